"""A Celery app on RabbitMQ with the ``rpc://`` result backend, Celery's most common set-up
besides Redis, for the integration tests of ``IdempotentTask`` on it.

Its store and dead-letter table are those of :mod:`tests.integration.worker_app` (the same
environment), under a key prefix of its own; bodies write to the same ledger.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from idempotent_tasks import IdempotentTask
from tests.integration.worker_app import note

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
#: The queue of this app's calls (purged by the tests before they start a worker).
QUEUE = "it-amqp"

app = Celery("it-amqp", broker=os.environ.get("IT_AMQP_URL", AMQP_URL), backend="rpc://")
app.conf.update(
    idempotency_store_url=os.environ.get("IT_STORE_URL", "redis://127.0.0.1:6379/11"),
    idempotency_key_prefix="it-amqp",
    idempotency_dlq_url=os.environ.get(
        "IT_DLQ_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/it_dead_letters"
    ),
    task_default_queue=QUEUE,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)


@app.task(base=IdempotentTask, bind=True)
def slow_charge(self: Any, order_id: str, seconds: float) -> dict[str, Any]:
    """Records a charge that takes ``seconds``."""
    note("start", order_id)
    time.sleep(seconds)
    note("finish", order_id)
    return {"order_id": order_id, "task_id": self.request.id}


@app.task(base=IdempotentTask, bind=True, on_duplicate="skip")
def slow_charge_or_skip(self: Any, order_id: str, seconds: float) -> dict[str, Any]:
    """:func:`slow_charge` whose duplicates are dropped while it runs."""
    return slow_charge.run(order_id, seconds)


@app.task(base=IdempotentTask)
def fails_with_a_large_payload(order_id: str, payload: str) -> None:
    """Fails for good, its payload and error message large enough that a dead letter carried
    whole in a message's headers would not fit RabbitMQ's frame (128 KiB)."""
    note("start", order_id)
    raise RuntimeError(f"{order_id} declined: {payload[:30_000]}")
