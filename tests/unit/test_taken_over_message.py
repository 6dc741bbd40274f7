"""The queued message of a call whose key another call took over (it counted as lost) is
published again once the key is completed, unless that would run or revoke it: when the
completion was not stored, or the call expired meanwhile."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore
from celery.result import AsyncResult

from idempotent_tasks import IdempotentTask
from idempotent_tasks import task as task_module
from idempotent_tasks.app_store import store_for
from idempotent_tasks.pickups import make_pickup
from idempotent_tasks.records import DuePickup
from idempotent_tasks.task import KEY_HEADER


def _envelope(expires: str | None = None) -> bytes:
    options = {} if expires is None else {"expires": expires}
    return json.dumps({"args": ["a"], "kwargs": {}, "options": options}).encode()


@pytest.fixture()
def charge() -> Any:
    app = Celery("taken-over", set_as_current=False, broker="memory://")
    app.conf.update(idempotency_store_url="memory://", result_backend="cache+memory://")

    @app.task(base=IdempotentTask, name="taken.charge", shared=False)
    def charge(order: str) -> str:
        return order

    return charge


@pytest.mark.parametrize(
    ("completed", "expires", "published"),
    [
        (True, None, True),
        (True, "future", True),
        (True, "past", False),  # a worker would drop it unrun, REVOKED
        (False, None, False),  # the key is not done: the copy would run it again
    ],
)
def test_a_taken_over_message_goes_out_again_only_once_the_key_holds_a_value_it_can_answer(
    charge: Any,
    monkeypatch: pytest.MonkeyPatch,
    completed: bool,
    expires: str | None,
    published: bool,
) -> None:
    sent: list[DuePickup] = []
    monkeypatch.setattr(task_module, "republish_taken", lambda app, store, due: sent.append(due))
    now = datetime.now(timezone.utc)
    moment = {"future": now + timedelta(hours=1), "past": now - timedelta(seconds=1)}
    attempt = SimpleNamespace(
        taken_over_envelope=_envelope(expires and moment[expires].isoformat()),
        taken_from_task_id="lost-call",
        completed=completed,
        request=SimpleNamespace(storage_key="taken.charge:k"),
        store=object(),
    )
    charge.push_request(id="taker", called_directly=False, is_eager=False)
    try:
        charge._republish_taken_over_message(attempt)
    finally:
        charge.pop_request()
    assert [(due.task_id, due.storage_key) for due in sent] == (
        [("lost-call", "taken.charge:k")] if published else []
    )


def test_a_taken_over_message_goes_out_again_when_the_call_that_took_it_replaced_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a key queued for call "lost-call", whose message counts as lost at once
    app = Celery("taken-over-replaced", set_as_current=False, broker="memory://")
    app.conf.update(idempotency_store_url="memory://", result_backend="cache+memory://")

    @app.task(base=IdempotentTask, name="taken.after", shared=False)
    def after(order: str) -> str:
        return order

    @app.task(base=IdempotentTask, name="taken.replaces", shared=False, bind=True)
    def replaces(self: Any, order: str) -> str:
        raise self.replace(after.s(order))

    store = store_for(app)
    lost = replaces._claim_request("order-1", ("o-1",), {}, "lost-call", owner="")
    assert store.reserve(lost, make_pickup(["o-1"], {}, {}, 10.0, wait=-20)) is None
    sent: list[DuePickup] = []
    monkeypatch.setattr(task_module, "republish_taken", lambda app, store, due: sent.append(due))
    # When another message of the key runs it, and its body replaces itself
    replaces.push_request(
        id="taker",
        called_directly=False,
        is_eager=False,
        args=["o-1"],
        kwargs={},
        headers={KEY_HEADER: "order-1"},
        delivery_info={"routing_key": "celery"},
    )
    try:
        with pytest.raises(Ignore):
            replaces("o-1")
    finally:
        replaces.pop_request()
    # Then the lost call's message goes out again (it answers with the replacement's value)
    assert [due.task_id for due in sent] == ["lost-call"]


def test_the_result_stored_for_a_taken_over_call_is_its_own_not_the_takers(
    charge: Any,
) -> None:
    # Given a call that took another call's key over and has children of its own
    charge.push_request(
        id="taker", called_directly=False, is_eager=False, children=[AsyncResult("child-1")]
    )
    try:
        # When it stores the key's value as that call's result
        charge._answer_taken_over_call("lost-call", "o-1")
    finally:
        charge.pop_request()
    # Then that record names no child of the taker's
    meta = charge.backend.get_task_meta("lost-call")
    assert (meta["status"], meta["result"], meta.get("children")) == ("SUCCESS", "o-1", [])
