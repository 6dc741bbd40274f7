"""Keyed calls Celery's worker revokes: their keys are freed, so nothing runs them later.

A revoked (or expired) message is discarded by the worker, acknowledged, and never reaches the
task's code, so its key would stay ``queued`` (or, for a call terminated while it ran, claimed)
with the pickup guard's copy of its message. The guard would publish it again, and once the
worker forgets the revoke (three hours, or a restart), the call would run.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from celery.signals import task_revoked

from . import publishing
from .app_store import store_for
from .core import Attempt
from .dead_letters import DEAD_LETTER_HEADER, DEAD_LETTER_SWEEP_HEADER, record_unrun_retry
from .errors import CorruptRecord, StoreUnavailable
from .keys import storage_key
from .records import Status
from .worker_request import request_header

if TYPE_CHECKING:
    from .task import IdempotentTask

logger = logging.getLogger(__name__)  # the worker's main process: no task runs here


def end_revoked_call(task: IdempotentTask, request: Any) -> None:
    """End a keyed call the worker discarded before it ran, revoked or expired.

    Its reservation is cancelled; a claim of this call whose owner is gone (its lease over: a
    call terminated while it ran, whose copy the guard published) is released; its message,
    kept by the claim of another call that took its key over, is dropped. A dead letter's
    retry records the revoke on its row (a failed retry), which would otherwise stay
    ``retrying``. Runs in the worker's main process, from Celery's ``task_revoked`` signal.
    """
    _record_on_dead_letter(task, request)
    args, kwargs, key = _call_of(task, request)
    if key is None:
        return
    stored_as = storage_key(task.name, key)
    publishing.cancel_reservation(task, stored_as, request.id)
    store = store_for(task.app)
    try:
        # Published again, that copy would be discarded the same way while workers remember
        # the revoke, and run after (three hours, a restart).
        store.drop_pickup(stored_as, request.id)
    except (StoreUnavailable, CorruptRecord) as exc:
        logger.warning("could not drop the pickup of revoked call %s: %s", request.id, exc)
    try:
        record = store.get(stored_as)
    except (StoreUnavailable, CorruptRecord) as exc:
        logger.warning("could not read key %r of revoked call %s: %s", key, request.id, exc)
        return
    if (
        record is not None
        and record.status is Status.PROCESSING
        and record.task_id == request.id
        and record.lease_expires_at <= record.store_time()
    ):
        claim = task._claim_request(key, args, kwargs, request.id, owner=record.owner)
        Attempt(store=store, request=claim, codec=task._codec).release_dead_owner()


def _call_of(task: IdempotentTask, request: Any) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """A revoked request's arguments and the key it runs under (``None``: no key)."""
    args, kwargs = tuple(request.args or ()), dict(request.kwargs or {})
    return args, kwargs, task._delivered_key(request, args, kwargs)


def _record_on_dead_letter(
    task: IdempotentTask, request: Any, how: str = "revoked before it ran"
) -> None:
    """A dead letter's retry that was revoked records that on its row, as a failed retry."""
    dead_letter_id = request_header(request, DEAD_LETTER_HEADER)
    if dead_letter_id is not None:
        sweep_id = request_header(request, DEAD_LETTER_SWEEP_HEADER)
        record_unrun_retry(task.app, dead_letter_id, sweep_id, "TaskRevokedError", how)


def end_terminated_call(task: IdempotentTask, request: Any) -> None:
    """End a keyed call terminated while it ran (``revoke(terminate=True)``).

    Its claim stays for now (its process may not be gone yet: it is released once it is, see
    ``IdempotentTask.release_terminated_call``), but the copy of its message kept for the
    pickup guard is dropped: published again after the worker forgot the revoke (three hours,
    a restart), it would run.
    """
    _record_on_dead_letter(task, request, "terminated while it ran")
    _, _, key = _call_of(task, request)
    if key is None:
        return
    # Killed before its claim reached the store (Celery terminates a call as soon as a pool
    # process accepts it), its key is still queued for it: that reservation goes too.
    stored_as = storage_key(task.name, key)
    publishing.cancel_reservation(task, stored_as, request.id)
    try:
        store_for(task.app).drop_pickup(stored_as, request.id)
    except (StoreUnavailable, CorruptRecord) as exc:
        logger.warning("could not drop the pickup of terminated call %s: %s", request.id, exc)


@task_revoked.connect  # type: ignore[untyped-decorator]
def _on_task_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
) -> None:
    from .task import IdempotentTask  # here: the task module imports this one

    if request is None or not isinstance(sender, IdempotentTask):
        return
    try:
        if terminated:
            end_terminated_call(sender, request)
        else:
            end_revoked_call(sender, request)
    except Exception:
        logger.exception("could not end the revoked call %s", getattr(request, "id", None))
