"""The dialect-dependent dead-letter statement, compiled for every dialect we support."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.dialects.mysql.mariadb import MariaDBDialect
from sqlalchemy.engine import Dialect

from idempotent_tasks.dlq import queries

NOW = datetime(2024, 5, 17, 12, 0, tzinfo=timezone.utc)

LOCKING_DIALECTS = {
    "postgresql": postgresql.dialect(),
    "mysql": mysql.dialect(),
    "mariadb": MariaDBDialect(),
}


def _sql(dialect: Dialect) -> str:
    return " ".join(str(queries.select_due_ids(NOW, 25).compile(dialect=dialect)).split())


@pytest.mark.parametrize("name", sorted(LOCKING_DIALECTS))
def test_due_ids_skip_rows_another_sweep_locked(name: str) -> None:
    dialect = LOCKING_DIALECTS[name]
    assert dialect.name == name
    sql = _sql(dialect)
    assert sql.endswith("FOR UPDATE SKIP LOCKED")
    assert sql.count("FOR UPDATE") == 1


def test_due_ids_on_sqlite_take_no_row_locks() -> None:
    # SQLite has no FOR UPDATE; its writers are serialised by the database lock instead.
    sql = _sql(sqlite.dialect())
    assert "FOR UPDATE" not in sql
    assert "SKIP LOCKED" not in sql


@pytest.mark.parametrize("name", [*sorted(LOCKING_DIALECTS), "sqlite"])
def test_due_ids_are_pending_due_oldest_first_and_limited(name: str) -> None:
    dialect = sqlite.dialect() if name == "sqlite" else LOCKING_DIALECTS[name]
    compiled = queries.select_due_ids(NOW, 25).compile(dialect=dialect)
    sql = " ".join(str(compiled).split())
    assert "idempotent_tasks_dead_letters.status =" in sql
    assert "idempotent_tasks_dead_letters.next_retry_at <=" in sql
    assert "ORDER BY idempotent_tasks_dead_letters.next_retry_at" in sql
    assert "LIMIT" in sql
    params = compiled.params
    assert queries.PENDING in params.values()
    assert 25 in params.values()


def _server(dialect: Dialect, version: tuple[int, ...]) -> Dialect:
    dialect.server_version_info = version
    return dialect


@pytest.mark.parametrize(
    ("dialect", "skips"),
    [
        (_server(MariaDBDialect(), (10, 5, 23)), False),
        (_server(MariaDBDialect(), (10, 6, 0)), True),
        (_server(MariaDBDialect(), (11, 4, 2)), True),
        (_server(mysql.dialect(), (5, 7, 44)), False),
        (_server(mysql.dialect(), (8, 0, 36)), True),
        (mysql.dialect(), False),  # not connected yet: no version to trust
        (_server(postgresql.dialect(), (12, 0)), True),
    ],
)
def test_rows_locked_by_another_sweep_are_skipped_only_where_the_server_can(
    dialect: Dialect, skips: bool
) -> None:
    # (MariaDB before 10.6 and MySQL before 8.0.1 refuse SKIP LOCKED as a syntax error: the
    # sweep would fail for good there)
    assert queries.skips_locked_rows(dialect) is skips
    sql = str(queries.select_due_ids(NOW, 25, skip_locked=skips).compile(dialect=dialect))
    assert ("FOR UPDATE" in sql) is skips
