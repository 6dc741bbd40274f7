"""What each store operation costs Redis, counted in instructions: steady where timings drift.

On a shared machine the time Redis spends on a command varies by a third from one minute to
the next; the instructions it executes do not. This starts a private ``redis-server`` under
valgrind's callgrind, runs each operation of a keyed task's life N times through the real
:class:`~idempotent_tasks.stores.redis.RedisStore`, and prints the instructions Redis executed
per call, less those of a PING (reading any command and answering it)::

    python -m benchmarks.redis_cost [--n 500]

For comparison, the same for what Celery's own Redis result backend makes Redis do to store a
result (``store_result``: a GET, then a SET and a PUBLISH), the work the completion takes over.
Needs ``valgrind`` (with ``callgrind_control``) and ``redis-server`` on ``PATH``.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
from celery import Celery, states
from celery.app.task import Context

from idempotent_tasks.celery_result import result_side_write
from idempotent_tasks.keys import fingerprint, storage_key
from idempotent_tasks.pickups import envelope
from idempotent_tasks.records import ClaimRequest, EncodedResult, Pickup
from idempotent_tasks.stores.redis import RedisStore

TASK_NAME = "benchmarks.idempotent"
#: Lease, completed-record ttl and re-publication timeout of every call (seconds).
LEASE, TTL, PICKUP_TIMEOUT = 300.0, 86400.0, 3600.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def counted_redis(folder: Path) -> Iterator[tuple[redis.Redis, Callable[[], int]]]:
    """A redis-server under callgrind; yields a client and ``take()``, which returns the
    instructions Redis executed since the previous ``take()`` (or its start)."""
    port = _free_port()
    server = subprocess.Popen(
        [
            *("valgrind", "--tool=callgrind", f"--callgrind-out-file={folder}/cg.%p"),
            *("redis-server", "--port", str(port), "--save", "", "--appendonly", "no"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server under valgrind did not start") from None
                time.sleep(0.2)

        def control(option: str) -> None:
            subprocess.run(
                ["callgrind_control", option, str(server.pid)],
                check=True,
                capture_output=True,
            )

        def take() -> int:
            for old in folder.glob(f"cg.{server.pid}.*"):
                old.unlink()
            control("--dump")
            [dump] = folder.glob(f"cg.{server.pid}.*")
            control("--zero")
            for line in dump.read_text().splitlines():
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
            raise RuntimeError(f"no instruction total in {dump}")

        control("--zero")
        yield client, take
    finally:
        client.close()
        server.terminate()
        server.wait(timeout=60)


def _request(i: int) -> ClaimRequest:
    key = f"distinct-{i}"
    return ClaimRequest(
        storage_key=storage_key(TASK_NAME, key),
        key=key,
        task_name=TASK_NAME,
        task_id=f"00000000-0000-4000-8000-{i:012d}",
        owner=f"owner-{i}",
        fingerprint=fingerprint(TASK_NAME, None, (i,), {}),
        lease_seconds=LEASE,
        ttl_seconds=TTL,
    )


def measure(n: int) -> dict[str, float]:
    """Redis instructions per call of each operation, less a PING's (``"ping"`` holds that)."""
    with tempfile.TemporaryDirectory() as folder, counted_redis(Path(folder)) as (client, take):
        port = client.connection_pool.connection_kwargs["port"]
        store = RedisStore(redis.Redis(port=port), prefix="idempotent_tasks")
        app = Celery("redis_cost", backend=f"redis://127.0.0.1:{port}/0")
        backend = app.backend
        requests = [_request(i) for i in range(n)]
        values = [{"item": i, "square": i * i, "status": "ok"} for i in range(n)]
        pickups = [
            Pickup(
                envelope=envelope((i,), {}, {}) or b"",
                due_in=PICKUP_TIMEOUT,
                timeout=PICKUP_TIMEOUT,
            )
            for i in range(n)
        ]
        # Loaded, connected and warmed up before counting.
        store.claim(_request(n))
        backend.store_result("warm-up", 0, states.SUCCESS)
        tokens: list[int] = []

        def per_call(run: Callable[[int], object]) -> float:
            take()
            for i in range(n):
                run(i)
            return take() / n

        ping = per_call(lambda _: client.ping())
        costs = {
            "reserve": per_call(lambda i: store.reserve(requests[i], pickups[i])),
            "claim": per_call(lambda i: tokens.append(store.claim(requests[i]).token)),
            "complete": per_call(
                lambda i: store.complete(
                    requests[i],
                    tokens[i],
                    EncodedResult(
                        content_type="application/json",
                        content_encoding="utf-8",
                        body=json.dumps(values[i]).encode(),
                    ),
                    result_side_write(
                        backend,
                        Context(id=requests[i].task_id, delivery_info={}, is_eager=False),
                        values[i],
                        max_bytes=1 << 20,
                    ),
                )
            ),
            "reserve_completed": per_call(lambda i: store.reserve(requests[i], pickups[i])),
            "celery_store_result": per_call(
                lambda i: backend.store_result(f"celery-{i}", values[i], states.SUCCESS)
            ),
        }
    return {"ping": ping} | {name: cost - ping for name, cost in costs.items()}


def table(costs: dict[str, float], n: int) -> str:
    """The figures as a markdown table."""
    per_task = costs["reserve"] + costs["claim"] + costs["complete"]
    rows = [
        ("reserve at publish (new key: queued record, due index)", costs["reserve"]),
        ("claim in the worker (queued -> processing, fencing token)", costs["claim"]),
        ("completion, writing Celery's result record too", costs["complete"]),
        ("IdempotentTask, per task (the three above)", per_task),
        ("Celery's store_result, which the completion replaces", costs["celery_store_result"]),
        (
            "reserve at publish of a completed key (the record read back)",
            costs["reserve_completed"],
        ),
    ]
    lines = [
        f"Redis instructions per call, N = {n}, less a PING's {costs['ping']:,.0f}:",
        "",
        "| operation | instructions | vs Celery's store_result |",
        "|---|---:|---:|",
    ]
    for name, cost in rows:
        lines.append(f"| {name} | {cost:,.0f} | {cost / costs['celery_store_result']:.1f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500, help="calls per operation")
    args = parser.parse_args(argv)
    print(table(measure(args.n), args.n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
