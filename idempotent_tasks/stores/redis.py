"""Claim store on Redis: one Lua script per operation, one round trip each.

Each key's record is a hash and its fencing counter a string. Keys are spread over
:data:`SHARDS` shards; each shard also has a sorted set of its queued keys by due time (the
pickup guard's index). Every name carries its shard's hash tag, so a key's record, counter and
index share one Redis Cluster slot and every script touches one slot only — but for the
completion's optional side write (Celery's result record, see
:mod:`idempotent_tasks.celery_result`), made only when the store shares the result backend's
plain Redis database.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from typing import Any, NamedTuple, TypeVar
from zlib import crc32

import redis
from redis.backoff import ExponentialBackoff
from redis.commands.core import Script
from redis.exceptions import (
    AskError,
    ClusterCrossSlotError,
    NoPermissionError,
    NoScriptError,
)
from redis.retry import Retry
from redis.sentinel import SentinelConnectionPool, SentinelManagedConnection

from .. import defaults
from ..errors import CorruptRecord, SideWriteRefused, StoreUnavailable
from ..fork_safe import ForkSafeLock
from ..records import (
    ClaimRequest,
    ClaimResult,
    CompleteOutcome,
    DuePickup,
    EncodedResult,
    Outcome,
    Pickup,
    Record,
    SideWrite,
    Status,
    retry_marker,
)
from ..redis_unavailable import is_read_only, is_refusal, is_unavailable
from .base import Store

logger = logging.getLogger(__name__)

#: Prefixes whose empty hash tag was warned of in this process.
_WARNED: set[str] = set()

_T = TypeVar("_T")
_SCRIPTS = (
    "reserve",
    "read",
    "cancel",
    "make_due",
    "drop",
    "settle",
    "due",
    "take",
    "claim",
    "complete",
    "release",
    "extend",
)
#: Shards keys are spread over (each one Redis Cluster slot, with its own due index).
SHARDS = 256
#: Connection errors after which redis-py reconnects and tries the command again.
_RETRIED_ERRORS: list[type[Exception]] = [redis.ConnectionError, redis.TimeoutError]
#: What redis-py leaves unset in a URL without them, and Redis (and Celery) take by default.
_DEFAULT_PORT, _DEFAULT_DB = 6379, 0
#: Longest duration handed to a script (35 000 years): sums of a few of them and the time stay
#: below 2^53, the integers Lua's numbers hold exactly and the scripts write out as digits.
_MAX_MS = 2**50


def connection_options() -> dict[str, Any]:
    """The store's own timeouts, health checks and reconnect-and-retry, for a new client; and
    replies as bytes (a result backend URL may ask for text: results may be binary)."""
    return {
        "decode_responses": False,
        "socket_connect_timeout": 2,
        "socket_timeout": 5,
        "health_check_interval": 15,
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.02), retries=4),
        "retry_on_error": _RETRIED_ERRORS,
    }


def _lua(name: str) -> str:
    """The text of a script, after the helpers every script may use (``lua/prelude.lua``)."""
    folder = resources.files(__package__).joinpath("lua")
    prelude = folder.joinpath("prelude.lua").read_text("utf-8")
    return prelude + folder.joinpath(f"{name}.lua").read_text("utf-8")


class RedisStore(Store):
    """A :class:`~idempotent_tasks.stores.base.Store` on Redis (or Redis Cluster) via redis-py.

    Args:
        client: a redis-py client; built by :meth:`from_url` with reconnect-and-retry on.
        prefix: first part of every key name.
    """

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        opening = prefix.find("{")
        if opening >= 0 and prefix[opening + 1 : opening + 2] == "}" and prefix not in _WARNED:
            # Redis Cluster hashes a name by its first {...}, and the whole name when that is
            # empty: a key's record, fencing counter and due index would fall in other slots.
            # (Any other brace in the prefix only moves every key's names into one slot.) Said
            # once a process: RQ builds a store for every job.
            _WARNED.add(prefix)
            logger.warning(
                "the Redis claim store's key prefix %r holds an empty hash tag {}: on Redis "
                "Cluster each script would fail with CROSSSLOT; use a prefix without it",
                prefix,
            )
        self.client = client
        self.prefix = prefix
        self._scripts: dict[str, Script] = {
            name: client.register_script(_lua(name)) for name in _SCRIPTS
        }
        #: Scripts run on a connection kept for them (see :meth:`_evalsha`), but for clients that
        #: are not a plain ``redis.Redis`` (cluster clients, wrappers) or that hold one
        #: connection of their own (``single_connection_client``).
        self._direct = (
            isinstance(client, redis.Redis) and getattr(client, "connection", None) is None
        )

    @classmethod
    def from_url(cls, url: str, prefix: str) -> RedisStore:
        """Connect lazily to ``redis://`` or ``rediss://`` ``url``."""
        pool = redis.ConnectionPool.from_url(url, **connection_options())
        # The URL's own options win over those given with it: replies stay bytes all the same.
        pool.connection_kwargs["decode_responses"] = False
        return cls(redis.Redis(connection_pool=pool), prefix)

    @classmethod
    def from_connection_params(cls, params: dict[str, Any], prefix: str) -> RedisStore:
        """Connect lazily with a redis-py connection pool's ``params``: those Celery's Redis
        result backend built (its TLS settings, credentials, credential provider), so the
        default store reaches the backend's server as the backend does. The store's own
        timeouts and retries replace the backend's, and the backend's cap on its own pool
        (``redis_max_connections``) is not the store's: the store keeps one connection of its
        pool for its scripts, and needs others besides."""
        left_out = ("retry_on_timeout", "max_connections")
        kept = {name: value for name, value in params.items() if name not in left_out}
        pool = redis.ConnectionPool(**{**kept, **connection_options()})
        return cls(redis.Redis(connection_pool=pool), prefix)

    def names(self, storage_key: str) -> list[str]:
        """Redis names of a key's record, its fencing counter and its shard's due index (one
        hash tag, one slot)."""
        shard = self._shard(storage_key)
        return [f"{shard}:r:{storage_key}", f"{shard}:f:{storage_key}", f"{shard}:due"]

    def _shard(self, storage_key: str) -> str:
        return f"{self.prefix}:{{{crc32(storage_key.encode()) % SHARDS:02x}}}"

    def reserve(
        self, request: ClaimRequest, pickup: Pickup, push: ListPush | None = None
    ) -> Record | None:
        """See :meth:`Store.reserve`; with ``push``, a key reserved has its message pushed onto
        the broker's list in the same step, and a key found has nothing pushed."""
        record, _, index = self.names(request.storage_key)
        keys = [record, index]
        pushed: list[Any] = []
        if push is not None:
            keys.append(push.list_key)
            same_database = push.database == self._own_address.db
            pushed = [push.message, "" if same_database else push.database]
        reply = self._run(
            "reserve",
            keys,
            [
                request.task_id,
                request.fingerprint,
                request.key,
                request.task_name,
                _ms(pickup.due_in),
                _ms(pickup.timeout),
                _ms(request.claim_ttl),
                pickup.envelope,
                request.storage_key,
                *pushed,
            ],
        )
        if not reply:
            return None
        return _record(request.storage_key, _pairs(reply[1:]), read_at=int(reply[0]) / 1000)

    def same_server(self, pool: redis.ConnectionPool) -> bool:
        """Whether connections of ``pool`` reach this store's Redis server as the store's do,
        whatever their database: a script of the store may then write for them (asked at
        every one-trip publish: answered once per pool)."""
        try:
            known = self._same_server_pools.get(pool)
        except TypeError:  # a pool that cannot be a weak key (unhashable, say): asked each time
            return self._reaches_same_server(pool)
        if known is None:
            known = self._same_server_pools[pool] = self._reaches_same_server(pool)
        return known

    @cached_property
    def _same_server_pools(self) -> weakref.WeakKeyDictionary[redis.ConnectionPool, bool]:
        return weakref.WeakKeyDictionary()

    def _reaches_same_server(self, pool: redis.ConnectionPool) -> bool:
        if not isinstance(self.client, redis.Redis):
            return False  # a cluster: its nodes are not one server
        if _sentinel_managed(self.client.connection_pool) or _sentinel_managed(pool):
            # The master its Sentinels name for a service: no address to compare (two
            # services' pools look alike), and it may move.
            return False
        return self._own_address._replace(db=None) == _address(pool)._replace(db=None)

    @cached_property
    def _own_address(self) -> _Address:
        return _address(self.client.connection_pool)

    def cancel_reservation(self, storage_key: str, task_id: str) -> bool:
        record, _, index = self.names(storage_key)
        return bool(self._run("cancel", [record, index], [task_id, storage_key]))

    def make_reservation_due(
        self, storage_key: str, task_id: str, republished: int | None = None
    ) -> bool:
        record, _, index = self.names(storage_key)
        count = "" if republished is None else republished
        return bool(self._run("make_due", [record, index], [task_id, storage_key, count]))

    def settle_owed_message(self, request: ClaimRequest) -> bool:
        record, _, _ = self.names(request.storage_key)
        # A settlement of its own id: redis-py sends the script again when its reply is lost.
        return bool(self._run("settle", [record], [request.owner, uuid.uuid4().hex]))

    def drop_pickup(self, storage_key: str, task_id: str) -> bool:
        record, _, index = self.names(storage_key)
        return bool(self._run("drop", [record, index], [task_id, storage_key]))

    def take_due(self, limit: int) -> list[DuePickup]:
        indexes = [f"{self.prefix}:{{{shard:02x}}}:due" for shard in range(SHARDS)]
        with _translated_errors():
            pipe = self.client.pipeline(transaction=False)
            for index in indexes:
                self._scripts["due"](keys=[index], args=[limit], client=pipe)
            replies = pipe.execute(raise_on_error=False)
        members: list[str] = []
        for index, found in zip(indexes, replies, strict=True):
            if isinstance(found, Exception):
                try:
                    with _translated_errors():
                        raise found
                except CorruptRecord as exc:
                    # One index holding something else must not stop the guard for every shard.
                    logger.error("skipping due index %r in the sweep: %s", index, exc)
                    continue
            for member in found:
                try:
                    members.append(_text(member))
                except CorruptRecord as exc:
                    # No key of ours is named so (keys are text): it guards no message, and
                    # left in the index it would take a place in every sweep's batch.
                    logger.error("dropping a member of due index %r: %s", index, exc)
                    with _translated_errors():
                        self.client.zrem(index, member)
        taken: list[DuePickup] = []
        for storage_key in members:
            try:
                due = self.take(storage_key)
            except CorruptRecord as exc:
                # One unreadable key must not stop the sweep for every other one.
                logger.warning("skipping key %r in the sweep: %s", storage_key, exc)
                continue
            except StoreUnavailable:
                if not taken:
                    raise
                break  # those taken already are moved on: they must go out
            if due is not None:
                taken.append(due)
                if len(taken) == limit:
                    break
        return taken

    def take(self, storage_key: str) -> DuePickup | None:
        record, _, index = self.names(storage_key)
        # A take of its own id: redis-py sends the script again when its reply is lost.
        reply = self._run(
            "take", [record, index], [storage_key, _ms(defaults.PICKUP_TIMEOUT), uuid.uuid4().hex]
        )
        if not reply:
            return None
        return DuePickup(
            storage_key=storage_key,
            task_id=_text(reply[0]),
            task_name=_text(reply[1]),
            envelope=_bytes(reply[2]),
            republished=int(reply[3]),
        )

    def claim(self, request: ClaimRequest) -> ClaimResult:
        reply = self._run(
            "claim",
            self.names(request.storage_key)[:2],
            [
                request.owner,
                request.fingerprint,
                request.task_id,
                _ms(request.lease_seconds),
                _ms(request.claim_ttl),
                "1" if request.validate else "0",
                request.previous_owner or "",
                request.key,
                request.task_name,
                # (only a retry's: the usual claim carries one argument fewer)
                *([request.retries] if request.retries else []),
            ],
        )
        if isinstance(reply, int):  # the usual claim: acquired, its token alone
            if reply < 1:  # tokens start at 1: no claim's answer (a connection out of step?)
                raise CorruptRecord(f"the claim script answered {reply!r}, not a token")
            return ClaimResult(outcome=Outcome.ACQUIRED, token=reply)
        outcome = Outcome(_text(reply[0]))
        if outcome is Outcome.ACQUIRED:
            return ClaimResult(
                outcome=outcome,
                token=int(reply[1]),
                takeover=bool(reply[2]),
                taken_from_task_id=_text(reply[3]) or None,
                **_owed(reply[4], reply[5] if len(reply) > 5 else None),
            )
        record = _record(request.storage_key, _pairs(reply[3:]), read_at=int(reply[1]) / 1000)
        return ClaimResult(outcome=outcome, record=record)

    def complete(
        self,
        request: ClaimRequest,
        token: int,
        result: EncodedResult | None,
        side_write: SideWrite | None = None,
        *,
        owes_message: bool = False,
    ) -> CompleteOutcome:
        try:
            return self._complete(request, token, result, side_write, owes_message)
        except (StoreUnavailable, CorruptRecord) as exc:
            refusal = exc.__cause__
            if side_write is None or not is_refusal(refusal):
                raise
            # Perhaps only the side write is refused (a cluster proxy's CROSSSLOT, an ACL's
            # NOPERM on Celery's keys): the completion is made again without it.
            raise SideWriteRefused(f"Redis refused the side write: {refusal}") from exc

    def _complete(
        self,
        request: ClaimRequest,
        token: int,
        result: EncodedResult | None,
        side_write: SideWrite | None,
        owes_message: bool,
    ) -> CompleteOutcome:
        keys: list[Any] = self.names(request.storage_key)
        side: list[Any] = []
        if side_write is not None:
            keys.append(side_write.key)
            ttl = side_write.ttl_seconds
            side = [side_write.value, _ms(ttl) if ttl else 0]
        reply = self._run(
            "complete",
            keys,
            [
                request.owner,
                token,
                _ms(request.ttl_seconds),
                "1" if result is not None else "0",
                result.content_type if result else "",
                result.content_encoding if result else "",
                result.body if result else b"",
                request.fingerprint,
                request.task_id,
                request.key,
                request.task_name,
                request.storage_key,
                "1" if owes_message else "0",
                *side,
            ],
        )
        return CompleteOutcome(_text(reply))

    def shares_database_with(self, client: redis.Redis) -> bool:
        """Whether ``client`` talks to this store's Redis server and database, so a
        :class:`SideWrite` for it can be made beside a completion."""
        return self._own_address == _address(client.connection_pool)

    def release(self, request: ClaimRequest, token: int, pickup: Pickup | None = None) -> bool:
        record, fence, index = self.names(request.storage_key)
        keys = [record, index, fence]
        args: list[Any] = [request.owner, token]
        if pickup is None:
            args += ["", "", _ms(request.claim_ttl), "", request.task_id, request.storage_key]
        else:
            args += [
                _ms(pickup.due_in),
                _ms(pickup.timeout),
                _ms(request.claim_ttl),
                pickup.envelope,
                request.task_id,
                request.storage_key,
                retry_marker(pickup.retries),
            ]
        return bool(self._run("release", keys, args))

    def extend(self, request: ClaimRequest, token: int) -> bool:
        args = [request.owner, token, _ms(request.lease_seconds), _ms(request.claim_ttl)]
        return bool(self._run("extend", self.names(request.storage_key)[:2], args))

    def result_byte_limit(self) -> None:
        return None

    def get(self, storage_key: str) -> Record | None:
        reply = self._run("read", self.names(storage_key)[:1], [])
        if len(reply) == 1:
            return None
        return _record(storage_key, _pairs(reply[1:]), read_at=int(reply[0]) / 1000)

    def forget(self, storage_key: str) -> bool:
        with _translated_errors():
            return bool(self.client.delete(self.names(storage_key)[0]))

    def close(self) -> None:
        kept = _own_kept_connection(self.client.connection_pool)
        if kept is not None:
            with kept.lock:
                kept.hand_back()
        self.client.connection_pool.disconnect()

    def _run(self, script: str, keys: list[Any], args: list[Any]) -> Any:
        loaded = self._scripts[script]
        with _translated_errors():
            try:
                return self._evalsha(loaded.sha, keys, args)
            except NoScriptError:
                # Redis restarted or flushed its scripts since: load this one again and rerun.
                # (On the connection kept for scripts: a pool capped at one has no other.)
                self._on_kept_connection(
                    ("SCRIPT", "LOAD", loaded.script),
                    lambda: self.client.script_load(loaded.script),
                )
                return self._evalsha(loaded.sha, keys, args)

    def _on_kept_connection(self, command: tuple[Any, ...], otherwise: Callable[[], Any]) -> Any:
        """Send ``command`` on the connection kept for scripts (see :meth:`_evalsha`), or call
        ``otherwise`` while another thread uses it, or for clients that keep none."""
        if self._direct:
            kept = _kept_connection(self.client.connection_pool)
            if kept.lock.acquire(blocking=False):
                try:
                    return kept.execute(command)
                finally:
                    kept.lock.release()
        return otherwise()

    def _evalsha(self, sha: str, keys: list[Any], args: list[Any]) -> Any:
        """Run a loaded script: one round trip.

        Scripts run on a connection of the client's pool kept checked out for them (one per
        pool and process), not through ``Redis.execute_command``: redis-py 8 spends about 40 us
        of CPU per command around the round trip itself (pool checkout and return,
        observability hooks), and a task pays for three scripts. While another thread uses
        that connection, or for other clients, the script goes through the client as usual.
        """
        return self._on_kept_connection(
            ("EVALSHA", sha, len(keys), *keys, *args),
            lambda: self.client.evalsha(sha, len(keys), *keys, *args),
        )


