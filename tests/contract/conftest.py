"""One store contract, run against every store: memory, Redis, SQLite, PostgreSQL, MariaDB."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from idempotent_tasks.dlq.schema import claims, pickups
from idempotent_tasks.records import ClaimRequest
from idempotent_tasks.stores import MemoryStore, Store
from idempotent_tasks.stores.redis import RedisStore
from idempotent_tasks.stores.sql import SqlStore
from tests.claim_requests import claim_request
from tests.services import require

CONTRACT_REDIS_DB = 14
CONTRACT_DATABASE = "contract_claims"
STORES = ["memory", "redis", "sqlite", "postgresql", "mariadb"]
SERVER_STORES = ["redis", "sqlite", "postgresql", "mariadb"]


@pytest.fixture(scope="session")
def sql_urls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A fresh database per SQL dialect for the store contract (created once per session)."""
    require("PostgreSQL")
    require("MariaDB")
    admin = sa.create_engine(
        "postgresql+psycopg://postgres@127.0.0.1:5432/postgres", isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as connection:
        connection.execute(sa.text(f"DROP DATABASE IF EXISTS {CONTRACT_DATABASE} WITH (FORCE)"))
        connection.execute(sa.text(f"CREATE DATABASE {CONTRACT_DATABASE}"))
    admin.dispose()
    maria = sa.create_engine("mysql+pymysql://root@127.0.0.1:3306/test")
    with maria.begin() as connection:
        connection.execute(sa.text(f"DROP DATABASE IF EXISTS {CONTRACT_DATABASE}"))
        connection.execute(sa.text(f"CREATE DATABASE {CONTRACT_DATABASE}"))
    maria.dispose()
    return {
        "sqlite": f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'claims.sqlite3'}",
        "postgresql": f"postgresql+psycopg://postgres@127.0.0.1:5432/{CONTRACT_DATABASE}",
        "mariadb": f"mysql+pymysql://root@127.0.0.1:3306/{CONTRACT_DATABASE}",
    }


def store_url(kind: str, request: pytest.FixtureRequest) -> str:
    """The URL of an emptied server store of ``kind``."""
    if kind == "redis":
        url = f"{request.getfixturevalue('redis_url')}/{CONTRACT_REDIS_DB}"
        redis.Redis.from_url(url).flushdb()
        return url
    url: str = request.getfixturevalue("sql_urls")[kind]
    engine = sa.create_engine(url)
    with engine.begin() as connection:
        inspector = sa.inspect(connection)
        for table in (claims, pickups):
            if inspector.has_table(table.name):
                connection.execute(table.delete())
    engine.dispose()
    return url


def open_store(kind: str, url: str, prefix: str = "contract") -> Store:
    if kind == "redis":
        return RedisStore.from_url(url, prefix=prefix)
    return SqlStore(url, prefix=prefix)


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """Each store, empty."""
    if request.param == "memory":
        yield MemoryStore()
        return
    opened = open_store(request.param, store_url(request.param, request))
    yield opened
    opened.close()


@pytest.fixture()
def make_request() -> Callable[..., ClaimRequest]:
    """Build claim requests for one fresh key; keyword arguments override any field."""
    key = f"key-{uuid.uuid4().hex[:8]}"

    def build(**overrides: Any) -> ClaimRequest:
        fields: dict[str, Any] = {"key": key, "task_name": "tasks.charge", "fingerprint": "fp-1"}
        return claim_request(**{**fields, **overrides})

    return build


__all__ = ["SERVER_STORES", "Path", "open_store", "store_url"]
