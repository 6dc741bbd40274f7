"""One claim store per Celery app and process, chosen from the app's settings."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any
from urllib.parse import urlsplit

from celery.signals import worker_process_init

from . import defaults
from .settings import app_setting
from .stores import Store, store_from_url

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_ATTRIBUTE = "_idempotent_tasks_store"


def store_url(app: Any) -> str:
    """The store URL an app uses: its setting, else its Redis result backend, else memory."""
    url = app_setting(app.conf, "idempotency_store_url")
    if url:
        return str(url)
    backend = str(app.conf.result_backend or "")
    if urlsplit(backend).scheme in ("redis", "rediss"):
        return backend
    logger.warning(
        "idempotency_store_url is not set and the result backend is not Redis: using memory://, "
        "which only protects tasks within one process; set idempotency_store_url"
    )
    return "memory://"


def store_for(app: Any) -> Store:
    """This process's store for ``app``, built on first use and again after a fork."""
    cached = getattr(app, _ATTRIBUTE, None)
    pid = os.getpid()
    if cached is not None and cached[0] == pid:
        return cached[1]  # type: ignore[no-any-return]
    with _lock:
        cached = getattr(app, _ATTRIBUTE, None)
        if cached is not None and cached[0] == pid:
            return cached[1]  # type: ignore[no-any-return]
        # A store inherited from a parent process is dropped unclosed: its sockets are the
        # parent's, and closing them here would cut the parent's connections.
        prefix = app_setting(app.conf, "idempotency_key_prefix") or defaults.KEY_PREFIX
        store = store_from_url(store_url(app), prefix=prefix)
        setattr(app, _ATTRIBUTE, (pid, store))
        return store


@worker_process_init.connect(weak=False)  # type: ignore[untyped-decorator]
def _forget_inherited_stores(**_: Any) -> None:
    """A prefork child must open its own connections; the pid check does it lazily anyway."""
    from celery import current_app

    if getattr(current_app, _ATTRIBUTE, None) is not None:
        delattr(current_app, _ATTRIBUTE)
