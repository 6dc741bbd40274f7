"""Charge an order once with RQ, however often it is enqueued (Redis, redis-py, rq).

Run a worker, then this file, both from the repository root::

    rq worker --path examples --queue-class idempotent_tasks.rq.IdempotentQueue \\
              --job-class idempotent_tasks.rq.IdempotentJob default
    python examples/rq_example.py
"""

from __future__ import annotations

import uuid

from idempotent_tasks.rq import idempotent


@idempotent(key="order:{order_id}", ttl=24 * 3600)
def charge(order_id: int, amount: int) -> dict[str, object]:
    """Charge ``amount`` cents for ``order_id``: runs to success at most once per order."""
    return {"charge_id": f"ch_{uuid.uuid4().hex[:12]}", "order_id": order_id, "amount": amount}


if __name__ == "__main__":
    import time

    from redis import Redis
    from rq import Retry

    # RQ refuses functions of __main__: enqueue the one the worker imports (--path examples).
    from rq_example import charge as importable_charge

    from idempotent_tasks.rq import IdempotentQueue

    queue = IdempotentQueue("default", connection=Redis())
    first = queue.enqueue(importable_charge, 42, 990, retry=Retry(max=3))  # key "order:42"
    again = queue.enqueue(importable_charge, 42, 990, idempotency_key="order:42")  # same key
    for job in (first, again):
        while job.get_status() not in ("finished", "failed"):
            time.sleep(0.1)
    print(first.return_value() == again.return_value())  # True: one charge, one value
