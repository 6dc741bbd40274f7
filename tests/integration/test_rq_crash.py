"""Crashes and outages with real ``rq worker`` processes: nothing runs twice, nothing is lost.

An ``rq worker`` killed mid-job: its key is taken over after the lease, and its abandoned job
is not lost.

How RQ itself recovers a job whose worker died: the job stays ``started`` in the queue's
``StartedJobRegistry`` until its execution entry expires (the last heartbeat plus at least
60 s), and the next maintenance run of any worker on that queue (every
``--maintenance-interval`` seconds, 10 min by default) calls ``StartedJobRegistry.cleanup()``:
a job with RQ retries left is re-enqueued, any other is failed as ``AbandonedJobError`` —
which ``IdempotentJob`` dead-letters, so the sweep retries it. This test calls that cleanup
itself, with a cut-off in the future, instead of waiting minutes for a worker to do it.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
import types
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from rq import Retry
from rq.command import send_stop_job_command
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import StartedJobRegistry

from idempotent_tasks.dlq import DeadLetterStatus
from idempotent_tasks.dlq.schema import dead_letters
from idempotent_tasks.keys import storage_key
from idempotent_tasks.records import Status
from idempotent_tasks.rq import IdempotentJob, IdempotentQueue, retry_dead_letters
from tests.integration import rq_jobs
from tests.integration.databases import set_pg_database_online
from tests.integration.redis_server import writes_held
from tests.integration.rq_support import (
    DLQ_DATABASE,
    RQEnv,
    RQWorker,
    rq_env_fixture,
    start_workers,
    status,
    wait_failed,
    wait_until,
    wait_value,
)

pytestmark = pytest.mark.slow
SLOW_FIRST = "tests.integration.rq_jobs.slow_first"


@pytest.fixture(scope="module")
def rq_env(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RQEnv]:
    yield from rq_env_fixture(redis_url, tmp_path_factory)


def test_a_worker_killed_mid_job_is_taken_over_after_the_lease_and_its_job_is_not_lost(
    rq_env: RQEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    name, key = f"killed-{uuid.uuid4().hex[:8]}", f"key-{uuid.uuid4().hex[:8]}"
    queue = _queue(rq_env, "crash")
    log_dir = tmp_path_factory.mktemp("rq-crash")
    workers: list[RQWorker] = start_workers(2, rq_env, [queue.name], log_dir, prefix="crash")
    try:
        # Given a keyed job (2 s lease) that one worker runs for a long time
        first = queue.enqueue(rq_jobs.slow_first, name, 60, idempotency_key=key)
        wait_until(lambda: rq_jobs.starts(name) == 1, 10, "the first run to start")
        running = next(w for w in workers if f"({first.id})" in w.log())
        idle = next(w for w in workers if w is not running)

        # When that worker and its work horse are killed
        running.kill()
        # Then, while the lease lasts, enqueueing the call again returns the dead owner's job
        # and enqueues nothing
        again = queue.enqueue(rq_jobs.slow_first, name, 60, idempotency_key=key)
        assert again.id == first.id and queue.count == 0

        # And once the lease has ended, a new enqueue runs on the other worker, taking over
        record_key = storage_key(SLOW_FIRST, key)

        def lease_ended() -> bool:
            record = queue.store.get(record_key)
            return record is not None and record.lease_expires_at < time.time()

        wait_until(lease_ended, 10, "the dead owner's lease to end")
        takeover = queue.enqueue(rq_jobs.slow_first, name, 60, idempotency_key=key)
        assert takeover.id != first.id
        value = wait_value(takeover)
        assert value == {"name": name, "run": 2}
        record = queue.store.get(record_key)
        assert record is not None and record.status is Status.COMPLETED
        assert record.token == 2 and record.task_id == takeover.id
        assert "took over key" in idle.log()

        # When RQ's maintenance finds the killed worker's job abandoned (no retries left)
        assert status(first).value == "started"
        StartedJobRegistry(queue.name, rq_env.connection, job_class=IdempotentJob).cleanup(
            timestamp=time.time() + 3600
        )
        # Then it is failed by RQ and dead-lettered by IdempotentJob
        assert status(first).value == "failed"
        (row,) = rq_env.rows_of(first.id)
        assert row.error_type == "AbandonedJobError" and row.idempotency_key == key
        assert row.status is DeadLetterStatus.PENDING

        # And the sweep re-enqueues it: it answers from the cache and its row succeeds
        rq_env.dlq.retry_now(row.id)
        assert retry_dead_letters(rq_env.connection, rq_env.dlq_url) == 1
        assert wait_value(first) == value
        wait_until(
            lambda: rq_env.dlq.get(row.id).status is DeadLetterStatus.SUCCEEDED,  # type: ignore[union-attr]
            10,
            "the row to be marked succeeded",
        )
        assert rq_jobs.starts(name) == 2
    finally:
        for worker in workers:
            worker.stop()


@pytest.mark.parametrize(
    ("function", "more", "error_type"),
    [(rq_jobs.flaky, 99, "TimeoutError"), (rq_jobs.fails_after, 2.5, "ValueError")],
    # Late: it fails 2.5 s into its 4 s timeout, and the pause before it goes back to its
    # queue (2 s, half the timeout) outlasts the timeout.
    ids=["at-once", "late-in-its-timeout"],
)
def test_a_final_failure_whose_dead_letter_cannot_be_written_is_written_later(
    rq_env: RQEnv,
    tmp_path_factory: pytest.TempPathFactory,
    function: Any,
    more: float,
    error_type: str,
) -> None:
    name = f"outage-{uuid.uuid4().hex[:8]}"
    queue = _queue(rq_env, "outage")
    workers = start_workers(1, rq_env, [queue.name], tmp_path_factory.mktemp("rq-outage"))
    try:
        # Given the dead-letter database refusing connections
        set_pg_database_online(DLQ_DATABASE, False)
        try:
            # When a job fails for good (a 4 s timeout: it looks again every 2 s)
            job = queue.enqueue(function, name, more, idempotency_key=name, job_timeout=4)
            wait_until(lambda: rq_jobs.starts(name) == 1, 10, "the job to run")
            # Then it goes back to its queue rather than fail unrecorded
            _wait_carrying_its_failure(job)
        finally:
            set_pg_database_online(DLQ_DATABASE, True)
        # And once the database is back, its dead letter is written and the job fails
        wait_failed(job, timeout=20)
        (row,) = rq_env.rows_of(job.id)
        assert row.error_type == error_type and row.idempotency_key == name
        assert row.status is DeadLetterStatus.PENDING
        assert "unwritten_failure" not in job.get_meta()["idempotency"]
        # Without running the body again
        assert rq_jobs.starts(name) == 1
    finally:
        for worker in workers:
            worker.stop()


@pytest.mark.parametrize("dlq", [True, False], ids=["dlq", "no-dlq"])
def test_a_work_horse_killed_mid_job_is_dead_lettered_and_its_key_released(
    dlq: bool, rq_env: RQEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    job_function = rq_jobs.slow_first if dlq else rq_jobs.slow_first_without_dlq
    task_name = f"tests.integration.rq_jobs.{job_function.__name__}"
    name, key = f"horse-{uuid.uuid4().hex[:8]}", f"key-{uuid.uuid4().hex[:8]}"
    queue = _queue(rq_env, "horse")
    (worker,) = start_workers(1, rq_env, [queue.name], tmp_path_factory.mktemp("rq-horse"))
    try:
        # Given a keyed job that runs for a long time
        first = queue.enqueue(job_function, name, 60, idempotency_key=key)
        wait_until(lambda: rq_jobs.starts(name) == 1, 10, "the first run to start")
        # When its work horse alone is killed (out of memory, say): the worker lives on
        _kill_work_horse(worker)
        # Then RQ fails the job, and IdempotentJob dead-letters it (unless dlq=False)
        wait_failed(first)
        if dlq:
            (row,) = wait_until(lambda: rq_env.rows_of(first.id), 10, "the dead letter")
            assert (row.error_type, row.idempotency_key) == ("WorkHorseKilled", key)
        else:
            wait_until(
                lambda: queue.store.get(storage_key(task_name, key)) is None, 10, "the release"
            )
            assert rq_env.rows_of(first.id) == []
        # And releases its key: a new call runs at once, not once the dead claim's lease ends
        assert queue.store.get(storage_key(task_name, key)) is None
        again = queue.enqueue(job_function, name, 60, idempotency_key=key)
        assert again.id != first.id
        assert wait_value(again) == {"name": name, "run": 2}
        assert worker.process.poll() is None
    finally:
        worker.stop()


def test_a_work_horse_killed_with_an_rq_retry_left_frees_its_key_for_the_retry(
    rq_env: RQEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    name, key = f"horse-retry-{uuid.uuid4().hex[:8]}", f"key-{uuid.uuid4().hex[:8]}"
    queue = _queue(rq_env, "horse-retry")
    (worker,) = start_workers(1, rq_env, [queue.name], tmp_path_factory.mktemp("rq-horse-retry"))
    try:
        # Given a keyed job with one RQ retry left, whose lease (its job timeout) is long
        first = queue.enqueue(
            rq_jobs.slow_first_long_lease,
            name,
            60,
            idempotency_key=key,
            retry=Retry(max=1),
            job_timeout=300,
        )
        wait_until(lambda: rq_jobs.starts(name) == 1, 10, "the first run to start")
        # When its work horse is killed
        _kill_work_horse(worker)
        # Then RQ's retry claims the key afresh and runs now, not once the 300 s lease ends
        assert wait_value(first, timeout=30) == {"name": name, "run": 2}
        assert rq_env.rows_of(first.id) == []
    finally:
        worker.stop()


def test_the_retry_of_a_killed_work_horses_job_waits_for_the_duplicate_that_took_its_key(
    rq_env: RQEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    name = f"horse-skip-{uuid.uuid4().hex[:8]}"
    queues = [_queue(rq_env, f"horse-skip-{side}") for side in ("a", "b")]
    folder = tmp_path_factory.mktemp("rq-horse-skip")
    (first_worker,) = start_workers(1, rq_env, [queues[0].name], folder, prefix="a")
    (second_worker,) = start_workers(1, rq_env, [queues[1].name], folder, prefix="b")
    try:
        # Given a running job of a function whose duplicates are skipped, with an RQ retry
        # left, and a job queued behind it
        job = queues[0].enqueue(rq_jobs.record_or_skip, name, 6, retry=Retry(max=1))
        wait_until(lambda: rq_jobs.starts(name) == 1, 10, "the first run to start")
        queues[0].enqueue(rq_jobs.record, f"{name}-behind", 0, 4.0)
        # When its work horse is killed (its key released for RQ's retry, queued behind the
        # other job), and a new call of the key runs meanwhile on another worker
        _kill_work_horse(first_worker)
        wait_until(lambda: rq_jobs.starts(f"{name}-behind") == 1, 10, "the job behind to start")
        duplicate = queues[1].enqueue(rq_jobs.record_or_skip, name, 6)
        wait_until(lambda: rq_jobs.starts(name) == 2, 10, "the new call to run")
        # Then the retry is no duplicate to skip: the call that held the key waits for its value
        expected = {"name": name, "value": 0, "run": 2}
        assert wait_value(job, timeout=30) == expected == wait_value(duplicate, timeout=5)
        assert rq_jobs.starts(name) == 2
    finally:
        first_worker.stop()
        second_worker.stop()


@pytest.mark.parametrize("made_by", ["IdempotentQueue", "plain Queue"])
def test_a_work_horse_killed_while_the_dead_letter_database_is_down_is_written_later(
    rq_env: RQEnv,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    made_by: str,
) -> None:
    name, key = f"horse-down-{uuid.uuid4().hex[:8]}", f"key-{uuid.uuid4().hex[:8]}"
    queue_name = f"it-rq-horse-down-{uuid.uuid4().hex[:8]}"
    # A plain Queue's job of an @idempotent function has no meta of ours (and no key): its
    # worker's dead letters go to the test's database by the environment
    monkeypatch.setenv("IDEMPOTENT_TASKS_DLQ_URL", rq_env.dlq_url)
    plain = made_by == "plain Queue"
    queue = (
        Queue(queue_name, connection=rq_env.connection)
        if plain
        else IdempotentQueue(queue_name, connection=rq_env.connection, dlq_url=rq_env.dlq_url)
    )
    (worker,) = start_workers(1, rq_env, [queue.name], tmp_path_factory.mktemp("rq-horse-down"))
    try:
        # Given a job that runs for a long time (keyed, when an IdempotentQueue made it)
        options = {} if plain else {"idempotency_key": key}
        job = queue.enqueue(rq_jobs.slow_first, name, 60, **options)
        # and a job that depends on it
        dependent = queue.enqueue(rq_jobs.record, f"{name}-next", 1, depends_on=job)
        wait_until(lambda: rq_jobs.starts(name) == 1, 10, "the first run to start")
        # When its work horse is killed while the dead-letter database refuses connections
        set_pg_database_online(DLQ_DATABASE, False)
        try:
            _kill_work_horse(worker)
            # Then the job goes back to its queue carrying the failure, rather than fail
            # unrecorded
            _wait_carrying_its_failure(job)
        finally:
            set_pg_database_online(DLQ_DATABASE, True)
        # And once the database is back, its dead letter is written and the job fails
        wait_failed(job, timeout=30)
        (row,) = rq_env.rows_of(job.id)
        assert (row.error_type, row.idempotency_key) == ("WorkHorseKilled", None if plain else key)
        assert row.status is DeadLetterStatus.PENDING
        assert "unwritten_failure" not in job.get_meta()["idempotency"]
        # Without running the body again, and with its key (if any) released
        assert rq_jobs.starts(name) == 1
        if isinstance(queue, IdempotentQueue):
            assert queue.store.get(storage_key(SLOW_FIRST, key)) is None
        # And the job that depends on it never ran: it waits for a parent that never finished
        assert rq_jobs.starts(f"{name}-next") == 0
        assert status(dependent) is JobStatus.DEFERRED
        assert worker.process.poll() is None
    finally:
        worker.stop()


def test_a_failure_whose_dead_letter_write_outlasts_the_job_timeout_is_still_written(
    rq_env: RQEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    name = f"late-{uuid.uuid4().hex[:8]}"
    queue = _queue(rq_env, "late")
    (worker,) = start_workers(1, rq_env, [queue.name], tmp_path_factory.mktemp("rq-late"))
    rq_env.dlq.ensure_schema()
    engine = sa.create_engine(rq_env.dlq_url)
    try:
        with engine.connect() as locker:
            # Given the dead-letter table locked, so that writing a row waits
            locker.execute(sa.text(f"LOCK TABLE {dead_letters.name} IN ACCESS EXCLUSIVE MODE"))
            # When a keyed job fails 1 s into its 2 s timeout: RQ's death penalty fires while
            # its dead letter is being written
            job = queue.enqueue(rq_jobs.fails_after, name, 1.0, idempotency_key=name, job_timeout=2)
            wait_until(lambda: rq_jobs.starts(name) == 1, 10, "the job to run")
            time.sleep(3)
            locker.rollback()
        # Then the dead letter is written all the same, with the function's own error
        wait_failed(job, timeout=20)
        (row,) = wait_until(lambda: rq_env.rows_of(job.id), 10, "the dead letter")
        assert (row.error_type, row.idempotency_key) == ("ValueError", name)
        assert rq_jobs.starts(name) == 1
    finally:
        engine.dispose()
        worker.stop()


def test_a_result_stored_after_the_job_timeout_fired_still_finishes_the_job(
    rq_env: RQEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    name = f"late-result-{uuid.uuid4().hex[:8]}"
    queue = IdempotentQueue(
        f"it-rq-late-result-{uuid.uuid4().hex[:8]}", connection=rq_env.connection
    )
    (worker,) = start_workers(1, rq_env, [queue.name], tmp_path_factory.mktemp("rq-late-result"))
    try:
        job = queue.enqueue(rq_jobs.record, name, 7, 2.0, idempotency_key=name, job_timeout=3)
        wait_until(lambda: rq_jobs.starts(name) == 1, 10, "the job to run")
        # Given Redis holding every write for 3.5 s: the function returns 2 s into its 3 s
        # timeout, and storing its result waits until after RQ's death penalty fired
        with writes_held(rq_env.connection, 3.5):
            # Then the job finishes with its value, stored for duplicates, having run once
            assert wait_value(job) == {"name": name, "value": 7, "run": 1}
        record = queue.store.get(storage_key("tests.integration.rq_jobs.record", name))
        assert record is not None and record.status is Status.COMPLETED
        assert rq_jobs.starts(name) == 1
    finally:
        worker.stop()


def test_a_failure_whose_key_release_outlasts_the_job_timeout_is_still_dead_lettered(
    rq_env: RQEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    name = f"late-release-{uuid.uuid4().hex[:8]}"
    queue = _queue(rq_env, "late-release")
    (worker,) = start_workers(1, rq_env, [queue.name], tmp_path_factory.mktemp("rq-late-release"))
    try:
        job = queue.enqueue(rq_jobs.fails_after, name, 2.0, idempotency_key=name, job_timeout=3)
        wait_until(lambda: rq_jobs.starts(name) == 1, 10, "the job to run")
        # Given Redis holding every write for 3.5 s: the function fails 2 s into its 3 s
        # timeout, and releasing its key waits until after RQ's death penalty fired
        with writes_held(rq_env.connection, 3.5):
            # Then its key is released and its dead letter written, with its own error
            wait_failed(job)
        (row,) = wait_until(lambda: rq_env.rows_of(job.id), 10, "the dead letter")
        assert (row.error_type, row.idempotency_key) == ("ValueError", name)
        assert queue.store.get(storage_key("tests.integration.rq_jobs.fails_after", name)) is None
        assert rq_jobs.starts(name) == 1
    finally:
        worker.stop()


def _queue(rq_env: RQEnv, label: str) -> IdempotentQueue:
    """An ``IdempotentQueue`` of this test's own, writing dead letters to the test's table."""
    return IdempotentQueue(
        f"it-rq-{label}-{uuid.uuid4().hex[:8]}",
        connection=rq_env.connection,
        dlq_url=rq_env.dlq_url,
    )


def _wait_carrying_its_failure(job: Job) -> None:
    """Wait until ``job`` went back to its queue carrying the failure it could not write."""
    wait_until(
        lambda: job.get_meta().get("idempotency", {}).get("unwritten_failure"),
        10,
        "the unwritten failure to be carried by the job",
    )
    assert status(job).value != "failed"


def _kill_work_horse(worker: RQWorker) -> None:
    """SIGKILL ``worker``'s work horse alone (out of memory, say): the worker lives on."""
    (horse,) = subprocess.run(
        ["pgrep", "-P", str(worker.process.pid)], capture_output=True, text=True, check=True
    ).stdout.split()
    os.kill(int(horse), signal.SIGKILL)


