"""Keyed calls that replace themselves (Celery's ``Task.replace``).

Such a body does its work, then hands over to a new task under its own task id, whose result
is the call's. Its key then counts as completed (its body never runs again), caching a marker
in place of a value: a duplicate's answer is the replacement's result in Celery's backend.
"""

from __future__ import annotations

from typing import Any

#: What a key caches for a call that replaced itself.
REPLACED = {"idempotency_replaced": True}


def is_replaced(value: Any) -> bool:
    """Whether a cached value is the marker of a call that replaced itself."""
    return isinstance(value, dict) and value == REPLACED
