"""A keyed call's reservation and its message's publish in one Redis round trip.

When the broker is kombu's Redis transport on the claim store's Redis server (one Redis for
broker, result backend and store, as most set-ups have it), the reservation script also pushes
the message onto the queue's list, and a key found with a record has nothing pushed. The
producer then makes one round trip per call, as plain Celery does, instead of two; and no
producer can die between reserving a key and publishing its message.

The message is the one Celery builds: the call goes through Celery's ``apply_async`` as usual,
and only the last step, kombu's push onto the list (``Channel._put``), is taken over for that
one message. So it is kept to the plain case: a call made outside a running task (whose
children Celery records as it publishes), not part of a canvas, with the pickup guard on, and
whose key this process has not published lately (a key sent again is likely answered from its
record, which this path learns only after Celery has built the whole message). Everything else
takes :func:`idempotent_tasks.publishing.reserve`'s two round trips, with the same outcome.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery.result import AsyncResult
from kombu.exceptions import OperationalError

from . import publishing
from .app_store import store_for
from .errors import CorruptRecord, StoreUnavailable
from .pickups import hand_to_guard
from .records import ClaimRequest, Pickup, Record

if TYPE_CHECKING:
    from .stores.redis import ListPush, RedisStore
    from .task import IdempotentTask

logger = logging.getLogger(__name__)

#: How many keys a process remembers having published, to send them again the two-trip way.
RECENT_KEYS = 4096

#: What this module uses of kombu's Redis channel (kombu 5).
_KOMBU_NAMES = ("_put", "_q_for_pri", "_get_message_priority", "_expires")
#: Marks a kombu channel whose ``_put`` this module took over.
_HOOKED = "_idempotent_tasks_reserving_put"


@dataclass
class _Pending:
    """The reservation to make with one message's push, and what became of it."""

    store: RedisStore
    request: ClaimRequest
    pickup: Pickup
    database: int
    #: kombu was about to push the message (the reservation was tried).
    reached: bool = False
    #: The store holds this call's reservation (whether or not the message went out).
    reserved: bool = False
    #: The record the key had: nothing was pushed.
    found: Record | None = None


_PENDING: ContextVar[_Pending | None] = ContextVar(
    "idempotent_tasks_reserve_and_push", default=None
)


class _RecentKeys:
    """The keys this process published lately, the oldest forgotten first."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._keys: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._lock = threading.Lock()

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


def publish(
    task: IdempotentTask,
    key: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    task_id: str,
    options: dict[str, Any],
    producer: Any,
    send: Callable[[Any], AsyncResult],
) -> Any:
    """Publish a keyed call reserving its key in the same round trip, or answer it from the
    key's record; ``None`` when that cannot be done here (publish it the two-trip way).

    ``options`` are the call's options, as :func:`publishing.reserve` takes them; ``send``
    publishes the message through Celery with the producer it is given.
    """
    if _recent.seen(task.name, key) or _PENDING.get() is not None:
        return None
    conf = task.app.conf
    if (
        task.app.current_worker_task is not None
        or conf.task_always_eager
        # Its monitors would see a task-sent event for a message never sent.
        or conf.task_send_sent_event
    ):
        return None
    store = _redis_store(store_for(task.app))
    if store is None:
        return None
    request, pickup = publishing.prepare(task, key, args, kwargs, task_id, options)
    if pickup is None:
        return None
    with task.app.producer_or_acquire(producer) as ready_producer:
        database = _broker_database(ready_producer.channel, store)
        if database is None:
            return None
        pending = _Pending(store, request, pickup, database)
        token = _PENDING.set(pending)
        try:
            result = send(ready_producer)
        except OperationalError:
            if pending.reached:
                # As with two trips: the call, if reserved, stays for the guard to publish.
                hand_to_guard(store, request.storage_key, request.task_id)
            raise
        except Exception:
            if pending.reached:  # a reservation made, or maybe made, before the push failed
                publishing.cancel_reservation(task, request)
            raise
        finally:
            _PENDING.reset(token)
    if not pending.reached:
        _reserve_after(store, request, pickup)
        return result
    if pending.found is None:
        return result  # reserved and pushed; or pushed without a look, the store unreachable
    del result  # never published: dropping it ends its result subscription
    return publishing.answer_from_record(task, pending.found, request)


def _reserve_after(store: RedisStore, request: ClaimRequest, pickup: Pickup) -> None:
    """Reserve the key of a message kombu published another way than a list push (a fanout
    exchange, an older message protocol), for the pickup guard: as the reservation before the
    publish would have, but for the record of a claim or a duplicate that came first."""
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


def _broker_database(channel: Any, store: RedisStore) -> int | None:
    """The database of the broker's queues when ``channel`` is kombu's Redis transport on
    ``store``'s server (its ``_put`` then taken over for pending calls), else ``None``."""
    try:
        from kombu.transport.redis import Channel
    except ImportError:
        return None
    if not isinstance(channel, Channel) or channel.global_keyprefix:
        return None
    if not all(hasattr(channel, name) for name in _KOMBU_NAMES):
        return None  # a kombu whose Redis channel pushes otherwise
    pool = channel.pool
    if not store.same_server(pool):
        return None
    if not channel.__dict__.get(_HOOKED):
        setattr(channel, "_put", _reserving_put(channel, channel._put))  # noqa: B010
        channel.__dict__[_HOOKED] = True
    return int(pool.connection_kwargs.get("db") or 0)


def _reserving_put(channel: Any, push: Callable[..., None]) -> Callable[..., None]:
    """kombu's ``_put`` of ``channel``, reserving the pending call's key as it pushes that
    call's message (a message kombu pushes onto several queues is reserved on the first)."""

    def put(queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        pending = _PENDING.get()
        if pending is None or (message.get("headers") or {}).get("id") != pending.request.task_id:
            push(queue, message, **kwargs)
        elif pending.reached:
            if pending.found is None:
                push(queue, message, **kwargs)
        else:
            pending.reached = True
            _reserve_pushing(channel, pending, queue, message, kwargs, push)

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
    push it with a plain ``LPUSH``; push it apart otherwise, only if reserved."""
    on_list = _list_push(channel, queue, message, kwargs, pending.database)
    request = pending.request
    try:
        found = pending.store.reserve(request, pending.pickup, on_list)
    except (StoreUnavailable, CorruptRecord) as exc:
        logger.warning("publishing %s without a look at its key: %s", request.task_name, exc)
        push(queue, message, **kwargs)
        return
    if found is not None and publishing.own_reservation(found, request):
        found = None  # reserved (and pushed) by a first try whose reply was lost
    pending.found = found
    pending.reserved = found is None
    if found is None and on_list is None:
        push(queue, message, **kwargs)


def _list_push(
    channel: Any, queue: str, message: dict[str, Any], kwargs: dict[str, Any], database: int
) -> ListPush | None:
    """kombu's push of ``message`` onto ``queue`` as a list push, if that is all it would be
    (not a batch, not a queue with an expiry to renew)."""
    from kombu.utils.json import dumps

    from .stores.redis import ListPush

    if kwargs.get("_publish_batch") is not None or queue in (channel._expires or {}):
        return None
    priority = channel._get_message_priority(message, reverse=False)
    encoded = dumps(message)  # type: ignore[no-untyped-call]
    return ListPush(database, channel._q_for_pri(queue, priority), encoded)
