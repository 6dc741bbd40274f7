"""A keyed call a worker rejects as an unknown task (Celery's ``task_unknown`` signal): written
to the dead-letter table and its key freed, unless the message is not that call's last."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

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


def _rejected(app: Celery, task_id: str, key: str, retries: int = 0) -> None:
    """Celery's worker rejecting a keyed message of ``TASK`` as unknown."""
    message = SimpleNamespace(
        headers={"id": task_id, "task": TASK, "retries": retries, KEY_HEADER: key},
        delivery_info={"exchange": "", "routing_key": "celery"},
        content_type="application/json",
        decode=lambda: ([7], {"amount": 5}, {"callbacks": None, "chain": None}),
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
    assert (row.args, row.kwargs, row.options["queue"]) == ([7], {"amount": 5}, "celery")


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
