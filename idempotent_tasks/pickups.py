"""The pickup guard: a keyed message the broker loses is published again.

Celery's Redis transport pops a message and only then records it as unacknowledged; a worker
killed, or a Redis restarted, between the two loses the message for good. So before a keyed
task is published, the claim store records the key as ``queued`` with an envelope of the
message (:meth:`~idempotent_tasks.stores.base.Store.reserve`); a worker's claim ends that. The
beat sweep (:func:`republish_lost`) publishes again, with the same task id, every queued key no
worker claimed within ``idempotency_pickup_timeout`` seconds of when it was due, and then
after twice as long each time. A publish of a key whose message counts as lost does the same
for that key (see :mod:`idempotent_tasks.publishing`), so a lost message is found without
beat too. A message that was only slow runs no body twice: its duplicate finds the key
claimed or completed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime, time, timedelta, timezone
from typing import Any, cast

from celery.exceptions import SoftTimeLimitExceeded
from celery.utils.log import get_task_logger
from kombu.entity import Exchange, Queue
from kombu.exceptions import OperationalError
from kombu.utils import json as kombu_json

from . import defaults, signals
from .broker_errors import broker_cannot_take
from .core import despite_time_limit
from .errors import CorruptRecord, StoreUnavailable
from .records import DuePickup, Pickup
from .settings import app_setting

logger = get_task_logger(__name__)

# kombu's JSON keeps datetimes, UUIDs and decimals as Celery's own messages do. Its encoder is
# built once: kombu_json.dumps builds one per call (a third of the cost of an envelope's).
dumps = cast(Callable[[Any], str], kombu_json.JSONEncoder().encode)
loads = cast(Callable[[str], Any], kombu_json.loads)

#: Options kombu may give as entities: the guard keeps their names.
_ENTITIES = (Queue, Exchange)
#: ``apply_async`` options an envelope keeps (routing, limits, callbacks, canvas ids, headers,
#: the arguments' reprs, compression).
CARRIED_OPTIONS = (
    "queue",
    "exchange",
    "routing_key",
    "priority",
    "expires",
    "eta",
    "time_limit",
    "soft_time_limit",
    "serializer",
    "ignore_result",
    "shadow",
    "link",
    "link_error",
    "chain",
    "chord",
    "group_id",
    "group_index",
    "root_id",
    "parent_id",
    "headers",
    "retries",
    "reply_to",
    "stamped_headers",
    # What events and logs show of the arguments, where a caller hides some of them.
    "argsrepr",
    "kwargsrepr",
    "compression",
)
#: Header of a message the guard published again: how many times it was (1 the first time).
REPUBLISHED_HEADER = "idempotency_pickup_republished"
#: The sets of options :func:`envelope` had to leave out that were warned of.
_WARNED_LEFT_OUT: set[str] = set()
#: Due times of queued keys are swept this many at a time.
SWEEP_BATCH = 500


def pickup_timeout(conf: Any) -> float:
    """Seconds after which a queued message counts as lost (0: the guard is off).

    ``idempotency_pickup_timeout`` when set, else the broker's ``visibility_timeout``, the
    time after which the Redis transport itself redelivers an unacknowledged message.
    """
    configured = conf.get("idempotency_pickup_timeout")
    if configured is not None:
        return max(float(configured), 0.0)
    transport_options = conf.get("broker_transport_options") or {}
    return float(transport_options.get("visibility_timeout", defaults.PICKUP_TIMEOUT) or 0)


def claim_ttl(conf: Any, ttl_seconds: float) -> float | None:
    """How long a key not completed yet outlives its lease (its due time, while queued) when
    ``idempotency_ttl`` is too short for the guard (``None``: the TTL, long enough, or the
    guard is off).

    The guard publishes a queued key's message again at its due time, and a dead owner's a
    pickup timeout after its lease ended, at its next sweep: the record must still be there
    then, and for the copy's claim. Later re-publications (after 2x, 4x ... the timeout) are
    bounded by this as by the TTL.
    """
    timeout = pickup_timeout(conf)
    if not timeout:
        return None
    needed = 2 * timeout + float(app_setting(conf, "idempotency_dlq_poll_interval"))
    return needed if needed > ttl_seconds else None


def seconds_until(countdown: Any = None, eta: Any = None) -> float:
    """How long from now a message asks to wait before it runs.

    A countdown (other than 0) wins over an ``eta``, as Celery makes the message's eta from
    it. A naive ``eta`` is UTC, as Celery's worker reads it (not this host's local time).
    """
    if countdown:
        return max(float(countdown), 0.0)
    if eta is not None:
        return max(_seconds_to(eta), 0.0)
    return 0.0


def _seconds_to(moment: Any) -> float:
    """Seconds from now to a moment (a ``datetime``, or ISO 8601 text). A naive moment is UTC,
    as Celery's worker reads it (not this host's local time)."""
    if isinstance(moment, str) and moment.endswith(("Z", "z")):
        moment = moment[:-1] + "+00:00"  # which Python 3.10's fromisoformat does not read
    when = datetime.fromisoformat(moment) if isinstance(moment, str) else cast(datetime, moment)
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return float((when - datetime.now(timezone.utc)).total_seconds())


def seconds_to_expiry(expires: Any) -> float | None:
    """How long from now a call's ``expires`` (seconds, a moment, or one in ISO 8601) ends
    it; ``None`` for a call that does not expire. A naive moment is UTC, as for ``eta``."""
    if expires is None or isinstance(expires, bool):
        return None
    if isinstance(expires, int | float):
        return float(expires)
    try:
        return _seconds_to(expires)
    except (TypeError, ValueError, AttributeError):
        return None  # not a moment Celery would take either: it fails the publish itself


def expired(expires: Any) -> bool:
    """Whether a call's ``expires`` (as :func:`seconds_to_expiry` reads it) has passed."""
    left = seconds_to_expiry(expires)
    return left is not None and left <= 0


