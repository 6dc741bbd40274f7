"""Keyed calls and dead letters sent to a worker that does not know their task.

Celery's worker discards a message naming a task it has not registered (a task renamed or
removed since it failed, a worker without its module, an old worker in a rolling upgrade),
fails its call with ``NotRegistered``, and runs none of this package's code for it. So the
worker's ``task_unknown`` signal ends it here:

* a keyed call's reservation is cancelled: its key would stay queued for a call that failed,
  every caller of the key handed that failure, until the pickup guard published the call again
  and a worker that knows the task ran it after all;
* a dead letter's retry is recorded on its row as a failed one (``NotRegistered``): it would
  stay ``retrying`` until its timeout, go back to ``pending`` and be sent again, for ever,
  never using a retry. The row is rescheduled, and gives up at its limit as any retry that
  keeps failing.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import task_unknown

from .app_store import store_for
from .dead_letters import DEAD_LETTER_HEADER, DEAD_LETTER_SWEEP_HEADER, record_unrun_retry
from .errors import CorruptRecord, StoreUnavailable
from .keys import KEY_HEADER, storage_key

logger = logging.getLogger(__name__)  # the worker's main process: no task runs here


@task_unknown.connect  # type: ignore[untyped-decorator]
def _on_task_unknown(
    sender: Any = None,
    name: str | None = None,
    id: str | None = None,
    message: Any = None,
    **_: Any,
) -> None:
    headers = getattr(message, "headers", None) or {}
    app = getattr(sender, "app", None)
    if app is None:
        return
    _cancel_reservation(app, name, id, headers.get(KEY_HEADER))
    dead_letter_id = headers.get(DEAD_LETTER_HEADER)
    if dead_letter_id is None:
        return
    how = f"the worker that received its retry has no task named {name!r}"
    try:
        record_unrun_retry(
            app, dead_letter_id, headers.get(DEAD_LETTER_SWEEP_HEADER), "NotRegistered", how
        )
    except Exception:  # never break the worker's consumer
        logger.exception("could not record the unknown task on dead letter %s", dead_letter_id)


def _cancel_reservation(app: Any, name: Any, task_id: Any, key: Any) -> None:
    """Free the key of a keyed call that failed as unknown: its reservation, and the guard's
    copy of its message a claim of another call keeps."""
    if not (isinstance(name, str) and isinstance(task_id, str) and isinstance(key, str) and key):
        return
    stored_as = storage_key(name, key)
    try:
        store = store_for(app)
        store.cancel_reservation(stored_as, task_id)
        store.drop_pickup(stored_as, task_id)
    except (StoreUnavailable, CorruptRecord) as exc:
        logger.warning("could not free key %r of unknown task %s: %s", key, name, exc)
    except Exception:  # never break the worker's consumer
        logger.exception("could not free key %r of unknown task %s", key, name)
