"""When a dead letter is tried again: exponential backoff with proportional jitter."""

from __future__ import annotations

import random
from datetime import datetime, timedelta

#: Jitter is uniform in ``[0, JITTER_FRACTION * delay]``.
JITTER_FRACTION = 0.25


def retry_delay(retry_count: int, base_delay: float, rng: random.Random | None = None) -> float:
    """Seconds until the next try: ``base * 2**retry_count`` plus ``U(0, 0.25 * that)``."""
    delay = base_delay * 2.0**retry_count
    jitter: float = (rng or random).uniform(0, JITTER_FRACTION * delay)
    return delay + jitter


def next_retry_at(
    now: datetime, retry_count: int, base_delay: float, rng: random.Random | None = None
) -> datetime:
    """The moment of the next try of an item that has been retried ``retry_count`` times."""
    return now + timedelta(seconds=retry_delay(retry_count, base_delay, rng))