@dataclass(frozen=True)
class ListPush:
    """A broker message that :meth:`RedisStore.reserve` pushes onto a list of the same Redis
    server (kombu's Redis transport: a queue is a list), in the same step as the reservation."""

    database: int
    list_key: str
    message: str | bytes


class _KeptConnection:
    """A connection checked out of a pool for scripts, and the lock of whoever uses it."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.connection: Any = None  # redis-py's connection classes carry no annotations

    def execute(self, command: tuple[Any, ...]) -> Any:
        """Send ``command`` and read its reply (the caller holds :attr:`lock`), retrying on
        connection errors with the connection's retry policy, as the client does."""
        connection = self._checked_out()
        return connection.retry.call_with_retry(
            lambda: self._round_trip(command), lambda _error: self.hand_back(broken=True)
        )

    def hand_back(self, broken: bool = False) -> None:
        """Return the connection to its pool (dropped first if ``broken``)."""
        connection, self.connection = self.connection, None
        if connection is not None:
            if broken:
                connection.disconnect()
            self.pool.release(connection)

    def _checked_out(self) -> Any:
        if self.connection is None:
            # Checking out connects as the pool does: a Sentinel pool asks for the master here.
            self.connection = self.pool.get_connection()
        return self.connection

    def _round_trip(self, command: tuple[Any, ...]) -> Any:
        connection = self._checked_out()
        try:
            connection.send_command(*command)
            reply = connection.read_response()
        except redis.ResponseError as exc:
            # An error reply: the connection is in step, nothing is left to read. But a
            # replica's READONLY (a master demoted by a failover) asks for a new connection:
            # made again, it reaches whichever server the name or the Sentinels give now.
            if is_read_only(exc):
                self.hand_back(broken=True)
                self.pool.disconnect(inuse_connections=False)  # the pool's idle ones too
            raise
        except BaseException:
            # Whatever interrupted the round trip (a soft time limit, a signal) may have left
            # the reply unread, for the next command to take as its own: drop the connection.
            # (The pool checks for this when a connection is checked out; this one stays out.)
            self.hand_back(broken=True)
            raise
        if getattr(connection, "should_reconnect", bool)():
            self.hand_back(broken=True)  # the server asked (maintenance): the pool reconnects
        return reply


