"""Where RQ jobs keep claims and dead letters: built lazily, once per process and URL.

Workers fork a work horse per job; an object inherited from the parent is never reused (its
sockets are the parent's), and never closed either (closing them would cut the parent's).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import redis

from ..dlq import DeadLetterQueue
from ..fork_safe import ForkSafeLock
from ..prometheus import enable_if_installed
from ..setup_errors import open_dead_letter_queue
from ..stores import Store, store_from_url
from ..stores.redis import RedisStore
from .options import DLQ_URL_ENV

_T = TypeVar("_T")
_lock = ForkSafeLock()
_built: dict[tuple[str, ...], tuple[int, object]] = {}


def dlq_url_for(dlq_url: str | None) -> str | None:
    """The dead-letter URL to use: the given one, else ``$IDEMPOTENT_TASKS_DLQ_URL``, else
    ``None`` (the local SQLite file of :func:`idempotent_tasks.dlq.engine.default_sqlite_url`)."""
    return dlq_url or os.environ.get(DLQ_URL_ENV) or None


def dead_letter_queue(dlq_url: str | None) -> DeadLetterQueue:
    """This process's :class:`DeadLetterQueue` for ``dlq_url`` (resolved by :func:`dlq_url_for`)."""
    url = dlq_url_for(dlq_url)
    return _per_process(("dlq", url or ""), lambda: open_dead_letter_queue(url))


def claim_store(connection: redis.Redis, prefix: str, store_url: str | None) -> Store:
    """The claim store of a job: ``store_url``'s store, else one on ``connection`` (RQ's Redis).

    A store on ``connection`` shares that client's connection pool, which redis-py already
    resets in a forked child, so it is cheap to build for every job.
    """
    # A work horse, a producer or a synchronous queue counts into Prometheus' default registry
    # when prometheus_client is installed (after the first call, a flag's read).
    enable_if_installed()
    if store_url:
        return _per_process(
            ("store", store_url, prefix), lambda: store_from_url(store_url, prefix=prefix)
        )
    return RedisStore(connection, prefix)


def _per_process(name: tuple[str, ...], build: Callable[[], _T]) -> _T:
    pid = os.getpid()
    with _lock:
        cached = _built.get(name)
        if cached is not None and cached[0] == pid:
            return cached[1]  # type: ignore[return-value]
        built = build()
        _built[name] = (pid, built)
        return built


def close_all() -> None:
    """Close what this process built (stores' connections, dead-letter engines)."""
    pid = os.getpid()
    with _lock:
        owned = [value for owner, value in _built.values() if owner == pid]
        _built.clear()
    for value in owned:
        if isinstance(value, DeadLetterQueue):
            value.dispose()
        else:
            close = getattr(value, "close", None)
            if close is not None:
                close()
