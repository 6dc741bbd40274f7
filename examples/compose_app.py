"""The app docker-compose.yml runs: charging orders through a flaky payment gateway.

Configured from the environment: ``REDIS_URL`` (broker, results and claims) and
``DATABASE_URL`` (the dead-letter table). Run it with ``docker compose up``, or locally::

    celery -A examples.compose_app worker -l info
    celery -A examples.compose_app beat -l info
"""

from __future__ import annotations

import os
import random
import uuid

from celery import Celery
from celery.utils.log import get_task_logger

from idempotent_tasks import IdempotentTask

logger = get_task_logger(__name__)

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/shop")

app = Celery("shop", broker=f"{REDIS_URL}/0", backend=f"{REDIS_URL}/1")
app.conf.update(
    idempotency_store_url=f"{REDIS_URL}/2",
    idempotency_dlq_url=DATABASE_URL,
    broker_connection_retry_on_startup=True,
)

#: Share of gateway calls that time out (the gateway is flaky, as they are).
GATEWAY_TIMEOUT_RATE = float(os.environ.get("GATEWAY_TIMEOUT_RATE", "0.2"))


class GatewayTimeout(TimeoutError):
    """The payment gateway did not answer in time."""


def call_gateway(order_id: int, amount: int, idempotency_key: str) -> str:
    """A stand-in payment gateway: sometimes times out, else returns a charge id."""
    logger.info("charging order %s", order_id)
    if random.random() < GATEWAY_TIMEOUT_RATE:
        raise GatewayTimeout(f"gateway timed out charging order {order_id}")
    return f"ch_{uuid.uuid5(uuid.NAMESPACE_URL, idempotency_key).hex[:12]}"


@app.task(
    name="shop.charge",
    base=IdempotentTask,
    bind=True,
    idempotency_key="order:{order_id}",
    autoretry_for=(GatewayTimeout,),
    max_retries=3,
    default_retry_delay=1,
)
def charge(self: IdempotentTask, order_id: int, amount: int) -> dict[str, object]:
    """Charge ``amount`` cents for ``order_id`` once, whatever the gateway and the broker do.

    The gateway gets the key too, so even a crash between its charge and our completion write
    cannot charge twice.
    """
    charge_id = call_gateway(order_id, amount, idempotency_key=f"order:{order_id}")
    return {"order_id": order_id, "amount": amount, "charge_id": charge_id}