def call_expired(due: DuePickup) -> bool:
    """Whether the call a taken pickup keeps expired: published again, it would be dropped
    unrun (RabbitMQ drops an expired message unseen; a worker revokes it)."""
    try:
        message = loads(due.envelope.decode())
    except (UnicodeDecodeError, ValueError):
        return False
    return expired((message.get("options") or {}).get("expires"))


def end_expired_call(store: Any, due: DuePickup) -> None:
    """Free the key of a call that expired before any worker took it (its message dropped
    unseen): its reservation is cancelled, so the key's next call runs, and nothing publishes
    the expired one again."""
    try:
        # Its key claimed (a dead owner's, whose lease ended: a new call takes it over; or a
        # worker claimed it just now), or completed by another call keeping its message: only
        # the expired copy goes.
        if store.drop_pickup(due.storage_key, due.task_id):
            logger.warning("%s (%s) expired: its copy is dropped", due.task_name, due.task_id)
        elif store.cancel_reservation(due.storage_key, due.task_id):
            logger.warning(
                "%s (%s) expired before any worker took it: its key is free",
                due.task_name,
                due.task_id,
            )
    except (StoreUnavailable, CorruptRecord) as exc:
        logger.warning("could not free the key of expired call %s: %s", due.task_id, exc)


def envelope(
    args: Iterable[Any],
    kwargs: dict[str, Any],
    options: dict[str, Any],
    run_at: datetime | None = None,
) -> bytes | None:
    """The message as the sweep would publish it again, or ``None`` when its arguments cannot
    be kept as JSON (those tasks are then published unguarded); ``run_at``: the moment it is
    to run, kept as its ``eta`` (a countdown or eta of ``options`` is not)."""
    carried: dict[str, Any] = {}
    for name in CARRIED_OPTIONS:
        value = options.get(name)
        if isinstance(value, _ENTITIES):
            value = value.name
        elif name == "expires":
            value = _absolute_expiry(value)
        elif name == "eta":
            value = run_at
        if value is not None:
            carried[name] = value
    if "expires" in options and options["expires"] is None:
        # Cleared by the caller (expires=None): said so, or the sweep's send_task would give
        # the copy the task's own expiry again.
        carried["expires"] = None
    # Celery's stamps: each an option of its own, named by ``stamped_headers`` (a name without
    # its option is left out: Celery would look for it when publishing).
    stamped = [name for name in carried.pop("stamped_headers", None) or () if name in options]
    if stamped:
        carried["stamped_headers"] = stamped
        for name in stamped:
            carried.setdefault(name, options[name])
    message = {"args": list(args), "kwargs": kwargs, "options": carried}
    try:
        return dumps(message).encode()
    except (TypeError, ValueError):
        pass
    # Some option is not JSON (an exotic callback, say): keep the options that are.
    kept = {name: value for name, value in carried.items() if _jsonable(value)}
    left_out = ", ".join(sorted(set(carried) - set(kept)))
    if left_out not in _WARNED_LEFT_OUT:  # once per process for each such set of options
        _WARNED_LEFT_OUT.add(left_out)
        logger.warning(
            "the pickup guard's copies of messages leave out what JSON cannot hold (%s): sent "
            "again, such a message goes without it",
            left_out,
        )
    if "stamped_headers" in kept:
        # A stamp left out is no longer named: Celery would look for it when publishing.
        kept["stamped_headers"] = [name for name in kept["stamped_headers"] if name in kept]
    message["options"] = kept
    try:
        return dumps(message).encode()
    except (TypeError, ValueError):
        return None


