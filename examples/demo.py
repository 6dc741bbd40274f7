"""Effectively-once Celery tasks in one process, with no servers: ``make demo``.

Starts a Celery worker (threads) inside this process on the in-memory app of ``shop.py`` and
shows, with values computed as it runs:

1. duplicates suppressed: one charge sent several times at once under one key runs once, and
   every caller gets the same charge;
2. later duplicates answered from the cache at publish time: nothing is published and the
   result's id is the original task id;
3. a flaky task retried safely: each failed attempt releases its claim, the retry claims the
   key afresh, and the body runs to success once;
4. dead letters: a task that fails for good lands in the dead-letter table (an SQLite file in
   a temporary folder), and the sweep task ``idempotent_tasks.retry_dead_letters`` (which beat
   sends every ``idempotency_dlq_poll_interval``; the demo sends it by hand) re-publishes it until
   it succeeds, then its key answers from the cache, or it ends ``permanent_failure``.

Prints ``OK`` and exits 0 when every guarantee shown held; prints ``FAILED: ...`` lines and
exits 1 otherwise.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from celery import states
from celery.contrib.testing.worker import start_worker
from celery.result import AsyncResult
from celery.signals import after_task_publish
from shop import (
    COURIER_OUTAGE,
    RECEIPT_TIMEOUTS,
    app,
    book_courier,
    charge,
    ledger,
    notify_warehouse,
    send_receipt,
)

from idempotent_tasks import signals
from idempotent_tasks.dlq import DeadLetter, DeadLetterQueue, DeadLetterStatus

#: Seconds to wait for any one result before declaring the demo failed.
RESULT_TIMEOUT = 15.0
#: Seconds between looks at a result in scene 4 (Celery's default half second adds up there).
POLL = 0.02
#: Threads of the in-process worker: enough for duplicates to run side by side.
WORKER_THREADS = 4
#: Environment variables through which Celery would leave memory for a server.
SERVER_VARIABLES = ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "TEST_BROKER")
#: The sweep task that re-publishes due dead letters.
SWEEP_TASK = "idempotent_tasks.retry_dead_letters"
#: Tasks of scene 4, which fail on purpose: their error logs would only repeat what it prints.
FAILING_ON_PURPOSE = (notify_warehouse.name, book_courier.name)


class Tally:
    """Thread-safe counts of what happened, fed by Celery's and idempotent_tasks' signals."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, ...]] = Counter()

    def add(self, *event: str) -> None:
        """Count one ``event``, e.g. ``("claim", "shop.charge", "acquired")``."""
        with self._lock:
            self._counts[event] += 1

    def __getitem__(self, event: tuple[str, ...]) -> int:
        with self._lock:
            return self._counts[event]

    def connect(self) -> None:
        """Subscribe to the signals counted here."""
        after_task_publish.connect(self._on_publish, weak=False)
        signals.claim_finished.connect(self._on_claim)
        signals.duplicate_suppressed.connect(self._on_duplicate)

    def _on_publish(self, sender: str | None = None, **_: Any) -> None:
        # Only the callers' publishes: waiting duplicates and retries re-publish from the worker.
        if threading.current_thread() is threading.main_thread():
            self.add("published", str(sender))

    def _on_claim(self, task_name: str, outcome: Any, takeover: bool, **_: Any) -> None:
        self.add("claim", task_name, str(outcome.value))
        if takeover:
            self.add("takeover", task_name)

    def _on_duplicate(self, task_name: str, where: str, outcome: Any, **_: Any) -> None:
        self.add("suppressed", task_name, where, str(outcome.value))


