"""The dead-letter queue: tasks that failed for good, kept and retried on a backoff."""

from __future__ import annotations

from .items import DeadLetter, DeadLetterStatus, Failure
from .queue import DeadLetterQueue

__all__ = ["DeadLetter", "DeadLetterQueue", "DeadLetterStatus", "Failure"]
