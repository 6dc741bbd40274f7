"""The SQL store under bad conditions: unreachable database, a schema newer than the code."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from idempotent_tasks.dlq.schema import CLAIMS_COMPONENT, schema_versions
from idempotent_tasks.errors import SchemaVersionError, StoreUnavailable
from idempotent_tasks.records import ClaimRequest
from idempotent_tasks.stores.sql import SqlStore


def _request() -> ClaimRequest:
    return ClaimRequest(
        storage_key="k",
        key="k",
        task_name="t",
        task_id="x",
        owner=uuid.uuid4().hex,
        fingerprint="fp",
        lease_seconds=30,
        ttl_seconds=60,
    )


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://postgres@127.0.0.1:1/nothing",
        "mysql+pymysql://root@127.0.0.1:1/nothing",
    ],
)
def test_unreachable_database_raises_store_unavailable(url: str) -> None:
    store = SqlStore(url, prefix="down")
    with pytest.raises(StoreUnavailable):
        store.claim(_request())
    store.close()


def test_claims_schema_newer_than_the_code_is_refused(tmp_path: object) -> None:
    url = f"sqlite:///{tmp_path}/claims.sqlite3"
    SqlStore(url, prefix="p").claim(_request())
    engine = sa.create_engine(url)
    with engine.begin() as connection:
        connection.execute(
            schema_versions.update()
            .where(schema_versions.c.component == CLAIMS_COMPONENT)
            .values(version=99)
        )
    engine.dispose()
    with pytest.raises(SchemaVersionError, match="schema version 99, newer"):
        SqlStore(url, prefix="p").claim(_request())
