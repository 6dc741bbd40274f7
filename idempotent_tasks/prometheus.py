"""Prometheus metrics fed by idempotent_tasks' signals (the ``prometheus`` extra).

Workers enable them by themselves when ``prometheus_client`` is installed (``worker_init``);
any other process (a producer, a web app) calls :func:`enable`. Counters cost one signal
dispatch and an increment per event; the dead-letter gauge is refreshed once per sweep, never
per task. With prefork workers, use ``prometheus_client``'s multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``) to export what every pool process counted.
"""

from __future__ import annotations

import threading
from typing import Any

from . import signals

_lock = threading.Lock()
_enabled: dict[int, Metrics] = {}


class Metrics:
    """The metrics of one registry, and the signal receivers that feed them."""

    def __init__(self, registry: Any) -> None:
        try:
            from prometheus_client import Counter, Gauge
        except ImportError as exc:  # pragma: no cover - the extra is installed in tests
            raise ImportError(
                "metrics need prometheus_client: pip install 'idempotent-tasks[prometheus]'"
            ) from exc
        prefix = "idempotent_tasks"
        self.claims = Counter(
            f"{prefix}_claims",
            "Worker claims by outcome.",
            ["task", "outcome"],
            registry=registry,
        )
        self.takeovers = Counter(
            f"{prefix}_takeovers",
            "Claims taken over from an expired or retried owner.",
            ["task"],
            registry=registry,
        )
        self.duplicates = Counter(
            f"{prefix}_duplicates_suppressed",
            "Duplicates not run, at publish or at the worker.",
            ["task", "where"],
            registry=registry,
        )
        self.stale_completes = Counter(
            f"{prefix}_stale_completes_refused",
            "Completions refused because the claim was taken over.",
            ["task"],
            registry=registry,
        )
        self.leases_lost = Counter(
            f"{prefix}_leases_lost",
            "Running bodies whose claim was taken over.",
            ["task"],
            registry=registry,
        )
        self.not_cached = Counter(
            f"{prefix}_results_not_cached",
            "Results too big or not serializable.",
            ["task"],
            registry=registry,
        )
        self.dead_letters_written = Counter(
            f"{prefix}_dead_letters_written",
            "Final failures written to the dead-letter table.",
            ["task", "status"],
            registry=registry,
        )
        self.dead_letters = Gauge(
            f"{prefix}_dead_letters",
            "Dead-letter rows by status (as of the last sweep).",
            ["status"],
            registry=registry,
        )
        signals.claim_finished.connect(self._on_claim)
        signals.duplicate_suppressed.connect(self._on_duplicate)
        signals.stale_complete_refused.connect(self._on_stale)
        signals.lease_lost.connect(self._on_lease_lost)
        signals.result_not_cached.connect(self._on_not_cached)
        signals.dead_letter_written.connect(self._on_dead_letter)
        signals.dead_letters_counted.connect(self._on_counted)

    def _on_claim(self, *, task_name: str, outcome: Any, takeover: bool, **_: Any) -> None:
        self.claims.labels(task_name, outcome.value).inc()
        if takeover:
            self.takeovers.labels(task_name).inc()

    def _on_duplicate(self, *, task_name: str, where: str, **_: Any) -> None:
        self.duplicates.labels(task_name, where).inc()

    def _on_stale(self, *, task_name: str, **_: Any) -> None:
        self.stale_completes.labels(task_name).inc()

    def _on_lease_lost(self, *, task_name: str, **_: Any) -> None:
        self.leases_lost.labels(task_name).inc()

    def _on_not_cached(self, *, task_name: str, **_: Any) -> None:
        self.not_cached.labels(task_name).inc()

    def _on_dead_letter(self, *, task_name: str, status: str, **_: Any) -> None:
        self.dead_letters_written.labels(task_name, status).inc()

    def _on_counted(self, *, counts: dict[str, int], **_: Any) -> None:
        for status, rows in counts.items():
            if status != "total":
                self.dead_letters.labels(status).set(rows)


def enable(registry: Any = None) -> Metrics:
    """Create the metrics in ``registry`` (default: prometheus_client's) and start feeding them.

    Calling it again with the same registry returns the same metrics.

    Raises:
        ImportError: prometheus_client is not installed (names the extra that brings it).
    """
    if registry is None:
        try:
            from prometheus_client import REGISTRY
        except ImportError as exc:
            raise ImportError(
                "metrics need prometheus_client: pip install 'idempotent-tasks[prometheus]'"
            ) from exc
        registry = REGISTRY
    with _lock:
        if id(registry) not in _enabled:
            _enabled[id(registry)] = Metrics(registry)
        return _enabled[id(registry)]
