"""What a worker checks and says as it starts: it refuses databases whose schema is newer than
this code (or that cannot be set up), and warns of stores its other processes or hosts do not
share and of leases renewed by a green thread."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from typing import Any, NoReturn
from urllib.parse import urlsplit

from celery.signals import worker_init

from .app_store import dlq_for, host_local_defaults, store_for
from .errors import SchemaVersionError, StoreUnavailable
from .settings import app_setting, positive_seconds, retry_count
from .setup_errors import SETUP_ERRORS, DeadLetterQueueUnusable

logger = logging.getLogger(__name__)


#: A store or dead-letter queue the worker cannot set up, however long it waits.
_UNUSABLE: tuple[type[Exception], ...] = (*SETUP_ERRORS, DeadLetterQueueUnusable)

#: Attribute of an app holding its worker's own hard time limit (``--time-limit``).
WORKER_TIME_LIMIT = "_idempotent_tasks_worker_time_limit"


@worker_init.connect(weak=False)  # type: ignore[untyped-decorator]
def note_worker_time_limit(sender: Any = None, **_: Any) -> None:
    """Keep the worker's hard time limit on its app (pool processes inherit it): given on the
    command line (``--time-limit``), the pool applies it, and ``app.conf`` does not hold it."""
    app, limit = getattr(sender, "app", None), getattr(sender, "time_limit", None)
    if app is not None and limit:
        setattr(app, WORKER_TIME_LIMIT, float(limit))


@worker_init.connect(weak=False)  # type: ignore[untyped-decorator]
def warn_of_green_leases(sender: Any = None, **_: Any) -> None:
    """Say, as a gevent or eventlet worker starts, what keeps its claims: the lease keeper is
    a green thread there, renewed only when the running task yields to the event loop."""
    from .task import IdempotentTask

    app = getattr(sender, "app", None)
    if app is None or not green_threads():
        return
    leases = []
    for task in app.tasks.values():
        if isinstance(task, IdempotentTask):
            with contextlib.suppress(ValueError):  # a setting it refuses, said when it runs
                leases.append(task._lease_and_ttl[0])
    if not leases:
        return
    lease = min(leases)
    logger.warning(
        "idempotent_tasks: under a gevent/eventlet pool the leases of running tasks are renewed "
        "by a green thread; a task that holds the event loop (a call the pool does not patch, "
        "CPU-bound work) for longer than its lease (%ss here at the shortest) can have its key "
        "taken over and run by a duplicate while it still runs: give such tasks an "
        "idempotency_lease longer than that",
        lease,
    )


@worker_init.connect(weak=False)  # type: ignore[untyped-decorator]
def warn_of_unshared_stores(sender: Any = None, **_: Any) -> None:
    """Say, as a worker starts, which of its app's stores its other processes or hosts do not
    share: the claim store and dead-letter table in SQLite files of this host because no URL
    is set (workers and producers on other hosts would keep files of their own), and a
    ``memory://`` store under a pool of processes (each keeps its own). Duplicates there run
    again."""
    app = _keyed_app(sender)
    if app is None:
        return
    try:
        local = host_local_defaults(app)
    except (OSError, ValueError):
        # No folder for them, a result backend URL that does not parse: refuse_newer_schemas
        # says so, and stops the worker.
        return
    if local:
        logger.warning(
            "idempotent_tasks: the %s %s on this host (%s): fine for one host; with "
            "workers or producers on several, set %s to a database they all reach",
            " and the ".join(file.what for file in local),
            "are SQLite files" if len(local) > 1 else "is an SQLite file",
            ", ".join(file.path for file in local),
            " and ".join(file.setting for file in local),
        )
    if _is_memory_store(app) and _forks_pool_processes(sender):
        logger.warning(
            "idempotent_tasks: the claim store is memory://, which each process keeps for "
            "itself: this worker's pool processes, and the processes that publish, each see "
            "only their own keys, so duplicates run again; use it with a solo or threads pool "
            "(tests, one process), else set idempotency_store_url to Redis or SQL"
        )


@worker_init.connect(weak=False)  # type: ignore[untyped-decorator]
def refuse_unusable_dead_letter_settings(sender: Any = None, **_: Any) -> None:
    """Stop a starting worker whose dead-letter settings are unusable: a retry limit (the
    app's, or a task's ``dlq_max_retries``) that is no whole number, 0 or more, or a retrying
    timeout that is no number of seconds above 0 (every sweep would take every running retry
    for stuck, and send it again)."""
    from .task import IdempotentTask

    app = _keyed_app(sender)
    if app is None:
        return
    try:
        retry_count(
            app_setting(app.conf, "idempotency_dlq_max_retries"), "idempotency_dlq_max_retries"
        )
        positive_seconds(
            app_setting(app.conf, "idempotency_dlq_retrying_timeout"),
            "idempotency_dlq_retrying_timeout",
        )
        for task in app.tasks.values():
            if isinstance(task, IdempotentTask) and task.dlq_max_retries is not None:
                retry_count(task.dlq_max_retries, f"{task.name}'s dlq_max_retries")
    except ValueError as exc:
        _refuse_to_start(exc)


def _refuse_to_start(error: Exception) -> NoReturn:
    """Stop the starting worker, saying why (``error``'s message)."""
    logger.critical("worker refuses to start: %s", error)
    raise SystemExit(f"idempotent_tasks: {error}") from error


def _keyed_app(worker: Any) -> Any:
    """The app of a starting worker when it has ``IdempotentTask`` tasks, else ``None``."""
    from .task import IdempotentTask

    app = getattr(worker, "app", None)
    if app is None or not any(isinstance(task, IdempotentTask) for task in app.tasks.values()):
        return None
    return app


def _is_memory_store(app: Any) -> bool:
    """Whether the app's claim store is ``memory://`` (in any case, as stores take it)."""
    try:
        scheme = urlsplit(str(app_setting(app.conf, "idempotency_store_url") or "")).scheme
    except ValueError:
        return False  # no store takes it: refuse_newer_schemas says so
    return scheme.lower() == "memory"


def _forks_pool_processes(worker: Any) -> bool:
    """Whether a worker (at ``worker_init``, its pool not yet resolved) runs tasks in pool
    processes of its own: prefork, Celery's default. A pool named by text is not imported to
    tell (gevent's or eventlet's would be, before they patch): Celery's aliases, or the
    module, say."""
    from celery.concurrency import ALIASES

    pool = getattr(worker, "pool_cls", None) or "prefork"
    if isinstance(pool, type):
        from celery.concurrency.prefork import TaskPool

        return issubclass(pool, TaskPool)
    target = ALIASES.get(str(pool)) or str(pool)
    return target.split(":")[0].startswith("celery.concurrency.prefork")


def green_threads() -> bool:
    """Whether this process's threads are gevent's or eventlet's (monkey-patched)."""
    gevent_monkey = sys.modules.get("gevent.monkey")
    if gevent_monkey is not None and gevent_monkey.is_module_patched("threading"):
        return True
    eventlet_patcher = sys.modules.get("eventlet.patcher")
    return bool(eventlet_patcher is not None and eventlet_patcher.is_monkey_patched("thread"))


@worker_init.connect(weak=False)  # type: ignore[untyped-decorator]
def refuse_newer_schemas(sender: Any = None, **_: Any) -> None:
    """Check the dead-letter database and an SQL claim store as a worker starts.

    A database at a newer schema version stops the worker with :class:`SchemaVersionError`'s
    message: it could only hand every keyed task and every failure back, again and again; so
    does a dead-letter queue or store that cannot even be set up (a driver not installed, a
    URL no store takes). A database that is down does not: it may be back before a task needs
    it.
    """
    app = _keyed_app(sender)
    if app is None:
        return
    try:
        dlq, store = dlq_for(app), store_for(app)
    except _UNUSABLE as exc:
        # A driver missing, a URL no store takes: every keyed task and every failure would be
        # handed back again and again.
        _refuse_to_start(exc)
    checks: dict[str, Callable[[], None]] = {"dead-letter database": dlq.ensure_schema}
    store_check = getattr(store, "ensure_schema", None)
    if store_check is not None:
        checks["claim store"] = store_check
    try:
        for what, check in checks.items():
            try:
                check()
            except SchemaVersionError as exc:
                _refuse_to_start(exc)
            except StoreUnavailable as exc:
                logger.warning("%s not reachable as the worker starts: %s", what, exc)
    finally:
        # No pooled connection is left for the pool processes forked next to inherit.
        dlq.dispose()
        if store_check is not None:
            store.close()
