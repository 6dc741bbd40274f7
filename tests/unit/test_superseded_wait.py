"""An owner whose claim was taken over while its body ran waits for the new owner, whatever
the task's ``on_duplicate``: it is no duplicate caller, and its body succeeded."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore, Retry

from idempotent_tasks import IdempotencyConflict, IdempotentTask
from idempotent_tasks.app_store import store_for
from idempotent_tasks.task import _REPUBLISH, KEY_HEADER, PREVIOUS_OWNER_HEADER, SUPERSEDED_HEADER


@pytest.fixture()
def app() -> Celery:
    app = Celery("superseded", set_as_current=False, broker="memory://")
    app.conf.update(idempotency_store_url="memory://", result_backend="cache+memory://")
    return app


def _deliver(task: Any, key: str, headers: dict[str, Any]) -> Any:
    """Run ``task`` as a worker runs a delivered message with ``headers``."""
    task.push_request(
        id="task-of-the-taken-over-owner",
        args=("k",),
        kwargs={},
        headers={KEY_HEADER: key, **headers},
        called_directly=False,
        delivery_info={"routing_key": "celery", "exchange": ""},
        retries=0,
    )
    try:
        return task("k")
    finally:
        task.pop_request()


@pytest.mark.parametrize("on_duplicate", ["skip", "raise"])
def test_a_taken_over_owner_waits_for_the_new_one_whatever_on_duplicate(
    app: Celery, on_duplicate: str
) -> None:
    @app.task(base=IdempotentTask, on_duplicate=on_duplicate, shared=False)
    def charge(order: str) -> str:
        return order

    # Given a key another execution (another task id) holds, running
    new_owner = charge._claim_request("key-1", ("k",), {}, "task-of-the-new-owner", owner="new")
    assert store_for(app).claim(new_owner).outcome.value == "acquired"
    # When the owner it took the key over from comes back to wait for its value
    with pytest.raises(Retry):
        _deliver(charge, "key-1", {SUPERSEDED_HEADER: True})
    # Then it waits (a Retry), where a plain duplicate is handled per on_duplicate
    with pytest.raises(Ignore if on_duplicate == "skip" else IdempotencyConflict):
        _deliver(charge, "key-1", {})


@pytest.mark.parametrize("on_duplicate", ["skip", "raise"])
def test_a_retry_whose_key_another_call_took_meanwhile_waits_whatever_on_duplicate(
    app: Celery, on_duplicate: str
) -> None:
    @app.task(base=IdempotentTask, on_duplicate=on_duplicate, shared=False)
    def charge(order: str) -> str:
        return order

    # Given a call that retried, its key freed, and another call that claimed it meanwhile
    other = charge._claim_request("key-2", ("k",), {}, "task-of-the-other-call", owner="other")
    assert store_for(app).claim(other).outcome.value == "acquired"
    # When the retry arrives (naming the owner it retried from), then it waits for the value
    with pytest.raises(Retry) as waited:
        _deliver(charge, "key-2", {PREVIOUS_OWNER_HEADER: "first-owner"})
    # And keeps waiting on its next delivery
    assert waited.value.sig.options[_REPUBLISH][SUPERSEDED_HEADER] is True
