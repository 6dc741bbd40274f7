"""The publish side of ``IdempotentTask``: a keyed call is answered from its key's record, or
the key is queued for the message about to go out (the pickup guard).

Only an optimisation and a safety net: the worker's claim is the guarantee, so a store that
cannot be reached lets the message go out unguarded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery import states
from celery.backends.rpc import RPCBackend
from celery.result import EagerResult
from celery.utils.log import get_task_logger
from kombu.entity import Exchange, Queue

from . import signals
from .app_store import store_for
from .broker_errors import broker_cannot_take
from .canvas_keys import required_key_error
from .errors import CorruptRecord, IdempotencyKeyMismatch, StoreUnavailable
from .keys import MAX_TASK_ID_CHARS, derive_key, fitted, validate_key
from .pickups import (
    call_expired,
    end_expired_call,
    hand_to_guard,
    make_pickup,
    republish_taken,
    seconds_until,
)
from .records import ClaimRequest, DuePickup, Outcome, Pickup, Record, Status
from .replacements import is_replaced

if TYPE_CHECKING:
    from .task import IdempotentTask

#: Header of a message that goes on with a call under its task id (a retry, a replacement it
#: hands its key to): the owner of the claim it may take over at once.
PREVIOUS_OWNER_HEADER = "idempotency_previous_owner"

logger = get_task_logger(__name__)


#: Header of the message its key was queued for at publish: its caller, and every duplicate
#: caller handed its ``AsyncResult``, wait for its value, so it is never dropped or failed as
#: a duplicate (another call may take its key over while it is on its way: a slow queue).
RESERVED_HEADER = "idempotency_reserved"

#: Longest task name the claim and dead-letter tables keep (their ``task_name`` columns).
MAX_TASK_NAME_CHARS = 255


def fitted_task_id(task_id: str) -> str:
    """``task_id``, or, when longer than the stores keep, a shorter id naming it: its start
    and a digest of the whole (a message sent by other means than ``apply_async``)."""
    return fitted(task_id, MAX_TASK_ID_CHARS)


def publish_key(
    task: IdempotentTask,
    call_key: object,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    required: bool = True,
) -> str | None:
    """The call's key: its own, else the task's, else ``None`` (``ValueError`` if the task
    requires one and ``required``: not for a re-publish of a message already running)."""
    if call_key is not None:
        return validate_key(call_key)
    if task.idempotency_key is not None:
        return derive_key(task.idempotency_key, task._signature, args, kwargs)
    if task.idempotency_key_required and required:
        raise required_key_error(task.name)
    return None


#: Options of a call that is one part of a canvas: a chord's body, a group collecting its
#: result by its own task id, a task that replaced itself with this call (``Task.replace``).
CANVAS_OPTIONS = ("chord", "group_id", "replaced_task_nesting")


def continues(options: dict[str, Any], link: Any, link_error: Any) -> bool:
    """Whether work waits on this very message (callbacks, a chain's next step, a chord or
    group collecting its task id, a replaced task's callers): such a call is published even
    when its key could answer at once, and the worker answers it as a duplicate, so that the
    work after it runs. A chain's last step has ``chain=[]``: its id is the chain's result."""
    in_chain = options.get("chain") is not None
    return bool(link or link_error or in_chain or any(options.get(n) for n in CANVAS_OPTIONS))


def prepare(
    task: IdempotentTask,
    key: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    task_id: str,
    options: dict[str, Any],
) -> tuple[ClaimRequest, Pickup | None]:
    """The reservation of a call's key, and what the pickup guard keeps of its message
    (``None``: the guard is off)."""
    # A replacement the call hands its key on to names the call's claim (see on_replace).
    previous_owner = (options.get("headers") or {}).get(PREVIOUS_OWNER_HEADER)
    request = task._claim_request(
        key, args, kwargs, task_id, owner="", previous_owner=previous_owner
    )
    wait = seconds_until(options.get("countdown"), options.get("eta"))
    if task._pickup_timeout <= 0:
        return request, None  # the guard is off: no envelope to build
    serializer = options.get("serializer") or task.serializer
    # The task's own routing, priority and limits, which Celery's apply_async adds after this
    # (a sweep in a process without the task would send the copy without them). Celery replies
    # (rpc://) to the caller's thread: so must a copy the guard publishes. A task's own expiry
    # is counted from this publish, not from the copy's (kept as a moment).
    options = {
        **own_publish_options(task),
        **options,
        "reply_to": options.get("reply_to") or task.app.thread_oid,
        # An explicit expires=None clears the task's own, as in Celery.
        "expires": options["expires"] if "expires" in options else task.expires,
        **_lineage(task, task_id, options),
    }
    pickup = make_pickup(args, kwargs, options, task._pickup_timeout, wait, serializer)
    return request, pickup


def own_publish_options(task: IdempotentTask, *names: str) -> dict[str, Any]:
    """The task's own publish options (all, or ``names``) that are set, as Celery's
    ``apply_async`` adds them to its messages, in names a copy can keep: a queue entity by its
    name when the app declares it (``task_queues``), else by its exchange and routing key; an
    exchange entity by its name."""
    options: dict[str, Any] = {}
    for name, value in task._get_exec_options().items():
        if value is None or (names and name not in names):
            continue
        if isinstance(value, Queue):
            if task.app.amqp.queues.get(value.name) == value:
                options[name] = value.name
            else:
                options.setdefault("exchange", value.exchange.name)
                options.setdefault("routing_key", value.routing_key)
        else:
            options[name] = value.name if isinstance(value, Exchange) else value
    return options


def _lineage(task: IdempotentTask, task_id: str, options: dict[str, Any]) -> dict[str, Any]:
    """The root and parent ids Celery gives a call made in a task (``send_task`` reads the
    running task), for the copy the sweep sends: sent from the sweep task, it would get that
    task's instead. A call made outside any task is its own root (its parent is the sweep
    task then, as a dead letter's retry's is)."""
    parent = task.app.current_worker_task
    if parent is None:
        return {"root_id": options.get("root_id") or task_id}
    request = parent.request
    return {
        "root_id": options.get("root_id") or request.root_id or request.id,
        "parent_id": options.get("parent_id") or request.id,
    }


def reserve(
    task: IdempotentTask, request: ClaimRequest, pickup: Pickup | None, *, continues: bool = False
) -> tuple[ClaimRequest | None, Any]:
    """Queue the key for this message (as :func:`prepare` made them), or answer from its
    record; with the guard off, only look at the record. ``continues``: work waits on the
    message (see :func:`continues`).

    Returns the reservation to cancel if the publish fails, and the result to return instead
    of publishing (``None``: publish).
    """
    store = store_for(task.app)
    try:
        if pickup is None:
            record = store.get(request.storage_key)
        else:
            record = store.reserve(request, pickup)
    except (StoreUnavailable, CorruptRecord) as exc:
        logger.warning("publishing %s without a look at its key: %s", task.name, exc)
        return None, None
    if record is None or own_reservation(record, request):
        return (None if pickup is None else request), None
    return None, answer_from_record(task, record, request, continues=continues)


def own_reservation(record: Record, request: ClaimRequest) -> bool:
    """The key is queued for this very message: the client sent the reservation again after
    losing the store's reply (redis-py retries a timed-out command), and the first one took."""
    return (
        record.status is Status.QUEUED
        and record.task_id == request.task_id
        and record.fingerprint == request.fingerprint
    )


