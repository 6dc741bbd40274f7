"""A keyed call a worker rejects as an unknown task (Celery's ``task_unknown`` signal): written
to the dead-letter table and its key freed, unless the message is not that call's last."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from idempotent_tasks import unknown_tasks
from idempotent_tasks.app_store import dlq_for, store_for
from idempotent_tasks.keys import KEY_HEADER, storage_key
from idempotent_tasks.records import ClaimRequest, Outcome, Pickup, Status
from idempotent_tasks.stores import MemoryStore
from tests.claim_requests import claim_request

TASK = "shop.not_deployed"
PICKUP = Pickup(envelope=b"{}", due_in=60.0, timeout=60.0)


@pytest.fixture()
def app(tmp_path: Path) -> Celery:
    app = Celery("unknown", set_as_current=False)
    app.conf.update(
        idempotency_store_url="memory://", idempotency_dlq_url=f"sqlite:///{tmp_path}/dlq.db"
    )
    return app


def _rejected(
    app: Celery,
    task_id: str,
    key: str,
    retries: int = 0,
    args: list[Any] | None = None,
    **headers: Any,
) -> None:
    """Celery's worker rejecting a keyed message of ``TASK`` as unknown (``headers``: more of
    the message's; its priority 3)."""
    message = SimpleNamespace(
        headers={"id": task_id, "task": TASK, "retries": retries, KEY_HEADER: key, **headers},
        delivery_info={"exchange": "", "routing_key": "celery"},
        properties={"priority": 3},
        content_type="application/json",
        decode=lambda: ([7] if args is None else args, {"amount": 5}, {"callbacks": None}),
    )
    unknown_tasks._on_task_unknown(
        sender=SimpleNamespace(app=app), name=TASK, id=task_id, message=message
    )


def _request(task_id: str, key: str) -> ClaimRequest:
    return claim_request(key=key, task_name=TASK, task_id=task_id)


def test_a_keyed_call_rejected_as_unknown_is_dead_lettered_and_its_key_freed(app: Celery) -> None:
    # Given a keyed call published (its key queued for it)
    assert store_for(app).reserve(_request("t-1", "k1"), PICKUP) is None
    # When a worker that does not know its task rejects it
    _rejected(app, "t-1", "k1")
    # Then its key is free, and it waits in the dead-letter table, as any call failed for good
    assert store_for(app).get(storage_key(TASK, "k1")) is None
    [row] = dlq_for(app).items()
    assert (row.task_id, row.idempotency_key, row.error_type) == ("t-1", "k1", "NotRegistered")
    assert (row.args, row.kwargs) == ([7], {"amount": 5})
    assert (row.options["queue"], row.options["priority"]) == ("celery", 3)


def test_a_call_rejected_as_unknown_keeps_when_it_was_to_run_and_its_expiry(app: Celery) -> None:
    # Given a call published to run in an hour, expiring in two
    eta, expires = (datetime.now(timezone.utc) + timedelta(hours=h) for h in (1, 2))
    assert store_for(app).reserve(_request("t-4", "k4"), PICKUP) is None
    _rejected(app, "t-4", "k4", eta=eta.isoformat(), expires=expires.isoformat())
    # Then its dead letter's retry would not run it early, nor after it expired
    [row] = dlq_for(app).items()
    assert (row.options["eta"], row.options["expires"]) == (eta.isoformat(), expires.isoformat())


def test_an_expired_call_rejected_as_unknown_frees_its_key_and_is_not_dead_lettered(
    app: Celery,
) -> None:
    assert store_for(app).reserve(_request("t-5", "k5"), PICKUP) is None
    expired = (datetime.now(timezone.utc) - timedelta(seconds=1)).isoformat()
    _rejected(app, "t-5", "k5", expires=expired)
    assert store_for(app).get(storage_key(TASK, "k5")) is None
    assert dlq_for(app).items() == []


def test_a_call_whose_arguments_the_table_cannot_keep_is_left_to_the_guard(app: Celery) -> None:
    # Given a call whose arguments the dead-letter table would keep only as text (a NaN)
    assert store_for(app).reserve(_request("t-6", "k6"), PICKUP) is None
    _rejected(app, "t-6", "k6", args=[float("nan")])
    # Then its key stays queued for the pickup guard, which sends its message again whole
    record = store_for(app).get(storage_key(TASK, "k6"))
    assert record is not None and record.status is Status.QUEUED
    assert dlq_for(app).items() == []


def test_a_copy_of_a_call_that_runs_elsewhere_changes_nothing(app: Celery) -> None:
    # Given a call claimed by a worker that knows its task, and an old copy of its message
    # (a redelivery, a guard copy) rejected by one that does not
    store = store_for(app)
    assert isinstance(store, MemoryStore)
    assert store.reserve(_request("t-2", "k2"), PICKUP) is None
    assert store.claim(_request("t-2", "k2")).outcome is Outcome.ACQUIRED
    _rejected(app, "t-2", "k2")
    # Then the running call keeps its key, and the guard its message (should its owner die with
    # it), and nothing is dead-lettered
    record = store.get(storage_key(TASK, "k2"))
    assert record is not None and record.status is Status.PROCESSING
    assert storage_key(TASK, "k2") in store._pending
    assert dlq_for(app).items() == []


def test_an_older_message_of_a_call_that_retried_changes_nothing(app: Celery) -> None:
    # Given a call that ran and retried: its key queued for its retry's message
    store = store_for(app)
    request = _request("t-3", "k3")
    token = store.claim(request).token
    assert store.release(request, token, dataclasses.replace(PICKUP, retries=1))
    # When its first message, redelivered, is rejected as unknown
    _rejected(app, "t-3", "k3", retries=0)
    # Then the key still waits for the retry, and nothing is dead-lettered
    record = store.get(storage_key(TASK, "k3"))
    assert record is not None and (record.status, record.owner) == (Status.QUEUED, "retry 1")
    assert dlq_for(app).items() == []
