"""Claim store on any SQLAlchemy database: PostgreSQL, MySQL/MariaDB, SQLite.

A fresh key is claimed by one ``INSERT`` that does nothing on conflict. A key that has a row is
read, decided on exactly as the Redis script decides, and taken over (when allowed) by an
``UPDATE`` that only matches the row as it was read: a compare-and-set, so two claimers racing
for an expired lease cannot both win, and an owner that completes meanwhile is not overwritten,
on any database, without locks. Released claims keep their row (``status = released``) so
fencing tokens keep growing. Times are POSIX seconds on the database server's clock
(:class:`~idempotent_tasks.stores.sql_clock.ServerClock`), so workers whose clocks disagree
still agree on when a lease ends.

The pickup guard keeps a ``queued`` claim row per published message, and the message itself in
a pickups row of the same id. Transactions that write both always write the claim row first,
so they do not wait on one another in a cycle; InnoDB's next-key locks still can, and an
operation whose transaction was a deadlock's victim runs again (:mod:`.sql_deadlocks`). A
claim keeps the pickup of the call it runs (it covers its owner's death too); a release with no
retry to publish drops its key's pickup, and the sweep's :meth:`SqlStore.take_due` drops those
of keys completed or expired.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import (
    Connection,
    Delete,
    Engine,
    Executable,
    Insert,
    RowMapping,
    Select,
    Update,
    text,
)
from sqlalchemy.exc import SQLAlchemyError

from .. import defaults
from ..dlq.engine import create_dlq_engine
from ..dlq.schema import (
    CLAIM_ID_CHARS,
    CLAIMS_COMPONENT,
    CLAIMS_MIGRATIONS,
    CLAIMS_SCHEMA_VERSION,
    PICKUPS_COMPONENT,
    PICKUPS_MIGRATIONS,
    PICKUPS_SCHEMA_VERSION,
    claims,
    pickups,
)
from ..dlq.schema_setup import ensure_component
from ..errors import CorruptRecord, StoreUnavailable
from ..keys import may_be_storage_key_of
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
    older_message,
    retry_marker,
)
from .base import Store, refuse_side_write
from .sql_clock import ServerClock
from .sql_deadlocks import Deadlocked, run_again_after_deadlock, was_rolled_back_for_another
from .sql_rows import is_live, is_readable, readable_claim, readable_pickup, record_of
from .sql_statements import (
    COMPLETED,
    PROCESSING,
    QUEUED,
    RELEASED,
    bump_pickup,
    delete_claim,
    delete_expired,
    delete_orphan_pickups,
    delete_pickup,
    delete_pickup_if_unchanged,
    delete_pickup_of_claimed,
    forget_claim,
    insert_if_absent,
    lock_claim,
    postpone_pickup,
    release_queued,
    replace_if_unchanged,
    retime_pickup,
    retime_queued,
    select_abandoned_or_keeping,
    select_claim,
    select_due,
    select_kept_message_of,
    select_owed_pickup,
    select_pickup,
    select_processing,
    set_debt,
    settle_owed,
    update_held,
    upsert_pickup,
)

logger = logging.getLogger(__name__)

#: Room a claim row's statement keeps for all but its result (bytes): the key, ids, names.
ROW_ROOM = 64 * 1024
#: Compare-and-set rounds a claim (or reservation) tries before calling the key contended.
MAX_CLAIM_ROUNDS = 10
#: Largest power of two a pickup's re-publication backoff grows to.
MAX_BACKOFF_EXPONENT = 20
#: Batches of due pickups one :meth:`SqlStore.take_due` reads at most (rows left behind by
#: claims are dropped on the way and may fill a batch).
MAX_TAKE_ROUNDS = 10
#: Seconds an unreadable pickup row is put off by each sweep that meets it: due first for
#: ever, enough of them would fill every batch and hold every other key back.
UNREADABLE_PICKUP_DELAY = 3600.0


# -- the store ----------------------------------------------------------------------------


class SqlStore(Store):
    """A :class:`~idempotent_tasks.stores.base.Store` on a SQLAlchemy database.

    Args:
        url: SQLAlchemy URL (``postgresql+psycopg://``, ``mysql+pymysql://``, ``sqlite:///``).
        prefix: first part of every row id, as for the Redis store.
        clock: POSIX seconds; default: this process's clock set to the database server's
            (:class:`~idempotent_tasks.stores.sql_clock.ServerClock`). Tests pass their own.
    """

    def __init__(self, url: str, prefix: str, clock: Callable[[], float] | None = None) -> None:
        longest = CLAIM_ID_CHARS - 1 - defaults.KEY_MAX_STORED_CHARS
        if len(prefix) > longest:
            # Refused here: every claim's row id would be too long for its column, and every
            # call of every keyed task would wait for a store that never takes it.
            raise ValueError(
                f"idempotency_key_prefix is {len(prefix)} characters long; the SQL store "
                f"takes at most {longest} (its row ids hold the prefix and the key)"
            )
        self.url = url
        self.prefix = prefix
        self.engine: Engine = create_dlq_engine(url)
        self.dialect = self.engine.dialect.name
        self._clock = ServerClock(self.engine) if clock is None else clock
        self._schema_ready = False
        self._schema_lock = threading.Lock()
        self._result_limit: int | None = None

    def claim_id(self, storage_key: str) -> str:
        """The row id of a key."""
        return f"{self.prefix}:{storage_key}"

    @run_again_after_deadlock
    def reserve(self, request: ClaimRequest, pickup: Pickup) -> Record | None:
        claim_id = self.claim_id(request.storage_key)
        for _ in range(MAX_CLAIM_ROUNDS):
            now = self._clock()
            fresh = {
                "id": claim_id,
                "token": 0,
                "created_at": now,
                **self._queued_values(request, pickup.due_in, now),
                "fingerprint": request.fingerprint,
            }
            if self._write_queued(insert_if_absent(self.dialect, fresh), request, pickup, now):
                return None
            found = self._claim_row(request.storage_key)
            if found is None:
                continue  # deleted between the two statements: insert again
            if is_live(found, now):
                return record_of(request.storage_key, found, read_at=now)
            # An expired or released row: replace it, keeping its token so tokens keep growing.
            token = int(found["token"])
            swap = replace_if_unchanged(claim_id, found, {**fresh, "token": token})
            if self._write_queued(swap, request, pickup, now):
                return None
        raise StoreUnavailable(f"reserve of {request.storage_key!r} kept losing races; try again")

    @run_again_after_deadlock
    def cancel_reservation(self, storage_key: str, task_id: str) -> bool:
        claim_id = self.claim_id(storage_key)
        # Released rather than deleted, like a released claim: tokens keep growing.
        now = self._clock()  # before the transaction: a measurement takes a connection too
        with self._begin() as connection:
            if _count(connection, release_queued(claim_id, task_id, now)) == 0:
                # Or a completed key keeping its message (see complete): that goes.
                kept = delete_pickup_of_claimed(claim_id, task_id, now, processing=False)
                return _count(connection, kept) > 0
            connection.execute(delete_pickup(claim_id))
            return True

    @run_again_after_deadlock
    def make_reservation_due(
        self, storage_key: str, task_id: str, republished: int | None = None
    ) -> bool:
        claim_id = self.claim_id(storage_key)
        now = self._clock()  # before the transaction: a measurement takes a connection too
        with self._begin() as connection:
            queued = _count(connection, retime_queued(claim_id, task_id, now, now)) == 1
            if not queued:
                # A claimed key keeping another call's message, which the guard could not
                # publish: the owner owes it again, alive or not (see make_due.lua).
                connection.execute(set_debt(claim_id, task_id, now, owes=True))
            # Else a dead owner's key: the pickup of task_id's message it keeps is due; the
            # owner's lease still decides when the message counts as lost. Or a completed key
            # keeping that message (see complete).
            keeping = select_abandoned_or_keeping(claim_id, task_id, now)
            if not queued and connection.execute(keeping).first() is None:
                return False
            if _count(connection, retime_pickup(claim_id, now, republished, task_id)) == 0:
                connection.rollback()  # no pickup: nothing for the guard to publish
                return False
            return True

    @run_again_after_deadlock
    def drop_pickup(self, storage_key: str, task_id: str) -> bool:
        claim_id = self.claim_id(storage_key)
        now = self._clock()  # before the transaction: a measurement takes a connection too
        with self._begin() as connection:
            # Another call's message about to go: the owner owes it no more (see drop.lua).
            # The claim row first, as release and take lock them (no deadlock between them).
            connection.execute(set_debt(claim_id, task_id, now, owes=False))
            if _count(connection, delete_pickup_of_claimed(claim_id, task_id, now)) > 0:
                return True
            # Claimed without a reservation, or its pickup dropped already: there was such a
            # record all the same (as the Redis and memory stores answer).
            found = connection.execute(select_processing(claim_id, task_id, now)).first()
            return found is not None

    def take_due(self, limit: int) -> list[DuePickup]:
        taken: list[DuePickup] = []
        # Each batch reads on from the last row of the one before (rows of a longer prefix
        # stay due, for their own app's sweep), and only batches holding rows of this prefix
        # count as rounds: however many of another's come first, this prefix's are reached.
        after: tuple[float, str] | None = None
        rounds = 0
        while rounds < MAX_TAKE_ROUNDS and len(taken) < limit:
            wanted = limit - len(taken)
            try:
                now = self._clock()
                with self._begin() as connection:
                    due_rows = select_due(self.prefix, now, wanted, after=after)
                    rows = connection.execute(due_rows).mappings().all()
            except StoreUnavailable:
                if not taken:
                    raise
                return taken  # those taken already are moved on: they must go out
            own = [row for row in rows if self._owns(row)]
            rounds += 1 if own else 0
            for row in own:
                try:
                    due = self._take(readable_pickup(row), now)
                except (CorruptRecord, ValueError, TypeError) as exc:
                    # One unreadable row must not stop the sweep for every other key.
                    logger.error("skipping the unreadable pickup of %r: %s", row["id"], exc)
                    self._postpone_unreadable(row["id"], now)
                    continue
                except StoreUnavailable:
                    if not taken:
                        raise
                    return taken  # those taken already are moved on: they must go out
                if due is not None:
                    taken.append(due)
            if len(rows) < wanted or not isinstance(rows[-1]["due_at"], int | float):
                break  # (one whose due time cannot be read was put off: not due next time)
            last = (float(rows[-1]["due_at"]), str(rows[-1]["id"]))
            if last == after:
                break  # a cursor that does not move on ends the sweep rather than loop
            after = last
        return taken

    def _owns(self, row: Any) -> bool:
        """Whether a pickup row found by this store's prefix is one of its own, not one of an
        app whose prefix starts with this one's and ``:`` (``shop:eu`` for ``shop``): what
        follows this prefix in its id is then no storage name of the row's task, but what
        follows a later ``:`` is."""
        rest, task_name = str(row["id"])[len(self.prefix) + 1 :], str(row["task_name"])
        if may_be_storage_key_of(rest, task_name):
            return True
        return not any(
            may_be_storage_key_of(rest[at + 1 :], task_name)
            for at, character in enumerate(rest)
            if character == ":"
        )

    def _postpone_unreadable(self, claim_id: str, now: float) -> None:
        """Put an unreadable pickup row off (for an operator to mend or forget), so the
        sweep's next batch reads the rows behind it."""
        try:
            self._rowcount(postpone_pickup(claim_id, now + UNREADABLE_PICKUP_DELAY))
        except StoreUnavailable as exc:
            logger.warning("could not put the unreadable pickup of %r off: %s", claim_id, exc)

    def take(self, storage_key: str) -> DuePickup | None:
        claim_id = self.claim_id(storage_key)
        row = readable_pickup(self._one(select_pickup(claim_id)))
        now = self._clock()
        if row is None or row["due_at"] > now:
            return None
        return self._take(row, now)

    def _take(self, row: RowMapping, now: float) -> DuePickup | None:
        """Move one due pickup (a readable row) on and return it, unless another sweep took it
        or its key no longer needs it (then its row is dropped).

        A key still queued for the pickup's task id is due at the pickup's time. A key claimed
        since is due only once its owner's lease ended a timeout ago without a takeover (the
        owner died and its message was lost too). A completed key keeping another call's
        message (see :meth:`complete`) is due at the pickup's time. The message goes out under
        its own task id, which is the owner's unless the owner is another call that took the
        key over (that call's callers are then answered by the message's own run, which takes
        it over in turn).
        """
        claim_id, task_id = row["id"], row["task_id"]
        timeout = float(row["timeout"])
        republished = int(row["republished"]) + 1
        due_at = now + timeout * 2 ** min(republished, MAX_BACKOFF_EXPONENT)
        with self._begin() as connection:
            if _count(connection, retime_queued(claim_id, task_id, now, due_at)) == 0:
                found = readable_claim(
                    row["id"], connection.execute(select_claim(claim_id)).mappings().one_or_none()
                )
                unchanged = (row["republished"], row["due_at"])
                live = found is not None and is_live(found, now)
                keeping = live and found["status"] == COMPLETED and found["task_id"] != task_id
                if not keeping and (not live or found["status"] != PROCESSING):
                    # Completed, cancelled, released, expired or queued for another task id.
                    connection.execute(delete_pickup_if_unchanged(claim_id, *unchanged))
                    return None
                if not keeping and not _disowned(connection, found, timeout, now, unchanged):
                    return None
            values = {"republished": republished, "due_at": due_at}
            bump = bump_pickup(claim_id, row["republished"], row["due_at"], values)
            if _count(connection, bump) == 0:
                connection.rollback()  # another sweep took it (or it was queued anew) first
                return None
        return DuePickup(
            storage_key=claim_id[len(self.prefix) + 1 :],
            task_name=row["task_name"],
            task_id=task_id,
            envelope=bytes(row["envelope"]),
            republished=republished,
        )

    @run_again_after_deadlock
    def claim(self, request: ClaimRequest) -> ClaimResult:
        claim_id = self.claim_id(request.storage_key)
        # Each statement is its own short transaction: the compare-and-set needs no locks held
        # across statements, so concurrent claimers cannot deadlock (InnoDB would otherwise).
        for _ in range(MAX_CLAIM_ROUNDS):
            now = self._clock()
            fresh = self._processing_row(request, now, token=1, takeover=False)
            if self._inserted(insert_if_absent(self.dialect, fresh), claim_id):
                return ClaimResult(outcome=Outcome.ACQUIRED, token=1)
            found = self._claim_row(request.storage_key)
            if found is None:
                continue  # deleted between the two statements: insert again
            decision = self._decide(request, found, now)
            if decision is not None and decision.outcome is Outcome.ACQUIRED:
                # This owner's claim made again (its reply lost): told what it was first.
                pickup = self._pickup_if_owed(claim_id, found["owes_message"])
                return dataclasses.replace(
                    decision,
                    taken_from_task_id=found["taken_from"],
                    **_owed(pickup, request.task_id),
                )
            if decision is not None:
                if decision.outcome is Outcome.COMPLETED and found["taken_from"] == request.task_id:
                    # Perhaps this call's message, which the key kept for the guard (see
                    # complete): it came. (Else the call this row's claim took the key from,
                    # whose message that claim published: nothing is kept for it.)
                    self._drop_kept_message(claim_id, request.task_id, now)
                return decision
            token = int(found["token"]) + 1
            takeover = found["status"] == PROCESSING and found["expires_at"] > now
            values = self._processing_row(request, now, token=token, takeover=takeover)
            if takeover or (found["status"] == QUEUED and is_live(found, now)):
                values["created_at"] = found["created_at"]
                if found["task_id"] == request.task_id:
                    values["fingerprint"] = found["fingerprint"]  # the same call: see _decide
            if is_live(found, now) and found["task_id"] != request.task_id:
                # Another call's key taken over: its queued message, lost, is owed by this
                # claim, and so is the message a dead owner owed (see claim.lua), unless it is
                # this call's own.
                values["taken_from"] = found["task_id"]
                values["owes_message"] = found["status"] == QUEUED or (
                    bool(found["owes_message"]) and not self._kept_for(claim_id, request.task_id)
                )
            elif takeover:
                # The same call's message redelivered: told what its first claim was.
                values["taken_from"] = found["taken_from"]
                values["owes_message"] = found["owes_message"]
            swap = replace_if_unchanged(claim_id, found, values)
            wrote, pickup = self._replaced(
                swap, claim_id, ended=not is_live(found, now), read_pickup=values["owes_message"]
            )
            if wrote:
                return ClaimResult(
                    outcome=Outcome.ACQUIRED,
                    token=token,
                    takeover=takeover,
                    taken_from_task_id=values["taken_from"],
                    **_owed(pickup, request.task_id),
                )
        raise StoreUnavailable(f"claim of {request.storage_key!r} kept losing races; try again")

    def _decide(self, request: ClaimRequest, row: Any, now: float) -> ClaimResult | None:
        """The outcome for an existing row, or ``None`` when this claim may replace it."""
        if not is_live(row, now):
            return None
        # The row's own message (a redelivery, or a retry with other arguments perhaps) is the
        # same call: no mismatch, and the key keeps the caller's fingerprint.
        same_call = row["task_id"] == request.task_id
        mismatch = request.validate and row["fingerprint"] != request.fingerprint and not same_call
        if row["status"] == QUEUED:
            # Published and not claimed yet: its own message runs it; another one waits for it
            # until it counts as lost (see claim.lua).
            if mismatch:
                return ClaimResult(
                    outcome=Outcome.MISMATCH, record=record_of(request.storage_key, row, now)
                )
            if (not same_call and row["lease_expires_at"] > now) or (
                # Queued for a retry, and this an older message of the call (see claim.lua).
                same_call and older_message(row["owner"], request.retries)
            ):
                return ClaimResult(
                    outcome=Outcome.IN_PROGRESS, record=record_of(request.storage_key, row, now)
                )
            return None
        if row["status"] == PROCESSING and row["owner"] == request.owner:
            return ClaimResult(outcome=Outcome.ACQUIRED, token=int(row["token"]))
        record = record_of(request.storage_key, row, now)
        if mismatch:
            return ClaimResult(outcome=Outcome.MISMATCH, record=record)
        if row["status"] == COMPLETED:
            return ClaimResult(outcome=Outcome.COMPLETED, record=record)
        previous = request.previous_owner
        if (previous and row["owner"] == previous) or row["lease_expires_at"] <= now:
            return None
        return ClaimResult(outcome=Outcome.IN_PROGRESS, record=record)

    @run_again_after_deadlock
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
        claim_id = self.claim_id(request.storage_key)
        now = self._clock()
        done = {
            "status": COMPLETED,
            "updated_at": now,
            "expires_at": now + request.ttl_seconds,
            "result_cached": result is not None,
            "content_type": result.content_type if result else None,
            "content_encoding": result.content_encoding if result else None,
            "result": result.body if result else None,
        }
        with self._begin() as connection:
            if _count(connection, update_held(claim_id, request.owner, token, now, done)) == 1:
                # Nothing is left to publish: a pickup left behind could be sent again under a
                # later owner's task id (as the Redis and memory stores, drop it).
                connection.execute(delete_pickup(claim_id))
                return CompleteOutcome.STORED
        for _ in range(MAX_CLAIM_ROUNDS):
            found = self._claim_row(request.storage_key)
            if found is not None and found["owner"] == request.owner and is_live(found, now):
                if found["status"] == COMPLETED:
                    return CompleteOutcome.STORED  # a repeated completion
            if found is not None and found["status"] != QUEUED and is_live(found, now):
                return CompleteOutcome.STALE
            # The claim vanished (expired, or forgotten; perhaps a new publish queued the key
            # since): write the result anew, unless another claimer took the key meanwhile. The
            # row is the key's fencing counter: its token never goes back.
            highest = token if found is None else max(token, int(found["token"]))
            row = {**self._processing_row(request, now, token=highest, takeover=False), **done}
            # The debt of the claim the store lost, unless a later claim queued the key since
            # (it took the debt over, and settled it: see complete.lua).
            row["owes_message"] = owes_message and not (
                found is not None
                and is_live(found, now)
                and found["status"] == QUEUED
                and int(found["token"]) > token
            )
            with self._begin() as connection:
                kept = self._kept_pickup(connection, request, found, now)
                if kept is not None:
                    # Another call's reservation, for the same arguments: its pickup stays, as
                    # long as the reservation would have lived, and the row names that call,
                    # whose claim drops it (see complete.lua).
                    row["taken_from"] = kept["task_id"]
                    row["expires_at"] = max(row["expires_at"], float(found["expires_at"]))
                if found is None:
                    written = _count(connection, insert_if_absent(self.dialect, row))
                else:
                    written = _count(connection, replace_if_unchanged(claim_id, found, row))
                if written == 1:
                    if kept is None:
                        connection.execute(delete_pickup(claim_id))
                    return CompleteOutcome.RECOVERED
            # Written between the read and this write (a cleanup, a reservation, a sweep moving
            # its due time on, a claim): look again, as Redis's one script would have seen it.
        raise StoreUnavailable(
            f"completion of {request.storage_key!r} kept losing races; try again"
        )

    @run_again_after_deadlock
    def settle_owed_message(self, request: ClaimRequest) -> bool:
        claim_id = self.claim_id(request.storage_key)
        now = self._clock()
        with self._begin() as connection:
            return _count(connection, settle_owed(claim_id, request.owner, now)) == 1

    @run_again_after_deadlock
    def release(self, request: ClaimRequest, token: int, pickup: Pickup | None = None) -> bool:
        now = self._clock()
        claim_id = self.claim_id(request.storage_key)
        if pickup is None:
            with self._begin() as connection:
                kept_of = connection.execute(select_kept_message_of(claim_id)).scalar()
                if kept_of is not None and kept_of != request.task_id:
                    # Another call's message (the call this claim took the key from): the key
                    # goes back to it, queued and due now, for the guard to publish it again.
                    # (It keeps its arguments, token and creation time.)
                    values = self._queued_values(request, 0.0, now, task_id=kept_of)
                    held = update_held(claim_id, request.owner, token, now, values)
                    if _count(connection, held) != 1:
                        return False
                    if _count(connection, retime_pickup(claim_id, now, None, kept_of)) == 1:
                        return True
                    # Its pickup dropped meanwhile (that call revoked): nothing to hand back.
                    connection.execute(forget_claim(claim_id, now))
                    return True
                values = {"status": RELEASED, "updated_at": now}
                held = update_held(claim_id, request.owner, token, now, values)
                if _count(connection, held) != 1:
                    return False
                connection.execute(delete_pickup(claim_id))  # nothing is left to publish
                return True
        # The key keeps the arguments it stands for (see claim): no fingerprint written.
        values = self._queued_values(request, pickup.due_in, now)
        values["owner"] = retry_marker(pickup.retries)
        # Not while it owes another call's message: the pickup would take its place (release.lua).
        held = update_held(claim_id, request.owner, token, now, values)
        return self._write_queued(
            held.where(claims.c.owes_message.is_not(True)), request, pickup, now
        )

    @run_again_after_deadlock
    def extend(self, request: ClaimRequest, token: int) -> bool:
        now = self._clock()
        values = {
            "lease_expires_at": now + request.lease_seconds,
            "updated_at": now,
            "expires_at": now + request.lease_seconds + request.claim_ttl,
        }
        claim_id = self.claim_id(request.storage_key)
        return self._rowcount(update_held(claim_id, request.owner, token, now, values)) == 1

    def result_byte_limit(self) -> int | None:
        """On MySQL/MariaDB, the largest result one statement carries: the server's
        ``max_allowed_packet``, less room for the rest of the row, halved (the driver sends
        bytes escaped, up to two for one); a larger one would cost the connection, every time.
        Other databases take any result the settings allow."""
        if self.dialect not in ("mysql", "mariadb"):
            return None
        if self._result_limit is None:
            with self._begin() as connection:
                packet = connection.execute(text("SELECT @@max_allowed_packet")).scalar_one()
            self._result_limit = max(int(packet) - ROW_ROOM, 0) // 2
        return self._result_limit

    def get(self, storage_key: str) -> Record | None:
        row = self._claim_row(storage_key)
        now = self._clock()
        if row is None or row["status"] == RELEASED or row["expires_at"] <= now:
            return None
        return record_of(storage_key, row, read_at=now)

    @run_again_after_deadlock
    def forget(self, storage_key: str) -> bool:
        claim_id = self.claim_id(storage_key)
        now = self._clock()
        # Released, not deleted: the row is the key's fencing counter, and tokens keep growing.
        # An unreadable row is deleted (its token cannot be counted on): the way out of a
        # CorruptRecord for an operator.
        with self._begin() as connection:
            found = connection.execute(select_claim(claim_id)).mappings().one_or_none()
            if found is not None and not is_readable(found):
                connection.execute(delete_claim(claim_id))
                connection.execute(delete_pickup(claim_id))
                return True
            connection.execute(forget_claim(claim_id, now))
            connection.execute(delete_pickup(claim_id))
        return found is not None and is_live(found, now)

    @run_again_after_deadlock
    def cleanup(self, older_than: float = 0.0) -> int:
        """Delete rows that expired more than ``older_than`` seconds ago, and their pickups;
        how many rows."""
        before = self._clock() - older_than
        with self._begin() as connection:
            deleted = _count(connection, delete_expired(before))
            connection.execute(delete_orphan_pickups(before))
            return deleted

    def _inserted(self, insert: Insert, claim_id: str) -> bool:
        """Run a claim's insert of a new row; whether it wrote. A pickup the key still has
        then is an earlier call's, left behind when the cleanup removed its expired row (due
        after that): its arguments must never be published under this claim's task id."""
        with self._begin() as connection:
            if _count(connection, insert) != 1:
                return False
            connection.execute(delete_pickup(claim_id))
            return True

    def _replaced(
        self, swap: Update, claim_id: str, *, ended: bool, read_pickup: bool
    ) -> tuple[bool, Any]:
        """Run a claim's compare-and-set: whether it wrote, and with ``read_pickup`` (a message
        the claim owes: see claim.lua) the key's pickup row, read in the same
        transaction (``None`` when there is none, or it cannot be read). A row it replaced that
        had ended (expired, released) takes its pickup along: that is another call's message,
        whose arguments the guard must never publish under this claim's task id."""
        with self._begin() as connection:
            if _count(connection, swap) != 1:
                return False, None
            if ended:
                connection.execute(delete_pickup(claim_id))
            if not read_pickup:
                return True, None
            row = connection.execute(select_pickup(claim_id)).mappings().one_or_none()
        return True, _readable_or_none(row)

    def _kept_for(self, claim_id: str, task_id: str) -> bool:
        """Whether the message the key keeps is ``task_id``'s own."""
        kept = self._one(select_kept_message_of(claim_id))
        return kept is not None and kept["task_id"] == task_id

    def _kept_pickup(
        self, connection: Connection, request: ClaimRequest, found: Any, now: float
    ) -> Any:
        """The pickup row of another call whose live reservation (``found``), for the same
        arguments, a completion written anew replaces: the key keeps it (see :meth:`complete`);
        ``None`` for none. Read in the completion's transaction."""
        if (
            found is None
            or found["status"] != QUEUED
            or found["fingerprint"] != request.fingerprint
            or not is_live(found, now)
        ):
            return None
        claim_id = self.claim_id(request.storage_key)
        pickup = _readable_or_none(connection.execute(select_pickup(claim_id)).mappings().first())
        if pickup is None or pickup["task_id"] == request.task_id:
            return None
        return pickup

    def _drop_kept_message(self, claim_id: str, task_id: str, now: float) -> None:
        """Drop the pickup of ``task_id``'s message that the key's completed row keeps, once
        that message came (see :meth:`complete`). Failing, it says so and leaves the pickup:
        the claim's answer stands, and the guard may publish the message once more."""
        try:
            with self._begin() as connection:
                # The claim row first, as the take locks them: no deadlock between the two.
                connection.execute(lock_claim(claim_id))
                kept = delete_pickup_of_claimed(claim_id, task_id, now, processing=False)
                connection.execute(kept)
        except StoreUnavailable as exc:
            logger.warning(
                "could not drop the kept message of %s on %r: %s", task_id, claim_id, exc
            )

    def _pickup_if_owed(self, claim_id: str, owed: bool | None) -> Any:
        """The key's pickup row, when its claim owes the message (else ``None``): read with the
        debt in one statement, so a guard's take that cleared it meanwhile is seen."""
        return _readable_or_none(self._one(select_owed_pickup(claim_id))) if owed else None

    def close(self) -> None:
        self.engine.dispose()

    def _write_queued(
        self, statement: Insert | Update, request: ClaimRequest, pickup: Pickup, now: float
    ) -> bool:
        """Run ``statement``, which writes a ``queued`` claim row or nothing, and when it wrote
        one, the pickup row beside it in the same transaction; whether it wrote."""
        with self._begin() as connection:
            if _count(connection, statement) != 1:
                return False
            row = {
                "id": self.claim_id(request.storage_key),
                "task_id": request.task_id,
                "task_name": request.task_name,
                "envelope": pickup.envelope,
                "timeout": pickup.timeout,
                "republished": 0,
                "due_at": now + pickup.due_in,
            }
            connection.execute(upsert_pickup(self.dialect, row))
            return True

    @staticmethod
    def _queued_values(
        request: ClaimRequest, due_in: float, now: float, task_id: str | None = None
    ) -> dict[str, Any]:
        """A ``queued`` claim row for ``task_id`` (default: the request's), due ``due_in``
        seconds on, but for its id, token, creation time and fingerprint."""
        return {
            "key": _shown_key(request.key),
            "task_name": request.task_name,
            "status": QUEUED,
            "owner": "",
            "takeover": False,
            "task_id": task_id or request.task_id,
            "lease_expires_at": now + due_in,
            "updated_at": now,
            "expires_at": now + due_in + request.claim_ttl,
            "result_cached": False,
            "content_type": None,
            "content_encoding": None,
            "result": None,
            "taken_from": None,
            "owes_message": False,
        }

    def _processing_row(
        self, request: ClaimRequest, now: float, *, token: int, takeover: bool
    ) -> dict[str, Any]:
        return {
            "id": self.claim_id(request.storage_key),
            "key": _shown_key(request.key),
            "task_name": request.task_name,
            "status": PROCESSING,
            "owner": request.owner,
            "token": token,
            "takeover": takeover,
            "task_id": request.task_id,
            "fingerprint": request.fingerprint,
            "lease_expires_at": now + request.lease_seconds,
            "created_at": now,
            "updated_at": now,
            "expires_at": now + request.lease_seconds + request.claim_ttl,
            "result_cached": False,
            "content_type": None,
            "content_encoding": None,
            "result": None,
            "taken_from": None,
            "owes_message": False,
        }

    def _rowcount(self, statement: Insert | Update | Delete) -> int:
        """Rows a statement wrote, in a transaction of its own."""
        with self._begin() as connection:
            return _count(connection, statement)

    def _claim_row(self, storage_key: str) -> Any:
        """The claim row of a key (``None`` if it has none); ``CorruptRecord`` if unreadable."""
        return readable_claim(storage_key, self._one(select_claim(self.claim_id(storage_key))))

    def _one(self, statement: Select[Any]) -> Any:
        with self._begin() as connection:
            return connection.execute(statement).mappings().one_or_none()

    @contextmanager
    def _begin(self) -> Iterator[Connection]:
        self.ensure_schema()
        try:
            with self.engine.begin() as connection:
                yield connection
        except SQLAlchemyError as exc:
            if was_rolled_back_for_another(exc):
                raise Deadlocked(f"SQL store transaction rolled back: {exc}") from exc
            raise StoreUnavailable(f"SQL store error: {exc}") from exc

    def ensure_schema(self) -> None:
        """Create the tables if missing and check their schema versions (once per store)."""
        if self._schema_ready:
            return
        with self._schema_lock:
            if not self._schema_ready:
                ensure_component(
                    self.engine,
                    component=CLAIMS_COMPONENT,
                    version=CLAIMS_SCHEMA_VERSION,
                    tables=[claims],
                    what="claim store",
                    migrations=CLAIMS_MIGRATIONS,
                )
                ensure_component(
                    self.engine,
                    component=PICKUPS_COMPONENT,
                    version=PICKUPS_SCHEMA_VERSION,
                    tables=[pickups],
                    what="claim store pickups",
                    migrations=PICKUPS_MIGRATIONS,
                )
                self._schema_ready = True


def _disowned(
    connection: Connection, found: Any, timeout: float, now: float, unchanged: tuple[Any, Any]
) -> bool:
    """Whether the message a ``processing`` claim row keeps counts as lost now (its owner's
    lease ended ``timeout`` ago), its debt cleared for the guard to publish it; else its pickup
    (as read: ``unchanged``) is put off to that time, or the take gives way to a claim that
    came meanwhile."""
    claim_id = found["id"]
    lost_at = float(found["lease_expires_at"]) + timeout
    if lost_at > now:
        connection.execute(bump_pickup(claim_id, *unchanged, {"due_at": lost_at}))
        return False
    # The guard publishes it now, and no claim owes it: a compare-and-set on the row as read,
    # so that a claim that took the key over meanwhile (perhaps owing it) makes this take give
    # way, and one decided on the row before loses its own compare-and-set (the update's time
    # moved).
    disown = replace_if_unchanged(claim_id, found, {"owes_message": False, "updated_at": now})
    if _count(connection, disown) == 0:
        connection.rollback()
        return False
    return True


def _owed(pickup: Any, task_id: str) -> dict[str, Any]:
    """The fields of a claim's answer naming the message it owes, from the key's pickup row
    (none when that row is gone, or it is the claiming call's own message: owed to no one)."""
    if pickup is None or pickup["task_id"] == task_id:
        return {}
    return {"owed_task_id": pickup["task_id"], "taken_over_envelope": bytes(pickup["envelope"])}


def _readable_or_none(pickup: Any) -> Any:
    """A pickup row, or ``None`` when there is none or it cannot be read (the guard's sweep
    reports that)."""
    try:
        return readable_pickup(pickup)
    except CorruptRecord:
        return None


def _count(connection: Connection, statement: Executable) -> int:
    """Rows a statement wrote.

    PostgreSQL and SQLite inserts return their rows (their drivers' row counts are not reliable
    for INSERT), so those are counted; MySQL reports matched rows (SQLAlchemy's FOUND_ROWS).
    """
    result = connection.execute(statement)
    if result.returns_rows:
        return len(result.all())
    return int(result.rowcount)


def _shown_key(key: str) -> str:
    """The caller's key as the ``key`` column keeps it, for people to read (rows are found by
    their id, which holds a long key's hash): a key longer than the column is cut."""
    return key[:_KEY_CHARS]


_KEY_CHARS: int = claims.c.key.type.length  # type: ignore[attr-defined]
