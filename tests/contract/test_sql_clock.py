"""The SQL store keeps time by the database server's clock, so skewed workers agree on leases.

The servers run on this host, so the server's clock is this process's ``time.time()``: a worker
whose clock is skewed is simulated by giving its store a skewed local clock.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from idempotent_tasks.errors import StoreUnavailable
from idempotent_tasks.records import ClaimRequest, Outcome
from idempotent_tasks.stores.sql import SqlStore
from idempotent_tasks.stores.sql_clock import ServerClock
from tests.claim_requests import claim_request

from .conftest import store_url

SERVERS = ["postgresql", "mariadb"]
SKEW = 3600.0
#: How far two reads of the same clock may be apart here (a query's round trip, a busy host).
TOLERANCE = 0.5


def _skewed(seconds: float) -> Callable[[], float]:
    return lambda: time.time() + seconds


@pytest.fixture()
def engine_of(sql_urls: dict[str, str]) -> Iterator[Callable[[str], sa.Engine]]:
    engines: list[sa.Engine] = []

    def make(kind: str) -> sa.Engine:
        engines.append(sa.create_engine(sql_urls[kind]))
        return engines[-1]

    yield make
    for engine in engines:
        engine.dispose()


def _request(key: str, lease: float) -> ClaimRequest:
    return claim_request(
        key=key,
        task_name="clock.task",
        storage_key=key,
        task_id=uuid.uuid4().hex,
        lease_seconds=lease,
    )


@pytest.mark.parametrize("kind", SERVERS)
@pytest.mark.parametrize("skew", [SKEW, -SKEW])
def test_clock_reads_the_server_time_whatever_the_local_clock(
    kind: str, skew: float, engine_of: Callable[[str], sa.Engine]
) -> None:
    clock = ServerClock(engine_of(kind), local=_skewed(skew))
    assert clock() == pytest.approx(time.time(), abs=TOLERANCE)


@pytest.mark.parametrize("kind", SERVERS)
def test_worker_with_a_clock_ahead_does_not_take_over_a_live_lease(
    kind: str, request: pytest.FixtureRequest, engine_of: Callable[[str], sa.Engine]
) -> None:
    url = store_url(kind, request)
    owner = SqlStore(url, prefix="clock")
    ahead = SqlStore(url, prefix="clock", clock=ServerClock(engine_of(kind), _skewed(SKEW)))
    try:
        assert owner.claim(_request("k", lease=30)).outcome is Outcome.ACQUIRED
        # By its own clock the lease ended an hour ago: it would take the key over at once.
        duplicate = ahead.claim(_request("k", lease=30))
        assert duplicate.outcome is Outcome.IN_PROGRESS
    finally:
        owner.close()
        ahead.close()


@pytest.mark.parametrize("kind", SERVERS)
def test_lease_of_a_worker_with_a_clock_behind_ends_on_time(
    kind: str, request: pytest.FixtureRequest, engine_of: Callable[[str], sa.Engine]
) -> None:
    url = store_url(kind, request)
    behind = SqlStore(url, prefix="clock", clock=ServerClock(engine_of(kind), _skewed(-SKEW)))
    other = SqlStore(url, prefix="clock")
    try:
        assert behind.claim(_request("k", lease=1)).outcome is Outcome.ACQUIRED
        # Written by its own clock, its lease would have ended an hour ago.
        assert other.claim(_request("k", lease=30)).outcome is Outcome.IN_PROGRESS
        time.sleep(1.2)
        taken = other.claim(_request("k", lease=30))
        assert (taken.outcome, taken.takeover) == (Outcome.ACQUIRED, True)
    finally:
        behind.close()
        other.close()


def _count_queries(engine: sa.Engine) -> list[str]:
    """The statements ``engine`` runs from now on."""
    statements: list[str] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement)

    return statements


@pytest.mark.parametrize("kind", SERVERS)
@pytest.mark.parametrize(
    ("resync_seconds", "reads", "queries_made"),
    [(3600, 50, 1), (0, 3, 3)],
    ids=["once-while-fresh", "again-after-resync-seconds"],
)
def test_the_server_is_asked_once_per_resync_period(
    kind: str,
    resync_seconds: float,
    reads: int,
    queries_made: int,
    engine_of: Callable[[str], sa.Engine],
) -> None:
    engine = engine_of(kind)
    queries = _count_queries(engine)
    clock = ServerClock(engine, local=_skewed(SKEW), resync_seconds=resync_seconds)
    for _ in range(reads):
        assert clock() == pytest.approx(time.time(), abs=TOLERANCE)
    assert len(queries) == queries_made


@pytest.mark.parametrize("kind", SERVERS)
@pytest.mark.parametrize("step", [SKEW, -SKEW])
def test_a_host_clock_stepped_after_the_measurement_changes_nothing(
    kind: str, step: float, engine_of: Callable[[str], sa.Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a clock that read the server's time, and is not due to read it again for an hour
    engine = engine_of(kind)
    queries = _count_queries(engine)
    clock = ServerClock(engine, resync_seconds=3600)
    assert clock() == pytest.approx(time.time(), abs=TOLERANCE)
    # When this host's clock is stepped (NTP, an operator)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + step)
    # Then the clock still reads the server's time, without asking the server again
    assert clock() == pytest.approx(real_time(), abs=TOLERANCE)
    assert len(queries) == 1


def test_sqlite_has_no_server_and_uses_the_local_clock(
    engine_of: Callable[[str], sa.Engine],
) -> None:
    clock = ServerClock(engine_of("sqlite"), local=lambda: 123.5)
    assert clock() == 123.5


def test_unreachable_server_at_first_read_raises_store_unavailable() -> None:
    engine = sa.create_engine("postgresql+psycopg://postgres@127.0.0.1:1/nothing")
    with pytest.raises(StoreUnavailable):
        ServerClock(engine)()
    engine.dispose()


def test_unreachable_server_later_keeps_the_last_offset(sql_urls: dict[str, str]) -> None:
    reachable = [True]
    attempts = [0]

    def connect() -> psycopg.Connection[object]:
        attempts[0] += 1
        if not reachable[0]:
            raise psycopg.OperationalError("connection refused (simulated)")
        return psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=test")

    engine = sa.create_engine("postgresql+psycopg://", creator=connect, poolclass=NullPool)
    clock = ServerClock(engine, local=_skewed(SKEW), resync_seconds=0)
    assert clock() == pytest.approx(time.time(), abs=TOLERANCE)
    reachable[0] = False
    assert clock() == pytest.approx(time.time(), abs=TOLERANCE)
    # A failed measurement is tried again after RETRY_SECONDS, not on every read
    attempts[0] = 0
    for _ in range(5):
        assert clock() == pytest.approx(time.time(), abs=TOLERANCE)
    assert attempts[0] == 0
    engine.dispose()
