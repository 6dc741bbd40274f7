"""``IdempotentQueue`` on the producer's side: keys, validation and the publish short cut.

No worker here: ``Queue(is_async=False)`` runs a job inside ``enqueue``, through
``IdempotentJob``, which is enough to complete a key.
"""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from rq import Queue, Retry, SimpleWorker
from rq.job import JobStatus

from idempotent_tasks import defaults
from idempotent_tasks.dlq import DeadLetterStatus, Failure
from idempotent_tasks.errors import IdempotencyKeyMismatch
from idempotent_tasks.keys import storage_key
from idempotent_tasks.records import Outcome, Status
from idempotent_tasks.rq import (
    CachedResultJob,
    IdempotentJob,
    IdempotentQueue,
    retry_dead_letters_job,
)
from idempotent_tasks.rq import job as rq_job_module
from idempotent_tasks.rq.options import META_KEY
from idempotent_tasks.stores.redis import RedisStore
from tests.claim_requests import claim_request
from tests.integration import rq_jobs
from tests.integration.rq_support import RQEnv, rq_env_fixture, taker_of

ROOT = Path(__file__).resolve().parents[2]
RECORD = "tests.integration.rq_jobs.record"
RQ_EXITS = "tests.integration.rq_jobs.exits"


@pytest.fixture(scope="module")
def rq_env(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RQEnv]:
    yield from rq_env_fixture(redis_url, tmp_path_factory)


def fresh(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:10]}"


@pytest.fixture()
def idle(rq_env: RQEnv) -> IdempotentQueue:
    """A queue no worker consumes: what lands there stays put."""
    return IdempotentQueue(fresh("idle"), connection=rq_env.connection, dlq_url=rq_env.dlq_url)


@pytest.fixture()
def sync(rq_env: RQEnv) -> IdempotentQueue:
    """A queue that runs each job inside ``enqueue``."""
    return IdempotentQueue(
        fresh("sync"), connection=rq_env.connection, dlq_url=rq_env.dlq_url, is_async=False
    )


@pytest.mark.parametrize("bad", ["", 42, b"bytes", ["k"]])
def test_a_key_that_is_not_a_non_empty_str_is_refused_before_anything_is_enqueued(
    idle: IdempotentQueue, bad: object
) -> None:
    with pytest.raises(ValueError, match="non-empty str"):
        idle.enqueue(rq_jobs.record, "x", 1, idempotency_key=bad)
    with pytest.raises(ValueError, match="non-empty str"):
        idle.enqueue_call(rq_jobs.record, ("x", 1), idempotency_key=bad)
    assert idle.count == 0


def test_a_key_given_as_none_is_refused_before_anything_is_enqueued(
    idle: IdempotentQueue,
) -> None:
    # (enqueue_call's own idempotency_key parameter is None by default: there it is no key)
    with pytest.raises(ValueError, match="not None"):
        idle.enqueue(rq_jobs.record, "x", 1, idempotency_key=None)
    with pytest.raises(ValueError, match="not None"):
        idle.enqueue_in(timedelta(seconds=60), rq_jobs.record, "x", 1, idempotency_key=None)
    assert idle.count == 0
    assert idle.scheduled_job_registry.count == 0


def test_a_job_whose_parent_succeeds_runs_after_it(idle: IdempotentQueue) -> None:
    # (RQ asks whether its dependencies are met while the succeeding parent is still started)
    parent = idle.enqueue(rq_jobs.record, fresh("parent"), 1, idempotency_key=fresh("key"))
    dependent = idle.enqueue(rq_jobs.record, fresh("dependent"), 2, depends_on=parent)
    SimpleWorker([idle], connection=idle.connection, job_class=IdempotentJob).work(burst=True)
    assert parent.get_status(refresh=True) is JobStatus.FINISHED
    assert dependent.get_status(refresh=True) is JobStatus.FINISHED
    assert dependent.return_value()["value"] == 2


