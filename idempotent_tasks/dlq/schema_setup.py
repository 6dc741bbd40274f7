"""Creating a component's tables on first use, and refusing a database newer than the code."""

from __future__ import annotations

from sqlalchemy import Engine, Table, inspect
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

from ..errors import SchemaVersionError, StoreUnavailable
from . import queries
from .schema import metadata, schema_versions


def ensure_component(
    engine: Engine, *, component: str, version: int, tables: list[Table], what: str
) -> None:
    """Create ``tables`` (and the version table) if missing, record or check ``version``.

    Raises:
        SchemaVersionError: the database records a newer version of ``component``.
        StoreUnavailable: the database cannot be reached.
    """
    try:
        _create_or_check(engine, component, version, tables, what)
    except (OperationalError, ProgrammingError, IntegrityError):
        # Another process created the tables at the same moment, or the database is down:
        # look once more, and call whatever is still wrong unreachable.
        try:
            _create_or_check(engine, component, version, tables, what)
        except (OperationalError, ProgrammingError, IntegrityError) as exc:
            raise StoreUnavailable(f"{what} database unreachable or unusable: {exc}") from exc


def _create_or_check(
    engine: Engine, component: str, version: int, tables: list[Table], what: str
) -> None:
    with engine.begin() as connection:
        inspector = inspect(connection)
        missing = [t for t in [schema_versions, *tables] if not inspector.has_table(t.name)]
        if missing:
            metadata.create_all(connection, tables=missing, checkfirst=True)
        found = connection.execute(queries.select_schema_version(component)).scalar_one_or_none()
        if found is None:
            connection.execute(queries.insert_schema_version(component, version))
            return
    if int(found) > version:
        raise SchemaVersionError(
            f"the {what} tables at {_safe(engine)} are at schema version {found}, newer than "
            f"this idempotent_tasks understands ({version}); upgrade idempotent_tasks "
            "(or point it at another database)"
        )
    if int(found) < version:  # pragma: no cover - version 1 is the first there is
        raise SchemaVersionError(
            f"the {what} tables at {_safe(engine)} are at schema version {found}, older than "
            f"{version}, and no migration from it exists"
        )


def _safe(engine: Engine) -> str:
    return make_url(str(engine.url)).render_as_string(hide_password=True)