def _absolute_expiry(expires: Any) -> Any:
    """``expires`` as a moment: Celery reads a number of seconds from each publish, so a
    message published again must not carry it as one (it would live on afresh)."""
    if isinstance(expires, int | float) and not isinstance(expires, bool):
        return (datetime.now(timezone.utc) + timedelta(seconds=expires)).isoformat()
    return expires


def _jsonable(value: Any) -> bool:
    try:
        dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def make_pickup(
    args: Iterable[Any],
    kwargs: dict[str, Any],
    options: dict[str, Any],
    timeout: float,
    wait: float,
    serializer: str = "json",
) -> Pickup | None:
    """The pickup of a message that runs ``wait`` seconds from now, with the re-publication
    ``timeout`` of :func:`pickup_timeout`; ``None`` when that is 0 (the guard is off: no
    envelope is built) or the message cannot be kept (see :func:`envelope`).

    The envelope is JSON. A message of another ``serializer`` (pickle, yaml, msgpack) is kept
    only if JSON gives its arguments back exactly: ``{1: 100}`` or a tuple would come back
    as ``{"1": 100}`` or a list, and run with other values than the caller's.
    """
    if timeout <= 0:
        return None
    arguments = [list(args), kwargs]
    if serializer != "json" and not _json_faithful(arguments):
        return None
    # The moment it is to run, kept: a copy sent before it (its first publish failed, and the
    # guard sends it at once) must wait for it as the call would have.
    run_at = datetime.now(timezone.utc) + timedelta(seconds=wait) if wait > 0 else None
    body = envelope(arguments[0], kwargs, options, run_at)
    if body is None:
        return None
    due_in = wait + timeout
    left = seconds_to_expiry(options.get("expires"))
    if left is not None:
        # Expired, the message may be dropped unseen (RabbitMQ does): its key is due then, for
        # the next call of the key (or the sweep) to find it ended.
        due_in = min(due_in, max(left, 0.0))
    retries = int(options.get("retries") or 0)  # a retry's, or a requeued one's
    return Pickup(envelope=body, due_in=due_in, timeout=timeout, retries=retries)


def _json_faithful(value: Any) -> bool:
    try:
        return _same(value, loads(dumps(value)))
    except (TypeError, ValueError):
        return False


def _same(original: Any, copy: Any) -> bool:
    """Whether ``copy`` is ``original`` in value and in type, all the way down: an enum member
    comes back from JSON as its value, a ``defaultdict`` as a ``dict``, a datetime of a named
    zone with a fixed offset, all of them equal to what they were."""
    if type(original) is not type(copy):
        return False
    if isinstance(original, dict):
        return original.keys() == copy.keys() and all(
            _same(value, copy[name]) for name, value in original.items()
        )
    if isinstance(original, list):
        return len(original) == len(copy) and all(map(_same, original, copy))
    if isinstance(original, datetime | time) and not _same_zone(original, copy):
        return False
    return bool(original == copy)


