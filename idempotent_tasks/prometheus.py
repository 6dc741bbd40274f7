"""Prometheus metrics fed by idempotent_tasks' signals (the ``prometheus`` extra).

Every process enables them by itself when ``prometheus_client`` is installed: a worker at
``worker_init``, any process when it first builds an app's claim store (a producer's first
keyed publish, a pool process's first claim, an eager call). :func:`enable` adds them to
another registry. ``prometheus_client`` is imported only by :func:`enable`, never by
``import idempotent_tasks``.

Cost: a counter is one signal dispatch and one increment per event. The dead-letter gauge is
never a query per task: the sweep (``retry_dead_letters``, every
``idempotency_dlq_poll_interval`` seconds) counts the rows once per run and sends
``dead_letters_counted``, which sets the gauge; a process that runs no sweep (an exporter beside
the workers) calls :func:`update_dead_letter_gauge` on its own schedule.

Prefork workers count in each pool process. Export them all with ``prometheus_client``'s
multiprocess mode: set ``PROMETHEUS_MULTIPROC_DIR`` to an empty directory before the worker
starts, and serve a registry holding a ``MultiProcessCollector``. The gauge's
``multiprocess_mode`` is ``mostrecent``: whichever process swept last is right.
"""

from __future__ import annotations

import logging
from typing import Any

from . import signals
from .fork_safe import ForkSafeLock

PREFIX = "idempotent_tasks"
INSTALL_HINT = "metrics need prometheus_client: pip install 'idempotent-tasks[prometheus]'"

logger = logging.getLogger(__name__)
_lock = ForkSafeLock()
_enabled: dict[int, Metrics] = {}
#: Whether :func:`enable_if_installed` ran in this process (or the one it was forked from).
_auto_enable_tried = False


