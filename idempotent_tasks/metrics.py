"""In-process counters of what idempotent_tasks did, fed by its signals.

``snapshot()`` gives them as a dict; they count per process (each prefork child its own).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from . import signals
from .fork_safe import ForkSafeLock

_lock = ForkSafeLock()
_counts: Counter[str] = Counter()


def _count(name: str) -> None:
    with _lock:
        _counts[name] += 1


def snapshot() -> dict[str, int]:
    """A copy of every counter: ``claims.<outcome>``, ``claims.takeover``, ``duplicates.<where>``,
    ``stale_completes_refused``, ``leases_lost``, ``results_not_cached``."""
    with _lock:
        return dict(_counts)


def reset() -> None:
    """Zero every counter (for tests)."""
    with _lock:
        _counts.clear()


def _on_claim(*, outcome: Any, takeover: bool, **_: Any) -> None:
    _count(f"claims.{outcome.value}")
    if takeover:
        _count("claims.takeover")


def _on_duplicate(*, where: str, **_: Any) -> None:
    _count(f"duplicates.{where}")


signals.claim_finished.connect(_on_claim)
signals.duplicate_suppressed.connect(_on_duplicate)
signals.stale_complete_refused.connect(lambda **_: _count("stale_completes_refused"))
signals.lease_lost.connect(lambda **_: _count("leases_lost"))
signals.result_not_cached.connect(lambda **_: _count("results_not_cached"))
