"""The SQL store when the database picks one of its transactions as a deadlock's victim: the
operation runs again, as nothing of it was written, instead of failing as an unavailable store
(which would put the task off for seconds, or fail a completion whose body has run)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from idempotent_tasks.dlq.schema import claims, pickups
from idempotent_tasks.records import ClaimRequest, CompleteOutcome, EncodedResult, Outcome, Pickup
from idempotent_tasks.stores.sql import SqlStore
from tests.claim_requests import claim_request

from .conftest import store_url

RESULT = EncodedResult(content_type="application/json", content_encoding="utf-8", body=b"42")
#: Rows the test's own transaction writes first on MariaDB, where InnoDB rolls back the
#: transaction that wrote fewer rows: the store's (one row) must be the one chosen.
BALLAST_ROWS = 50


def _request(task_id: str) -> ClaimRequest:
    return claim_request(
        key="o-1",
        task_name="charge",
        task_id=task_id,
        lease_seconds=60,
        ttl_seconds=600,
    )


def _lock_waits(engine: sa.Engine, kind: str) -> int:
    """Transactions of the database waiting for a row lock now."""
    query = (
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        if kind == "postgresql"
        else "SELECT count(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'"
    )
    with engine.connect() as connection:
        return int(connection.execute(sa.text(query)).scalar_one())


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen within {timeout} s: {what}")
        time.sleep(0.02)


@pytest.mark.parametrize("kind", ["postgresql", "mariadb"])
def test_a_completion_chosen_as_a_deadlocks_victim_runs_again_and_stores_the_result(
    kind: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    url = store_url(kind, request)
    store = SqlStore(url, prefix=f"deadlock-{uuid.uuid4().hex[:8]}")
    engine = sa.create_engine(url)
    try:
        # Given a key reserved at publish and claimed by its own message: its claim row is
        # processing and its pickup row stays beside it (the completion deletes it)
        call = _request(task_id="t-1")
        assert store.reserve(call, Pickup(envelope=b"{}", due_in=60, timeout=60)) is None
        claimed = store.claim(call)
        assert claimed.outcome is Outcome.ACQUIRED
        claim_id = store.claim_id(call.storage_key)
        # ... and another transaction holding the pickup row's lock (after writing rows of its
        # own, so that on MariaDB it is not the lighter one)
        other = engine.connect()
        transaction = other.begin()
        if kind == "mariadb":
            other.execute(sa.text("CREATE TABLE IF NOT EXISTS deadlock_ballast (n INT)"))
            other.execute(
                sa.text("INSERT INTO deadlock_ballast (n) VALUES (:n)"),
                [{"n": n} for n in range(BALLAST_ROWS)],
            )
        other.execute(sa.select(pickups).where(pickups.c.id == claim_id).with_for_update())
        # When the owner completes (its transaction updates the claim row, then waits for the
        # pickup row), and the other transaction then asks for the claim row: a deadlock
        caplog.set_level(logging.DEBUG, logger="idempotent_tasks.stores.sql_deadlocks")
        outcome: list[object] = []
        completing = threading.Thread(
            target=lambda: outcome.append(_outcome(store, call, claimed.token))
        )
        completing.start()
        _wait_for(lambda: _lock_waits(engine, kind) == 1, "the completion waiting for a lock")
        touch = claims.update().where(claims.c.id == claim_id)
        # (this waits until the database has rolled the completion back)
        other.execute(touch.values(updated_at=claims.c.updated_at))
        transaction.commit()
        other.close()
        completing.join(timeout=30)
        # Then the database rolled the completion's transaction back, and the store ran the
        # completion again: the result is stored, and the pickup is gone with the claim's end
        assert outcome == [CompleteOutcome.STORED]
        assert any("deadlock's victim" in record.getMessage() for record in caplog.records)
        record = store.get(call.storage_key)
        assert record is not None
        assert (record.status, record.result) == ("completed", RESULT)
        with engine.connect() as connection:
            left = connection.execute(sa.select(pickups.c.id).where(pickups.c.id == claim_id))
            assert left.first() is None
    finally:
        store.close()
        engine.dispose()


def _outcome(store: SqlStore, call: ClaimRequest, token: int) -> object:
    try:
        return store.complete(call, token, RESULT)
    except Exception as exc:  # reported by the assertion on the outcome
        return exc


def test_mariadbs_row_changed_since_the_snapshot_counts_as_a_rollback_for_another() -> None:
    # MariaDB 11.6.2 and later refuse, with innodb_snapshot_isolation on (their default), a
    # write to a row changed since the transaction's snapshot; this machine's 10.11 cannot
    # produce it, so the error is the one PyMySQL raises for it
    import pymysql

    from idempotent_tasks.stores.sql_deadlocks import was_rolled_back_for_another

    changed = pymysql.err.OperationalError(1020, "Record has changed since last read in table")
    assert was_rolled_back_for_another(sa.exc.OperationalError("UPDATE", {}, changed))
    other = pymysql.err.OperationalError(2013, "Lost connection to MySQL server")
    assert not was_rolled_back_for_another(sa.exc.OperationalError("UPDATE", {}, other))