def test_a_stopped_job_frees_its_key_and_a_new_enqueue_runs(
    rq_env: RQEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    name, key = f"stopped-{uuid.uuid4().hex[:8]}", f"key-{uuid.uuid4().hex[:8]}"
    queue = _queue(rq_env, "stop")
    workers = start_workers(1, rq_env, [queue.name], tmp_path_factory.mktemp("rq-stop"))
    try:
        # Given a keyed job running long
        first = queue.enqueue(rq_jobs.slow_first, name, 60, idempotency_key=key)
        wait_until(lambda: rq_jobs.starts(name) == 1, 10, "the job to start")
        # When it is stopped on purpose
        send_stop_job_command(rq_env.connection, first.id)
        wait_until(lambda: status(first).value == "stopped", 10, "the job to stop")
        # Then its key is freed (not dead-lettered), and the call enqueued again runs
        wait_until(lambda: queue.store.get(storage_key(SLOW_FIRST, key)) is None, 10, "the release")
        again = queue.enqueue(rq_jobs.slow_first, name, 0, idempotency_key=key)
        assert again.id != first.id
        assert wait_value(again)["run"] == 2
        assert rq_env.rows_of(first.id) == []
    finally:
        for worker in workers:
            worker.stop()


def test_a_dead_letters_retry_stopped_while_it_ran_records_it_on_its_row(
    rq_env: RQEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    name, key = f"stopped-retry-{uuid.uuid4().hex[:8]}", f"key-{uuid.uuid4().hex[:8]}"
    queue_name = f"it-rq-stop-retry-{uuid.uuid4().hex[:8]}"
    workers = start_workers(1, rq_env, [queue_name], tmp_path_factory.mktemp("rq-stop-retry"))
    try:
        # Given a dead letter of a long keyed job, re-enqueued by the sweep and running
        job_id, item = rq_env.seed_dead_letter(SLOW_FIRST, key, [name, 60], queue_name)
        assert rq_env.dlq.retry_now(item.id)
        assert retry_dead_letters(rq_env.connection, rq_env.dlq_url) == 1
        wait_until(lambda: rq_jobs.starts(name) == 1, 10, "the retry to start")
        # When it is stopped on purpose
        send_stop_job_command(rq_env.connection, job_id)

        # Then its row records a failed retry, rather than stay retrying to be sent again
        def recorded() -> bool:
            row = rq_env.dlq.get(item.id)
            return row is not None and row.status is DeadLetterStatus.PENDING

        wait_until(recorded, 10, "the stop on the row")
        row = rq_env.dlq.get(item.id)
        assert row is not None and (row.retry_count, row.error_type) == (1, "StopJobCommand")
    finally:
        for worker in workers:
            worker.stop()


def test_a_dead_letters_job_cancelled_once_sent_again_is_not_sent_again(
    rq_env: RQEnv,
) -> None:
    # Given a dead letter the sweep sent again, onto a queue no worker serves yet
    name, key = f"cancelled-{uuid.uuid4().hex[:8]}", f"key-{uuid.uuid4().hex[:8]}"
    queue_name = f"it-rq-cancel-{uuid.uuid4().hex[:8]}"
    job_id, item = rq_env.seed_dead_letter(SLOW_FIRST, key, [name, 0], queue_name)
    assert rq_env.dlq.retry_now(item.id)
    assert retry_dead_letters(rq_env.connection, rq_env.dlq_url) == 1
    # When an operator cancels its job, and its row is later found stuck retrying (an hour on)
    Job.fetch(job_id, connection=rq_env.connection).cancel()
    engine = sa.create_engine(rq_env.dlq_url)
    try:
        with engine.begin() as connection:
            connection.execute(
                dead_letters.update()
                .where(dead_letters.c.id == item.id)
                .values(updated_at=dead_letters.c.updated_at - timedelta(hours=2))
            )
    finally:
        engine.dispose()
    assert retry_dead_letters(rq_env.connection, rq_env.dlq_url) == 0
    # Then the job stays cancelled, and the row is given up, its failure kept, saying why
    assert Job.fetch(job_id, connection=rq_env.connection).get_status() is JobStatus.CANCELED
    row = rq_env.dlq.get(item.id)
    assert row is not None and row.status is DeadLetterStatus.PERMANENT_FAILURE
    assert (row.retry_count, row.error_type) == (item.retry_count, item.error_type)
    assert "[not sent again: " in (row.error_message or "")
    assert "cancelled" in (row.error_message or "")


def test_a_keyed_job_whose_data_this_worker_cannot_read_is_dead_lettered(
    rq_env: RQEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    name, key = f"ghost-{uuid.uuid4().hex[:8]}", f"key-{uuid.uuid4().hex[:8]}"
    queue = _queue(rq_env, "ghost")
    # Given a keyed job whose arguments name a class the worker cannot import (a newer
    # producer's, in a rolling deploy)
    job = queue.enqueue(rq_jobs.record, name, 1, idempotency_key=key)
    rq_env.connection.hset(job.key, "data", _pickled_with_a_ghost(job.func_name, name))
    # When a worker takes it
    (worker,) = start_workers(1, rq_env, [queue.name], tmp_path_factory.mktemp("rq-ghost"))
    try:
        # Then it fails without running, and waits in the dead-letter table, whence only RQ's
        # own copy can be sent again (nothing of its call could be read)
        wait_failed(job, timeout=20)
        (row,) = wait_until(lambda: rq_env.rows_of(job.id), 10, "the dead letter")
        assert (row.idempotency_key, row.task_name) == (key, rq_jobs.__name__ + ".record")
        assert row.options.get("args_lossy") is True
        assert "DeserializationError" in row.error_type + (row.traceback or "")
        assert rq_jobs.starts(name) == 0
    finally:
        worker.stop()


def _pickled_with_a_ghost(func_name: str, name: str) -> bytes:
    """An RQ job's data for ``func_name(name, <an object of a module no worker has>)``."""
    ghost_module = types.ModuleType("it_rq_ghost_module")

    class Ghost:
        pass

    Ghost.__module__, Ghost.__qualname__ = ghost_module.__name__, "Ghost"
    ghost_module.Ghost = Ghost  # type: ignore[attr-defined]
    sys.modules[ghost_module.__name__] = ghost_module
    try:
        return pickle.dumps((func_name, None, (name, Ghost()), {}))
    finally:
        del sys.modules[ghost_module.__name__]
