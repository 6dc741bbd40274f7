"""IdempotentTask on RabbitMQ with the rpc:// result backend, with a real worker.

rpc:// sends a task's result to the reply queue of the caller that published it, and to no
one else: a duplicate call cannot be handed another call's ``AsyncResult``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.result import EagerResult

from idempotent_tasks.dlq import DeadLetterQueue
from tests.integration.databases import dead_letter_database, set_pg_database_online
from tests.integration.helpers import fresh, ledger_events, wait_until
from tests.integration.workers import ROOT, WorkerProcess
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


#: A caller in a process of its own: publishes a duplicate, prints how it was answered.
DUPLICATE_CALLER = """
import json, sys
from tests.integration import amqp_app
task = getattr(amqp_app, sys.argv[1])
result = task.apply_async((sys.argv[2], 4.0), idempotency_key=sys.argv[3])
print(json.dumps({"kind": type(result).__name__, "value": result.get(timeout=30)}))
"""


@pytest.mark.parametrize("task_name", ["slow_charge", "slow_charge_or_skip"])
def test_a_duplicate_from_another_caller_gets_the_owners_value(amqp: Any, task_name: str) -> None:
    task = getattr(amqp, task_name)
    order, key = fresh("rpc"), fresh("key")
    # Given a keyed call running on the worker for 4 s
    owner = task.apply_async((order, 4.0), idempotency_key=key)
    wait_until(lambda: ledger_events(order, "start") == 1, 20, "the owner to start")
    # When another caller (a process of its own: its own rpc reply queue) calls the key while
    # the owner runs
    caller = subprocess.run(
        [sys.executable, "-c", DUPLICATE_CALLER, task_name, order, key],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert caller.returncode == 0, caller.stderr
    answered = json.loads(caller.stdout.strip().splitlines()[-1])
    value = owner.get(timeout=30)
    # Then it was answered through its own message (not handed the owner's result, which rpc
    # sends to the owner's caller alone) with the owner's value, and the body ran once
    assert answered == {"kind": "AsyncResult", "value": value}
    assert value["order_id"] == order
    assert ledger_events(order, "start") == 1
    # And a call once it completed is answered from the cache, publishing nothing
    later = task.apply_async((order, 4.0), idempotency_key=key)
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


def test_a_large_failure_whose_dead_letter_waits_for_its_database_is_not_lost(
    amqp: Any, it_env: dict[str, str], tmp_path: Path
) -> None:
    # Given a worker on a queue of its own whose dead-letter database is offline
    url = dead_letter_database("it_amqp_dlq_down")
    queue_name = f"{amqp.QUEUE}-dlq-down"
    worker = WorkerProcess(
        "amqp-dlq-down",
        {**it_env, "IT_DLQ_URL": url},
        tmp_path,
        app_module="tests.integration.amqp_app",
        extra_args=("-Q", queue_name),
    )
    name, payload = fresh("large-failure"), "p" * 120_000
    try:
        set_pg_database_online("it_amqp_dlq_down", False)
        # When a call with a large payload fails for good (its error message large too, and
        # a callback of its own with a large argument)
        callback = amqp.slow_charge.si("c" * 140_000, 0.0)
        amqp.fails_with_a_large_payload.apply_async(
            (name, payload), idempotency_key=fresh("key"), queue=queue_name, link=callback
        )
        wait_until(
            lambda: worker.log().count("could not write its dead letter") >= 2,
            30,
            "the message that writes it later to come back",
        )
        # And the database comes back
        set_pg_database_online("it_amqp_dlq_down", True)
        # Then the failure is written once, with its whole payload and its callback (the
        # message that writes it later carried them in its headers, over RabbitMQ's frame,
        # and was dropped before)
        dead_letters = DeadLetterQueue(url)
        try:
            rows = wait_until(
                lambda: [row for row in dead_letters.items() if row.args[:1] == [name]],
                30,
                "the dead letter",
            )
        finally:
            dead_letters.dispose()
        assert len(rows) == 1 and rows[0].args == [name, payload]
        assert "c" * 140_000 in json.dumps(rows[0].options["link"])
        assert rows[0].error_message.startswith(f"{name} declined: ppp")
        assert ledger_events(name, "start") == 1
    finally:
        set_pg_database_online("it_amqp_dlq_down", True)
        worker.stop()
