"""The Celery app the integration tests' worker processes run.

Configured from the environment so each test session picks its own Redis databases:
IT_BROKER_URL, IT_BACKEND_URL, IT_STORE_URL, IT_LEDGER_URL. Task bodies record every start and
finish in a ledger (a Redis list per key, apart from the product's store) so tests can count
how often a body really ran.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime
from decimal import Decimal
from typing import Any

import redis
from celery import Celery
from celery.exceptions import MaxRetriesExceededError
from pydantic import BaseModel

from idempotent_tasks import IdempotentTask

app = Celery(
    "it",
    broker=os.environ.get("IT_BROKER_URL", "redis://127.0.0.1:6379/10"),
    backend=os.environ.get("IT_BACKEND_URL", "redis://127.0.0.1:6379/11"),
)
app.conf.update(
    idempotency_store_url=os.environ.get("IT_STORE_URL", "redis://127.0.0.1:6379/11"),
    idempotency_lease=float(os.environ.get("IT_LEASE", "300")),
    idempotency_ttl=float(os.environ.get("IT_TTL", "86400")),
    idempotency_pickup_timeout=float(os.environ.get("IT_PICKUP_TIMEOUT", "3600")),
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("IT_VISIBILITY_TIMEOUT", "3600")),
        # Sweep for unacknowledged messages every second (kombu's default: ~100 s).
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    worker_prefetch_multiplier=1,
    task_default_retry_delay=0.2,
    broker_connection_retry_on_startup=True,
    idempotency_dlq_url=os.environ.get(
        "IT_DLQ_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/it_dead_letters"
    ),
    idempotency_dlq_base_delay=float(os.environ.get("IT_DLQ_BASE_DELAY", "0.5")),
    idempotency_dlq_poll_interval=float(os.environ.get("IT_DLQ_POLL_INTERVAL", "1")),
    idempotency_dlq_write_retry_delay=float(os.environ.get("IT_DLQ_WRITE_RETRY_DELAY", "1")),
    idempotency_dlq_retrying_timeout=float(os.environ.get("IT_DLQ_RETRYING_TIMEOUT", "3600")),
    beat_max_loop_interval=1,
)

ledger = redis.Redis.from_url(os.environ.get("IT_LEDGER_URL", "redis://127.0.0.1:6379/13"))


def note(event: str, name: str) -> int:
    """Append ``event`` to the ledger of ``name``; returns how many entries it now has."""
    return int(ledger.rpush(f"ledger:{name}", f"{event}:{os.getpid()}:{time.time()}"))


@app.task(base=IdempotentTask, bind=True)
def charge(self: Any, order_id: str, amount: int, sleep: float = 0.0) -> dict[str, Any]:
    """Records a charge; sleeps to widen the window in which duplicates race."""
    note("start", order_id)
    time.sleep(sleep)
    note("finish", order_id)
    return {"order_id": order_id, "amount": amount, "pid": os.getpid(), "task_id": self.request.id}


@app.task(
    base=IdempotentTask,
    bind=True,
    autoretry_for=(TimeoutError,),
    max_retries=5,
    default_retry_delay=0.1,
)
def flaky(self: Any, name: str, failures: int) -> str:
    """Fails with TimeoutError ``failures`` times (counted in the ledger), then succeeds."""
    runs = note("start", name)
    if runs <= failures:
        raise TimeoutError(f"attempt {runs} of {name} timed out")
    note("finish", name)
    return f"{name} ok after {runs} runs"


@app.task(base=IdempotentTask, bind=True, max_retries=5)
def manual_retry(self: Any, name: str, failures: int) -> str:
    """Calls self.retry() ``failures`` times, then succeeds."""
    runs = note("start", name)
    if runs <= failures:
        raise self.retry(countdown=0.1)
    note("finish", name)
    return f"{name} ok after {runs} runs"


@app.task(
    base=IdempotentTask,
    bind=True,
    autoretry_for=(TimeoutError,),
    max_retries=1,
    default_retry_delay=0.1,
)
def always_fails(self: Any, name: str) -> None:
    """Never succeeds: exhausts its retries."""
    note("start", name)
    raise TimeoutError(f"{name} always times out")


@app.task(base=IdempotentTask, on_duplicate="skip")
def skipping(name: str, sleep: float) -> str:
    note("start", name)
    time.sleep(sleep)
    return name


@app.task(base=IdempotentTask, on_duplicate="raise")
def raising(name: str, sleep: float) -> str:
    note("start", name)
    time.sleep(sleep)
    return name


class Order(BaseModel):
    """A pydantic model a ``pydantic=True`` task takes."""

    id: int
    amount: int


@app.task(base=IdempotentTask, pydantic=True, idempotency_key="order-model:{order.id}")
def charge_order(order: Order) -> int:
    """A pydantic=True task keyed by its model's field: Celery sends the model dumped."""
    note("start", f"order-model-{order.id}")
    return order.amount


