"""The interface every claim store implements, and the helpers they share."""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

from ..errors import StoreUnavailable
from ..records import (
    ClaimRequest,
    ClaimResult,
    CompleteOutcome,
    DuePickup,
    EncodedResult,
    Pickup,
    Record,
    SideWrite,
)

logger = logging.getLogger(__name__)


@runtime_checkable
class Store(Protocol):
    """Where claims and cached results live. Holds no business logic: each method is one atomic
    step of the claim protocol (one round trip to a server store).

    Every method raises :class:`~idempotent_tasks.errors.StoreUnavailable` when the store cannot
    be reached, and :class:`~idempotent_tasks.errors.CorruptRecord` when a record cannot be read.
    Every write is checked against the caller's ``owner`` and fencing ``token``.
    """

    def reserve(self, request: ClaimRequest, pickup: Pickup) -> Record | None:
        """Record, before its message is published, that ``request.task_id`` will run the key.

        When the key has no live record, writes a ``queued`` one (task id, fingerprint, the
        ``pickup``; ``lease_expires_at`` is when the message counts as lost) and returns
        ``None``. Otherwise writes nothing and returns the record found, whatever its state,
        with the store's time it was read (``read_at``). ``request.owner`` and
        ``request.lease_seconds`` are not used.
        """
        ...

    def cancel_reservation(self, storage_key: str, task_id: str) -> bool:
        """Delete the ``queued`` record of ``task_id`` (its publish failed, or the call ended
        unrun), or the pickup of its message a ``completed`` record keeps (see
        :meth:`complete`); whether there was one."""
        ...

    def make_reservation_due(
        self, storage_key: str, task_id: str, republished: int | None = None
    ) -> bool:
        """Make the ``queued`` record of ``task_id`` due at once: its message could not be
        published (the broker was unreachable), and the pickup guard publishes it when it next
        looks (a sweep, or a publish of the key). ``republished``, when given, sets the count
        of re-publications back (a take whose publish failed does not count). A ``processing``
        record keeping ``task_id``'s message whose lease ended (a dead owner's key, taken for
        that lost message) has its pickup made due; one whose owner is alive is left alone;
        so has a ``completed`` record keeping ``task_id``'s message (see :meth:`complete`).
        Whether there was one with a pickup."""
        ...

    def drop_pickup(self, storage_key: str, task_id: str) -> bool:
        """Forget the pickup of ``task_id``'s message while its key is ``processing``: that
        call was terminated on purpose (a revoke) or expired, and the guard must never publish
        its message again. The claim stays until its lease ends, and so does a message of
        another call that ``task_id``'s took the key from (until :meth:`release` without a
        pickup deletes the key, and that message with it). A ``completed`` record keeping
        ``task_id``'s message (see :meth:`complete`) forgets it too. Whether the key is
        ``processing`` for ``task_id``, or kept its message."""
        ...

    def take_due(self, limit: int) -> list[DuePickup]:
        """Up to ``limit`` queued keys whose message counts as lost, for re-publication.

        Each one taken has its due time moved on (``timeout * 2 ** republished`` from now) in
        the same atomic step, so concurrent sweeps never take one key in the same period.
        ``republished`` counts the re-publications since the message was queued (by
        :meth:`reserve` or a retry's :meth:`release`); a claim does not reset it. Each goes
        out under the task id of its own message, which a claim by another call does not
        change (nor the owner's callers: that message's run takes the key over and answers
        them); a message a ``completed`` record keeps for another call (see :meth:`complete`)
        is taken at its due time too. Index entries of keys that no longer need their pickup
        are dropped on the way.
        """
        ...

    def take(self, storage_key: str) -> DuePickup | None:
        """The pickup of one key, taken as :meth:`take_due` takes each one it hands out, if
        the key's message counts as lost now; else ``None``."""
        ...

    def claim(self, request: ClaimRequest) -> ClaimResult:
        """Atomically claim ``request.storage_key`` for ``request.owner``.

        Acquired when there is no record or a ``queued`` one (the fingerprint is still
        compared; one queued for a retry of the same call, not by an older message of it: see
        :meth:`release`), when the record is ``processing`` under an expired
        lease or under ``request.previous_owner`` (a takeover: the fencing token is incremented),
        or when it is already held by this very owner (a retried call); replacing another task
        id's ``queued`` or ``processing`` record, it names that id (``taken_from_task_id``),
        and for a ``queued`` one gives its message (``taken_over_envelope``). The same call's
        claim made again (its reply lost, or its message redelivered) is told the same again,
        while the key keeps that other call's message. Otherwise returns the
        record found: ``MISMATCH`` if validation is on and its fingerprint differs, else
        ``COMPLETED`` or ``IN_PROGRESS``; like :meth:`reserve`'s, that record carries the
        store's time it was read (``read_at``).
        """
        ...

    def complete(
        self,
        request: ClaimRequest,
        token: int,
        result: EncodedResult | None,
        side_write: SideWrite | None = None,
        *,
        owes_message: bool = False,
    ) -> CompleteOutcome:
        """Mark the key ``completed`` with ``result`` for ``request.ttl_seconds``.

        Only while ``request.owner`` still holds ``token``: returns ``STALE`` and writes nothing if
        another owner took over; ``RECOVERED`` if the record had vanished (or was only
        ``queued`` again by a new publish) and was written anew, with the key's highest token
        (tokens never go back). Completing again what this owner completed returns ``STORED``.
        ``result=None`` records that the result was not cached (duplicates get ``None``).

        ``owes_message``: this claim owes the message it took over (its claim said so); a
        record written anew keeps that debt, for :meth:`settle_owed_message`.

        A record written anew over the live ``queued`` reservation of another call (another
        task id) for the same arguments (fingerprint) keeps that call's pickup, due when it
        was, and lives at least as long as that reservation would have: its message is
        answered from this result when it arrives, and should the broker have lost it, the
        guard publishes it (see :meth:`take_due`). The claim of that message (answered
        ``COMPLETED``) drops the pickup, as :meth:`drop_pickup` does.

        ``side_write`` is written (and published) in the same atomic step when the outcome is
        ``STORED``, never otherwise. Only the Redis store takes one (see
        ``RedisStore.shares_database_with``), and raises ``SideWriteRefused`` when Redis refuses
        it (the completion is then to be made again without it); the others raise
        ``ValueError``.
        """
        ...

    def settle_owed_message(self, request: ClaimRequest) -> bool:
        """Whether the claim of ``request.owner`` (one execution attempt), completed or still
        held, still owes the message it took over
        (:attr:`~idempotent_tasks.records.ClaimResult.owed_task_id`), clearing that debt in the
        same atomic step: the caller then publishes it, once. A held claim settles before it
        is released with a pickup (a retry), which keeps the retry's message in its place.

        ``False`` when the pickup guard took that message meanwhile (the owner was slow past
        its lease and a re-publication timeout, and the guard published it), when the claim
        owes none, or when the key is no longer that claim's.
        """
        ...

    def result_byte_limit(self) -> int | None:
        """The largest encoded result :meth:`complete` can write, or ``None`` when the store
        has no limit of its own (only ``idempotency_result_max_bytes`` applies)."""
        ...

    def release(self, request: ClaimRequest, token: int, pickup: Pickup | None = None) -> bool:
        """Give up a ``processing`` claim held by ``request.owner`` with ``token``.

        Without ``pickup`` the record is deleted, unless it keeps the message of the call this
        claim took the key from (see :attr:`~idempotent_tasks.records.ClaimResult.owed_task_id`):
        the key then goes back to that call, ``queued`` for its message and due now, so the
        pickup guard publishes it again rather than lose it. With a pickup (a retry is being
        published) it becomes ``queued`` for ``request.task_id`` with that pickup, as
        :meth:`reserve` writes it, its owner :func:`~idempotent_tasks.records.retry_marker`
        of the pickup's retries: a claim of the same call whose message counts fewer (an
        older message) is answered ``IN_PROGRESS``. Returns whether the claim was held and
        released; the fencing counter is kept, so tokens keep growing.

        A claim that still owes another call's message it keeps is not released with a pickup
        (``False``): the pickup would take that message's place, and nothing would publish it.
        Its owner settles the debt first (:meth:`settle_owed_message`, then publishes it);
        else the claim stays for the next message of its call to take over, owing it in turn.
        """
        ...

    def extend(self, request: ClaimRequest, token: int) -> bool:
        """Renew the lease to ``request.lease_seconds`` from now; ``False`` if no longer held."""
        ...

    def get(self, storage_key: str) -> Record | None:
        """The record of a key, or ``None`` when there is none (or it expired).

        Like :meth:`reserve`'s, the record carries the store's time it was read (``read_at``).
        """
        ...

    def forget(self, storage_key: str) -> bool:
        """Delete a key's record whatever its state (an operator's action); whether one existed."""
        ...

    def close(self) -> None:
        """Drop connections; the store reconnects on next use."""
        ...


def refuse_side_write(store: Store, side_write: SideWrite | None) -> None:
    """Raise ``ValueError`` for a side write given to a store that cannot make one."""
    if side_write is not None:
        raise ValueError(f"{type(store).__name__} cannot write beside a completion")


def remove_expired_records(store: Store) -> None:
    """Delete the expired records of a store that does not expire them by itself (SQL: its
    ``cleanup``), as a dead-letter sweep does on every run; a store down is logged."""
    cleanup = getattr(store, "cleanup", None)
    if cleanup is None:
        return
    try:
        removed = cleanup()
    except StoreUnavailable as exc:
        logger.warning("could not remove expired claims: %s", exc)
        return
    if removed:
        logger.info("removed %s expired claims", removed)
