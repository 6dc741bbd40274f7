"""Dead-letter items as Python sees them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..text_enum import TextEnum

#: Item option: the arguments JSON could not hold are kept as their ``repr``, for display only.
ARGS_LOSSY = "args_lossy"


class DeadLetterStatus(TextEnum):
    """Where a dead letter is in its life."""

    PENDING = "pending"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    PERMANENT_FAILURE = "permanent_failure"


@dataclass(frozen=True, kw_only=True)
class Failure:
    """A final failure to record: the task as it was called, and how it failed.

    ``failure_id`` names the failed delivery (task id and attempt), so writing the same failure
    twice leaves one row.
    """

    failure_id: str
    task_name: str
    task_id: str
    idempotency_key: str | None
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    error_type: str
    error_message: str
    traceback: str | None
    max_retries: int
    #: The adapter that wrote it, whose sweep re-publishes it: "celery" or "rq".
    framework: str = "celery"
    #: Made once per failure, and carried by every write of it (a write tried again later):
    #: it tells such a write from a later call's failure under the same ``failure_id``.
    occurrence: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(frozen=True, kw_only=True)
class DeadLetter:
    """One row of the dead-letter table. Timestamps are timezone-aware (UTC)."""

    id: str
    task_name: str
    task_id: str
    failure_id: str
    idempotency_key: str | None
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    error_type: str
    error_message: str
    traceback: str | None
    retry_count: int
    max_retries: int
    next_retry_at: datetime | None
    status: DeadLetterStatus
    sweep_id: str | None
    created_at: datetime
    updated_at: datetime
    framework: str = "celery"
    #: The app whose queue wrote it, in a table apps share (``None``: no app named).
    scope: str | None = None

    def succeeded_before(self, sweep_id: str | None) -> bool:
        """Whether a failure reported for this row, by the run the sweep ``sweep_id`` sent (any
        run, for ``None``), is a new failure after the row's success by that very run (its key
        forgotten or expired since, or a repeating job's next run): it then gets a row of its
        own. Another sweep's run reporting late adds nothing."""
        return self.status is DeadLetterStatus.SUCCEEDED and (
            sweep_id is None or sweep_id == self.sweep_id
        )
