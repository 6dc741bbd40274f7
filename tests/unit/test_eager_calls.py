"""Keyed calls run eagerly (``task.apply()``, ``task_always_eager``): no copy of the call is ever
published to wait or to try again; the caller gets the error."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.signals import after_task_publish

from idempotent_tasks import IdempotentTask, StoreUnavailable
from idempotent_tasks.core import Attempt
from idempotent_tasks.task import KEY_HEADER


@pytest.fixture()
def published() -> Iterator[list[Any]]:
    sent: list[Any] = []

    def count(**message: Any) -> None:
        sent.append(message)

    after_task_publish.connect(count, weak=False)
    yield sent
    after_task_publish.disconnect(count)


def test_an_eager_call_meeting_a_store_down_fails_and_publishes_nothing(
    monkeypatch: pytest.MonkeyPatch, published: list[Any]
) -> None:
    app = Celery("eager", set_as_current=False, broker="memory://")
    app.conf.update(idempotency_store_url="memory://", result_backend="cache+memory://")
    runs: list[str] = []

    @app.task(base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        runs.append(order)
        return order

    def down(self: Attempt) -> None:
        raise StoreUnavailable("store down")

    monkeypatch.setattr(Attempt, "claim", down)
    # When a keyed call runs eagerly while the store is down
    result = charge.apply(("o-1",), headers={KEY_HEADER: "k"})
    # Then it fails with the store's error: not run unclaimed, nothing sent to a broker, and
    # not re-run in a loop until Python's recursion limit
    assert result.state == "FAILURE"
    assert isinstance(result.result, StoreUnavailable)
    assert runs == []
    assert published == []


def test_an_eager_call_failing_while_the_dead_letter_database_is_down_raises_its_own_error(
    tmp_path: Any, published: list[Any]
) -> None:
    app = Celery("eager-dlq", set_as_current=False, broker="memory://")
    app.conf.update(
        idempotency_store_url="memory://",
        result_backend="cache+memory://",
        # A directory where the SQLite file should be: the database cannot be opened
        idempotency_dlq_url=f"sqlite:///{tmp_path}",
    )

    @app.task(base=IdempotentTask, shared=False)
    def declines(order: str) -> None:
        raise LookupError(f"{order} declined")

    result = declines.apply(("o-2",), headers={KEY_HEADER: "k"})
    assert result.state == "FAILURE"
    assert isinstance(result.result, LookupError)
    assert published == []
