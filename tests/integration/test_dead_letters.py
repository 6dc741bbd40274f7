"""The dead-letter queue with real workers (and a real beat) on PostgreSQL and MariaDB."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

import pytest

from idempotent_tasks import IdempotencyKeyMismatch
from idempotent_tasks.app_store import dlq_for
from idempotent_tasks.dlq import DeadLetter, DeadLetterQueue, DeadLetterStatus, Failure
from tests.integration import worker_app
from tests.integration.databases import fresh_mariadb_database, fresh_pg_database
from tests.integration.helpers import (
    app_dlq_url,
    fresh,
    ledger_events,
    ledger_sequence,
    wait_until,
)
from tests.integration.workers import BeatProcess, WorkerProcess

app = worker_app.app


def _row_of(task_id: str, queue: DeadLetterQueue | None = None) -> DeadLetter | None:
    rows = [item for item in (queue or dlq_for(app)).items(limit=1000) if item.task_id == task_id]
    assert len(rows) <= 1, rows
    return rows[0] if rows else None


def _seed_ledgered_dead_letter(task_id: str, key: str, name: str) -> DeadLetter:
    """A due dead letter of ``ledgered(name)`` under ``key``, allowed one retry."""
    return dlq_for(app).add(
        Failure(
            failure_id=f"{task_id}:0",
            task_name=worker_app.ledgered.name,
            task_id=task_id,
            idempotency_key=key,
            args=[name],
            kwargs={},
            options={"queue": "celery"},
            error_type="RuntimeError",
            error_message="seeded",
            traceback=None,
            max_retries=1,
        )
    )


def _given_up(item_id: str) -> DeadLetter:
    """The dead letter ``item_id`` once it has ended ``permanent_failure``."""
    return wait_until(
        lambda: (
            (r := dlq_for(app).get(item_id))
            and r.status is DeadLetterStatus.PERMANENT_FAILURE
            and r
        ),
        30,
        "the dead letter to give up",
    )


@pytest.fixture(scope="module", params=["postgresql", "mariadb"])
def workers_and_beat(
    it_env: dict[str, str],
    worker_app: Any,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[tuple[list[WorkerProcess], BeatProcess]]:
    """Two workers and a beat whose dead-letter table is on each database in turn, as is the
    test process's."""
    fresh_database = fresh_pg_database if request.param == "postgresql" else fresh_mariadb_database
    env = {**it_env, "IT_DLQ_URL": fresh_database("it_dead_letters_beat")}
    logs = tmp_path_factory.mktemp("dlq")
    with app_dlq_url(worker_app.app, env["IT_DLQ_URL"]):
        workers = [WorkerProcess(f"dlq{index}", env, logs) for index in range(2)]
        beat = BeatProcess(env, logs)
        yield workers, beat
        beat.stop()
        for worker in workers:
            worker.stop()


