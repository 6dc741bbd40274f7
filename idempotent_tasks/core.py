"""The claim protocol, free of any task framework: claim -> run -> complete | release.

An :class:`Attempt` is one execution attempt of one keyed call. Adapters (Celery, RQ) build one
per delivery, act on :meth:`Attempt.claim`'s outcome, run the body inside
:meth:`Attempt.heartbeat`, then call :meth:`Attempt.complete` or :meth:`Attempt.release`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from . import defaults, signals
from .codec import ResultCodec
from .errors import CorruptRecord, SideWriteRefused, StoreUnavailable
from .heartbeat import keeper
from .records import (
    ClaimRequest,
    ClaimResult,
    CompleteOutcome,
    EncodedResult,
    Outcome,
    Pickup,
    Record,
    SideWrite,
    Status,
)
from .stores.base import Store

logger = logging.getLogger(__name__)

#: Longest pause between tries to store a completion while the store is unreachable: the
#: lease is no longer renewed, so once the store is back, every moment waited is one in which
#: a redelivered duplicate may take the key over and run the body again.
MAX_COMPLETE_PAUSE = 0.5


_T = TypeVar("_T")

#: A clock that goes on while the machine sleeps (a suspended VM or host), as the store's does
#: for a lease: Linux's CLOCK_BOOTTIME, where there is one.
_LEASE_CLOCK = getattr(time, "CLOCK_BOOTTIME", None)


def lease_clock() -> float:
    """Seconds on a clock that counts the time a lease runs here, suspensions included."""
    if _LEASE_CLOCK is None:
        return time.monotonic()
    return time.clock_gettime(_LEASE_CLOCK)


def despite_time_limit(limit: type[BaseException], step: Callable[[], _T]) -> _T:
    """Run ``step`` (bookkeeping after the body: store its result, release its key, write its
    dead letter) to its end even if ``limit`` is raised during it.

    ``limit`` is a framework's one-shot time limit raised by a signal wherever the process is
    (RQ's job timeout, Celery's soft time limit): it bounds the body, and landing in a slow
    store call after the body ended it would lose the body's outcome. It fires once per run,
    so the step is run once more; every such step may run twice.
    """
    try:
        return step()
    except limit as exc:
        logger.warning("%s after the body ended; finishing its bookkeeping", type(exc).__name__)
        return step()


def new_owner() -> str:
    """A unique id for one execution attempt (task ids repeat on redelivery; owners never do)."""
    return uuid.uuid4().hex


def wait_delay(waits: int) -> float:
    """Seconds a waiting call waits before it looks again, after ``waits`` earlier looks:
    doubling from ``WAIT_INITIAL_DELAY`` up to ``WAIT_MAX_DELAY``."""
    # The exponent is capped: 2.0 ** 1024 overflows, and an owner may run for hours.
    return min(defaults.WAIT_INITIAL_DELAY * 2.0 ** min(waits, 32), defaults.WAIT_MAX_DELAY)


def wait_for_owner(record: Record, waits: int) -> float:
    """Seconds a duplicate waits before it looks again at a key in progress, after ``waits``
    earlier looks: :func:`wait_delay`, never past the owner's lease, at least 50 ms.

    The lease is judged by the store's clock, which wrote it: on a worker whose clock runs
    ahead, the local clock would see every lease as over and look again every 50 ms.
    """
    return max(min(wait_delay(waits), record.lease_expires_at - record.store_time()), 0.05)


@dataclass
class Attempt:
    """One execution attempt's hold on a key.

    Args:
        store: where the claim lives.
        request: the claim this attempt makes (owner, key, fingerprint, lease, ttl ...).
        codec: how its result is cached.
        log: where the warnings of the task's own thread go (the Celery adapter gives its
            task logger); the lease keeper's thread logs to this module's.
    """

    store: Store
    request: ClaimRequest
    codec: ResultCodec
    log: logging.Logger = logger
    token: int = 0
    #: Set when a heartbeat found the claim taken over by another owner.
    lost: bool = False
    #: Set by :meth:`finish` when another execution holds the key and has not completed yet:
    #: the adapter must then wait for that execution's value instead of returning its own.
    superseded: bool = False
    #: Set when the completion also made the side write it was given (see :meth:`complete`).
    side_written: bool = False
    #: Set when the store refused that side write (the completion was made without it).
    side_write_refused: bool = False
    #: Set when this attempt's completion was stored with its value cached: the key answers
    #: duplicates with that value now (not ``None``).
    result_cached: bool = False
    #: Set once this attempt gives the key up (a retry, a failure): a renewal the heartbeat
    #: makes after that finds the claim gone, which is no takeover.
    given_up: bool = False
    #: The task id of another call whose claim or queued message this claim replaced.
    taken_from_task_id: str | None = None
    #: The message this claim owes, to publish again once the key completes: its call's task
    #: id and its envelope (see :class:`~idempotent_tasks.records.ClaimResult`).
    owed_task_id: str | None = None
    taken_over_envelope: bytes | None = None
    #: Set once this attempt sent that message (or the broker refused it for good) before
    #: giving its claim up for a retry: a completion it makes after all
    #: (``retry(throw=False)``) owes it no more.
    owed_message_sent: bool = False
    #: When this attempt last asked for its claim (:func:`lease_clock`): its lease runs from no
    #: earlier.
    asked_at: float = 0.0
    #: What this attempt's completion did, once the store answered it.
    completion: CompleteOutcome | None = None

    def claim(self) -> ClaimResult:
        """Claim the key (one store round trip). Raises StoreUnavailable."""
        self.asked_at = lease_clock()
        result = self.store.claim(self.request)
        if result.outcome is Outcome.ACQUIRED:
            self.token = result.token
            self.taken_from_task_id = result.taken_from_task_id
            self.owed_task_id = result.owed_task_id
            self.taken_over_envelope = result.taken_over_envelope
            if result.takeover:
                self.log.warning(
                    "took over key %r of %s from an earlier owner, whose lease ended or whose "
                    "attempt this one retries (token %s)",
                    self.request.key,
                    self.request.task_name,
                    result.token,
                )
        signals.claim_finished.send(
            task_name=self.request.task_name, outcome=result.outcome, takeover=result.takeover
        )
        return result

    def held_at_start(self) -> bool:
        """Whether the acquired claim is still this attempt's as its body is about to start.

        Its lease runs from no earlier than the claim was asked for. A process paused since
        for half the lease or more (frozen, swapped out, stopped while its claim's reply was
        on its way) could have lost the key to another execution, which may even have
        completed it: it asks the store (a token-checked renewal) before running the body.
        Otherwise nothing is asked. Raises StoreUnavailable when the store cannot say.
        """
        if lease_clock() - self.asked_at < self.request.lease_seconds / 2:
            return True
        return self.store.extend(self.request, self.token)

    def cached_value(self, record: Record) -> Any:
        """The value a completed record answers duplicates with (``None`` if not cached)."""
        if record.result is None:
            return None
        return self.codec.decode(record.result)

    @contextmanager
    def heartbeat(self) -> Iterator[None]:
        """Keep the lease renewed (by the process's lease keeper) while the body runs."""
        lease = keeper.add(self._renew, self._on_lease_lost, self.request.lease_seconds)
        try:
            yield
        finally:
            keeper.remove(lease)

    def complete(self, value: Any, side_write: SideWrite | None = None) -> CompleteOutcome:
        """Cache ``value`` and mark the key completed, if this attempt still holds it.

        ``side_write`` (a store that shares the framework's result database) is made in the
        same step when the completion is stored; :attr:`side_written` tells whether it was.
        """
        return self._complete_encoded(self._encoded(value), side_write)

    def _encoded(self, value: Any) -> EncodedResult | None:
        """``value`` as the store caches it; ``None`` (logged, and signalled once) when it is
        not cached: too big, or not serializable."""
        encoded, reason = self.codec.encode(value)
        if encoded is not None:
            limit = self.store.result_byte_limit()
            if limit is not None and len(encoded.body) > limit:
                reason = (
                    f"result is {len(encoded.body)} bytes, over the {limit} bytes the store's "
                    "database takes in one statement"
                )
                encoded = None
        if reason is not None:
            self.log.warning(
                "result of %s for key %r is not cached (%s); duplicates will get None",
                self.request.task_name,
                self.request.key,
                reason,
            )
            signals.result_not_cached.send(
                task_name=self.request.task_name, key=self.request.key, reason=reason
            )
        return encoded

    def _complete_encoded(
        self, encoded: EncodedResult | None, side_write: SideWrite | None
    ) -> CompleteOutcome:
        owes = self._owes_message()
        try:
            outcome = self.store.complete(
                self.request, self.token, encoded, side_write, owes_message=owes
            )
            self.side_written = side_write is not None and outcome is CompleteOutcome.STORED
        except SideWriteRefused as exc:  # raised only when given a side write
            self.log.warning("%s; completing key %r without it", exc, self.request.key)
            self.side_write_refused = True
            outcome = self.store.complete(self.request, self.token, encoded, owes_message=owes)
        self.completion = outcome
        self.result_cached = outcome is not CompleteOutcome.STALE and encoded is not None
        if outcome is CompleteOutcome.STALE:
            self.log.warning(
                "%s finished key %r after its claim was taken over by another execution; "
                "its result was not stored",
                self.request.task_name,
                self.request.key,
            )
            signals.stale_complete_refused.send(
                task_name=self.request.task_name, key=self.request.key
            )
        elif outcome is CompleteOutcome.RECOVERED:
            self.log.warning(
                "claim of key %r of %s had vanished from the store; result stored anew",
                self.request.key,
                self.request.task_name,
            )
        return outcome

    def finish(
        self, value: Any, patience_seconds: float, side_write: SideWrite | None = None
    ) -> Any:
        """Complete with ``value``, trying for up to ``patience_seconds`` while the store is
        unreachable; returns the value every caller should see.

        That is ``value`` itself, or, when this attempt lost its claim to an execution that
        completed first, that execution's cached value. If the store stays unreachable, the
        result is not stored (logged): a duplicate may run the body again once the lease ends.
        A record the store cannot read is not stored to either (logged).
        """
        deadline = time.monotonic() + patience_seconds
        pause = 0.1
        encoded: list[EncodedResult | None] = []  # once, whatever the tries
        while True:
            tried_at = time.monotonic()
            try:
                if not encoded:
                    encoded.append(self._encoded(value))
                if self._complete_encoded(encoded[0], side_write) is CompleteOutcome.STALE:
                    return self._winning_value(value)
                return value
            except CorruptRecord as exc:
                # The body ran: its value still goes to this caller. Duplicates find the key as
                # a CorruptRecord does, until an operator forgets it.
                self.log.error(
                    "%s succeeded but its result for key %r could not be stored: %s",
                    self.request.task_name,
                    self.request.key,
                    exc,
                )
                return value
            except StoreUnavailable as exc:
                # A try can take seconds (the client's own reconnects): one more must end in time.
                now = time.monotonic()
                if now + pause + (now - tried_at) > deadline:
                    self.log.error(
                        "%s succeeded but its result for key %r could not be stored: %s; a "
                        "duplicate may run it again once its lease ends",
                        self.request.task_name,
                        self.request.key,
                        exc,
                    )
                    return value
                self.log.warning(
                    "store unreachable while completing key %r, retrying: %s",
                    self.request.key,
                    exc,
                )
                time.sleep(pause)
                pause = min(pause * 2, MAX_COMPLETE_PAUSE)

    def _winning_value(self, own_value: Any) -> Any:
        try:
            record = self.store.get(self.request.storage_key)
        except StoreUnavailable:
            # Refused, this value may never be the key's: waited on as for a live new owner,
            # the key's own value is looked up again once the store is back.
            self.superseded = True
            return own_value
        except CorruptRecord:
            return own_value
        if record is not None and record.status in (Status.PROCESSING, Status.QUEUED):
            # The execution that took the key over is still running (or retrying): this value
            # must not be handed to callers as the key's result (it may never be the one stored).
            self.superseded = True
            return own_value
        if record is None or record.status is not Status.COMPLETED or not record.result_cached:
            return own_value
        return self.cached_value(record)

    def settle_owed_message(self) -> bool:
        """Whether this attempt, its completion stored, publishes the message its claim owes
        (:attr:`owed_task_id`) now: the store clears the debt as it says so, so the message goes
        out once, from here or from the pickup guard (which takes it when the owner is slow).

        A completion that wrote the record anew (the store had lost it) wrote the debt with it.
        A store that cannot say is taken as a yes (logged): a message sent twice is answered
        twice from the cache, one never sent leaves its callbacks waiting."""
        stored = self.completion in (CompleteOutcome.STORED, CompleteOutcome.RECOVERED)
        if not (stored and self._owes_message()):
            return False
        try:
            return self.store.settle_owed_message(self.request)
        except (StoreUnavailable, CorruptRecord) as exc:
            self.log.warning(
                "could not ask whether key %r still owes the message of %s (%s); publishing it",
                self.request.key,
                self.owed_task_id,
                exc,
            )
            return True

    def settle_owed_message_before_release(self) -> bool:
        """Whether this attempt, about to give its held claim up for a later message of its
        call (a retry, a requeue, a replacement: the key stays queued for it), publishes the
        message its claim owes now. That release keeps the later message in its place: owed by
        no one, the owed message would never go out, its callbacks never run. Published now,
        it waits for the key's value as any message of another call does.

        Raises StoreUnavailable or CorruptRecord when the store cannot say: the claim is then
        best kept, still owing the message, for the next message to take over."""
        if self.given_up or not self.token or not self._owes_message():
            return False
        return self.store.settle_owed_message(self.request)

    def _owes_message(self) -> bool:
        return (
            self.owed_task_id is not None
            and self.taken_over_envelope is not None
            and not self.owed_message_sent
        )

    def release_quietly(self, pickup: Pickup | None = None) -> None:
        """Release, logging (not raising) a store error: the lease frees the key anyway.

        A release keeping ``pickup`` that the store refuses is logged too: the claim is no
        longer this owner's, or it still owes another call's kept message, which the pickup
        would replace. The key then stays claimed until its lease ends, and the message it
        was to keep takes it over then."""
        try:
            released = self.release(pickup)
        except (StoreUnavailable, CorruptRecord) as exc:
            self.log.warning(
                "could not release key %r (%s); it frees itself when its lease ends",
                self.request.key,
                exc,
            )
            return
        if not released and pickup is not None and self.token:
            self.log.warning(
                "the release of key %r for the next message of %s was refused: the claim is "
                "no longer this owner's, or it still owes the message of another call; the "
                "key frees itself when its lease ends",
                self.request.key,
                self.request.task_id,
            )

    def release_dead_owner(self, pickup: Pickup | None = None) -> None:
        """Release the claim of this attempt's owner, whose process died with its token: the
        token is read from the record, and nothing is released unless this owner still holds
        the key (a later attempt that took it over keeps it). Store errors are logged."""
        try:
            record = self.store.get(self.request.storage_key)
        except (StoreUnavailable, CorruptRecord) as exc:
            self.log.warning(
                "could not release key %r (%s): its lease frees it", self.request.key, exc
            )
            return
        if record is None or record.status is not Status.PROCESSING:
            return
        if record.owner != self.request.owner:
            return  # taken over since, or never claimed by this owner
        self.token = record.token
        self.release_quietly(pickup)

    def release(self, pickup: Pickup | None = None) -> bool:
        """Give the key up so a retry can claim it; ``False`` if it was no longer held.

        With ``pickup`` (the retry's message), the key stays queued for this task id, so the
        retry is published again should its message be lost.
        """
        if not self.token:
            return False
        self.given_up = True
        return self.store.release(self.request, self.token, pickup)

    def _renew(self) -> bool:
        if self.given_up:
            return True  # nothing to renew, and nothing lost
        try:
            return self.store.extend(self.request, self.token)
        except StoreUnavailable as exc:
            # Unknown: raised, for the lease keeper to try again within seconds (not at the
            # next interval, a third of the lease on, when the lease may have run out).
            raise StoreUnavailable(f"lease of key {self.request.key!r}: {exc}") from exc

    def _on_lease_lost(self) -> None:
        if self.given_up:
            return  # released on purpose while the renewal was on its way
        self.lost = True
        logger.warning(
            "lease of key %r of %s was taken over while its body still runs",
            self.request.key,
            self.request.task_name,
        )
        signals.lease_lost.send(task_name=self.request.task_name, key=self.request.key)
