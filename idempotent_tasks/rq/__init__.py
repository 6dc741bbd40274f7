"""The same guarantees for RQ jobs: ``IdempotentQueue`` and ``IdempotentJob``.

Producer::

    from redis import Redis
    from rq import Retry
    from idempotent_tasks.rq import IdempotentQueue, idempotent

    @idempotent(ttl=3600)          # optional per-function options
    def charge(order_id, amount): ...

    q = IdempotentQueue("default", connection=Redis())
    job = q.enqueue(charge, 42, 990, idempotency_key="order-42", retry=Retry(max=3))

Workers::

    rq worker --queue-class idempotent_tasks.rq.IdempotentQueue \\
              --job-class idempotent_tasks.rq.IdempotentJob default

Dead letters: run :func:`retry_dead_letters` (or ``idempotent-tasks rq retry-dead-letters``)
periodically; see :mod:`idempotent_tasks.rq.sweep`.
"""

from __future__ import annotations

from .job import IdempotentJob
from .options import IdempotencyOptions, idempotent
from .queue import CachedResultJob, IdempotentQueue
from .sweep import retry_dead_letters, retry_dead_letters_job

__all__ = [
    "CachedResultJob",
    "IdempotencyOptions",
    "IdempotentJob",
    "IdempotentQueue",
    "idempotent",
    "retry_dead_letters",
    "retry_dead_letters_job",
]