def reaches_this_caller(task: IdempotentTask, answer: Any) -> bool:
    """Whether a publish can hand ``answer`` back instead of publishing the call: a cached
    value always; another call's ``AsyncResult`` only with a result backend any caller can
    read. rpc:// sends a result to its own caller's reply queue alone, so this caller would
    wait for ever: its call is published, and the worker answers it, waiting for the value."""
    return isinstance(answer, EagerResult) or not isinstance(task.backend, RPCBackend)


def cancel_reservation(task: IdempotentTask, storage_key: str, task_id: str) -> None:
    """Take back the reservation of a message that could not be published (or of a call that
    ended unrun)."""
    try:
        store_for(task.app).cancel_reservation(storage_key, task_id)
    except (StoreUnavailable, CorruptRecord) as exc:
        logger.warning(
            "could not cancel the reservation of %s (%s): it will be published later",
            task_id,
            exc,
        )


def publish_failed(task: IdempotentTask, storage_key: str, task_id: str, error: Exception) -> None:
    """The reserved call's publish failed with kombu's ``error``. A broker that could not be
    reached leaves the call queued, due at once, for the guard to publish (a duplicate may
    have joined it since it was reserved); one that refused the message (a queue's key of
    another type) would refuse it at every try: the reservation is taken back."""
    if broker_cannot_take(error):
        hand_to_guard(store_for(task.app), storage_key, task_id)
    else:
        cancel_reservation(task, storage_key, task_id)


