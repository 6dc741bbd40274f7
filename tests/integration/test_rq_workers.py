"""``IdempotentJob`` in real ``rq worker`` processes: duplicates, retries and dead letters.

Two workers (each forking a work horse per job) consume one queue shared by this module; every
test uses keys and ledger names of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from rq import Callback, Queue, Retry
from rq.job import JobStatus
from rq.results import Result

from idempotent_tasks.dlq import DeadLetterStatus
from idempotent_tasks.keys import storage_key
from idempotent_tasks.records import CompleteOutcome, Outcome, Status
from idempotent_tasks.rq import CachedResultJob, IdempotentJob, IdempotentQueue, retry_dead_letters
from idempotent_tasks.rq.job import CODEC
from idempotent_tasks.rq.options import META_KEY
from tests.integration import rq_jobs
from tests.integration.rq_support import (
    ROOT,
    RQEnv,
    RQWorker,
    rq_env_fixture,
    start_workers,
    status,
    taker_of,
    wait_failed,
    wait_until,
    wait_value,
)

FLAKY = "tests.integration.rq_jobs.flaky"
RECORD = "tests.integration.rq_jobs.record"
RECORD_KEYED = "tests.integration.rq_jobs.record_keyed"


@pytest.fixture(scope="module")
def rq_env(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RQEnv]:
    yield from rq_env_fixture(redis_url, tmp_path_factory)


@pytest.fixture(scope="module")
def queue_name() -> str:
    return f"it-rq-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def workers(
    rq_env: RQEnv, queue_name: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[RQWorker]]:
    started = start_workers(2, rq_env, [queue_name], tmp_path_factory.mktemp("rq-workers"))
    yield started
    for worker in started:
        worker.stop()


@pytest.fixture()
def queue(rq_env: RQEnv, queue_name: str, workers: list[RQWorker]) -> IdempotentQueue:
    return IdempotentQueue(queue_name, connection=rq_env.connection, dlq_url=rq_env.dlq_url)


def fresh(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:10]}"


def logs(workers: list[RQWorker]) -> str:
    return "\n".join(worker.log() for worker in workers)


def test_duplicates_enqueued_at_once_run_once_and_share_the_result(
    queue: IdempotentQueue,
) -> None:
    # Given eight producers enqueueing the same call with the same key at the same moment
    name, key = fresh("dup"), fresh("key")
    barrier = threading.Barrier(8)

    def enqueue(_: int) -> Any:
        barrier.wait()
        return queue.enqueue(rq_jobs.record, name, 5, 1.0, idempotency_key=key)

    with ThreadPoolExecutor(8) as pool:
        jobs = list(pool.map(enqueue, range(8)))
    # When both workers have consumed whatever was enqueued
    values = [wait_value(job) for job in jobs]
    # Then the body ran once and every producer's job answers with its value
    assert rq_jobs.starts(name) == 1
    assert values == [{"name": name, "value": 5, "run": 1}] * 8
    # And a later duplicate enqueues nothing and answers from the cache
    later = queue.enqueue(rq_jobs.record, name, 5, 1.0, idempotency_key=key)
    assert isinstance(later, CachedResultJob)
    assert later.return_value() == values[0]
    assert later.id in {job.id for job in jobs}


def test_a_duplicate_that_outwaits_its_slice_goes_back_to_the_queue_and_ends_with_the_value(
    queue: IdempotentQueue, rq_env: RQEnv
) -> None:
    # Given a keyed job running for 2 s (its duplicates wait 0.3 s per turn in a worker)
    name = fresh("slice")
    owner = queue.enqueue(rq_jobs.record_keyed, name, 3, 2.0)
    wait_until(lambda: rq_jobs.starts(name) == 1, 10, "the owner to start")
    # When a duplicate arrives through a plain rq.Queue (no publish-side look: the worker
    # derives the key from the function's template)
    plain = Queue(queue.name, connection=rq_env.connection, job_class=IdempotentJob)
    duplicate = plain.enqueue(rq_jobs.record_keyed, name, 3, 2.0)
    # Then it goes back to the queue while the owner runs, and ends with the owner's value
    assert wait_value(duplicate) == wait_value(owner) == {"name": name, "value": 3, "run": 1}
    assert rq_jobs.starts(name) == 1
    assert duplicate.get_meta()[META_KEY]["waits"] >= 1  # turns it went back to the queue
    assert [result.type for result in duplicate.results()] == [Result.Type.SUCCESSFUL]


def test_a_job_running_past_its_lease_keeps_its_key_while_it_lives(
    queue: IdempotentQueue, rq_env: RQEnv
) -> None:
    # Given a keyed job whose claim lives 2 s without a heartbeat, running for 6 s
    name, key = fresh("renewed"), fresh("key")
    owner = queue.enqueue(rq_jobs.slow_first, name, 6, idempotency_key=key)
    wait_until(lambda: rq_jobs.starts(name) == 1, 10, "the owner to start")
    # When, past two of its leases, the call is enqueued again, and a duplicate arrives
    # through a plain rq.Queue (no publish-side look) for the idle worker
    time.sleep(4)
    again = queue.enqueue(rq_jobs.slow_first, name, 6, idempotency_key=key)
    plain = Queue(queue.name, connection=rq_env.connection, job_class=IdempotentJob)
    duplicate = plain.enqueue(rq_jobs.slow_first, name, 6, meta={META_KEY: {"key": key}})
    # Then the running owner still holds the key: the call gets the owner's job, the duplicate
    # waits for it, and the body ran once
    assert again.id == owner.id
    expected = {"name": name, "run": 1}
    assert wait_value(duplicate, timeout=30) == wait_value(owner, timeout=30) == expected
    assert rq_jobs.starts(name) == 1


def test_a_skipping_owner_taken_over_mid_run_waits_for_the_new_owners_value(
    queue: IdempotentQueue,
) -> None:
    # Given a job of a skipping function running its body
    name = fresh("superseded")
    owner = queue.enqueue(rq_jobs.record_or_skip, name, 3.0)
    wait_until(lambda: rq_jobs.starts(name) == 1, 10, "the owner to start")
    stored = storage_key(f"{rq_jobs.__name__}.record_or_skip", f"skip:{name}")
    held = queue.store.get(stored)
    assert held is not None and held.task_id == owner.id
    # When another call takes its key over meanwhile (as after a lease lost to a stalled
    # store), and has not finished when the owner's body ends
    taker = taker_of(held, stored, f"skip:{name}")
    claimed = queue.store.claim(taker)
    assert claimed.outcome is Outcome.ACQUIRED and claimed.token is not None
    wait_until(
        lambda: (
            status(owner) is JobStatus.FINISHED
            or (owner.get_meta().get(META_KEY) or {}).get("superseded")
        ),
        20,
        "the owner's body to end",
    )
    # Then the owner, no duplicate to drop, waits for the taker's value rather than end
    # with None, and gets it once the taker completes
    assert status(owner) is not JobStatus.FINISHED, owner.return_value()
    value = {"name": name, "value": 7, "run": 2}
    encoded, _ = CODEC.encode(value)
    assert queue.store.complete(taker, claimed.token, encoded) is CompleteOutcome.STORED
    assert wait_value(owner, timeout=30) == value
    assert rq_jobs.starts(name) == 1


@pytest.mark.parametrize("mode", ["skip", "raise"])
def test_duplicates_of_skip_and_raise_functions(
    queue: IdempotentQueue, rq_env: RQEnv, mode: str
) -> None:
    # Given a keyed job running for 1.5 s on one worker, whose function skips or fails its
    # duplicates
    function = rq_jobs.record_or_skip if mode == "skip" else rq_jobs.record_or_raise
    name = fresh(mode)
    owner = queue.enqueue(function, name, 1.5)
    wait_until(lambda: rq_jobs.starts(name) == 1, 10, "the owner to start")
    # When a duplicate reaches the other worker meanwhile
    plain = Queue(queue.name, connection=rq_env.connection, job_class=IdempotentJob)
    duplicate = plain.enqueue(function, name, 1.5)
    if mode == "skip":
        # Then it finishes with None, running nothing
        assert wait_value(duplicate) is None
    else:
        # Then it fails with a conflict, neither retried nor dead-lettered
        wait_failed(duplicate)
        latest = duplicate.latest_result()
        assert latest is not None and "IdempotencyConflict" in (latest.exc_string or "")
        assert rq_env.rows_of(duplicate.id) == []
    assert wait_value(owner) == {"name": name, "value": 0, "run": 1}
    assert rq_jobs.starts(name) == 1


def test_a_retried_job_releases_its_key_and_claims_it_again(
    queue: IdempotentQueue, workers: list[RQWorker]
) -> None:
    # Given a job that fails twice and may be retried twice by RQ
    name, key = fresh("retry"), fresh("key")
    job = queue.enqueue(rq_jobs.flaky, name, 2, idempotency_key=key, retry=Retry(max=2))
    # Then its third run succeeds: each retry claimed the released key afresh (no takeover)
    assert wait_value(job) == {"name": name, "run": 3}
    assert rq_jobs.starts(name) == 3
    record = queue.store.get(storage_key(FLAKY, key))
    assert record is not None and record.status is Status.COMPLETED
    assert record.token == 3 and record.task_id == job.id
    assert "took over key" not in logs(workers)
    # And a duplicate is answered from the cache, as the original job
    again = queue.enqueue(rq_jobs.flaky, name, 2, idempotency_key=key, retry=Retry(max=2))
    assert again.id == job.id and again.return_value() == {"name": name, "run": 3}


def test_an_exhausted_job_is_dead_lettered_and_swept_once(
    queue: IdempotentQueue, rq_env: RQEnv
) -> None:
    # Given a job that always fails, retried once by RQ
    name, key = fresh("dead"), fresh("key")
    job = queue.enqueue(rq_jobs.flaky, name, 99, idempotency_key=key, retry=Retry(max=1))
    wait_failed(job)
    assert rq_jobs.starts(name) == 2
    # Then its final failure is a pending dead letter, and its key is free again
    (row,) = rq_env.rows_of(job.id)
    assert row.status is DeadLetterStatus.PENDING
    assert (row.task_name, row.args, row.kwargs) == (FLAKY, [name, 99], {})
    assert row.options == {
        "queue": queue.name,
        "framework": "rq",
        # what a re-enqueue needs should RQ no longer have the job (never the stores' URLs)
        "prefix": "idempotent_tasks",
        "task_name": "tests.integration.rq_jobs.flaky",
        "timeout": 180,
        "own_store": False,
    }
    assert row.idempotency_key == key and row.error_type == "TimeoutError"
    assert queue.store.get(storage_key(FLAKY, key)) is None

    # When it is due and two sweeps run at once
    rq_env.dlq.retry_now(row.id)
    with ThreadPoolExecutor(2) as pool:
        counts = list(
            pool.map(lambda _: retry_dead_letters(rq_env.connection, rq_env.dlq_url), range(2))
        )
    # Then the job was re-enqueued once (the same job), ran once more and failed again: the
    # row is rescheduled with one retry used
    assert sum(counts) == 1
    wait_until(
        lambda: rq_env.dlq.get(row.id).retry_count == 1,  # type: ignore[union-attr]
        20,
        "the re-run's failure to be recorded",
    )
    item = rq_env.dlq.get(row.id)
    assert item is not None and item.status is DeadLetterStatus.PENDING
    assert rq_jobs.starts(name) == 3
    # RQ marks the job failed after our failure hook has written the row: wait for it too
    wait_until(lambda: status(job) is JobStatus.FAILED, 20, "the re-run to be marked failed")
    assert rq_env.rows_of(job.id) == [item]
    assert retry_dead_letters(rq_env.connection, rq_env.dlq_url) == 0


def test_a_dead_letter_whose_function_recovers_ends_succeeded_through_the_cli(
    queue: IdempotentQueue, rq_env: RQEnv
) -> None:
    # Given a dead-lettered job whose function fails twice only (unkeyed: still dead-lettered)
    name = fresh("recover")
    job = queue.enqueue(rq_jobs.flaky, name, 2, retry=Retry(max=1))
    wait_failed(job)
    (row,) = rq_env.rows_of(job.id)
    assert row.idempotency_key is None
    rq_env.dlq.retry_now(row.id)
    # When the installed sweep command runs, the table named by the environment
    swept = subprocess.run(
        [
            str(Path(sys.executable).with_name("idempotent-tasks")),
            "rq",
            "retry-dead-letters",
            "--redis-url",
            rq_env.rq_url,
        ],
        cwd=ROOT,
        env={**os.environ, "IDEMPOTENT_TASKS_DLQ_URL": rq_env.dlq_url},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert swept.stdout.strip() == "re-enqueued 1 dead letter"
    # Then the same job runs again, succeeds, and its row is marked succeeded
    assert wait_value(job) == {"name": name, "run": 3}
    wait_until(
        lambda: rq_env.dlq.get(row.id).status is DeadLetterStatus.SUCCEEDED,  # type: ignore[union-attr]
        10,
        "the row to be marked succeeded",
    )


def test_a_duplicate_that_gets_the_key_after_waiting_runs_the_body_with_its_whole_timeout(
    queue: IdempotentQueue, rq_env: RQEnv
) -> None:
    # Given a keyed job that fails for good 3 s into its first run (an 8 s timeout)
    name = fresh("late-key")
    owner = queue.enqueue(rq_jobs.fails_first_then_takes, name, 3.0, 5.0, job_timeout=8)
    wait_until(lambda: rq_jobs.starts(name) == 1, 10, "the owner to start")
    # When a duplicate, through a plain rq.Queue, waits for the key (up to half its 8 s
    # timeout) and gets it once the owner released it, about 3.75 s into its run
    plain = Queue(queue.name, connection=rq_env.connection, job_class=IdempotentJob)
    duplicate = plain.enqueue(rq_jobs.fails_first_then_takes, name, 3.0, 5.0, job_timeout=8)
    wait_failed(owner)
    # Then its 5 s body runs in a run of its own, with the whole timeout, and succeeds: in
    # the run that waited it would have had about 4 s
    assert wait_value(duplicate, timeout=30) == {"name": name, "run": 2}
    assert [result.type for result in duplicate.results()] == [Result.Type.SUCCESSFUL]
    assert rq_jobs.starts(name) == 2


def test_a_dead_letters_job_whose_key_stands_for_other_arguments_records_it_on_its_row(
    queue: IdempotentQueue, rq_env: RQEnv
) -> None:
    # Given a dead letter of record(name, 1) under a key, whose caller then called again with
    # corrected arguments, record(name, 2), which completed under the same key
    name, key = fresh("corrected"), fresh("key")
    _, item = rq_env.seed_dead_letter(RECORD, key, [name, 1], queue.name)
    corrected = queue.enqueue(rq_jobs.record, name, 2, idempotency_key=key)
    assert wait_value(corrected) == {"name": name, "value": 2, "run": 1}
    # When the sweep sends the dead letter again
    assert rq_env.dlq.retry_now(item.id)
    assert retry_dead_letters(rq_env.connection, rq_env.dlq_url) == 1

    # Then its run fails with the mismatch and its row records a failed retry, rather than
    # stay retrying and, once the key expired, run the old arguments
    def recorded() -> bool:
        row = rq_env.dlq.get(item.id)
        return row is not None and row.status is DeadLetterStatus.PENDING

    wait_until(recorded, 20, "the mismatch on the row")
    row = rq_env.dlq.get(item.id)
    assert row is not None
    assert (row.retry_count, row.error_type) == (1, "IdempotencyKeyMismatch")
    assert rq_jobs.starts(name) == 1


def test_jobs_enqueued_by_a_path_the_producer_cannot_import_match_however_called(
    queue: IdempotentQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a producer that cannot import the function it enqueues by its dotted path (a web
    # app without the workers' code), and a key completed by a positional call
    def cannot_import(path: str) -> Any:
        raise ImportError(path)

    monkeypatch.setattr("idempotent_tasks.rq.queue.import_attribute", cannot_import)
    name, key = fresh("by-path"), fresh("key")
    first = queue.enqueue(RECORD, name, 1, idempotency_key=key)
    assert wait_value(first) == {"name": name, "value": 1, "run": 1}
    # When the same call is enqueued with its arguments named
    again = queue.enqueue(RECORD, name=name, value=1, idempotency_key=key)
    # Then it is no mismatch: it gets the key's value, and the body ran once
    assert wait_value(again) == {"name": name, "value": 1, "run": 1}
    assert rq_jobs.starts(name) == 1


def test_a_job_whose_success_callback_fails_writes_no_dead_letter(
    queue: IdempotentQueue, rq_env: RQEnv
) -> None:
    # Given a keyed job whose body succeeds and whose on_success callback raises
    name, key = fresh("callback"), fresh("key")
    job = queue.enqueue(
        rq_jobs.record,
        name,
        1,
        idempotency_key=key,
        on_success=Callback(rq_jobs.failing_success_callback),
    )
    # When RQ fails the job for its callback
    wait_failed(job)
    time.sleep(1)
    # Then no dead letter is written (sent again, it would find the key completed, and the
    # callback fail again, for ever), and the key keeps the body's value
    assert rq_env.rows_of(job.id) == []
    assert rq_jobs.starts(name) == 1
    record = queue.store.get(storage_key(RECORD, key))
    assert record is not None and record.status is Status.COMPLETED


def _dead_lettered_as_corrupt(queue: IdempotentQueue, rq_env: RQEnv, name: str) -> None:
    """Enqueue ``record_keyed(name, 1)`` through a plain rq.Queue (no look at enqueue; its dead
    letters go to the test's table), and see it fail and be dead-lettered as CorruptRecord."""
    plain = Queue(queue.name, connection=rq_env.connection, job_class=IdempotentJob)
    job = plain.enqueue(rq_jobs.record_keyed, name, 1, meta={META_KEY: {"dlq_url": rq_env.dlq_url}})
    wait_failed(job)
    (row,) = wait_until(lambda: rq_env.rows_of(job.id), 10, "the dead letter")
    assert (row.error_type, row.idempotency_key) == ("CorruptRecord", f"keyed:{name}")


def test_a_job_whose_keys_cached_result_cannot_be_read_is_dead_lettered(
    queue: IdempotentQueue, rq_env: RQEnv
) -> None:
    # Given a completed key whose cached result no serializer here reads (written by another
    # app sharing the store, say)
    name = fresh("unreadable")
    first = queue.enqueue(rq_jobs.record_keyed, name, 1)
    assert wait_value(first) == {"name": name, "value": 1, "run": 1}
    record_name = queue.store.names(storage_key(RECORD_KEYED, f"keyed:{name}"))[0]
    rq_env.connection.hset(record_name, "content_type", "application/x-no-such-serializer")
    # When a job of the key arrives, then it fails without running, and waits in the
    # dead-letter table rather than vanish
    _dead_lettered_as_corrupt(queue, rq_env, name)
    assert rq_jobs.starts(name) == 1


def test_a_job_whose_key_holds_a_corrupt_record_is_dead_lettered_without_running(
    queue: IdempotentQueue, rq_env: RQEnv
) -> None:
    # Given a key whose Redis record was overwritten with something else than a record
    name = fresh("corrupt")
    record_name = queue.store.names(storage_key(RECORD_KEYED, f"keyed:{name}"))[0]
    rq_env.connection.set(record_name, "not a record")
    # When a job of the key arrives, then it fails without running, and waits in the
    # dead-letter table rather than vanish
    _dead_lettered_as_corrupt(queue, rq_env, name)
    assert rq_jobs.starts(name) == 0
    rq_env.connection.delete(record_name)
