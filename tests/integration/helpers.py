"""Small helpers for integration tests: ledger counts, queue lengths, fresh keys."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
import redis

from idempotent_tasks import IdempotentTask
from tests.integration import worker_app

#: A queue no test worker consumes: what lands here was published and stays put.
IDLE_QUEUE = "nobody-listens"


def fresh(name: str) -> str:
    """A name no other test (or earlier run) uses."""
    return f"{name}-{uuid.uuid4().hex[:10]}"


def ledger_events(name: str, event: str) -> int:
    """How many times the ledger of ``name`` recorded ``event`` (start or finish)."""
    entries = worker_app.ledger.lrange(f"ledger:{name}", 0, -1)
    return sum(1 for entry in entries if entry.decode().startswith(f"{event}:"))


def ledger_sequence(name: str) -> list[str]:
    """The events the ledger of ``name`` recorded, in the order they happened."""
    entries = worker_app.ledger.lrange(f"ledger:{name}", 0, -1)
    return [entry.decode().split(":", 1)[0] for entry in entries]


def queue_length(queue: str) -> int:
    """Messages waiting in a broker queue."""
    broker = redis.Redis.from_url(worker_app.app.conf.broker_url)
    return int(broker.llen(queue))


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``condition`` until truthy; fail the test with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@contextmanager
def app_store_url(app: Any, url: str) -> Iterator[None]:
    """Point the test process's app at another claim store, closing each store it drops."""
    with _app_url(app, "idempotency_store_url", "_idempotent_tasks_store", "close", url):
        yield


@contextmanager
def app_dlq_url(app: Any, url: str) -> Iterator[None]:
    """Point the test process's app at another dead-letter table, closing each one it drops."""
    with _app_url(app, "idempotency_dlq_url", "_idempotent_tasks_dlq", "dispose", url):
        yield


@contextmanager
def _app_url(app: Any, setting: str, cache: str, closer: str, url: str) -> Iterator[None]:
    def drop_cached() -> None:
        cached = app.__dict__.pop(cache, None)
        if cached is not None:
            getattr(cached[1], closer)()

    previous = app.conf[setting]
    drop_cached()
    app.conf[setting] = url
    try:
        yield
    finally:
        drop_cached()
        app.conf[setting] = previous


def set_pickup_timeout(monkeypatch: pytest.MonkeyPatch, app: Any, seconds: float) -> None:
    """Publish from this process with another pickup timeout, for one test.

    Tasks read the setting once (see ``IdempotentTask._pickup_timeout``): theirs is replaced
    too, and monkeypatch restores both.
    """
    monkeypatch.setitem(app.conf, "idempotency_pickup_timeout", seconds)
    for task in app.tasks.values():
        if isinstance(task, IdempotentTask):
            monkeypatch.setitem(task.__dict__, "_pickup_timeout", float(seconds))


def publish_in_two_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    """Publish keyed calls from this process as to a broker apart from the store, for one
    test: the reservation, then the message (``idempotent_tasks.reserve_and_push`` off)."""
    from idempotent_tasks import reserve_and_push

    monkeypatch.setattr(reserve_and_push, "publish", lambda *args, **kwargs: None)


def charge_at_once(callers: int, order: str, key: str) -> list[Any]:
    """``callers`` threads publishing the same keyed charge of ``order`` (a body that sleeps
    half a second) at the same moment; every caller's value."""
    with ThreadPoolExecutor(max_workers=callers) as pool:
        results = list(
            pool.map(
                lambda _: worker_app.charge.apply_async(
                    (order, 990), {"sleep": 0.5}, idempotency_key=key
                ),
                range(callers),
            )
        )
    return [result.get(timeout=60) for result in results]
