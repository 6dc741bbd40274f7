"""Every table idempotent_tasks keeps in SQL (dead letters, claims, pickups), and their schema
versions."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Double,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
    inspect,
    text,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Connection, Dialect

#: A step that brings a component's tables from the version it is keyed by to the next one.
Migration = Callable[[Connection], None]

#: Version of the dead-letter table; a database at a higher version is refused. Version 2:
#: ``failure_id`` compared exactly on MySQL/MariaDB (see :class:`ExactText`); 3: its text in
#: utf8mb4 there, whatever the server's default (see :data:`TEXT_IN_UTF8MB4`).
SCHEMA_VERSION = 3
#: Name under which the dead-letter schema records its version.
COMPONENT = "dead_letters"

metadata = MetaData()

LongText = Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
# MySQL/MariaDB BLOB holds only 64 KiB.
LongBlob = LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")
#: Table options: on MySQL/MariaDB, text in utf8mb4 whatever the server's default (latin1 in
#: MariaDB's own before 11.6, where a key, task name or error message in another script, an
#: emoji, is refused in strict mode, and the write is retried for ever).
TEXT_IN_UTF8MB4: dict[str, Any] = {"mysql_charset": "utf8mb4"}


class ExactText(TypeDecorator[str]):
    """Text that only equals itself, on every database.

    MySQL's and MariaDB's default collations compare ignoring case, accents and trailing
    spaces (and in ``utf8mb4_general_ci`` every emoji equals every other), which would make
    keys ``order-42`` and ``ORDER-42`` one row. There the text is kept as its UTF-8 bytes.

    Bytes that are not UTF-8 (written by hand, or latin1 text that an earlier version's
    migration to bytes kept as it was) read back as text that writes back to the same bytes
    (Python's ``surrogateescape``): such a row is still found, updated and deleted by its id.
    """

    impl = String
    cache_ok = True

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.length = length

    def load_dialect_impl(self, dialect: Dialect) -> Any:
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(mysql.VARBINARY(self.length * 4))
        return dialect.type_descriptor(String(self.length))

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        if isinstance(value, str) and dialect.name in ("mysql", "mariadb"):
            return value.encode(errors="surrogateescape")
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        return value.decode(errors="surrogateescape") if isinstance(value, bytes) else value


@dataclass(frozen=True)
class Unreadable:
    """What a column holds that its type cannot read (SQLite keeps any text in any column):
    read as this marker, so that the other rows of the same query are read all the same."""

    kind: str
    text: Any
    error: str

    def __repr__(self) -> str:
        return f"unreadable {self.kind} ({self.error}): {self.text!r:.80}"


class _Tolerant(TypeDecorator[Any]):
    """A type whose values that do not parse read as :class:`Unreadable` instead of failing
    the whole fetch."""

    cache_ok = True
    #: What the marker calls the value.
    kind = "value"

    def result_processor(self, dialect: Dialect, coltype: Any) -> Any:
        parse = super().result_processor(dialect, coltype)
        if parse is None:
            return None  # the driver parses the value itself, and its database checks it

        def tolerant(value: Any) -> Any:
            try:
                return parse(value)
            except (ValueError, TypeError, RecursionError) as exc:  # JSON nested too deep
                return Unreadable(self.kind, value, str(exc))

        return tolerant


class TolerantJSON(_Tolerant):
    """JSON that reads text that does not parse as :class:`Unreadable`."""

    impl = JSON
    kind = "JSON"
    cache_ok = True  # SQLAlchemy reads it from each class itself


class TolerantTimestamp(_Tolerant):
    """A moment that reads text that is not one (an SQLite row edited by hand) as
    :class:`Unreadable`."""

    impl = DateTime(timezone=True)
    kind = "timestamp"
    cache_ok = True

    def coerce_compared_value(self, op: Any, value: Any) -> Any:
        # As a DateTime column does: a timedelta beside it is an interval, not a moment.
        return self.impl_instance.coerce_compared_value(op, value)


# MySQL/MariaDB DATETIME keeps no fractions of a second unless told to.
Timestamp = TolerantTimestamp().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


dead_letters = Table(
    "idempotent_tasks_dead_letters",
    metadata,
    Column("id", String(36), primary_key=True),
    Column("task_name", String(255), nullable=False),
    Column("task_id", String(255), nullable=False),
    # Which adapter wrote the row ("celery" or "rq"): each one's sweep re-publishes only its own.
    Column("framework", String(16), nullable=False, server_default="celery"),
    # One row per failed delivery (task id and attempt): a write repeated after a lost reply
    # or a database outage finds its row already there.
    # "<task id>:<retries>": task ids that differ only in case are different tasks.
    Column("failure_id", ExactText(300), nullable=False, unique=True),
    Column("idempotency_key", String(1024)),
    Column("args", TolerantJSON, nullable=False),
    Column("kwargs", TolerantJSON, nullable=False),
    Column("options", TolerantJSON, nullable=False),
    Column("error_type", String(255), nullable=False),
    Column("error_message", LongText, nullable=False),
    Column("traceback", LongText),
    Column("retry_count", Integer, nullable=False),
    Column("max_retries", Integer, nullable=False),
    Column("next_retry_at", Timestamp),
    Column("status", String(32), nullable=False),
    # Which sweep took the row for re-publishing (its claim on the row).
    Column("sweep_id", String(36)),
    Column("created_at", Timestamp, nullable=False),
    Column("updated_at", Timestamp, nullable=False),
    Index("ix_idempotent_tasks_dead_letters_due", "status", "framework", "next_retry_at"),
    Index("ix_idempotent_tasks_dead_letters_task", "task_name", "status"),
    Index("ix_idempotent_tasks_dead_letters_key", "idempotency_key", mysql_length=191),
    Index("ix_idempotent_tasks_dead_letters_sweep", "sweep_id"),
    **TEXT_IN_UTF8MB4,
)

schema_versions = Table(
    "idempotent_tasks_schema_version",
    metadata,
    Column("component", String(64), primary_key=True),
    Column("version", Integer, nullable=False),
)

#: Version of the claims table of the SQL store (2: ids compared exactly on MySQL/MariaDB;
#: 3: text in utf8mb4 there; 4: ``taken_from`` and ``owes_message``).
CLAIMS_SCHEMA_VERSION = 4
CLAIMS_COMPONENT = "claims"

#: Characters of a claim's row id: "<prefix>:<storage key>" (a storage key has at most
#: ``defaults.KEY_MAX_STORED_CHARS``, 200).
CLAIM_ID_CHARS = 320

# POSIX seconds as doubles: MySQL's FLOAT is single precision, too coarse for timestamps.
claims = Table(
    "idempotent_tasks_claims",
    metadata,
    Column("id", ExactText(CLAIM_ID_CHARS), primary_key=True),
    Column("key", String(1024), nullable=False),
    Column("task_name", String(255), nullable=False),
    # queued | processing | completed | released (a released claim is kept so tokens keep
    # growing)
    Column("status", String(16), nullable=False),
    Column("owner", String(64), nullable=False),
    Column("token", BigInteger, nullable=False),
    Column("takeover", Boolean, nullable=False),
    Column("task_id", String(255), nullable=False),
    Column("fingerprint", String(64), nullable=False),
    Column("lease_expires_at", Double, nullable=False),
    Column("created_at", Double, nullable=False),
    Column("updated_at", Double, nullable=False),
    Column("expires_at", Double, nullable=False),
    Column("result_cached", Boolean, nullable=False),
    Column("content_type", String(128)),
    Column("content_encoding", String(64)),
    Column("result", LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")),
    # Written by a claim of another call's live row: that call's task id, and whether its
    # queued message was handed to the claim, to be published again once the key completes
    # (see claim.lua); kept for the same call's claim made again. NULL in rows of version 3.
    Column("taken_from", String(255)),
    Column("owes_message", Boolean),
    Index("ix_idempotent_tasks_claims_expires", "expires_at"),
    **TEXT_IN_UTF8MB4,
)

#: Version of the pickups table of the SQL store (the pickup guard's outbox; 2 and 3 as for
#: claims).
PICKUPS_SCHEMA_VERSION = 3
PICKUPS_COMPONENT = "pickups"

# The message of a queued claim, kept until a worker claims the key so a sweep can publish it
# again. A row is only meaningful while its claim row is ``queued`` for the same task id; rows
# left behind by a claim are dropped by the sweep that finds them due.
pickups = Table(
    "idempotent_tasks_pickups",
    metadata,
    # The id of the claim row.
    Column("id", ExactText(CLAIM_ID_CHARS), primary_key=True),
    Column("task_id", String(255), nullable=False),
    Column("task_name", String(255), nullable=False),
    Column("envelope", LongBlob, nullable=False),
    # Seconds of the first re-publication backoff (doubled each time).
    Column("timeout", Double, nullable=False),
    Column("republished", Integer, nullable=False),
    # When the message counts as lost (mirrored in the claim row's lease_expires_at).
    Column("due_at", Double, nullable=False),
    Index("ix_idempotent_tasks_pickups_due", "due_at"),
    **TEXT_IN_UTF8MB4,
)


def _compared_exactly(table: Table, column: str) -> Migration:
    """Version 1 -> 2 of a table with an :class:`ExactText` column: on MySQL/MariaDB the
    column, compared by a case- and accent-insensitive collation before, becomes bytes.

    Its text becomes utf8mb4 first (with a binary collation, so no two values become equal):
    a table in the server's default character set (latin1 on many) would otherwise keep
    latin1 bytes, which read back as no text at all.
    """

    def migrate(connection: Connection) -> None:
        dialect = connection.dialect
        if dialect.name in ("mysql", "mariadb"):
            exact = cast(ExactText, table.c[column].type)
            as_utf8mb4 = f"VARCHAR({exact.length}) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
            as_bytes = exact.compile(dialect=dialect)
            for column_type in (as_utf8mb4, as_bytes):
                connection.execute(
                    text(f"ALTER TABLE {table.name} MODIFY {column} {column_type} NOT NULL")
                )

    return migrate


def _in_utf8mb4(table: Table) -> Migration:
    """Version 2 -> 3: on MySQL/MariaDB the table's text, in the server's default character
    set before (latin1 on many), becomes utf8mb4."""

    def migrate(connection: Connection) -> None:
        if connection.dialect.name in ("mysql", "mariadb"):
            connection.execute(text(f"ALTER TABLE {table.name} CONVERT TO CHARACTER SET utf8mb4"))

    return migrate


def _with_columns(table: Table, *names: str) -> Migration:
    """A step adding the nullable columns ``names`` of ``table`` (NULL in its rows), those
    it lacks (a step taken twice, as MySQL's DDL commits at once, adds each once)."""

    def migrate(connection: Connection) -> None:
        present = {column["name"] for column in inspect(connection).get_columns(table.name)}
        for name in names:
            if name not in present:
                column_type = table.c[name].type.compile(dialect=connection.dialect)
                connection.execute(
                    text(f"ALTER TABLE {table.name} ADD COLUMN {name} {column_type}")
                )

    return migrate


DEAD_LETTER_MIGRATIONS: Mapping[int, Migration] = {
    1: _compared_exactly(dead_letters, "failure_id"),
    2: _in_utf8mb4(dead_letters),
}
CLAIMS_MIGRATIONS: Mapping[int, Migration] = {
    1: _compared_exactly(claims, "id"),
    2: _in_utf8mb4(claims),
    3: _with_columns(claims, "taken_from", "owes_message"),
}
PICKUPS_MIGRATIONS: Mapping[int, Migration] = {
    1: _compared_exactly(pickups, "id"),
    2: _in_utf8mb4(pickups),
}
