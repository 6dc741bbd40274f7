"""Keyed calls that replace themselves (Celery's ``Task.replace``).

Such a body does its work, then hands over to a new task under its own task id, whose result
is the call's. Its key then counts as completed (its body never runs again), caching a marker
in place of a value: a duplicate's answer is the replacement's result in Celery's backend. A
task that replaces itself with itself (a polling loop, say) hands its key on instead, queued for
the replacement, which runs under it.
"""

from __future__ import annotations

from typing import Any

#: What a key caches for a call that replaced itself.
REPLACED = {"__idempotent_tasks_replaced__": True}
#: Header of a duplicate waiting for a replacement's result: when it began to wait.
WAIT_SINCE_HEADER = "idempotency_replacement_wait_since"


def is_replaced(value: Any) -> bool:
    """Whether a cached value is the marker of a call that replaced itself."""
    return isinstance(value, dict) and value == REPLACED