class Checks:
    """The guarantees the demo shows, checked as it goes."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def expect(self, condition: bool, failure: str) -> bool:
        """Record ``failure`` unless ``condition`` holds; returns ``condition``."""
        if not condition:
            self.failures.append(failure)
        return condition


def _times(count: int) -> str:
    return f"{count} time" if count == 1 else f"{count} times"


def duplicates(tally: Tally, checks: Checks) -> dict[str, Any]:
    """Scenes 1 and 2: the same charge sent at once, then again once it finished.

    Returns:
        The one charge the gateway made.
    """
    key, concurrent = "order-42", 3
    print(f'1. charge(42, 990) sent {concurrent} times at once with idempotency_key="{key}"')
    published = tally["published", charge.name]
    results = [charge.apply_async((42, 990), idempotency_key=key) for _ in range(concurrent)]
    values = [result.get(timeout=RESULT_TIMEOUT) for result in results]
    published = tally["published", charge.name] - published
    made = ledger.charges_of(42)
    owner_id, charged = made[0] if made else ("?", None)
    at_publish = tally["suppressed", charge.name, "publish", "in_progress"]
    in_worker = tally["suppressed", charge.name, "worker", "completed"]
    how = [f"{published} published"]
    if at_publish:
        how.append(f"{at_publish} got the owner's result at publish time")
    if in_worker:
        how.append(f"{in_worker} waited in the worker and took the owner's cached value")
    print(f"   body ran {_times(len(made))}; {', '.join(how)}")
    print(f"   every caller got {values[0]}")
    checks.expect(len(made) == 1, f"charge body ran {_times(len(made))} for one key")
    checks.expect(
        all(value == charged for value in values), f"callers got different values: {values}"
    )
    checks.expect(
        published + at_publish == concurrent and in_worker == published - 1,
        f"{concurrent} calls: {published} published, {at_publish} answered at publish, "
        f"{in_worker} answered in the worker",
    )

    print("2. sent twice more once it finished: apply_async, .s().set(idempotency_key=...).delay()")
    published = tally["published", charge.name]
    later = [
        charge.apply_async((42, 990), idempotency_key=key),
        charge.s(42, 990).set(idempotency_key=key).delay(),
    ]
    later_values = [result.get(timeout=RESULT_TIMEOUT) for result in later]
    published = tally["published", charge.name] - published
    same_ids = all(result.id == owner_id for result in later)
    cached = all(value == charged for value in later_values)
    print(
        f"   {published} published, body ran {_times(len(ledger.charges_of(42)))} in all; "
        f"both returned {'the cached value' if cached else 'OTHER values'}"
    )
    print(f"   their result .id is {'' if same_ids else 'NOT '}the original task id: {owner_id}")
    checks.expect(published == 0, f"{published} messages published for a completed key")
    checks.expect(
        same_ids, f"result ids {[r.id for r in later]} are not the original task id {owner_id}"
    )
    checks.expect(cached, f"later callers got {later_values}, not {charged}")
    checks.expect(len(ledger.charges_of(42)) == 1, "a later duplicate ran the charge body again")
    return dict(charged or {})


def flaky_retries(tally: Tally, checks: Checks) -> None:
    """Scene 3: a task that times out twice, retried safely, then called again."""
    name, email = send_receipt.name, "ada@example.com"
    print(
        f'3. send_receipt(42, "{email}"): flaky, keyed per task by "{send_receipt.idempotency_key}"'
    )
    first = send_receipt.delay(42, email)
    value = first.get(timeout=RESULT_TIMEOUT)
    attempts = ledger.receipts_of(42)
    claims = tally["claim", name, "acquired"]
    takeovers = tally["takeover", name]
    released = "released before each retry" if takeovers == 0 else "NOT always released"
    print(
        f"   attempts: {', '.join(attempts)}; key claimed {_times(claims)}, "
        f"{released} ({takeovers} takeovers)"
    )
    print(f"   result: {value!r}")
    expected = ["TimeoutError"] * RECEIPT_TIMEOUTS + ["sent"]
    checks.expect(attempts == expected, f"send_receipt attempts {attempts}, expected {expected}")
    checks.expect(
        claims == len(expected) and takeovers == 0,
        f"send_receipt claimed {_times(claims)} with {takeovers} takeovers",
    )

    published = tally["published", name]
    again = send_receipt.delay(42, email)
    again_value = again.get(timeout=RESULT_TIMEOUT)
    published = tally["published", name] - published
    starts = ledger.receipt_starts[42]
    same = again_value == value and again.id == first.id
    print(
        f"   sent again: {published} published, {'same' if same else 'OTHER'} task id and value; "
        f"body started {_times(starts)} in all"
    )
    checks.expect(published == 0, f"{published} receipts published for a completed key")
    checks.expect(
        same,
        f"the second receipt call got {again.id}={again_value!r}, not {first.id}={value!r}",
    )
    checks.expect(starts == len(expected), f"send_receipt body started {_times(starts)}")


def _wait_for(found: Callable[[], Any], what: str) -> Any:
    """Poll ``found`` until it returns something truthy; raise TimeoutError after a while."""
    deadline = time.monotonic() + RESULT_TIMEOUT
    while not (value := found()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {RESULT_TIMEOUT:.0f}s for {what}")
        time.sleep(POLL)
    return value


def _succeeded(result: AsyncResult) -> AsyncResult | None:
    """``result`` if its task succeeded, else ``None`` (for :func:`_wait_for`)."""
    return result if result.state == states.SUCCESS else None


def _state(item: DeadLetter) -> str:
    return f"{item.status.value}, retry {item.retry_count}/{item.max_retries}"


class Sweeps:
    """Sends the sweep task as beat would, once the dead letter it is for is due."""

    def __init__(self, queue: DeadLetterQueue) -> None:
        self.queue = queue
        self.sent = 0

    def dead_letter_of(self, task_name: str, task_id: str) -> DeadLetter | None:
        """The row a failed task left, if any."""
        rows = [row for row in self.queue.items(task_name=task_name) if row.task_id == task_id]
        return rows[0] if rows else None

    def sweep(self, item: DeadLetter) -> tuple[int, DeadLetter]:
        """Sweep once ``item`` is due; returns how many were re-published, and ``item`` once
        its re-published task has run (no longer ``retrying``)."""
        if item.next_retry_at is not None:
            time.sleep(max((item.next_retry_at - datetime.now(timezone.utc)).total_seconds(), 0))
        self.sent += 1
        published = int(app.send_task(SWEEP_TASK).get(timeout=RESULT_TIMEOUT, interval=POLL))
        settled = _wait_for(
            lambda: (
                (row := self.queue.get(item.id))
                and row.status is not DeadLetterStatus.RETRYING
                and row
            ),
            f"dead letter {item.id} to leave retrying",
        )
        return published, settled


def dead_letters(tally: Tally, checks: Checks) -> list[DeadLetter]:
    """Scene 4: a task that fails for good every time, then one that recovers on a dead-letter
    retry; the sweep is sent by hand where beat would send it.

    Returns:
        The two dead letters, as they ended.
    """
    queue = DeadLetterQueue(str(app.conf.idempotency_dlq_url))
    every = app.conf.beat_schedule.get(SWEEP_TASK, {}).get("schedule")
    print(f"4. dead letters, kept in {queue.url}")
    print(f"   retried by the task {SWEEP_TASK}: beat sends it every {every}s, here the demo does")
    checks.expect(every is not None, f"no beat entry sends {SWEEP_TASK}")
    sweeps = Sweeps(queue)
    try:
        given_up = _failing_for_good(sweeps, checks)
        recovered = _recovering(sweeps, tally, checks)
    finally:
        queue.dispose()
    return [item for item in (given_up, recovered) if item is not None]


def _landed(sweeps: Sweeps, checks: Checks, name: str, task_id: str) -> DeadLetter | None:
    """The dead letter a task that failed for good left: printed, and checked to be due."""
    item = sweeps.dead_letter_of(name, task_id)
    if not checks.expect(item is not None, f"{name} failed for good but left no dead letter"):
        return None
    assert item is not None
    print(f"   dead letter: {item.task_name}, {item.error_type}, {_state(item)}")
    checks.expect(
        (item.error_type, item.status, item.retry_count) == ("ConnectionError", "pending", 0),
        f"{name}'s dead letter is {item.error_type}, {_state(item)}",
    )
    return item


def _ran(item: DeadLetter) -> str:
    return "it ran" if item.status is DeadLetterStatus.SUCCEEDED else "failed again"


def _failing_for_good(sweeps: Sweeps, checks: Checks) -> DeadLetter | None:
    """A task that always fails: dead-lettered, swept until ``permanent_failure``, then left."""
    name, retries = notify_warehouse.name, notify_warehouse.dlq_max_retries
    print(
        f"   notify_warehouse(42): warehouse API down for good, no Celery retries, "
        f"dlq_max_retries={retries}"
    )
    failed = notify_warehouse.delay(42)
    failed.get(timeout=RESULT_TIMEOUT, interval=POLL, propagate=False)
    item = _landed(sweeps, checks, name, failed.id)
    if item is None:
        return None
    for retry_count in range(1, retries + 1):
        published, item = sweeps.sweep(item)
        print(f"   sweep {sweeps.sent}: {published} re-published, {_ran(item)} -> {_state(item)}")
        status = "permanent_failure" if retry_count == retries else "pending"
        checks.expect(
            published == 1 and (item.status, item.retry_count) == (status, retry_count),
            f"sweep {sweeps.sent}: {published} re-published, then {_state(item)}; expected 1, "
            f"then {status}, retry {retry_count}",
        )
    published, item = sweeps.sweep(item)
    starts = ledger.starts[name, 42]
    print(f"   sweep {sweeps.sent}: {published} re-published; body ran {_times(starts)} in all")
    checks.expect(
        published == 0 and item.status is DeadLetterStatus.PERMANENT_FAILURE,
        f"a permanent failure was re-published ({published}) or changed to {_state(item)}",
    )
    checks.expect(starts == 1 + retries, f"{name} body ran {_times(starts)}")
    return item


def _recovering(sweeps: Sweeps, tally: Tally, checks: Checks) -> DeadLetter | None:
    """A task that fails its Celery retries, succeeds on its dead letter's retry, and then
    answers its key from the cache."""
    name, key = book_courier.name, "courier-42"
    celery_tries = 1 + book_courier.max_retries
    print(
        f'   book_courier(42), idempotency_key="{key}": courier API down for '
        f"{COURIER_OUTAGE} tries (try + {book_courier.max_retries} Celery retry)"
    )
    first = book_courier.apply_async((42,), idempotency_key=key)
    first.get(timeout=RESULT_TIMEOUT, interval=POLL, propagate=False)
    item = _landed(sweeps, checks, name, first.id)
    if item is None:
        return None
    checks.expect(
        ledger.starts[name, 42] == celery_tries,
        f"{name} ran {_times(ledger.starts[name, 42])} before it was dead-lettered",
    )
    published, item = sweeps.sweep(item)
    # The re-published task ran under the original task id: that result is now its value. The
    # dead letter is marked succeeded just before Celery stores the result, so poll with a new
    # AsyncResult each time: one that has read the earlier FAILURE keeps it (a ready state).
    value = None
    if item.status is DeadLetterStatus.SUCCEEDED:
        result = _wait_for(
            lambda: _succeeded(app.AsyncResult(first.id)), f"{name}'s retry to store its result"
        )
        value = result.result
    print(
        f"   sweep {sweeps.sent}: {published} re-published, {_ran(item)} -> {_state(item)}; "
        f"got {value}"
    )
    checks.expect(
        published == 1 and (item.status, item.retry_count) == ("succeeded", 0),
        f"sweep {sweeps.sent}: {published} re-published, then {_state(item)}; expected 1, "
        "then succeeded, retry 0",
    )

    before = tally["published", name]
    again = book_courier.apply_async((42,), idempotency_key=key)
    again_value = again.get(timeout=RESULT_TIMEOUT, interval=POLL)
    published = tally["published", name] - before
    starts = ledger.starts[name, 42]
    same = again_value == value and again.id == first.id
    print(
        f"   sent again: {published} published, {'same' if same else 'OTHER'} task id and value; "
        f"body ran {_times(starts)} in all"
    )
    checks.expect(published == 0, f"{published} bookings published for a completed key")
    checks.expect(
        same, f"the second booking got {again.id}={again_value!r}, not {first.id}={value!r}"
    )
    checks.expect(starts == celery_tries + 1, f"{name} body ran {_times(starts)}")
    return item


def _quiet_failures_on_purpose() -> None:
    """Drop the error logs (with tracebacks) of scene 4's tasks, which fail on purpose."""

    def keep(record: logging.LogRecord) -> bool:
        return not any(name in record.getMessage() for name in FAILING_ON_PURPOSE)

    for logger in ("celery.app.trace", "idempotent_tasks.task", "idempotent_tasks.dead_letters"):
        logging.getLogger(logger).addFilter(keep)