def _prometheus_client() -> Any:
    """The ``prometheus_client`` module, or an ImportError naming the extra that brings it."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return prometheus_client


class Metrics:
    """The metrics of one registry, and the signal receivers that feed them.

    Metric names (counters get Prometheus' ``_total`` suffix):
    ``idempotent_tasks_claims_total{task,outcome}``, ``..._takeovers_total{task}``,
    ``..._duplicates_suppressed_total{task,where}`` (``where`` is ``publish`` or ``worker``),
    ``..._stale_completes_refused_total{task}``, ``..._leases_lost_total{task}``,
    ``..._results_not_cached_total{task}``, ``..._dead_letters_written_total{task,status}``,
    ``..._lost_messages_republished_total{task}`` and the gauge
    ``idempotent_tasks_dead_letters{status}``.
    """

    def __init__(self, registry: Any) -> None:
        client = _prometheus_client()
        #: Held so that the registry outlives this entry of ``_enabled`` (keyed by its id).
        self.registry = registry
        try:
            self._make_metrics(client.Counter, client.Gauge, registry)
        except Exception:
            # A name the registry holds already: none of ours stays half-registered, so that
            # the registry is as it was and a later enable() can succeed.
            for made in vars(self).values():
                if isinstance(made, (client.Counter, client.Gauge)):
                    registry.unregister(made)
            raise
        self._receivers = (
            (signals.claim_finished, self._on_claim),
            (signals.duplicate_suppressed, self._on_duplicate),
            (signals.stale_complete_refused, self._on_stale),
            (signals.lease_lost, self._on_lease_lost),
            (signals.result_not_cached, self._on_not_cached),
            (signals.dead_letter_written, self._on_dead_letter),
            (signals.dead_letters_counted, self._on_counted),
            (signals.lost_message_republished, self._on_lost_republished),
        )

    def _make_metrics(self, counter: Any, gauge: Any, registry: Any) -> None:
        self.claims = counter(
            f"{PREFIX}_claims", "Worker claims by outcome.", ["task", "outcome"], registry=registry
        )
        self.takeovers = counter(
            f"{PREFIX}_takeovers",
            "Claims taken over from an expired or retried owner.",
            ["task"],
            registry=registry,
        )
        self.duplicates = counter(
            f"{PREFIX}_duplicates_suppressed",
            "Duplicates not run, at publish or at the worker.",
            ["task", "where"],
            registry=registry,
        )
        self.stale_completes = counter(
            f"{PREFIX}_stale_completes_refused",
            "Completions refused because the claim was taken over.",
            ["task"],
            registry=registry,
        )
        self.leases_lost = counter(
            f"{PREFIX}_leases_lost",
            "Running bodies whose claim was taken over.",
            ["task"],
            registry=registry,
        )
        self.not_cached = counter(
            f"{PREFIX}_results_not_cached",
            "Results too big or not serializable.",
            ["task"],
            registry=registry,
        )
        self.dead_letters_written = counter(
            f"{PREFIX}_dead_letters_written",
            "Final failures written to the dead-letter table.",
            ["task", "status"],
            registry=registry,
        )
        self.lost_republished = counter(
            f"{PREFIX}_lost_messages_republished",
            "Queued messages no worker claimed in time, published again.",
            ["task"],
            registry=registry,
        )
        self.dead_letters = gauge(
            f"{PREFIX}_dead_letters",
            "Dead-letter rows by status (as of the last count).",
            ["status"],
            registry=registry,
            multiprocess_mode="mostrecent",
        )

    def connect(self) -> None:
        """Start feeding the metrics from the signals."""
        for signal, receiver in self._receivers:
            signal.connect(receiver)

    def disconnect(self) -> None:
        """Stop feeding them (the metrics keep their values)."""
        for signal, receiver in self._receivers:
            signal.disconnect(receiver)

    def set_dead_letters(self, counts: dict[str, int]) -> None:
        """Set the gauge from ``DeadLetterQueue.stats()`` (its ``total`` is left out)."""
        for status, rows in counts.items():
            if status != "total":
                self.dead_letters.labels(status).set(rows)

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

    def _on_lost_republished(self, *, task_name: str, **_: Any) -> None:
        self.lost_republished.labels(task_name).inc()

    def _on_counted(self, *, counts: dict[str, int], **_: Any) -> None:
        self.set_dead_letters(counts)


def _default_registry(registry: Any) -> Any:
    return _prometheus_client().REGISTRY if registry is None else registry


def enable(registry: Any = None) -> Metrics:
    """Create the metrics in ``registry`` (default: prometheus_client's) and start feeding them.

    Calling it again with the same registry returns the same metrics, still fed once.

    Raises:
        ImportError: prometheus_client is not installed (names the extra that brings it).
    """
    registry = _default_registry(registry)
    with _lock:
        metrics = _enabled.get(id(registry))
        if metrics is None:
            metrics = _enabled[id(registry)] = Metrics(registry)
        metrics.connect()
        return metrics


def enable_if_installed() -> None:
    """:func:`enable` the default registry when prometheus_client is installed, the first time
    it is called (a forked child inherits that); else nothing (the in-process counters of
    :mod:`idempotent_tasks.metrics` still count).

    Called on every process's first keyed call: after that it costs a flag's read, a
    :func:`disable` sticks, and a registry that refuses the metrics (a name taken, an old
    prometheus_client) is logged once, never the call's failure.
    """
    global _auto_enable_tried
    if _auto_enable_tried:
        return
    _auto_enable_tried = True
    try:
        enable()
    except ImportError:
        pass
    except Exception:
        logger.warning("could not register the Prometheus metrics", exc_info=True)


def disable(registry: Any = None) -> None:
    """Stop feeding the metrics of ``registry``; they stay registered with their values."""
    registry = _default_registry(registry)
    with _lock:
        metrics = _enabled.get(id(registry))
    if metrics is not None:
        metrics.disconnect()


def update_dead_letter_gauge(queue: Any, registry: Any = None) -> dict[str, int]:
    """Count the dead-letter rows of ``queue`` (one query) and set the gauge; the counts.

    Enables the metrics of ``registry`` first if they are not yet.

    For a process that runs no sweep; workers and beat need not call it. ``queue`` is a
    :class:`~idempotent_tasks.dlq.DeadLetterQueue`; its ``StoreUnavailable`` propagates.

    Raises:
        ImportError: prometheus_client is not installed (names the extra that brings it).
    """
    metrics = enable(registry)
    counts: dict[str, int] = queue.stats()
    metrics.set_dead_letters(counts)
    return counts
