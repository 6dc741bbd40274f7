"""The SQL store under bad conditions: unreachable database, a schema newer or older than the
code, a pool with no connection to spare."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import Any

import pytest
import sqlalchemy as sa

from idempotent_tasks.codec import ResultCodec
from idempotent_tasks.core import Attempt
from idempotent_tasks.dlq import DeadLetterQueue, Failure, schema_setup
from idempotent_tasks.dlq.schema import (
    CLAIMS_COMPONENT,
    CLAIMS_SCHEMA_VERSION,
    PICKUPS_COMPONENT,
    PICKUPS_SCHEMA_VERSION,
    claims,
    dead_letters,
    pickups,
    schema_versions,
)
from idempotent_tasks.errors import CorruptRecord, SchemaVersionError, StoreUnavailable
from idempotent_tasks.records import ClaimRequest, CompleteOutcome, EncodedResult, Outcome, Pickup
from idempotent_tasks.stores.sql import SqlStore
from tests.claim_requests import claim_request
from tests.integration.databases import fresh_mariadb_database, version_one_dead_letter

from .conftest import store_url

#: The guard's copy of a message that counts as lost at once.
DUE_NOW = Pickup(envelope=b"{}", due_in=0.0, timeout=60)


def _request(key: str = "k") -> ClaimRequest:
    return claim_request(key=key, storage_key=key, task_id="x")


def _garble_pickup(store: SqlStore, storage_key: str, column: str) -> None:
    """Write text into one column of a key's pickup row, as SQLite lets anyone."""
    with store.engine.begin() as connection:
        connection.execute(
            sa.text(f"UPDATE {pickups.name} SET {column} = 'x' WHERE id = :id"),
            {"id": store.claim_id(storage_key)},
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


def test_a_connection_dropped_while_the_tables_are_set_up_is_store_unavailable(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a first use whose table setup loses its connection half-way (not an operational
    # error: an interface error, as a driver raises for a connection closed under it)
    def dropped(*_: object, **__: object) -> None:
        raise sa.exc.InterfaceError("SELECT version", None, ConnectionResetError("closed"))

    monkeypatch.setattr(schema_setup, "_create_or_check", dropped)
    store = SqlStore(f"sqlite:///{tmp_path}/claims.sqlite3", prefix="p")
    # When a claim is asked, then it fails closed as an unavailable store (retried later)
    with pytest.raises(StoreUnavailable, match="database unusable"):
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
        assert store.cancel_reservation("k", "x") is True
    finally:
        store.close()


#: Columns of the claims table version 4 added.
VERSION_FOUR_COLUMNS = ("taken_from", "owes_message")


def _version_one_tables(engine: sa.Engine) -> sa.Table:
    """The claim store's tables as version 1 made them: ids compared by the database's default
    collation (on MariaDB, blind to case, accents and trailing spaces), and without the
    columns of version 4."""
    old = sa.MetaData()
    for table in (claims, pickups):
        columns = [
            sa.Column("id", sa.String(320), primary_key=True)
            if column.name == "id"
            else column._copy()
            for column in table.columns
            if column.name not in VERSION_FOUR_COLUMNS
        ]
        sa.Table(table.name, old, *columns)
    with engine.begin() as connection:
        for table in (claims, pickups, schema_versions):
            connection.execute(sa.text(f"DROP TABLE IF EXISTS {table.name}"))
        old.create_all(connection)
        schema_versions.create(connection)
        for component in (CLAIMS_COMPONENT, PICKUPS_COMPONENT):
            connection.execute(schema_versions.insert().values(component=component, version=1))
    return old.tables[claims.name]


V1_RESULT = EncodedResult(content_type="application/json", content_encoding="utf-8", body=b"1")


def _completed_version_one_claim(engine: sa.Engine, old_claims: sa.Table, key: str) -> ClaimRequest:
    """Write a completed claim of ``key`` (prefix "migrated") into version 1's claims table;
    the request that claims the key again."""
    with engine.begin() as connection:
        connection.execute(
            old_claims.insert().values(
                id=f"migrated:t:{key}",
                key=key,
                task_name="t",
                status="completed",
                owner="o",
                token=1,
                takeover=False,
                task_id="x",
                fingerprint="fp",
                lease_expires_at=0.0,
                created_at=0.0,
                updated_at=0.0,
                expires_at=4e9,
                result_cached=True,
                content_type=V1_RESULT.content_type,
                content_encoding=V1_RESULT.content_encoding,
                result=V1_RESULT.body,
            )
        )
    return claim_request(
        key=key,
        task_id="x",
        owner="o2",
        ttl_seconds=600,
    )


@pytest.mark.parametrize("kind", ["postgresql", "mariadb", "sqlite"])
def test_version_one_tables_are_brought_to_exact_ids_keeping_their_rows(
    kind: str, request: pytest.FixtureRequest
) -> None:
    # Given a database with the version 1 tables and a completed key in them
    url = store_url(kind, request)
    engine = sa.create_engine(url)
    old_key = _completed_version_one_claim(engine, _version_one_tables(engine), "order-42")
    # When a store of this version opens it
    store = SqlStore(url, prefix="migrated")
    try:
        # Then the row is still there, and a key that differs only in case is its own
        found = store.claim(old_key)
        assert (found.outcome, found.record and found.record.result) == (
            Outcome.COMPLETED,
            V1_RESULT,
        )
        other = dataclasses.replace(old_key, storage_key="t:ORDER-42", key="ORDER-42", owner="o3")
        claimed = store.claim(other)
        assert claimed.outcome is Outcome.ACQUIRED
        assert store.complete(other, claimed.token, None) is CompleteOutcome.STORED
        with engine.connect() as connection:
            versions = dict(connection.execute(sa.select(schema_versions)).all())
        assert versions[CLAIMS_COMPONENT] == CLAIMS_SCHEMA_VERSION == 4
        assert versions[PICKUPS_COMPONENT] == PICKUPS_SCHEMA_VERSION == 3
        # and the columns of version 4 are there, for a claim to write
        present = {column["name"] for column in sa.inspect(engine).get_columns(claims.name)}
        assert present.issuperset(VERSION_FOUR_COLUMNS)
    finally:
        store.close()
        engine.dispose()


NUMBER_COLUMNS = ["token", "lease_expires_at", "expires_at", "created_at"]


def _corrupt_claim_row(store: SqlStore, column: str, value: str) -> None:
    """Write ``value`` as text into one column of every claim row, as SQLite lets anyone."""
    with store.engine.begin() as connection:
        connection.execute(sa.text(f"UPDATE {claims.name} SET {column} = :value"), {"value": value})


@pytest.mark.parametrize(
    ("kind", "column"),
    [("sqlite", column) for column in NUMBER_COLUMNS]
    + [(kind, "status") for kind in ("sqlite", "postgresql", "mariadb")],
)
def test_a_claim_row_that_cannot_be_read_is_a_corrupt_record_until_forgotten(
    kind: str, column: str, request: pytest.FixtureRequest
) -> None:
    store = SqlStore(store_url(kind, request), prefix=f"corrupt-{uuid.uuid4().hex[:8]}")
    try:
        first = _request()
        assert store.claim(first).outcome is Outcome.ACQUIRED
        _corrupt_claim_row(store, column, "garbled")
        # Every read names the row unreadable, never a raw TypeError or ValueError
        with pytest.raises(CorruptRecord, match="unreadable"):
            store.claim(dataclasses.replace(first, owner="other", task_id="y"))
        pickup = Pickup(envelope=b"{}", due_in=60, timeout=60)
        with pytest.raises(CorruptRecord, match="unreadable"):
            store.reserve(dataclasses.replace(first, task_id="y"), pickup)
        with pytest.raises(CorruptRecord, match="unreadable"):
            store.get(first.storage_key)
        # Forgetting the key (the operator's way out) deletes the row: the key works again
        assert store.forget(first.storage_key) is True
        second = dataclasses.replace(first, owner="other", task_id="y")
        claim = store.claim(second)
        assert claim.outcome is Outcome.ACQUIRED
        assert store.complete(second, claim.token, None) is CompleteOutcome.STORED
    finally:
        with store.engine.begin() as connection:
            connection.execute(claims.delete().where(claims.c.id.like(f"{store.prefix}:%")))
        store.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_sweep_skips_a_key_whose_claim_row_is_unreadable_and_takes_the_others(
    kind: str, request: pytest.FixtureRequest
) -> None:
    store = SqlStore(store_url(kind, request), prefix=f"sweep-{uuid.uuid4().hex[:8]}")
    try:
        pickup = Pickup(envelope=b"{}", due_in=0.05, timeout=60)
        broken, fine = _request(), _request("k2")
        assert store.reserve(broken, pickup) is None
        assert store.reserve(fine, pickup) is None
        with store.engine.begin() as connection:
            connection.execute(
                claims.update().where(claims.c.id == store.claim_id("k")).values(status="garbled")
            )
        import time

        time.sleep(0.2)
        assert [due.storage_key for due in store.take_due(10)] == ["k2"]
    finally:
        store.close()


@pytest.mark.parametrize("column", ["timeout", "republished", "due_at", "envelope"])
def test_a_pickup_row_that_cannot_be_read_is_a_corrupt_record_and_the_sweep_takes_the_others(
    column: str, request: pytest.FixtureRequest
) -> None:
    store = SqlStore(store_url("sqlite", request), prefix=f"pickup-{uuid.uuid4().hex[:8]}")
    try:
        # Given two keys whose messages count as lost, one with text in a number column
        broken, fine = _request(), _request("k2")
        assert store.reserve(broken, DUE_NOW) is None
        assert store.reserve(fine, DUE_NOW) is None
        _garble_pickup(store, "k", column)
        # Then taking that key names its row unreadable, never a raw TypeError or ValueError
        with pytest.raises(CorruptRecord, match=r"pickup row .* is unreadable"):
            store.take("k")
        # And the sweep takes the other key all the same
        assert [due.storage_key for due in store.take_due(10)] == ["k2"]
        # And forgetting the key (the operator's way out) deletes the row
        assert store.forget("k") is True
        assert store.take("k") is None
    finally:
        store.close()


def test_unreadable_pickups_filling_a_whole_batch_do_not_hold_the_other_keys_back(
    request: pytest.FixtureRequest,
) -> None:
    store = SqlStore(store_url("sqlite", request), prefix=f"batch-{uuid.uuid4().hex[:8]}")
    try:
        # Given two due pickups that cannot be read, due before a readable one
        for key in ("b0", "b1"):
            assert store.reserve(_request(key), DUE_NOW) is None
            _garble_pickup(store, key, "timeout")
        fine = _request("k2")
        assert store.reserve(fine, Pickup(envelope=b"{}", due_in=0.01, timeout=60)) is None
        time.sleep(0.05)
        # When the sweep takes two at a time, then the readable key is taken: the unreadable
        # ones, met first, are put off rather than fill every batch
        assert [due.storage_key for due in store.take_due(2)] == ["k2"]
    finally:
        store.close()


LATIN1_DATABASE = "latin1_claims"
GIFT = "gift-\U0001f600-\u8d08\u308a\u7269"  # an emoji and CJK: no latin1 for either


@pytest.fixture()
def latin1_url() -> str:
    """A MariaDB database whose default character set is latin1 (MariaDB's own default before
    11.6; this machine's server is configured for utf8mb4)."""
    return fresh_mariadb_database(LATIN1_DATABASE, charset="latin1")


def _gift_request(owner: str = "o") -> ClaimRequest:
    return claim_request(
        key=GIFT,
        task_id="x",
        owner=owner,
        ttl_seconds=600,
    )


def _failure(**fields: Any) -> Failure:
    return Failure(
        **{
            "failure_id": "x:0",
            "task_name": "t",
            "task_id": "x",
            "idempotency_key": None,
            "args": [],
            "kwargs": {},
            "options": {},
            "error_type": "PaymentDeclined",
            "error_message": "declined",
            "traceback": None,
            "max_retries": 3,
            **fields,
        }
    )


def _keeps_any_script(url: str) -> None:
    """A key and an error message beyond latin1 go through the store's and the dead-letter
    table's writes, and come back as they went in."""
    store = SqlStore(url, prefix="p")
    try:
        first = _gift_request()
        claimed = store.claim(first)
        assert claimed.outcome is Outcome.ACQUIRED
        # A retry's release rewrites the row with its key (as a retry does)
        assert store.release(first, claimed.token, Pickup(envelope=b"{}", due_in=60, timeout=60))
        assert store.claim(_gift_request(owner="o2")).outcome is Outcome.ACQUIRED
        record = store.get(first.storage_key)
        assert record is not None and record.key == GIFT
    finally:
        store.close()
    queue = DeadLetterQueue(url)
    try:
        failure = _failure(idempotency_key=GIFT, args=[GIFT], error_message=f"declined: {GIFT}")
        item = queue.add(failure)
        found = queue.get(item.id)
        assert found is not None
        assert (found.idempotency_key, found.error_message) == (GIFT, f"declined: {GIFT}")
    finally:
        queue.dispose()


def test_keys_and_errors_beyond_latin1_are_kept_on_a_latin1_mariadb(latin1_url: str) -> None:
    _keeps_any_script(latin1_url)


def test_tables_made_latin1_by_an_earlier_version_are_brought_to_utf8mb4(latin1_url: str) -> None:
    # Given the tables as version 2 made them on a latin1 server (its default character set)
    store = SqlStore(latin1_url, prefix="p")
    store.ensure_schema()
    store.close()
    queue = DeadLetterQueue(latin1_url)
    queue.ensure_schema()
    queue.dispose()
    engine = sa.create_engine(latin1_url)
    with engine.begin() as connection:
        for table in (claims, pickups, dead_letters):
            connection.execute(sa.text(f"ALTER TABLE {table.name} CONVERT TO CHARACTER SET latin1"))
        connection.execute(schema_versions.update().values(version=2))
    # When this version opens them, then they keep text in any script
    try:
        _keeps_any_script(latin1_url)
        with engine.connect() as connection:
            versions = dict(connection.execute(sa.select(schema_versions)).all())
        assert versions == {
            CLAIMS_COMPONENT: CLAIMS_SCHEMA_VERSION,
            PICKUPS_COMPONENT: PICKUPS_SCHEMA_VERSION,
            "dead_letters": 3,
        }
    finally:
        engine.dispose()


def test_a_result_over_what_mariadb_takes_in_one_statement_is_not_cached_and_the_key_completes(
    request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a MariaDB store (max_allowed_packet 16 MiB, the server's default here) and a task
    # that lets results of up to 64 MiB be cached
    store = SqlStore(store_url("mariadb", request), prefix=f"packet-{uuid.uuid4().hex[:8]}")
    codec = ResultCodec(serializer="json", max_bytes=64 << 20)
    try:
        limit = store.result_byte_limit()
        assert limit is not None and 1 << 20 < limit < 16 << 20
        # When one call completes with a result over the store's limit, which the driver sends
        # escaped to twice its size, over the packet size; and another with one just under it
        big, fits = _attempt(store, codec, "big"), _attempt(store, codec, "fits")
        with caplog.at_level(logging.WARNING, logger="idempotent_tasks.core"):
            assert big.complete("'" * (limit + limit // 8)) is CompleteOutcome.STORED
        assert fits.complete("x" * (limit - 2)) is CompleteOutcome.STORED
        # Then the first key is completed with no cached result (duplicates get None, as for
        # any result too big), and said so; the second keeps its value
        big_record, fits_record = (store.get(a.request.storage_key) for a in (big, fits))
        assert big_record is not None and big_record.status.value == "completed"
        assert big_record.result is None
        assert "takes in one statement" in caplog.text
        assert fits_record is not None and fits_record.result is not None
        assert codec.decode(fits_record.result) == "x" * (limit - 2)
    finally:
        store.close()


def _attempt(store: SqlStore, codec: ResultCodec, key: str) -> Attempt:
    attempt = Attempt(
        store=store, request=dataclasses.replace(_request(), storage_key=key), codec=codec
    )
    assert attempt.claim().outcome is Outcome.ACQUIRED
    return attempt


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_other_databases_take_any_result_the_settings_allow(
    kind: str, request: pytest.FixtureRequest
) -> None:
    store = SqlStore(store_url(kind, request), prefix="no-limit")
    try:
        assert store.result_byte_limit() is None
    finally:
        store.close()


def test_version_one_tables_on_a_latin1_server_keep_keys_beyond_ascii(latin1_url: str) -> None:
    # Given version 1's tables on a latin1 server (its default character set), a completed key
    # and a dead letter of a task id beyond ASCII in them
    engine = sa.create_engine(latin1_url)
    old_key = _completed_version_one_claim(engine, _version_one_tables(engine), "caf\xe9-42")
    version_one_dead_letter(engine, failure_id="caf\xe9-42:0", task_id="caf\xe9-42")
    try:
        # When this version opens them, then the key is still found completed (its id was
        # kept as its UTF-8 bytes, not latin1's: the body would run again)
        store = SqlStore(latin1_url, prefix="migrated")
        try:
            found = store.claim(old_key)
            assert (found.outcome, found.record and found.record.result) == (
                Outcome.COMPLETED,
                V1_RESULT,
            )
        finally:
            store.close()
        # And the dead letter reads back as written
        queue = DeadLetterQueue(latin1_url)
        try:
            assert [(item.task_id, item.failure_id) for item in queue.items()] == [
                ("caf\xe9-42", "caf\xe9-42:0")
            ]
        finally:
            queue.dispose()
    finally:
        engine.dispose()


def test_a_pickup_whose_row_id_is_not_utf8_is_still_taken_and_moved_on(
    request: pytest.FixtureRequest,
) -> None:
    # Given a queued key, due, whose rows' ids hold latin1 bytes on MariaDB (an earlier
    # version's migration of a latin1 table kept them so)
    store = SqlStore(store_url("mariadb", request), prefix=f"bytes-{uuid.uuid4().hex[:8]}")
    try:
        queued = _request("caf\xe9")
        assert store.reserve(queued, DUE_NOW) is None
        written_id = store.claim_id("caf\xe9")
        with store.engine.begin() as connection:
            for table in (claims, pickups):
                connection.execute(
                    sa.text(f"UPDATE {table.name} SET id = :raw WHERE id = :id"),
                    {"raw": written_id.encode("latin-1"), "id": written_id.encode()},
                )
        # When the sweep looks, then it takes it (read), and moves it on (written by that id)
        assert [due.task_id for due in store.take_due(10)] == [queued.task_id]
        assert store.take_due(10) == []
    finally:
        with store.engine.begin() as connection:
            for table in (claims, pickups):
                connection.execute(table.delete().where(table.c.id.like(f"{store.prefix}:%")))
        store.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mariadb"])
def test_the_longest_prefix_a_claim_row_takes_works_and_a_longer_one_is_refused_up_front(
    kind: str, request: pytest.FixtureRequest
) -> None:
    url = store_url(kind, request)
    # A prefix whose row ids could not fit: refused when the store is built, not by every claim
    with pytest.raises(ValueError, match="idempotency_key_prefix is 120 characters long"):
        SqlStore(url, prefix="p" * 120)
    # The longest one it takes holds the longest readable storage key (200 characters)
    store = SqlStore(url, prefix=f"{uuid.uuid4().hex}".ljust(119, "p"))
    try:
        longest = dataclasses.replace(_request(), storage_key="t:" + "k" * 198)
        claim = store.claim(longest)
        assert claim.outcome is Outcome.ACQUIRED
        assert store.complete(longest, claim.token, None) is CompleteOutcome.STORED
        record = store.get(longest.storage_key)
        assert record is not None and record.storage_key == longest.storage_key
    finally:
        with store.engine.begin() as connection:
            connection.execute(claims.delete().where(claims.c.id.like(f"{store.prefix}:%")))
        store.close()


def test_a_task_id_is_found_exactly_whatever_the_connections_character_set(
    request: pytest.FixtureRequest,
) -> None:
    # Given a MariaDB store whose connection speaks latin1 (the tables keep utf8mb4), and a
    # key queued for a call whose task id is not ASCII
    store = SqlStore(f"{store_url('mariadb', request)}?charset=latin1", prefix="latin1")
    queued = _request(f"latin1-{uuid.uuid4().hex[:8]}")
    queued = dataclasses.replace(queued, task_id="ördér-42")
    try:
        assert store.reserve(queued, Pickup(envelope=b"{}", due_in=60, timeout=60)) is None
        # Then only that very id cancels its reservation
        assert store.cancel_reservation(queued.storage_key, "ORDÉR-42") is False
        assert store.cancel_reservation(queued.storage_key, "ördér-42") is True
    finally:
        store.close()


def test_a_postgresql_server_that_prints_doubles_rounded_still_compares_its_times_exactly(
    request: pytest.FixtureRequest,
) -> None:
    # Given a PostgreSQL server (or role, or database) that prints doubles rounded to 15
    # digits (extra_float_digits = 0: PostgreSQL before 12 by default), where the store reads
    # back the times it compares before each change
    url = store_url("postgresql", request) + "?options=-c%20extra_float_digits%3D0"
    store = SqlStore(url, prefix="rounded")
    try:
        call = claim_request(key="k", storage_key="k", task_id="t-1", lease_seconds=0.2)
        # When a reserved key's own message claims it, then it is acquired (a read time that
        # no longer equals the stored one made every such change lose as to a race)
        assert store.reserve(call, DUE_NOW) is None
        assert store.claim(call).outcome is Outcome.ACQUIRED
        # and a later call takes the key over once its lease ends
        time.sleep(0.3)
        later = dataclasses.replace(call, owner="owner-2", task_id="t-2")
        taken = store.claim(later)
        assert (taken.outcome, taken.takeover) == (Outcome.ACQUIRED, True)
    finally:
        store.close()
