"""One claim store and one dead-letter queue per Celery app and process."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from celery.signals import worker_init, worker_process_init
from sqlalchemy.exc import SQLAlchemyError

from . import defaults
from .dlq import DeadLetterQueue
from .dlq.engine import default_sqlite_url
from .errors import StoreUnavailable
from .prometheus import enable_if_installed
from .settings import app_setting
from .stores import Store, store_from_url

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_lock = threading.Lock()
_STORE = "_idempotent_tasks_store"
_DLQ = "_idempotent_tasks_dlq"


class DeadLetterQueueUnusable(StoreUnavailable):
    """The app's dead-letter queue cannot even be set up: a matter of configuration, which no
    wait mends (a worker refuses to start on it)."""


def store_url(app: Any) -> str:
    """The store URL an app uses: its setting, else its Redis result backend, else the local
    SQLite file ``claims.sqlite3`` (beside the dead-letter one)."""
    url = app_setting(app.conf, "idempotency_store_url")
    if url:
        return str(url)
    backend = str(app.conf.result_backend or "")
    if urlsplit(backend).scheme in ("redis", "rediss"):
        return backend
    return default_sqlite_url("claims.sqlite3")


def store_for(app: Any) -> Store:
    """This process's claim store for ``app``, built on first use and again after a fork."""

    def build() -> Store:
        # Any process that publishes or runs keyed calls (a producer, a pool process, eager
        # calls) counts into Prometheus' default registry when prometheus_client is installed.
        enable_if_installed()
        prefix = app_setting(app.conf, "idempotency_key_prefix") or defaults.KEY_PREFIX
        params = _backend_connection_params(app)
        if params is not None:
            from .stores.redis import RedisStore

            return RedisStore.from_connection_params(params, prefix)
        return store_from_url(store_url(app), prefix=prefix)

    return _per_process(app, _STORE, build)


def _backend_connection_params(app: Any) -> dict[str, Any] | None:
    """The connection parameters of the Redis result backend the store defaults to, if it
    does: its URL alone would drop ``redis_backend_use_ssl``, ``redis_password`` and the like."""
    if app_setting(app.conf, "idempotency_store_url"):
        return None
    if urlsplit(str(app.conf.result_backend or "")).scheme not in ("redis", "rediss"):
        return None
    params = getattr(app.backend, "connparams", None)
    return dict(params) if isinstance(params, dict) else None


def dlq_for(app: Any) -> DeadLetterQueue:
    """This process's dead-letter queue for ``app`` (``idempotency_dlq_url``, else SQLite)."""

    def build() -> DeadLetterQueue:
        try:
            return DeadLetterQueue(
                app_setting(app.conf, "idempotency_dlq_url"),
                base_delay=float(app_setting(app.conf, "idempotency_dlq_base_delay")),
            )
        except (ImportError, OSError, ValueError, SQLAlchemyError) as exc:
            # Its driver missing, its URL malformed, the default SQLite folder not writable: a
            # failure is then kept as for a database that is down (the task goes back to its
            # queue), never lost. A worker refuses to start on it (see startup).
            raise DeadLetterQueueUnusable(f"dead-letter database unusable: {exc}") from exc

    return _per_process(app, _DLQ, build)


def _per_process(app: Any, attribute: str, build: Callable[[], _T]) -> _T:
    # An object inherited from a parent process is dropped unclosed: its sockets are the
    # parent's, and closing them here would cut the parent's connections.
    pid = os.getpid()
    cached = getattr(app, attribute, None)
    if cached is not None and cached[0] == pid:
        return cached[1]  # type: ignore[no-any-return]
    with _lock:
        cached = getattr(app, attribute, None)
        if cached is not None and cached[0] == pid:
            return cached[1]  # type: ignore[no-any-return]
        built = build()
        setattr(app, attribute, (pid, built))
        return built


@worker_init.connect(weak=False)  # type: ignore[untyped-decorator]
def _enable_metrics(**_: Any) -> None:
    """A worker's main process registers the metrics before it forks its pool."""
    enable_if_installed()


@worker_process_init.connect(weak=False)  # type: ignore[untyped-decorator]
def _forget_inherited(**_: Any) -> None:
    """A prefork child must open its own connections; the pid check does it lazily anyway."""
    from celery import current_app

    for attribute in (_STORE, _DLQ):
        if getattr(current_app, attribute, None) is not None:
            delattr(current_app, attribute)
