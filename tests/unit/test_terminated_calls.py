"""A keyed call revoked with ``terminate=True`` while it runs: at the revoke its claim stays
(its process may not be gone yet; see test_duplicates for its release once it is), but the
pickup guard never publishes its message again."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context
from celery.signals import task_revoked

from idempotent_tasks import IdempotentTask
from idempotent_tasks.app_store import _STORE
from idempotent_tasks.dlq import DeadLetterQueue
from idempotent_tasks.keys import storage_key
from idempotent_tasks.pickups import make_pickup, republish_lost
from idempotent_tasks.records import Outcome, Status
from idempotent_tasks.stores import MemoryStore
from idempotent_tasks.worker_request import ISSUED_BY, ISSUED_OWNER
from tests.dead_letter_rows import taken_row


class Clocked:
    """An app whose claim store is a memory store on a clock the test moves."""

    def __init__(self) -> None:
        self.app = Celery("terminated", set_as_current=False, broker="memory://")
        self.app.conf.update(idempotency_store_url="memory://", result_backend="cache+memory://")
        self.now = 1000.0
        self.store = MemoryStore(clock=lambda: self.now)
        setattr(self.app, _STORE, (os.getpid(), self.store))

    def charge_task(self) -> Any:
        """A keyed task of this app whose body returns its order."""

        @self.app.task(base=IdempotentTask, shared=False)
        def charge(order: str) -> str:
            return order

        return charge

    def reserve(self, task: Any, task_id: str) -> None:
        """Publish-time reservation of key ``k`` for ``task_id``, with the guard's copy."""
        reservation = task._claim_request("k", ("o",), {}, task_id, owner="")
        pickup = make_pickup(("o",), {}, {}, 60.0, 0.0)
        assert pickup is not None
        assert self.store.reserve(reservation, pickup) is None


def test_a_terminated_calls_message_is_not_published_again() -> None:
    clocked = Clocked()
    app, store = clocked.app, clocked.store
    charge = clocked.charge_task()

    # Given a keyed call that was published, then claimed and running
    clocked.reserve(charge, "task-1")
    running = charge._claim_request("k", ("o",), {}, "task-1", owner="pool-process")
    assert store.claim(running).outcome is Outcome.ACQUIRED
    # When it is revoked with terminate=True
    _terminate(charge, "task-1")
    # Then, long after its lease and the pickup timeout, the guard publishes nothing
    clocked.now += running.lease_seconds + 3600
    assert republish_lost(app, store) == 0
    record = store.get(storage_key(charge.name, "k"))
    assert record is not None and record.task_id == "task-1"


def test_a_call_terminated_before_its_claim_frees_its_key() -> None:
    clocked = Clocked()
    app, store = clocked.app, clocked.store
    charge = clocked.charge_task()

    # Given a keyed call published, and terminated as its pool process accepted it, before
    # its claim reached the store
    clocked.reserve(charge, "task-1")
    _terminate(charge, "task-1")
    # Then its key is free (a new call of it runs), and the guard publishes nothing
    assert store.get(storage_key(charge.name, "k")) is None
    clocked.now += 3600 + 60
    assert republish_lost(app, store) == 0