def _same_zone(original: datetime | time, copy: datetime | time) -> bool:
    """Whether ``copy`` (at the fixed offset kombu's JSON gives it) keeps ``original``'s zone:
    the same one, or a zone of that one offset in January and July (UTC as ``ZoneInfo``, pytz
    or dateutil); not a zone with summer time, nor one a time of day cannot be placed in."""
    if original.tzinfo == copy.tzinfo:
        return True
    offset, zone = original.utcoffset(), original.tzinfo
    if offset is None or zone is None or offset != copy.utcoffset():
        return False
    if isinstance(original, time):
        return True  # (a time's zone gives an offset only when it has one all year)
    try:
        # Asked of the zone with naive moments, which pytz places in each season.
        naive = original.replace(tzinfo=None)
        seasons = {zone.utcoffset(naive.replace(month=month, day=1)) for month in (1, 7)}
    except Exception:  # a zone of the caller's own that cannot say
        return False
    return seasons == {offset}


def republish(app: Any, due: DuePickup) -> None:
    """Publish a queued key's message again: same task, id, arguments, options and key."""
    message = loads(due.envelope.decode())
    options = dict(message["options"])
    options["headers"] = {**options.get("headers", {}), REPUBLISHED_HEADER: due.republished}
    app.send_task(
        due.task_name,
        args=message["args"],
        kwargs=message["kwargs"],
        task_id=due.task_id,
        add_to_parent=False,  # published by the sweep task, but no child of it
        **options,
    )


def republish_lost(app: Any, store: Any, batch: int = SWEEP_BATCH) -> int:
    """Publish again every queued key whose message no worker claimed in time; how many."""
    published = 0
    while True:
        try:
            taken = store.take_due(batch)
        except StoreUnavailable as exc:
            logger.warning("could not look for lost messages: %s", exc)
            return published
        except CorruptRecord as exc:
            # (a due index holding something else): the rest of the sweep, its dead letters
            # above all, goes on; the guard waits for an operator to mend or forget it.
            logger.error("could not look for lost messages: %s", exc)
            return published
        for index, due in enumerate(taken):
            if call_expired(due):
                end_expired_call(store, due)
                continue
            try:
                published += republish_taken(app, store, due, raise_unreachable=True)
            except OperationalError:
                # The broker cannot be reached: the rest of the batch is handed back as well,
                # untried, and this sweep ends (its next take would find the same keys).
                for untried in taken[index + 1 :]:
                    hand_to_guard(
                        store, untried.storage_key, untried.task_id, untried.republished - 1
                    )
                return published
        if len(taken) < batch:
            return published


def republish_taken(
    app: Any, store: Any, due: DuePickup, *, raise_unreachable: bool = False
) -> bool:
    """Publish a pickup taken from the store again, logging it; whether it went out.

    A pickup that cannot be published stays with its key: it is due again after its backoff,
    or at once when the broker could not be reached or take it for now (it goes out as soon
    as the broker is back); ``raise_unreachable`` then raises kombu's ``OperationalError``
    too.
    """
    try:
        # A soft time limit firing meanwhile (the sweep's, a task's) must not drop it: taken,
        # the pickup is not due again before its backoff, or gone with its key.
        despite_time_limit(SoftTimeLimitExceeded, lambda: republish(app, due))
    except Exception as exc:
        logger.error("could not publish %s (%s) again: %s", due.task_name, due.task_id, exc)
        if broker_cannot_take(exc):
            hand_to_guard(store, due.storage_key, due.task_id, due.republished - 1)
            if raise_unreachable:
                raise
        return False
    logger.warning(
        "published %s (%s) again: no worker claimed its message in time (%s time)",
        due.task_name,
        due.task_id,
        due.republished,
    )
    signals.lost_message_republished.send(task_name=due.task_name)
    return True


def hand_to_guard(
    store: Any, storage_key: str, task_id: str, republished: int | None = None
) -> None:
    """Make the queued key of a message the broker could not take (or a dead owner's key whose
    lost message it could not take again) due at once, for the guard to publish as soon as it
    can (``republished``: the count of re-publications to set back,
    for a take whose publish failed); a store error is logged (it is then due after its
    backoff)."""
    try:
        store.make_reservation_due(storage_key, task_id, republished)
    except (StoreUnavailable, CorruptRecord) as exc:
        logger.warning("could not hand key %r to the pickup guard at once: %s", storage_key, exc)
