"""Job functions the RQ integration tests enqueue. Each records every start of its body in a
Redis ledger list (``ledger:<name>``, db 8), so tests count how often a body really ran."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import redis

from idempotent_tasks.dlq import DeadLetterQueue
from idempotent_tasks.rq import idempotent

LEDGER_URL_ENV = "IT_RQ_LEDGER_URL"
DEFAULT_LEDGER_URL = "redis://127.0.0.1:6379/8"

_ledger: tuple[int, redis.Redis] | None = None


def ledger() -> redis.Redis:
    """This process's client of the ledger database."""
    global _ledger
    if _ledger is None or _ledger[0] != os.getpid():
        client = redis.Redis.from_url(os.environ.get(LEDGER_URL_ENV, DEFAULT_LEDGER_URL))
        _ledger = (os.getpid(), client)
    return _ledger[1]


def close_ledger() -> None:
    global _ledger
    if _ledger is not None and _ledger[0] == os.getpid():
        _ledger[1].close()
    _ledger = None


def starts(name: str) -> int:
    """How many times a body recorded under ``name`` started."""
    return int(ledger().llen(f"ledger:{name}"))


def _start(name: str) -> int:
    return int(ledger().rpush(f"ledger:{name}", f"start:{os.getpid()}:{time.time()}"))


def record(name: str, value: int, seconds: float = 0.0) -> dict[str, Any]:
    """Record a start, take ``seconds``, return a value naming the run it came from."""
    run = _start(name)
    time.sleep(seconds)
    return {"name": name, "value": value, "run": run}


@idempotent(key="keyed:{name}", wait_slice=0.3)
def record_keyed(name: str, value: int, seconds: float = 0.0) -> dict[str, Any]:
    """:func:`record` keyed by its name; duplicates wait 0.3 s in the worker, then requeue."""
    return record(name, value, seconds)


@idempotent(key="skip:{name}", on_duplicate="skip")
def record_or_skip(name: str, seconds: float = 0.0) -> dict[str, Any]:
    """:func:`record` whose duplicates are dropped while it runs."""
    return record(name, 0, seconds)


@idempotent(key="raise:{name}", on_duplicate="raise")
def record_or_raise(name: str, seconds: float = 0.0) -> dict[str, Any]:
    """:func:`record` whose duplicates fail with IdempotencyConflict while it runs."""
    return record(name, 0, seconds)


class Billing:
    """Two classes with a method of one name: their keys must not meet."""

    def charge(self, order: str) -> str:
        _start(order)
        return "billed"

    @classmethod
    def open(cls, order: str) -> str:
        _start(order)
        return "billing opened"

    def declines(self, order: str) -> None:
        _start(order)
        raise ValueError(f"{order} declined")


class Refunds:
    def charge(self, order: str) -> str:
        _start(order)
        return "refunded"

    @classmethod
    def open(cls, order: str) -> str:
        _start(order)
        return "refunds opened"


def exits(name: str) -> None:
    """Ends its run with SystemExit (as a platform's shutdown or a cancellation would)."""
    _start(name)
    raise SystemExit(f"{name} exits")


@idempotent(key_required=True)
def key_required(name: str) -> None:
    """Refused at enqueue without a per-call key."""


def flaky(name: str, failures: int) -> dict[str, Any]:
    """Fail the first ``failures`` starts with TimeoutError, then succeed."""
    run = _start(name)
    if run <= failures:
        raise TimeoutError(f"run {run} of {name} failed")
    return {"name": name, "run": run}


def asks_for_a_retry(name: str) -> Any:
    """Return RQ's ``Retry`` (its other way to ask for a retry) on every start."""
    from rq import Retry

    _start(name)
    return Retry(max=2)


def fails_odd_runs(name: str) -> dict[str, Any]:
    """Fail the first, third, ... starts with ValueError; succeed on the others."""
    run = _start(name)
    if run % 2:
        raise ValueError(f"run {run} of {name} failed")
    return {"name": name, "run": run}


def fails_after(name: str, seconds: float) -> None:
    """Take ``seconds``, then fail with ValueError."""
    run = _start(name)
    time.sleep(seconds)
    raise ValueError(f"run {run} of {name} failed after {seconds} s")


@idempotent(key="fails-first:{name}")
def fails_first_then_takes(name: str, fails_after: float, seconds: float) -> dict[str, Any]:
    """Fail the first start ``fails_after`` seconds in; later starts take ``seconds``."""
    run = _start(name)
    if run == 1:
        time.sleep(fails_after)
        raise ValueError(f"run 1 of {name} failed")
    time.sleep(seconds)
    return {"name": name, "run": run}


def fails_holding(name: str, value: Any) -> None:
    """Fail with ValueError, whatever ``value`` is (a tuple, say)."""
    _start(name)
    raise ValueError(f"{name} failed holding {value!r}")


@idempotent(lease=2)
def slow_first(name: str, seconds: float) -> dict[str, Any]:
    """Take ``seconds`` on the first start only; claims live 2 s without a heartbeat."""
    run = _start(name)
    if run == 1:
        time.sleep(seconds)
    return {"name": name, "run": run}


def slow_first_long_lease(name: str, seconds: float) -> dict[str, Any]:
    """:func:`slow_first` without options of its own: its lease is its job's timeout."""
    run = _start(name)
    if run == 1:
        time.sleep(seconds)
    return {"name": name, "run": run}


@idempotent(lease=2, dlq=False)
def slow_first_without_dlq(name: str, seconds: float) -> dict[str, Any]:
    """:func:`slow_first`, whose final failures are not dead-lettered."""
    return slow_first(name, seconds)


@idempotent(dlq=False)
def fails_without_dlq(name: str) -> None:
    """Fail with ValueError; its final failures are not dead-lettered."""
    run = _start(name)
    raise ValueError(f"run {run} of {name} failed")


#: What each run of :func:`fails_after_recovering` found stuck, in this process.
recovered_while_running: list[int] = []


def fails_after_recovering(dlq_url: str, seconds: float, timeout: float) -> None:
    """Run ``seconds``, then do what a sweep would at that moment (make rows ``retrying`` for
    over ``timeout`` due again, noting how many), and fail."""
    time.sleep(seconds)
    queue = DeadLetterQueue(dlq_url)
    try:
        recovered_while_running.append(
            queue.recover_stuck(timedelta(seconds=timeout), framework="rq")
        )
    finally:
        queue.dispose()
    raise RuntimeError("declined again")


def failing_success_callback(job: Any, connection: Any, result: Any, *_: Any, **__: Any) -> None:
    """An ``on_success`` callback that always raises."""
    raise RuntimeError("the success callback declined")
