"""Retries with a real worker: the claim is released before a retry, failures end cleanly."""

from __future__ import annotations

import time

import pytest

from idempotent_tasks.app_store import dlq_for
from idempotent_tasks.keys import storage_key
from idempotent_tasks.records import Status
from tests.integration import worker_app
from tests.integration.helpers import fresh, ledger_events, wait_until
from tests.integration.workers import WorkerProcess

pytestmark = pytest.mark.usefixtures("two_workers")
#: What a worker logs when it drops an older copy of a call's message.
OLDER_COPY_DROPPED = "an older copy of the call's message, dropped"


def _record(task: object, key: str) -> object:
    from idempotent_tasks.app_store import store_for

    return store_for(worker_app.app).get(storage_key(task.name, key))  # type: ignore[attr-defined]


def test_autoretry_for_retries_until_success_and_caches_once() -> None:
    name, key = fresh("flaky"), fresh("key")
    result = worker_app.flaky.apply_async((name, 2), idempotency_key=key)
    assert result.get(timeout=30) == f"{name} ok after 3 runs"
    assert ledger_events(name, "start") == 3
    assert ledger_events(name, "finish") == 1
    record = _record(worker_app.flaky, key)
    assert record is not None and record.status is Status.COMPLETED  # type: ignore[attr-defined]
    # A later duplicate gets the cached value without a fourth run.
    assert worker_app.flaky.apply_async((name, 2), idempotency_key=key).get() == result.get()
    assert ledger_events(name, "start") == 3


def test_self_retry_retries_until_success() -> None:
    name, key = fresh("manual"), fresh("key")
    result = worker_app.manual_retry.apply_async((name, 2), idempotency_key=key)
    assert result.get(timeout=30) == f"{name} ok after 3 runs"
    assert ledger_events(name, "start") == 3


def test_claim_is_free_between_a_failure_and_its_retry() -> None:
    # Given a task that fails once and is retried 2 s later
    name, key = fresh("gap"), fresh("key")
    result = worker_app.slow_retry.apply_async((name,), idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 10, "the first attempt")
    time.sleep(0.5)
    # Then, while the retry waits for its countdown, no claim holds the key: it is queued for
    # the retry (so a lost retry message is published again; an older message of the call
    # does not take it), and the retry claims it
    record = _record(worker_app.slow_retry, key)
    assert record is not None and record.status is Status.QUEUED, record
    assert record.owner == "retry 1" and record.task_id == result.id
    assert result.get(timeout=30) == f"{name} ok"
    assert ledger_events(name, "start") == 2


def test_a_duplicate_does_not_run_the_body_while_a_retry_sits_out_its_countdown() -> None:
    # Given a task that fails once and is retried 2 s later, and a duplicate of the call
    # delivered meanwhile (bypassing the publish-side look)
    name, key = fresh("countdown"), fresh("key")
    result = worker_app.slow_retry.apply_async((name,), idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 10, "the first attempt")
    duplicate = worker_app.app.send_task(
        worker_app.slow_retry.name, (name,), headers={"idempotency_key": key}
    )
    # Then the duplicate waits for the retry: the body runs a second time only once the
    # countdown is over, and both calls get its value
    assert result.get(timeout=30) == duplicate.get(timeout=30) == f"{name} ok"
    starts = _start_times(name)
    assert len(starts) == 2
    assert starts[1] - starts[0] >= 1.5  # default_retry_delay=2.0


def test_an_older_copy_of_a_calls_message_does_not_run_its_retry_early(
    two_workers: list[WorkerProcess],
) -> None:
    # Given a call that fails once and is retried 5 s later
    name, key = fresh("older-copy"), fresh("key")
    task = worker_app.retried_later
    result = task.apply_async((name,), idempotency_key=key)

    def queued_for_the_retry() -> bool:
        record = _record(task, key)
        return record is not None and record.owner == "retry 1"  # type: ignore[attr-defined]

    wait_until(queued_for_the_retry, 10, "the retry to be queued")
    # When an older copy of the call's first message arrives meanwhile (a redelivery after the
    # visibility timeout, or the guard's copy of a message slow to arrive): the call's task id
    # and key, none of its retries counted
    worker_app.app.send_task(
        task.name, (name,), task_id=result.id, headers={"idempotency_key": key}
    )
    # Then that copy is dropped, and the retry alone runs the body again: after its countdown,
    # counted as the call's first retry
    wait_until(
        lambda: any(
            f"[{result.id}]" in line and OLDER_COPY_DROPPED in line
            for worker in two_workers
            for line in worker.log().splitlines()
        ),
        10,
        "the older copy to be dropped",
    )
    assert result.get(timeout=30) == f"{name} ok after 1 retries"
    starts = _start_times(name)
    assert len(starts) == 2
    assert starts[1] - starts[0] >= 4  # its countdown: 5 s


