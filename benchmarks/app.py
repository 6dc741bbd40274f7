"""The benchmark's Celery app: one trivial task per implementation, all on Redis DBs 4-7.

The worker runs as ``celery -A benchmarks.app worker ...``; the producer imports the same module.
Every body increments a per-implementation counter, so the benchmark can count how often a body
really ran.
"""

from __future__ import annotations

import cProfile
import os
import time
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery.signals import worker_process_init, worker_process_shutdown, worker_ready
from celery_once import QueueOnce

from idempotent_tasks import IdempotentTask

#: Redis server without a DB number; override with ``BENCH_REDIS_URL``.
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379").rstrip("/")

# One DB per role, flushed before every measurement (the tests use DBs 3 and 8-15: never touch
# them).
BROKER_DB = 4
BACKEND_DB = 5
ONCE_DB = 6
#: IdempotentTask's claim store is left at its default, the result backend's Redis database: its
#: completions then write Celery's result records themselves (idempotent_tasks.celery_result).
STORE_DB = BACKEND_DB
COUNTER_DB = 7
BENCH_DBS = (BROKER_DB, BACKEND_DB, ONCE_DB, COUNTER_DB)

#: Set by the worker once it consumes; the runner waits for it before starting the producer.
READY_KEY = "bench:worker-ready"
#: Environment variable naming a folder: each pool process writes a cProfile dump there.
PROFILE_ENV = "BENCH_PROFILE_DIR"

IMPLEMENTATIONS = ("plain", "late", "bare3", "once", "idempotent", "twotrips")


def db_url(db: int) -> str:
    """URL of one of the benchmark's Redis DBs."""
    return f"{REDIS_URL}/{db}"


def runs_key(impl: str) -> str:
    """Counter of how many times the body of ``impl``'s task ran."""
    return f"bench:runs:{impl}"


app = Celery("benchmarks", broker=db_url(BROKER_DB), backend=db_url(BACKEND_DB))
app.conf.update(
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": db_url(ONCE_DB), "default_timeout": 3600},
    },
    broker_connection_retry_on_startup=True,
)

#: This process's client per DB, with the pid that made it.
_clients: dict[int, tuple[int, redis.Redis]] = {}


def _client(db: int) -> redis.Redis:
    """This process's client for one of the benchmark's DBs (a new one after a fork)."""
    pid = os.getpid()
    made = _clients.get(db)
    if made is None or made[0] != pid:
        made = _clients[db] = (pid, redis.Redis.from_url(db_url(db)))
    return made[1]


def counter_client() -> redis.Redis:
    """This process's client for the counter DB."""
    return _client(COUNTER_DB)


def store_db_client() -> redis.Redis:
    """This process's client for the store DB."""
    return _client(STORE_DB)


def expected_result(item: int) -> dict[str, Any]:
    """What every task returns for ``item``: small, JSON-friendly, deterministic."""
    return {"item": item, "square": item * item, "status": "ok"}


def _body(impl: str, item: int) -> dict[str, Any]:
    counter_client().incr(runs_key(impl))
    return expected_result(item)


@app.task(name="benchmarks.plain")
def plain_task(item: int) -> dict[str, Any]:
    """Plain Celery: every message runs the body."""
    return _body("plain", item)


@app.task(name="benchmarks.late", acks_late=True, reject_on_worker_lost=True)
def late_ack_task(item: int) -> dict[str, Any]:
    """Plain Celery acknowledging late, as ``IdempotentTask`` does so that a crash loses no
    message: what crash safety alone costs."""
    return _body("late", item)


def bare_round_trip_key(item: int) -> str:
    """What the ``bare3`` implementation reads and writes for ``item`` (in the store's DB)."""
    return f"bench:bare:{item}"


@app.task(name="benchmarks.bare3", acks_late=True, reject_on_worker_lost=True)
def bare_round_trips_task(item: int) -> dict[str, Any]:
    """Plain Celery plus what a crash-safe effectively-once task cannot do without, only that.

    Late acknowledgement (a worker that dies mid-task must not lose the message), one GET at
    publish (see ``benchmarks.produce``), one SET before and one after the body (the claim
    protocol's round trips): a store-backed effectively-once task cannot cost less, so its
    throughput is the ceiling ``IdempotentTask`` can reach on the machine.
    """
    client = store_db_client()
    client.set(bare_round_trip_key(item), "processing")
    value = _body("bare3", item)
    client.set(bare_round_trip_key(item), "completed")
    return value


@app.task(name="benchmarks.once", base=QueueOnce, once={"graceful": True})
def once_task(item: int) -> dict[str, Any]:
    """celery-once: a call whose arguments are already queued or running is dropped."""
    return _body("once", item)


@app.task(name="benchmarks.idempotent", base=IdempotentTask)
def idempotent_task(item: int) -> dict[str, Any]:
    """idempotent_tasks: the body runs at most once per idempotency key."""
    return _body("idempotent", item)


@app.task(name="benchmarks.twotrips", base=IdempotentTask)
def two_trips_task(item: int) -> dict[str, Any]:
    """idempotent_tasks published in two round trips (the reservation, then kombu's push), as
    with a broker apart from the store: the producer sets ``idempotency_publish_in_one_trip``
    off (see ``benchmarks.produce``)."""
    return _body("twotrips", item)


TASKS: dict[str, Any] = {
    "plain": plain_task,
    "late": late_ack_task,
    "bare3": bare_round_trips_task,
    "once": once_task,
    "idempotent": idempotent_task,
    "twotrips": two_trips_task,
}


@worker_ready.connect
def _announce_ready(**_: Any) -> None:
    """Tell the runner the worker (and its pool) is up and consuming."""
    counter_client().set(READY_KEY, os.getpid())


_profiler: cProfile.Profile | None = None


@worker_process_init.connect
def _start_profiling(**_: Any) -> None:
    """With ``BENCH_PROFILE_DIR`` set, profile each pool process's CPU time from its start."""
    global _profiler
    if os.environ.get(PROFILE_ENV):
        # CPU time, not wall time: on 2 shared cores, time spent waiting is someone else's CPU.
        _profiler = cProfile.Profile(time.process_time)
        _profiler.enable()


@worker_process_shutdown.connect
def _dump_profile(**_: Any) -> None:
    """Write this pool process's profile when it exits."""
    if _profiler is None:
        return
    _profiler.disable()
    folder = Path(os.environ[PROFILE_ENV])
    folder.mkdir(parents=True, exist_ok=True)
    _profiler.dump_stats(folder / f"worker-{os.getpid()}.pstats")