def test_a_job_cancelled_with_enqueue_dependents_enqueues_them(idle: IdempotentQueue) -> None:
    # (IdempotentJob says a queued parent has not ended, for a lost run sent back to its queue;
    # RQ asks about the very job it cancels while that job is still queued)
    parent = idle.enqueue(rq_jobs.record, fresh("parent"), 1)
    dependent = idle.enqueue(rq_jobs.record, fresh("dependent"), 2, depends_on=parent)
    assert dependent.get_status(refresh=True) is JobStatus.DEFERRED
    parent.cancel(enqueue_dependents=True)
    assert dependent.get_status(refresh=True) is JobStatus.QUEUED


def test_a_keyed_functools_partial_is_refused_and_an_unkeyed_one_runs(
    idle: IdempotentQueue, sync: IdempotentQueue
) -> None:
    # RQ names every partial functools.partial.__call__: keyed, partial(charge, 1) and
    # partial(refund, 1) would share their keys, the second answered with the first's value
    name = fresh("partial")
    with pytest.raises(ValueError, match=r"functools\.partial cannot be enqueued with an idem"):
        idle.enqueue(functools.partial(rq_jobs.record, name), 1, idempotency_key="k")
    with pytest.raises(ValueError, match=r"functools\.partial cannot be enqueued with an idem"):
        idle.enqueue_call(functools.partial(rq_jobs.record, name), (1,), idempotency_key="k")
    assert idle.count == 0
    # Unkeyed, it is a plain RQ job
    job = sync.enqueue(functools.partial(rq_jobs.record, name), 1)
    assert job.return_value() == {"name": name, "value": 1, "run": 1}


def test_the_store_is_the_queues_own_redis_unless_a_url_is_given(idle: IdempotentQueue) -> None:
    # Given a queue with no store_url: its claims live on its own Redis connection
    store = idle.store
    assert isinstance(store, RedisStore)
    assert store.client is idle.connection
    name, key = fresh("own-redis"), fresh("key")
    job = idle.enqueue(rq_jobs.record, name, 1, idempotency_key=key)
    # When a worker runs the keyed job
    SimpleWorker([idle], connection=idle.connection, job_class=IdempotentJob).work(burst=True)
    # Then its completed claim is a record in that very Redis
    stored = storage_key(f"{rq_jobs.__name__}.record", key)
    record = store.get(stored)
    assert record is not None and (record.task_id, record.status) == (job.id, Status.COMPLETED)
    assert idle.connection.exists(store.names(stored)[0])


def test_a_memory_store_is_one_for_the_queue_and_the_jobs_of_its_process(rq_env: RQEnv) -> None:
    queue = IdempotentQueue(
        fresh("sync-memory"),
        connection=rq_env.connection,
        dlq_url=rq_env.dlq_url,
        is_async=False,
        store_url="memory://",
    )
    name, key = fresh("memory"), fresh("key")
    # Given a keyed job run to its end in this process, claimed in the memory store
    first = queue.enqueue(rq_jobs.record, name, 1, idempotency_key=key)
    assert first.return_value()["name"] == name
    # Then the queue's look sees that claim: a duplicate is answered with the first job, and a
    # call with other arguments is refused, before anything is enqueued
    again = queue.enqueue(rq_jobs.record, name, 1, idempotency_key=key)
    assert (again.id, again.return_value()) == (first.id, first.return_value())
    with pytest.raises(IdempotencyKeyMismatch):
        queue.enqueue(rq_jobs.record, name, 2, idempotency_key=key)
    assert rq_jobs.starts(name) == 1


