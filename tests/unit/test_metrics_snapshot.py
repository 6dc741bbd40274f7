"""The in-process counters (``idempotent_tasks.metrics``), live once the package is imported."""

from __future__ import annotations

import subprocess
import sys


def test_the_counters_count_without_being_imported_by_hand() -> None:
    # A fresh interpreter that imports only the package, as an app does, then runs a keyed call
    program = """
from celery import Celery
from idempotent_tasks import IdempotentTask
from idempotent_tasks.task import KEY_HEADER

app = Celery("counted", set_as_current=False, broker="memory://")
app.conf.update(idempotency_store_url="memory://", result_backend="cache+memory://")

@app.task(base=IdempotentTask)
def charge(order):
    return order

for _ in range(2):
    charge.push_request(id="t1", args=("o",), kwargs={}, headers={KEY_HEADER: "k"},
                        called_directly=False, delivery_info={}, retries=0)
    try:
        charge("o")
    finally:
        charge.pop_request()

import sys
print(sorted(sys.modules["idempotent_tasks.metrics"].snapshot().items()))
"""
    output = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True
    ).stdout
    assert output.strip() == (
        "[('claims.acquired', 1), ('claims.completed', 1), ('duplicates.worker', 1)]"
    )