@app.task(base=IdempotentTask, idempotency_key="order:{order_id}")
def templated(order_id: int, amount: int = 0) -> int:
    note("start", f"templated-{order_id}")
    return amount


@app.task
def plain(x: int) -> int:
    return x


@app.task(
    base=IdempotentTask,
    bind=True,
    autoretry_for=(TimeoutError,),
    max_retries=2,
    default_retry_delay=2.0,
)
def slow_retry(self: Any, name: str) -> str:
    """Fails once, retried after 2 s: the gap in which the key must be free."""
    runs = note("start", name)
    if runs == 1:
        raise TimeoutError("first attempt times out")
    return f"{name} ok"


@app.task(base=IdempotentTask, bind=True, max_retries=2)
def retried_later(self: Any, name: str) -> str:
    """Fails on a run that counts no retries, retried 5 s later."""
    note("start", name)
    if self.request.retries == 0:
        raise self.retry(countdown=5.0)
    return f"{name} ok after {self.request.retries} retries"


@app.task(base=IdempotentTask, max_retries=0)
def no_retries(name: str, sleep: float) -> str:
    """Allows no retries at all, so a waiting duplicate must not spend any."""
    note("start", name)
    time.sleep(sleep)
    return f"{name} done"


@app.task(base=IdempotentTask, bind=True, default_retry_delay=0.2)
def slow_first(self: Any, name: str, sleep: float) -> dict[str, Any]:
    """Sleeps only in its first run (the one a test crashes, pauses or outlives)."""
    runs = note("start", name)
    if runs == 1:
        time.sleep(sleep)
    note("finish", name)
    return {"name": name, "run": runs, "pid": os.getpid()}


@app.task(base=IdempotentTask, max_retries=1, default_retry_delay=0.2)
def dies(name: str) -> None:
    """Kills its own pool process, every run (as the OOM killer would)."""
    note("start", name)
    os.kill(os.getpid(), signal.SIGKILL)


@app.task(base=IdempotentTask, max_retries=1, default_retry_delay=0.2)
def exits(name: str) -> None:
    """Ends its pool process with SystemExit, every run (a library calling sys.exit)."""
    note("start", name)
    raise SystemExit(f"{name} exits")


@app.task(
    base=IdempotentTask,
    bind=True,
    autoretry_for=(TimeoutError,),
    max_retries=3,
    default_retry_delay=0.1,
)
def slow_first_then_flaky(self: Any, name: str, sleep: float) -> dict[str, Any]:
    """Sleeps in its first run, fails its second (retried), succeeds from its third."""
    runs = note("start", name)
    if runs == 1:
        time.sleep(sleep)
    if runs == 2:
        raise TimeoutError(f"run {runs} of {name} timed out")
    note("finish", name)
    return {"name": name, "run": runs}


@app.task(base=IdempotentTask, idempotency_key_required=True)
def must_have_key(name: str) -> str:
    note("start", name)
    return name