def test_a_process_running_keyed_jobs_counts_into_the_default_prometheus_registry(
    rq_env: RQEnv,
) -> None:
    # Given a fresh process that enqueues a keyed job twice on a synchronous queue
    script = (
        "import sys\n"
        "from prometheus_client import REGISTRY\n"
        "from redis import Redis\n"
        "from idempotent_tasks.rq import IdempotentQueue\n"
        "from tests.integration import rq_jobs\n"
        "queue = IdempotentQueue(sys.argv[1], connection=Redis.from_url(sys.argv[2]),\n"
        "                        dlq_url=sys.argv[3], is_async=False)\n"
        "for _ in range(2):\n"
        "    queue.enqueue(rq_jobs.record, sys.argv[4], 1, idempotency_key=sys.argv[4])\n"
        "labels = {'task': 'tests.integration.rq_jobs.record'}\n"
        "print(REGISTRY.get_sample_value('idempotent_tasks_claims_total',\n"
        "                                {**labels, 'outcome': 'acquired'}),\n"
        "      REGISTRY.get_sample_value('idempotent_tasks_duplicates_suppressed_total',\n"
        "                                {**labels, 'where': 'publish'}))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, fresh("sync"), rq_env.rq_url, rq_env.dlq_url, fresh("n")],
        cwd=ROOT,
        env={**os.environ, **rq_env.worker_env()},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # Then its claim and its duplicate are counted there, without an enable() call
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1.0", "1.0"]


def test_a_keyed_job_id_the_stores_cannot_hold_is_refused_before_anything_is_enqueued(
    idle: IdempotentQueue,
) -> None:
    # (an SQL claim row or a dead letter keeps 255 characters: such a job could be neither
    # claimed nor dead-lettered)
    too_long = "j" * 256
    with pytest.raises(ValueError, match="256 characters long; at most 255 are kept"):
        idle.enqueue(rq_jobs.record, "x", 1, idempotency_key="k", job_id=too_long)
    with pytest.raises(ValueError, match="256 characters long"):
        idle.enqueue_call(rq_jobs.record, ("x", 1), idempotency_key="k", job_id=too_long)
    with pytest.raises(ValueError, match="256 characters long"):
        idle.enqueue_in(
            timedelta(hours=1), rq_jobs.record, "x", 1, idempotency_key="k", job_id=too_long
        )
    assert idle.count == 0
    # A job id of 255 characters, or any job id without a key, is RQ's as ever
    assert idle.enqueue(rq_jobs.record, "x", 1, idempotency_key="k", job_id="j" * 255)
    assert idle.enqueue(rq_jobs.record, "x", 1, job_id=too_long)
    assert idle.count == 2


def test_a_function_that_requires_a_key_refuses_calls_without_one(idle: IdempotentQueue) -> None:
    with pytest.raises(ValueError, match="requires an idempotency key"):
        idle.enqueue(rq_jobs.key_required, "x")
    assert idle.count == 0
    job = idle.enqueue(rq_jobs.key_required, "x", idempotency_key="given")
    assert job.meta[META_KEY]["key"] == "given"


def test_the_key_and_fingerprint_travel_in_the_job_meta(
    idle: IdempotentQueue, rq_env: RQEnv
) -> None:
    # A template key binds positional arguments to parameter names; the fingerprint is the
    # same however the arguments are passed.
    name = fresh("meta")
    by_position = idle.enqueue(rq_jobs.record_keyed, name, 1)
    by_name = IdempotentQueue(fresh("idle"), connection=rq_env.connection).enqueue_call(
        rq_jobs.record_keyed, kwargs={"name": name, "value": 1, "seconds": 0.0}
    )
    carried = by_position.meta[META_KEY]
    assert carried["key"] == f"keyed:{name}"
    assert carried["dlq_url"] == rq_env.dlq_url
    assert carried["fingerprint"] == by_name.meta[META_KEY]["fingerprint"]
    assert "dlq_url" not in by_name.meta[META_KEY]


def test_a_scheduled_job_carries_its_key(idle: IdempotentQueue) -> None:
    with pytest.raises(ValueError, match="non-empty str"):
        idle.enqueue_in(timedelta(minutes=5), rq_jobs.record, "x", 1, idempotency_key="")
    job = idle.enqueue_in(timedelta(minutes=5), rq_jobs.record, "x", 1, idempotency_key="later")
    assert job.meta[META_KEY]["key"] == "later" and job.kwargs == {}
    assert job.get_status() == "scheduled" and idle.count == 0


def test_a_completed_key_enqueues_nothing_and_answers_with_the_cached_value(
    sync: IdempotentQueue, idle: IdempotentQueue
) -> None:
    name, key = fresh("done"), fresh("key")
    first = sync.enqueue(rq_jobs.record, name, 7, idempotency_key=key)
    assert first.return_value() == {"name": name, "value": 7, "run": 1}

    # Another queue, same function (here by its path) and key: nothing is enqueued.
    again = idle.enqueue(RECORD, name, 7, idempotency_key=key)
    assert isinstance(again, CachedResultJob)
    assert again.id == first.id
    assert again.return_value() == again.result == {"name": name, "value": 7, "run": 1}
    assert again.latest_result().return_value == again.return_value()
    assert again.is_finished
    assert idle.count == 0
    assert rq_jobs.starts(name) == 1


def test_a_failing_job_with_retries_on_a_synchronous_queue_is_dead_lettered(
    sync: IdempotentQueue, rq_env: RQEnv
) -> None:
    # A synchronous queue never retries: the job's failure is final, whatever retry= says
    name, key = fresh("sync-retry"), fresh("key")
    job = sync.enqueue(rq_jobs.flaky, name, 99, idempotency_key=key, retry=Retry(max=2))
    assert job.get_status() == JobStatus.FAILED
    [row] = rq_env.rows_of(job.id)
    assert (row.idempotency_key, row.error_type) == (key, "TimeoutError")
    assert rq_jobs.starts(name) == 1


def test_a_job_returning_retry_on_a_synchronous_queue_is_dead_lettered(
    sync: IdempotentQueue, rq_env: RQEnv
) -> None:
    # A synchronous queue never retries, a Retry the function returns included: final, and
    # kept in the dead-letter table for its sweep (its key released), not lost
    name, key = fresh("sync-returned-retry"), fresh("key")
    job = sync.enqueue(rq_jobs.asks_for_a_retry, name, idempotency_key=key)
    [row] = rq_env.rows_of(job.id)
    assert (row.idempotency_key, row.error_type) == (key, "MaxRetriesExceeded")
    assert "synchronous queue" in row.error_message
    assert rq_jobs.starts(name) == 1


def test_a_dead_letter_whose_arguments_json_gives_back_otherwise_is_said_to_be_lossy(
    sync: IdempotentQueue, rq_env: RQEnv
) -> None:
    # Given a job whose argument is a tuple (RQ pickles it: the job gets a tuple), failed
    name, key = fresh("tuple"), fresh("key")
    job = sync.enqueue(rq_jobs.fails_holding, name, (1, 2), idempotency_key=key)
    assert job.get_status() == JobStatus.FAILED
    # Then its dead letter keeps the arguments to be read, but never rebuilds a job from them
    # (JSON would give a list back): only RQ's own copy of the job is sent again
    [row] = rq_env.rows_of(job.id)
    assert row.args == [name, [1, 2]]
    assert row.options["args_lossy"] is True


def test_a_job_ended_by_a_base_exception_with_no_retries_left_is_dead_lettered(
    sync: IdempotentQueue, rq_env: RQEnv
) -> None:
    name, key = fresh("exits"), fresh("key")
    job = sync.enqueue(rq_jobs.exits, name, idempotency_key=key)
    assert job.get_status() == JobStatus.FAILED
    [row] = rq_env.rows_of(job.id)
    assert (row.idempotency_key, row.status.value) == (key, "pending")
    assert (row.error_type, row.error_message) == ("SystemExit", f"{name} exits")
    # And its key is free for a new call
    assert sync.store.get(storage_key(RQ_EXITS, key)) is None


def _run_one_job(queue: IdempotentQueue) -> None:
    """Run the next job of ``queue`` in this process (one only: a job that goes back to its
    queue would come round again)."""
    worker = SimpleWorker([queue], connection=queue.connection, job_class=IdempotentJob)
    worker.work(burst=True, max_jobs=1)


def test_a_failure_whose_dead_letter_database_cannot_be_set_up_stays_on_its_queue(
    rq_env: RQEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(defaults, "DLQ_WRITE_RETRY_DELAY", 0.05)
    # Given a failing job whose dead-letter URL names no driver SQLAlchemy has
    queue = IdempotentQueue(
        fresh("unusable-dlq"), connection=rq_env.connection, dlq_url="nosuchdb://x/y"
    )
    name = fresh("unusable-dlq")
    try:
        job = queue.enqueue(rq_jobs.flaky, name, 99, idempotency_key=fresh("key"))
        _run_one_job(queue)
        # Then its failure goes back to its queue with the job, to be written once it can be
        job = IdempotentJob.fetch(job.id, connection=rq_env.connection)
        assert job.get_status() == JobStatus.QUEUED
        assert job.meta[META_KEY]["unwritten_failure"]["error_type"] == "TimeoutError"
        assert rq_jobs.starts(name) == 1
    finally:
        queue.delete(delete_jobs=True)


def test_a_job_whose_claim_store_cannot_be_set_up_here_waits_on_its_queue_unrun(
    idle: IdempotentQueue, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(defaults, "STORE_UNAVAILABLE_DELAY", 0.05)
    # Given a keyed job whose claim store this worker cannot build (a driver it lacks)
    name = fresh("unusable-store")
    job = idle.enqueue(rq_jobs.record, name, 1, idempotency_key=fresh("key"))
    job.meta[META_KEY]["store_url"] = "nosuchdb://x/y"
    job.save_meta()
    _run_one_job(idle)
    # Then it goes back to its queue, its body not run (never run unclaimed), saying why as an
    # error (no wait mends it)
    job = IdempotentJob.fetch(job.id, connection=idle.connection)
    assert job.get_status() == JobStatus.QUEUED
    assert rq_jobs.starts(name) == 0
    [error] = [r for r in caplog.records if "claim store unusable here" in r.getMessage()]
    assert error.levelname == "ERROR"


def test_methods_of_one_name_on_two_classes_never_share_a_key(sync: IdempotentQueue) -> None:
    order, key = fresh("order"), fresh("key")
    billed = sync.enqueue(rq_jobs.Billing().charge, order, idempotency_key=key)
    refunded = sync.enqueue(rq_jobs.Refunds().charge, order, idempotency_key=key)
    assert (billed.return_value(), refunded.return_value()) == ("billed", "refunded")
    assert rq_jobs.starts(order) == 2
    # While the same method of another instance of the same class is the same function
    again = sync.enqueue(rq_jobs.Billing().charge, order, idempotency_key=key)
    assert again.return_value() == "billed" and rq_jobs.starts(order) == 2
    # And class methods of one name on two classes are two functions too
    opened, other = fresh("opened"), fresh("key")
    billing = sync.enqueue(rq_jobs.Billing.open, opened, idempotency_key=other)
    refunds = sync.enqueue(rq_jobs.Refunds.open, opened, idempotency_key=other)
    assert (billing.return_value(), refunds.return_value()) == ("billing opened", "refunds opened")


def test_a_failed_method_jobs_dead_letter_is_never_sent_again_by_its_bare_name(
    sync: IdempotentQueue, rq_env: RQEnv
) -> None:
    # Given a failed job of a method (RQ names it "declines", its object apart)
    order = fresh("order")
    job = sync.enqueue(rq_jobs.Billing().declines, order, idempotency_key=fresh("key"))
    [row] = rq_env.rows_of(job.id)
    assert row.task_name == "declines"
    # Then its row keeps that only RQ's own copy of the job, with its object, can be sent
    # again (an enqueue by name would import no such function, or a builtin of that name)
    assert row.options["args_lossy"] is True


def test_a_method_job_that_came_without_its_scoped_name_is_claimed_under_it(
    idle: IdempotentQueue, rq_env: RQEnv
) -> None:
    # Given a completed key of Refunds().charge, and a job of the same method under the same
    # key that carries no scoped name (enqueued another way: enqueue_many, a plain Queue)
    order, key = fresh("order"), fresh("key")
    sync = IdempotentQueue(idle.name, connection=rq_env.connection, is_async=False)
    first = sync.enqueue(rq_jobs.Refunds().charge, order, idempotency_key=key)
    assert first.return_value() == "refunded"
    plain = Queue(idle.name, connection=rq_env.connection, job_class=IdempotentJob)
    job = plain.enqueue(rq_jobs.Refunds().charge, order, meta={META_KEY: {"key": key}})
    # When a worker runs it, then it claims under the same scoped name: the key is completed,
    # so it answers with the cached value, and the body does not run again
    SimpleWorker([idle], connection=rq_env.connection, job_class=IdempotentJob).work(burst=True)
    assert IdempotentJob.fetch(job.id, connection=rq_env.connection).return_value() == "refunded"
    assert rq_jobs.starts(order) == 1


def test_a_synchronous_job_taken_over_mid_run_returns_its_bodys_value(
    sync: IdempotentQueue,
) -> None:
    name, key = fresh("sync-taken"), fresh("key")
    stored = storage_key(RECORD, key)

    def take_over() -> None:
        # While the body runs, another call takes its key over (as after a lease lost to a
        # stalled store), and has not finished when the body ends
        deadline = time.monotonic() + 10
        while rq_jobs.starts(name) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        held = sync.store.get(stored)
        assert held is not None
        assert sync.store.claim(taker_of(held, stored, key)).outcome is Outcome.ACQUIRED

    with ThreadPoolExecutor(1) as pool:
        taken = pool.submit(take_over)
        job = sync.enqueue(rq_jobs.record, name, 1, 1.0, idempotency_key=key)
        taken.result()
    # Then the caller gets what its body returned (nothing to wait in), not a requeue
    assert job.get_status() == JobStatus.FINISHED
    assert job.return_value() == {"name": name, "value": 1, "run": 1}


def test_a_completed_key_with_other_arguments_raises_a_mismatch(sync: IdempotentQueue) -> None:
    name, key = fresh("mismatch"), fresh("key")
    sync.enqueue(rq_jobs.record, name, 1, idempotency_key=key)
    with pytest.raises(IdempotencyKeyMismatch):
        sync.enqueue(rq_jobs.record, name, 2, idempotency_key=key)
    assert rq_jobs.starts(name) == 1


def _claim_by_hand(queue: IdempotentQueue, key: str, job: Any, owner_job_id: str) -> None:
    """Claim ``key`` of :func:`rq_jobs.record` with ``job``'s arguments as a worker running
    job ``owner_job_id`` would."""
    claim = queue.store.claim(
        claim_request(
            key=key,
            task_name=RECORD,
            storage_key=storage_key(RECORD, key),
            task_id=owner_job_id,
            owner="worker-attempt",
            fingerprint=job.meta[META_KEY]["fingerprint"],
            lease_seconds=60,
        )
    )
    assert claim.outcome is Outcome.ACQUIRED


def test_a_key_in_progress_returns_the_owners_job_and_enqueues_nothing(
    idle: IdempotentQueue,
) -> None:
    # Given a job whose key a worker has claimed (done here by hand, as the worker would)
    name, key = fresh("busy"), fresh("key")
    owner = idle.enqueue(rq_jobs.record, name, 1, idempotency_key=key)
    _claim_by_hand(idle, key, owner, owner.id)
    # When the same call is enqueued again
    again = idle.enqueue(rq_jobs.record, name, 1, idempotency_key=key)
    # Then it is the owner's job, and the queue still holds only the owner
    assert again.id == owner.id
    assert isinstance(again, IdempotentJob)
    assert idle.count == 1
    # And once the owner's job has ended without finishing (stopped, failed, cancelled), the
    # call is enqueued: the worker's claim waits for the lease, not the caller for nothing
    owner.set_status(JobStatus.STOPPED)
    later = idle.enqueue(rq_jobs.record, name, 1, idempotency_key=key)
    assert later.id != owner.id
    assert idle.count == 2


def test_a_key_whose_owners_job_rq_cannot_read_is_enqueued_with_a_warning(
    idle: IdempotentQueue, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a job whose key a worker has claimed, and whose hash then holds a status RQ
    # cannot read (written by something else)
    name, key = fresh("unreadable"), fresh("key")
    owner = idle.enqueue(rq_jobs.record, name, 1, idempotency_key=key)
    _claim_by_hand(idle, key, owner, owner.id)
    idle.connection.hset(owner.key, "status", "no such status")
    # When the same call is enqueued again, then it is (the worker's claim decides), and the
    # caller is told why it was not answered with the owner's job, not given RQ's ValueError
    again = idle.enqueue(rq_jobs.record, name, 1, idempotency_key=key)
    assert again.id != owner.id
    assert f"the job {owner.id} of its key cannot be read" in caplog.text


def test_a_duplicate_whose_job_timeout_ends_its_wait_goes_back_to_its_queue(
    idle: IdempotentQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a key another job holds, and a duplicate with a 1 s job timeout, most of which
    # its claim store's set-up takes (the timeout counts from the job's start)
    name, key = fresh("timed-out-wait"), fresh("key")
    job = idle.enqueue(rq_jobs.record, name, 1, idempotency_key=key, job_timeout=1)
    _claim_by_hand(idle, key, job, "another-job")
    real_claim_store = rq_job_module.claim_store

    def slow_claim_store(*args: object, **kwargs: object) -> object:
        time.sleep(0.8)
        return real_claim_store(*args, **kwargs)

    monkeypatch.setattr(rq_job_module, "claim_store", slow_claim_store)
    # When a worker runs it, and the timeout fires while it waits for the key
    SimpleWorker([idle], connection=idle.connection, job_class=IdempotentJob).work(
        burst=True, max_jobs=1
    )
    # Then it goes back to its queue to wait on, neither run nor failed
    assert job.get_status(refresh=True) == JobStatus.QUEUED
    assert idle.job_ids == [job.id]
    assert rq_jobs.starts(name) == 0


def test_the_queue_runs_jobs_as_idempotent_jobs(rq_env: RQEnv) -> None:
    queue = IdempotentQueue(fresh("q"), connection=rq_env.connection)
    assert queue.job_class is IdempotentJob
    plain = Queue(queue.name, connection=rq_env.connection, job_class=IdempotentJob)
    job = plain.enqueue(rq_jobs.record, "x", 1)
    assert isinstance(queue.fetch_job(job.id), IdempotentJob)


def test_the_rq_example_is_importable_and_charges_once(rq_env: RQEnv) -> None:
    example = importlib.import_module("examples.rq_example")
    queue = IdempotentQueue(
        fresh("example"), connection=rq_env.connection, dlq_url=rq_env.dlq_url, is_async=False
    )
    order_id = int(uuid.uuid4().int % 10**9)
    first = queue.enqueue(example.charge, order_id, 990)
    second = queue.enqueue(example.charge, order_id, 990)
    assert second.id == first.id
    assert second.return_value() == first.return_value()


def test_the_sweep_leaves_other_frameworks_rows_alone(rq_env: RQEnv) -> None:
    # Given a due Celery row in the shared dead-letter table
    celery_row = rq_env.dlq.add(
        Failure(
            failure_id=fresh("celery"),
            task_name="shop.charge",
            task_id=fresh("task"),
            idempotency_key="k",
            args=[42],
            kwargs={},
            options={"queue": "celery"},
            error_type="TimeoutError",
            error_message="slow",
            traceback=None,
            max_retries=3,
        )
    )
    rq_env.dlq.retry_now(celery_row.id)
    # When RQ's sweep runs, in a job of its own (as ``rq cron`` would run it)
    sync = Queue(fresh("sweep"), connection=rq_env.connection, is_async=False)
    job = sync.enqueue(retry_dead_letters_job, rq_env.dlq_url)
    # Then it re-enqueued nothing and the row is still pending for Celery's sweep
    assert job.return_value() == 0
    item = rq_env.dlq.get(celery_row.id)
    assert item is not None and item.status is DeadLetterStatus.PENDING


def test_a_job_enqueued_many_at_a_time_carries_the_queues_scope(rq_env: RQEnv) -> None:
    # Given a queue with its own key prefix, whose call of a keyed function completed
    name = fresh("many")
    scoped = IdempotentQueue(
        fresh("scoped"), connection=rq_env.connection, key_prefix=fresh("prefix"), is_async=False
    )
    assert scoped.enqueue(rq_jobs.record_keyed, name, 1).return_value()["value"] == 1
    # When the same call comes through enqueue_many, and a worker runs it
    idle = IdempotentQueue(scoped.name, connection=rq_env.connection, key_prefix=scoped.key_prefix)
    [job] = idle.enqueue_many([Queue.prepare_data(rq_jobs.record_keyed, (name, 1))])
    SimpleWorker([idle], connection=rq_env.connection, job_class=IdempotentJob).work(burst=True)
    # Then its worker claims under the queue's prefix: the key answers, the body ran once
    assert IdempotentJob.fetch(job.id, connection=rq_env.connection).return_value()["value"] == 1
    assert rq_jobs.starts(name) == 1
