"""Creating a component's tables on first use, and refusing a database newer than the code."""

from __future__ import annotations

import random
import time
from collections.abc import Mapping

from sqlalchemy import Connection, Engine, Table, inspect
from sqlalchemy.engine.interfaces import ReflectedIndex
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError, SQLAlchemyError

from ..errors import SchemaVersionError, StoreUnavailable
from ..urls import shown_url
from . import queries
from .schema import Migration, metadata, schema_versions

#: Rounds of "look, create what is missing, record the version" before giving up: processes
#: starting together on an empty database race to create the same tables.
SETUP_ROUNDS = 8


def ensure_component(
    engine: Engine,
    *,
    component: str,
    version: int,
    tables: list[Table],
    what: str,
    migrations: Mapping[int, Migration] | None = None,
) -> None:
    """Create ``tables`` (and the version table) if missing, record or check ``version``.

    Tables at an older version are brought to ``version`` by ``migrations`` (keyed by the
    version each step starts from). Safe when several processes do it at once: whoever loses
    a race to create a table, record the version or take a step looks again.

    Raises:
        SchemaVersionError: the database records a newer version of ``component``.
        StoreUnavailable: the database cannot be reached.
    """
    _probe(engine, what)
    for round_number in range(1, SETUP_ROUNDS + 1):
        try:
            _create_or_check(engine, component, version, tables, what, migrations or {})
            return
        except (OperationalError, ProgrammingError, IntegrityError) as exc:
            if round_number == SETUP_ROUNDS:
                raise StoreUnavailable(f"{what} database unusable: {exc}") from exc
            time.sleep(random.uniform(0.02, 0.1) * round_number)
        except SQLAlchemyError as exc:  # a connection dropped half-way (InterfaceError), say
            raise StoreUnavailable(f"{what} database unusable: {exc}") from exc


def _probe(engine: Engine, what: str) -> None:
    """Connect once, so that a database that is down fails fast and says so.

    SQLite's switch to WAL on a new connection can find the file locked by another process
    doing the same (SQLite does not always wait its busy timeout there): that is retried.
    """
    for round_number in range(1, SETUP_ROUNDS + 1):
        try:
            with engine.connect():
                return
        except OperationalError as exc:
            if "database is locked" not in str(exc) or round_number == SETUP_ROUNDS:
                raise StoreUnavailable(f"{what} database unreachable: {exc}") from exc
            time.sleep(random.uniform(0.02, 0.1) * round_number)
        except SQLAlchemyError as exc:
            raise StoreUnavailable(f"{what} database unreachable: {exc}") from exc


def _create_or_check(
    engine: Engine,
    component: str,
    version: int,
    tables: list[Table],
    what: str,
    migrations: Mapping[int, Migration],
) -> None:
    with engine.begin() as connection:
        inspector = inspect(connection)
        missing = [t for t in [schema_versions, *tables] if not inspector.has_table(t.name)]
        if missing:
            metadata.create_all(connection, tables=missing, checkfirst=True)
        found = connection.execute(queries.select_schema_version(component)).scalar_one_or_none()
        if found is None:
            connection.execute(queries.insert_schema_version(component, version))
            found = version
    while int(found) < version and int(found) in migrations:
        step = migrations[int(found)]
        with engine.begin() as connection:
            # MySQL commits its DDL at once: the steps are written to be taken twice unharmed.
            step(connection)
            connection.execute(queries.advance_schema_version(component, int(found)))
            found = connection.execute(queries.select_schema_version(component)).scalar_one()
    if int(found) > version:
        raise SchemaVersionError(
            f"the {what} tables at {_safe(engine)} are at schema version {found}, newer than "
            f"this idempotent_tasks understands ({version}); upgrade idempotent_tasks "
            "(or point it at another database)"
        )
    if int(found) < version:
        raise SchemaVersionError(
            f"the {what} tables at {_safe(engine)} are at schema version {found}, older than "
            f"{version}, and no migration from it exists"
        )
    # Only at this version: the indexes are this version's.
    with engine.begin() as connection:
        inspector = inspect(connection)
        for table in tables:
            _create_missing_indexes(connection, inspector.get_indexes(table.name), table)


def _create_missing_indexes(
    connection: Connection, present: list[ReflectedIndex], table: Table
) -> None:
    """Create the indexes of ``table`` the database lacks: MySQL commits each CREATE at once,
    so a process stopped between a table's CREATE TABLE and its CREATE INDEX left the table
    without them (and every sweep scanning it whole)."""
    names = {index["name"] for index in present}
    for index in table.indexes:
        if index.name not in names:
            index.create(connection)


def _safe(engine: Engine) -> str:
    return shown_url(engine.url.render_as_string(hide_password=True))