def main() -> int:
    """Run the four scenes against an in-process worker; 0 if every guarantee held, else 1."""
    for variable in SERVER_VARIABLES:
        os.environ.pop(variable, None)  # keep Celery on memory even if the shell names a server
    where = {
        "broker": str(app.conf.broker_url),
        "results": str(app.conf.result_backend),
        "claims": str(app.conf.idempotency_store_url),
    }
    if any(not url.split("://")[0].endswith("memory") for url in where.values()):
        print(f"FAILED: the demo must run in memory, not on {where}", file=sys.stderr)
        return 1
    dead_letter_url = str(app.conf.idempotency_dlq_url)
    if not dead_letter_url.startswith("sqlite:///"):
        print(
            f"FAILED: the demo's dead letters must be in SQLite, not {dead_letter_url}",
            file=sys.stderr,
        )
        return 1

    started = time.monotonic()
    tally, checks = Tally(), Checks()
    tally.connect()
    _quiet_failures_on_purpose()
    print(
        f"idempotent_tasks demo, worker of {WORKER_THREADS} threads in this process: "
        + ", ".join(f"{role} {url}" for role, url in where.items())
    )
    with start_worker(
        app,
        pool="threads",
        concurrency=WORKER_THREADS,
        perform_ping_check=False,
        loglevel="WARNING",
    ):
        try:
            charged = duplicates(tally, checks)
            flaky_retries(tally, checks)
            kept = dead_letters(tally, checks)
        except Exception as exc:  # a result that never came is a failed guarantee too
            checks.failures.append(f"{type(exc).__name__}: {exc}")
            charged, kept = {}, []

    if checks.failures:
        for failure in checks.failures:
            print(f"FAILED: {failure}", file=sys.stderr)
        return 1
    print(
        f"OK in {time.monotonic() - started:.1f}s: card charged once "
        f"({charged.get('charge_id')}), receipt sent once, every caller got the same value; "
        f"dead letters: {', '.join(f'{item.task_name} {item.status.value}' for item in kept)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
