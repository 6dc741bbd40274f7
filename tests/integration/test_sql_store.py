"""Real workers claiming through the SQL store on PostgreSQL and MariaDB: duplicates, a crash
takeover, and a schema it cannot use yet."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from idempotent_tasks.app_store import store_for
from idempotent_tasks.dlq.schema import CLAIMS_COMPONENT, CLAIMS_SCHEMA_VERSION
from idempotent_tasks.keys import storage_key
from idempotent_tasks.records import Status
from tests.integration import worker_app
from tests.integration.databases import (
    fresh_mariadb_database,
    fresh_pg_database,
    set_schema_version,
)
from tests.integration.helpers import (
    app_store_url,
    charge_at_once,
    fresh,
    ledger_events,
    wait_until,
)
from tests.integration.workers import WorkerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["postgresql", "mariadb"])
def sql_store_url(worker_app: Any, request: pytest.FixtureRequest) -> Iterator[str]:
    """A claim store on each database, used by this module's workers and the test process."""
    fresh_database = fresh_pg_database if request.param == "postgresql" else fresh_mariadb_database
    url = fresh_database("it_claims")
    with app_store_url(worker_app.app, url):
        yield url


@pytest.fixture()
def start_worker(it_env: dict[str, str], sql_store_url: str, tmp_path: Path) -> Iterator[Any]:
    started: list[WorkerProcess] = []

    def start(queue: str | None = None, **env: str) -> WorkerProcess:
        worker = WorkerProcess(
            f"sql{len(started)}",
            {**it_env, "IT_STORE_URL": sql_store_url, **env},
            tmp_path,
            extra_args=("-Q", queue) if queue else (),
        )
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def test_duplicates_at_once_on_two_workers_run_once(start_worker: Any) -> None:
    start_worker()
    start_worker()
    order, key = fresh("sql-order"), fresh("key")
    values = charge_at_once(20, order, key)
    assert ledger_events(order, "start") == 1
    assert all(value == values[0] for value in values)
    record = store_for(worker_app.app).get(storage_key(worker_app.charge.name, key))
    assert record is not None and record.status is Status.COMPLETED


def test_worker_killed_mid_task_is_taken_over_after_the_lease(start_worker: Any) -> None:
    env = {"IT_LEASE": "2", "IT_VISIBILITY_TIMEOUT": "3"}
    first = start_worker(**env)
    name, key = fresh("sql-killed"), fresh("key")
    result = worker_app.slow_first.apply_async((name, 30.0), idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 15, "the first run to start")
    first.kill()
    start_worker(**env)
    assert result.get(timeout=60)["run"] == 2
    assert ledger_events(name, "finish") == 1
    record = store_for(worker_app.app).get(storage_key(worker_app.slow_first.name, key))
    assert record is not None
    assert (record.status, record.token) == (Status.COMPLETED, 2)


def test_a_claim_store_at_a_newer_schema_hands_keyed_calls_back_until_it_can_claim(
    start_worker: Any, sql_store_url: str
) -> None:
    # Given a running worker, whose claim store an upgrade then moved to a newer schema (on a
    # queue of its own: a pool process that ran an earlier test's leftover message before the
    # upgrade has checked the schema already, and checks it once)
    store_for(worker_app.app).get("warm")  # this process checked the schema before
    queue = fresh("sql-newer-queue")
    worker = start_worker(queue)
    set_schema_version(sql_store_url, CLAIMS_COMPONENT, CLAIMS_SCHEMA_VERSION + 1)
    try:
        # When a keyed call reaches it
        order, key = fresh("sql-newer"), fresh("key")
        result = worker_app.charge.apply_async((order, 10), idempotency_key=key, queue=queue)
        # Then it neither runs unclaimed nor fails: it is handed back, to be tried again
        wait_until(lambda: "store unavailable, will try again" in worker.log(), 30, "the hand-back")
        assert "newer" in worker.log()
        assert result.state != "FAILURE"
        assert ledger_events(order, "start") == 0
    finally:
        set_schema_version(sql_store_url, CLAIMS_COMPONENT, CLAIMS_SCHEMA_VERSION)
    # And once a worker can claim (here: the schema back), it runs once
    assert result.get(timeout=60)["order_id"] == order
    assert ledger_events(order, "start") == 1
