"""The chaos run's Celery app: keyed tasks that write every body start and end to the ledger.

Configured from the environment that ``chaos.run`` sets (names in :mod:`chaos`): the run's own
Redis as broker, result backend and (for ``--store redis``) claim store, its own PostgreSQL for
the dead-letter table (and the claim store for ``--store postgresql``), the ledger file, a short
lease and a visibility timeout shorter than the slow tasks.

Ledger events written here (one per line of what a worker did):

- ``start`` / ``finish`` / ``fail``: a body began, returned (with its value), or raised.
- ``completed``: the task returned and its completion was not refused, so the key's result is
  this execution's (written from Celery's ``task_success`` signal, after the product stored it).
- ``refused`` / ``lease_lost``: the product's signals: a stale owner's completion was refused, a
  heartbeat found its claim taken over.
- ``republished``: the dead-letter sweep re-published a row (from ``after_task_publish``).
- ``pickup_republished``: the pickup guard published a message no worker had claimed in time.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from celery import Celery, current_task
from celery.signals import after_task_publish, task_prerun, task_success

from chaos import (
    DLQ_BASE_DELAY_S,
    DLQ_MAX_RETRIES,
    DLQ_POLL_INTERVAL_S,
    DLQ_RETRYING_TIMEOUT_S,
    ENV_BACKEND_URL,
    ENV_BROKER_URL,
    ENV_DLQ_URL,
    ENV_LEASE,
    ENV_LEDGER,
    ENV_STORE_URL,
    ENV_VISIBILITY_TIMEOUT,
    LEASE_S,
    VISIBILITY_TIMEOUT_S,
)
from chaos.ledger import Ledger
from idempotent_tasks import IdempotentTask, signals
from idempotent_tasks.dead_letters import DEAD_LETTER_HEADER, SWEEP_TASK
from idempotent_tasks.dlq import DeadLetterQueue
from idempotent_tasks.errors import StoreUnavailable
from idempotent_tasks.pickups import REPUBLISHED_HEADER

KEY_HEADER = "idempotency_key"
#: Seconds between the tries of a flaky task, and of the first retry of a doomed one.
RETRY_DELAY_S = 0.3

app = Celery(
    "chaos",
    broker=os.environ.get(ENV_BROKER_URL, "redis://127.0.0.1:6379/0"),
    backend=os.environ.get(ENV_BACKEND_URL, "redis://127.0.0.1:6379/1"),
)
app.conf.update(
    idempotency_store_url=os.environ.get(ENV_STORE_URL, "redis://127.0.0.1:6379/1"),
    idempotency_dlq_url=os.environ.get(ENV_DLQ_URL),
    idempotency_lease=float(os.environ.get(ENV_LEASE, LEASE_S)),
    idempotency_dlq_base_delay=DLQ_BASE_DELAY_S,
    idempotency_dlq_max_retries=DLQ_MAX_RETRIES,
    idempotency_dlq_poll_interval=DLQ_POLL_INTERVAL_S,
    idempotency_dlq_retrying_timeout=DLQ_RETRYING_TIMEOUT_S,
    idempotency_dlq_write_retry_delay=1.0,
    broker_transport_options={
        "visibility_timeout": float(os.environ.get(ENV_VISIBILITY_TIMEOUT, VISIBILITY_TIMEOUT_S)),
        # Hand out unacknowledged messages again within a second of their timeout (kombu's
        # default sweeps every ~100 s).
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # The lock a restore sweep holds: a worker SIGKILLed while holding it blocks every
        # restore until it expires (kombu's default: 300 s, which stalls the whole run).
        "unacked_mutex_expire": 10,
    },
    # Keep storing a task's result while the result backend (the run's Redis) restarts:
    # Celery's default gives up at once and the caller sees ConnectionError instead.
    result_backend_always_retry=True,
    result_backend_max_retries=60,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    worker_prefetch_multiplier=1,
    worker_cancel_long_running_tasks_on_connection_loss=False,
    beat_max_loop_interval=1,
    task_default_retry_delay=RETRY_DELAY_S,
)

ledger = Ledger(os.environ.get(ENV_LEDGER, "chaos-ledger.sqlite3"))


class FlakyError(Exception):
    """A transient failure: the task retries it (``autoretry_for``)."""


@dataclass
class _Running:
    """The body execution this pool process is in (prefork runs one task at a time)."""

    exec_id: str
    key: str
    task_id: str
    finished: bool = False
    refused: bool = False


_running: _Running | None = None
_dlq: tuple[int, DeadLetterQueue] | None = None


def dead_letters() -> DeadLetterQueue:
    """This process's handle on the dead-letter table (opened anew after a fork)."""
    global _dlq
    if _dlq is None or _dlq[0] != os.getpid():
        _dlq = (os.getpid(), DeadLetterQueue(app.conf.idempotency_dlq_url))
    return _dlq[1]


