"""The SQL store's clock: this process's clock, set to the database server's.

Leases and expiries in claim rows are written by one worker and compared by another. Were each
to use its own clock, a host whose clock runs ahead would find live leases expired and take
them over (the body would run twice), and one running behind would wait on dead owners. So
each process measures how far its clock is from the database server's (one query, on first use,
then every :data:`RESYNC_SECONDS`, and at once when its own clock is stepped) and adds that to
its own, as the Redis store takes every time from Redis' ``TIME``. SQLite has no server: every
process of one file shares the host's clock, so that one is used as it is.
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

#: Seconds between two measurements of the offset (the server's clock stepped by NTP or an
#: operator is followed within this long).
RESYNC_SECONDS = 60.0
#: Seconds this process's clock may run apart from ``time.monotonic`` before it counts as
#: stepped (NTP, an operator, a resume from suspend) and the offset is measured again at once:
#: an offset measured before the step would be off by the step (a worker stepped an hour
#: ahead would take live leases over; a sweep would retry dead letters twice).
STEP_SECONDS = 1.0
#: Seconds before trying again when a measurement failed after an earlier one succeeded.
RETRY_SECONDS = 5.0


class ServerClock:
    """POSIX seconds on the database server's clock, read without a query per call.

    Args:
        engine: the store's engine (its dialect picks the query; SQLite uses ``local``).
        local: this process's clock.
        resync_seconds: seconds (on ``time.monotonic``) a measured offset is used for.

    The first call raises :class:`~idempotent_tasks.errors.StoreUnavailable` if the server
    cannot be asked; later failures keep the last offset and try again in
    :data:`RETRY_SECONDS`.
    """

    def __init__(
        self,
        engine: Engine,
        local: Callable[[], float] = time.time,
        resync_seconds: float = RESYNC_SECONDS,
    ) -> None:
        self._engine = engine
        self._local = local
        self._resync_seconds = resync_seconds
        self._query = select_server_time(engine.dialect.name)
        self._lock = threading.Lock()
        #: Server clock minus local clock, in seconds.
        self.offset = 0.0
        #: ``time.monotonic()`` after which the offset is measured again (None: never measured).
        self._next_sync: float | None = None
        #: The local clock minus ``time.monotonic()`` when the offset was measured.
        self._local_ahead_of_monotonic = 0.0

    def __call__(self) -> float:
        local = self._local()
        if self._query is not None and self._due(local, time.monotonic()):
            self._sync()
            local = self._local()
        return local + self.offset

    def _due(self, local: float, monotonic: float) -> bool:
        next_sync = self._next_sync
        if next_sync is None or monotonic >= next_sync:
            return True
        return abs(local - monotonic - self._local_ahead_of_monotonic) > STEP_SECONDS

    def _sync(self) -> None:
        with self._lock:
            next_sync = self._next_sync
            if not self._due(self._local(), time.monotonic()):
                return  # another thread measured it meanwhile
            try:
                offset = self._measure()
            except SQLAlchemyError as exc:
                if next_sync is None:
                    raise StoreUnavailable(
                        f"could not read the database server's clock: {exc}"
                    ) from exc
                logger.warning("could not read the database server's clock, will retry: %s", exc)
                self._set_next_sync(RETRY_SECONDS)  # one try per step, too
                return
            self.offset = offset
            self._set_next_sync(self._resync_seconds)

    def _set_next_sync(self, seconds: float) -> None:
        monotonic = time.monotonic()
        self._local_ahead_of_monotonic = self._local() - monotonic
        self._next_sync = monotonic + seconds

    def _measure(self) -> float:
        assert self._query is not None
        with self._engine.connect() as connection:
            before = self._local()
            server = float(connection.execute(self._query).scalar_one())
            after = self._local()
        # The server read its clock somewhere during the round trip: take the middle.
        return server - (before + after) / 2
