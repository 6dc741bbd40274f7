"""IdempotentTask on RabbitMQ with the rpc:// result backend, with a real worker.

rpc:// sends a task's result to the reply queue of the thread that published it, and to no
one else: a duplicate call cannot be handed another call's ``AsyncResult``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.result import EagerResult

from tests.integration.helpers import fresh, ledger_events, wait_until
from tests.integration.workers import WorkerProcess
from tests.services import require

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def amqp(
    it_env: dict[str, str], worker_app: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """tests.integration.amqp_app, its queue emptied, served by one prefork worker."""
    require("RabbitMQ")
    from tests.integration import amqp_app

    amqp_app.app.control.purge()  # calls an earlier run left behind
    worker = WorkerProcess(
        "amqp",
        it_env,
        tmp_path_factory.mktemp("amqp"),
        app_module="tests.integration.amqp_app",
    )
    try:
        yield amqp_app
    finally:
        worker.stop()


@pytest.mark.parametrize("task_name", ["slow_charge", "slow_charge_or_skip"])
def test_a_duplicate_sent_from_another_thread_gets_the_owners_value(
    amqp: Any, task_name: str
) -> None:
    task = getattr(amqp, task_name)
    order, key = fresh("rpc"), fresh("key")
    # Given a keyed call running on the worker, published from one thread
    owner = task.apply_async((order, 1.5), idempotency_key=key)
    wait_until(lambda: ledger_events(order, "start") == 1, 20, "the owner to start")
    # When a duplicate is published from another thread (its own rpc reply queue), while the
    # owner runs
    got: list[Any] = []
    failed: list[BaseException] = []

    def duplicate() -> None:
        try:
            got.append(task.apply_async((order, 1.5), idempotency_key=key).get(timeout=30))
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=duplicate)
    thread.start()
    # (one thread waits on rpc at a time: Celery's rpc backend is not made for two at once)
    thread.join(timeout=40)
    value = owner.get(timeout=30)
    # Then both callers get the owner's value, and the body ran once
    assert failed == []
    assert got == [value]
    assert value["order_id"] == order
    assert ledger_events(order, "start") == 1
    # And a call once it completed is answered from the cache, publishing nothing
    later = task.apply_async((order, 1.5), idempotency_key=key)
    assert isinstance(later, EagerResult) and later.get() == value


def test_a_keyed_call_is_answered_over_rabbitmq(amqp: Any, tmp_path: Path) -> None:
    # A keyed call end to end over RabbitMQ: published, claimed, answered
    order = fresh("amqp")
    assert (
        amqp.slow_charge.apply_async((order, 0), idempotency_key=order).get(timeout=30)["order_id"]
        == order
    )


def test_a_call_rabbitmq_dropped_as_expired_frees_its_key_for_the_next_call(amqp: Any) -> None:
    # Given a keyed call sent to a queue no worker serves, expiring after 2 s: RabbitMQ drops
    # it then, unseen by any worker (so no revoke frees its key)
    order, key = fresh("expired"), fresh("key")
    first = amqp.slow_charge.apply_async(
        (order, 0), idempotency_key=key, expires=2, queue=f"{amqp.QUEUE}-idle"
    )
    time.sleep(2.5)
    # When the key is called again, on the served queue
    second = amqp.slow_charge.apply_async((order, 0), idempotency_key=key)
    # Then this call runs (it is not handed the dropped call's result, which never comes)
    assert second.id != first.id
    assert second.get(timeout=30) == {"order_id": order, "task_id": second.id}
    assert ledger_events(order, "start") == 1