def _header(request: Any, name: str) -> Any:
    """A custom message header: Celery makes it a request attribute (else in ``headers``)."""
    value = getattr(request, name, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(name)
    return value


def _row_state(row_id: str) -> tuple[int | None, str | None]:
    """A dead-letter row's retry_count and status, or ``(None, None)`` if unreadable."""
    try:
        item = dead_letters().get(row_id)
    except StoreUnavailable:
        return None, None
    if item is None:
        return None, None
    return item.retry_count, item.status.value


def _begin(task: Any, key: str, kind: str) -> str:
    """Record a body start; returns the execution's id."""
    global _running
    request = task.request
    exec_id = uuid.uuid4().hex
    row_id = _header(request, DEAD_LETTER_HEADER)
    row_retry, _status = _row_state(row_id) if row_id else (None, None)
    ledger.write(
        "start",
        key=key,
        exec_id=exec_id,
        kind=kind,
        task_id=request.id,
        retries=request.retries,
        ppid=os.getppid(),
        worker=request.hostname,
        redelivered=bool((request.delivery_info or {}).get("redelivered")),
        dead_letter_id=row_id,
        dead_letter_retry=row_retry,
    )
    _running = _Running(exec_id=exec_id, key=key, task_id=request.id)
    return exec_id


def _end(exec_id: str, key: str, kind: str, **data: Any) -> None:
    """Record how a body ended (``finish`` with its value, or ``fail``)."""
    ledger.write(kind, key=key, exec_id=exec_id, **data)
    if _running is not None and _running.exec_id == exec_id and kind == "finish":
        _running.finished = True


@app.task(  # type: ignore[untyped-decorator]
    name="chaos.work",
    base=IdempotentTask,
    bind=True,
    autoretry_for=(FlakyError,),
    max_retries=4,
    default_retry_delay=RETRY_DELAY_S,
)
def work(self: Any, key: str, kind: str, seconds: float, failures: int) -> dict[str, Any]:
    """A keyed unit of work: fails ``failures`` times in all (flaky), sleeps ``seconds``.

    Returns a value unique to this execution, so callers who got another execution's value
    show up in the audit.
    """
    exec_id = _begin(self, key, kind)
    if failures and ledger.count(key, "fail") < failures:
        _end(exec_id, key, "fail", error="FlakyError")
        raise FlakyError(f"{key} fails this time")
    time.sleep(seconds)
    value = {"key": key, "exec": exec_id, "pid": os.getpid()}
    _end(exec_id, key, "finish", value=value)
    return value


@app.task(  # type: ignore[untyped-decorator]
    name="chaos.doomed",
    base=IdempotentTask,
    bind=True,
    autoretry_for=(FlakyError,),
    max_retries=1,
    default_retry_delay=RETRY_DELAY_S,
)
def doomed(self: Any, key: str) -> None:
    """Fails every time: its retries run out, it is dead-lettered, and the sweep retries it."""
    exec_id = _begin(self, key, "doomed")
    _end(exec_id, key, "fail", error="FlakyError")
    raise FlakyError(f"{key} always fails")


@task_prerun.connect(weak=False)  # type: ignore[untyped-decorator]
def _forget_running(**_: Any) -> None:
    """A new task starts in this process: nothing of the previous one carries over."""
    global _running
    _running = None


@task_success.connect(weak=False)  # type: ignore[untyped-decorator]
def _record_completion(sender: Any = None, result: Any = None, **_: Any) -> None:
    """The task returned: if its body ran here and was not refused, the key completed here."""
    global _running
    running = _running
    if running is None or sender is None or sender.request.id != running.task_id:
        return
    if running.finished and not running.refused:
        ledger.write("completed", key=running.key, exec_id=running.exec_id, value=result)
    _running = None


@signals.stale_complete_refused.connect
def _record_refusal(task_name: str = "", key: str = "", **_: Any) -> None:
    """The product refused this (stale) owner's completion."""
    running = _running
    exec_id = None
    if running is not None and running.key == key:
        running.refused = True
        exec_id = running.exec_id
    ledger.write("refused", key=key, exec_id=exec_id, task_name=task_name)


@signals.lease_lost.connect
def _record_lease_lost(task_name: str = "", key: str = "", **_: Any) -> None:
    """A heartbeat (in the keeper thread) found this process's claim taken over."""
    running = _running
    exec_id = running.exec_id if running is not None and running.key == key else None
    ledger.write("lease_lost", key=key, exec_id=exec_id, task_name=task_name)


@after_task_publish.connect(weak=False)  # type: ignore[untyped-decorator]
def _record_republication(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """The dead-letter sweep re-published a row: one ledger entry per re-publication. The
    pickup guard's re-publications (same sweep task) are recorded apart."""
    headers = headers or {}
    if headers.get(REPUBLISHED_HEADER) is not None:
        ledger.write(
            "pickup_republished",
            key=headers.get(KEY_HEADER),
            task_id=headers.get("id"),
            times=headers[REPUBLISHED_HEADER],
        )
        return
    row_id = headers.get(DEAD_LETTER_HEADER)
    if row_id is None or getattr(current_task, "name", None) != SWEEP_TASK:
        return
    retry_count, status = _row_state(row_id)
    ledger.write(
        "republished",
        key=headers.get(KEY_HEADER),
        row=row_id,
        retry_count=retry_count,
        row_status=status,
        sweep=current_task.request.id,
        task_id=headers.get("id"),
    )
