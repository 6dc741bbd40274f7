"""A task killed at its hard time limit: dead-lettered, its key free, not run again."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.exceptions import TimeLimitExceeded
from celery.result import AsyncResult

from idempotent_tasks.app_store import dlq_for, store_for
from idempotent_tasks.core import new_owner
from idempotent_tasks.dlq import DeadLetter, DeadLetterQueue, DeadLetterStatus
from idempotent_tasks.keys import storage_key
from idempotent_tasks.records import CompleteOutcome, Outcome, Status
from idempotent_tasks.worker_request import ISSUED_BY, ISSUED_OWNER
from tests.integration import worker_app
from tests.integration.databases import fresh_pg_database, set_pg_database_online
from tests.integration.helpers import app_store_url, fresh, ledger_events, wait_until
from tests.integration.redis_server import RedisServer, writes_held
from tests.integration.workers import WorkerProcess

app = worker_app.app


def _row_of(task_id: str) -> DeadLetter | None:
    rows = [item for item in dlq_for(app).items(limit=1000) if item.task_id == task_id]
    return rows[0] if rows else None


@pytest.mark.slow
def test_a_task_killed_at_its_hard_time_limit_is_dead_lettered_and_its_key_released(
    it_env: dict[str, str], worker_app: Any, tmp_path: Path
) -> None:
    # Given a worker whose pool kills a keyed task at its hard time limit (1 s)
    worker = WorkerProcess("limits", it_env, tmp_path)
    try:
        name, key = fresh("overrun"), fresh("key")
        task = worker_app.overruns
        result = task.apply_async((name, 30), idempotency_key=key)
        # Then the caller sees Celery's TimeLimitExceeded
        with pytest.raises(TimeLimitExceeded):
            result.get(timeout=30)
        # And the call waits in the dead-letter table, as a failure in the body would
        row = wait_until(lambda: _row_of(result.id), 10, "the dead letter")
        assert (row.task_name, row.idempotency_key) == (task.name, key)
        assert (row.args, row.kwargs) == ([name, 30], {})
        assert row.error_type == "TimeLimitExceeded"
        assert row.failure_id == f"{result.id}:0"
        assert row.status is DeadLetterStatus.PERMANENT_FAILURE
        # And the key is free, so the pickup guard will not run the killed call again
        store = store_for(app)
        wait_until(lambda: store.get(storage_key(task.name, key)) is None, 10, "the key's release")
        # And a new call with the key runs afresh (it fails for good only when it overruns)
        again = task.apply_async((name, 0), idempotency_key=key)
        assert again.id != result.id
        assert again.get(timeout=30) == name
        assert ledger_events(name, "start") == 2
        assert ledger_events(name, "finish") == 1
        # And a call without a key is dead-lettered the same way
        unkeyed = task.apply_async((fresh("unkeyed"), 30))
        with pytest.raises(TimeLimitExceeded):
            unkeyed.get(timeout=30)
        row = wait_until(lambda: _row_of(unkeyed.id), 10, "the unkeyed call's dead letter")
        assert (row.idempotency_key, row.error_type) == (None, "TimeLimitExceeded")
    finally:
        worker.stop()


@pytest.mark.slow
def test_a_killed_call_celery_hands_back_to_the_broker_is_not_dead_lettered_and_runs_again(
    it_env: dict[str, str], worker_app: Any, tmp_path: Path
) -> None:
    # Given a task whose message Celery requeues when its hard time limit kills it
    worker = WorkerProcess("requeues", it_env, tmp_path)
    try:
        name, key = fresh("requeued"), fresh("key")
        task = worker_app.overruns_once
        result = task.apply_async(
            (name,), idempotency_key=key, link=worker_app.noted_callback.s(name)
        )
        # When its first run is killed, then the requeued message runs it again at once
        # (its key released for it, not held until the killed run's lease ends)
        wait_until(lambda: ledger_events(name, "finish") == 1, 30, "the requeued run")
        assert ledger_events(name, "start") == 2
        # (the killed run's FAILURE, which Celery stored, stands until the run after it is done)
        wait_until(
            lambda: AsyncResult(result.id, app=app).state == "SUCCESS", 10, "the requeued result"
        )
        assert AsyncResult(result.id, app=app).get(timeout=10) == name
        # And its link runs once, after the run that finished
        wait_until(lambda: ledger_events(name, "callback") == 1, 10, "the link")
        time.sleep(0.5)
        assert ledger_events(name, "callback") == 1
        # And the call, which did not fail for good, is not in the dead-letter table
        assert _row_of(result.id) is None
        record = store_for(app).get(storage_key(task.name, key))
        assert record is not None and record.status is Status.COMPLETED
    finally:
        worker.stop()


def test_a_killed_call_releases_only_the_claim_its_own_delivery_made(worker_app: Any) -> None:
    # Given a call whose key, after its lease ended, was taken over by another delivery of
    # the same task id, and the first delivery then killed at its hard time limit
    task = worker_app.overruns
    name, key, task_id = fresh("taken-over"), fresh("key"), fresh("task")
    store = store_for(app)
    killed_owner, new_owner_id = new_owner(), new_owner()
    claim = task._claim_request(key, (name, 30), {}, task_id, owner=new_owner_id)
    assert store.claim(claim).outcome is Outcome.ACQUIRED

    def end_delivery(owner: str) -> None:
        task.end_killed_call(_delivery(task, task_id, name, key, owner), TimeLimitExceeded(1))

    # When the main process ends the killed delivery, then the new owner keeps the key
    end_delivery(killed_owner)
    record = store.get(storage_key(task.name, key))
    assert record is not None
    assert (record.status, record.owner) == (Status.PROCESSING, new_owner_id)
    # And when that new delivery is killed in turn, its own claim is released
    end_delivery(new_owner_id)
    assert store.get(storage_key(task.name, key)) is None


def test_a_call_killed_after_completing_its_key_is_not_dead_lettered(worker_app: Any) -> None:
    # Given a delivery that completed its key (its value stored), then was killed at its hard
    # time limit before the worker heard back (publishing its callbacks, say)
    task = worker_app.overruns
    name, key, task_id = fresh("killed-late"), fresh("key"), fresh("task")
    store = store_for(app)
    owner = new_owner()
    claim = task._claim_request(key, (name, 30), {}, task_id, owner=owner)
    claimed = store.claim(claim)
    assert claimed.outcome is Outcome.ACQUIRED
    encoded, _ = task._codec.encode(name)
    assert store.complete(claim, claimed.token, encoded) is CompleteOutcome.STORED
    # When the main process ends the killed delivery
    task.end_killed_call(_delivery(task, task_id, name, key, owner), TimeLimitExceeded(1))
    # Then no dead letter is written (its retry would send the call's callbacks again), and
    # the key stays completed with its value
    assert _row_of(task_id) is None
    record = store.get(storage_key(task.name, key))
    assert record is not None and record.status is Status.COMPLETED


def _delivery(task: Any, task_id: str, name: str, key: str, owner: str) -> dict[str, Any]:
    """The request of a delivery of ``task`` (``name``, 30 s) this worker issued ``owner``."""
    return {
        "id": task_id,
        "task": task.name,
        "args": [name, 30],
        "kwargs": {},
        "retries": 0,
        "delivery_info": {"exchange": "", "routing_key": "celery"},
        "idempotency_key": key,
        ISSUED_OWNER: owner,
        ISSUED_BY: os.getpid(),
    }


def _errbacks_once_settled(name: str) -> int:
    """How many times the errbacks of ``name`` ran, once they have (Celery 5.7 runs those of a
    call killed at its time limit twice, from two handlers, in quick succession)."""
    wait_until(lambda: ledger_events(name, "errback") > 0, 30, "the errbacks")
    time.sleep(1)
    return ledger_events(name, "errback")


@pytest.mark.slow
def test_a_killed_call_whose_dead_letter_waits_for_its_database_fails_only_once(
    it_env: dict[str, str], worker_app: Any, tmp_path: Path
) -> None:
    database = "it_killed_dlq_down"
    url = fresh_pg_database(database)
    queue = DeadLetterQueue(url)
    queue.ensure_schema()
    worker = WorkerProcess("killed-down", {**it_env, "IT_DLQ_URL": url}, tmp_path)

    def killed_call() -> tuple[str, AsyncResult]:
        name = fresh("killed")
        result = worker_app.overruns.apply_async(
            (name, 30), idempotency_key=fresh("key"), link_error=worker_app.noted_errback.s(name)
        )
        return name, result

    def rows_of(result: AsyncResult) -> list[DeadLetter]:
        return [row for row in queue.items() if row.task_id == result.id]

    try:
        # Given how often Celery runs the errbacks of a killed call whose dead letter is
        # written at once
        name, result = killed_call()
        wait_until(lambda: rows_of(result), 30, "the first dead letter")
        failures_reported = _errbacks_once_settled(name)
        # When the dead-letter database is offline as the next call is killed
        set_pg_database_online(database, False)
        name, result = killed_call()
        # (from the worker's main process, then again from the message re-published to write it)
        wait_until(
            lambda: worker.log().count("could not write its dead letter") >= 2,
            30,
            "two failed writes",
        )
        # And comes back, so the message re-published once more writes the dead letter
        set_pg_database_online(database, True)
        rows = wait_until(lambda: rows_of(result), 30, "the second dead letter")
        assert [row.error_type for row in rows] == ["TimeLimitExceeded"]
        wait_until(
            lambda: f"[{result.id}] ignored" in worker.log() or "DeadLettered" in worker.log(),
            30,
            "the end of the re-published message",
        )
        # Then the call failed once, as the first did: no more errbacks, one run of its body
        assert _errbacks_once_settled(name) == failures_reported
        assert ledger_events(name, "start") == 1
        # And its result is still the failure Celery stored (no RETRY or STARTED over it), as
        # anyone reading it from the backend now sees
        stored = app.backend._get_task_meta_for(result.id)
        assert (stored["status"], type(stored["result"])) == ("FAILURE", TimeLimitExceeded)
    finally:
        set_pg_database_online(database, True)
        queue.dispose()
        worker.stop()


@pytest.fixture()
def store_of_its_own(
    request: pytest.FixtureRequest, it_env: dict[str, str], worker_app: Any, tmp_path: Path
) -> Iterator[tuple[RedisServer, redis.Redis]]:
    """A worker whose store is a Redis server of its own, that server and a client of it:
    pausing or stopping the broker's instead would hold up the worker's main process too."""
    server = RedisServer(tmp_path, persistent=False)
    worker_args = getattr(request, "param", ())  # the worker's command-line options
    worker = WorkerProcess(
        "own-store", {**it_env, "IT_STORE_URL": server.url}, tmp_path, extra_args=worker_args
    )
    client = redis.Redis.from_url(server.url)
    try:
        with app_store_url(worker_app.app, server.url):
            yield server, client
    finally:
        client.close()
        worker.stop()
        server.stop()


@pytest.mark.slow
def test_a_result_stored_after_the_soft_time_limit_fired_still_ends_the_call(
    worker_app: Any, store_of_its_own: tuple[RedisServer, redis.Redis]
) -> None:
    _, store_server = store_of_its_own
    name, key = fresh("soft"), fresh("key")
    task = worker_app.near_its_soft_limit
    result = task.apply_async((name, 2.0), idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 20, "the body to start")
    # When the store holds every write for 3.5 s: the body returns 2 s into its 3 s soft time
    # limit, and storing its result waits until after that limit fired
    with writes_held(store_server, 3.5):
        # Then the call ends with the body's value, stored for duplicates, having run once
        assert result.get(timeout=30) == name
    record = store_for(app).get(storage_key(task.name, key))
    assert record is not None and record.status is Status.COMPLETED
    assert task.apply_async((name, 2.0), idempotency_key=key).get(timeout=30) == name
    assert ledger_events(name, "start") == 1


@pytest.mark.slow
def test_a_failure_released_after_the_soft_time_limit_fired_is_still_dead_lettered(
    worker_app: Any, store_of_its_own: tuple[RedisServer, redis.Redis]
) -> None:
    _, store_server = store_of_its_own
    name, key = fresh("soft-fail"), fresh("key")
    task = worker_app.near_its_soft_limit
    result = task.apply_async((name, 2.0, True), idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 20, "the body to start")
    # When the store holds every write for 3.5 s: the body fails 2 s into its 3 s soft time
    # limit, and releasing its key waits until after that limit fired
    with writes_held(store_server, 3.5), pytest.raises(ValueError):
        # Then the caller sees the body's own error, the call is dead-lettered, its key free
        result.get(timeout=30)
    row = wait_until(lambda: _row_of(result.id), 10, "the dead letter")
    assert (row.error_type, row.idempotency_key) == ("ValueError", key)
    assert store_for(app).get(storage_key(task.name, key)) is None
    assert ledger_events(name, "start") == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("task_name", "store_of_its_own"),
    [("near_its_time_limit", ()), ("under_the_workers_time_limit", ("--time-limit", "8"))],
    ids=["the-tasks-limit", "the-workers-limit"],
    indirect=["store_of_its_own"],
)
def test_a_result_the_store_cannot_take_before_the_hard_time_limit_still_ends_the_call(
    worker_app: Any, store_of_its_own: tuple[RedisServer, redis.Redis], task_name: str
) -> None:
    server, _ = store_of_its_own
    name, key = fresh("hard"), fresh("key")
    task = getattr(worker_app, task_name)
    result = task.apply_async((name, 2.0), idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 20, "the body to start")
    # When the store goes down while the body runs (2 s of an 8 s hard time limit, and a
    # try of the completion then takes up to 3 s: the store client's own reconnects)
    server.stop()
    # Then storing its result stops trying before the limit: the caller gets the body's value
    # (not TimeLimitExceeded for a body that succeeded)
    assert result.get(timeout=30) == name
    assert ledger_events(name, "start") == 1
