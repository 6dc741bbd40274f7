"""Resolving a setting the Celery way: call option > task option > app setting > default."""

from __future__ import annotations

from typing import Any

from . import defaults

_MISSING = object()


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
