"""One sweep over the due dead letters, shared by the Celery and RQ sweeps."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from enum import Enum
from typing import Any

from ..errors import StoreUnavailable
from .items import DeadLetter
from .queue import DeadLetterQueue

logger = logging.getLogger(__name__)


class AlreadySucceeded(Exception):
    """A dead letter whose last retry succeeded, its row left unmarked (the database was down
    then): the sweep marks it ``succeeded`` rather than send it again."""


class ResendLater(Exception):
    """A dead letter not to be sent now, and not failed either (its job is still queued, say):
    due again later, with no retry used."""


class CannotResend(Exception):
    """A dead letter that cannot be sent again as it is kept (its arguments are kept only as
    text, say): sending it would run the task with the wrong values. It is given up at once
    (``permanent_failure``), its failure kept."""


def resend_due(
    queue: DeadLetterQueue,
    resend: Callable[[DeadLetter], None],
    *,
    framework: str,
    batch: int,
    retry_delay: float,
    unreachable: Callable[[BaseException], bool] = lambda _error: False,
    interrupted: tuple[type[BaseException], ...] = (),
    runs: Collection[str] | None = None,
) -> int:
    """Take every due item of ``framework``, in batches, and ``resend`` each; how many went.
    (With a scoped ``queue``, only the items it takes: see :meth:`DeadLetterQueue.take_due`,
    which ``runs`` is given to.)

    An error ``unreachable`` says is the broker's (it cannot be reached, or cannot take
    messages now) costs no retry: the item is due again ``retry_delay`` seconds later, and the
    sweep ends at once, the rest of the batch handed back untried, so a long outage does not
    cost a publish timeout per row. An item ``resend`` puts off (:class:`ResendLater`) is due
    again then too, with no retry used, and the sweep goes on. An item that cannot be sent as
    it is kept (:class:`CannotResend`) is given up at once, its failure kept. Any other error
    of ``resend`` (a router or serializer that raises, a queue the broker refuses to push
    onto) counts as a failed retry, with its error: the item is tried again on its backoff and
    gives up at its limit, rather than be sent every ``retry_delay`` for ever.
    An item is tried once per sweep, however short its backoff: a batch that comes round to
    items tried already is the sweep's last.

    An ``interrupted`` error (the sweep's own time limit) is no item's failure: the item it
    lands on and the rest of the batch are handed back due, no retry used, and it is raised.
    When the database fails to record how one item went, that item waits for
    :meth:`~DeadLetterQueue.recover_stuck`, and the sweep goes on with the others.

    Raises:
        ValueError: ``batch`` is below 1 (a sweep of empty batches would never end).
    """
    batch = _batch_size(batch)
    sent = 0
    tried: set[str] = set()
    while True:
        taken = queue.take_due(batch, framework=framework, runs=runs)
        items = [item for item in taken if item.id not in tried]
        for again in taken:
            if again.id in tried:  # due again already (a backoff of about nothing)
                queue.unclaim(again.id, taken=again)
        tried.update(item.id for item in items)
        for index, item in enumerate(items):
            try:
                outcome = _resend_one(queue, item, resend, retry_delay, unreachable, interrupted)
            except interrupted as exc:
                logger.warning(
                    "dead-letter sweep interrupted (%s): %d taken dead letters handed back",
                    type(exc).__name__,
                    len(items) - index,
                )
                _hand_back(queue, items[index:], delay=0.0)
                raise
            except StoreUnavailable as exc:
                logger.error(
                    "dead letter %s: could not record how its retry went (%s); it is taken up "
                    "again once it has been retrying for the retrying timeout",
                    item.id,
                    exc,
                )
                continue
            if outcome is _Outcome.UNREACHABLE:
                _hand_back(queue, items[index:], delay=retry_delay)
                return sent
            if outcome is _Outcome.SENT:
                sent += 1
        if len(items) < batch:  # the last batch, or one that came round to items tried
            return sent


class _Outcome(Enum):
    SENT = "sent"
    HANDLED = "handled"  # put off, marked, given up, or a retry used
    UNREACHABLE = "unreachable"


def _resend_one(
    queue: DeadLetterQueue,
    item: DeadLetter,
    resend: Callable[[DeadLetter], None],
    retry_delay: float,
    unreachable: Callable[[BaseException], bool],
    interrupted: tuple[type[BaseException], ...],
) -> _Outcome:
    """Send one taken item again, and record what became of it (see :func:`resend_due`)."""
    try:
        resend(item)
    except ResendLater as exc:
        logger.warning(
            "dead letter %s not sent again now (due again in %ss): %s", item.id, retry_delay, exc
        )
        queue.unclaim(item.id, delay=retry_delay, taken=item)
    except AlreadySucceeded:
        logger.warning("dead letter %s had succeeded: marked so, not sent again", item.id)
        queue.mark_succeeded(item.id)
    except CannotResend as exc:
        # No retry would do better; the failure it records stays as it was.
        logger.error("dead letter %s cannot be sent again (given up): %s", item.id, exc)
        queue.give_up(item.id, str(exc), item.sweep_id)
    except interrupted:
        raise
    except Exception as exc:
        if unreachable(exc):
            logger.error(
                "could not send dead letters again (due again in %ss): %s", retry_delay, exc
            )
            return _Outcome.UNREACHABLE
        # Not the broker's absence: most likely the same error at every try (a router, a
        # serializer, a queue's key of the wrong type), so it uses a retry.
        logger.error("could not send dead letter %s again (a retry used): %r", item.id, exc)
        queue.record_retry_failure(item.id, type(exc).__name__, str(exc), None)
    else:
        return _Outcome.SENT
    return _Outcome.HANDLED


def _hand_back(queue: DeadLetterQueue, items: list[DeadLetter], delay: float) -> None:
    """Make taken items due again ``delay`` seconds on, untried, as far as the database lets
    (those it does not wait for :meth:`~DeadLetterQueue.recover_stuck`)."""
    for item in items:
        try:
            queue.unclaim(item.id, delay=delay, taken=item)
        except StoreUnavailable as exc:
            logger.error("could not hand dead letters back (%s): they wait to be recovered", exc)
            return


def _batch_size(batch: Any) -> int:
    """``batch`` as a whole number of items, 1 or more (``500.0`` too)."""
    try:
        size = int(batch)
    except (TypeError, ValueError, OverflowError):
        size = 0
    if isinstance(batch, bool) or size != batch or size < 1:
        raise ValueError(
            f"a dead-letter sweep's batch must be a whole number, 1 or more, not {batch!r}"
        )
    return size
