"""What building a claim store or a dead-letter queue raises when its set-up is wrong."""

from __future__ import annotations

from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from .dlq import DeadLetterQueue
from .errors import StoreUnavailable
from .settings import non_negative_seconds

#: What building a store or a dead-letter queue raises for a set-up no wait mends: a driver
#: not installed, a URL that does not parse or names no store, a data folder not makeable.
SETUP_ERRORS: tuple[type[Exception], ...] = (ImportError, OSError, ValueError, SQLAlchemyError)


class StoreUnusable(StoreUnavailable):
    """A claim store that cannot even be set up here: a matter of configuration, which no wait
    mends (a Celery worker refuses to start on it; an RQ job waits in its queue, unrun)."""


class DeadLetterQueueUnusable(StoreUnavailable):
    """The dead-letter queue cannot even be set up: a matter of configuration, which no wait
    mends (a Celery worker refuses to start on it)."""


def open_dead_letter_queue(
    url: str | None, base_delay: Any = None, scope: str | None = None
) -> DeadLetterQueue:
    """A :class:`DeadLetterQueue` for ``url`` (and the setting ``base_delay``, when given; the
    app name ``scope``, see :class:`DeadLetterQueue`); :class:`DeadLetterQueueUnusable` when its
    set-up is wrong (a driver missing, a URL or setting malformed, the default folder not
    writable): a failure is then kept as for a database that is down (its task goes back to
    its queue), never lost."""
    try:
        settings: dict[str, Any] = {"scope": scope}
        if base_delay is not None:
            settings["base_delay"] = non_negative_seconds(base_delay, "idempotency_dlq_base_delay")
        return DeadLetterQueue(url, **settings)
    except SETUP_ERRORS as exc:
        raise DeadLetterQueueUnusable(f"dead-letter database unusable: {exc}") from exc
