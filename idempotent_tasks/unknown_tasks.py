"""Keyed calls and dead letters sent to a worker that does not know their task.

Celery's worker discards a message naming a task it has not registered (a task renamed or
removed since it failed, a worker without its module, an old worker in a rolling upgrade),
fails its call with ``NotRegistered``, and runs none of this package's code for it. So the
worker's ``task_unknown`` signal ends it here, as any call that failed for good:

* a keyed call is written to the dead-letter table (whose sweep sends it again on its
  backoff: to a worker that knows the task by then, it runs), and its key is freed. Left
  queued for a call that failed, the key would hand every caller that failure, until the pickup
  guard published the call again unseen. A message older than the one its key waits for (a
  redelivery, a copy of a call that retried or runs elsewhere) changes nothing;
* a dead letter's retry is recorded on its row as a failed one (``NotRegistered``): it would
  stay ``retrying`` until its timeout, go back to ``pending`` and be sent again, for ever,
  never using a retry. The row is rescheduled, and gives up at its limit as any retry that
  keeps failing.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

from celery.signals import task_unknown

from .app_store import store_for
from .dead_letters import (
    DEAD_LETTER_HEADER,
    DEAD_LETTER_SWEEP_HEADER,
    failure_id_of,
    failure_options,
    record_unrun_retry,
    write_failure,
)
from .dlq.arguments import stored_arguments
from .dlq.items import Failure
from .errors import CorruptRecord, StoreUnavailable
from .keys import KEY_HEADER, storage_key
from .pickups import expired
from .publishing import fitted_task_id
from .records import Status, older_message
from .settings import dead_letter_retries

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
    dead_letter_id = headers.get(DEAD_LETTER_HEADER)
    if dead_letter_id is None:
        key = headers.get(KEY_HEADER)
        if isinstance(name, str) and isinstance(id, str) and isinstance(key, str) and key:
            try:
                _end_keyed_call(app, name, id, key, message)
            except Exception:  # never break the worker's consumer
                logger.exception("could not end the keyed call %s of unknown task %s", id, name)
        return
    how = f"the worker that received its retry has no task named {name!r}"
    try:
        record_unrun_retry(
            app, dead_letter_id, headers.get(DEAD_LETTER_SWEEP_HEADER), "NotRegistered", how
        )
    except Exception:  # never break the worker's consumer
        logger.exception("could not record the unknown task on dead letter %s", dead_letter_id)


def _end_keyed_call(app: Any, name: str, task_id: str, key: str, message: Any) -> None:
    """Dead-letter a keyed call failed as unknown, then free its key (its reservation)."""
    headers = message.headers
    retries = int(headers.get("retries") or 0)
    stored_as = storage_key(name, key)
    store = store_for(app)
    try:
        record = store.get(stored_as)
    except (StoreUnavailable, CorruptRecord) as exc:
        logger.warning("could not read key %r of unknown task %s: %s", key, name, exc)
        return  # left queued, the guard publishes the call again: never lost
    fitted_id = fitted_task_id(task_id)
    if record is not None and not (
        record.status is Status.QUEUED
        and record.task_id == fitted_id
        and not older_message(record.owner, retries)
    ):
        return  # an older copy, or a call running or done elsewhere: it is not this one's end
    if expired(headers.get("expires")):
        # Past its expiry it would not run anyway: its key is freed, as for an expired call.
        store.cancel_reservation(stored_as, fitted_id)
        return
    failure = _failure(app, name, fitted_id, key, retries, message)
    if failure is None:
        # Its arguments cannot be read here, or kept exactly: left queued, the guard publishes
        # the call again.
        return
    try:
        write_failure(app, failure, None)
    except StoreUnavailable as exc:
        logger.warning("could not write the dead letter of unknown task %s: %s", name, exc)
        return  # left queued, the guard publishes the call again: never lost
    store.cancel_reservation(stored_as, fitted_id)


def _failure(
    app: Any, name: str, task_id: str, key: str, retries: int, message: Any
) -> Failure | None:
    """The dead letter of a keyed call of task protocol 2 that failed as unknown."""
    try:
        args, kwargs, embed = message.decode()
    except Exception as exc:  # another protocol, a content type this worker does not accept
        logger.warning("could not read the arguments of unknown task %s: %s", name, exc)
        return None
    headers = message.headers
    request = SimpleNamespace(**{**headers, **(embed or {})})
    stored_args, stored_kwargs, faithful = stored_arguments(
        args, kwargs, exact=getattr(message, "content_type", None) != "application/json"
    )
    if not faithful:
        return None
    # Its routing, with its priority, which transports keep in the message's properties.
    request.delivery_info = {
        **(getattr(message, "delivery_info", None) or {}),
        "priority": (getattr(message, "properties", None) or {}).get("priority"),
    }
    # When it was to run and until when (Celery rejected it unread): a retry keeps them.
    timing = {option: headers[option] for option in ("eta", "expires") if headers.get(option)}
    return Failure(
        failure_id=failure_id_of(task_id, retries),
        task_name=name,
        task_id=task_id,
        idempotency_key=key,
        args=stored_args,
        kwargs=stored_kwargs,
        options={**failure_options(request, faithful=True), **timing},
        error_type="NotRegistered",
        error_message=f"the worker that received it has no task named {name!r}",
        traceback=None,
        # (The task's own dlq_max_retries cannot be known in a process without the task.)
        max_retries=dead_letter_retries(None, app.conf),
    )
