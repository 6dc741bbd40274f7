"""Per-task options and result caching limits, with real workers."""

from __future__ import annotations

import pytest

from idempotent_tasks.app_store import store_for
from idempotent_tasks.keys import storage_key
from tests.integration import worker_app
from tests.integration.helpers import IDLE_QUEUE, fresh, ledger_events, queue_length

pytestmark = pytest.mark.usefixtures("two_workers")


def test_key_required_refuses_a_call_without_one_before_publishing() -> None:
    with pytest.raises(ValueError, match="requires an idempotency key"):
        worker_app.must_have_key.apply_async((fresh("n"),), queue=IDLE_QUEUE)
    assert queue_length(IDLE_QUEUE) == 0
    name = fresh("n")
    assert worker_app.must_have_key.apply_async((name,), idempotency_key=name).get(10) == name


def test_validation_off_lets_other_arguments_share_the_key() -> None:
    name, key = fresh("unvalidated"), fresh("key")
    first = worker_app.unvalidated.apply_async((name, 1), idempotency_key=key).get(timeout=30)
    second = worker_app.unvalidated.apply_async((name, 2), idempotency_key=key).get(timeout=30)
    assert first == second == 1
    assert ledger_events(name, "start") == 1


def test_result_over_the_size_limit_completes_the_key_without_caching() -> None:
    # Given a result of 2 MiB, over the default 1 MiB limit
    name, key = fresh("big"), fresh("key")
    size = 2 * 1024 * 1024
    assert len(worker_app.big_result.apply_async((name, size), idempotency_key=key).get(30)) == size
    # Then the key counts as completed, duplicates get None, and the body ran once
    record = store_for(worker_app.app).get(storage_key(worker_app.big_result.name, key))
    assert record is not None and record.status.value == "completed"
    assert not record.result_cached
    assert worker_app.big_result.apply_async((name, size), idempotency_key=key).get(30) is None
    duplicate = worker_app.app.send_task(
        worker_app.big_result.name, (name, size), headers={"idempotency_key": key}
    )
    assert duplicate.get(timeout=30) is None
    assert ledger_events(name, "start") == 1


def test_a_task_calling_itself_as_a_function_runs_it_as_a_plain_call() -> None:
    # A direct call inside the body is no delivery: it must not claim the message's key
    key = fresh("key")
    assert worker_app.summed.apply_async((3,), idempotency_key=key).get(timeout=30) == 6
    record = store_for(worker_app.app).get(storage_key(worker_app.summed.name, key))
    assert record is not None and record.status.value == "completed"
