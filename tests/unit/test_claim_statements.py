"""The SQL claim store's dialect-dependent statements, compiled for every dialect we support."""

from __future__ import annotations

import re

import pytest
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.dialects.mysql.mariadb import MariaDBDialect
from sqlalchemy.engine import Dialect

from idempotent_tasks.stores import sql_statements

DIALECTS: dict[str, Dialect] = {
    "postgresql": postgresql.dialect(),
    "sqlite": sqlite.dialect(),
    "mysql": mysql.dialect(),
    "mariadb": MariaDBDialect(),
}
CLAIM_ROW = {"id": "p:t:k", "status": "processing", "owner": "o", "token": 1}
PICKUP_ROW = {"id": "p:t:k", "task_id": "t-1", "republished": 0, "due_at": 1.5}


def _sql(statement: object, name: str) -> str:
    compiled = statement.compile(dialect=DIALECTS[name])  # type: ignore[attr-defined]
    return " ".join(str(compiled).split())


def _assigned(sql: str, after: str) -> list[str]:
    """Columns assigned (``column = ...``) after ``after`` in ``sql``."""
    return re.findall(r"(?:^|, |\s)(\w+) = ", sql.split(after, 1)[1])


@pytest.mark.parametrize("name", ["postgresql", "sqlite"])
def test_fresh_claim_insert_does_nothing_on_conflict_and_returns_the_id(name: str) -> None:
    sql = _sql(sql_statements.insert_if_absent(name, CLAIM_ROW), name)
    assert sql.startswith("INSERT INTO idempotent_tasks_claims")
    assert re.search(r"ON CONFLICT DO NOTHING RETURNING (idempotent_tasks_claims\.)?id$", sql)


def test_fresh_claim_insert_on_a_sqlite_without_returning_returns_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # SQLite before 3.35 refuses RETURNING: its count of changes says whether the row went in.
    monkeypatch.setattr(sql_statements, "SQLITE_RETURNING", False)
    sql = _sql(sql_statements.insert_if_absent("sqlite", CLAIM_ROW), "sqlite")
    assert sql.endswith("ON CONFLICT DO NOTHING")


@pytest.mark.parametrize("name", ["mysql", "mariadb"])
def test_fresh_claim_insert_ignores_a_duplicate_on_mysql(name: str) -> None:
    sql = _sql(sql_statements.insert_if_absent(name, CLAIM_ROW), name)
    assert sql.startswith("INSERT IGNORE INTO idempotent_tasks_claims")
    assert "ON DUPLICATE" not in sql


@pytest.mark.parametrize("name", ["postgresql", "sqlite"])
def test_pickup_upsert_replaces_every_column_but_the_id(name: str) -> None:
    sql = _sql(sql_statements.upsert_pickup(name, PICKUP_ROW), name)
    assert "ON CONFLICT (id) DO UPDATE SET" in sql
    assert _assigned(sql, "DO UPDATE SET") == ["task_id", "republished", "due_at"]


@pytest.mark.parametrize("name", ["mysql", "mariadb"])
def test_pickup_upsert_on_mysql_updates_on_duplicate_key(name: str) -> None:
    sql = _sql(sql_statements.upsert_pickup(name, PICKUP_ROW), name)
    assert _assigned(sql, "ON DUPLICATE KEY UPDATE") == ["task_id", "republished", "due_at"]


def test_compare_and_set_matches_every_field_a_write_changes() -> None:
    read = {
        "owner": "o",
        "token": 3,
        "status": "processing",
        "lease_expires_at": 10.0,
        "updated_at": 5.0,
    }
    sql = _sql(sql_statements.replace_if_unchanged("p:t:k", read, {"owner": "n"}), "postgresql")
    where = sql.split(" WHERE ", 1)[1]
    for column in ("id", *read):
        assert f"idempotent_tasks_claims.{column} = " in where


def test_server_time_is_read_from_the_server_clock_on_postgresql() -> None:
    sql = _sql(sql_statements.select_server_time("postgresql"), "postgresql")
    assert sql == "SELECT EXTRACT(epoch FROM clock_timestamp()) AS anon_1"


@pytest.mark.parametrize("name", ["mysql", "mariadb"])
def test_server_time_on_mysql_is_computed_from_utc_not_the_session_zone(name: str) -> None:
    sql = _sql(sql_statements.select_server_time(name), name)
    assert "timestampdiff(MICROSECOND," in sql
    assert "utc_timestamp(6)" in sql  # literal: a server-side bind could not size it
    assert "now(" not in sql.lower() and "unix_timestamp" not in sql.lower()


def test_sqlite_has_no_server_time() -> None:
    assert sql_statements.select_server_time("sqlite") is None
