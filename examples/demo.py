"""Effectively-once Celery tasks in one process, with no servers: ``make demo``.

Starts a Celery worker (threads) inside this process on the in-memory app of ``shop.py`` and
shows, with values computed as it runs:

1. duplicates suppressed: one charge sent several times at once under one key runs once, and
   every caller gets the same charge;
2. later duplicates answered from the cache at publish time: nothing is published and the
   result's id is the original task id;
3. a flaky task retried safely: each failed attempt releases its claim, the retry claims the
   key afresh, and the body runs to success once.

Prints ``OK`` and exits 0 when every guarantee shown held; prints ``FAILED: ...`` lines and
exits 1 otherwise.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from typing import Any

from celery.contrib.testing.worker import start_worker
from celery.signals import after_task_publish
from shop import RECEIPT_TIMEOUTS, app, charge, ledger, send_receipt

from idempotent_tasks import signals

#: Seconds to wait for any one result before declaring the demo failed.
RESULT_TIMEOUT = 15.0
#: Threads of the in-process worker: enough for duplicates to run side by side.
WORKER_THREADS = 4
#: Environment variables through which Celery would leave memory for a server.
SERVER_VARIABLES = ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "TEST_BROKER")


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


def main() -> int:
    """Run the three scenes against an in-process worker; 0 if every guarantee held, else 1."""
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

    started = time.monotonic()
    tally, checks = Tally(), Checks()
    tally.connect()
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
        except Exception as exc:  # a result that never came is a failed guarantee too
            checks.failures.append(f"{type(exc).__name__}: {exc}")
            charged = {}

    if checks.failures:
        for failure in checks.failures:
            print(f"FAILED: {failure}", file=sys.stderr)
        return 1
    print(
        f"OK in {time.monotonic() - started:.1f}s: card charged once "
        f"({charged.get('charge_id')}), receipt sent once, every caller got the same value"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
