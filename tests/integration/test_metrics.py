"""Prometheus metrics after a real run: a Celery worker in this process, claims on Redis, then
the counters."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from prometheus_client import CollectorRegistry

from idempotent_tasks import IdempotentTask
from idempotent_tasks.dlq import DeadLetterQueue, Failure
from idempotent_tasks.prometheus import enable

app = Celery("metrics", broker="memory://", backend="cache+memory://", set_as_current=False)
app.conf.update(
    broker_transport_options={"polling_interval": 0.01},
    broker_connection_retry_on_startup=True,
)
runs: list[int] = []


@app.task(base=IdempotentTask, name="metrics.charge")
def charge(order_id: int) -> int:
    runs.append(order_id)
    return order_id * 10


@app.task(base=IdempotentTask, name="metrics.big", shared=False)
def big() -> str:
    return "x" * 2_000_000


@app.task(base=IdempotentTask, name="metrics.fails", shared=False)
def fails() -> None:
    raise RuntimeError("fails for good")


@app.task(base=IdempotentTask, name="metrics.slow", shared=False)
def slow(order_id: int) -> int:
    time.sleep(1.5)
    return order_id


@app.task(base=IdempotentTask, name="metrics.linked", shared=False)
def linked(order_id: int) -> int:
    return order_id


@app.task(name="metrics.callback", shared=False)
def callback(value: int) -> int:
    return value


@pytest.fixture(scope="module")
def registry(it_env: dict[str, str]) -> Iterator[CollectorRegistry]:
    # Claims on the integration tests' Redis; broker and results in memory (the worker runs
    # in this process, so the counters are read here)
    app.conf.idempotency_store_url = it_env["IT_STORE_URL"]
    registry = CollectorRegistry()
    enable(registry)
    with start_worker(
        app, pool="threads", concurrency=2, perform_ping_check=False, loglevel="WARNING"
    ):
        yield registry


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_claims_and_duplicates_are_counted_after_a_run(registry: CollectorRegistry) -> None:
    # Given one key sent three times: twice at the worker (send_task), once after completion
    first = app.send_task("metrics.charge", (7,), headers={"idempotency_key": "order-7"})
    assert first.get(timeout=10) == 70
    second = app.send_task("metrics.charge", (7,), headers={"idempotency_key": "order-7"})
    assert second.get(timeout=10) == 70
    third = charge.apply_async((7,), idempotency_key="order-7")
    assert third.get(timeout=10) == 70
    # Then the counters say what happened, and the body ran once
    assert runs.count(7) == 1
    task = "metrics.charge"
    assert value(registry, "idempotent_tasks_claims_total", task=task, outcome="acquired") == 1
    assert value(registry, "idempotent_tasks_claims_total", task=task, outcome="completed") == 1
    assert (
        value(registry, "idempotent_tasks_duplicates_suppressed_total", task=task, where="worker")
        == 1
    )
    assert (
        value(registry, "idempotent_tasks_duplicates_suppressed_total", task=task, where="publish")
        == 1
    )


def test_a_duplicate_published_for_the_work_waiting_on_it_is_counted_once_by_the_worker(
    registry: CollectorRegistry,
) -> None:
    # Given a completed key, and a duplicate with a link callback: work waits on its message,
    # so it is published, and the worker answers it from the key's record
    assert linked.apply_async((9,), idempotency_key="order-9").get(timeout=10) == 9
    duplicate = linked.apply_async((9,), idempotency_key="order-9", link=callback.s())
    assert duplicate.get(timeout=10) == 9
    # Then it counts as one duplicate suppressed, at the worker, not at publish too
    task = "metrics.linked"
    counted = {
        where: value(
            registry, "idempotent_tasks_duplicates_suppressed_total", task=task, where=where
        )
        for where in ("publish", "worker")
    }
    assert counted == {"publish": 0, "worker": 1}


def test_a_duplicate_waiting_for_its_owner_is_counted_once(registry: CollectorRegistry) -> None:
    # Given a duplicate that reaches the worker while its owner runs, and waits for it
    owner = app.send_task("metrics.slow", (8,), headers={"idempotency_key": "order-8"})
    time.sleep(0.3)
    duplicate = app.send_task("metrics.slow", (8,), headers={"idempotency_key": "order-8"})
    assert owner.get(timeout=10) == duplicate.get(timeout=10) == 8
    # Then it counts as one duplicate suppressed, however often it looked at the key
    suppressed = value(
        registry,
        "idempotent_tasks_duplicates_suppressed_total",
        task="metrics.slow",
        where="worker",
    )
    assert suppressed == 1


def test_result_not_cached_is_counted(registry: CollectorRegistry) -> None:
    assert len(big.apply_async(idempotency_key="big-1").get(timeout=10)) == 2_000_000
    assert value(registry, "idempotent_tasks_results_not_cached_total", task="metrics.big") == 1


def test_dead_letter_rows_are_counted_by_the_sweep(
    registry: CollectorRegistry, tmp_path: Any
) -> None:
    # Given a dead-letter table with two rows, one of them not retried
    url = f"sqlite:///{tmp_path / 'dlq.sqlite3'}"
    queue = DeadLetterQueue(url, base_delay=3600)
    for index, retries in enumerate((3, 0)):
        queue.add(
            Failure(
                failure_id=f"t{index}:0",
                task_name="metrics.charge",
                task_id=f"t{index}",
                idempotency_key=None,
                args=[],
                kwargs={},
                options={},
                error_type="E",
                error_message="m",
                traceback=None,
                max_retries=retries,
            )
        )
    queue.dispose()
    app.conf.idempotency_dlq_url = url
    app.__dict__.pop("_idempotent_tasks_dlq", None)
    # And a task that fails for good, so its row is written by the worker
    with pytest.raises(RuntimeError):
        fails.apply_async(idempotency_key="fails-1").get(timeout=10)
    # When the sweep runs (nothing is due yet)
    assert app.send_task("idempotent_tasks.retry_dead_letters").get(timeout=20) == 0
    # Then the gauge shows the rows by status, and the worker's write was counted
    assert value(registry, "idempotent_tasks_dead_letters", status="pending") == 2
    assert value(registry, "idempotent_tasks_dead_letters", status="permanent_failure") == 1
    assert (
        value(
            registry,
            "idempotent_tasks_dead_letters_written_total",
            task="metrics.fails",
            status="pending",
        )
        == 1
    )
    cached = app.__dict__.pop("_idempotent_tasks_dlq", None)
    if cached is not None:
        cached[1].dispose()


def test_importing_the_package_does_not_import_prometheus_client() -> None:
    check = "import idempotent_tasks, sys; assert 'prometheus_client' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], check=True, timeout=60)
