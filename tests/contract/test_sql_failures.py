"""The SQL store under bad conditions: unreachable database, a schema newer than the code."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from idempotent_tasks.dlq.schema import CLAIMS_COMPONENT, schema_versions
from idempotent_tasks.errors import SchemaVersionError, StoreUnavailable
from idempotent_tasks.records import ClaimRequest, Pickup
from idempotent_tasks.stores.sql import SqlStore

from .conftest import store_url


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


@pytest.mark.parametrize("kind", ["postgresql", "mariadb"])
def test_a_cancel_needs_no_second_pooled_connection_to_read_the_clock(
    kind: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a reservation, and a store whose pool has one connection and whose clock has not
    # read the server's time yet
    url = store_url(kind, request)
    publisher = SqlStore(url, prefix="one-connection")
    assert publisher.reserve(_request(), Pickup(envelope=b"m", due_in=60, timeout=60)) is None
    publisher.close()
    monkeypatch.setattr(
        "idempotent_tasks.stores.sql.create_dlq_engine",
        lambda url: sa.create_engine(url, pool_size=1, max_overflow=0, pool_timeout=1),
    )
    store = SqlStore(url, prefix="one-connection")
    try:
        # Then its first operation, a cancel, reads the clock before it holds the connection
        assert store.cancel_reservation(_request()) is True
    finally:
        store.close()
