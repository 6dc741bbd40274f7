"""The records a store keeps and the answers its operations give."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .text_enum import TextEnum


class Status(TextEnum):
    """State of a key's record."""

    #: A message for the key was published and no worker has claimed it yet.
    QUEUED = "queued"
    PROCESSING = "processing"
    COMPLETED = "completed"


class Outcome(TextEnum):
    """What an atomic claim found, and so what the worker must do."""

    ACQUIRED = "acquired"
    COMPLETED = "completed"
    IN_PROGRESS = "in_progress"
    MISMATCH = "mismatch"


class CompleteOutcome(TextEnum):
    """What a completion write did."""

    STORED = "stored"
    #: The record had vanished (expired, or lost with a store that keeps nothing on disk); the
    #: result was written anyway, since this execution did finish and no one else holds the key.
    RECOVERED = "recovered"
    #: Another owner holds the key now (it was taken over): nothing was written.
    STALE = "stale"


@dataclass(frozen=True, kw_only=True)
class EncodedResult:
    """A task's return value as stored: kombu content type, encoding and bytes."""

    content_type: str
    content_encoding: str
    body: bytes


@dataclass(frozen=True, kw_only=True)
class SideWrite:
    """A value a completion writes and publishes beside its record, in the same atomic step.

    The Celery adapter uses it for Celery's own result record when the store and the result
    backend are one Redis database: the completion then also stands for the backend's write.
    ``ttl_seconds`` of ``None`` (or 0) keeps the value until deleted.
    """

    key: bytes
    value: bytes
    ttl_seconds: float | None


@dataclass(frozen=True, kw_only=True)
class ClaimRequest:
    """Everything a store needs to claim one key for one execution attempt.

    ``lease_seconds`` is how long the claim lives without a heartbeat; ``previous_owner`` is the
    owner of the attempt this one retries, whose claim this attempt may take over at once.
    """

    storage_key: str
    key: str
    task_name: str
    task_id: str
    owner: str
    fingerprint: str
    lease_seconds: float
    ttl_seconds: float
    validate: bool = True
    previous_owner: str | None = None
    #: How many retries the claiming message counts (Celery's ``request.retries``): a key
    #: queued for a later retry of the same call is not taken by it (see :func:`retry_marker`).
    retries: int = 0
    #: How long a key not completed yet outlives its lease, or its due time while queued
    #: (``None``: ``ttl_seconds``). The pickup guard looks for a key whose message counts as
    #: lost at its due time, or a pickup timeout after a dead owner's lease: a TTL shorter than
    #: that would let the record, and the message kept with it, go first.
    claim_ttl_seconds: float | None = None

    @property
    def claim_ttl(self) -> float:
        """Seconds a key not completed yet outlives its lease or its due time."""
        return self.ttl_seconds if self.claim_ttl_seconds is None else self.claim_ttl_seconds


@dataclass(frozen=True, kw_only=True)
class Record:
    """One key's stored state. Times are POSIX seconds from the store's clock."""

    storage_key: str
    key: str
    task_name: str
    status: Status
    #: The claim's owner; of a ``queued`` record, the message it waits for (see
    #: :func:`retry_marker`), or ``""``.
    owner: str
    token: int
    task_id: str
    fingerprint: str
    lease_expires_at: float
    created_at: float
    updated_at: float
    expires_at: float
    result: EncodedResult | None = None
    #: False when the result was too big or could not be serialized: duplicates get ``None``.
    result_cached: bool = False
    #: The store's clock when :meth:`Store.reserve` or :meth:`Store.get` read the record, so
    #: a caller on another host judges its lease by the clock that wrote it (``None``: unknown).
    read_at: float | None = None

    def store_time(self) -> float:
        """The store's time when this record was read, else this host's time now."""
        return time.time() if self.read_at is None else self.read_at


@dataclass(frozen=True, kw_only=True)
class ClaimResult:
    """The answer of :meth:`Store.claim`.

    ``token`` is this attempt's fencing token when ``outcome`` is ``ACQUIRED``; ``record`` is the
    record found otherwise; ``takeover`` says the claim replaced an expired or retried owner.
    ``taken_from_task_id`` is the task id of another call whose live claim or queued message
    this claim replaced (its lease ended, or its message counts as lost): its callers wait on
    that id, which may never run again. ``taken_over_envelope`` is the pickup envelope of a
    message this claim owes, of the call ``owed_task_id``: that call's ``queued`` message, when
    the claim replaced one (the message counts as lost), or one a dead owner owed, which passes
    on to the claim that takes its key over. Once this call completes, that message is
    published again, so its call answers with the key's value and its callbacks, chord part or
    reply follow. The same call's claim made again is told the same, the message while still
    owed (the guard did not publish it meanwhile).
    """

    outcome: Outcome
    token: int = 0
    record: Record | None = None
    takeover: bool = False
    taken_from_task_id: str | None = None
    owed_task_id: str | None = None
    taken_over_envelope: bytes | None = None


@dataclass(frozen=True, kw_only=True)
class Pickup:
    """What a store keeps of a published message until a worker claims its key, so the
    message can be published again if the broker loses it.

    ``envelope`` is opaque to the store (the adapter's own encoding of the message). The
    message counts as lost ``due_in`` seconds from now; each later re-publication waits twice
    as long as the one before, starting from ``timeout``.
    """

    envelope: bytes
    due_in: float
    timeout: float
    #: How many retries the message counts: a release with this pickup queues the key for it
    #: (see :func:`retry_marker`).
    retries: int = 0


@dataclass(frozen=True, kw_only=True)
class DuePickup:
    """A key whose message no worker claimed in time, taken by one sweep (a queued key, or one
    keeping that message: see :meth:`~idempotent_tasks.stores.base.Store.take_due`).

    ``republished`` counts re-publications including this one (1 the first time).
    """

    storage_key: str
    task_name: str
    task_id: str
    envelope: bytes
    republished: int


#: The retries a message counts that is newer than every retry of its call: a dead letter's
#: re-publication, which its sweep orders after every earlier message of the call (a worker
#: drops a dead letter's message of an earlier sweep before it claims).
LATEST_MESSAGE = 2**53 - 1


def retry_marker(retries: int) -> str:
    """What a ``queued`` record keeps as its owner while it waits for the message of a retry
    counting ``retries`` retries (``""`` for a message counting none: it waits for any).

    A message of the same call that counts fewer retries is an older one (redelivered after a
    visibility timeout, or the guard's copy of a message slow to arrive): taking the key, it
    would run the call before the retry's countdown is over, its retries counted anew.
    """
    return f"retry {retries}" if retries > 0 else ""


def older_message(owner: str, retries: int) -> bool:
    """Whether a message of a ``queued`` record's own call, counting ``retries`` retries, is
    older than the one the record waits for (its ``owner``: see :func:`retry_marker`). An
    owner that does not read as a marker waits for no particular message."""
    count = owner.removeprefix("retry ")
    return count != owner and count.isascii() and count.isdigit() and retries < int(count)
