"""The docker-compose example app, run as docker-compose.yml runs it: a real ``celery worker``
process on examples.compose_app against real Redis and PostgreSQL, and a caller process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from idempotent_tasks.dlq import DeadLetterQueue
from tests.integration.workers import WorkerProcess
from tests.services import require

ROOT = Path(__file__).resolve().parents[2]
DATABASE = "compose_shop"
DATABASE_URL = f"postgresql+psycopg://postgres@127.0.0.1:5432/{DATABASE}"

# Publishes one order three ways: a first charge, the same charge again through apply_async
# (answered at publish from the cached result), and two raw messages that skip the publish-side
# look, as a broker redelivery would (answered by the worker's claim).
DUPLICATES = """
import json, sys
from examples.compose_app import app, charge
order = int(sys.argv[1])
first = charge.delay(order, 990)
value = first.get(timeout=30)
again = charge.apply_async((order, 990))
redelivered = [app.send_task("shop.charge", (order, 990)) for _ in range(2)]
print(json.dumps({
    "value": value,
    "again_id": again.id,
    "first_id": first.id,
    "again": again.get(timeout=30),
    "redelivered": [result.get(timeout=30) for result in redelivered],
}))
"""

# Publishes one order whose every gateway call times out, and waits for its final failure.
FAILING = """
import sys
from examples.compose_app import GatewayTimeout, charge
try:
    charge.delay(int(sys.argv[1]), 990).get(timeout=60)
except GatewayTimeout:
    print("timed out for good")
"""


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    """A fresh PostgreSQL database for the app's dead-letter table."""
    require("PostgreSQL")
    admin = sa.create_engine(
        "postgresql+psycopg://postgres@127.0.0.1:5432/postgres", isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as connection:
        connection.execute(sa.text(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)"))
        connection.execute(sa.text(f"CREATE DATABASE {DATABASE}"))
    admin.dispose()
    yield DATABASE_URL


def app_env(redis_url: str, database_url: str, timeout_rate: str) -> dict[str, str]:
    """The environment docker-compose.yml gives the app, pointed at the local services."""
    return {
        "REDIS_URL": redis_url,
        "DATABASE_URL": database_url,
        "GATEWAY_TIMEOUT_RATE": timeout_rate,
    }


def call(script: str, env: dict[str, str], order: int) -> str:
    """Run ``script`` as a caller process; its standard output."""
    run = subprocess.run(
        [sys.executable, "-c", script, str(order)],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


def gateway_calls(worker: WorkerProcess, order: int) -> int:
    """How many times the worker's gateway stand-in was called for ``order`` (its log lines)."""
    return worker.log().count(f"]: charging order {order}\n")


def new_order() -> int:
    """An order id no earlier run has used (the Redis claims outlive a test run)."""
    return uuid.uuid4().int % 10**9


def test_a_duplicate_charge_calls_the_gateway_once(
    redis_url: str, database: str, tmp_path: Path
) -> None:
    order = new_order()
    env = app_env(redis_url, database, timeout_rate="0")
    worker = WorkerProcess(
        "compose", env, tmp_path, concurrency=1, pool="solo", app_module="examples.compose_app"
    )
    try:
        # When the same order is charged four times (one publish-side, two worker-side duplicates)
        seen = json.loads(call(DUPLICATES, env, order))
    finally:
        worker.stop()

    # Then every caller gets the first charge, and the gateway was called once
    value = seen["value"]
    assert value["order_id"] == order
    assert value["charge_id"].startswith("ch_")
    assert seen["again_id"] == seen["first_id"], "the duplicate was published, not answered"
    assert seen["again"] == value
    assert seen["redelivered"] == [value, value]
    assert gateway_calls(worker, order) == 1, worker.log()


def test_a_charge_that_keeps_timing_out_is_dead_lettered_in_postgresql(
    redis_url: str, database: str, tmp_path: Path
) -> None:
    order = new_order()
    env = app_env(redis_url, database, timeout_rate="1")
    worker = WorkerProcess(
        "compose-down", env, tmp_path, concurrency=1, pool="solo", app_module="examples.compose_app"
    )
    try:
        # When the gateway times out on every call (first try and max_retries=3 retries)
        output = call(FAILING, env, order)
    finally:
        worker.stop()

    # Then the charge failed for good after four gateway calls, and waits in the dead-letter
    # table of PostgreSQL for the sweep that beat runs
    assert output.strip() == "timed out for good"
    assert gateway_calls(worker, order) == 4, worker.log()
    queue = DeadLetterQueue(database)
    try:
        items = [item for item in queue.items(task_name="shop.charge") if item.args[0] == order]
    finally:
        queue.dispose()
    assert len(items) == 1
    assert items[0].status.value == "pending"
    assert items[0].error_type.endswith("GatewayTimeout")
    assert items[0].idempotency_key is not None