def test_a_terminated_call_whose_body_ends_with_system_exit_leaves_nothing_to_publish() -> None:
    # SIGTERM, Celery's way to terminate a running call, is SystemExit in the pool process
    clocked = Clocked()
    app, store = clocked.app, clocked.store

    @app.task(base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        # The main process handles the revoke while the body still runs
        _terminate(charge, "task-9")
        raise SystemExit(15)

    clocked.reserve(charge, "task-9")
    charge.push_request(
        id="task-9",
        args=["o"],
        kwargs={},
        headers={"idempotency_key": "k"},
        called_directly=False,
        delivery_info={"exchange": "", "routing_key": "celery"},
        retries=0,
    )
    try:
        with pytest.raises(SystemExit):
            charge("o")
    finally:
        charge.pop_request()
    clocked.now += 3600 + 600
    assert republish_lost(app, store) == 0


def test_a_dead_letters_retry_terminated_while_it_ran_records_it_on_its_row(
    tmp_path: Path,
) -> None:
    clocked = Clocked()
    url = f"sqlite:///{tmp_path / 'dead_letters.sqlite3'}"
    clocked.app.conf.idempotency_dlq_url = url

    @clocked.app.task(base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        return order

    # Given a dead letter a sweep took and re-published, its retry running
    queue = DeadLetterQueue(url)
    item = taken = taken_row(queue, task_name=charge.name, task_id="task-5", key="k", args=["o"])
    # When that retry is terminated
    request = Context(
        id="task-5",
        args=["o"],
        kwargs={},
        idempotency_key="k",
        idempotency_dead_letter_id=item.id,
        idempotency_dead_letter_sweep=taken.sweep_id,
    )
    task_revoked.send(sender=charge, request=request, terminated=True, signum=15, expired=False)
    # Then its row records a failed retry (not left retrying, to be sent again in an hour)
    row = queue.get(item.id)
    queue.dispose()
    assert row is not None
    assert (row.status.value, row.retry_count, row.error_type) == ("pending", 1, "TaskRevokedError")


def test_a_dead_letters_retry_killed_after_completing_its_key_marks_its_row_succeeded(
    tmp_path: Path,
) -> None:
    from celery.exceptions import TimeLimitExceeded

    clocked = Clocked()
    url = f"sqlite:///{tmp_path / 'dead_letters.sqlite3'}"
    clocked.app.conf.idempotency_dlq_url = url
    charge = clocked.charge_task()
    # Given a dead letter a sweep took and re-published, whose retry completed its key (its
    # value stored under the owner id this worker issued) and was then killed at its hard
    # time limit (publishing its callbacks, say)
    queue = DeadLetterQueue(url)
    item = taken = taken_row(queue, task_name=charge.name, task_id="task-6", key="k", args=["o"])
    claim = charge._claim_request("k", ("o",), {}, "task-6", owner="issued-owner")
    token = clocked.store.claim(claim).token
    clocked.store.complete(claim, token, None)
    request = {
        "id": "task-6",
        "args": ["o"],
        "kwargs": {},
        "idempotency_key": "k",
        "delivery_info": {"exchange": "", "routing_key": "celery"},
        "retries": 0,
        "idempotency_dead_letter_id": item.id,
        "idempotency_dead_letter_sweep": taken.sweep_id,
        ISSUED_OWNER: "issued-owner",
        ISSUED_BY: os.getpid(),
    }
    # When the worker ends the killed call
    charge.end_killed_call(request, TimeLimitExceeded(1.0))
    # Then its row succeeded (left retrying, it would be sent again at its timeout)
    row = queue.get(item.id)
    queue.dispose()
    assert row is not None and row.status.value == "succeeded"


@pytest.mark.parametrize("requeued", [False, True], ids=["revoked", "cancelled"])
def test_a_terminated_calls_claim_is_released_once_its_process_is_gone(requeued: bool) -> None:
    clocked = Clocked()
    app, store = clocked.app, clocked.store

    @app.task(base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        return order

    # Given a keyed call claimed under the owner id the worker issued its delivery
    running = charge._claim_request("k", ("o",), {}, "task-1", owner="issued-1")
    assert store.claim(running).outcome is Outcome.ACQUIRED
    request_dict = {
        "id": "task-1",
        "task": charge.name,
        "args": ["o"],
        "kwargs": {},
        "idempotency_key": "k",
        ISSUED_OWNER: "issued-1",
        ISSUED_BY: os.getpid(),
    }
    # When its process is gone (killed outright by the revoke, or cancelled), then its claim
    # is released at once: freed, or queued for its message coming back (the guard's copy)
    charge.release_terminated_call(request_dict, requeued=requeued)
    record = store.get(storage_key(charge.name, "k"))
    if requeued:
        assert record is not None and record.status is Status.QUEUED
        assert record.task_id == "task-1"
    else:
        assert record is None or record.status is not Status.PROCESSING
    # And a claim a later delivery of the call took since is never released by it
    again = charge._claim_request("k", ("o",), {}, "task-1", owner="issued-2")
    assert store.claim(again).outcome is Outcome.ACQUIRED
    charge.release_terminated_call(request_dict, requeued=requeued)
    record = store.get(storage_key(charge.name, "k"))
    assert record is not None and (record.status, record.owner) == (Status.PROCESSING, "issued-2")


def test_a_revoked_calls_message_kept_by_the_call_that_took_its_key_is_never_published() -> None:
    clocked = Clocked()
    app, store = clocked.app, clocked.store
    charge = clocked.charge_task()

    # Given a keyed call whose message counted as lost, and another call that took its key
    # over (its claim keeps that message for the guard)
    clocked.reserve(charge, "task-1")
    clocked.now += 61
    taker = charge._claim_request("k", ("o",), {}, "task-2", owner="pool-process")
    assert store.claim(taker).taken_from_task_id == "task-1"
    # When the first call is revoked, and a worker discards its message
    request = Context(id="task-1", args=["o"], kwargs={}, idempotency_key="k")
    task_revoked.send(sender=charge, request=request, terminated=False, signum=None, expired=False)
    # Then, should the taker die, the guard never publishes the revoked call's message
    clocked.now += taker.lease_seconds + 3600
    assert republish_lost(app, store) == 0


def _terminate(task: Any, task_id: str) -> None:
    """What the worker's main process does for ``revoke(task_id, terminate=True)`` of a call
    of ``task`` with key ``k``."""
    request = Context(id=task_id, args=["o"], kwargs={}, idempotency_key="k")
    task_revoked.send(sender=task, request=request, terminated=True, signum=15, expired=False)