@pytest.mark.usefixtures("workers_and_beat")
class TestWithBeat:
    def test_failed_task_lands_with_every_field_right(self) -> None:
        # Given a task that fails for good (its dead letter allows no retries, so it stays put)
        name, key = fresh("failed"), fresh("key")
        task = worker_app.fails_once_and_for_all
        result = task.apply_async((name,), {"amount": 5}, idempotency_key=key, priority=3)
        with pytest.raises(RuntimeError, match="fails for good"):
            result.get(timeout=30)
        # Then one row holds the call as it was sent, and its error
        row = wait_until(lambda: _row_of(result.id), 10, "the dead letter")
        assert row.task_name == task.name
        assert (row.args, row.kwargs, row.idempotency_key) == ([name], {"amount": 5}, key)
        assert (row.options["queue"], row.options.get("priority")) == ("celery", 3)
        assert row.error_type == "RuntimeError"
        assert row.error_message == f"{name} fails for good"
        assert row.traceback is not None and "RuntimeError" in row.traceback
        assert (row.retry_count, row.max_retries) == (0, 0)
        assert (row.status, row.next_retry_at) == (DeadLetterStatus.PERMANENT_FAILURE, None)
        assert row.created_at.tzinfo is not None
        assert row.failure_id == f"{result.id}:0"

    def test_exhausted_task_lands_pending_with_its_backoff(self) -> None:
        name, key = fresh("exhausted"), fresh("key")
        result = worker_app.flaky.apply_async((name, 99), idempotency_key=key)
        with pytest.raises(TimeoutError):
            result.get(timeout=30)
        row = wait_until(lambda: _row_of(result.id), 10, "the dead letter")
        assert ledger_events(name, "start") == 6  # the first run and five retries
        assert row.failure_id == f"{result.id}:5"
        assert row.max_retries == 3  # idempotency_dlq_max_retries' default
        assert row.error_type == "TimeoutError"

    def test_beat_retries_a_dead_letter_until_it_succeeds(self) -> None:
        # Given a task that fails twice in all: once, then once more on its own retry
        name, key = fresh("recovers"), fresh("key")
        result = worker_app.recovers_after.apply_async((name, 2), idempotency_key=key)
        with pytest.raises(TimeoutError):
            result.get(timeout=30)
        assert ledger_events(name, "start") == 2
        # When beat's sweep re-publishes it (same task id, same key)
        row = wait_until(
            lambda: (r := _row_of(result.id)) and r.status is DeadLetterStatus.SUCCEEDED and r,
            30,
            "the dead letter to succeed",
        )
        # Then it ran a third time and succeeded, and its key now answers from the cache
        assert ledger_events(name, "start") == 3
        assert row.retry_count == 0
        value = f"{name} recovered on run 3"
        assert app.AsyncResult(result.id).get(timeout=30) == value
        again = worker_app.recovers_after.apply_async((name, 2), idempotency_key=key)
        assert again.get(timeout=10) == value
        assert again.id == result.id
        assert ledger_events(name, "start") == 3

    def test_a_dead_letter_whose_retry_succeeds_goes_on_with_its_callbacks_and_chain(
        self,
    ) -> None:
        # Given a chain whose first step fails for good, and a call with a callback that does
        name, linked = fresh("chained"), fresh("linked")
        step = worker_app.recovers_after
        chained = (
            step.s(name, 2).set(idempotency_key=fresh("key")) | worker_app.noted_callback.s(name)
        ).apply_async()
        called = step.apply_async(
            (linked, 2), idempotency_key=fresh("key"), link=worker_app.noted_callback.s(linked)
        )
        with pytest.raises(TimeoutError):
            called.get(timeout=30)
        # When beat's sweep re-publishes them and they succeed
        for task_id in (chained.parent.id, called.id):
            wait_until(
                lambda task_id=task_id: (
                    (r := _row_of(task_id)) and r.status is DeadLetterStatus.SUCCEEDED
                ),
                30,
                "the dead letter to succeed",
            )
        # Then the rest of the chain runs, and the callback, each once
        wait_until(lambda: ledger_events(name, "callback") == 1, 30, "the chain's next step")
        wait_until(lambda: ledger_events(linked, "callback") == 1, 30, "the callback")
        time.sleep(0.5)
        # (the failed runs called nothing: every callback comes after the run that succeeded)
        assert ledger_sequence(name) == ledger_sequence(linked) == ["start"] * 3 + ["callback"]

    def test_a_dead_letter_keeps_datetimes_and_decimals_and_is_retried_with_them(self) -> None:
        # Given a task called with values JSON has no type for, that fails on its first run
        name, key = fresh("dated"), fresh("key")
        when = datetime(2026, 11, 25, 1, 2, 3, tzinfo=timezone.utc)
        result = worker_app.dated.apply_async((name, when, Decimal("9.90")), idempotency_key=key)
        with pytest.raises(RuntimeError, match="fails once"):
            result.get(timeout=30)
        # When beat's sweep re-publishes its dead letter
        row = wait_until(
            lambda: (r := _row_of(result.id)) and r.status is DeadLetterStatus.SUCCEEDED and r,
            30,
            "the dead letter to succeed",
        )
        # Then the retry got the very values of the first call
        assert row.task_id == result.id
        value = "datetime 2026-11-25T01:02:03+00:00 Decimal 9.90"
        assert app.AsyncResult(result.id).get(timeout=30) == value

    def test_dead_letter_retries_end_in_permanent_failure(self) -> None:
        name, key = fresh("forever"), fresh("key")
        result = worker_app.fails_forever.apply_async((name,), idempotency_key=key)
        with pytest.raises(RuntimeError):
            result.get(timeout=30)
        row = wait_until(
            lambda: (
                (r := _row_of(result.id)) and r.status is DeadLetterStatus.PERMANENT_FAILURE and r
            ),
            30,
            "permanent failure",
        )
        assert (row.retry_count, row.max_retries, row.next_retry_at) == (1, 1, None)
        assert ledger_events(name, "start") == 2  # the first run and one dead-letter retry

    def test_dlq_false_never_lands(self) -> None:
        name = fresh("nodlq")
        result = worker_app.fails_without_dlq.apply_async((name,), idempotency_key=fresh("k"))
        with pytest.raises(RuntimeError):
            result.get(timeout=30)
        assert _row_of(result.id) is None

    def test_key_mismatch_never_lands(self) -> None:
        name, key = fresh("mismatch"), fresh("key")
        worker_app.ledgered.apply_async((name,), idempotency_key=key).get(timeout=30)
        other = app.send_task(
            worker_app.ledgered.name, (fresh("other"),), headers={"idempotency_key": key}
        )
        with pytest.raises(IdempotencyKeyMismatch):
            other.get(timeout=30)
        assert _row_of(other.id) is None

    def test_a_dead_letter_whose_key_now_stands_for_other_arguments_gives_up(self) -> None:
        # Given a key completed by a call, and a dead letter of that key with other arguments
        # (the failed call its caller has since called again, corrected)
        key, corrected, failed = fresh("key"), fresh("corrected"), fresh("failed")
        worker_app.ledgered.apply_async((corrected,), idempotency_key=key).get(timeout=30)
        item = _seed_ledgered_dead_letter(fresh("task"), key, failed)
        # When beat's sweep re-publishes it, then its retry fails with the mismatch, which its
        # row records (it does not stay retrying), and the old arguments never run
        row = _given_up(item.id)
        assert (row.retry_count, row.error_type) == (1, "IdempotencyKeyMismatch")
        assert ledger_events(failed, "start") == 0

    def test_a_dead_letter_whose_retry_was_revoked_gives_up(self) -> None:
        # Given a dead letter whose task id the workers were told to revoke
        name, task_id = fresh("revoked"), fresh("task")
        app.control.revoke(task_id)
        time.sleep(1)  # the broadcast reaches the workers
        item = _seed_ledgered_dead_letter(task_id, fresh("key"), name)
        # When beat's sweep re-publishes it and a worker discards it, then its row records
        # the revoke as a failed retry (it does not stay retrying), and nothing ran
        row = _given_up(item.id)
        assert (row.retry_count, row.error_type) == (1, "TaskRevokedError")
        assert ledger_events(name, "start") == 0


