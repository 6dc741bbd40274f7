"""When a dead letter is tried again: exponential backoff with proportional jitter."""

from __future__ import annotations

import random
from datetime import datetime, timedelta

#: Jitter is uniform in ``[0, JITTER_FRACTION * delay]``.
JITTER_FRACTION = 0.25
#: Longest delay before a try (about a century): beyond it, ``2**retry_count`` would overflow
#: datetime arithmetic (and then floats), and a row would never reach its limit.
MAX_DELAY = 100 * 365 * 86400.0


def retry_delay(retry_count: int, base_delay: float, rng: random.Random | None = None) -> float:
    """Seconds until the next try: ``base * 2**retry_count`` plus ``U(0, 0.25 * that)``, at
    most :data:`MAX_DELAY` in all."""
    delay = min(base_delay * 2.0 ** min(retry_count, 1000), MAX_DELAY / (1 + JITTER_FRACTION))
    jitter: float = (rng or random).uniform(0, JITTER_FRACTION * delay)
    return delay + jitter


def next_retry_at(
    now: datetime, retry_count: int, base_delay: float, rng: random.Random | None = None
) -> datetime:
    """The moment of the next try of an item that has been retried ``retry_count`` times."""
    return now + timedelta(seconds=retry_delay(retry_count, base_delay, rng))