@app.task(
    base=IdempotentTask,
    bind=True,
    idempotency_key_required=True,
    autoretry_for=(TimeoutError,),
    max_retries=3,
    default_retry_delay=0.1,
)
def must_have_key_flaky(self: Any, name: str) -> int:
    """Requires a key; its first run fails with TimeoutError; returns its retry count."""
    if note("start", name) == 1:
        raise TimeoutError(f"{name} timed out")
    return int(self.request.retries)


@app.task(base=IdempotentTask, idempotency_validate=False)
def unvalidated(name: str, amount: int) -> int:
    note("start", name)
    return amount


@app.task(base=IdempotentTask)
def big_result(name: str, size: int) -> str:
    """Returns ``size`` characters: over idempotency_result_max_bytes it is not cached."""
    note("start", name)
    return "x" * size


@app.task(
    base=IdempotentTask, autoretry_for=(TimeoutError,), max_retries=1, default_retry_delay=0.1
)
def recovers_after(name: str, failures: int) -> str:
    """Fails ``failures`` times in all (across dead-letter retries), then succeeds."""
    runs = note("start", name)
    if runs <= failures:
        raise TimeoutError(f"run {runs} of {name} timed out")
    return f"{name} recovered on run {runs}"


@app.task(base=IdempotentTask, dlq_max_retries=1)
def dated(name: str, when: datetime, amount: Decimal) -> str:
    """Fails on its first run; then tells the types of the values it was given."""
    if note("start", name) == 1:
        raise RuntimeError(f"{name} fails once")
    return f"{type(when).__name__} {when.isoformat()} {type(amount).__name__} {amount}"


@app.task(base=IdempotentTask, bind=True, max_retries=5, default_retry_delay=0.1)
def paged(self: Any, name: str, page: int) -> int:
    """Retries itself with the next page (other arguments, same call) until page 3."""
    note("start", name)
    if page < 3:
        raise self.retry(args=(name, page + 1))
    return page


@app.task(
    base=IdempotentTask,
    bind=True,
    max_retries=5,
    default_retry_delay=0.1,
    idempotency_key="paged:{name}:{page}",
)
def paged_by_template(self: Any, name: str, page: int) -> int:
    """:func:`paged` under the key its template derives from the first call's page."""
    note("start", name)
    if page < 3:
        raise self.retry(args=(name, page + 1))
    return page


@app.task(base=IdempotentTask)
def summed(n: int) -> int:
    """1 + 2 + ... + n, calling itself as a plain function (not as a message)."""
    return 0 if n == 0 else n + summed(n - 1)


@app.task(base=IdempotentTask, dlq=False)
def fails_without_dlq(name: str) -> None:
    note("start", name)
    raise RuntimeError(f"{name} fails, and is not dead-lettered")


@app.task(base=IdempotentTask, dlq_max_retries=1)
def fails_forever(name: str) -> None:
    """Fails every time, with one dead-letter retry allowed."""
    note("start", name)
    raise RuntimeError(f"{name} fails every time")


@app.task(base=IdempotentTask)
def ledgered(name: str) -> str:
    """Just records that it ran."""
    note("start", name)
    return name


@app.task(base=IdempotentTask, dlq_max_retries=0)
def fails_once_and_for_all(name: str, amount: int = 0) -> None:
    """Fails; its dead letter allows no retries, so the row stays as written."""
    note("start", name)
    raise RuntimeError(f"{name} fails for good")


@app.task(base=IdempotentTask, bind=True, max_retries=3)
def retries_into_the_void(self: Any, name: str) -> str:
    """Its first run retries into a queue no worker reads (its retry message stays there)."""
    if note("start", name) == 1:
        raise self.retry(queue="nowhere", countdown=0)
    return f"{name} done"


@app.task(base=IdempotentTask, bind=True, max_retries=0)
def falls_back(self: Any, name: str, sleep: float) -> str:
    """Allows no retries: its retry raises MaxRetriesExceededError, which it catches to do
    fallback work for ``sleep`` seconds."""
    note("start", name)
    try:
        raise self.retry(countdown=0)
    except MaxRetriesExceededError:
        note("fallback", name)
        time.sleep(sleep)
    return f"{name} fell back"


