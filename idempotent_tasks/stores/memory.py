"""Claim store in this process's memory: for tests and single-process apps.

Every operation holds one lock, so it is as atomic as the server stores' scripts; nothing is
shared with other processes (a prefork worker's children each get their own).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable

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
    older_message,
    retry_marker,
)
from .base import Store, refuse_side_write

#: Largest power of two a pickup's re-publication backoff grows to.
MAX_BACKOFF_EXPONENT = 20
#: Seconds (of the store's clock) between sweeps of expired records: one no call touches
#: again would otherwise stay for ever, as would its fencing counter.
SWEEP_EVERY = 60.0


@dataclasses.dataclass
class _Taken:
    """The call a key's claim took the key from, and whether it owes the message the key keeps
    (that call's, or one a dead owner owed before: see claim.lua)."""

    task_id: str
    owes_message: bool


@dataclasses.dataclass
class _Pending:
    """A key's pickup: its message (``task_id``'s: a claim by another call keeps it so, see
    claim.lua), when it is due and how often it was published again."""

    pickup: Pickup
    task_id: str
    due_at: float
    republished: int = 0


class MemoryStore(Store):
    """A :class:`~idempotent_tasks.stores.base.Store` in a dict, with an injectable clock."""

    def __init__(
        self, clock: Callable[[], float] = time.time, sweep_every: float = SWEEP_EVERY
    ) -> None:
        """``sweep_every``: seconds of ``clock`` between sweeps of expired keys (``math.inf``:
        none, as a SQL store whose cleanup does not run)."""
        self._clock = clock
        self._sweep_every = sweep_every
        self._lock = threading.Lock()
        self._records: dict[str, Record] = {}
        self._fences: dict[str, int] = {}
        #: When the fencing counter of a key without a record may go: its last record's expiry.
        self._fences_until: dict[str, float] = {}
        self._pending: dict[str, _Pending] = {}
        self._taken: dict[str, _Taken] = {}
        # (``math.inf``: not even once, at the first call)
        self._next_sweep = math.inf if sweep_every == math.inf else 0.0

    def reserve(self, request: ClaimRequest, pickup: Pickup) -> Record | None:
        with self._lock:
            now = self._clock()
            self._sweep(now)
            found = self._live(request.storage_key, now)
            if found is not None:
                return dataclasses.replace(found, read_at=now)
            self._queue(request, pickup, now, created_at=now, token=0)
            return None

    def cancel_reservation(self, storage_key: str, task_id: str) -> bool:
        with self._lock:
            found = self._live(storage_key, self._clock())
            if found is not None and found.status is Status.COMPLETED:
                return self._drop_kept_message(storage_key, found, task_id)
            if found is None or found.status is not Status.QUEUED or found.task_id != task_id:
                return False
            self._drop(storage_key)
            return True

    def make_reservation_due(
        self, storage_key: str, task_id: str, republished: int | None = None
    ) -> bool:
        with self._lock:
            now = self._clock()
            found = self._live(storage_key, now)
            pending = self._pending.get(storage_key)
            if found is None or pending is None or pending.task_id != task_id:
                return False
            if found.status is Status.QUEUED:
                self._records[storage_key] = dataclasses.replace(
                    found, lease_expires_at=now, updated_at=now
                )
            elif found.status is Status.COMPLETED:
                if pending.task_id == found.task_id:
                    return False  # not a message the key keeps for another call
            else:
                taken = self._taken.get(storage_key)
                if pending.task_id != found.task_id and taken is not None:
                    # Another call's message, which the guard could not publish: the owner
                    # owes it again, alive or not (see make_due.lua).
                    taken.owes_message = True
                if found.lease_expires_at > now:
                    return False  # its owner is alive (it renewed its lease since)
            pending.due_at = now
            if republished is not None:
                pending.republished = republished
            return True

    def drop_pickup(self, storage_key: str, task_id: str) -> bool:
        with self._lock:
            found = self._live(storage_key, self._clock())
            if found is not None and found.status is Status.COMPLETED:
                return self._drop_kept_message(storage_key, found, task_id)
            if found is None or found.status is not Status.PROCESSING:
                return False
            pending = self._pending.get(storage_key)
            if pending is not None and pending.task_id == task_id:
                del self._pending[storage_key]
                if (taken := self._taken.get(storage_key)) is not None:
                    taken.owes_message = False  # its message is gone (see drop.lua)
                return True
            return found.task_id == task_id

    def take_due(self, limit: int) -> list[DuePickup]:
        with self._lock:
            now = self._clock()
            taken: list[DuePickup] = []
            for storage_key in list(self._pending):
                if len(taken) == limit:
                    break
                due = self._take(storage_key, now)
                if due is not None:
                    taken.append(due)
            return taken

    def take(self, storage_key: str) -> DuePickup | None:
        with self._lock:
            return self._take(storage_key, self._clock())

    def _take(self, storage_key: str, now: float) -> DuePickup | None:
        pending = self._pending.get(storage_key)
        if pending is None:
            return None
        found = self._live(storage_key, now)
        if found is None or (found.status is Status.COMPLETED and pending.task_id == found.task_id):
            self._pending.pop(storage_key, None)
            return None
        due = pending.due_at
        if found.status is Status.PROCESSING:
            # Claimed: lost only if its owner's lease ended a timeout ago, untaken.
            due = max(due, found.lease_expires_at + pending.pickup.timeout)
        if due > now:
            return None
        pending.republished += 1
        backoff = 2 ** min(pending.republished, MAX_BACKOFF_EXPONENT)
        pending.due_at = now + pending.pickup.timeout * backoff
        if found.status is Status.QUEUED:
            self._records[storage_key] = dataclasses.replace(
                found, lease_expires_at=pending.due_at, updated_at=now
            )
        elif found.status is Status.PROCESSING:
            self._records[storage_key] = dataclasses.replace(found, updated_at=now)
            if (taken := self._taken.get(storage_key)) is not None:
                taken.owes_message = False  # the guard publishes it: no owner owes it now
        return DuePickup(
            storage_key=storage_key,
            task_name=found.task_name,
            task_id=pending.task_id,
            envelope=pending.pickup.envelope,
            republished=pending.republished,
        )

    def claim(self, request: ClaimRequest) -> ClaimResult:
        with self._lock:
            now = self._clock()
            self._sweep(now)
            found = self._live(request.storage_key, now)
            if found is None:
                return self._acquire(
                    request, now, created_at=now, takeover=False, fingerprint=request.fingerprint
                )
            found = dataclasses.replace(found, read_at=now)
            # The record's own message (a redelivery, or a retry with other arguments perhaps)
            # is the same call: the key keeps the caller's fingerprint.
            same_call = found.task_id == request.task_id
            kept = found.fingerprint if same_call else request.fingerprint
            mismatch = (
                request.validate and found.fingerprint != request.fingerprint and not same_call
            )
            # What this claim tells (see claim.lua): replacing another call's record, it takes
            # the key from that call, and owes that call's queued message, lost, or the message
            # a dead owner owed; the same call's claim made again is told what its first one was.
            taken = self._taken.get(request.storage_key)
            if not same_call:
                pending = self._pending.get(request.storage_key)
                owed_before = (
                    taken is not None
                    and taken.owes_message
                    and not (pending is not None and pending.task_id == request.task_id)
                )
                taken = _Taken(found.task_id, found.status is Status.QUEUED or owed_before)
            if found.status is Status.QUEUED:
                if mismatch:
                    return ClaimResult(outcome=Outcome.MISMATCH, record=found)
                if (not same_call and found.lease_expires_at > now) or (
                    same_call and older_message(found.owner, request.retries)
                ):
                    # Its own message runs it (see claim.lua): another one, or an older message
                    # of the call while it is queued for a retry, waits.
                    return ClaimResult(outcome=Outcome.IN_PROGRESS, record=found)
                # The pickup stays (its count too): should this owner die with its message, it
                # is sent again.
                return self._acquire(
                    request,
                    now,
                    created_at=found.created_at,
                    takeover=False,
                    fingerprint=kept,
                    taken=taken,
                )
            if found.status is Status.PROCESSING and found.owner == request.owner:
                # Its claim made again (its reply lost).
                again = ClaimResult(outcome=Outcome.ACQUIRED, token=found.token)
                return self._told(again, request, taken)
            if mismatch:
                return ClaimResult(outcome=Outcome.MISMATCH, record=found)
            if found.status is Status.COMPLETED:
                self._drop_kept_message(request.storage_key, found, request.task_id)
                return ClaimResult(outcome=Outcome.COMPLETED, record=found)
            previous = request.previous_owner
            if (previous and found.owner == previous) or found.lease_expires_at <= now:
                return self._acquire(
                    request,
                    now,
                    created_at=found.created_at,
                    takeover=True,
                    fingerprint=kept,
                    taken=taken,
                )
            return ClaimResult(outcome=Outcome.IN_PROGRESS, record=found)

    def _told(
        self, acquired: ClaimResult, request: ClaimRequest, taken: _Taken | None
    ) -> ClaimResult:
        """``acquired``, naming the call it took the key from, and the message it owes, if
        any (not the claiming call's own: owed to no one)."""
        if taken is None:
            return acquired
        told = dataclasses.replace(acquired, taken_from_task_id=taken.task_id)
        pending = self._others_message(request)
        if not taken.owes_message or pending is None:
            return told
        return dataclasses.replace(
            told, owed_task_id=pending.task_id, taken_over_envelope=pending.pickup.envelope
        )

    def complete(
        self,
        request: ClaimRequest,
        token: int,
        result: EncodedResult | None,
        side_write: SideWrite | None = None,
        *,
        owes_message: bool = False,
    ) -> CompleteOutcome:
        refuse_side_write(self, side_write)
        with self._lock:
            now = self._clock()
            found = self._live(request.storage_key, now)
            outcome = CompleteOutcome.STORED
            kept = None
            expires_at = now + request.ttl_seconds
            if found is None or found.status is Status.QUEUED:
                outcome = CompleteOutcome.RECOVERED
                pending = self._pending.pop(request.storage_key, None)
                if (
                    found is not None
                    and found.task_id != request.task_id
                    and found.fingerprint == request.fingerprint
                    and pending is not None
                ):
                    # Another call's reservation, for the same arguments: the key keeps its
                    # pickup, as long as the reservation would have lived (see complete.lua)
                    kept = pending
                    expires_at = max(expires_at, found.expires_at)
                # The debt of the claim the store lost, unless a later claim queued the key
                # since (it took the debt over, and settled it: see complete.lua).
                owes_message = owes_message and (found is None or found.token <= token)
                # Tokens never go back: the record keeps the key's highest token given.
                token = max(token, self._fences.get(request.storage_key, 0))
                self._fences[request.storage_key] = token
                found = self._new_record(request, token, now, created_at=now)
                self._taken.pop(request.storage_key, None)
                if owes_message:
                    self._taken[request.storage_key] = _Taken("", owes_message=True)
            elif found.status is Status.COMPLETED and found.owner == request.owner:
                return CompleteOutcome.STORED  # a repeated completion
            elif found.owner != request.owner or found.token != token:
                return CompleteOutcome.STALE
            self._pending.pop(request.storage_key, None)
            if kept is not None:
                self._pending[request.storage_key] = kept
            self._records[request.storage_key] = dataclasses.replace(
                found,
                status=Status.COMPLETED,
                updated_at=now,
                expires_at=expires_at,
                result=result,
                result_cached=result is not None,
            )
            return outcome

    def settle_owed_message(self, request: ClaimRequest) -> bool:
        with self._lock:
            found = self._live(request.storage_key, self._clock())
            taken = self._taken.get(request.storage_key)
            if (
                found is None
                or found.status not in (Status.COMPLETED, Status.PROCESSING)
                or found.owner != request.owner
                or taken is None
                or not taken.owes_message
            ):
                return False
            taken.owes_message = False
            return True

    def release(self, request: ClaimRequest, token: int, pickup: Pickup | None = None) -> bool:
        with self._lock:
            if not self._held(request, token):
                return False
            if pickup is None:
                if not self._hand_back(request, self._clock()):
                    self._drop(request.storage_key)
                return True
            taken = self._taken.get(request.storage_key)
            if taken is not None and taken.owes_message:
                return False  # the pickup would take the owed message's place (release.lua)
            found = self._records[request.storage_key]
            # The key keeps the arguments it stands for (a retry may run with others).
            self._queue(
                request,
                pickup,
                self._clock(),
                found.created_at,
                found.token,
                found.fingerprint,
                owner=retry_marker(pickup.retries),
            )
            return True

    def extend(self, request: ClaimRequest, token: int) -> bool:
        with self._lock:
            if not self._held(request, token):
                return False
            now = self._clock()
            found = self._records[request.storage_key]
            self._records[request.storage_key] = dataclasses.replace(
                found,
                lease_expires_at=now + request.lease_seconds,
                updated_at=now,
                expires_at=now + request.lease_seconds + request.claim_ttl,
            )
            return True

    def result_byte_limit(self) -> None:
        return None

    def get(self, storage_key: str) -> Record | None:
        with self._lock:
            now = self._clock()
            found = self._live(storage_key, now)
            return None if found is None else dataclasses.replace(found, read_at=now)

    def forget(self, storage_key: str) -> bool:
        with self._lock:
            found = self._live(storage_key, self._clock())
            self._drop(storage_key)
            return found is not None

    def close(self) -> None:
        """Nothing to close: the records live as long as the store object."""

    def _held(self, request: ClaimRequest, token: int) -> bool:
        found = self._live(request.storage_key, self._clock())
        return (
            found is not None
            and found.status is Status.PROCESSING
            and found.owner == request.owner
            and found.token == token
        )

    def _live(self, storage_key: str, now: float) -> Record | None:
        found = self._records.get(storage_key)
        if found is not None and found.expires_at <= now:
            self._drop(storage_key)
            return None
        return found

    def _sweep(self, now: float) -> None:
        """Drop expired records, and the fencing counters of keys whose last record would
        have expired by now (as Redis expires a counter just after its record, however it
        ended: released or forgotten ones too), every ``sweep_every`` seconds."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + self._sweep_every
        for storage_key in [key for key, found in self._records.items() if found.expires_at <= now]:
            self._drop(storage_key)
        for storage_key in [
            key
            for key, until in self._fences_until.items()
            if key not in self._records and until <= now
        ]:
            del self._fences_until[storage_key]
            self._fences.pop(storage_key, None)

    def _drop_kept_message(self, storage_key: str, found: Record, task_id: str) -> bool:
        """Forget the message of call ``task_id`` that the completed record ``found`` keeps
        (see :meth:`complete`); whether it kept it."""
        pending = self._pending.get(storage_key)
        if pending is None or pending.task_id != task_id or task_id == found.task_id:
            return False
        del self._pending[storage_key]
        return True

    def _others_message(self, request: ClaimRequest) -> _Pending | None:
        """The key's pickup, when it keeps the message of another call than ``request``'s."""
        pending = self._pending.get(request.storage_key)
        return None if pending is None or pending.task_id == request.task_id else pending

    def _hand_back(self, request: ClaimRequest, now: float) -> bool:
        """Queue a released key for the message of another call it keeps (the call its claim
        took the key from: see claim.lua), due now; whether it kept one."""
        pending = self._others_message(request)
        if pending is None:
            return False
        found = self._records[request.storage_key]
        self._records[request.storage_key] = dataclasses.replace(
            found,
            status=Status.QUEUED,
            owner="",
            task_id=pending.task_id,
            lease_expires_at=now,
            updated_at=now,
            expires_at=now + request.claim_ttl,
        )
        pending.due_at = now
        self._taken.pop(request.storage_key, None)
        return True

    def _drop(self, storage_key: str) -> None:
        found = self._records.pop(storage_key, None)
        if found is not None:
            until = self._fences_until.get(storage_key, 0.0)
            self._fences_until[storage_key] = max(until, found.expires_at)
        self._pending.pop(storage_key, None)
        self._taken.pop(storage_key, None)

    def _queue(
        self,
        request: ClaimRequest,
        pickup: Pickup,
        now: float,
        created_at: float,
        token: int,
        fingerprint: str | None = None,
        owner: str = "",
    ) -> None:
        self._records[request.storage_key] = Record(
            storage_key=request.storage_key,
            key=request.key,
            task_name=request.task_name,
            status=Status.QUEUED,
            owner=owner,
            token=token,
            task_id=request.task_id,
            fingerprint=request.fingerprint if fingerprint is None else fingerprint,
            lease_expires_at=now + pickup.due_in,
            created_at=created_at,
            updated_at=now,
            expires_at=now + pickup.due_in + request.claim_ttl,
        )
        self._pending[request.storage_key] = _Pending(
            pickup, task_id=request.task_id, due_at=now + pickup.due_in
        )
        # A retry's: the call its claim took the key from is its message's to name.
        self._taken.pop(request.storage_key, None)

    def _acquire(
        self,
        request: ClaimRequest,
        now: float,
        *,
        created_at: float,
        takeover: bool,
        fingerprint: str,
        taken: _Taken | None = None,
    ) -> ClaimResult:
        token = self._fences.get(request.storage_key, 0) + 1
        self._fences[request.storage_key] = token
        record = self._new_record(request, token, now, created_at)
        self._records[request.storage_key] = dataclasses.replace(record, fingerprint=fingerprint)
        self._taken.pop(request.storage_key, None)
        if taken is not None:
            self._taken[request.storage_key] = taken
        acquired = ClaimResult(outcome=Outcome.ACQUIRED, token=token, takeover=takeover)
        return self._told(acquired, request, taken)

    @staticmethod
    def _new_record(request: ClaimRequest, token: int, now: float, created_at: float) -> Record:
        return Record(
            storage_key=request.storage_key,
            key=request.key,
            task_name=request.task_name,
            status=Status.PROCESSING,
            owner=request.owner,
            token=token,
            task_id=request.task_id,
            fingerprint=request.fingerprint,
            lease_expires_at=now + request.lease_seconds,
            created_at=created_at,
            updated_at=now,
            expires_at=now + request.lease_seconds + request.claim_ttl,
        )