def _start_times(name: str) -> list[float]:
    """When each run of the call ``name`` began (its ledger's start entries)."""
    return [
        float(entry.decode().rsplit(":", 1)[1])
        for entry in worker_app.ledger.lrange(f"ledger:{name}", 0, -1)
        if entry.startswith(b"start:")
    ]


def test_a_retry_with_other_arguments_continues_the_same_call() -> None:
    name, key = fresh("paged"), fresh("key")
    result = worker_app.paged.apply_async((name, 1), idempotency_key=key)
    assert result.get(timeout=30) == 3
    assert ledger_events(name, "start") == 3
    # The key still stands for the caller's arguments: a duplicate of the call gets the value
    assert worker_app.paged.apply_async((name, 1), idempotency_key=key).get(timeout=10) == 3


def test_a_retry_with_other_arguments_keeps_the_key_its_template_gave_a_keyless_message() -> None:
    # Given a call sent without a key (send_task: no header), keyed by its task's template
    name = fresh("paged-by-template")
    task = worker_app.paged_by_template
    result = worker_app.app.send_task(task.name, (name, 1))
    # When it retries itself with other arguments, then the retries continue the same call,
    # under the key of the first call's arguments
    assert result.get(timeout=30) == 3
    assert ledger_events(name, "start") == 3
    record = _record(task, f"paged:{name}:1")
    assert record is not None and record.status is Status.COMPLETED  # type: ignore[attr-defined]
    # and no retry claimed a key of its own (the first one, left queued, would run again)
    assert _record(task, f"paged:{name}:2") is None
    assert _record(task, f"paged:{name}:3") is None


def test_exhausted_retries_fail_the_task_and_free_the_key() -> None:
    name, key = fresh("doomed"), fresh("key")
    result = worker_app.always_fails.apply_async((name,), idempotency_key=key)
    with pytest.raises(TimeoutError, match="always times out"):
        result.get(timeout=30)
    assert ledger_events(name, "start") == 2  # the first run and its one retry
    assert _record(worker_app.always_fails, key) is None


def test_a_body_that_catches_its_used_up_retry_keeps_its_key_while_it_falls_back() -> None:
    # Given a task allowing no retries whose body catches the MaxRetriesExceededError of its
    # retry and does 3 s of fallback work
    name, key = fresh("fallback"), fresh("key")
    owner = worker_app.falls_back.apply_async((name, 3.0), idempotency_key=key)
    wait_until(lambda: ledger_events(name, "fallback") == 1, 10, "the fallback to start")
    # Then meanwhile the key is still its running claim's
    record = _record(worker_app.falls_back, key)
    assert record is not None and record.status is Status.PROCESSING, record  # type: ignore[attr-defined]
    # and a duplicate arriving at the worker (bypassing the publish-side look) waits for it
    duplicate = worker_app.app.send_task(
        worker_app.falls_back.name, (name, 3.0), headers={"idempotency_key": key}
    )
    assert duplicate.get(timeout=30) == owner.get(timeout=30) == f"{name} fell back"
    assert ledger_events(name, "start") == 1


def test_waiting_duplicate_spends_none_of_its_retries() -> None:
    # Given a task allowing no retries, whose owner runs for 4 s
    name, key = fresh("patient"), fresh("key")
    owner = worker_app.no_retries.apply_async((name, 4.0), idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 10, "the owner to start")
    # When a duplicate arrives at the worker (bypassing the publish-side look)
    duplicate = worker_app.app.send_task(
        worker_app.no_retries.name, (name, 4.0), headers={"idempotency_key": key}
    )
    # Then it waits through several polls and resolves to the owner's value
    assert duplicate.get(timeout=30) == owner.get(timeout=30) == f"{name} done"
    assert ledger_events(name, "start") == 1


def test_a_message_sent_without_the_key_its_task_requires_fails_and_runs_nothing() -> None:
    # Given a task that requires a key, sent by other means than apply_async, without one
    name = fresh("keyless")
    task = worker_app.must_have_key_flaky
    result = worker_app.app.send_task(task.name, (name,))
    # Then it fails at the worker, as apply_async would have refused it, and runs nothing
    with pytest.raises(ValueError, match="requires an idempotency key"):
        result.get(timeout=30)
    assert ledger_events(name, "start") == 0
    # and it is no dead letter: no retry of it could run with a key either
    assert not [item for item in dlq_for(worker_app.app).items() if item.task_id == result.id]


def test_a_retry_sent_without_the_key_its_task_requires_still_runs_and_retries() -> None:
    # Given a retry of a call without a key (a message from before its task required one)
    name = fresh("keyless")
    task = worker_app.must_have_key_flaky
    result = worker_app.app.send_task(task.name, (name,), retries=1)
    # Then it runs as a plain task, and its failure is retried as Celery retries it (its
    # retry is refused neither at its publish nor at the worker)
    assert result.get(timeout=30) == 2
    assert ledger_events(name, "start") == 2
