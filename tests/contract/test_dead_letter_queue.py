"""The dead-letter queue contract, one body run on SQLite, PostgreSQL and MariaDB."""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import queue as queue_module
import random
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, TypeAlias

import pytest
import sqlalchemy as sa

from idempotent_tasks.dlq import DeadLetter, DeadLetterQueue, DeadLetterStatus, Failure, queries
from idempotent_tasks.dlq.arguments import stored_arguments
from idempotent_tasks.dlq.queries import SCOPE_OPTION
from idempotent_tasks.dlq.schema import (
    COMPONENT,
    SCHEMA_VERSION,
    dead_letters,
    metadata,
    schema_versions,
)
from idempotent_tasks.dlq.sweep import resend_due
from idempotent_tasks.errors import (
    CorruptRecord,
    IdempotencyError,
    SchemaVersionError,
    StoreUnavailable,
)
from tests.integration.databases import version_one_dead_letter
from tests.services import require

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
MARIADB_URL = "mysql+pymysql://root@127.0.0.1:3306/test"
#: Database name -> (service for ``tests.services.require``, URL); SQLite lives in ``tmp_path``.
SERVERS = {"postgresql": ("PostgreSQL", PG_URL), "mariadb": ("MariaDB", MARIADB_URL)}
DATABASES = ["sqlite", "postgresql", "mariadb"]

BASE = 60.0  # seconds of the first backoff step
SEED = 1234
T0 = datetime(2024, 5, 17, 12, 30, 45, 123456, tzinfo=timezone.utc)
SWEEPERS = 4
SWEPT_ITEMS = 200
FIRST_USE_ROUNDS = 10

Statuses = DeadLetterStatus


class Clock:
    """A clock that stands still until the test moves it."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> datetime:
        self.now += timedelta(**delta)
        return self.now


MakeQueue = Callable[..., DeadLetterQueue]
#: What each child process reports: ("ok", its result) or ("error", a traceback).
Results: TypeAlias = "multiprocessing.queues.Queue[tuple[str, Any]]"


def _drop_dead_letter_tables(url: str) -> None:
    # Only the dead-letter queue's two tables: other components may share the database.
    engine = sa.create_engine(url)
    try:
        metadata.drop_all(engine, tables=[dead_letters, schema_versions])
    finally:
        engine.dispose()


def _version_rows(engine: sa.Engine) -> list[tuple[str, int]]:
    query = sa.select(schema_versions).where(schema_versions.c.component == COMPONENT)
    with engine.connect() as connection:
        return [(row.component, row.version) for row in connection.execute(query)]


@pytest.fixture(params=DATABASES)
def dlq_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database with no dead-letter tables (so every test also creates the schema)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'dead_letters.sqlite3'}"
    service, url = SERVERS[request.param]
    require(service)
    _drop_dead_letter_tables(url)
    return url


@pytest.fixture()
def clock() -> Clock:
    return Clock(T0)


@pytest.fixture()
def make_queue(dlq_url: str, clock: Clock) -> Iterator[MakeQueue]:
    """Build queues on the test's database (fixed clock, seeded jitter), disposed afterwards."""
    made: list[DeadLetterQueue] = []

    def make(**overrides: Any) -> DeadLetterQueue:
        options: dict[str, Any] = {
            "base_delay": BASE,
            "clock": clock,
            "rng": random.Random(SEED),
            **overrides,
        }
        dlq = DeadLetterQueue(dlq_url, **options)
        made.append(dlq)
        return dlq

    yield make
    for dlq in made:
        dlq.dispose()


@pytest.fixture()
def dlq(make_queue: MakeQueue) -> DeadLetterQueue:
    return make_queue()


def _failure(**overrides: Any) -> Failure:
    fields: dict[str, Any] = {
        "failure_id": f"{uuid.uuid4()}:0",
        "task_name": "tasks.charge",
        "task_id": str(uuid.uuid4()),
        "idempotency_key": f"key-{uuid.uuid4().hex[:8]}",
        "args": [1, "two"],
        "kwargs": {"amount": 5},
        "options": {"queue": "celery"},
        "error_type": "RuntimeError",
        "error_message": "boom",
        "traceback": "Traceback (most recent call last):\nRuntimeError: boom",
        "max_retries": 3,
        **overrides,
    }
    return Failure(**fields)


def _add_at(dlq: DeadLetterQueue, clock: Clock, moment: datetime, **overrides: Any) -> DeadLetter:
    clock.now = moment
    return dlq.add(_failure(**overrides))


def _due_window(now: datetime, retry_count: int) -> tuple[datetime, datetime]:
    step = BASE * 2**retry_count
    return now + timedelta(seconds=step), now + timedelta(seconds=1.25 * step)


def _in_due_window(moment: datetime | None, now: datetime, retry_count: int) -> bool:
    low, high = _due_window(now, retry_count)
    return moment is not None and low <= moment <= high


def _is_utc(moment: datetime | None) -> bool:
    return moment is not None and moment.utcoffset() == timedelta(0)


def _ids(items: list[DeadLetter]) -> set[str]:
    return {item.id for item in items}


# -- schema -------------------------------------------------------------------------------------


def test_first_use_creates_both_tables_indexes_and_version(dlq: DeadLetterQueue) -> None:
    assert dlq.stats()["total"] == 0
    inspector = sa.inspect(dlq.engine)
    assert inspector.has_table(dead_letters.name)
    assert inspector.has_table(schema_versions.name)
    index_names = {index["name"] for index in inspector.get_indexes(dead_letters.name)}
    assert {index.name for index in dead_letters.indexes} <= index_names
    columns = {column["name"] for column in inspector.get_columns(dead_letters.name)}
    assert {column.name for column in dead_letters.columns} == columns
    assert _version_rows(dlq.engine) == [(COMPONENT, SCHEMA_VERSION)]


def test_a_second_queue_on_existing_tables_uses_them(make_queue: MakeQueue) -> None:
    first = make_queue()
    item = first.add(_failure())
    second = make_queue()
    assert second.get(item.id) == item
    assert _version_rows(second.engine) == [(COMPONENT, SCHEMA_VERSION)]


def test_an_index_missing_from_existing_tables_is_created(make_queue: MakeQueue) -> None:
    # Given the table without one of its indexes (MySQL commits CREATE TABLE at once: a process
    # stopped before its CREATE INDEX leaves it so)
    first = make_queue()
    first.ensure_schema()
    [sweep_index] = [index for index in dead_letters.indexes if index.name.endswith("_sweep")]
    with first.engine.begin() as connection:
        sweep_index.drop(connection)
    # When a queue opens it, then the index is there again
    make_queue().ensure_schema()
    index_names = {
        index["name"] for index in sa.inspect(first.engine).get_indexes(dead_letters.name)
    }
    assert sweep_index.name in index_names


def test_a_newer_schema_is_refused_naming_both_versions(make_queue: MakeQueue) -> None:
    # Given tables written by a newer idempotent_tasks
    older = make_queue()
    older.ensure_schema()
    newer = SCHEMA_VERSION + 1
    with older.engine.begin() as connection:
        connection.execute(
            sa.text(f"UPDATE {schema_versions.name} SET version = :version WHERE component = :c"),
            {"version": newer, "c": COMPONENT},
        )
    # When a new queue first touches the database, Then it refuses, naming both versions
    refused = make_queue()
    with pytest.raises(SchemaVersionError) as raised:
        refused.stats()
    message = str(raised.value)
    assert f"schema version {newer}" in message
    assert f"({SCHEMA_VERSION})" in message
    assert "upgrade" in message
    assert isinstance(raised.value, IdempotencyError)
    # And it keeps refusing, for every operation, without touching the rows
    with pytest.raises(SchemaVersionError):
        refused.add(_failure())
    with pytest.raises(SchemaVersionError):
        refused.take_due()
    assert older.stats()["total"] == 0


# -- add ----------------------------------------------------------------------------------------


def test_add_stores_every_field(dlq: DeadLetterQueue, clock: Clock) -> None:
    failure = _failure(
        failure_id="task-1:0",
        task_name="tasks.refund",
        task_id="task-1",
        idempotency_key="order-42",
        args=[1, "zwei", [3.5, None], {"nested": True}],
        kwargs={"amount": 5, "currency": "EUR", "note": "café ✓ 🎉", "tags": ["a", "b"]},
        options={"queue": "payments", "routing_key": "pay.eu", "priority": 3},
        error_type="PaymentDeclined",
        error_message="card declined: ünïcödé ✓ 🎉",
        # Longer than a MySQL TEXT column (64 KiB) can hold.
        traceback="Traceback (most recent call last):\n" + "  frame\n" * 10_000,
        max_retries=5,
    )
    item = dlq.add(failure)
    # The twin of the queue's generator gives the jitter of its first draw.
    jitter = random.Random(SEED).uniform(0, 0.25 * BASE)
    expected_due = T0 + timedelta(seconds=BASE + jitter)
    for found in (item, dlq.get(item.id)):
        assert found is not None
        uuid.UUID(found.id)
        assert (found.task_name, found.task_id, found.failure_id) == (
            "tasks.refund",
            "task-1",
            "task-1:0",
        )
        assert found.idempotency_key == "order-42"
        assert found.args == [1, "zwei", [3.5, None], {"nested": True}]
        assert found.kwargs == failure.kwargs
        assert found.options == {"queue": "payments", "routing_key": "pay.eu", "priority": 3}
        assert (found.error_type, found.error_message) == (
            "PaymentDeclined",
            "card declined: ünïcödé ✓ 🎉",
        )
        assert found.traceback == failure.traceback
        assert (found.retry_count, found.max_retries) == (0, 5)
        assert found.status is Statuses.PENDING
        assert found.sweep_id is None
        # Microseconds survive the round trip (MySQL keeps none unless told to).
        assert found.next_retry_at == expected_due
        assert _in_due_window(found.next_retry_at, T0, 0)
        assert found.created_at == T0
        assert found.updated_at == T0
        assert all(
            _is_utc(moment) for moment in (found.next_retry_at, found.created_at, found.updated_at)
        )


def test_add_keeps_a_missing_key_and_traceback(dlq: DeadLetterQueue) -> None:
    item = dlq.add(_failure(idempotency_key=None, traceback=None, args=[], kwargs={}, options={}))
    assert (item.idempotency_key, item.traceback) == (None, None)
    assert (item.args, item.kwargs, item.options) == ([], {}, {})


