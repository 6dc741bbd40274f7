"""The SQL store's clock: the database server's, read without a query per call.

Leases and expiries in claim rows are written by one worker and compared by another. Were each
to use its own clock, a host whose clock runs ahead would find live leases expired and take
them over (the body would run twice), and one running behind would wait on dead owners. So
each process asks the database server for its time (one query, on first use and then every
:data:`RESYNC_SECONDS`) and counts on from it with a clock nobody steps, as the Redis store
takes every time from Redis' ``TIME``: this host's own clock plays no part, so NTP or an
operator stepping it changes nothing. SQLite has no server: every process of one file shares
the host's clock, so that one is used as it is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from ..errors import StoreUnavailable
from .sql_statements import select_server_time

logger = logging.getLogger(__name__)

#: Seconds between two measurements (the server's own clock stepped, or drifting apart from
#: this host's, is followed within this long).
RESYNC_SECONDS = 60.0
#: Seconds before trying again when a measurement failed after an earlier one succeeded.
RETRY_SECONDS = 5.0
_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


def steady_time() -> float:
    """Seconds on a clock nobody steps: since boot, time suspended included, on Linux;
    ``time.monotonic`` elsewhere (where a suspended host lags until the next measurement)."""
    return time.clock_gettime(_BOOTTIME) if _BOOTTIME is not None else time.monotonic()


class ServerClock:
    """POSIX seconds on the database server's clock, read without a query per call.

    Args:
        engine: the store's engine (its dialect picks the query; SQLite uses ``local``).
        local: this host's clock, for SQLite; a server's time is not read from it.
        resync_seconds: seconds (on ``steady``) a measurement is used for.
        steady: the clock the server's time is counted on with (see :func:`steady_time`).

    The first call raises :class:`~idempotent_tasks.errors.StoreUnavailable` if the server
    cannot be asked; later failures keep counting on from the last measurement and try again
    in :data:`RETRY_SECONDS`.
    """

    def __init__(
        self,
        engine: Engine,
        local: Callable[[], float] = time.time,
        resync_seconds: float = RESYNC_SECONDS,
        steady: Callable[[], float] = steady_time,
    ) -> None:
        self._engine = engine
        self._local = local
        self._steady = steady
        self._resync_seconds = resync_seconds
        self._query = select_server_time(engine.dialect.name)
        self._lock = threading.Lock()
        #: Server clock minus the steady clock, in seconds.
        self._offset = 0.0
        #: Steady time after which the offset is measured again (None: never measured).
        self._next_sync: float | None = None

    def __call__(self) -> float:
        if self._query is None:
            return self._local()
        steady = self._steady()
        next_sync = self._next_sync
        if next_sync is None or steady >= next_sync:
            self._sync()
            steady = self._steady()
        return steady + self._offset

    def _sync(self) -> None:
        with self._lock:
            next_sync = self._next_sync
            if next_sync is not None and self._steady() < next_sync:
                return  # another thread measured it meanwhile
            try:
                offset = self._measure()
            except SQLAlchemyError as exc:
                if next_sync is None:
                    raise StoreUnavailable(
                        f"could not read the database server's clock: {exc}"
                    ) from exc
                logger.warning("could not read the database server's clock, will retry: %s", exc)
                self._next_sync = self._steady() + RETRY_SECONDS
                return
            self._offset = offset
            self._next_sync = self._steady() + self._resync_seconds

    def _measure(self) -> float:
        assert self._query is not None
        with self._engine.connect() as connection:
            before = self._steady()
            server = float(connection.execute(self._query).scalar_one())
            after = self._steady()
        # The server read its clock somewhere during the round trip: take the middle.
        return server - (before + after) / 2
