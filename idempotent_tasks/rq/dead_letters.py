"""RQ's side of the dead-letter table: the rows RQ jobs write and how they are marked."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from redis import Redis
from redis.exceptions import RedisError
from rq.serializers import PickleSerializer

from .. import signals
from ..dlq import DeadLetter, DeadLetterQueue, Failure
from ..dlq.items import ARGS_LOSSY
from ..errors import SchemaVersionError, StoreUnavailable
from .options import FRAMEWORK

logger = logging.getLogger(__name__)

#: How long a success whose row could not be marked is remembered: well past the sweep's
#: timeout for rows stuck ``retrying`` (after which the row is due again), however seldom the
#: sweep runs (one small key per such row).
UNMARKED_SUCCESS_SECONDS = 30 * 86400
#: Bounds of what a dead letter keeps of an error.
MAX_ERROR_MESSAGE_CHARS = 10_000
MAX_TRACEBACK_CHARS = 60_000


def row_options(queue_name: str, args_lossy: bool = False) -> dict[str, Any]:
    """``options`` of an RQ row: its queue and the framework mark the RQ sweep selects on.

    ``args_lossy`` marks rows whose arguments JSON could not hold (kept as ``repr`` for display):
    such a row can be retried only while RQ still has the original job.
    """
    options: dict[str, Any] = {"queue": queue_name, "framework": FRAMEWORK}
    if args_lossy:
        options[ARGS_LOSSY] = True
    return options


def serializer_name(serializer: Any) -> str | None:
    """How a row names its job's RQ serializer, for the sweep to read and write the job with
    it (``rq.serializers.JSONSerializer``); ``None`` for RQ's default (pickle)."""
    if serializer is None or serializer is PickleSerializer:
        return None
    module = getattr(serializer, "__module__", None)
    name = getattr(serializer, "__qualname__", None)
    if module is None or name is None:  # an instance: named by its class
        module, name = type(serializer).__module__, type(serializer).__qualname__
    return f"{module}.{name}"


def write_failure(
    queue: DeadLetterQueue,
    failure: Failure,
    dead_letter_id: str | None,
    sweep_id: str | None = None,
    *,
    only_on_row: bool = False,
) -> str | None:
    """Record a final failure: a new row, or the next failure of a re-enqueued row (of the
    sweep ``sweep_id``, when given); with ``only_on_row`` (a function whose dead-letter queue
    is off), only the latter.

    Returns the row's id (``None``: no row). Raises StoreUnavailable (or SchemaVersionError)
    when the database cannot be written.
    """
    item = queue.record_failure(failure, dead_letter_id, sweep_id, only_on_row=only_on_row)
    if item is None:
        return None
    _log_item(failure.task_id, item)
    return item.id


def mark_succeeded(
    queue_of: Callable[[], DeadLetterQueue],
    dead_letter_id: str,
    sweep_id: str | None,
    connection: Redis,
) -> None:
    """A re-enqueued dead letter succeeded, by the job the sweep ``sweep_id`` enqueued: mark its
    row (the queue ``queue_of`` gives).

    With the database down, the success is noted in RQ's Redis instead (see
    :func:`succeeded_unmarked`), for the sweep to mark the row rather than enqueue it again
    once it is due again (a job without a key would run again).
    """
    try:
        queue_of().mark_succeeded(dead_letter_id, sweep_id)
    except (StoreUnavailable, SchemaVersionError) as exc:
        logger.warning("could not mark dead letter %s succeeded: %s", dead_letter_id, exc)
        try:
            connection.set(_unmarked_name(dead_letter_id), 1, ex=UNMARKED_SUCCESS_SECONDS)
        except RedisError as note_error:
            # The job succeeded all the same: its row comes back, and runs it once more.
            logger.error("could not note dead letter %s succeeded: %s", dead_letter_id, note_error)


def succeeded_unmarked(connection: Redis, dead_letter_id: str) -> bool:
    """Whether the row's last re-enqueued job succeeded while its mark could not be written."""
    return bool(connection.exists(_unmarked_name(dead_letter_id)))


def _unmarked_name(dead_letter_id: str) -> str:
    return f"idempotent_tasks:rq:dead_letter_succeeded:{dead_letter_id}"


def _log_item(job_id: str, item: DeadLetter) -> None:
    signals.dead_letter_written.send(task_name=item.task_name, status=item.status.value)
    logger.error(
        "job %s dead-lettered as %s: %s, %s of %s retries used, next try %s",
        job_id,
        item.id,
        item.status.value,
        item.retry_count,
        item.max_retries,
        item.next_retry_at.isoformat() if item.next_retry_at else "never",
    )