def test_add_with_no_retries_allowed_keeps_a_permanent_failure(dlq: DeadLetterQueue) -> None:
    item = dlq.add(_failure(max_retries=0))
    assert (item.status, item.next_retry_at, item.retry_count) == (
        Statuses.PERMANENT_FAILURE,
        None,
        0,
    )


def test_clock_in_another_zone_is_stored_as_the_same_instant(make_queue: MakeQueue) -> None:
    tokyo = timezone(timedelta(hours=9))
    dlq = make_queue(clock=Clock(T0.astimezone(tokyo)))
    item = dlq.add(_failure())
    assert item.created_at == T0
    assert item.created_at.utcoffset() == timedelta(0)


SESSIONS_IN_TOKYO = {
    "postgresql": f"{PG_URL}?options=-c%20TimeZone%3DAsia/Tokyo",
    "mariadb": f"{MARIADB_URL}?init_command=SET%20time_zone%3D%27%2B09%3A00%27",
}


@pytest.mark.parametrize("name", sorted(SESSIONS_IN_TOKYO))
def test_timestamps_do_not_depend_on_the_session_time_zone(name: str, clock: Clock) -> None:
    service, url = SERVERS[name]
    require(service)
    _drop_dead_letter_tables(url)
    # Given a queue whose database sessions run in Tokyo time, and one in UTC
    in_tokyo = DeadLetterQueue(SESSIONS_IN_TOKYO[name], base_delay=BASE, clock=clock)
    in_utc = DeadLetterQueue(url, base_delay=BASE, clock=clock)
    try:
        item = in_tokyo.add(_failure())
        # Then both read the same instants back
        assert item.created_at == T0
        assert in_utc.get(item.id) == item
        # And "due" means the same instant: not a second before the first step, but after it
        clock.now = T0 + timedelta(seconds=BASE - 1)
        assert in_tokyo.take_due() == []
        clock.now = T0 + timedelta(seconds=1.25 * BASE + 1)
        assert _ids(in_tokyo.take_due()) == {item.id}
    finally:
        in_tokyo.dispose()
        in_utc.dispose()


class _HourBehind(datetime):
    """``datetime`` on a host whose clock runs an hour behind."""

    @classmethod
    def now(cls, tz: Any = None) -> Any:
        return datetime.now(tz) - timedelta(hours=1)


