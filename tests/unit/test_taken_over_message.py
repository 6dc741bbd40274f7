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

from idempotent_tasks import IdempotentTask
from idempotent_tasks import task as task_module
from idempotent_tasks.records import DuePickup


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