#: Guards the creation of kept connections.
_KEPT_LOCK = ForkSafeLock()
#: Attribute of a connection pool holding its kept connection.
_KEPT_ATTRIBUTE = "_idempotent_tasks_kept_connection"


def _kept_connection(pool: Any) -> _KeptConnection:
    """The kept connection of ``pool`` in this process: every store on one client shares it.

    It lives on the pool itself, so it goes when the pool goes. A forked child makes its own
    (the parent's connection, and maybe its held lock, are the parent's).
    """
    kept = _own_kept_connection(pool)
    if kept is None:
        with _KEPT_LOCK:
            kept = _own_kept_connection(pool)
            if kept is None:
                kept = _KeptConnection(pool)
                setattr(pool, _KEPT_ATTRIBUTE, kept)
    return kept


def _own_kept_connection(pool: Any) -> _KeptConnection | None:
    """The kept connection this process made for ``pool``, if it made one."""
    kept: _KeptConnection | None = getattr(pool, _KEPT_ATTRIBUTE, None)
    return kept if kept is not None and kept.pid == os.getpid() else None


@contextmanager
def _translated_errors() -> Iterator[None]:
    """Every Redis error as the store's: unreachable or refusing for now (the claim then fails
    closed: the task is tried again later), or a record the scripts cannot work with."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise StoreUnavailable(f"Redis store unreachable: {exc}") from exc
    except redis.ResponseError as exc:
        if is_unavailable(exc) or isinstance(exc, NoPermissionError):
            raise StoreUnavailable(f"Redis store refuses the store's commands: {exc}") from exc
        if isinstance(exc, AskError | ClusterCrossSlotError):  # MOVED is an ASK too
            # A plain client on one node of a Redis Cluster, and a key another node serves:
            # the record is not the matter, and the call must not be dead-lettered for it.
            raise StoreUnavailable(
                f"the store's Redis is a cluster node that does not serve this key ({exc}); "
                "point idempotency_store_url at a server or proxy that serves every key"
            ) from exc
        if "unknown command" in str(exc):
            raise StoreUnavailable(f"the store's Redis does not run scripts: {exc}") from exc
        if "WRONGTYPE" in str(exc):
            raise CorruptRecord(f"Redis key holds something else than a record: {exc}") from exc
        # A script that failed on what it found: a record edited into something unreadable.
        raise CorruptRecord(f"Redis could not run the store's script on the record: {exc}") from exc
    except redis.RedisError as exc:
        # The client cannot even connect as configured (a TLS option redis-py refuses, say):
        # failing closed keeps the task to try again once that is mended.
        raise StoreUnavailable(f"Redis store cannot be used: {exc}") from exc


class _Address(NamedTuple):
    """Where a pool's connections go and as whom: server, database and credentials."""

    connection_class: Any
    host: str | None
    path: str | None
    port: int
    db: int | None
    username: str | None
    password: str | None
    credential_provider: int