@pytest.mark.parametrize("name", sorted(SERVERS))
def test_a_host_whose_clock_is_wrong_still_writes_and_judges_times_on_the_servers(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    service, url = SERVERS[name]
    require(service)
    _drop_dead_letter_tables(url)
    # Given an item made due now by a host whose clock is right
    right = DeadLetterQueue(url, base_delay=BASE)
    due_now = right.add(_failure())
    assert right.retry_now(due_now.id)
    # And a host whose clock runs an hour behind the database server's
    monkeypatch.setattr("idempotent_tasks.dlq.queue.datetime", _HourBehind)
    behind = DeadLetterQueue(url, base_delay=BASE)
    try:
        # Then its sweep finds the item due now, not in an hour
        assert _ids(behind.take_due()) == {due_now.id}
        # And the rows it writes carry the server's times, not times an hour off
        before = datetime.now(timezone.utc)
        written = behind.add(_failure())
        after = datetime.now(timezone.utc)
        assert before - timedelta(seconds=2) <= written.created_at <= after + timedelta(seconds=2)
        assert written.next_retry_at is not None
        assert written.next_retry_at >= before + timedelta(seconds=BASE * 0.75 - 2)
    finally:
        right.dispose()
        behind.dispose()


class _Stepped(datetime):
    """``datetime`` on a host whose clock NTP or an operator steps: ``step`` is how far off."""

    step = timedelta(0)

    @classmethod
    def now(cls, tz: Any = None) -> Any:
        return datetime.now(tz) + cls.step


@pytest.mark.parametrize("name", sorted(SERVERS))
def test_a_sweep_host_whose_clock_is_stepped_takes_no_item_another_sweep_holds(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    service, url = SERVERS[name]
    require(service)
    _drop_dead_letter_tables(url)
    monkeypatch.setattr("idempotent_tasks.dlq.queue.datetime", _Stepped)
    # Given a sweep host that read the server's time while its clock ran an hour behind
    monkeypatch.setattr(_Stepped, "step", timedelta(hours=-1))
    stepped = DeadLetterQueue(url, base_delay=BASE)
    right = DeadLetterQueue(url, base_delay=BASE)
    try:
        assert stepped.take_due() == []
        # And whose clock was then set right
        monkeypatch.setattr(_Stepped, "step", timedelta(0))
        # When another sweep takes an item a moment later
        item = right.add(_failure())
        assert right.retry_now(item.id)
        assert _ids(right.take_due()) == {item.id}
        # Then the stepped host neither counts it as stuck nor takes it again
        assert stepped.recover_stuck(timedelta(hours=1)) == 0
        assert stepped.take_due() == []
        written = stepped.add(_failure())
        assert written.created_at == pytest.approx(
            datetime.now(timezone.utc), abs=timedelta(seconds=2)
        )
    finally:
        stepped.dispose()
        right.dispose()


@pytest.mark.parametrize("name", sorted(SERVERS))
@pytest.mark.parametrize(
    ("operation", "taken"), [("mark_succeeded", True), ("unclaim", True), ("retry_now", False)]
)
def test_a_first_read_of_the_servers_clock_needs_no_second_pooled_connection(
    name: str, operation: str, taken: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    service, url = SERVERS[name]
    require(service)
    _drop_dead_letter_tables(url)
    seeding = DeadLetterQueue(url, base_delay=BASE)
    item = seeding.add(_failure())
    if taken:  # a sweep is retrying it
        assert seeding.retry_now(item.id)
        assert _ids(seeding.take_due()) == {item.id}
    seeding.dispose()
    # Given a queue whose pool has one connection, and whose clock has not read the server yet
    monkeypatch.setattr(
        "idempotent_tasks.dlq.queue.create_dlq_engine",
        lambda url: sa.create_engine(url, pool_size=1, max_overflow=0, pool_timeout=1),
    )
    queue = DeadLetterQueue(url, base_delay=BASE)
    try:
        # When its first use writes a time, then it does so (not waiting on itself for a
        # connection until the pool gives up)
        assert getattr(queue, operation)(item.id) is True
    finally:
        queue.dispose()


def test_task_ids_keys_and_failure_ids_longer_than_their_columns_are_kept_whole(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    # Given a failure whose task id, key and failure id are longer than their columns hold
    # (an RQ job id of 300 characters, a key of 5000: keys of any length are allowed)
    task_id, key = "t" * 299 + "1", "k" * 4999 + "1"
    failure = _failure(task_id=task_id, idempotency_key=key, failure_id=f"{task_id}:0")
    # When it is written, twice (a write repeated after a lost reply)
    item = dlq.add(failure)
    assert dlq.add(failure) == item
    # Then one row keeps them whole, and items read back show them as they were given
    assert dlq.stats()["total"] == 1
    assert (item.task_id, item.idempotency_key) == (task_id, key)
    assert item.options == {"queue": "celery"}
    read_back = dlq.get(item.id)
    assert read_back is not None
    assert (read_back.task_id, read_back.idempotency_key) == (task_id, key)
    # And ones that differ only at their end are different rows
    other = dlq.add(_failure(task_id="t" * 299 + "2", failure_id="t" * 299 + "2:0"))
    assert other.id != item.id and other.task_id == "t" * 299 + "2"


@pytest.mark.parametrize(
    ("first", "span"), [(0x4E00, 0x5000), (0x1F300, 0x600)], ids=["cjk", "emoji"]
)
def test_a_key_long_in_bytes_is_kept_whole(dlq: DeadLetterQueue, first: int, span: int) -> None:
    # Given a key of 1000 characters of 3 or 4 bytes each, all sorts (no compression shrinks
    # it): within the column's characters, over what PostgreSQL's index on it takes (2704
    # bytes an entry)
    chosen = random.Random(7)
    key = "order-" + "".join(chr(first + chosen.randrange(span)) for _ in range(1000))
    # When its failure is written, then it lands, and reads back whole
    item = dlq.add(_failure(idempotency_key=key, failure_id="task-long-key:0"))
    assert item.status is DeadLetterStatus.PENDING
    read_back = dlq.get(item.id)
    assert read_back is not None and read_back.idempotency_key == key


def test_the_same_failure_twice_is_one_row(dlq: DeadLetterQueue, clock: Clock) -> None:
    # Given a write repeated after a lost reply (same failed delivery, later)
    failure = _failure(failure_id="task-7:2")
    first = dlq.add(failure)
    clock.advance(seconds=5)
    again = dlq.add(failure)
    # Then the first row stands, unchanged
    assert again == first
    assert [item.id for item in dlq.items()] == [first.id]
    assert dlq.stats()["total"] == 1


def test_other_deliveries_of_one_task_are_separate_rows(dlq: DeadLetterQueue) -> None:
    first = dlq.add(_failure(failure_id="task-8:0", task_id="task-8"))
    second = dlq.add(_failure(failure_id="task-8:1", task_id="task-8"))
    assert first.id != second.id
    assert dlq.stats()["total"] == 2


# -- rows a database refuses -------------------------------------------------------------------


def _nested(depth: int) -> Any:
    value: Any = "deepest"
    for _ in range(depth):
        value = {"inner": value}
    return value


@pytest.mark.parametrize(
    "args",
    [["x" * (17 * 1024 * 1024)], [_nested(40)]],
    ids=["over-16-MiB", "nested-40-deep"],
)
def test_arguments_a_database_refuses_for_good_leave_a_row_without_them(
    request: pytest.FixtureRequest, dlq: DeadLetterQueue, clock: Clock, args: list[Any]
) -> None:
    # Given a failure whose arguments MariaDB refuses (over its max_allowed_packet of 16 MiB,
    # or nested deeper than its JSON check takes), which the others take
    refused = request.node.callspec.params["dlq_url"] == "mariadb"
    # When it is written, then it lands: nothing raises, so the task is not written again for ever
    item = _add_at(dlq, clock, T0, args=args, error_message="warehouse down")
    kept = dlq.get(item.id)
    assert kept is not None
    if not refused:
        assert kept.args == args and kept.status is Statuses.PENDING
        return
    # And on MariaDB it is kept without its arguments, given up on, saying why
    assert (kept.args, kept.kwargs) == ([], {})
    assert kept.status is Statuses.PERMANENT_FAILURE and kept.next_retry_at is None
    assert kept.options["args_lossy"] is True  # no sweep sends it again
    assert kept.options["args_refused"]
    assert kept.options["args_preview"].startswith("[[")
    assert len(kept.options["args_preview"]) <= 1000
    assert (kept.task_id, kept.error_message) == (item.task_id, "warehouse down")


# -- rows edited by hand ------------------------------------------------------------------------


def _edit_row(dlq: DeadLetterQueue, item_id: str, **columns: Any) -> None:
    """Write ``columns`` of a row straight to the table, as an operator's UPDATE would."""
    with dlq.engine.begin() as connection:
        connection.execute(
            sa.update(dead_letters).where(dead_letters.c.id == item_id).values(**columns)
        )


def test_a_row_edited_into_another_shape_is_given_up_on_and_the_sweep_goes_on(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    # Given three due rows, one of them edited by hand: kwargs a JSON array, not an object
    healthy = [_add_at(dlq, clock, T0), _add_at(dlq, clock, T0)]
    corrupt = _add_at(dlq, clock, T0, error_message="warehouse down")
    _edit_row(dlq, corrupt.id, kwargs=[1, 2])
    clock.now = T0 + timedelta(hours=1)
    # When a sweep takes them, then it gets the two it can read, and no error
    assert _ids(dlq.take_due(limit=10)) == {item.id for item in healthy}
    # And the edited row is kept, given up on, its reason and its failure in its error
    assert dlq.stats()[Statuses.PERMANENT_FAILURE.value] == 1
    with pytest.raises(CorruptRecord, match=rf"dead letter {corrupt.id} cannot be read"):
        dlq.get(corrupt.id)
    with dlq.engine.connect() as connection:
        row = connection.execute(
            sa.select(dead_letters).where(dead_letters.c.id == corrupt.id)
        ).one()
    assert (row.status, row.error_type, row.sweep_id) == (
        "permanent_failure",
        "CorruptRecord",
        None,
    )
    assert "kwargs is not a JSON object" in row.error_message
    assert "its failure was RuntimeError: warehouse down" in row.error_message


@pytest.mark.parametrize("dlq_url", ["postgresql"], indirect=True)
def test_a_timestamp_column_moves_by_an_interval_in_sql(dlq: DeadLetterQueue, clock: Clock) -> None:
    # An operator's (or a test's) UPDATE on PostgreSQL: the column's type keeps a timedelta
    # beside it an interval. (SQLAlchemy's generic SQL has no such arithmetic on SQLite or
    # MariaDB, whatever the column's type.)
    item = _add_at(dlq, clock, T0)
    _edit_row(dlq, item.id, updated_at=dead_letters.c.updated_at - timedelta(hours=2))
    found = dlq.get(item.id)
    assert found is not None and found.updated_at == T0 - timedelta(hours=2)


def test_a_batch_of_rows_it_cannot_read_does_not_end_the_take(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    # Given two edited rows due first, then a readable one
    edited = [_add_at(dlq, clock, T0), _add_at(dlq, clock, T0 + timedelta(seconds=1))]
    for item in edited:
        _edit_row(dlq, item.id, args={"not": "a list"})
    readable = _add_at(dlq, clock, T0 + timedelta(minutes=1))
    clock.now = T0 + timedelta(hours=1)
    # When a sweep takes two at a time, then its first batch (both unreadable) does not end
    # it: it takes again, and gets the readable one
    assert _ids(dlq.take_due(limit=2)) == {readable.id}
    assert dlq.stats()[Statuses.PERMANENT_FAILURE.value] == 2


@pytest.fixture
def sqlite_dlq(tmp_path: Path, clock: Clock) -> Iterator[DeadLetterQueue]:
    """A queue on a fresh SQLite file (which keeps what the server databases refuse)."""
    dlq = DeadLetterQueue(
        f"sqlite:///{tmp_path / 'dead_letters.sqlite3'}", clock=clock, rng=random.Random(SEED)
    )
    yield dlq
    dlq.dispose()


@pytest.mark.parametrize(
    ("column", "text", "unreadable"),
    [
        # SQLite keeps any text in a JSON or DATETIME column; PostgreSQL and MariaDB refuse it
        ("kwargs", "{not json", "kwargs holds unreadable JSON"),
        ("created_at", "last tuesday", "created_at holds unreadable timestamp"),
    ],
)
def test_a_row_whose_column_does_not_parse_is_left_out_and_given_up_on(
    sqlite_dlq: DeadLetterQueue, clock: Clock, column: str, text: str, unreadable: str
) -> None:
    # Given two due rows on SQLite, one edited by hand into a value its column cannot read
    dlq = sqlite_dlq
    readable = _add_at(dlq, clock, T0)
    edited = _add_at(dlq, clock, T0, error_message="warehouse down")
    with dlq.engine.begin() as connection:
        connection.execute(
            sa.text(f"UPDATE {dead_letters.name} SET {column} = :text WHERE id = :id"),
            {"text": text, "id": edited.id},
        )
    # Then a listing reads the other row, and names the edited one
    reported: list[CorruptRecord] = []
    assert _ids(dlq.items(on_corrupt=reported.append)) == {readable.id}
    assert [f"dead letter {edited.id}" in str(error) for error in reported] == [True]
    with pytest.raises(CorruptRecord, match=unreadable):
        dlq.get(edited.id)
    # And a sweep takes the other row, and gives the edited one up
    clock.now = T0 + timedelta(hours=1)
    assert _ids(dlq.take_due(limit=10)) == {readable.id}
    assert dlq.stats()[Statuses.PERMANENT_FAILURE.value] == 1


def test_a_text_column_holding_bytes_is_left_out_and_given_up_on(
    sqlite_dlq: DeadLetterQueue, clock: Clock
) -> None:
    # Given two due rows on SQLite (which keeps a BLOB in any column), one whose error type an
    # operator's client overwrote with bytes
    dlq = sqlite_dlq
    readable = _add_at(dlq, clock, T0)
    edited = _add_at(dlq, clock, T0)
    _edit_row(dlq, edited.id, error_type=b"\xffRuntimeError")
    # Then a listing reads the other row, and names the edited one
    reported: list[CorruptRecord] = []
    assert _ids(dlq.items(on_corrupt=reported.append)) == {readable.id}
    assert ["error_type is not text" in str(error) for error in reported] == [True]
    # And a sweep takes the other row, and gives the edited one up
    clock.now = T0 + timedelta(hours=1)
    assert _ids(dlq.take_due(limit=10)) == {readable.id}
    assert dlq.stats()[Statuses.PERMANENT_FAILURE.value] == 1


def test_a_failure_id_whose_bytes_are_not_utf8_is_read_and_its_row_swept(clock: Clock) -> None:
    # Given a due row on MariaDB whose failure id holds latin1 bytes (an earlier version's
    # migration of a latin1 table to bytes kept them so)
    require("MariaDB")
    _drop_dead_letter_tables(MARIADB_URL)
    dlq = DeadLetterQueue(MARIADB_URL, clock=clock, rng=random.Random(SEED))
    try:
        item = _add_at(dlq, clock, T0)
        with dlq.engine.begin() as connection:
            connection.execute(
                sa.text(f"UPDATE {dead_letters.name} SET failure_id = :raw WHERE id = :id"),
                {"raw": b"caf\xe9-42:0", "id": item.id},
            )
        # Then it is listed and read, the byte that is not UTF-8 shown as U+FFFD
        assert [found.failure_id for found in dlq.items()] == ["caf\ufffd-42:0"]
        found = dlq.get(item.id)
        assert found is not None and found.failure_id == "caf\ufffd-42:0"
        # And a sweep takes it, and its end is written as any other row's
        clock.now = T0 + timedelta(hours=1)
        assert _ids(dlq.take_due(limit=10)) == {item.id}
        assert dlq.mark_succeeded(item.id) is True
        assert dlq.stats()[Statuses.SUCCEEDED.value] == 1
    finally:
        dlq.dispose()


@pytest.mark.parametrize(
    "columns",
    [
        {"status": "bogus"},
        {"args": {"a": 1}},
        {"options": "text"},
        # The whole task name of a row whose column holds it cut, edited into a number
        {"options": {"full_task_name": 5}},
    ],
    ids=str,
)
def test_listing_leaves_out_a_row_it_cannot_read_and_says_so(
    dlq: DeadLetterQueue, clock: Clock, columns: dict[str, Any]
) -> None:
    # Given two rows, one edited by hand into something no write makes
    kept = _add_at(dlq, clock, T0)
    edited = _add_at(dlq, clock, T0)
    _edit_row(dlq, edited.id, **columns)
    # When they are listed, then the readable one is, and the other is handed to on_corrupt
    reported: list[CorruptRecord] = []
    assert _ids(dlq.items(on_corrupt=reported.append)) == {kept.id}
    assert [str(edited.id) in str(error) for error in reported] == [True]
    # And without on_corrupt the listing still works (the row is logged)
    assert _ids(dlq.items()) == {kept.id}


# -- status transitions -------------------------------------------------------------------------


def test_withdraw_deletes_the_dead_letter_of_a_failure_only_while_pending_and_unretried(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    # Given a dead letter retried that failed again (pending, one retry used), one that
    # succeeded, and the dead letter of a delivery revoked as it failed (pending, unretried)
    retried = _add_at(dlq, clock, T0)
    succeeded = _add_at(dlq, clock, T0)
    clock.now = T0 + timedelta(hours=1)
    assert _ids(dlq.take_due(limit=10)) == {retried.id, succeeded.id}
    assert dlq.record_retry_failure(retried.id, "RuntimeError", "again", None) is not None
    assert dlq.mark_succeeded(succeeded.id)
    revoked = _add_at(dlq, clock, T0 + timedelta(hours=1))
    # (and one written given up at once: its task allows no retries)
    unretriable = _add_at(dlq, clock, T0 + timedelta(hours=1), max_retries=0)
    # When each failure is withdrawn, then only those no retry was sent of go
    withdrawn = [
        dlq.withdraw(item.failure_id) for item in (revoked, unretriable, retried, succeeded)
    ]
    assert withdrawn == [True, True, False, False]
    assert dlq.get(revoked.id) is None and dlq.get(unretriable.id) is None
    assert dlq.get(retried.id) is not None and dlq.get(succeeded.id) is not None


def test_take_due_takes_due_pending_items_oldest_first_up_to_limit(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    # Given three items due at different times, added latest-due first, and one due later
    third = _add_at(dlq, clock, T0 + timedelta(minutes=20))
    second = _add_at(dlq, clock, T0 + timedelta(minutes=10))
    first = _add_at(dlq, clock, T0)
    future = _add_at(dlq, clock, T0 + timedelta(hours=1))
    # When nothing is due yet, nothing is taken
    clock.now = T0
    assert dlq.take_due() == []
    # When the three are due, a sweep of two takes the two due first
    now = clock.now = T0 + timedelta(minutes=30)
    taken = dlq.take_due(limit=2)
    assert _ids(taken) == {first.id, second.id}
    assert all(item.status is Statuses.RETRYING for item in taken)
    assert all(item.updated_at == now for item in taken)
    assert len({item.sweep_id for item in taken}) == 1
    assert taken[0].sweep_id is not None
    # And the next sweep takes the rest that is due, and then nothing
    assert _ids(dlq.take_due(limit=10)) == {third.id}
    assert dlq.take_due(limit=10) == []
    still = dlq.get(future.id)
    assert still is not None and still.status is Statuses.PENDING
    assert dlq.stats()["retrying"] == 3


def test_a_sweep_that_picked_an_item_another_sweep_retried_meanwhile_leaves_it_to_its_backoff(
    dlq: DeadLetterQueue, make_queue: MakeQueue, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a due item, and a sweep that picks it, then stalls before it marks it; meanwhile
    # another sweep takes it, sends it, and its retry fails, putting it off by its backoff
    # (where the server locks no rows: SQLite here; elsewhere the other sweep skips it)
    item = dlq.add(_failure(max_retries=3))
    clock.advance(days=1)
    other = make_queue()
    mark = queries.claim_for_sweep
    stalled: list[bool] = []

    def stalled_mark(ids: Any, sweep_id: str, now: datetime) -> Any:
        if not stalled:
            stalled.append(True)
            for taken in other.take_due():
                other.record_retry_failure(taken.id, "Error", "failed again", None)
        return mark(ids, sweep_id, now)

    monkeypatch.setattr(queries, "claim_for_sweep", stalled_mark)
    # When the stalled sweep goes on, then it does not send the item again before its backoff
    taken = dlq.take_due()
    retried = dlq.get(item.id)
    assert retried is not None
    if retried.retry_count == 1:  # the other sweep did take it
        assert taken == [] and retried.status is Statuses.PENDING
        assert _in_due_window(retried.next_retry_at, clock.now, 1)
    else:  # it skipped the row the stalled sweep had locked, which takes it
        assert _ids(taken) == {item.id}


def test_take_due_leaves_other_statuses_alone(dlq: DeadLetterQueue, clock: Clock) -> None:
    permanent = dlq.add(_failure(max_retries=0))
    succeeded = dlq.add(_failure())
    assert dlq.mark_succeeded(succeeded.id)
    clock.advance(days=1)
    assert dlq.take_due() == []
    assert dlq.stats()["total"] == 2
    assert dlq.get(permanent.id) == permanent


def test_mark_succeeded_ends_a_retrying_item_and_twice_is_harmless(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    item = dlq.add(_failure())
    clock.advance(hours=1)
    (taken,) = dlq.take_due()
    now = clock.advance(seconds=3)
    assert dlq.mark_succeeded(taken.id) is True
    done = dlq.get(item.id)
    assert done is not None
    assert (done.status, done.next_retry_at, done.updated_at) == (Statuses.SUCCEEDED, None, now)
    # A second report (a redelivered success) changes nothing
    clock.advance(seconds=3)
    assert dlq.mark_succeeded(taken.id) is False
    assert dlq.get(item.id) == done
    assert dlq.mark_succeeded(str(uuid.uuid4())) is False


def test_a_failed_retry_reschedules_with_a_doubled_step_until_max_retries(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    item = dlq.add(_failure(max_retries=3))
    for attempt in (1, 2, 3):
        # Given the item is due and a sweep took it
        clock.advance(days=1)
        (taken,) = dlq.take_due()
        assert taken.id == item.id
        # When its re-published task fails for good again
        now = clock.advance(seconds=10)
        after = dlq.record_retry_failure(
            item.id, f"Error{attempt}", f"failed again ({attempt})", f"tb {attempt}"
        )
        # Then the count goes up and the error is the latest
        assert after is not None
        assert after.retry_count == attempt
        assert (after.error_type, after.error_message, after.traceback) == (
            f"Error{attempt}",
            f"failed again ({attempt})",
            f"tb {attempt}",
        )
        assert (after.sweep_id, after.updated_at) == (None, now)
        assert dlq.get(item.id) == after
        if attempt < 3:
            # rescheduled base * 2**retry_count (+ at most 25 %) from now
            assert after.status is Statuses.PENDING
            assert _in_due_window(after.next_retry_at, now, attempt)
            assert dlq.take_due() == []  # not due yet
        else:
            # at max_retries it gives up
            assert (after.status, after.next_retry_at) == (Statuses.PERMANENT_FAILURE, None)
    clock.advance(days=365)
    assert dlq.take_due() == []


def test_record_retry_failure_changes_only_a_retrying_item(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    pending = dlq.add(_failure())
    done = dlq.add(_failure())
    dlq.mark_succeeded(done.id)
    clock.advance(seconds=30)
    for item_id in (pending.id, done.id):
        before = dlq.get(item_id)
        assert dlq.record_retry_failure(item_id, "Late", "late report", None) == before
    assert dlq.record_retry_failure(str(uuid.uuid4()), "Late", "late report", None) is None


def _taken_by_a_sweep(dlq: DeadLetterQueue, clock: Clock) -> tuple[DeadLetter, DeadLetter]:
    """An item added, and as a sweep then took it (retrying, with that sweep's id)."""
    item = dlq.add(_failure(max_retries=3))
    clock.advance(days=1)
    [taken] = dlq.take_due()
    assert taken.id == item.id and taken.sweep_id is not None
    return item, taken


def test_give_up_ends_a_retrying_item_at_once_keeping_its_failure(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    # Given an item a sweep took, and one pending
    item, taken = _taken_by_a_sweep(dlq, clock)
    pending = dlq.add(_failure(max_retries=3))
    # When another sweep, which no longer holds it, finds it cannot be sent, then nothing
    # changes
    assert dlq.give_up(item.id, "its job is gone", "an-earlier-sweep") is False
    assert dlq.get(item.id) == taken
    # When the sweep holding it cannot send it (said twice: a repeated report), then it ends
    # at once, its failure as it was, the reason added to its message once
    assert dlq.give_up(item.id, "its job is gone", taken.sweep_id) is True
    assert dlq.give_up(item.id, "its job is gone") is False
    ended = dlq.get(item.id)
    assert ended is not None
    assert (ended.status, ended.retry_count, ended.next_retry_at, ended.sweep_id) == (
        DeadLetterStatus.PERMANENT_FAILURE,
        0,
        None,
        None,
    )
    assert (ended.error_type, ended.traceback) == (item.error_type, item.traceback)
    assert ended.error_message == f"{item.error_message}\n[not sent again: its job is gone]"
    # And an item no sweep holds is left alone
    before = dlq.get(pending.id)
    assert dlq.give_up(pending.id, "its job is gone") is False
    assert dlq.get(pending.id) == before


def test_a_repeated_retry_failure_report_counts_once(dlq: DeadLetterQueue, clock: Clock) -> None:
    item = dlq.add(_failure(max_retries=3))
    clock.advance(days=1)
    dlq.take_due()
    first = dlq.record_retry_failure(item.id, "E", "once", None)
    clock.advance(seconds=1)
    again = dlq.record_retry_failure(item.id, "E", "twice", None)
    assert first is not None and first.retry_count == 1
    assert again == first


def test_a_report_from_an_earlier_sweeps_run_leaves_a_later_sweeps_retry_alone(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    # Given an item whose first retry (published by one sweep) failed, and which a later sweep
    # has taken again
    item, first_sweep = _taken_by_a_sweep(dlq, clock)
    failed = dlq.record_retry_failure(item.id, "E", "once", None, first_sweep.sweep_id)
    assert failed is not None and failed.retry_count == 1
    clock.advance(days=1)
    [second_sweep] = dlq.take_due()
    assert second_sweep.sweep_id not in (None, first_sweep.sweep_id)
    # When the first retry's failure is reported again (a redelivery, a write repeated after a
    # lost reply), then nothing changes: the second retry is still in flight
    assert dlq.record_retry_failure(item.id, "E", "again", None, first_sweep.sweep_id) == (
        dlq.get(item.id)
    )
    held = dlq.get(item.id)
    assert held is not None
    assert (held.status, held.retry_count) == (Statuses.RETRYING, 1)
    # And the second retry's own failure counts
    second = dlq.record_retry_failure(item.id, "E", "second", None, second_sweep.sweep_id)
    assert second is not None
    assert (second.status, second.retry_count, second.error_message) == (
        Statuses.PENDING,
        2,
        "second",
    )


def test_unclaim_puts_a_retrying_item_back_due_now(dlq: DeadLetterQueue, clock: Clock) -> None:
    item = dlq.add(_failure())
    clock.advance(hours=1)
    dlq.take_due()
    now = clock.advance(seconds=2)
    assert dlq.unclaim(item.id) is True
    back = dlq.get(item.id)
    assert back is not None
    assert (back.status, back.next_retry_at, back.sweep_id, back.updated_at) == (
        Statuses.PENDING,
        now,
        None,
        now,
    )
    assert back.retry_count == 0
    # Only a retrying item can be unclaimed
    assert dlq.unclaim(item.id) is False
    assert dlq.unclaim(str(uuid.uuid4())) is False
    assert _ids(dlq.take_due()) == {item.id}
    # With a delay, it is due that much later, and not before
    now = clock.advance(seconds=1)
    assert dlq.unclaim(item.id, delay=60) is True
    back = dlq.get(item.id)
    assert back is not None
    assert (back.status, back.next_retry_at) == (Statuses.PENDING, now + timedelta(seconds=60))
    assert dlq.take_due() == []
    clock.advance(seconds=60)
    assert _ids(dlq.take_due()) == {item.id}


def test_retry_now_makes_an_item_pending_and_due(dlq: DeadLetterQueue, clock: Clock) -> None:
    # Given an item that gave up, and one not due for a minute
    given_up = dlq.add(_failure(max_retries=0))
    waiting = dlq.add(_failure())
    now = clock.advance(seconds=1)
    # When the operator retries both now
    assert dlq.retry_now(given_up.id) is True
    assert dlq.retry_now(waiting.id) is True
    # Then both are pending, due now, and the next sweep takes them
    for item_id in (given_up.id, waiting.id):
        found = dlq.get(item_id)
        assert found is not None
        assert (found.status, found.next_retry_at, found.updated_at) == (
            Statuses.PENDING,
            now,
            now,
        )
    assert _ids(dlq.take_due()) == {given_up.id, waiting.id}
    # But an item being retried is left to its sweep
    clock.advance(seconds=1)
    before = dlq.get(waiting.id)
    assert dlq.retry_now(waiting.id) is False
    assert dlq.get(waiting.id) == before
    assert dlq.retry_now(str(uuid.uuid4())) is False


def test_get_and_retry_now_take_the_id_by_the_name_the_contract_gives_it(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    item = dlq.add(_failure(max_retries=0))
    now = clock.advance(seconds=1)
    assert dlq.retry_now(id=item.id) is True
    found = dlq.get(id=item.id)
    assert found is not None
    assert (found.id, found.status, found.next_retry_at) == (item.id, Statuses.PENDING, now)


def test_retry_now_revives_a_succeeded_item(dlq: DeadLetterQueue, clock: Clock) -> None:
    item = dlq.add(_failure())
    dlq.mark_succeeded(item.id)
    now = clock.advance(seconds=1)
    assert dlq.retry_now(item.id) is True
    found = dlq.get(item.id)
    assert found is not None
    assert (found.status, found.next_retry_at) == (Statuses.PENDING, now)


# -- stuck items --------------------------------------------------------------------------------


def test_an_item_stuck_in_retrying_returns_to_pending(dlq: DeadLetterQueue, clock: Clock) -> None:
    # Given one item taken 11 minutes ago and another taken 6 minutes ago
    older = _add_at(dlq, clock, T0)
    newer = _add_at(dlq, clock, T0 + timedelta(minutes=1))  # due after the older, jitter or not
    clock.now = T0 + timedelta(hours=1)
    assert _ids(dlq.take_due(limit=1)) == {older.id}
    clock.advance(minutes=5)
    assert _ids(dlq.take_due(limit=1)) == {newer.id}
    taken_by = dlq.get(older.id)
    assert taken_by is not None and taken_by.sweep_id is not None
    now = clock.advance(minutes=6)
    # When stuck items are recovered with a 10-minute timeout
    assert dlq.recover_stuck(timedelta(minutes=10)) == 1
    # Then only the older one is pending again, due now, still naming the sweep that sent it
    back = dlq.get(older.id)
    assert back is not None
    assert (back.status, back.next_retry_at, back.sweep_id, back.updated_at) == (
        Statuses.PENDING,
        now,
        taken_by.sweep_id,
        now,
    )
    assert back.retry_count == 0
    kept = dlq.get(newer.id)
    assert kept is not None and kept.status is Statuses.RETRYING
    assert _ids(dlq.take_due()) == {older.id}


def _recovered_while_its_run_lives(
    dlq: DeadLetterQueue, clock: Clock, grace: timedelta = timedelta(minutes=1)
) -> DeadLetter:
    """An item a sweep sent whose run is alive, but whose renewals were lost (the database
    down past the timeout): made due again as stuck, ``grace`` from now."""
    dlq.add(_failure(max_retries=3))
    clock.advance(days=1)
    [taken] = dlq.take_due()
    clock.advance(minutes=11)
    assert dlq.recover_stuck(timedelta(minutes=10), grace=grace) == 1
    return taken


def test_an_item_recovered_with_a_grace_is_due_only_after_it(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    taken = _recovered_while_its_run_lives(dlq, clock, grace=timedelta(minutes=1))
    back = dlq.get(taken.id)
    assert back is not None and back.status is Statuses.PENDING
    assert back.next_retry_at == clock.now + timedelta(minutes=1)
    assert dlq.take_due() == []
    clock.advance(minutes=1)
    assert _ids(dlq.take_due()) == {taken.id}


def test_a_recovered_item_whose_run_renews_it_is_retrying_again_and_not_sent_twice(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    # Given an item made due again as stuck while its run was alive
    taken = _recovered_while_its_run_lives(dlq, clock)
    # When another sweep's copy renews it, nothing changes; when its own run renews it, it is
    # retrying again, that run's, and no sweep takes it when it would have been due
    assert dlq.renew_retrying(taken.id, "another-sweep") is False
    assert dlq.renew_retrying(taken.id, taken.sweep_id) is True
    back = dlq.get(taken.id)
    assert back is not None
    assert (back.status, back.sweep_id, back.updated_at) == (
        Statuses.RETRYING,
        taken.sweep_id,
        clock.now,
    )
    clock.advance(minutes=2)
    assert dlq.take_due() == []


@pytest.mark.parametrize("outcome", ["succeeds", "fails"])
def test_the_outcome_of_a_recovered_items_run_counts_until_it_is_sent_again(
    dlq: DeadLetterQueue, clock: Clock, outcome: str
) -> None:
    # Given two items one sweep sent, made due again as stuck while their runs were alive,
    # one of which a later sweep has sent again since
    dlq.add(_failure(max_retries=3))
    dlq.add(_failure(max_retries=3))
    clock.advance(days=1)
    sent = {item.id: item for item in dlq.take_due()}
    clock.advance(minutes=11)
    assert dlq.recover_stuck(timedelta(minutes=10), grace=timedelta(minutes=1)) == 2
    clock.advance(minutes=2)
    [again] = dlq.take_due(limit=1)
    resent = sent.pop(again.id)
    [taken] = sent.values()
    assert again.sweep_id != resent.sweep_id
    # When the first run of each reports its outcome
    for item in (taken, resent):
        if outcome == "succeeds":
            dlq.mark_succeeded(item.id, item.sweep_id)
        else:
            dlq.record_retry_failure(item.id, "Error", "failed again", None, item.sweep_id)
    # Then it counts for the item not sent again. A failure does not count for the one sent
    # again (its own run's outcome does), which no renewal of the first run takes back
    # either; a success does, as a success of the call's, whichever run made it.
    ended = dlq.get(taken.id)
    still = dlq.get(resent.id)
    assert ended is not None and still is not None
    if outcome == "succeeds":
        assert ended.status is still.status is Statuses.SUCCEEDED
        return
    assert (ended.status, ended.retry_count, ended.sweep_id) == (Statuses.PENDING, 1, None)
    assert _in_due_window(ended.next_retry_at, clock.now, 1)
    assert (still.status, still.sweep_id, still.retry_count) == (
        Statuses.RETRYING,
        again.sweep_id,
        0,
    )
    assert dlq.renew_retrying(resent.id, resent.sweep_id) is False


def test_recover_stuck_touches_no_other_status(dlq: DeadLetterQueue, clock: Clock) -> None:
    dlq.add(_failure())
    dlq.add(_failure(max_retries=0))
    done = dlq.add(_failure())
    dlq.mark_succeeded(done.id)
    clock.advance(days=30)
    assert dlq.recover_stuck(timedelta(minutes=1)) == 0
    assert dlq.stats() == {
        "pending": 1,
        "retrying": 0,
        "succeeded": 1,
        "permanent_failure": 1,
        "total": 3,
    }


def test_text_with_nul_characters_is_stored(dlq: DeadLetterQueue, clock: Clock) -> None:
    # PostgreSQL refuses NUL in text columns: a row it refused would be written again forever
    item = dlq.add(
        _failure(
            args=["frame\x00data"],
            max_retries=3,
            error_message="bad frame \x00 here",
            traceback="line \x00",
        )
    )
    row = dlq.get(item.id)
    assert row is not None
    assert row.error_message == "bad frame \\x00 here"
    assert row.args == ["frame\x00data"]
    clock.advance(days=1)
    [taken] = dlq.take_due()
    failed = dlq.record_retry_failure(taken.id, "E", "again \x00", "tb \x00", taken.sweep_id)
    assert failed is not None and failed.error_message == "again \\x00"


def test_text_no_database_holds_is_stored_written_out_and_long_names_whole(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    # A lone surrogate (a file name's undecodable byte) no database's encoding holds, and names
    # longer than their columns: a row a database refused would be written again forever
    args, kwargs, faithful = stored_arguments(["/data/\udcff"], {"path": "\udcff"})
    assert not faithful
    task_name = "tasks." + "n" * 300
    item = dlq.add(
        _failure(
            task_name=task_name,
            args=args,
            kwargs=kwargs,
            error_type="E" * 300,
            error_message="cannot open /data/\udcff",
            traceback="tb \udcff",
        )
    )
    row = dlq.get(item.id)
    assert row is not None
    assert (row.error_message, row.traceback) == ("cannot open /data/\\udcff", "tb \\udcff")
    assert (row.args, row.kwargs) == (["/data/\\udcff"], {"path": "\\udcff"})
    assert (row.task_name, row.error_type) == (task_name, "E" * 255)
    clock.advance(days=1)
    [taken] = dlq.take_due()
    failed = dlq.record_retry_failure(taken.id, "E\udcff", "again \udcff", None, taken.sweep_id)
    assert failed is not None
    assert (failed.error_type, failed.error_message) == ("E\\udcff", "again \\udcff")


def test_recover_stuck_of_one_framework_leaves_the_others_rows(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    # Given a Celery row and an RQ row, both taken by their sweeps long ago
    celery_row = dlq.add(_failure())
    rq_row = dlq.add(_failure(framework="rq"))
    clock.advance(days=1)
    assert len(dlq.take_due(framework="celery")) == 1
    assert len(dlq.take_due(framework="rq")) == 1
    clock.advance(hours=2)
    # When RQ's sweep recovers its stuck rows, then only its own go back
    assert dlq.recover_stuck(timedelta(hours=1), framework="rq") == 1
    celery_now, rq_now = dlq.get(celery_row.id), dlq.get(rq_row.id)
    assert celery_now is not None and celery_now.status is Statuses.RETRYING
    assert rq_now is not None and rq_now.status is Statuses.PENDING


def test_a_renewed_retrying_row_is_not_stuck_and_only_its_sweeps_run_renews_it(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    # Given a row taken by a sweep 50 minutes ago, whose run began (or retries) now
    row = dlq.add(_failure())
    clock.advance(days=1)
    [taken] = dlq.take_due()
    clock.advance(minutes=50)
    assert not dlq.renew_retrying(taken.id, sweep_id="another sweep")
    assert dlq.renew_retrying(taken.id, sweep_id=taken.sweep_id)
    # When a sweep looks for rows stuck for an hour 20 minutes later, then it is not one
    clock.advance(minutes=20)
    assert dlq.recover_stuck(timedelta(hours=1)) == 0
    # And once no run renewed it for an hour, it is
    clock.advance(minutes=41)
    assert dlq.recover_stuck(timedelta(hours=1)) == 1
    # A row no longer retrying is left as it is
    assert not dlq.renew_retrying(row.id)
    found = dlq.get(row.id)
    assert found is not None and found.status is Statuses.PENDING


def test_a_retrying_row_whose_run_retries_after_a_long_countdown_is_not_stuck_meanwhile(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    # Given a row taken by a sweep, whose run retries with a countdown of two hours
    dlq.add(_failure())
    clock.advance(days=1)
    [taken] = dlq.take_due()
    assert dlq.renew_retrying(taken.id, sweep_id=taken.sweep_id, waits_for=2 * 3600)
    # (a renewal of the run that made it, finishing after it, takes none of that away)
    assert dlq.renew_retrying(taken.id, sweep_id=taken.sweep_id)
    # When a sweep looks for rows stuck for an hour while the retry waits, and an hour after
    # it was due, then it is not one
    clock.advance(hours=2, minutes=59)
    assert dlq.recover_stuck(timedelta(hours=1)) == 0
    # And once the retry is an hour overdue with no run renewing the row, it is
    clock.advance(minutes=2)
    assert dlq.recover_stuck(timedelta(hours=1)) == 1


def test_a_failure_under_the_id_of_a_row_that_ended_gets_a_row_of_its_own(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    # Given a call's dead letter that succeeded since, and one that gave up after retries
    succeeded = dlq.add(_failure(failure_id="reused:0"))
    clock.advance(days=1)
    [taken] = dlq.take_due()
    assert dlq.mark_succeeded(taken.id)
    gave_up = dlq.add(_failure(failure_id="again:0", max_retries=1))
    clock.advance(days=1)
    [taken] = dlq.take_due()
    gave_up_now = dlq.record_retry_failure(taken.id, "E", "no", None, taken.sweep_id)
    assert gave_up_now is not None and gave_up_now.status is Statuses.PERMANENT_FAILURE
    # When a later call under the same task id fails for good (and its write is repeated)
    later = dlq.add(_failure(failure_id="reused:0", error_message="the later call"))
    repeated = dlq.add(_failure(failure_id="reused:0", error_message="the later call"))
    after_give_up = dlq.add(_failure(failure_id="again:0"))
    # Then each later failure has a pending row of its own, written once
    assert later.id != succeeded.id and repeated.id == later.id
    assert (later.status, later.error_message) == (Statuses.PENDING, "the later call")
    assert after_give_up.id != gave_up.id and after_give_up.status is Statuses.PENDING
    found = dlq.get(succeeded.id)
    assert found is not None and found.status is Statuses.SUCCEEDED
    # While a row kept without retries takes its failure written again, and so does a row
    # that ended since this very failure was first written (its write tried again later)
    kept = dlq.add(_failure(failure_id="kept:0", max_retries=0))
    assert dlq.add(_failure(failure_id="kept:0", max_retries=0)).id == kept.id
    failure = _failure(failure_id="written-twice:0")
    first = dlq.add(failure)
    clock.advance(days=1)
    assert first.id in [taken.id for taken in dlq.take_due()]
    assert dlq.mark_succeeded(first.id)
    assert dlq.add(failure).id == first.id
    assert "failure_occurrence" not in first.options


class _Interleaving(random.Random):
    """A jitter source that, once ``between`` is set, runs it before its next draw: inside
    ``record_retry_failure``, between its read of the row and its write."""

    def __init__(self) -> None:
        super().__init__(SEED)
        self.between: Callable[[], None] | None = None

    def uniform(self, a: float, b: float) -> float:
        if self.between is not None:
            between, self.between = self.between, None
            between()
        return super().uniform(a, b)


def test_a_stale_retry_failure_report_does_not_overwrite_a_later_sweeps_claim(
    make_queue: MakeQueue, clock: Clock
) -> None:
    # Given a row the first sweep took, whose report of a failed retry is on its way
    other = make_queue()
    later_sweep: list[DeadLetter] = []

    def recovered_and_taken_again() -> None:
        assert other.recover_stuck(timedelta(0)) == 1
        later_sweep.extend(other.take_due())

    interleaving = _Interleaving()
    reporting = make_queue(rng=interleaving)
    item = reporting.add(_failure(max_retries=3))
    clock.advance(days=1)
    [first_sweep] = reporting.take_due()
    clock.advance(seconds=1)
    interleaving.between = recovered_and_taken_again
    # When, between its read and its write, the row is recovered and a later sweep takes it
    reporting.record_retry_failure(item.id, "E", "late", None, first_sweep.sweep_id)
    # Then the later sweep still holds it, no retry counted
    [second] = later_sweep
    row = reporting.get(item.id)
    assert row is not None
    assert (row.status, row.sweep_id, row.retry_count) == (Statuses.RETRYING, second.sweep_id, 0)


# -- the operator's API -------------------------------------------------------------------------


def test_items_lists_the_newest_hundred_unless_told_otherwise(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    added = [_add_at(dlq, clock, T0 + timedelta(seconds=second)) for second in range(101)]
    listed = dlq.items()
    assert [item.id for item in listed] == [item.id for item in reversed(added)][:100]
    assert len(dlq.items(limit=101)) == 101


def test_items_filter_by_status_and_task_newest_first(dlq: DeadLetterQueue, clock: Clock) -> None:
    added = [
        _add_at(dlq, clock, T0 + timedelta(minutes=minute), task_name=name)
        for minute, name in enumerate(["tasks.a", "tasks.b", "tasks.a", "tasks.b", "tasks.a"])
    ]
    newest_first = [item.id for item in reversed(added)]
    assert dlq.mark_succeeded(added[2].id)
    assert dlq.mark_succeeded(added[3].id)

    assert [item.id for item in dlq.items()] == newest_first
    assert [item.id for item in dlq.items(limit=2)] == newest_first[:2]
    assert [item.id for item in dlq.items(task_name="tasks.a")] == [
        added[4].id,
        added[2].id,
        added[0].id,
    ]
    assert [item.id for item in dlq.items(status="succeeded")] == [added[3].id, added[2].id]
    assert [item.id for item in dlq.items(status=Statuses.PENDING, task_name="tasks.a")] == [
        added[4].id,
        added[0].id,
    ]
    assert [item.id for item in dlq.items(status=Statuses.PENDING, limit=1)] == [added[4].id]
    assert dlq.items(task_name="tasks.unknown") == []
    assert dlq.items(status=Statuses.RETRYING) == []
    assert dlq.items() == [dlq.get(item_id) for item_id in newest_first]


def test_get_of_an_unknown_id_is_none(dlq: DeadLetterQueue) -> None:
    dlq.add(_failure())
    assert dlq.get(str(uuid.uuid4())) is None


def test_stats_count_each_status_and_the_total(dlq: DeadLetterQueue, clock: Clock) -> None:
    assert dlq.stats() == {
        "pending": 0,
        "retrying": 0,
        "succeeded": 0,
        "permanent_failure": 0,
        "total": 0,
    }
    retried = _add_at(dlq, clock, T0)
    _add_at(dlq, clock, T0 + timedelta(hours=2))
    _add_at(dlq, clock, T0 + timedelta(hours=2))
    done = dlq.add(_failure())
    dlq.add(_failure(max_retries=0))
    dlq.mark_succeeded(done.id)
    assert _ids(dlq.take_due()) == {retried.id}
    assert dlq.stats() == {
        "pending": 2,
        "retrying": 1,
        "succeeded": 1,
        "permanent_failure": 1,
        "total": 5,
    }


def test_purge_by_status_and_age(dlq: DeadLetterQueue, clock: Clock) -> None:
    # Given, two hours ago, a failure that gave up and one still pending;
    given_up = _add_at(dlq, clock, T0, max_retries=0)
    old_pending = _add_at(dlq, clock, T0)
    # and now, a success (of an old item) and a fresh failure
    succeeded = _add_at(dlq, clock, T0)
    clock.now = T0 + timedelta(hours=2)
    dlq.mark_succeeded(succeeded.id)
    fresh = dlq.add(_failure())
    # When purging succeeded items older than an hour, Then none qualifies (both must hold)
    assert dlq.purge(status=Statuses.SUCCEEDED, older_than=timedelta(hours=1)) == 0
    # When purging succeeded items, Then only the success goes
    assert dlq.purge(status="succeeded") == 1
    assert dlq.get(succeeded.id) is None
    # When purging anything not updated for an hour, Then the two old items go
    assert dlq.purge(older_than=timedelta(hours=1)) == 2
    assert dlq.get(given_up.id) is None
    assert dlq.get(old_pending.id) is None
    # And the fresh one stays
    assert [item.id for item in dlq.items()] == [fresh.id]
    assert dlq.purge(status=Statuses.PERMANENT_FAILURE) == 0
    assert dlq.stats()["total"] == 1


def test_purge_takes_an_age_in_seconds_or_a_moment(dlq: DeadLetterQueue, clock: Clock) -> None:
    # Given items updated two hours, an hour and a half, and no time ago
    oldest = _add_at(dlq, clock, T0)
    older = _add_at(dlq, clock, T0 + timedelta(minutes=30))
    clock.now = T0 + timedelta(hours=2)
    fresh = dlq.add(_failure())
    # When purging by a number of seconds, then that is the age
    assert dlq.purge(older_than=3 * 3600) == 0
    assert dlq.purge(older_than=100 * 60.0) == 1
    assert dlq.get(oldest.id) is None and dlq.get(older.id) is not None
    # When purging by a moment (naive: UTC), then items updated before it go
    assert dlq.purge(older_than=(T0 + timedelta(hours=1)).replace(tzinfo=None)) == 1
    assert [item.id for item in dlq.items()] == [fresh.id]
    # And what is neither is refused, deleting nothing
    with pytest.raises(TypeError, match="older_than"):
        dlq.purge(older_than="1h")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="negative"):
        dlq.purge(older_than=-1)
    assert dlq.stats()["total"] == 1


# -- several processes --------------------------------------------------------------------------


def _sweep_until_empty(
    url: str, barrier: multiprocessing.synchronize.Barrier, results: Results
) -> None:
    """In a child process: take due items ten at a time until none is pending; their ids."""
    try:
        dlq = DeadLetterQueue(url)
        try:
            dlq.ensure_schema()
            barrier.wait(timeout=60)
            taken: list[str] = []
            deadline = time.monotonic() + 30
            # A sweep that lost its whole batch to another gets nothing although items are
            # still due, so keep going until none is pending.
            while (batch := dlq.take_due(limit=10)) or dlq.stats()["pending"]:
                taken.extend(item.id for item in batch)
                if time.monotonic() > deadline:
                    raise RuntimeError("due items stay pending: take_due does not take them")
            results.put(("ok", taken))
        finally:
            dlq.dispose()
    except BaseException:
        barrier.abort()  # the others stop waiting for this one
        results.put(("error", traceback.format_exc()))


def _first_use(url: str, barrier: multiprocessing.synchronize.Barrier, results: Results) -> None:
    """In a child process: in each round, touch a database with no tables with the others."""
    errors: list[str] = []
    try:
        for round_ in range(FIRST_USE_ROUNDS):
            dlq = DeadLetterQueue(url)
            barrier.wait(timeout=60)
            try:
                dlq.stats()
            except Exception as exc:
                errors.append(f"round {round_}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            finally:
                dlq.dispose()
            # One process drops the tables for the next round while the others wait.
            if barrier.wait(timeout=60) == 0 and round_ < FIRST_USE_ROUNDS - 1:
                _drop_dead_letter_tables(url)
            barrier.wait(timeout=60)
        results.put(("ok", errors))
    except BaseException:
        barrier.abort()  # the others stop waiting for this one
        results.put(("error", traceback.format_exc()))


def _run_in_processes(target: Callable[..., None], url: str) -> list[Any]:
    """Run ``target(url, barrier, results)`` in ``SWEEPERS`` spawned processes; their results."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(SWEEPERS)
    results = context.Queue()
    processes = [
        context.Process(target=target, args=(url, barrier, results)) for _ in range(SWEEPERS)
    ]
    for process in processes:
        process.start()
    outcomes = []
    try:
        for _ in processes:
            outcomes.append(results.get(timeout=60))
    except queue_module.Empty:
        pytest.fail(f"a process never answered: {[p.exitcode for p in processes]}")
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        results.close()
        results.join_thread()
    errors = [detail for status, detail in outcomes if status != "ok"]
    assert not errors, "\n".join(errors)
    return [detail for _, detail in outcomes]


def test_concurrent_sweeps_take_every_item_exactly_once(dlq: DeadLetterQueue, dlq_url: str) -> None:
    # Given many items due long ago (the fixed clock is in the past; the sweepers use real time)
    added = {dlq.add(_failure()).id for _ in range(SWEPT_ITEMS)}
    # When four processes sweep the same table at once, ten items at a time
    taken_per_process = _run_in_processes(_sweep_until_empty, dlq_url)
    # Then every item was taken by exactly one of them
    taken = Counter(item_id for ids in taken_per_process for item_id in ids)
    assert [item_id for item_id, times in taken.items() if times > 1] == []
    assert set(taken) == added
    assert dlq.stats()["retrying"] == SWEPT_ITEMS


#: Where tables created by one process at the same moment as another's fail the other's first use.
def test_concurrent_first_use_creates_the_schema_once(dlq_url: str) -> None:
    # Given no tables, When four processes use the database at the same moment (a few rounds)
    errors = [error for found in _run_in_processes(_first_use, dlq_url) for error in found]
    # Then all of them work, and one version row is written
    assert not errors, "\n".join(errors)
    engine = sa.create_engine(dlq_url)
    try:
        assert _version_rows(engine) == [(COMPONENT, SCHEMA_VERSION)]
    finally:
        engine.dispose()


# -- a database that is not there ---------------------------------------------------------------


def _unreachable_sqlite(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'dead_letters.sqlite3'}"


@pytest.mark.parametrize(
    "make_url",
    [
        pytest.param(lambda _: "postgresql+psycopg://postgres@127.0.0.1:1/test", id="postgresql"),
        pytest.param(lambda _: "mysql+pymysql://root@127.0.0.1:1/test", id="mariadb"),
        pytest.param(_unreachable_sqlite, id="sqlite"),
    ],
)
def test_an_unreachable_database_raises_store_unavailable(
    make_url: Callable[[Path], str], tmp_path: Path
) -> None:
    dlq = DeadLetterQueue(make_url(tmp_path), clock=Clock(T0))
    try:
        # First use, and every use after it, fails the same documented way
        with pytest.raises(StoreUnavailable):
            dlq.stats()
        with pytest.raises(StoreUnavailable):
            dlq.add(_failure())
        with pytest.raises(StoreUnavailable):
            dlq.take_due()
    finally:
        dlq.dispose()


def test_a_postgresql_server_that_never_answers_is_unavailable_after_the_connect_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    from idempotent_tasks.dlq import engine

    # Given a port that takes connections and never says a word (a hung server)
    monkeypatch.setattr(engine, "CONNECT_TIMEOUT_SECONDS", 1)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        dlq = DeadLetterQueue(f"postgresql+psycopg://postgres@127.0.0.1:{port}/test")
        try:
            # Then the queue gives up (libpq alone would wait for ever)
            with pytest.raises(StoreUnavailable):
                dlq.stats()
        finally:
            dlq.dispose()


def test_a_queue_works_once_its_database_appears(tmp_path: Path) -> None:
    # Given a queue whose first use failed (its SQLite folder did not exist yet)
    url = _unreachable_sqlite(tmp_path)
    dlq = DeadLetterQueue(url, clock=Clock(T0))
    try:
        with pytest.raises(StoreUnavailable):
            dlq.stats()
        # When the folder appears, Then the same queue creates its tables and works
        (tmp_path / "no" / "such" / "dir").mkdir(parents=True)
        item = dlq.add(_failure())
        assert dlq.get(item.id) == item
    finally:
        dlq.dispose()


@pytest.mark.parametrize(
    "url",
    [
        pytest.param(f"{PG_URL}_no_such_database", id="postgresql-unknown-db"),
        pytest.param(f"{MARIADB_URL}_no_such_database", id="mariadb-unknown-db"),
        pytest.param(MARIADB_URL.replace("root@", "no_such_user@"), id="mariadb-unknown-user"),
    ],
)
def test_a_refused_login_raises_store_unavailable(url: str) -> None:
    require("PostgreSQL" if url.startswith("postgresql") else "MariaDB")
    dlq = DeadLetterQueue(url, clock=Clock(T0))
    try:
        with pytest.raises(StoreUnavailable):
            dlq.stats()
    finally:
        dlq.dispose()


def test_add_keeps_a_task_id_of_the_longest_length_apply_async_takes(
    dlq: DeadLetterQueue,
) -> None:
    from idempotent_tasks.keys import MAX_TASK_ID_CHARS

    task_id = ("t" * MAX_TASK_ID_CHARS)[:-1] + "z"
    item = dlq.add(_failure(task_id=task_id, failure_id=f"{task_id}:99"))
    assert (item.task_id, item.failure_id) == (task_id, f"{task_id}:99")
    assert dlq.get(item.id) == item


def test_failures_of_task_ids_that_differ_only_in_case_are_two_rows(dlq: DeadLetterQueue) -> None:
    first = dlq.add(_failure(task_id="Order-42", failure_id="Order-42:0"))
    second = dlq.add(_failure(task_id="order-42", failure_id="order-42:0"))
    assert first.id != second.id
    assert (first.failure_id, second.failure_id) == ("Order-42:0", "order-42:0")
    assert dlq.stats()["pending"] == 2


def test_a_version_one_table_is_brought_to_exact_failure_ids_keeping_its_rows(
    dlq_url: str,
) -> None:
    # Given a dead-letter table as version 1 made it (failure ids compared by the database's
    # default collation: on MariaDB, blind to case) holding one failure
    engine = sa.create_engine(dlq_url)
    try:
        version_one_dead_letter(engine, failure_id="Order-42:0", task_id="Order-42")
        # When a queue of this version opens it
        dlq = DeadLetterQueue(dlq_url)
        try:
            # Then the row is kept, and a task id that differs only in case gets its own
            added = dlq.add(_failure(task_id="order-42", failure_id="order-42:0"))
            assert added.failure_id == "order-42:0"
            assert sorted(item.failure_id for item in dlq.items(limit=10)) == [
                "Order-42:0",
                "order-42:0",
            ]
            assert _version_rows(engine) == [(COMPONENT, SCHEMA_VERSION)] == [(COMPONENT, 3)]
        finally:
            dlq.dispose()
    finally:
        engine.dispose()


# -- one sweep over the due items (resend_due) --------------------------------------------------


class _TimeLimit(Exception):
    """Stands for a sweep's own time limit (Celery's soft one, RQ's job timeout: both plain
    exceptions), raised wherever the sweep is."""


def test_a_sweep_interrupted_by_its_time_limit_hands_its_batch_back_with_no_retry_used(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    # Given three due items
    items = [_add_at(dlq, clock, T0 + timedelta(seconds=n)) for n in range(3)]
    clock.now = T0 + timedelta(hours=1)
    sent: list[str] = []

    def resend(item: DeadLetter) -> None:
        if len(sent) == 1:
            raise _TimeLimit()  # the time limit fires while the second one is sent
        sent.append(item.id)

    # When the sweep's time limit interrupts it on the second item
    with pytest.raises(_TimeLimit):
        resend_due(
            dlq, resend, framework="celery", batch=10, retry_delay=60, interrupted=(_TimeLimit,)
        )
    # Then the one that went stays taken, and the other two are due again at once, their
    # failure and retry count as they were: the interruption was no failure of theirs
    went = dlq.get(sent[0])
    assert went is not None and went.status is Statuses.RETRYING
    handed_back = _ids(items) - {went.id}
    for item_id in handed_back:
        found = dlq.get(item_id)
        assert found is not None
        assert (found.status, found.retry_count, found.error_type) == (
            Statuses.PENDING,
            0,
            "RuntimeError",
        )
    assert _ids(dlq.take_due(limit=10)) == handed_back


def test_a_sweep_interrupted_after_its_message_went_out_and_began_leaves_the_item_to_its_run(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    # Given a due item whose message goes out, and whose run begins (renewing its row), before
    # the sweep hears that the publish failed (its reply lost, a time limit in the middle)
    item = _add_at(dlq, clock, T0)
    clock.now = T0 + timedelta(hours=1)

    def resend(sent: DeadLetter) -> None:
        clock.advance(seconds=1)
        assert dlq.renew_retrying(sent.id, sent.sweep_id) is True
        raise _TimeLimit()

    # When the sweep hands its batch back
    with pytest.raises(_TimeLimit):
        resend_due(
            dlq, resend, framework="celery", batch=10, retry_delay=60, interrupted=(_TimeLimit,)
        )
    # Then the item stays its run's: no later sweep sends it a second time while it runs
    found = dlq.get(item.id)
    assert found is not None and found.status is Statuses.RETRYING
    clock.advance(minutes=5)
    assert dlq.take_due(limit=10) == []


def test_unclaim_of_a_taken_item_hands_it_back_only_while_no_run_renewed_it(
    dlq: DeadLetterQueue, clock: Clock
) -> None:
    first, second = dlq.add(_failure()), dlq.add(_failure())
    clock.advance(hours=1)
    taken = {item.id: item for item in dlq.take_due()}
    clock.advance(seconds=1)
    assert dlq.renew_retrying(first.id, taken[first.id].sweep_id) is True
    assert dlq.unclaim(first.id, taken=taken[first.id]) is False
    assert dlq.unclaim(second.id, taken=taken[second.id]) is True
    assert _ids(dlq.take_due()) == {second.id}


@pytest.mark.parametrize("batch", [0, -1, 2.5, True])
def test_a_sweep_refuses_a_batch_that_is_no_count_of_one_or_more(batch: Any) -> None:
    # (a batch of 0 took nothing, and never ended the sweep; -1 is no LIMIT on SQLite)
    with pytest.raises(ValueError, match="batch must be a whole number, 1 or more"):
        resend_due(None, print, framework="celery", batch=batch, retry_delay=60)  # type: ignore[arg-type]


class _QueueThatCannotRecord(DeadLetterQueue):
    """A queue whose database fails as the sweep records a failed retry."""

    def record_retry_failure(self, *args: Any, **kwargs: Any) -> DeadLetter | None:
        raise StoreUnavailable("database went away")


def test_a_sweep_that_cannot_record_one_items_retry_goes_on_with_the_others(
    dlq_url: str, clock: Clock
) -> None:
    # Given three due items, the first of which fails to be sent, and a database that fails
    # as the sweep records that
    dlq = _QueueThatCannotRecord(dlq_url, clock=clock, rng=random.Random(SEED))
    try:
        items = [_add_at(dlq, clock, T0 + timedelta(seconds=n)) for n in range(3)]
        clock.now = T0 + timedelta(hours=1)
        sent: list[str] = []

        def resend(item: DeadLetter) -> None:
            if item.id == items[0].id:
                raise ValueError("a router that raises")
            sent.append(item.id)

        # When the sweep runs, then it sends the other two all the same
        assert resend_due(dlq, resend, framework="celery", batch=10, retry_delay=60) == 2
        assert set(sent) == _ids(items[1:])
        # and the first stays taken, for recover_stuck to make due again after its timeout
        first = dlq.get(items[0].id)
        assert first is not None and first.status is Statuses.RETRYING
    finally:
        dlq.dispose()


# -- apps sharing one table ---------------------------------------------------------------------


def _status(dlq: DeadLetterQueue, item: DeadLetter) -> tuple[DeadLetterStatus, int]:
    found = dlq.get(item.id)
    assert found is not None
    return found.status, found.retry_count


def test_an_app_sweeps_its_own_rows_unnamed_rows_and_rows_of_tasks_it_runs(
    make_queue: MakeQueue, clock: Clock
) -> None:
    # Given one table written by two apps' queues ("shop" and "mail") and by one that names no
    # app (a queue of an earlier version, RQ's, the Python API's)
    shop, mail, unnamed = make_queue(scope="shop"), make_queue(scope="mail"), make_queue()
    own = _add_at(shop, clock, T0, task_name="shop.charge")
    # (its task not registered where the sweep runs: a worker with other modules, a task
    # removed since; its own app's row all the same)
    own_of_a_task_not_here = _add_at(shop, clock, T0, task_name="shop.removed")
    others = _add_at(mail, clock, T0, task_name="mail.send")
    others_of_a_task_shop_runs = _add_at(mail, clock, T0, task_name="shop.refund")
    nameless = _add_at(unnamed, clock, T0, task_name="old.task")
    clock.now = T0 + timedelta(hours=1)
    # When the shop's sweep takes what is due, as an app running shop.charge and shop.refund
    taken = shop.take_due(limit=10, runs={"shop.charge", "shop.refund"})
    # Then it takes its own row, the unnamed one, and mail's row of a task it runs (an app
    # renamed since takes the rows of its old name); never mail's row of a task it does not
    # know, which its worker would refuse (a retry used), and which mail's sweep takes
    assert _ids(taken) == {
        own.id,
        own_of_a_task_not_here.id,
        nameless.id,
        others_of_a_task_shop_runs.id,
    }
    assert _status(shop, others) == (Statuses.PENDING, 0)
    assert _ids(mail.take_due(limit=10, runs={"mail.send"})) == {others.id}
    # And each row names the app that wrote it, as an attribute, not an option to send
    assert {item.id: item.scope for item in unnamed.items(limit=10)} == {
        own.id: "shop",
        own_of_a_task_not_here.id: "shop",
        others.id: "mail",
        others_of_a_task_shop_runs.id: "mail",
        nameless.id: None,
    }
    assert all(SCOPE_OPTION not in item.options for item in unnamed.items(limit=10))


def test_a_queue_that_names_no_app_sweeps_every_row(make_queue: MakeQueue, clock: Clock) -> None:
    # (the Python API's, and RQ's: told no tasks to keep to)
    shop, unnamed = make_queue(scope="shop"), make_queue()
    rows = [_add_at(shop, clock, T0), _add_at(unnamed, clock, T0)]
    clock.now = T0 + timedelta(hours=1)
    assert _ids(unnamed.take_due(limit=10)) == _ids(rows)


def test_an_app_without_a_name_sweeps_unnamed_rows_and_rows_of_tasks_it_runs(
    make_queue: MakeQueue, clock: Clock
) -> None:
    # Given a named app's rows in a table an app without a name (Celery()) sweeps too
    shop, unnamed = make_queue(scope="shop"), make_queue()
    shops = _add_at(shop, clock, T0, task_name="shop.charge")
    shops_of_a_shared_task = _add_at(shop, clock, T0, task_name="common.notify")
    its_own = _add_at(unnamed, clock, T0, task_name="tools.report")
    clock.now = T0 + timedelta(hours=1)
    # Then its sweep takes its own (unnamed) rows, whatever their task, and the shop's row of a
    # task it runs too; never the shop's row of a task it does not know
    taken = unnamed.take_due(limit=10, runs={"common.notify"})
    assert _ids(taken) == {its_own.id, shops_of_a_shared_task.id}
    assert _status(shop, shops) == (Statuses.PENDING, 0)


def test_an_app_recovers_only_the_stuck_rows_it_would_sweep(
    make_queue: MakeQueue, clock: Clock
) -> None:
    # Given a row of each app taken by its sweep, both stuck in retrying since (the sweeps died)
    shop, mail = make_queue(scope="shop"), make_queue(scope="mail")
    own = _add_at(shop, clock, T0, task_name="shop.charge")
    others = _add_at(mail, clock, T0, task_name="mail.send")
    clock.now = T0 + timedelta(hours=1)
    assert _ids(shop.take_due(limit=10)) == {own.id}
    assert _ids(mail.take_due(limit=10)) == {others.id}
    clock.now += timedelta(hours=2)
    # When the shop's sweep recovers stuck rows (by its own retrying timeout)
    assert shop.recover_stuck(timedelta(hours=1), framework="celery", runs={"shop.charge"}) == 1
    # Then only its own is due again: mail's is judged by mail's sweep and its timeout
    assert _status(shop, own) == (Statuses.PENDING, 0)
    assert _status(shop, others)[0] is Statuses.RETRYING


def test_a_row_whose_options_do_not_parse_leaves_a_named_sweep_working(
    tmp_path: Path, clock: Clock
) -> None:
    # Given two due rows on SQLite (which keeps any text in a JSON column), one whose options
    # an operator's UPDATE made text that is not JSON
    dlq = DeadLetterQueue(
        f"sqlite:///{tmp_path / 'dead_letters.sqlite3'}", clock=clock, scope="shop"
    )
    try:
        readable = _add_at(dlq, clock, T0)
        edited = _add_at(dlq, clock, T0)
        with dlq.engine.begin() as connection:
            connection.execute(
                sa.text(f"UPDATE {dead_letters.name} SET options = '{{not json' WHERE id = :id"),
                {"id": edited.id},
            )
        # Then the app's sweep, which asks each row's options for its app, takes the other row
        # and gives the edited one up, as an unnamed sweep does
        clock.now = T0 + timedelta(hours=1)
        assert _ids(dlq.take_due(limit=10)) == {readable.id}
        assert dlq.stats()[Statuses.PERMANENT_FAILURE.value] == 1
    finally:
        dlq.dispose()
