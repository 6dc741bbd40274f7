"""A keyed call's reservation and its message's publish in one Redis round trip.

When the broker is kombu's Redis transport on the claim store's Redis server (one Redis for
broker, result backend and store, as most set-ups have it), the reservation script also pushes
the message onto the queue's list, and a key found with a record has nothing pushed. The
producer then makes one round trip per call, as plain Celery does, instead of two; and no
producer can die between reserving a key and publishing its message.

The message is the one Celery builds: the call goes through Celery's ``apply_async`` as usual,
and only kombu's last step, the push of that one message onto its list, is taken over. kombu's
Redis channel class has its ``_put`` wrapped, once per process; the wrapper hands every other
message straight on, and reserves the pending call's key as its message is pushed: in the same
script on the store's server, else by a reservation just before kombu's own push (a broker
elsewhere, a key prefix, a batch). So it holds on every channel, a producer's own
(``apply_async(connection=...)``) and one kombu opens again after a connection error alike.

It is kept to the plain case: a call made outside a running task (whose children Celery
records as it publishes), not part of a canvas, with the pickup guard on, and whose key this
process has not published lately (a key sent again is likely answered from its record, which
this path learns only after Celery has built the whole message). Everything else takes
:func:`idempotent_tasks.publishing.reserve`'s two round trips, with the same outcomes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery.result import AsyncResult
from kombu.exceptions import OperationalError
from kombu.utils.json import dumps

from . import publishing
from .app_store import store_for
from .broker_errors import broker_cannot_take
from .errors import CorruptRecord, StoreUnavailable
from .fork_safe import ForkSafeLock
from .pickups import hand_to_guard
from .records import ClaimRequest, Pickup, Record
from .settings import app_setting, switch

if TYPE_CHECKING:
    from .stores.redis import ListPush, RedisStore
    from .task import IdempotentTask

logger = logging.getLogger(__name__)

#: How many keys a process remembers having published, to send them again the two-trip way.
RECENT_KEYS = 4096

#: What this module uses of kombu's Redis channel (kombu 5).
_KOMBU_NAMES = ("_put", "_q_for_pri", "_get_message_priority", "_expires", "global_keyprefix")
#: Marks kombu's ``_put`` as wrapped by this module.
_WRAPPED = "_idempotent_tasks_reserving"
_wrap_lock = ForkSafeLock()


@dataclass
class _Pending:
    """The reservation to make as one message is pushed, and what became of it."""

    store: RedisStore
    request: ClaimRequest
    pickup: Pickup
    #: kombu was about to push the message: the reservation was tried.
    reached: bool = False
    #: The record the key had: the message was not pushed.
    found: Record | None = None


_PENDING: ContextVar[_Pending | None] = ContextVar(
    "idempotent_tasks_reserve_and_push", default=None
)


class _RecentKeys:
    """The keys this process published lately, the oldest forgotten first."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._keys: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._lock = ForkSafeLock()

    def seen(self, task_name: str, key: str) -> bool:
        """Remember the key; whether it was remembered already."""
        entry = (task_name, key)
        with self._lock:
            if entry in self._keys:
                self._keys.move_to_end(entry)
                return True
            self._keys[entry] = None
            if len(self._keys) > self._size:
                self._keys.popitem(last=False)
            return False


_recent = _RecentKeys(RECENT_KEYS)

#: What :func:`publish` returns for a call whose key's record it found and this call takes
#: over: publish it without a reservation, as the two-trip path would after its own look.
TAKE_OVER = object()


@dataclass(frozen=True)
class Published:
    """What :func:`publish` returns for a call it published: Celery's result of it (told apart
    from an answer a record gave, which with rpc:// results would be published after all)."""

    result: AsyncResult


def publish(
    task: IdempotentTask,
    request: ClaimRequest,
    pickup: Pickup,
    producer: Any,
    send: Callable[[Any], AsyncResult],
) -> Any:
    """Publish a keyed call reserving its key as its message is pushed (:class:`Published`), or
    answer it from the key's record; ``None`` when that cannot be done here (publish it the
    two-trip way), and :data:`TAKE_OVER` for a record the call takes over (publish it
    unreserved).

    ``request`` and ``pickup`` are the call's reservation, as :func:`publishing.prepare` made
    them; ``send`` publishes the message through Celery with the producer it is given.
    """
    conf = task.app.conf
    if (
        _PENDING.get() is not None
        or task.app.current_worker_task is not None
        or conf.task_always_eager
        # Its monitors would see a task-sent event for a duplicate never sent.
        or conf.task_send_sent_event
        or conf.task_protocol == 1  # the task id is not in the message's headers
        or not switch(
            app_setting(conf, "idempotency_publish_in_one_trip"), "idempotency_publish_in_one_trip"
        )
    ):
        return None
    store = _redis_store(store_for(task.app))
    if store is None or _recent.seen(task.name, request.key):
        return None
    with task.app.producer_or_acquire(producer) as ready_producer:
        try:
            channel = ready_producer.channel  # connects to the broker
        except Exception:
            # Unreachable, say: the two trips reserve first (a key with a record is answered,
            # a new one kept for the guard), then meet the same error publishing.
            return None
        if not _wrapped(channel):
            return None
        pending = _Pending(store, request, pickup)
        token = _PENDING.set(pending)
        try:
            result = send(ready_producer)
        except OperationalError as error:
            if pending.reached:  # reserved, or maybe reserved: as with two trips
                publishing.publish_failed(task, request.storage_key, request.task_id, error)
                raise
            if not broker_cannot_take(error):
                raise  # refused as it would be at every try: nothing to keep
            return _reserve_unpublished(task, pending, error)
        except Exception:
            if pending.reached:  # a reservation made, or maybe made, before the push failed
                publishing.cancel_reservation(task, request.storage_key, request.task_id)
            raise
        except BaseException:
            # Interrupted (Ctrl-C, a green thread's timeout, an exit), the message pushed or
            # not: a call reserved stays for the guard to publish (once more at most).
            if pending.reached and pending.found is None:
                hand_to_guard(store, request.storage_key, request.task_id)
            raise
        finally:
            _PENDING.reset(token)
    if not pending.reached:
        _reserve_after(store, request, pickup)
        return Published(result)
    if pending.found is None:
        # Reserved and pushed; or pushed without a look, the store unreachable.
        return Published(result)
    del result  # never published: dropping it ends its result subscription
    answer = publishing.answer_from_record(task, pending.found, request)
    # None: a key this call takes over (a dead owner's, an unreadable value); the two-trip
    # publish need not look at the record again.
    return TAKE_OVER if answer is None else answer