def _sentinel_managed(pool: Any) -> bool:
    """Whether ``pool`` connects to whichever master Redis Sentinel names."""
    return isinstance(pool, SentinelConnectionPool) or issubclass(
        getattr(pool, "connection_class", object), SentinelManagedConnection
    )


def _address(pool: redis.ConnectionPool) -> _Address:
    kwargs = pool.connection_kwargs
    port, db = kwargs.get("port"), kwargs.get("db")
    return _Address(
        pool.connection_class,
        kwargs.get("host"),
        kwargs.get("path"),
        _DEFAULT_PORT if port is None else int(port),
        _DEFAULT_DB if db is None else int(db),
        kwargs.get("username"),
        kwargs.get("password"),
        id(kwargs.get("credential_provider")),
    )


def _ms(seconds: float) -> int:
    """Milliseconds for a script, at least 1 and at most :data:`_MAX_MS`."""
    return min(max(1, round(seconds * 1000)), _MAX_MS)


def _text(value: bytes | str) -> str:
    """A reply's text; bytes that are not UTF-8 (a record written by something else) make a
    :class:`CorruptRecord`."""
    if isinstance(value, str):
        return value
    try:
        return value.decode()
    except UnicodeDecodeError as exc:
        raise CorruptRecord(f"the store holds bytes that are not UTF-8: {value[:40]!r}") from exc


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value