# store_errors_even_if_ignored: a message sent with ignore_result still stores its errors.
@app.task(base=IdempotentTask, time_limit=1, dlq_max_retries=0, store_errors_even_if_ignored=True)
def overruns(name: str, sleep: float) -> str:
    """Killed by its hard time limit when ``sleep`` is over a second (it has no soft one)."""
    note("start", name)
    time.sleep(sleep)
    note("finish", name)
    return name


@app.task(base=IdempotentTask, soft_time_limit=3, time_limit=30, dlq_max_retries=0)
def near_its_soft_limit(name: str, sleep: float, fail: bool = False) -> str:
    """Records its start, then after ``sleep`` s returns ``name`` (or fails with ValueError);
    its soft time limit is 3 s."""
    note("start", name)
    time.sleep(sleep)
    if fail:
        raise ValueError(f"{name} failed")
    return name


@app.task(base=IdempotentTask, time_limit=8)
def near_its_time_limit(name: str, sleep: float) -> str:
    """Records its start and returns ``name`` after ``sleep`` s; its hard time limit is 8 s."""
    note("start", name)
    time.sleep(sleep)
    return name


@app.task(base=IdempotentTask)
def under_the_workers_time_limit(name: str, sleep: float) -> str:
    """:func:`near_its_time_limit` with no time limit of its own (the worker's applies)."""
    note("start", name)
    time.sleep(sleep)
    return name


@app.task
def noted_errback(request: Any, exc: Any, traceback: Any, name: str) -> None:
    """An errback (Celery's new style): records in the ledger of ``name`` that it ran."""
    note("errback", name)


@app.task(bind=True)
def replaced_by_ledgered(self: Any, name: str, key: str) -> None:
    """Replaces itself with ``ledgered(name)`` under ``key`` (Celery's ``Task.replace``)."""
    raise self.replace(ledgered.si(name).set(idempotency_key=key))


@app.task(base=IdempotentTask, bind=True)
def replaces_itself(self: Any, name: str, sleep: float = 0.0) -> None:
    """Does its work, then hands over to a plain task that sleeps ``sleep`` s and returns
    ``len(name)`` (Celery's ``Task.replace``)."""
    note("start", name)
    raise self.replace(slept.si(len(name), sleep))


@app.task
def slept(x: int, sleep: float) -> int:
    time.sleep(sleep)
    return x


@app.task(base=IdempotentTask, bind=True, idempotency_key="countdown:{name}")
def counts_down(self: Any, name: str, left: int) -> str:
    """Replaces itself with itself, ``left`` times (a polling loop), under one derived key."""
    note("start", name)
    if left > 0:
        raise self.replace(counts_down.si(name, left - 1))
    return name


@app.task(base=IdempotentTask, bind=True)
def polls(self: Any, name: str, left: int, every: float) -> str:
    """Replaces itself with itself ``left`` times, ``every`` seconds apart (a polling loop)."""
    note("start", name)
    if left > 0:
        raise self.replace(polls.si(name, left - 1, every).set(countdown=every))
    return name


@app.task(base=IdempotentTask, bind=True)
def rekeys_itself(self: Any, name: str, left: int) -> str:
    """Replaces itself with itself ``left`` times, each replacement under a key of its own."""
    note("start", name)
    if left > 0:
        raise self.replace(self.si(name, left - 1).set(idempotency_key=f"{name}-{left - 1}"))
    return name


@app.task
def noted_callback(value: Any, name: str) -> None:
    """A link: records in the ledger of ``name`` that it ran."""
    note("callback", name)


@app.task(
    base=IdempotentTask,
    time_limit=1,
    acks_on_timeout=False,
)
def overruns_once(name: str) -> str:
    """Its first run is killed at its hard time limit; Celery hands the message back to the
    broker (acks on timeout off), and the run after that finishes."""
    if note("start", name) == 1:
        time.sleep(30)
    note("finish", name)
    return name
