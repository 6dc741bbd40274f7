"""``DeadLetterQueue``: the persistent table of tasks that failed for good."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import threading
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from functools import partial
from typing import Any, overload

from sqlalchemy import URL, Connection, Engine, literal, select, text
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, SQLAlchemyError
from sqlalchemy.sql.elements import ColumnElement

from ..errors import CorruptRecord, StoreUnavailable
from ..keys import fitted
from ..stores.sql_clock import ServerClock
from ..urls import url_text
from . import queries
from .arguments import first_line, safe_repr, utf8_text
from .backoff import next_retry_at
from .engine import (
    create_dlq_engine,
    default_sqlite_url,
    driver_codes,
    from_db_time,
    to_db_time,
)
from .items import ARGS_LOSSY, DeadLetter, DeadLetterStatus, Failure
from .schema import (
    COMPONENT,
    DEAD_LETTER_MIGRATIONS,
    SCHEMA_VERSION,
    Unreadable,
    dead_letters,
)
from .schema_setup import ensure_component

logger = logging.getLogger(__name__)

#: Items a sweep takes at most per batch.
SWEEP_BATCH = 100
#: Longest task id, key and failure id the columns keep; longer ones are kept whole in the
#: item's options, under these names (the columns show their start and a digest).
MAX_TASK_ID_CHARS, MAX_KEY_CHARS, MAX_FAILURE_ID_CHARS = 255, 1024, 300
#: Longest key the table keeps in UTF-8 bytes as well: PostgreSQL's index on it takes at most
#: 2704 bytes an entry, and 1024 characters of CJK or emoji are up to 4096.
MAX_KEY_BYTES = 1024
#: Longest task name and error type the table keeps (their columns).
MAX_TASK_NAME_CHARS, MAX_ERROR_TYPE_CHARS = 255, 255
FULL_TASK_ID, FULL_KEY = "full_task_id", "full_idempotency_key"
FULL_TASK_NAME = "full_task_name"
#: Options entry holding the failure's :attr:`~Failure.occurrence` (not shown in items).
OCCURRENCE = "failure_occurrence"
#: Times a sweep picks again when concurrent sweeps took all it picked.
TAKE_ROUNDS = 5


def server_utc_clock(engine: Engine) -> Callable[[], datetime]:
    """The database server's current UTC time, read without a query per call.

    Due times and sweep leases are written by one process and compared by another; on the
    server's clock (see :class:`~idempotent_tasks.stores.sql_clock.ServerClock`), hosts whose
    clocks disagree still agree on when an item is due or stuck.
    """
    seconds = ServerClock(engine, local=lambda: datetime.now(timezone.utc).timestamp())
    return lambda: datetime.fromtimestamp(seconds(), timezone.utc)


class DeadLetterQueue:
    """The dead-letter table on any SQLAlchemy URL (PostgreSQL, MySQL/MariaDB, SQLite).

    The tables are created on first use. A database whose schema version is newer than this
    code raises :class:`~idempotent_tasks.errors.SchemaVersionError`; database errors surface as
    :class:`~idempotent_tasks.errors.StoreUnavailable`.

    Args:
        url: SQLAlchemy URL (text, or a ``URL`` object); ``None`` for the local SQLite file
            (see ``default_sqlite_url``).
        base_delay: seconds of the first backoff step (doubling with every retry).
        clock: returns the current UTC time; default: the database server's
            (:func:`server_utc_clock`; SQLite's is the host's). Tests pass their own.
        rng: the jitter's random source (for tests).
        scope: the name of the app this queue writes for, in a table several apps share (the
            default SQLite file is one per user of a host): each row it writes names it, and
            its sweeps leave another app's rows of tasks it does not run to that app (see
            :meth:`take_due`). ``None``: rows name no app.
    """

    def __init__(
        self,
        url: str | URL | None = None,
        *,
        base_delay: float = 60,
        clock: Callable[[], datetime] | None = None,
        rng: random.Random | None = None,
        scope: str | None = None,
    ) -> None:
        self.url = url_text(url) if url else default_sqlite_url()
        self.base_delay = base_delay
        self.scope = scope
        self.engine: Engine = create_dlq_engine(self.url)
        # Read before a transaction begins, never inside one: a first read or a resync asks the
        # server on a connection of its own, and a transaction holding the pool's last one
        # would wait for itself.
        self._clock = server_utc_clock(self.engine) if clock is None else clock
        self._rng = rng
        self._schema_ready = False
        self._schema_lock = threading.Lock()

    # -- writing ------------------------------------------------------------------------------

    def record_failure(
        self,
        failure: Failure,
        dead_letter_id: str | None,
        sweep_id: str | None = None,
        *,
        only_on_row: bool = False,
    ) -> DeadLetter | None:
        """Record a final failure: the next failure of the re-published row ``dead_letter_id``
        (of the sweep ``sweep_id``, when given; see :meth:`record_on_row`), else a new row,
        unless ``only_on_row`` (a task whose dead-letter queue is off). Returns the row the
        failure is on now, if any."""
        on_row = self.record_on_row(failure, dead_letter_id, sweep_id)
        if on_row is not None or only_on_row:
            return on_row
        return self.add(failure)

    def record_on_row(
        self, failure: Failure, dead_letter_id: str | None, sweep_id: str | None = None
    ) -> DeadLetter | None:
        """Record the failure of the re-published row ``dead_letter_id`` (of the sweep
        ``sweep_id``, when given) on that row; ``None`` when there is no such row, or it
        succeeded by that very run (its key forgotten since, or a repeating job's next run):
        the failure is then a new call's."""
        if dead_letter_id is None:
            return None
        item = self.record_retry_failure(
            dead_letter_id, failure.error_type, failure.error_message, failure.traceback, sweep_id
        )
        if item is None or item.succeeded_before(sweep_id):
            return None
        return item

    def add(self, failure: Failure) -> DeadLetter:
        """Record a final failure as a ``pending`` item; the same failure twice gives one row.

        A failure whose id names a row that has since succeeded, or given up after its
        retries, is a new call's (a task id used again): it gets a row of its own. A row the
        database refuses twice for what it holds while it answers queries (MariaDB: arguments
        over ``max_allowed_packet``, JSON nested too deep) is kept without its arguments (the
        start of their text in ``options["args_preview"]``, the reason in
        ``options["args_refused"]``), as ``permanent_failure``: it can be read, not retried.

        Raises:
            StoreUnavailable: the database cannot be reached (or refuses even that row).
        """
        now = self._clock()
        options = {**failure.options, OCCURRENCE: failure.occurrence}
        if self.scope is not None:
            options[queries.SCOPE_OPTION] = self.scope
        task_id = _fitted(_storable(failure.task_id), MAX_TASK_ID_CHARS, options, FULL_TASK_ID)
        task_name = _fitted(
            _storable(failure.task_name), MAX_TASK_NAME_CHARS, options, FULL_TASK_NAME
        )
        key = failure.idempotency_key
        if key is not None:
            key = _fitted(_storable(key), MAX_KEY_CHARS, options, FULL_KEY, MAX_KEY_BYTES)
        failure_id = _compared_id(_storable(failure.failure_id))
        row = {
            "id": str(uuid.uuid4()),
            "task_name": task_name,
            "task_id": task_id,
            "framework": failure.framework,
            "failure_id": failure_id,
            "idempotency_key": key,
            "args": list(failure.args),
            "kwargs": dict(failure.kwargs),
            "options": options,
            "error_type": _storable(failure.error_type)[:MAX_ERROR_TYPE_CHARS],
            "error_message": _storable(failure.error_message),
            "traceback": _storable(failure.traceback),
            "retry_count": 0,
            "max_retries": failure.max_retries,
            # With no retries allowed, a dead letter is kept but never retried by itself.
            "status": (
                DeadLetterStatus.PENDING
                if failure.max_retries > 0
                else DeadLetterStatus.PERMANENT_FAILURE
            ).value,
            "next_retry_at": (
                self._db(next_retry_at(now, 0, self.base_delay, self._rng))
                if failure.max_retries > 0
                else None
            ),
            "created_at": self._db(now),
            "updated_at": self._db(now),
        }
        return self._insert_or_keep_without_arguments(row)

    def _insert_or_keep_without_arguments(self, row: dict[str, Any]) -> DeadLetter:
        """Insert ``row``; if the database refuses it twice for what it holds while it answers
        queries, insert it without its arguments (written again later, it would never land).
        ``StoreUnavailable`` when the database is down."""
        try:
            return self._insert(row)
        except StoreUnavailable as refused:
            if not self._refused_for_good(refused, row):
                raise
        try:
            return self._insert(row)  # once more: a passing error would pass now
        except StoreUnavailable as again:
            if not self._refused_for_good(again, row):
                raise
            reason = _first_line(again)
        logger.error(
            "the dead-letter database refused the failure of %s %s (%s): it is kept without "
            "its arguments, not to be retried",
            row["task_name"],
            row["task_id"],
            reason,
        )
        return self._insert(_without_arguments(row, reason))

    def _refused_for_good(self, error: StoreUnavailable, row: dict[str, Any]) -> bool:
        """Whether a failed insert of ``row`` was the database refusing that row, not an
        outage: a data error, one of MySQL's refusals of a row, or (MySQL) a dropped
        connection while the row is over ``max_allowed_packet``; and the database answers."""
        cause = error.__cause__
        if not isinstance(cause, DBAPIError):
            return False
        if cause.connection_invalidated:
            # MySQL drops the connection of a packet too big; so does an outage, or a proxy.
            return self._over_packet_limit(row)
        if not isinstance(cause, DataError) and not _refuses_the_row(cause.orig):
            return False
        try:
            with self._begin() as connection:
                connection.execute(select(literal(1)))
        except StoreUnavailable:
            return False
        return True

    def _over_packet_limit(self, row: dict[str, Any]) -> bool:
        """Whether ``row`` is bigger than a MySQL server's ``max_allowed_packet`` (which it
        tells, so it answers); never on another database."""
        if self.engine.dialect.name not in ("mysql", "mariadb"):
            return False
        try:
            with self._begin() as connection:
                limit = int(connection.execute(text("SELECT @@max_allowed_packet")).scalar_one())
        except (StoreUnavailable, TypeError, ValueError):
            return False
        return _row_size(row) >= limit

    def _insert(self, row: dict[str, Any]) -> DeadLetter:
        """Insert ``row`` (a failure written before keeps its row); the item as it now is."""
        row = dict(row)
        failure_id, occurrence = row["failure_id"], row["options"][OCCURRENCE]
        while True:
            try:
                with self._begin() as connection:
                    connection.execute(queries.insert_dead_letter(row))
            except IntegrityError:
                pass  # this failure was written before (a retried write): keep that row
            with self._begin() as connection:
                found = connection.execute(queries.select_by_failure(row["failure_id"])).one()
            item = _item(found._mapping)
            # Written now or by an earlier write of this very failure, or a row this failure
            # joins (one still to be retried, or kept as it is).
            if found.options.get(OCCURRENCE) == occurrence or not _ended_before(item):
                return item
            # A row ended before this failure: this one is a later call's under the same id.
            row["failure_id"] = _compared_id(f"{failure_id}@{item.id}")

    def take_due(
        self,
        limit: int = SWEEP_BATCH,
        framework: str = "celery",
        runs: Collection[str] | None = None,
    ) -> list[DeadLetter]:
        """Atomically take up to ``limit`` due ``pending`` items of ``framework``, marking them
        ``retrying``.

        Given ``runs`` (the tasks its sweep can run), a queue takes only its own app's rows
        (its :attr:`scope`'s), rows that name no app, and other apps' rows of tasks named in
        ``runs`` (an app renamed takes the rows of its old name): another app's row of a task
        it does not know would be refused by its worker, a retry used each time, and never
        reach its own app. Without ``runs``, a queue that names no app takes every row.

        Concurrent callers never take the same item: where the server can (PostgreSQL,
        MariaDB 10.6+, MySQL 8.0.1+), they skip rows another sweep has locked; everywhere,
        only rows still ``pending`` are marked, and each caller reads back just the rows its
        own mark took.
        """
        for _ in range(TAKE_ROUNDS):
            now = self._clock()
            sweep_id = str(uuid.uuid4())
            with self._begin() as connection:
                due = queries.select_due_ids(
                    self._db(now),
                    limit,
                    framework,
                    queries.skips_locked_rows(connection.dialect),
                    self._scoped(runs, connection.dialect),
                )
                ids = list(connection.execute(due).scalars())
                if not ids:
                    return []
                connection.execute(queries.claim_for_sweep(ids, sweep_id, self._db(now)))
            with self._begin() as connection:
                rows = connection.execute(queries.select_swept(sweep_id)).all()
            items = _readable(rows, partial(self._give_up_unreadable, sweep_id=sweep_id, now=now))
            if items:
                return items
            # Another sweep took every row this one picked (SQLite, no row locks), or none it
            # took could be read: pick again.
        return []

    def _give_up_unreadable(
        self, row: Any, error: CorruptRecord, sweep_id: str, now: datetime
    ) -> None:
        """Mark a row a sweep took but cannot read (edited by hand into another shape)
        ``permanent_failure``, saying why, for an operator to mend and retry, rather than stop
        the sweep of every other row (left ``retrying`` if the database fails now: it comes
        back after its timeout)."""
        failure = f"{row['error_type']}: {row['error_message']}"
        values = {
            "status": DeadLetterStatus.PERMANENT_FAILURE.value,
            "error_type": CorruptRecord.__name__,
            "error_message": _storable(f"{error} (its failure was {failure})"),
            "sweep_id": None,
            "next_retry_at": None,
            "updated_at": self._db(now),
        }
        update = queries.record_retry_failure(row["id"], values, sweep_id, row["retry_count"])
        try:
            with self._begin() as connection:
                connection.execute(update)
        except StoreUnavailable as exc:
            logger.error("%s, and could not be marked permanent_failure: %s", error, exc)
            return
        logger.error("%s: marked permanent_failure, not sent again", error)

    def recover_stuck(
        self,
        timeout: timedelta,
        framework: str | None = None,
        runs: Collection[str] | None = None,
        grace: timedelta = timedelta(0),
    ) -> int:
        """Return items ``retrying`` for longer than ``timeout`` to ``pending``, due ``grace``
        from now (only those of ``framework``, when given, and those :meth:`take_due` would
        take with ``runs``); how many.

        An item's run may be alive after all, its renewals lost to a database that was down:
        until the item is sent again, that run takes it back as it renews it, and its success
        or failure counts (the grace gives it time to)."""
        now = self._clock()
        with self._begin() as connection:
            result = connection.execute(
                queries.recover_stuck(
                    self._db(now - timeout),
                    self._db(now),
                    self._db(now + grace),
                    framework,
                    self._scoped(runs, connection.dialect),
                )
            )
        return int(result.rowcount)

    def _scoped(self, runs: Collection[str] | None, dialect: Dialect) -> ColumnElement[bool] | None:
        if self.scope is None and runs is None:
            return None
        return queries.in_scope(self.scope, runs or (), dialect)

    def unclaim(self, item_id: str, delay: float = 0.0, *, taken: DeadLetter | None = None) -> bool:
        """Put a ``retrying`` item back to ``pending``, due ``delay`` seconds from now (its
        re-publication failed; no retry is used).

        With ``taken``, the item as a sweep took it, only while no run has renewed it since: a
        publish that failed may have sent its message all the same (its reply lost, a time
        limit in the middle of it), and a run that began stays the only one.
        """
        now = self._clock()
        due = now + timedelta(seconds=max(delay, 0.0))
        held = None if taken is None else (taken.sweep_id, self._db(taken.updated_at))
        with self._begin() as connection:
            result = connection.execute(
                queries.unclaim(item_id, self._db(now), self._db(due), held)
            )
        return bool(result.rowcount)

    def renew_retrying(
        self, item_id: str, sweep_id: str | None = None, waits_for: float = 0.0
    ) -> bool:
        """A re-published item's run began (or retries): it is not stuck, so its
        ``retrying`` timeout counts from now, or from ``waits_for`` seconds from now (a retry
        of its run waiting out a countdown: its ``updated_at`` then lies ahead). Whether the
        item (of ``sweep_id``) was ``retrying``."""
        alive_until = self._db(self._clock() + timedelta(seconds=max(waits_for, 0.0)))
        with self._begin() as connection:
            result = connection.execute(queries.renew_retrying(item_id, sweep_id, alive_until))
        return bool(result.rowcount)

    def mark_succeeded(self, item_id: str, sweep_id: str | None = None) -> bool:
        """Mark a re-published item ``succeeded`` (by the run the sweep ``sweep_id`` sent, when
        given); whether it was ``retrying`` or ``pending``."""
        now = self._db(self._clock())
        with self._begin() as connection:
            result = connection.execute(queries.mark_succeeded(item_id, now, sweep_id))
        return bool(result.rowcount)

    def withdraw(self, failure_id: str) -> bool:
        """Delete the dead letter written for the failed delivery ``failure_id`` while no retry
        of it was sent (``pending``, or ``permanent_failure`` as written): its call did not
        fail after all (it was revoked as it ran). Whether there was one."""
        compared = _compared_id(_storable(failure_id))
        with self._begin() as connection:
            result = connection.execute(queries.withdraw(compared))
        return bool(result.rowcount)

    def give_up(self, item_id: str, reason: str, sweep_id: str | None = None) -> bool:
        """A ``retrying`` item that can never be sent again (its arguments kept as text only,
        its job gone) becomes ``permanent_failure`` at once, its failure as it was, the
        ``reason`` added to its message; only while the sweep ``sweep_id`` holds it, when
        given. Whether it was so held."""
        note = _storable(f"[not sent again: {reason}]")
        now = self._db(self._clock())  # before the transaction: see the class's docstring
        with self._begin() as connection:
            found = connection.execute(queries.select_by_id(item_id)).one_or_none()
            if found is None:
                return False
            message = found._mapping["error_message"] or ""
            if note not in message:
                message = f"{message}\n{note}" if message else note
            result = connection.execute(queries.give_up(item_id, message, now, sweep_id))
        return bool(result.rowcount)

    def record_retry_failure(
        self,
        item_id: str,
        error_type: str,
        error_message: str,
        traceback: str | None,
        sweep_id: str | None = None,
    ) -> DeadLetter | None:
        """A re-published item failed for good again: reschedule it, or give up at its limit.

        Only an item in ``retrying`` changes, and with ``sweep_id`` (the sweep that published
        the run reporting), only while that sweep holds it: a repeated report changes nothing,
        even once a later sweep took the item again. (With ``sweep_id``, an item that sweep's
        run left ``pending``, made due again as stuck, and not sent again since, changes too.)
        Returns the item as it now is, or ``None`` if there is no such item.
        """
        now = self._clock()
        with self._begin() as connection:
            found = connection.execute(queries.select_by_id(item_id)).one_or_none()
            if found is None:
                return None
            item = _item(found._mapping)
            held = sweep_id is None or item.sweep_id == sweep_id
            # (Pending, and still its sweep's: made due again as stuck while its run was alive.)
            recovered = sweep_id is not None and item.status is DeadLetterStatus.PENDING
            if held and (item.status is DeadLetterStatus.RETRYING or recovered):
                retry_count = item.retry_count + 1
                exhausted = retry_count >= item.max_retries
                values: dict[str, Any] = {
                    "retry_count": retry_count,
                    "error_type": _storable(error_type)[:MAX_ERROR_TYPE_CHARS],
                    "error_message": _storable(error_message),
                    "traceback": _storable(traceback),
                    "sweep_id": None,
                    "updated_at": self._db(now),
                    "status": (
                        DeadLetterStatus.PERMANENT_FAILURE
                        if exhausted
                        else DeadLetterStatus.PENDING
                    ).value,
                    "next_retry_at": None
                    if exhausted
                    else self._db(next_retry_at(now, retry_count, self.base_delay, self._rng)),
                }
                connection.execute(
                    queries.record_retry_failure(
                        item_id, values, item.sweep_id, item.retry_count, item.status.value
                    )
                )
            found = connection.execute(queries.select_by_id(item_id)).one()
        return _item(found._mapping)

    # -- the operator's API ---------------------------------------------------------------

    def items(
        self,
        status: str | DeadLetterStatus | None = None,
        task_name: str | None = None,
        limit: int = 100,
        *,
        on_corrupt: Callable[[CorruptRecord], None] | None = None,
    ) -> list[DeadLetter]:
        """Items, newest first, optionally of one status and/or one task.

        A row that cannot be read (edited by hand into another shape) is left out and handed to
        ``on_corrupt`` (by default, logged as an error).
        """
        status_value = DeadLetterStatus(status).value if status is not None else None
        with self._begin() as connection:
            rows = connection.execute(queries.select_items(status_value, task_name, limit)).all()

        def left_out(_: Any, error: CorruptRecord) -> None:
            if on_corrupt is None:
                logger.error("%s: left out", error)
            else:
                on_corrupt(error)

        return _readable(rows, left_out)

    def get(self, id: str) -> DeadLetter | None:
        """One item by id, or ``None``; ``CorruptRecord`` if its row cannot be read."""
        with self._begin() as connection:
            found = connection.execute(queries.select_by_id(id)).one_or_none()
        return None if found is None else _item(found._mapping)

    def stats(self) -> dict[str, int]:
        """How many items each status has, plus ``total``."""
        counts = {status.value: 0 for status in DeadLetterStatus}
        with self._begin() as connection:
            for status, count in connection.execute(queries.count_by_status()).all():
                counts[status] = int(count)
        counts["total"] = sum(counts.values())
        return counts

    def retry_now(self, id: str) -> bool:
        """Make an item due at once (``pending``), whatever its status but ``retrying``."""
        now = self._db(self._clock())
        with self._begin() as connection:
            result = connection.execute(queries.retry_now(id, now))
        return bool(result.rowcount)

    def purge(
        self,
        status: str | DeadLetterStatus | None = None,
        older_than: timedelta | float | datetime | None = None,
    ) -> int:
        """Delete items of ``status`` and/or not updated for ``older_than``; how many.

        ``older_than`` is an age (a ``timedelta``, or seconds), or a moment (a ``datetime``;
        naive ones are UTC): items last updated before it go. Neither given: every item goes.
        """
        status_value = DeadLetterStatus(status).value if status is not None else None
        cutoff = self._db(self._cutoff(older_than)) if older_than is not None else None
        with self._begin() as connection:
            result = connection.execute(queries.purge(status_value, cutoff))
        return int(result.rowcount)

    def now(self) -> datetime:
        """The current UTC time on this queue's clock (the database server's by default)."""
        return self._clock()

    def dispose(self) -> None:
        """Close pooled connections (after a fork, or when done)."""
        self.engine.dispose()

    # -- plumbing -----------------------------------------------------------------------------

    def _cutoff(self, older_than: timedelta | float | datetime) -> datetime:
        """The moment ``purge``'s ``older_than`` names."""
        if isinstance(older_than, datetime):
            if older_than.tzinfo is None:
                return older_than.replace(tzinfo=timezone.utc)
            return older_than.astimezone(timezone.utc)
        if isinstance(older_than, bool) or not isinstance(older_than, timedelta | int | float):
            raise TypeError(
                f"older_than must be a timedelta, seconds or a datetime, not {older_than!r}"
            )
        age = older_than if isinstance(older_than, timedelta) else timedelta(seconds=older_than)
        if age < timedelta(0):
            raise ValueError(f"older_than must not be negative, not {older_than!r}")
        return self._clock() - age

    def _db(self, moment: datetime) -> datetime:
        return to_db_time(self.engine, moment)

    @contextmanager
    def _begin(self) -> Iterator[Connection]:
        self.ensure_schema()
        try:
            with self.engine.begin() as connection:
                yield connection
        except IntegrityError:
            raise
        except SQLAlchemyError as exc:
            raise StoreUnavailable(f"dead-letter database error: {exc}") from exc

    def ensure_schema(self) -> None:
        """Create the tables if missing and check the schema version (once per object)."""
        if self._schema_ready:
            return
        with self._schema_lock:
            if self._schema_ready:
                return
            ensure_component(
                self.engine,
                component=COMPONENT,
                version=SCHEMA_VERSION,
                tables=[dead_letters],
                what="dead-letter",
                migrations=DEAD_LETTER_MIGRATIONS,
            )
            self._schema_ready = True


@overload
def _storable(text: str) -> str: ...
@overload
def _storable(text: None) -> None: ...
def _storable(text: str | None) -> str | None:
    """Text every database takes, none refusing it for good (a ``DataError`` no later try would
    get past): NUL, which PostgreSQL refuses in text, is written out as ``\\x00``, and a lone
    surrogate (a file name's undecodable byte), which no database encoding holds, as
    ``\\udcff``."""
    return None if text is None else utf8_text(text.replace("\x00", "\\x00"))


#: MySQL/MariaDB errors that refuse a row for what it holds: a packet over
#: max_allowed_packet, data too long, invalid JSON, a failed CHECK (JSON nested too deep).
_MYSQL_ROW_REFUSALS = frozenset({1153, 1406, 3140, 4025})
#: Options a row kept without its arguments says why in, and shows their start in.
ARGS_REFUSED = "args_refused"
ARGS_PREVIEW = "args_preview"
_PREVIEW_CHARS = 1000
_KEPT_TRACEBACK_CHARS = 65536


def _refuses_the_row(original: BaseException | None) -> bool:
    """Whether a database error refuses a row for what it holds: PostgreSQL's data
    exceptions and program limits, MySQL's refusals of a row."""
    state, number = driver_codes(original)
    return (state is not None and state[:2] in ("22", "54")) or number in _MYSQL_ROW_REFUSALS


def _row_size(row: dict[str, Any]) -> int:
    """About how many bytes ``row`` takes on the wire (its JSON columns and long texts)."""
    texts = (row["traceback"] or "", row["error_message"] or "")
    columns = [row["args"], row["kwargs"], row["options"]]
    return len(json.dumps(columns, default=str).encode()) + sum(len(t.encode()) for t in texts)


def _first_line(error: BaseException) -> str:
    return first_line(error)[:500]


def _without_arguments(row: dict[str, Any], reason: str) -> dict[str, Any]:
    """``row`` without its arguments (their start kept as text), its traceback cut short, and
    only the options that name it, given up on: it can be read, never sent again."""
    preview = safe_repr([row["args"], row["kwargs"]])[:_PREVIEW_CHARS]
    options = {
        name: value
        for name, value in row["options"].items()
        if name in (OCCURRENCE, FULL_TASK_ID, FULL_TASK_NAME, FULL_KEY, queries.SCOPE_OPTION)
    }
    options.update({ARGS_LOSSY: True, ARGS_REFUSED: reason, ARGS_PREVIEW: preview})
    traceback = row["traceback"]
    return {
        **row,
        "args": [],
        "kwargs": {},
        "options": options,
        "status": DeadLetterStatus.PERMANENT_FAILURE.value,
        "next_retry_at": None,
        "traceback": traceback[-_KEPT_TRACEBACK_CHARS:] if traceback else traceback,
    }


def _compared_id(failure_id: str) -> str:
    """A failure id as the table keeps it (only compared: a digest names an over-long one)."""
    if len(failure_id) > MAX_FAILURE_ID_CHARS:
        return "sha256:" + hashlib.sha256(failure_id.encode()).hexdigest()
    return failure_id


def _ended_before(item: DeadLetter) -> bool:
    """Whether a row's story ended: it succeeded, or gave up after retries (a row written to
    be kept, never retried, may be this very failure written again)."""
    return item.status is DeadLetterStatus.SUCCEEDED or (
        item.status is DeadLetterStatus.PERMANENT_FAILURE and item.retry_count > 0
    )


def _fitted(
    value: str,
    limit: int,
    options: dict[str, Any],
    full_name: str,
    max_bytes: int | None = None,
) -> str:
    """``value`` as its column keeps it: when longer than ``limit`` characters (or
    ``max_bytes`` in UTF-8), its start and a digest of the whole, the whole value going to
    ``options[full_name]`` (items read it back from there)."""
    kept = fitted(value, limit, max_bytes)
    if kept != value:
        options[full_name] = value
    return kept


def _readable(
    rows: Sequence[Any], on_corrupt: Callable[[Any, CorruptRecord], None]
) -> list[DeadLetter]:
    """The items of ``rows``; each row that cannot be read is handed to ``on_corrupt`` (with
    its error) and left out."""
    items = []
    for row in rows:
        try:
            items.append(_item(row._mapping))
        except CorruptRecord as exc:
            on_corrupt(row._mapping, exc)
    return items


def _item(row: Any) -> DeadLetter:
    """The item of a row; ``CorruptRecord`` when a column holds what no write puts there."""
    try:
        return _read_item(row)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise CorruptRecord(
            f"dead letter {row['id']} cannot be read ({type(exc).__name__}: {exc})"
        ) from exc


def _shown(text: str) -> str:
    """Text read from bytes that are not UTF-8 (see ``schema.ExactText``), printable: each
    byte that is not UTF-8 becomes U+FFFD."""
    return text.encode(errors="surrogateescape").decode(errors="replace")


#: Columns every write fills with text (a client writing bytes or a number there corrupts them).
TEXT_COLUMNS = ("task_name", "task_id", "framework", "error_type", "error_message", "status")


def _read_item(row: Any) -> DeadLetter:
    for column in TEXT_COLUMNS:
        if not isinstance(row[column], str):
            raise TypeError(f"{column} is not text: {row[column]!r:.80}")
    for column in ("args", "kwargs", "options", "next_retry_at", "created_at", "updated_at"):
        if isinstance(row[column], Unreadable):
            raise ValueError(f"{column} holds {row[column]!r}")
    if not isinstance(row["args"], list):
        raise TypeError(f"args is not a JSON array: {row['args']!r:.80}")
    for column in ("kwargs", "options"):
        if not isinstance(row[column], dict):
            raise TypeError(f"{column} is not a JSON object: {row[column]!r:.80}")
    options = dict(row["options"])
    for name in (FULL_TASK_NAME, FULL_TASK_ID, FULL_KEY):
        if not isinstance(options.get(name, ""), str):
            raise TypeError(f"options[{name!r}] is not text: {options[name]!r:.80}")
    options.pop(OCCURRENCE, None)
    scope = options.pop(queries.SCOPE_OPTION, None)
    return DeadLetter(
        id=row["id"],
        # As the sweep's SQL reads it: a value edited in that is not text, as JSON writes it.
        scope=scope if isinstance(scope, str) or scope is None else json.dumps(scope),
        task_name=options.pop(FULL_TASK_NAME, row["task_name"]),
        task_id=options.pop(FULL_TASK_ID, row["task_id"]),
        framework=row["framework"],
        failure_id=_shown(row["failure_id"]),
        idempotency_key=options.pop(FULL_KEY, row["idempotency_key"]),
        args=list(row["args"]),
        kwargs=dict(row["kwargs"]),
        options=options,
        error_type=row["error_type"],
        error_message=row["error_message"],
        traceback=row["traceback"],
        retry_count=int(row["retry_count"]),
        max_retries=int(row["max_retries"]),
        next_retry_at=from_db_time(row["next_retry_at"]),
        status=DeadLetterStatus(row["status"]),
        sweep_id=row["sweep_id"],
        created_at=from_db_time(row["created_at"]),  # type: ignore[arg-type]
        updated_at=from_db_time(row["updated_at"]),  # type: ignore[arg-type]
    )
