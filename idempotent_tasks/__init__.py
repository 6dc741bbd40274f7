"""Effectively-once Celery tasks: ``base=IdempotentTask`` and ``idempotency_key=``."""

from __future__ import annotations

from . import (
    metrics,  # noqa: F401  (its in-process counters listen from the first call)
    sent_by_name,  # noqa: F401  (keys of calls sent by name go into the headers)
)
from .dead_letters import retry_dead_letters
from .errors import (
    CorruptRecord,
    DeadLettered,
    IdempotencyConflict,
    IdempotencyError,
    IdempotencyKeyMismatch,
    SchemaVersionError,
    StoreUnavailable,
)
from .task import IdempotentTask

__version__ = "0.1.0"

__all__ = [
    "CorruptRecord",
    "DeadLettered",
    "IdempotencyConflict",
    "IdempotencyError",
    "IdempotencyKeyMismatch",
    "IdempotentTask",
    "SchemaVersionError",
    "StoreUnavailable",
    "__version__",
    "retry_dead_letters",
]
