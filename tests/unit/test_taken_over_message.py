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
from celery.exceptions import SoftTimeLimitExceeded
from celery.result import AsyncResult

from idempotent_tasks import IdempotentTask, pickups
from idempotent_tasks.records import DuePickup


def _envelope(expires: str | None = None) -> bytes:
    options = {} if expires is None else {"expires": expires}
    return json.dumps({"args": ["a"], "kwargs": {}, "options": options}).encode()


def _republish_as_the_taker(
    charge: Any, envelope: bytes, *, cached: bool, still_owed: bool = True
) -> None:
    """Run the taker's re-publication of call "lost-call"'s message (key ``taken.charge:k``)
    once its own completion was (or was not) stored with its value cached, and the store says
    the claim still owes the message (or not: the pickup guard published it)."""
    attempt = SimpleNamespace(
        settle_owed_message=lambda: still_owed,
        taken_over_envelope=envelope,
        taken_from_task_id="lost-call",
        owed_task_id="lost-call",
        result_cached=cached,
        request=SimpleNamespace(storage_key="taken.charge:k"),
        store=object(),
    )
    charge.push_request(id="taker", called_directly=False, is_eager=False)
    try:
        charge._republish_taken_over_message(attempt)
    finally:
        charge.pop_request()


@pytest.fixture()
def charge() -> Any:
    app = Celery("taken-over", set_as_current=False, broker="memory://")
    app.conf.update(idempotency_store_url="memory://", result_backend="cache+memory://")

    @app.task(base=IdempotentTask, name="taken.charge", shared=False)
    def charge(order: str) -> str:
        return order

    return charge


@pytest.mark.parametrize(
    ("cached", "expires", "still_owed", "published"),
    [
        (True, None, True, True),
        (True, "future", True, True),
        (True, "past", True, False),  # a worker would drop it unrun, REVOKED
        # not stored (the copy would run the key again), or not cached (it would answer None)
        (False, None, True, False),
        # the pickup guard published it while this call was slow past its lease
        (True, None, False, False),
    ],
)
def test_a_taken_over_message_goes_out_again_only_once_the_key_holds_a_value_it_can_answer(
    charge: Any,
    monkeypatch: pytest.MonkeyPatch,
    cached: bool,
    expires: str | None,
    still_owed: bool,
    published: bool,
) -> None:
    sent: list[DuePickup] = []
    monkeypatch.setattr(pickups, "republish", lambda app, due: sent.append(due))
    now = datetime.now(timezone.utc)
    moment = {"future": now + timedelta(hours=1), "past": now - timedelta(seconds=1)}
    _republish_as_the_taker(
        charge,
        _envelope(expires and moment[expires].isoformat()),
        cached=cached,
        still_owed=still_owed,
    )
    assert [(due.task_id, due.storage_key) for due in sent] == (
        [("lost-call", "taken.charge:k")] if published else []
    )


def test_a_soft_time_limit_firing_while_it_goes_out_does_not_drop_it(
    charge: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a publish the call's soft time limit interrupts once (it fires once per run)
    tries: list[DuePickup] = []

    def interrupted_once(app: Any, due: DuePickup) -> None:
        tries.append(due)
        if len(tries) == 1:
            raise SoftTimeLimitExceeded()

    monkeypatch.setattr(pickups, "republish", interrupted_once)
    _republish_as_the_taker(charge, _envelope(), cached=True)
    # Then it is published all the same
    assert [due.task_id for due in tries] == ["lost-call", "lost-call"]


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
