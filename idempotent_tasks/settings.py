"""Resolving a setting the Celery way: call option > task option > app setting > default."""

from __future__ import annotations

import logging
import math
from typing import Any

from celery.utils.serialization import strtobool

from . import defaults

_MISSING = object()

logger = logging.getLogger(__name__)


def app_setting(conf: Any, name: str) -> Any:
    """``app.conf[name]``, or its default from :data:`defaults.APP_SETTINGS` when unset."""
    value = conf.get(name, _MISSING)
    if value is _MISSING or value is None:
        return defaults.APP_SETTINGS[name]
    return value


def resolve(*candidates: Any, default: Any) -> Any:
    """The first candidate that is not ``None`` (most specific first), else ``default``."""
    for value in candidates:
        if value is not None:
            return value
    return default


def positive_seconds(value: Any, name: str) -> float:
    """``value`` as seconds; ``ValueError`` naming the setting unless it is a finite number
    above 0 (an infinite or zero lease or TTL has no meaning a store could keep)."""
    seconds = _seconds(value, name)
    if seconds <= 0:
        raise ValueError(f"{name} must be a finite number of seconds above 0, not {value!r}")
    return seconds


def non_negative_seconds(value: Any, name: str) -> float:
    """``value`` as seconds, 0 allowed (no wait); ``ValueError`` naming the setting unless it
    is a finite number of at least 0."""
    seconds = _seconds(value, name)
    if seconds < 0:
        raise ValueError(f"{name} must be a finite number of seconds, 0 or more, not {value!r}")
    return seconds


def _seconds(value: Any, name: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds, not {value!r}") from None
    if not math.isfinite(seconds):
        raise ValueError(f"{name} must be a finite number of seconds, not {value!r}")
    return seconds


def switch(value: Any, name: str) -> bool:
    """``value`` as on or off: a bool, 0 or 1, or text Celery reads as one (``"false"``,
    ``"yes"``, ``"0"`` ..., from an environment variable); ``ValueError`` naming the setting
    otherwise (``bool("false")`` would be true)."""
    if isinstance(value, str):
        try:
            value = strtobool(value.strip())
        except TypeError:
            pass
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    raise ValueError(f"{name} must be true or false, not {value!r}")


def byte_count(value: Any, name: str) -> int:
    """``value`` as a whole number of bytes, 0 or more (text such as ``"1048576"``, from an
    environment variable, too); ``ValueError`` naming the setting otherwise."""
    count = _count(value)
    if count is None:
        raise ValueError(f"{name} must be a whole number of bytes, 0 or more, not {value!r}")
    return count


def retry_count(value: Any, name: str) -> int:
    """``value`` as a number of retries, 0 or more (text such as ``"5"`` too); ``ValueError``
    naming the setting otherwise."""
    count = _count(value)
    if count is None:
        raise ValueError(f"{name} must be a whole number, 0 or more, not {value!r}")
    return count


def _count(value: Any) -> int | None:
    """``value`` as a whole number, 0 or more; ``None`` if it is none."""
    if isinstance(value, bool):
        return None
    try:
        count = int(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: float("inf")
        return None
    if count >= 0 and (isinstance(value, str) or count == value):
        return count
    return None


def dead_letter_retries(task_value: Any, conf: Any) -> int:
    """How many times a dead letter is retried: the task's ``dlq_max_retries``, else the app's
    ``idempotency_dlq_max_retries``. A value that is no count (a setting mistyped, changed
    since the worker started and checked it) is logged and the next one taken (the app's,
    then the default): the failure being dead-lettered is not lost over it."""
    candidates = [("idempotency_dlq_max_retries", app_setting(conf, "idempotency_dlq_max_retries"))]
    if task_value is not None:
        candidates.insert(0, ("dlq_max_retries", task_value))
    for name, value in candidates:
        try:
            return retry_count(value, name)
        except ValueError as exc:
            logger.error("%s: the dead letter takes the next setting, or the default", exc)
    return defaults.DLQ_MAX_RETRIES
