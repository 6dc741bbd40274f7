"""SQLAlchemy engines for the dead-letter database, with what each dialect needs."""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import NoSuchModuleError

from ..urls import shown_url
from .liveness import libpq_liveness_args, watch_pymysql_socket

#: Seconds a new PostgreSQL connection through libpq may take (it waits for ever by default),
#: unless the URL sets ``connect_timeout``. A worker's main process writes dead letters too (a
#: call killed at its time limit) and must not hang on a server that does not answer.
CONNECT_TIMEOUT_SECONDS = 10
#: Seconds an SQLite writer waits for another writer's lock before failing.
SQLITE_BUSY_TIMEOUT_MS = 10_000

#: PostgreSQL drivers on libpq, whose ``connect_timeout`` bounds the connection only (pg8000's
#: ``timeout`` would bound every statement too, and is left to the URL).
_LIBPQ_DRIVERS = frozenset({"psycopg", "psycopg2", "psycopg2cffi"})
_DRIVER_EXTRAS = {"postgresql": "sql", "mysql": "sql", "mariadb": "sql"}


#: The dead-letter table's default SQLite file, in the data folder.
DEAD_LETTERS_FILE = "dead_letters.sqlite3"


def default_sqlite_url(filename: str = DEAD_LETTERS_FILE) -> str:
    """A local SQLite file, used where no URL is set (its folder made if missing).

    ``$IDEMPOTENT_TASKS_DATA_DIR/<filename>``, else ``$XDG_DATA_HOME/idempotent_tasks/<filename>``
    (``~/.local/share/idempotent_tasks/<filename>``).
    """
    path = default_sqlite_path(filename)
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def default_sqlite_path(filename: str) -> Path:
    """Where :func:`default_sqlite_url` keeps ``filename`` (nothing made).

    Raises:
        OSError: no ``IDEMPOTENT_TASKS_DATA_DIR`` or ``XDG_DATA_HOME``, and no home folder to
            find (a container's user without one).
    """
    base = os.environ.get("IDEMPOTENT_TASKS_DATA_DIR")
    if base:
        return Path(base) / filename
    data_home = os.environ.get("XDG_DATA_HOME")
    if not data_home:
        try:
            data_home = str(Path.home() / ".local" / "share")
        except RuntimeError as exc:  # no HOME, and no passwd entry for this user
            raise OSError(
                f"no folder for the default SQLite files ({exc}): set "
                "IDEMPOTENT_TASKS_DATA_DIR, or the URLs of the store and dead-letter table"
            ) from exc
    return Path(data_home) / "idempotent_tasks" / filename


def create_dlq_engine(url: str) -> Engine:
    """An engine for ``url``: pre-ping on every dialect; a connect timeout and doubles printed
    exactly on PostgreSQL; a database gone silent detected in seconds on PostgreSQL and on
    PyMySQL (:mod:`.liveness`); WAL and a busy timeout on SQLite.

    Raises:
        ImportError: the URL's driver is not installed (naming the extra that brings it).
    """
    if url.split("://", 1)[0].split("+", 1)[0] == "postgres":
        instead = shown_url(f"postgresql+psycopg://{url.split('://', 1)[-1]}")
        raise ValueError(
            f"SQLAlchemy names PostgreSQL postgresql://, not postgres://: use {instead}"
        )
    parsed = make_url(url)
    dialect = parsed.get_backend_name()
    if dialect == "sqlite" and _in_memory(parsed.database, parsed.query):
        raise ValueError(
            f"{shown_url(url)} is an SQLite database in memory, which each connection (a "
            "thread, a process) has a new one of, and which is gone once closed: use a file, "
            "sqlite:///path (or memory:// for a claim store within one process)"
        )
    options: dict[str, Any] = {"pool_pre_ping": True}
    driver = parsed.get_driver_name()
    if dialect == "postgresql" and driver in _LIBPQ_DRIVERS:
        connect_args = libpq_liveness_args(driver, parsed.query)
        if "connect_timeout" not in parsed.query:
            connect_args["connect_timeout"] = CONNECT_TIMEOUT_SECONDS
        options["connect_args"] = connect_args
    try:
        engine = create_engine(url, **options)
    except (ImportError, NoSuchModuleError) as exc:
        extra = _DRIVER_EXTRAS.get(dialect, "sql")
        raise ImportError(
            f"no driver for {url.split('://')[0]}: pip install 'idempotent-tasks[{extra}]'"
        ) from exc
    if dialect == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    elif dialect == "postgresql":
        event.listen(engine, "connect", _exact_doubles)
    elif driver == "pymysql":
        event.listen(engine, "connect", watch_pymysql_socket)
    return engine


def _in_memory(database: str | None, query: Any) -> bool:
    """Whether an SQLite URL's database is in memory: no file name, ``:memory:``, or a
    ``file:`` URI naming ``:memory:`` or with ``mode=memory``."""
    if not database or database == ":memory:":
        return True
    if not database.startswith("file:"):
        return False
    return ":memory:" in database or "mode=memory" in database or query.get("mode") == "memory"


def _sqlite_pragmas(connection: Any, _record: Any) -> None:
    cursor = connection.cursor()
    # The busy timeout first: switching to WAL needs a lock another process may hold.
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA journal_mode=WAL")
    # LIKE as the other databases compare: the claim store's sweep selects its own prefix's
    # keys with one, and "Shop:" must not take "shop:"'s.
    cursor.execute("PRAGMA case_sensitive_like=ON")
    cursor.close()


def _exact_doubles(connection: Any, _record: Any) -> None:
    # Doubles printed exactly, whatever the server, database or role sets: the claim store
    # reads times back and compares them in its next change. Rounded to 15 digits
    # (extra_float_digits = 0, PostgreSQL's default before 12), they never match.
    cursor = connection.cursor()
    cursor.execute("SET extra_float_digits = 3")
    cursor.close()
    connection.commit()  # the setting would go with the transaction's rollback


def to_db_time(engine: Engine, moment: datetime) -> datetime:
    """A UTC moment as the dialect stores it (naive UTC where columns keep no zone)."""
    moment = moment.astimezone(timezone.utc)
    if engine.dialect.name == "postgresql":
        return moment
    return moment.replace(tzinfo=None)


def from_db_time(moment: datetime | None) -> datetime | None:
    """A stored moment, timezone-aware in UTC."""
    if moment is None:
        return None
    if moment.tzinfo is None:
        return moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc)


def driver_codes(error: BaseException | None) -> tuple[str | None, object]:
    """A driver's error as its codes: the SQLSTATE (psycopg's ``sqlstate``, psycopg2's
    ``pgcode``) and the first argument (PyMySQL's and mysqlclient's error number)."""
    state = getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)
    args: tuple[object, ...] = getattr(error, "args", None) or ()
    return (state if isinstance(state, str) else None), (args[0] if args else None)
