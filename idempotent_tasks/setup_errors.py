"""What building a claim store or a dead-letter queue raises when its set-up is wrong."""

from __future__ import annotations

from sqlalchemy.exc import SQLAlchemyError

from .errors import StoreUnavailable

#: What building a store or a dead-letter queue raises for a set-up no wait mends: a driver
#: not installed, a URL that does not parse or names no store, a data folder not makeable.
SETUP_ERRORS: tuple[type[Exception], ...] = (ImportError, OSError, ValueError, SQLAlchemyError)


class StoreUnusable(StoreUnavailable):
    """A claim store that cannot even be set up here: a matter of configuration, which no wait
    mends (a Celery worker refuses to start on it; an RQ job waits in its queue, unrun)."""


class DeadLetterQueueUnusable(StoreUnavailable):
    """The dead-letter queue cannot even be set up: a matter of configuration, which no wait
    mends (a Celery worker refuses to start on it)."""