def _reserve_unpublished(task: IdempotentTask, pending: _Pending, error: Exception) -> Any:
    """What a call whose publish failed with ``error`` before its push (the broker unreachable)
    gets, as with two trips: the answer from its key's record; else its key is queued for the
    pickup guard to publish, and ``error`` raised."""
    request = pending.request
    try:
        found = pending.store.reserve(request, pending.pickup)
    except (StoreUnavailable, CorruptRecord):
        raise error from None
    answer = None
    if found is not None and not publishing.own_reservation(found, request):
        answer = publishing.answer_from_record(task, found, request)
    if answer is None:
        hand_to_guard(pending.store, request.storage_key, request.task_id)
        raise error
    return answer


def _reserve_after(store: RedisStore, request: ClaimRequest, pickup: Pickup) -> None:
    """Reserve the key of a message kombu published another way than a list push (a fanout
    exchange), for the pickup guard: as the reservation before the publish would have, but
    for the record of a claim or a duplicate that came first (its message is out already)."""
    try:
        store.reserve(request, pickup)
    except (StoreUnavailable, CorruptRecord) as exc:
        logger.warning("could not reserve the key of published %s: %s", request.task_name, exc)


def _redis_store(store: Any) -> RedisStore | None:
    try:  # redis-py is an optional dependency
        from .stores.redis import RedisStore
    except ImportError:
        return None
    return store if isinstance(store, RedisStore) else None


def _wrapped(channel: Any) -> bool:
    """Whether kombu pushes ``channel``'s messages through this module's wrapper (wrapping
    kombu's Redis channel class the first time)."""
    try:
        from kombu.transport.redis import Channel
    except ImportError:
        return False
    if not isinstance(channel, Channel) or not all(hasattr(channel, n) for n in _KOMBU_NAMES):
        return False
    if not getattr(Channel._put, _WRAPPED, False):
        with _wrap_lock:
            if not getattr(Channel._put, _WRAPPED, False):
                setattr(Channel, "_put", _reserving_put(Channel._put))  # noqa: B010
    return bool(getattr(type(channel)._put, _WRAPPED, False))  # a subclass may push otherwise


def _reserving_put(push: Callable[..., None]) -> Callable[..., None]:
    """kombu's ``Channel._put``, reserving the pending call's key as it pushes that call's
    message (a message kombu pushes onto several queues is reserved on the first)."""

    def put(channel: Any, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        pending = _PENDING.get()
        if pending is None or (message.get("headers") or {}).get("id") != pending.request.task_id:
            push(channel, queue, message, **kwargs)
        elif pending.reached:
            if pending.found is None:
                push(channel, queue, message, **kwargs)
        else:
            pending.reached = True
            _reserve_pushing(channel, pending, queue, message, kwargs, push)

    setattr(put, _WRAPPED, True)
    return put


def _reserve_pushing(
    channel: Any,
    pending: _Pending,
    queue: str,
    message: dict[str, Any],
    kwargs: dict[str, Any],
    push: Callable[..., None],
) -> None:
    """Reserve the pending call's key, pushing its message in the same step when kombu would
    push it with a plain ``LPUSH`` on the store's server; push it apart otherwise, if
    reserved."""
    on_list = _list_push(channel, pending.store, queue, message, kwargs)
    request = pending.request
    try:
        found = pending.store.reserve(request, pending.pickup, on_list)
    except (StoreUnavailable, CorruptRecord) as exc:
        # As with two trips, the message goes out unguarded, marked as not reserved. (Were the
        # store's reply lost after its script pushed it, it goes out twice under one task id:
        # the claim runs it once.)
        logger.warning("publishing %s without its key reserved: %s", request.task_name, exc)
        message.get("headers", {}).pop(publishing.RESERVED_HEADER, None)
        push(channel, queue, message, **kwargs)
        return
    if found is not None and publishing.own_reservation(found, request):
        found = None  # reserved (and pushed) by a first try whose reply was lost
    pending.found = found
    if found is None and on_list is None:
        push(channel, queue, message, **kwargs)


def _list_push(
    channel: Any, store: RedisStore, queue: str, message: dict[str, Any], kwargs: dict[str, Any]
) -> ListPush | None:
    """kombu's push of ``message`` onto ``queue`` as the store's script can make it: a plain
    ``LPUSH`` on the store's server (no key prefix, not a batch, no queue expiry to renew)."""
    from .stores.redis import ListPush  # redis-py is an optional dependency

    if (
        channel.global_keyprefix
        or kwargs.get("_publish_batch") is not None
        or queue in (channel._expires or {})
    ):
        return None
    pool = channel.pool
    if not store.same_server(pool):
        return None
    priority = channel._get_message_priority(message, reverse=False)
    encoded = dumps(message)  # type: ignore[no-untyped-call]
    database = int(pool.connection_kwargs.get("db") or 0)
    return ListPush(database, channel._q_for_pri(queue, priority), encoded)