@pytest.mark.usefixtures("workers_and_beat")
def test_a_keyed_message_with_a_task_id_no_store_keeps_fails_and_its_dead_letter_runs_it() -> None:
    # Given a keyed message sent by name with a task id of 300 characters (apply_async refuses
    # one; send_task does not look)
    name, key = fresh("long-id"), fresh("key")
    task_id = fresh("t").ljust(300, "x")
    result = app.send_task(
        worker_app.ledgered.name, (name,), task_id=task_id, headers={"idempotency_key": key}
    )
    # Then the worker fails it for good, with a clear error, running no body
    with pytest.raises(ValueError, match="300 characters long"):
        result.get(timeout=30)
    # And it waits in the dead-letter table under a task id that fits, whose retry runs it once
    fitted = wait_until(
        lambda: [row for row in dlq_for(app).items(limit=1000) if row.idempotency_key == key],
        10,
        "the dead letter",
    )[0].task_id
    assert len(fitted) == 255 and fitted.startswith(task_id[:200])
    row = wait_until(
        lambda: (r := _row_of(fitted)) and r.status is DeadLetterStatus.SUCCEEDED and r,
        30,
        "the dead letter to succeed",
    )
    assert (row.args, row.error_type) == ([name], "ValueError")
    assert ledger_events(name, "start") == 1
    assert app.AsyncResult(fitted).get(timeout=10) == name
