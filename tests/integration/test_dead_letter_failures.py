"""Dead-letter sweeps racing, and a dead-letter database down at failure time."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from idempotent_tasks import DeadLettered
from idempotent_tasks.dead_letters import SWEEP_TASK
from idempotent_tasks.dlq import DeadLetterQueue, Failure
from idempotent_tasks.dlq.schema import COMPONENT, SCHEMA_VERSION
from tests.integration import worker_app
from tests.integration.databases import (
    dead_letter_database,
    fresh_mariadb_database,
    fresh_pg_database,
    set_pg_database_online,
    set_schema_version,
)
from tests.integration.helpers import fresh, ledger_events, wait_until
from tests.integration.workers import WorkerProcess

app = worker_app.app


def _failure(name: str) -> Failure:
    return Failure(
        failure_id=f"sweep-{name}",
        task_name=worker_app.ledgered.name,
        task_id=fresh("t"),
        idempotency_key=name,
        args=[name],
        kwargs={},
        options={"queue": "celery"},
        error_type="RuntimeError",
        error_message="seeded",
        traceback=None,
        max_retries=3,
    )


@pytest.mark.slow
@pytest.mark.parametrize("database", ["postgresql", "mariadb"])
def test_four_sweeps_at_once_republish_each_row_exactly_once(
    database: str, it_env: dict[str, str], worker_app: Any, tmp_path: Path
) -> None:
    # Given 120 due dead letters
    url = (fresh_pg_database if database == "postgresql" else fresh_mariadb_database)("it_sweeps")
    queue = DeadLetterQueue(url, base_delay=0)
    names = [fresh(f"sweep{index}") for index in range(120)]
    for name in names:
        queue.add(_failure(name))
    # When four sweeps run at once on two workers (two processes each)
    env = {**it_env, "IT_DLQ_URL": url}
    workers = [WorkerProcess(f"sweep{index}", env, tmp_path) for index in range(2)]
    try:
        sweeps = [app.send_task(SWEEP_TASK, kwargs={"batch": 5}) for _ in range(4)]
        counts = [sweep.get(timeout=60) for sweep in sweeps]
        # Then every row was re-published once in all, and each task ran once
        assert sum(counts) == len(names)
        wait_until(lambda: queue.stats()["succeeded"] == len(names), 60, "every re-published task")
        assert all(ledger_events(name, "start") == 1 for name in names)
    finally:
        for worker in workers:
            worker.stop()
        queue.dispose()


@pytest.mark.slow
@pytest.mark.parametrize("expires", [None, 4.0], ids=["no-expiry", "call-expires-meanwhile"])
def test_database_down_at_failure_time_loses_nothing(
    expires: float | None, it_env: dict[str, str], worker_app: Any, tmp_path: Path
) -> None:
    # Given a dead-letter database that is offline when a task fails for good (a call that
    # expires 4 s after it was sent, in one case: the database stays down past that)
    url = dead_letter_database("it_dlq_down")
    worker = WorkerProcess("down", {**it_env, "IT_DLQ_URL": url}, tmp_path)
    try:
        set_pg_database_online("it_dlq_down", False)
        name = fresh("down")
        result = worker_app.fails_forever.apply_async(
            (name,), idempotency_key=fresh("key"), expires=expires
        )
        wait_until(
            lambda: "could not write its dead letter" in worker.log(), 30, "the failed write"
        )
        if expires is not None:
            time.sleep(expires + 1)
        # When the database comes back
        set_pg_database_online("it_dlq_down", True)
        # Then the failure is written once, and the task ends failed (not lost, not retried)
        with pytest.raises(DeadLettered, match="RuntimeError"):
            result.get(timeout=60)
        queue = DeadLetterQueue(url)
        rows = [row for row in queue.items() if row.task_id == result.id]
        queue.dispose()
        assert len(rows) == 1
        assert rows[0].error_message == f"{name} fails every time"
        assert ledger_events(name, "start") == 1
    finally:
        set_pg_database_online("it_dlq_down", True)
        worker.stop()


@pytest.mark.slow
@pytest.mark.parametrize("outage", ["short", "past the retrying timeout"])
def test_a_dead_letter_retry_that_succeeds_while_the_database_is_down_is_marked_later(
    it_env: dict[str, str], worker_app: Any, tmp_path: Path, outage: str
) -> None:
    # Given a dead letter of a call without a key, taken by the sweep and running (in one case
    # on a worker that takes a row retrying for 3 s without a renewal for stuck, and writes an
    # outcome it could not write every 4 s)
    database = "it_dlq_mark_down" if outage == "short" else "it_dlq_outage"
    url = fresh_pg_database(database)
    queue = DeadLetterQueue(url, base_delay=0)
    order = fresh("order")
    seeded = dataclasses.replace(
        _failure(order),
        task_name=worker_app.charge.name,
        idempotency_key=None,
        args=[order, 10],
        kwargs={"sleep": 2.0},
    )
    queue.add(seeded)
    queue.dispose()
    env = {**it_env, "IT_DLQ_URL": url}
    if outage != "short":
        env.update(IT_DLQ_RETRYING_TIMEOUT="3", IT_DLQ_WRITE_RETRY_DELAY="4")
    worker = WorkerProcess("mark-down", env, tmp_path)
    queue = DeadLetterQueue(url)
    try:
        assert app.send_task(SWEEP_TASK).get(timeout=30) == 1
        wait_until(lambda: ledger_events(order, "start") == 1, 30, "the retry's start")
        # When the database is down as the retry succeeds (and stays down past the timeout,
        # a sweep meeting it first as it comes back, before the run's outcome is written)
        set_pg_database_online(database, False)
        wait_until(lambda: "could not mark dead letter" in worker.log(), 30, "the failed mark")
        assert app.AsyncResult(seeded.task_id).get(timeout=30)["order_id"] == order
        if outage != "short":
            time.sleep(4)
        set_pg_database_online(database, True)
        if outage != "short":
            # (the sweep makes the row due again, but does not send it at once)
            assert app.send_task(SWEEP_TASK).get(timeout=30) == 0
        # Then once it is back, the row is marked succeeded (not left retrying, to come back
        # and run the body again), and the caller's result is still the success
        wait_until(lambda: queue.stats()["succeeded"] == 1, 30, "the row marked succeeded")
        assert app.send_task(SWEEP_TASK).get(timeout=30) == 0
        assert app.AsyncResult(seeded.task_id).state == "SUCCESS"
        time.sleep(3)
        assert ledger_events(order, "start") == 1
    finally:
        set_pg_database_online(database, True)
        worker.stop()
        queue.dispose()


def test_a_worker_refuses_to_start_on_a_dead_letter_database_newer_than_its_code(
    it_env: dict[str, str], worker_app: Any, tmp_path: Path
) -> None:
    # Given a dead-letter database an upgrade moved to a newer schema
    url = dead_letter_database("it_dlq_newer")
    set_schema_version(url, COMPONENT, SCHEMA_VERSION + 1)
    # When a worker starts on it, then it refuses, naming both versions
    with pytest.raises(RuntimeError, match="exited") as refused:
        WorkerProcess("newer", {**it_env, "IT_DLQ_URL": url}, tmp_path).stop()
    assert f"schema version {SCHEMA_VERSION + 1}" in str(refused.value)
    assert "refuses to start" in str(refused.value)


def test_a_worker_refuses_to_start_on_a_dead_letter_queue_whose_driver_is_missing(
    it_env: dict[str, str], worker_app: Any, tmp_path: Path
) -> None:
    # Given a dead-letter URL for a database whose driver this machine lacks: no failure could
    # ever be written, each would be handed back again and again
    url = "mssql+pymssql://user@127.0.0.1:1/dead_letters"
    # When a worker starts on it, then it refuses, saying what to install
    with pytest.raises(RuntimeError, match="exited") as refused:
        WorkerProcess("nodriver", {**it_env, "IT_DLQ_URL": url}, tmp_path).stop()
    assert "refuses to start" in str(refused.value)
    assert "no driver for mssql+pymssql" in str(refused.value)