def answer_from_record(
    task: IdempotentTask, record: Record, request: ClaimRequest, *, continues: bool = False
) -> Any:
    """What a publish of a key that has a record returns instead (``None``: publish).
    ``continues``: work waits on the message (see :func:`continues`).

    Leases are judged by the store's clock, which wrote them, not by this host's.
    """
    # A record of this very task id is this call going on, as the stores judge it: a
    # replacement it handed its key to (naming its claim's owner), or a step of a canvas
    # published again under the id Celery fixed for it (its upstream ran twice, and gave it
    # other arguments). A caller's own call under a task id it chose, which no work waits on,
    # is judged as any other: other arguments are refused.
    same_call = record.task_id == request.task_id and (
        request.previous_owner is not None or continues
    )
    if task.idempotency_validate and record.fingerprint != request.fingerprint and not same_call:
        raise IdempotencyKeyMismatch(
            request.key, task.name, record.fingerprint, request.fingerprint
        )
    if record.status is Status.COMPLETED:
        try:
            value = task._codec.decode(record.result) if record.result else None
        except CorruptRecord as exc:
            logger.warning("cached result of key %r is unreadable: %s", request.key, exc)
            return None
        if is_replaced(value):
            # The replacement's result, in Celery's.
            answer: Any = task.AsyncResult(record.task_id)
        else:
            answer = EagerResult(record.task_id, value, states.SUCCESS, name=task.name)
        return _suppressed(task, answer, Outcome.COMPLETED, continues)
    if record.lease_expires_at > record.store_time():
        task_id: str | None = record.task_id  # its message is on its way, or its owner alive
    else:
        # A queued key past the time its message counts as lost, or a claimed one whose owner's
        # lease ended (lost too once that was a pickup timeout ago: the store decides).
        due = _take_if_lost(task, record)
        if due is not None and call_expired(due):
            end_expired_call(store_for(task.app), due)
            return None  # the key is free: this call runs
        task_id = _republished(task, due)
        if task_id is None:
            if record.status is not Status.QUEUED:
                return None  # a dead owner's key: this message takes it over
            task_id = record.task_id  # not lost after all, or its re-publication failed
    return _suppressed(task, task.AsyncResult(task_id), Outcome.IN_PROGRESS, continues)


def _suppressed(task: IdempotentTask, answer: Any, outcome: Outcome, continues: bool) -> Any:
    """``answer``, signalled as a duplicate suppressed at publish when the publish returns it
    instead of publishing: not when work waits on the message, nor when this caller cannot
    read it (the worker then answers the published call, and counts it)."""
    if not continues and reaches_this_caller(task, answer):
        signals.duplicate_suppressed.send(task_name=task.name, where="publish", outcome=outcome)
    return answer


def _take_if_lost(task: IdempotentTask, record: Record) -> DuePickup | None:
    """Take the key's message, as the beat sweep would, if it counts as lost (so a lost
    message is found without beat too); ``None`` when it does not (or the guard is off)."""
    if task._pickup_timeout <= 0:
        return None
    try:
        return store_for(task.app).take(record.storage_key)
    except (StoreUnavailable, CorruptRecord) as exc:
        logger.warning("could not take over the lost message of key %r: %s", record.key, exc)
        return None


def _republished(task: IdempotentTask, due: DuePickup | None) -> str | None:
    """Publish a taken message again; the task id it went out under, else ``None``."""
    # A broker still unreachable fails this publish as it failed the call's own (its key due
    # again at once), rather than hand back a result nothing will ever write.
    if due is None or not republish_taken(
        task.app, store_for(task.app), due, raise_unreachable=True
    ):
        return None
    return due.task_id
