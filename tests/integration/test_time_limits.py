"""A task killed at its hard time limit: dead-lettered, its key free, not run again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from celery.exceptions import TimeLimitExceeded

from idempotent_tasks.app_store import dlq_for, store_for
from idempotent_tasks.dlq import DeadLetter, DeadLetterStatus
from idempotent_tasks.keys import storage_key
from tests.integration import worker_app
from tests.integration.helpers import fresh, ledger_events, wait_until
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
