"""Dead-letter rows as a sweep leaves them, for tests of what a retry's message does."""

from __future__ import annotations

import uuid

from idempotent_tasks.dlq import DeadLetter, DeadLetterQueue, Failure


def taken_row(
    queue: DeadLetterQueue, *, task_name: str, task_id: str, key: str | None, args: list[str]
) -> DeadLetter:
    """A failure of ``task_id`` written, made due, and taken by a sweep (``retrying``, its
    ``sweep_id`` the sweep's): the row of a retry's message just sent."""
    item = queue.add(
        Failure(
            failure_id=f"{task_id}:0",
            task_name=task_name,
            task_id=task_id,
            idempotency_key=key,
            args=args,
            kwargs={},
            options={},
            error_type="RuntimeError",
            error_message=f"first failure of {uuid.uuid4().hex[:8]}",
            traceback=None,
            max_retries=3,
        )
    )
    assert queue.retry_now(item.id)
    [taken] = queue.take_due(framework="celery")
    return taken
