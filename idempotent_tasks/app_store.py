"""One claim store and one dead-letter queue per Celery app and process."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlsplit

from celery.signals import worker_init, worker_process_init

from . import defaults
from .dlq import DeadLetterQueue
from .dlq.engine import DEAD_LETTERS_FILE, default_sqlite_path, default_sqlite_url
from .fork_safe import ForkSafeLock
from .prometheus import enable_if_installed
from .settings import app_setting
from .setup_errors import open_dead_letter_queue
from .stores import Store, store_from_url
from .urls import url_text

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_lock = ForkSafeLock()
_STORE = "_idempotent_tasks_store"
_DLQ = "_idempotent_tasks_dlq"
#: The claim store's default SQLite file, in the data folder.
CLAIMS_FILE = "claims.sqlite3"


def store_url(app: Any) -> str:
    """The store URL an app uses: its setting, else its Redis result backend, else the local
    SQLite file ``claims.sqlite3`` (beside the dead-letter one)."""
    url = app_setting(app.conf, "idempotency_store_url")
    if url:
        return url_text(url)
    if _store_on_backend(app):
        return str(app.conf.result_backend)
    return default_sqlite_url(CLAIMS_FILE)


def _store_on_backend(app: Any) -> bool:
    """Whether an app's store is its result backend's Redis: no ``idempotency_store_url``
    set, and a Redis result backend."""
    return not app_setting(app.conf, "idempotency_store_url") and _is_redis_backend(
        str(app.conf.result_backend or "")
    )


class HostLocalFile(NamedTuple):
    """A database kept in an SQLite file of this host because no URL names a shared one."""

    what: str
    setting: str
    path: str


def host_local_defaults(app: Any) -> list[HostLocalFile]:
    """What ``app`` keeps in a local SQLite file because no URL names a shared database: the
    claim store (no ``idempotency_store_url`` and a result backend other than Redis) and the
    dead-letter table (no ``idempotency_dlq_url``), with their files' paths (nothing made).
    Only processes on this host see those files.

    Raises:
        OSError: no folder for them can be found (see ``default_sqlite_path``).
    """
    local = []
    if not app_setting(app.conf, "idempotency_store_url") and not _store_on_backend(app):
        local.append(
            HostLocalFile(
                "claim store", "idempotency_store_url", str(default_sqlite_path(CLAIMS_FILE))
            )
        )
    if not app_setting(app.conf, "idempotency_dlq_url"):
        local.append(
            HostLocalFile(
                "dead-letter table",
                "idempotency_dlq_url",
                str(default_sqlite_path(DEAD_LETTERS_FILE)),
            )
        )
    return local


def _is_redis_backend(url: str) -> bool:
    """Whether a result backend URL is Celery's Redis backend: ``redis://``, ``rediss://``,
    ``redis+socket://`` or ``sentinel://`` (Redis behind Sentinel)."""
    return urlsplit(url).scheme.split("+", 1)[0] in ("redis", "rediss", "sentinel")


def store_for(app: Any) -> Store:
    """This process's claim store for ``app``, built on first use and again after a fork."""

    def build() -> Store:
        # Any process that publishes or runs keyed calls (a producer, a pool process, eager
        # calls) counts into Prometheus' default registry when prometheus_client is installed.
        enable_if_installed()
        prefix = app_setting(app.conf, "idempotency_key_prefix") or defaults.KEY_PREFIX
        if _store_on_backend(app):
            store = _backend_store(app.backend, prefix)
            if store is not None:
                return store
        return store_from_url(store_url(app), prefix=prefix)

    return _per_process(app, _STORE, build)


def _backend_store(backend: Any, prefix: str) -> Store | None:
    """A store on the Redis server of Celery's Redis result backend, reached as the backend
    reaches it (its URL alone would drop ``redis_backend_use_ssl``, ``redis_password``, a
    credential provider, and Sentinel's ``master_name``), with the store's own timeouts."""
    from celery.backends.redis import SentinelBackend

    from .stores.redis import RedisStore, connection_options

    params = getattr(backend, "connparams", None)
    if not isinstance(params, dict):
        return None
    if isinstance(backend, SentinelBackend):
        return RedisStore(_sentinel_master(backend, params, connection_options()), prefix)
    return RedisStore.from_connection_params(dict(params), prefix)


def _sentinel_master(backend: Any, params: dict[str, Any], options: dict[str, Any]) -> Any:
    """A client of the master a Sentinel backend's Sentinels name (found again after a
    failover), as Celery's backend finds it, with the store's timeouts on the Sentinels too:
    a Sentinel that does not answer must not hold a claim up for minutes."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry
    from redis.sentinel import Sentinel

    transport = dict(backend.app.conf.result_backend_transport_options or {})
    timeouts = {name: options[name] for name in ("socket_connect_timeout", "socket_timeout")}
    # (The backend's cap on its pool is not the store's: see RedisStore.from_connection_params.)
    left_out = ("hosts", "retry_on_timeout", "max_connections")
    connection = {name: value for name, value in params.items() if name not in left_out}
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        [(host["host"], host["port"]) for host in params["hosts"]],
        min_other_sentinels=transport.get("min_other_sentinels", 0),
        # One try per Sentinel (the master's own connection retries the whole lookup).
        sentinel_kwargs={
            "retry": Retry(NoBackoff(), 1),
            **timeouts,
            **(transport.get("sentinel_kwargs") or {}),
        },
        **{**connection, **options},
    )
    credentials = {name: params[name] for name in ("username", "password") if name in params}
    return sentinel.master_for(transport.get("master_name"), **credentials)  # type: ignore[no-untyped-call]


def dlq_for(app: Any) -> DeadLetterQueue:
    """This process's dead-letter queue for ``app`` (``idempotency_dlq_url``, else SQLite)."""

    def build() -> DeadLetterQueue:
        # Unusable, a worker refuses to start on it (see startup).
        return open_dead_letter_queue(
            app_setting(app.conf, "idempotency_dlq_url"),
            base_delay=app_setting(app.conf, "idempotency_dlq_base_delay"),
            # Apps sharing a table (the default SQLite file is one per user of a host) keep
            # their rows apart by name (see DeadLetterQueue.take_due); an app without one
            # writes rows that name none.
            scope=app.main or None,
        )

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
