"""An RQ job whose timeout fires while its dead letter is made still writes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from rq.timeouts import JobTimeoutException

from idempotent_tasks.dlq import DeadLetterQueue
from idempotent_tasks.rq import IdempotentJob
from idempotent_tasks.rq import job as rq_job
from idempotent_tasks.rq.options import META_KEY


def fails(order: str) -> None:
    raise ValueError(order)


def test_a_job_timeout_firing_as_the_dead_letter_is_made_still_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a job failed for good (no RQ retries) whose timeout fires once while its dead
    # letter is made (as its arguments are dumped for the table)
    dump = rq_job.stored_arguments
    fired: list[bool] = []

    def dump_as_the_timeout_fires(*args: Any, **kwargs: Any) -> Any:
        if not fired:
            fired.append(True)
            raise JobTimeoutException("Task exceeded maximum timeout value (30 seconds)")
        return dump(*args, **kwargs)

    monkeypatch.setattr(rq_job, "stored_arguments", dump_as_the_timeout_fires)
    dlq_url = f"sqlite:///{tmp_path}/dead.sqlite3"
    meta = {
        META_KEY: {
            "prefix": "p",
            "task_name": f"{__name__}.fails",
            "store_url": "memory://",
            "dlq_url": dlq_url,
        }
    }
    connection = Redis(host="127.0.0.1", port=1)  # nothing here reaches RQ's Redis
    job = IdempotentJob.create(fails, args=("o-1",), connection=connection, meta=meta, timeout=30)
    job.worker_name = "w1"  # run by a worker, not a synchronous queue
    # When it runs, then its own error goes on, and its dead letter is written all the same
    with pytest.raises(ValueError):
        job.perform()
    queue = DeadLetterQueue(dlq_url)
    rows = queue.items()
    queue.dispose()
    assert fired
    assert [(row.args, row.error_type) for row in rows] == [(["o-1"], "ValueError")]
