"""The app ``celery -A tests.acceptance.cli_app idempotency ...`` runs against in the CLI tests.

Its stores come from ``CLI_STORE_URL`` and ``CLI_DLQ_URL``, its task modules from
``CLI_IMPORTS``, read at import (reload it after changing them).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from idempotent_tasks import IdempotentTask

STORE_URL = os.environ.get("CLI_STORE_URL", "redis://127.0.0.1:6379/15")
DLQ_URL = os.environ.get(
    "CLI_DLQ_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/cli_dead_letters"
)
KEY_PREFIX = "cli"

app = Celery("cli_app", set_as_current=False)
app.conf.update(
    broker_url="memory://",
    idempotency_store_url=STORE_URL,
    idempotency_dlq_url=DLQ_URL,
    idempotency_key_prefix=KEY_PREFIX,
    # Task modules a worker would import (comma-separated), as ``imports`` names them.
    imports=tuple(filter(None, os.environ.get("CLI_IMPORTS", "").split(","))),
)


# shared=False: a shared task would join every app made later, each reload adding one more.
@app.task(base=IdempotentTask, name="shop.charge", shared=False)  # type: ignore[untyped-decorator]
def charge(order_id: int) -> dict[str, Any]:
    """A registered idempotent task whose cached results the CLI decodes with its codec."""
    return {"charge_id": f"ch_{order_id}", "order_id": order_id}
