"""Keeping a re-sent dead letter's row ``retrying`` while its run lasts, for Celery and RQ.

A sweep takes a row that stayed ``retrying`` longer than its timeout for one whose sweep died:
it makes the row due and sends it again. A run that is merely long would then be sent a second
time, and its failure, reported under the first sweep, be dropped as another sweep's: the row
would run on every poll interval, its retries never counted. So while the run lasts its row is
renewed, every third of the timeout, from a thread of its own (a stalled dead-letter database
never holds up the renewal of the claims' leases).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..heartbeat import LeaseKeeper
from .queue import DeadLetterQueue

logger = logging.getLogger(__name__)

_row_keeper = LeaseKeeper()


def renew_retrying(
    queue_of: Callable[[], DeadLetterQueue],
    dead_letter_id: str,
    sweep_id: str | None,
    time_limit: type[BaseException] | None = None,
    waits_for: float = 0.0,
) -> bool:
    """A re-sent dead letter's run begins, or goes on (``waits_for``: its retry waits that many
    seconds first): renew its row. Whether the row may still be ``sweep_id``'s ``retrying``
    one: an error (the database down) is logged, and counts as yes, never as the run's failure.

    ``time_limit``, the framework's one-shot time limit when the run's own thread renews (see
    :func:`~idempotent_tasks.core.despite_time_limit`), is never taken for such an error: the
    run would go on without its limit.
    """
    try:
        return queue_of().renew_retrying(dead_letter_id, sweep_id, waits_for)
    except Exception as exc:  # the database down, or its URL unusable: the run goes on
        if time_limit is not None and isinstance(exc, time_limit):
            raise
        logger.warning("could not renew dead letter %s: %s", dead_letter_id, exc)
        return True


@contextmanager
def kept_retrying(
    queue_of: Callable[[], DeadLetterQueue],
    dead_letter_id: str,
    sweep_id: str | None,
    timeout: float,
) -> Iterator[None]:
    """Renew the row of ``dead_letter_id`` every third of ``timeout`` seconds while the block
    runs; a renewal that fails (the database down) is tried again within seconds, not a third
    of the timeout later: by then a sweep may take the row for stuck."""
    lease = _row_keeper.add(
        lambda: queue_of().renew_retrying(dead_letter_id, sweep_id), lambda: None, timeout
    )
    try:
        yield
    finally:
        _row_keeper.remove(lease)
