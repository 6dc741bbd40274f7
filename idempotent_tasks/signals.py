"""Signals idempotent_tasks sends; metrics and users subscribe to them.

Receivers are called synchronously with keyword arguments only; an exception in a receiver is
logged and never disturbs the task.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

Receiver = Callable[..., Any]


class Signal:
    """A named list of receivers (deliberately tiny: the core imports no framework)."""

    def __init__(self, name: str, doc: str) -> None:
        self.name = name
        self.__doc__ = doc
        self._receivers: list[Receiver] = []

    def connect(self, receiver: Receiver) -> Receiver:
        """Subscribe ``receiver`` (usable as a decorator); connecting twice is a no-op."""
        if receiver not in self._receivers:
            self._receivers.append(receiver)
        return receiver

    def disconnect(self, receiver: Receiver) -> None:
        """Unsubscribe ``receiver`` if it was subscribed."""
        if receiver in self._receivers:
            self._receivers.remove(receiver)

    def send(self, **payload: Any) -> None:
        """Call every receiver with ``payload``."""
        for receiver in list(self._receivers):
            try:
                receiver(signal=self, **payload)
            except Exception:
                logger.exception("receiver %r of signal %s failed", receiver, self.name)


claim_finished = Signal(
    "claim_finished", "A worker claimed a key: task_name, outcome (an Outcome), takeover (bool)."
)
duplicate_suppressed = Signal(
    "duplicate_suppressed",
    "A duplicate was not run: task_name, where ('publish' or 'worker'), outcome.",
)
stale_complete_refused = Signal(
    "stale_complete_refused",
    "An owner whose claim was taken over tried to complete: task_name, key.",
)
lease_lost = Signal("lease_lost", "A heartbeat found its claim taken over: task_name, key.")
dead_letter_written = Signal(
    "dead_letter_written",
    "A final failure was written to the dead-letter table: task_name, status (its row's).",
)
dead_letters_counted = Signal(
    "dead_letters_counted", "A sweep counted the dead-letter rows: counts (status -> rows)."
)
result_not_cached = Signal(
    "result_not_cached", "A result was too big or not serializable: task_name, key, reason."
)
lost_message_republished = Signal(
    "lost_message_republished",
    "A queued key's message no worker claimed in time was published again: task_name.",
)