def _owed(task_id: bytes | str, envelope: bytes | str | None) -> dict[str, Any]:
    """The fields of a claim's answer that name the message it owes, if any."""
    if not task_id or not envelope:
        return {}
    return {"owed_task_id": _text(task_id), "taken_over_envelope": _bytes(envelope)}


def _pairs(flat: list[bytes]) -> dict[str, bytes]:
    return {_text(flat[i]): flat[i + 1] for i in range(0, len(flat) - 1, 2)}


def _field(fields: dict[str, bytes], name: str, convert: Callable[[str], _T]) -> _T:
    try:
        return convert(_text(fields[name]))
    except (KeyError, ValueError, CorruptRecord) as exc:
        raise CorruptRecord(f"record field {name!r} is missing or unreadable") from exc


def _record(storage_key: str, fields: dict[str, bytes], read_at: float | None = None) -> Record:
    # (Text from a client of the caller's that decodes its replies.)
    cached = fields.get("result_cached") in (b"1", "1") and "result" in fields
    result = None
    if cached:
        result = EncodedResult(
            content_type=_field(fields, "content_type", str),
            content_encoding=_field(fields, "content_encoding", str),
            body=_bytes(fields["result"]),
        )
    return Record(
        storage_key=storage_key,
        key=_field(fields, "key", str),
        task_name=_field(fields, "task_name", str),
        status=_field(fields, "status", Status),
        owner=_field(fields, "owner", str),
        token=_field(fields, "token", int),
        task_id=_field(fields, "task_id", str),
        fingerprint=_field(fields, "fingerprint", str),
        lease_expires_at=_field(fields, "lease_expires_at", float) / 1000,
        created_at=_field(fields, "created_at", float) / 1000,
        updated_at=_field(fields, "updated_at", float) / 1000,
        expires_at=_field(fields, "expires_at", float) / 1000,
        result=result,
        result_cached=cached,
        read_at=read_at,
    )
