"""The pickup guard's part of the store contract: queued keys, their envelopes and the sweep.

Every store answers the same: ``reserve`` queues a key no record protects, a claim acquires
a queued key, and ``take_due`` hands each overdue queued key, and each claimed key whose owner's
lease ended a re-publication timeout ago, to one sweep per due period.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from idempotent_tasks.errors import StoreUnavailable
from idempotent_tasks.records import (
    ClaimRequest,
    CompleteOutcome,
    DuePickup,
    EncodedResult,
    Outcome,
    Pickup,
    Record,
    Status,
)
from idempotent_tasks.stores import MemoryStore, Store
from idempotent_tasks.stores import sql as sql_store_module
from idempotent_tasks.stores.redis import RedisStore
from idempotent_tasks.stores.sql import SqlStore
from tests.claim_requests import claim_request
from tests.contract.conftest import SERVER_STORES, open_store, store_url

Make = Callable[..., ClaimRequest]
RESULT = EncodedResult(content_type="application/json", content_encoding="utf-8", body=b'{"a": 1}')
# Not text: NUL and bytes invalid in UTF-8 must come back as they went in.
ENVELOPE = b"\x00\xff\x80envelope\x00\x01" + bytes(range(256))
#: Seconds until a reserved key's message counts as lost, and the re-publication timeout.
DUE_IN = 0.3
TIMEOUT = 0.25
#: Sleeps longer than DUE_IN, and than the first backoff (TIMEOUT * 2), with some slack.
PAST_DUE = DUE_IN + 0.15
PAST_FIRST_BACKOFF = TIMEOUT * 2 + 0.15


def make_pickup(
    envelope: bytes = ENVELOPE, due_in: float = DUE_IN, timeout: float = TIMEOUT
) -> Pickup:
    return Pickup(envelope=envelope, due_in=due_in, timeout=timeout)


def request_for(make_request: Make, name: str, **overrides: object) -> ClaimRequest:
    """A request for key ``name`` (tests with several keys)."""
    return make_request(storage_key=f"tasks.charge:{name}", key=name, **overrides)


def taken_keys(store: Store, limit: int = 100) -> list[str]:
    return [due.storage_key for due in store.take_due(limit)]


def unread(record: Record | None) -> Record | None:
    """``record`` without the time it was read, to compare what two reads found."""
    return None if record is None else dataclasses.replace(record, read_at=None)


# -- reserve ------------------------------------------------------------------------------


def test_reserve_on_an_empty_key_queues_it(store: Store, make_request: Make) -> None:
    request = make_request(task_id="t-7", ttl_seconds=60.0)
    assert store.reserve(request, make_pickup()) is None
    record = store.get(request.storage_key)
    assert record is not None
    assert record.status is Status.QUEUED
    assert (record.owner, record.task_id, record.fingerprint) == ("", "t-7", request.fingerprint)
    assert (record.key, record.task_name) == (request.key, request.task_name)
    assert record.lease_expires_at == pytest.approx(time.time() + DUE_IN, abs=1)
    assert record.expires_at == pytest.approx(time.time() + DUE_IN + 60, abs=1)
    assert record.result is None


def _put_in_state(store: Store, request: ClaimRequest, state: str) -> None:
    if state == "queued":
        assert store.reserve(request, make_pickup()) is None
        return
    token = store.claim(request).token
    if state == "completed":
        store.complete(request, token, RESULT)
    elif state == "lease expired":
        time.sleep(0.3)  # the request's lease is 0.1 s


@pytest.mark.parametrize("state", ["queued", "processing", "lease expired", "completed"])
def test_reserve_on_a_live_record_returns_it_and_writes_nothing(
    store: Store, make_request: Make, state: str
) -> None:
    # Given a key in some state (task-1's)
    first = make_request(task_id="task-1", lease_seconds=0.1 if state == "lease expired" else 30)
    _put_in_state(store, first, state)
    before = store.get(first.storage_key)
    assert before is not None
    # When another publish of the key tries to reserve it
    other = make_request(storage_key=first.storage_key, task_id="task-2")
    found = store.reserve(other, make_pickup(envelope=b"other", due_in=0.0))
    # Then it gets the record found, and the record is unchanged
    assert found is not None
    assert (found.status, found.owner, found.token, found.task_id) == (
        before.status,
        before.owner,
        before.token,
        "task-1",
    )
    assert unread(store.get(first.storage_key)) == unread(before)
    if state == "queued":  # the first reservation's message is the one kept
        time.sleep(PAST_DUE)
        [due] = store.take_due(10)
        assert (due.task_id, due.envelope) == ("task-1", ENVELOPE)
    else:
        assert store.take_due(10) == []


@pytest.mark.parametrize("gone", ["released", "expired"])
def test_reserve_after_the_record_is_gone_queues_the_key(
    store: Store, make_request: Make, gone: str
) -> None:
    first = make_request(ttl_seconds=0.2)
    token = store.claim(first).token
    if gone == "released":
        store.release(first, token)
    else:
        store.complete(first, token, RESULT)
        time.sleep(0.35)
    later = make_request(storage_key=first.storage_key, task_id="task-2")
    assert store.reserve(later, make_pickup()) is None
    record = store.get(first.storage_key)
    assert record is not None
    assert (record.status, record.task_id) == (Status.QUEUED, "task-2")
    # and the key's tokens keep growing past the one given before
    assert store.claim(later).token > token


# -- claiming queued keys -----------------------------------------------------------------


def test_claim_of_a_queued_key_acquires_with_a_growing_token(
    store: Store, make_request: Make
) -> None:
    request = make_request()
    tokens = []
    for _ in range(3):
        assert store.reserve(request, make_pickup()) is None
        claim = store.claim(request)
        assert claim.outcome is Outcome.ACQUIRED
        assert not claim.takeover
        tokens.append(claim.token)
        record = store.get(request.storage_key)
        assert record is not None
        assert (record.status, record.owner) == (Status.PROCESSING, request.owner)
        assert store.release(request, claim.token) is True
    assert tokens == sorted(set(tokens))
    assert tokens[0] >= 1


def test_a_queued_key_waits_for_its_own_message_until_that_counts_as_lost(
    store: Store, make_request: Make
) -> None:
    # Given a key queued for message "t-own" (a reservation, or a retry sitting out its
    # countdown), due in 1 s (time for the claim below on a busy machine)
    own = make_request(task_id="t-own")
    assert store.reserve(own, make_pickup(due_in=1.0)) is None
    # When another message of the key is delivered first, then it waits for that one
    other = make_request(task_id="t-other")
    early = store.claim(other)
    assert early.outcome is Outcome.IN_PROGRESS
    assert early.record is not None and early.record.task_id == "t-own"
    # And once the key's message counts as lost, the other one runs it, told whose message
    # it took over (that call's callers wait on its task id) and given that message, to be
    # published again once the key is completed
    time.sleep(1.0 + 0.15)
    late = store.claim(other)
    assert (late.outcome, late.taken_from_task_id) == (Outcome.ACQUIRED, "t-own")
    assert (late.owed_task_id, late.taken_over_envelope) == ("t-own", ENVELOPE)


def test_a_queued_keys_own_message_takes_nothing_from_another_call(
    store: Store, make_request: Make
) -> None:
    own = make_request(task_id="t-own")
    assert store.reserve(own, make_pickup()) is None
    claim = store.claim(own)
    assert (claim.outcome, claim.taken_from_task_id) == (Outcome.ACQUIRED, None)
    assert claim.taken_over_envelope is None


def test_claim_of_a_queued_key_with_another_fingerprint_is_a_mismatch(
    store: Store, make_request: Make
) -> None:
    first = make_request(fingerprint="fp-a")
    store.reserve(first, make_pickup(due_in=1.0))  # its message not lost by the last claim
    other = store.claim(
        make_request(storage_key=first.storage_key, fingerprint="fp-b", task_id="task-2")
    )
    assert other.outcome is Outcome.MISMATCH
    assert other.record is not None
    assert (other.record.fingerprint, other.record.status) == ("fp-a", Status.QUEUED)
    unchecked = make_request(
        storage_key=first.storage_key, fingerprint="fp-b", task_id="task-2", validate=False
    )
    assert store.claim(unchecked).outcome is Outcome.IN_PROGRESS  # the key's message runs it


@pytest.mark.parametrize("how", ["reserved", "overdue", "taken by a sweep", "released to retry"])
def test_a_queued_key_is_never_in_progress(store: Store, make_request: Make, how: str) -> None:
    request = make_request()
    if how == "released to retry":
        store.release(request, store.claim(request).token, make_pickup())
    else:
        store.reserve(request, make_pickup())
    if how in ("overdue", "taken by a sweep"):
        time.sleep(PAST_DUE)
    if how == "taken by a sweep":
        assert taken_keys(store) == [request.storage_key]
    record = store.get(request.storage_key)
    assert record is not None
    assert record.status is Status.QUEUED
    # Any delivery of the key's message claims it, whichever worker it reaches.
    claim = store.claim(make_request(storage_key=request.storage_key))
    assert claim.outcome is Outcome.ACQUIRED
    assert not claim.takeover


# -- the sweep ----------------------------------------------------------------------------


def test_take_due_hands_an_overdue_key_out_once_per_backoff(
    store: Store, make_request: Make
) -> None:
    # Given a reserved key due in 1 s, with a first backoff of 2 s (time for the steps between
    # two takes on a busy machine)
    request = make_request(task_id="t-3")
    store.reserve(request, make_pickup(due_in=1.0, timeout=1.0))
    # Not before it is due
    assert store.take_due(10) == []
    time.sleep(1.0 + 0.15)
    # Then once, with its envelope intact
    assert store.take_due(10) == [
        DuePickup(
            storage_key=request.storage_key,
            task_name=request.task_name,
            task_id="t-3",
            envelope=ENVELOPE,
            republished=1,
        )
    ]
    record = store.get(request.storage_key)
    assert record is not None
    assert record.status is Status.QUEUED
    assert record.lease_expires_at == pytest.approx(time.time() + 2.0, abs=0.7)
    # Not again until the backed-off due time
    assert store.take_due(10) == []
    time.sleep(1.0)
    assert store.take_due(10) == []
    time.sleep(1.0 + 0.15)
    [again] = store.take_due(10)
    assert (again.storage_key, again.envelope, again.republished) == (
        request.storage_key,
        ENVELOPE,
        2,
    )


def test_take_hands_one_overdue_key_out_once_per_backoff(store: Store, make_request: Make) -> None:
    # Given two reserved keys due in 1 s, with a first backoff of 2 s (time for the steps
    # between two takes on a busy machine)
    first, second = request_for(make_request, "first"), request_for(make_request, "second")
    for request in (first, second):
        assert store.reserve(request, make_pickup(due_in=1.0, timeout=1.0)) is None
    # Not before it is due
    assert store.take(first.storage_key) is None
    time.sleep(1.0 + 0.15)
    # Then once, with its envelope, as the sweep would have taken it
    assert store.take(first.storage_key) == DuePickup(
        storage_key=first.storage_key,
        task_name=first.task_name,
        task_id=first.task_id,
        envelope=ENVELOPE,
        republished=1,
    )
    assert store.take(first.storage_key) is None
    # and the sweep, backed off the same, hands out only the other key
    assert taken_keys(store) == [second.storage_key]
    time.sleep(2.0 + 0.15)
    again = store.take(first.storage_key)
    assert again is not None and again.republished == 2


@pytest.mark.parametrize("state", ["unknown", "claimed unreserved, lease over", "completed"])
def test_take_of_a_key_without_a_lost_message_is_none(
    store: Store, make_request: Make, state: str
) -> None:
    request = make_request(lease_seconds=0.1)
    if state != "unknown":
        token = store.claim(request).token
        if state == "completed":
            store.complete(request, token, RESULT)
    time.sleep(PAST_FIRST_BACKOFF)
    assert store.take(request.storage_key) is None


def test_records_read_carry_the_store_time(store: Store, make_request: Make) -> None:
    request = make_request()
    assert store.reserve(request, make_pickup(due_in=1.0)) is None
    found = store.reserve(make_request(task_id="task-2"), make_pickup())
    read = store.get(request.storage_key)
    assert found is not None and read is not None
    # This host's clock is the stores' here (Redis, the databases and this process share it).
    assert found.read_at == pytest.approx(time.time(), abs=1)
    assert read.read_at == pytest.approx(time.time(), abs=1)
    # Written at the reserve (due in 1 s), read a moment later (up to three quarters of a
    # second on a loaded machine).
    assert read.store_time() + 1.0 - 0.75 <= read.lease_expires_at
    assert read.lease_expires_at <= read.store_time() + 1.0 + 0.01


@pytest.mark.parametrize("answer", ["in_progress", "completed", "mismatch"])
def test_a_claims_answer_carries_the_store_time(
    store: Store, make_request: Make, answer: str
) -> None:
    # Given a key another owner holds (or finished)
    owner = make_request(owner="owner-1", lease_seconds=30.0)
    token = store.claim(owner).token
    if answer == "completed":
        store.complete(owner, token, RESULT)
    # When another attempt claims it
    fingerprint = "other-arguments" if answer == "mismatch" else owner.fingerprint
    found = store.claim(make_request(owner="owner-2", fingerprint=fingerprint)).record
    # Then the record it is answered with says when the store read it
    assert found is not None
    assert found.read_at == pytest.approx(time.time(), abs=1)
    if answer == "in_progress":
        assert found.lease_expires_at - found.store_time() == pytest.approx(30.0, abs=1)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_read_at_is_the_stores_clock_not_this_hosts(
    kind: str, make_request: Make, request: pytest.FixtureRequest
) -> None:
    # Given a store whose clock runs an hour ahead of this host's (Redis's is its TIME)
    def ahead() -> float:
        return time.time() + 3600

    store: Store = (
        MemoryStore(clock=ahead)
        if kind == "memory"
        else SqlStore(store_url(kind, request), prefix="contract", clock=ahead)
    )
    claim = make_request()
    store.claim(claim)
    # Then the records it reads say when by its clock
    found = store.reserve(make_request(task_id="task-2"), make_pickup())
    read = store.get(claim.storage_key)
    claimed = store.claim(make_request(owner="owner-2")).record
    assert found is not None and read is not None and claimed is not None
    assert found.read_at == pytest.approx(ahead(), abs=1)
    assert read.read_at == pytest.approx(ahead(), abs=1)
    assert claimed.read_at == pytest.approx(ahead(), abs=1)
    assert read.store_time() == read.read_at
    store.close()


def test_a_completed_keys_message_is_never_sent_again_under_a_later_owner(
    store: Store, make_request: Make
) -> None:
    # Given a reserved key that ran and completed, and whose record then expired
    first = make_request(task_id="t-first", ttl_seconds=0.2)
    assert store.reserve(first, make_pickup()) is None
    store.complete(first, store.claim(first).token, RESULT)
    time.sleep(0.3)
    # When a later call, published without a reservation, claims the key and its owner dies
    later = make_request(task_id="t-later", fingerprint="fp-later", lease_seconds=0.1)
    assert store.claim(later).outcome is Outcome.ACQUIRED
    time.sleep(0.1 + PAST_FIRST_BACKOFF)
    # Then no sweep sends the first call's message again under the later owner's task id
    assert store.take_due(10) == []


# -- a completion over another call's reservation ----------------------------------------


def completed_over_a_reservation(
    store: Store, make_request: Make, due_in: float = DUE_IN, ttl: float = 60, **reserved: object
) -> tuple[ClaimRequest, int]:
    """A claim by call "owner-task" whose record vanished (a store restarted without
    persistence), and which completed (its result kept ``ttl`` s) after a call made of
    ``reserved`` (a new publish of the key) reserved the key for its message, due in
    ``due_in`` s: that claim and its token."""
    owner = make_request(task_id="owner-task", ttl_seconds=ttl)
    token = store.claim(owner).token
    assert token is not None
    store.forget(owner.storage_key)
    newcomer = make_request(storage_key=owner.storage_key, **reserved)
    assert store.reserve(newcomer, make_pickup(envelope=b"its message", due_in=due_in)) is None
    assert store.complete(owner, token, RESULT) is CompleteOutcome.RECOVERED
    return owner, token


def assert_completed_keeping_nothing(store: Store, key: str, task_id: str) -> None:
    """``key`` is completed with RESULT, and keeps nothing of call ``task_id`` to publish."""
    assert store.make_reservation_due(key, task_id) is False
    assert store.take(key) is None
    record = store.get(key)
    assert record is not None and (record.status, record.result) == (Status.COMPLETED, RESULT)


def test_a_completion_over_another_calls_reservation_keeps_its_message_for_the_guard(
    store: Store, make_request: Make
) -> None:
    # Given a claim whose record vanished, and a new call with the same arguments that
    # reserved the key meanwhile (its message published, and perhaps lost by the broker)
    # When the claim completes
    owner, _ = completed_over_a_reservation(store, make_request, task_id="newcomer")
    # Then its result is the key's
    record = store.get(owner.storage_key)
    assert record is not None
    assert (record.status, record.task_id, record.result) == (
        Status.COMPLETED,
        "owner-task",
        RESULT,
    )
    # and the new call's message is kept: once due, the guard publishes it (under its own task
    # id) once per backoff
    time.sleep(PAST_DUE)
    taken = store.take_due(100)
    assert [(due.storage_key, due.task_id, due.envelope, due.republished) for due in taken] == [
        (owner.storage_key, "newcomer", b"its message", 1)
    ]
    assert store.take_due(100) == []
    # and the key stays completed with the owner's result, for as long as it was to
    after = store.get(owner.storage_key)
    assert after is not None
    assert (after.status, after.task_id, after.result, after.expires_at) == (
        Status.COMPLETED,
        "owner-task",
        RESULT,
        record.expires_at,
    )


def test_the_kept_message_goes_once_its_call_is_answered(store: Store, make_request: Make) -> None:
    # Given a completed key keeping a new call's message for the guard
    owner, _ = completed_over_a_reservation(store, make_request, task_id="newcomer")
    # When that message comes, and is answered from the key's result
    newcomer = make_request(storage_key=owner.storage_key, task_id="newcomer")
    answer = store.claim(newcomer)
    assert answer.outcome is Outcome.COMPLETED
    assert answer.record is not None and answer.record.result == RESULT
    # Then the guard never publishes it again
    time.sleep(PAST_DUE)
    assert store.take(owner.storage_key) is None
    assert store.take_due(100) == []


def test_a_kept_message_is_dropped_or_made_due_for_its_own_call_only(
    store: Store, make_request: Make
) -> None:
    # Given a completed key keeping a new call's message, due in a minute: not before
    owner, _ = completed_over_a_reservation(store, make_request, due_in=60, task_id="newcomer")
    assert store.take(owner.storage_key) is None
    # When its publish is handed to the guard (it failed), it is due at once
    assert store.make_reservation_due(owner.storage_key, "owner-task") is False
    assert store.make_reservation_due(owner.storage_key, "newcomer") is True
    due = store.take(owner.storage_key)
    assert due is not None and due.task_id == "newcomer"
    # and when that call is revoked, its message goes; the owner's call keeps nothing
    assert store.drop_pickup(owner.storage_key, "owner-task") is False
    assert store.drop_pickup(owner.storage_key, "newcomer") is True
    assert_completed_keeping_nothing(store, owner.storage_key, "newcomer")


def test_a_kept_message_stays_for_other_calls_and_the_owners_own(
    store: Store, make_request: Make
) -> None:
    # Given a completed key keeping a new call's message
    owner, token = completed_over_a_reservation(store, make_request, task_id="newcomer")
    # When the owner completes again (its reply lost), its own message comes again, and a
    # third call's, each answered from the result
    assert store.complete(owner, token, RESULT) is CompleteOutcome.STORED
    redelivered = make_request(storage_key=owner.storage_key, task_id="owner-task")
    third = make_request(storage_key=owner.storage_key, task_id="third")
    assert store.claim(redelivered).outcome is Outcome.COMPLETED
    assert store.claim(third).outcome is Outcome.COMPLETED
    assert store.drop_pickup(owner.storage_key, "third") is False
    assert store.cancel_reservation(owner.storage_key, "owner-task") is False
    # Then the new call's message is still kept for the guard
    time.sleep(PAST_DUE)
    due = store.take(owner.storage_key)
    assert due is not None and due.task_id == "newcomer"


def test_a_kept_message_goes_with_its_calls_cancelled_publish(
    store: Store, make_request: Make
) -> None:
    # Given a completed key keeping a new call's message, whose publish then failed for good
    # (the broker refused it: its caller got the error)
    owner, _ = completed_over_a_reservation(store, make_request, task_id="newcomer")
    # When its reservation is cancelled, the message goes: the guard never publishes it
    assert store.cancel_reservation(owner.storage_key, "newcomer") is True
    time.sleep(PAST_DUE)
    assert_completed_keeping_nothing(store, owner.storage_key, "newcomer")


@pytest.mark.parametrize(
    "other", ["ORDER-42", "order-42 ", "ördér-42"], ids=["case", "trailing-space", "accents"]
)
def test_a_task_id_differing_only_in_case_spaces_or_accents_is_another_call(
    store: Store, make_request: Make, other: str
) -> None:
    # Given a key queued for call "order-42" (a task id its caller chose), its message kept
    queued = make_request(task_id="order-42")
    assert store.reserve(queued, make_pickup(due_in=60)) is None
    # When a call whose id a case-, space- or accent-blind comparison takes for it cancels
    # its reservation, or drops its kept message, then neither is that call's to take
    assert store.cancel_reservation(queued.storage_key, other) is False
    assert store.make_reservation_due(queued.storage_key, other) is False
    record = store.get(queued.storage_key)
    assert record is not None and (record.status, record.task_id) == (Status.QUEUED, "order-42")
    assert store.cancel_reservation(queued.storage_key, "order-42") is True
    # Nor, once another call completed the key keeping call "order-42"'s message for the
    # guard, is that message another call's to drop
    owner, _ = completed_over_a_reservation(store, make_request, task_id="order-42")
    assert store.drop_pickup(owner.storage_key, other) is False
    time.sleep(PAST_DUE)
    due = store.take(owner.storage_key)
    assert due is not None and due.task_id == "order-42"


def test_a_key_keeping_a_message_outlives_a_shorter_result_ttl_until_its_due_time(
    store: Store, make_request: Make
) -> None:
    # Given a completion, whose result is kept 0.1 s, over a reservation due in 0.3 s
    owner, _ = completed_over_a_reservation(store, make_request, ttl=0.1, task_id="newcomer")
    # When the reservation's due time comes, then the guard still finds its message, and the
    # key still answers with the result, until the reservation would have expired
    time.sleep(PAST_DUE)
    due = store.take(owner.storage_key)
    assert due is not None and due.task_id == "newcomer"
    answer = store.claim(make_request(storage_key=owner.storage_key, task_id="third"))
    assert answer.outcome is Outcome.COMPLETED
    assert answer.record is not None and answer.record.expires_at > time.time() + 50


def test_a_key_taken_over_and_completed_keeps_nothing_of_the_call_it_took_it_from(
    store: Store, make_request: Make
) -> None:
    # Given a key whose queued message counted as lost, taken over by another call (which
    # owes that message: its worker publishes it once the key completes), and completed
    lost = make_request(task_id="t-lost")
    assert store.reserve(lost, make_pickup()) is None
    time.sleep(PAST_DUE)
    taker = make_request(task_id="t-taker")
    claimed = store.claim(taker)
    assert (claimed.outcome, claimed.owed_task_id) == (Outcome.ACQUIRED, "t-lost")
    assert claimed.token is not None
    assert store.complete(taker, claimed.token, RESULT) is CompleteOutcome.STORED
    # Then the record keeps no message of the lost call for the guard: none to cancel, drop,
    # make due or take
    assert store.cancel_reservation(lost.storage_key, "t-lost") is False
    assert store.drop_pickup(lost.storage_key, "t-lost") is False
    assert_completed_keeping_nothing(store, lost.storage_key, "t-lost")
    # and that call's message, when it comes, is answered from the result
    assert store.claim(lost).outcome is Outcome.COMPLETED


@pytest.mark.parametrize(
    "reserved",
    [{"task_id": "owner-task"}, {"task_id": "other", "fingerprint": "fp-other"}],
    ids=["its-own-call", "other-arguments"],
)
def test_a_completion_over_a_reservation_of_its_own_call_or_other_arguments_keeps_nothing(
    store: Store, make_request: Make, reserved: dict[str, object]
) -> None:
    # Its own call's message reserved anew (a retry): there is no other call to answer; a
    # call with other arguments (its claim fails with a mismatch) is owed no value
    owner, _ = completed_over_a_reservation(store, make_request, **reserved)
    time.sleep(PAST_DUE)
    assert store.take(owner.storage_key) is None
    assert store.take_due(100) == []


def test_a_large_envelope_round_trips(store: Store, make_request: Make) -> None:
    envelope = bytes(range(256)) * 2048  # 512 KiB: more than a MySQL BLOB holds
    store.reserve(make_request(), make_pickup(envelope=envelope, due_in=0.0))
    time.sleep(0.05)
    [due] = store.take_due(10)
    assert due.envelope == envelope


def test_take_due_skips_keys_no_longer_queued(store: Store, make_request: Make) -> None:
    # Given four reserved keys: one claimed, one completed, one forgotten, one left queued (a
    # first backoff of 2 s: not due again at the sweep's second look, on a busy machine too)
    claimed, completed, forgotten, lost = (
        request_for(make_request, name) for name in ("claimed", "completed", "forgotten", "lost")
    )
    for request in (claimed, completed, forgotten, lost):
        assert store.reserve(request, make_pickup(timeout=1.0)) is None
    store.claim(claimed)
    store.complete(completed, store.claim(completed).token, RESULT)
    assert store.forget(forgotten.storage_key) is True
    time.sleep(PAST_DUE)
    # When the sweep looks, only the one no worker claimed is due
    assert taken_keys(store) == [lost.storage_key]
    assert store.take_due(10) == []
    # and the claimed and completed keys are as their workers left them
    running = store.get(claimed.storage_key)
    assert running is not None
    assert (running.status, running.owner) == (Status.PROCESSING, claimed.owner)
    assert running.lease_expires_at == pytest.approx(time.time() + 30, abs=2)
    done = store.get(completed.storage_key)
    assert done is not None
    assert (done.status, done.result) == (Status.COMPLETED, RESULT)


def test_take_due_respects_its_limit(store: Store, make_request: Make) -> None:
    names = [f"k{i}" for i in range(5)]
    for name in names:  # a first backoff of 2 s: none is due again within the four sweeps
        store.reserve(request_for(make_request, name), make_pickup(due_in=0.0, timeout=1.0))
    time.sleep(0.05)
    batches = [taken_keys(store, limit=2) for _ in range(4)]
    assert [len(batch) for batch in batches] == [2, 2, 1, 0]
    taken = [key for batch in batches for key in batch]
    assert sorted(taken) == sorted(f"tasks.charge:{name}" for name in names)


@pytest.mark.parametrize("kind", SERVER_STORES)
def test_the_sweep_takes_only_its_own_prefixs_keys_however_their_case_differs(
    kind: str, request: pytest.FixtureRequest, make_request: Make
) -> None:
    # Given two apps on one store whose key prefixes differ in case only (SQLite's LIKE
    # compares ASCII letters ignoring case), and a due key of one of them
    with _apps_on_one_store(kind, request, "Shop", "shop") as (upper, lower):
        lower.reserve(request_for(make_request, "k1"), make_pickup(due_in=0.0))
        time.sleep(0.05)
        # Then the other app's sweep takes nothing, and its own app's sweep takes it
        assert upper.take_due(10) == []
        assert taken_keys(lower) == ["tasks.charge:k1"]


@pytest.mark.parametrize("kind", SERVER_STORES)
def test_the_sweep_leaves_alone_the_keys_of_a_prefix_that_extends_its_own(
    kind: str, request: pytest.FixtureRequest, make_request: Make
) -> None:
    # Given two apps on one store with prefixes "shop" and "shop:eu" (the SQL store's row ids
    # of the second start with the first's "shop:"), more due keys of "shop:eu" than ten
    # batches of two hold (its app stopped), then one of "shop", due last
    others = [f"eu{i:02}" for i in range(25)]
    with _apps_on_one_store(kind, request, "shop", "shop:eu") as (shop, shop_eu):
        for name in others:
            shop_eu.reserve(request_for(make_request, name), make_pickup(due_in=0.0))
        time.sleep(0.01)
        shop.reserve(request_for(make_request, "own"), make_pickup(due_in=0.0))
        time.sleep(0.05)
        # Then the sweep of "shop", two keys at a time, takes its own key only, past the others
        assert taken_keys(shop, limit=2) == ["tasks.charge:own"]
        # and "shop:eu"'s sweep takes its own, as they were kept
        taken = shop_eu.take_due(100)
        assert sorted(due.storage_key for due in taken) == [
            f"tasks.charge:{name}" for name in others
        ]
        assert {due.task_name for due in taken} == {"tasks.charge"}


@contextmanager
def _apps_on_one_store(
    kind: str, request: pytest.FixtureRequest, *prefixes: str
) -> Iterator[list[Store]]:
    """Stores of ``kind`` on one emptied store, one per key prefix (each an app of its own)."""
    url = store_url(kind, request)
    stores = [open_store(kind, url, prefix=prefix) for prefix in prefixes]
    try:
        yield stores
    finally:
        for store in stores:
            store.close()


@pytest.mark.parametrize("kind", SERVER_STORES)
def test_take_due_hands_out_what_it_took_when_the_store_fails_half_way(
    kind: str, request: pytest.FixtureRequest, make_request: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given two due keys, and a store that goes away after the first is taken
    store = open_store(kind, store_url(kind, request))
    try:
        for name in ("k1", "k2"):
            store.reserve(request_for(make_request, name), make_pickup(due_in=0.0))
        time.sleep(0.05)
        take_one = "take" if kind == "redis" else "_take"
        original, calls = getattr(store, take_one), []

        def then_fail(*args: object) -> object:
            calls.append(args)
            if len(calls) > 1:
                raise StoreUnavailable("gone")
            return original(*args)

        monkeypatch.setattr(store, take_one, then_fail)
        # When the sweep takes them, then the key already taken (moved on to its next due
        # time) is handed out, to be published, not dropped until that time
        assert len(store.take_due(10)) == 1
        monkeypatch.undo()
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mariadb"])
def test_sql_take_due_hands_out_what_it_took_when_a_later_batch_cannot_be_read(
    kind: str, request: pytest.FixtureRequest, make_request: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given three due keys, the first claimed since (its pickup is no longer due: a batch of
    # two takes one key and looks for more), and a database that goes away after one batch
    store = open_store(kind, store_url(kind, request))
    try:
        requests = [request_for(make_request, f"k{i}") for i in range(3)]
        for request_ in requests:
            store.reserve(request_, make_pickup(due_in=0.0))
            time.sleep(0.01)  # due in this order
        store.claim(requests[0])
        time.sleep(0.05)
        original, batches = sql_store_module.select_due, []

        def then_fail(*args: object, **kwargs: object) -> object:
            batches.append(args)
            if len(batches) > 1:
                raise StoreUnavailable("gone")
            return original(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(sql_store_module, "select_due", then_fail)
        # When the sweep takes two, then the key already taken (moved on to its next due
        # time) is handed out, to be published, not dropped until that time
        assert [due.storage_key for due in store.take_due(2)] == [requests[1].storage_key]
        assert len(batches) == 2
    finally:
        monkeypatch.undo()
        store.close()


def test_a_redis_due_index_holding_something_else_stops_the_guard_for_its_shard_alone(
    request: pytest.FixtureRequest, make_request: Make
) -> None:
    # Given a due key, and another shard's due index overwritten with a string (by hand)
    store = open_store("redis", store_url("redis", request), prefix=f"p{uuid.uuid4().hex[:8]}")
    assert isinstance(store, RedisStore)
    try:
        due_one = request_for(make_request, "k-due")
        store.reserve(due_one, make_pickup(due_in=0.0))
        own_index = store.names(due_one.storage_key)[2]
        other = next(
            f"{store.prefix}:{{{shard:02x}}}:due"
            for shard in range(256)
            if f"{store.prefix}:{{{shard:02x}}}:due" != own_index
        )
        store.client.set(other, "not an index")
        time.sleep(0.05)
        # When the sweep takes due keys, then it takes that one, skipping the unreadable index
        assert [due.storage_key for due in store.take_due(10)] == [due_one.storage_key]
    finally:
        for index in range(256):
            store.client.delete(f"{store.prefix}:{{{index:02x}}}:due")
        store.close()


def test_claimed_keys_do_not_hide_due_ones_for_good(store: Store, make_request: Make) -> None:
    # Keys claimed after they were reserved leave index entries the sweep drops on its way.
    # (A first backoff of 2 s: none taken is due again within the four sweeps.)
    requests = [request_for(make_request, f"k{i}") for i in range(6)]
    for request in requests:
        store.reserve(request, make_pickup(due_in=0.0, timeout=1.0))
        time.sleep(0.01)  # the claimed ones are due first
    for request in requests[:4]:
        store.claim(request)
    time.sleep(0.05)
    taken = [key for _ in range(4) for key in taken_keys(store, limit=2)]
    assert sorted(taken) == sorted(request.storage_key for request in requests[4:])


def test_a_claimed_key_whose_owner_died_is_taken_under_the_owners_task_id(
    store: Store, make_request: Make
) -> None:
    # Given a reserved key claimed by its own message, whose owner then died
    owner = make_request(task_id="t-owner", lease_seconds=0.2)
    assert store.reserve(owner, make_pickup()) is None
    assert store.claim(owner).outcome is Outcome.ACQUIRED
    # When nothing took the key over for a re-publication timeout after the lease
    time.sleep(0.2 + TIMEOUT + 0.1)
    # Then the sweep takes it, to publish the owner's message again under its own task id
    assert [(due.task_id, due.envelope) for due in store.take_due(10)] == [("t-owner", ENVELOPE)]


def test_a_dead_takers_key_is_taken_under_the_task_id_of_the_message_it_keeps(
    store: Store, make_request: Make
) -> None:
    # Given a reserved key (a re-publication timeout of 1 s) claimed by another call (task id
    # "t-owner") with a 0.2 s lease
    reserved = make_request(task_id="t-reserved")
    assert store.reserve(reserved, make_pickup(due_in=0.0, timeout=1.0)) is None
    time.sleep(0.01)  # its message counts as lost at once (Redis: 1 ms on)
    owner = make_request(task_id="t-owner", lease_seconds=0.2)
    first = store.claim(owner)
    assert (first.outcome, first.taken_over_envelope) == (Outcome.ACQUIRED, ENVELOPE)
    # While its lease lives, and for one re-publication timeout after, it is not lost
    time.sleep(0.1)
    assert store.take_due(10) == []
    time.sleep(0.25)  # lease over, timeout not yet (0.85 s to go: room for a busy machine)
    assert store.take_due(10) == []
    # When the owner died and nothing took the key over for the timeout (1 s after the lease)
    time.sleep(1.0)
    taken = store.take_due(10)
    # Then the sweep takes it once, to publish the message it keeps again under that message's
    # own task id (the owner's callers wait on another id, and its own message is not kept),
    # and backs off
    assert [(due.task_id, due.envelope, due.republished) for due in taken] == [
        ("t-reserved", ENVELOPE, 1)
    ]
    assert store.take_due(10) == []
    # and the re-published message takes the key over, told whose call it took the key from
    again = store.claim(make_request(task_id="t-reserved"))
    assert (again.outcome, again.takeover, again.taken_from_task_id) == (
        Outcome.ACQUIRED,
        True,
        "t-owner",
    )
    assert again.taken_over_envelope is None


def _taken_from_a_lost_message(
    store: Store, make_request: Make, lease: float, timeout: float = TIMEOUT
) -> ClaimRequest:
    """A key reserved for call "t-lost" (with a ``timeout``-second re-publication timeout),
    whose message counted as lost and was taken over by call "t-taker" (returned, with a
    ``lease``-second lease)."""
    lost = make_request(task_id="t-lost")
    assert store.reserve(lost, make_pickup(due_in=0.0, timeout=timeout)) is None
    time.sleep(0.01)
    taker = make_request(task_id="t-taker", lease_seconds=lease)
    first = store.claim(taker)
    assert (first.outcome, first.taken_from_task_id) == (Outcome.ACQUIRED, "t-lost")
    assert (first.owed_task_id, first.taken_over_envelope) == ("t-lost", ENVELOPE)
    return taker


def _dead_taker_taken_by_the_guard(
    store: Store, make_request: Make
) -> tuple[ClaimRequest, DuePickup]:
    """A key taken from a lost message (call "t-lost") by a taker with a 0.1 s lease that died,
    and what the guard then took to publish: the taker's request, and that pickup."""
    taker = _taken_from_a_lost_message(store, make_request, lease=0.1)
    time.sleep(0.1 + TIMEOUT + 0.1)
    [due] = store.take_due(10)
    assert (due.task_id, due.envelope) == ("t-lost", ENVELOPE)
    return taker, due


def test_a_claim_made_again_is_told_again_whose_message_it_took(
    store: Store, make_request: Make
) -> None:
    # Given a call that took the key of a lost message over
    taker = _taken_from_a_lost_message(store, make_request, lease=30.0)
    # When its claim is made again by the same owner (the first reply lost on the way)
    again = store.claim(taker)
    # Then it is told the same: whose call it took, and that call's message to send again
    assert (again.outcome, again.taken_from_task_id) == (Outcome.ACQUIRED, "t-lost")
    assert (again.owed_task_id, again.taken_over_envelope) == ("t-lost", ENVELOPE)


def test_a_takers_redelivered_message_is_told_whose_message_it_took(
    store: Store, make_request: Make
) -> None:
    # Given a call that took the key of a lost message over, and whose worker then died
    taker = _taken_from_a_lost_message(store, make_request, lease=0.2)
    time.sleep(0.3)
    # When its message comes back (the broker's redelivery: a new owner, the same task id)
    redelivered = store.claim(dataclasses.replace(taker, owner=uuid.uuid4().hex))
    # Then it takes its own claim over, told whose call it had taken the key from, with that
    # call's message (owed once the key completes)
    assert (redelivered.outcome, redelivered.takeover, redelivered.taken_from_task_id) == (
        Outcome.ACQUIRED,
        True,
        "t-lost",
    )
    assert (redelivered.owed_task_id, redelivered.taken_over_envelope) == ("t-lost", ENVELOPE)


def test_a_claim_made_again_after_taking_a_dead_owners_key_gets_no_message_either(
    store: Store, make_request: Make
) -> None:
    # Given a key whose own message's owner died, taken over by another call: told whose call
    # it took, and given no message (the dead owner's comes back by itself)
    own = make_request(task_id="t-own", lease_seconds=0.2)
    assert store.reserve(own, make_pickup()) is None
    assert store.claim(own).outcome is Outcome.ACQUIRED
    time.sleep(0.3)
    heir = make_request(storage_key=own.storage_key, task_id="t-heir", lease_seconds=0.2)
    first = store.claim(heir)
    assert (first.taken_from_task_id, first.taken_over_envelope) == ("t-own", None)
    # When its claim is made again (the reply lost), or its message redelivered after it died
    again = store.claim(heir)
    time.sleep(0.3)
    redelivered = store.claim(dataclasses.replace(heir, owner=uuid.uuid4().hex))
    # Then each is told the same as the first: no message to publish twice
    for claim in (again, redelivered):
        assert (claim.outcome, claim.taken_from_task_id, claim.taken_over_envelope) == (
            Outcome.ACQUIRED,
            "t-own",
            None,
        )


def test_a_dead_takers_debt_passes_to_the_call_that_takes_its_key_over(
    store: Store, make_request: Make
) -> None:
    # Given a key taken from a lost message by "t-taker", which died owing that message
    taker = _taken_from_a_lost_message(store, make_request, lease=0.2)
    time.sleep(0.3)
    # When another call takes the key over (before the guard would publish the message), and
    # its claim is made again (the reply lost)
    heir = make_request(storage_key=taker.storage_key, task_id="t-heir")
    first = store.claim(heir)
    again = store.claim(heir)
    # Then each time it is told whose key it took, and given the message owed, under that
    # message's own call's task id
    for claim in (first, again):
        assert (claim.taken_from_task_id, claim.owed_task_id, claim.taken_over_envelope) == (
            "t-taker",
            "t-lost",
            ENVELOPE,
        )


def test_a_lost_calls_own_message_taking_its_key_back_owes_nothing(
    store: Store, make_request: Make
) -> None:
    # Given a key taken from a lost message by "t-taker", which died owing that message (a
    # re-publication timeout of 1 s: no sweep takes the key while the checks below run)
    taker = _taken_from_a_lost_message(store, make_request, lease=0.2, timeout=1.0)
    time.sleep(0.3)
    # When the lost call's own message (slow, not lost after all) takes the key over
    lost = store.claim(
        make_request(storage_key=taker.storage_key, task_id="t-lost", lease_seconds=0.2)
    )
    # Then it answers the taker's callers, and owes no message: it is running its own
    assert (lost.taken_from_task_id, lost.owed_task_id, lost.taken_over_envelope) == (
        "t-taker",
        None,
        None,
    )
    assert store.take_due(10) == []
    # And should it die in turn, the call taking the key from it owes nothing either
    time.sleep(0.3)
    later = store.claim(make_request(storage_key=taker.storage_key, task_id="t-later"))
    assert (later.taken_from_task_id, later.owed_task_id, later.taken_over_envelope) == (
        "t-lost",
        None,
        None,
    )


def test_a_takers_message_published_by_the_guard_is_no_longer_handed_out(
    store: Store, make_request: Make
) -> None:
    # Given a call that took the key of a lost message over and died, and the guard, which
    # then took that message to publish it itself
    taker, _ = _dead_taker_taken_by_the_guard(store, make_request)
    # When the taker's message comes back, then it is told whose key it took, but not given
    # that message: it is on its way already
    redelivered = store.claim(dataclasses.replace(taker, owner=uuid.uuid4().hex))
    assert (redelivered.outcome, redelivered.taken_from_task_id) == (Outcome.ACQUIRED, "t-lost")
    assert redelivered.taken_over_envelope is None


def test_a_terminated_taker_leaves_the_message_it_took_to_the_guard(
    store: Store, make_request: Make
) -> None:
    # Given a call that took the key of a lost message over
    taker = _taken_from_a_lost_message(store, make_request, lease=0.1)
    # When the taker is terminated on purpose (its claim not released: its process may live)
    assert store.drop_pickup(taker.storage_key, "t-taker") is True
    # Then the message it took is still the guard's to publish once its lease is over (only
    # the terminated call's own message is never sent again), and the lost call alone can
    # have it dropped
    time.sleep(0.1 + TIMEOUT + 0.1)
    [due] = store.take_due(10)
    assert (due.task_id, due.envelope) == ("t-lost", ENVELOPE)
    assert store.drop_pickup(taker.storage_key, "t-lost") is True
    time.sleep(PAST_FIRST_BACKOFF)
    assert store.take_due(10) == []


def test_a_dead_takers_key_is_handed_back_under_the_task_id_of_the_message_it_keeps(
    store: Store, make_request: Make
) -> None:
    # Given a key whose taker died, taken by the guard for the message the key keeps
    taker, due = _dead_taker_taken_by_the_guard(store, make_request)
    assert due.republished == 1
    # When its publish fails and it is handed back: by that message's task id, not the taker's
    assert store.make_reservation_due(taker.storage_key, "t-taker", 0) is False
    assert store.make_reservation_due(taker.storage_key, "t-lost", 0) is True
    # Then the guard takes it again at once
    [again] = store.take_due(10)
    assert (again.task_id, again.envelope, again.republished) == ("t-lost", ENVELOPE, 1)


def test_a_dead_owners_claim_taken_over_hands_out_no_envelope(
    store: Store, make_request: Make
) -> None:
    # Given a reserved key claimed by its own message, whose owner then died
    own = make_request(task_id="t-own", lease_seconds=0.2)
    assert store.reserve(own, make_pickup()) is None
    first = store.claim(own)
    assert (first.outcome, first.taken_over_envelope) == (Outcome.ACQUIRED, None)
    time.sleep(0.3)
    # When another call's message takes the key over
    heir = store.claim(make_request(storage_key=own.storage_key, task_id="t-heir"))
    # Then it is told whose call it took, but given no message to publish again: the dead
    # owner's message comes back by itself (the broker's redelivery, or the guard's)
    assert (heir.outcome, heir.takeover, heir.taken_from_task_id) == (
        Outcome.ACQUIRED,
        True,
        "t-own",
    )
    assert heir.taken_over_envelope is None


def test_a_claim_does_not_reset_the_count_of_re_publications(
    store: Store, make_request: Make
) -> None:
    # Given a queued key whose message was published again once
    reserved = make_request(task_id="t-1")
    assert store.reserve(reserved, make_pickup(due_in=0.0)) is None
    time.sleep(0.05)
    [first] = store.take_due(10)
    assert first.republished == 1
    # When that message is claimed, and its owner dies with it
    owner = make_request(task_id="t-1", lease_seconds=0.2)
    assert store.claim(owner).outcome is Outcome.ACQUIRED
    time.sleep(PAST_FIRST_BACKOFF)
    # Then the sweep publishes it again as the message's second re-publication
    [again] = store.take_due(10)
    assert (again.task_id, again.envelope, again.republished) == ("t-1", ENVELOPE, 2)


def test_a_claimed_key_whose_owner_renews_its_lease_is_never_taken(
    store: Store, make_request: Make
) -> None:
    # Given a claimed key whose owner renews its 0.3 s lease every 0.15 s (the lease and the
    # re-publication timeout, 0.5 s, leave 0.8 s after each renewal: room for a busy machine)
    request = make_request(lease_seconds=0.3)
    assert store.reserve(request, make_pickup(due_in=0.0, timeout=0.5)) is None
    token = store.claim(request).token
    # Then no sweep takes it, for longer than the lease and the timeout together
    for _ in range(7):
        time.sleep(0.15)
        assert store.extend(request, token)
        assert store.take_due(10) == []


@pytest.mark.parametrize("ending", ["completed", "failed for good"])
def test_a_key_that_ended_is_never_taken(store: Store, make_request: Make, ending: str) -> None:
    request = make_request(lease_seconds=0.1)
    assert store.reserve(request, make_pickup(due_in=0.0)) is None
    token = store.claim(request).token
    if ending == "completed":
        store.complete(request, token, RESULT)
    else:
        assert store.release(request, token)
    time.sleep(0.1 + TIMEOUT + 0.1)
    assert store.take_due(10) == []


# -- cancel, release, complete ------------------------------------------------------------


def test_cancel_reservation_deletes_only_its_own_queued_record(
    store: Store, make_request: Make
) -> None:
    mine = make_request(task_id="task-1")
    store.reserve(mine, make_pickup())
    stranger = make_request(storage_key=mine.storage_key, task_id="task-2")
    assert store.cancel_reservation(stranger.storage_key, stranger.task_id) is False
    record = store.get(mine.storage_key)
    assert record is not None
    assert (record.status, record.task_id) == (Status.QUEUED, "task-1")
    assert store.cancel_reservation(mine.storage_key, mine.task_id) is True
    assert store.get(mine.storage_key) is None
    assert store.cancel_reservation(mine.storage_key, mine.task_id) is False
    time.sleep(PAST_DUE)
    assert store.take_due(10) == []


def test_a_reservation_made_due_is_handed_to_the_guard_at_once(
    store: Store, make_request: Make
) -> None:
    # Given a key reserved for task-1 (due in 1 s, with a first backoff of 2 s: room for a
    # busy machine), whose message could not be published
    mine = make_request(task_id="task-1")
    assert store.reserve(mine, make_pickup(envelope=b"unsent", due_in=1.0, timeout=1.0)) is None
    assert store.take_due(10) == []
    # When it is made due (and not by another task id's publish)
    stranger = make_request(storage_key=mine.storage_key, task_id="task-2")
    assert store.make_reservation_due(stranger.storage_key, stranger.task_id) is False
    assert store.make_reservation_due(mine.storage_key, mine.task_id) is True
    # Then it is still queued for task-1, its lease over, and the guard takes it now, once
    record = store.get(mine.storage_key)
    assert record is not None
    assert (record.status, record.task_id) == (Status.QUEUED, "task-1")
    assert record.lease_expires_at <= record.store_time()
    [due] = store.take_due(10)
    assert (due.task_id, due.envelope, due.republished) == ("task-1", b"unsent", 1)
    assert store.take_due(10) == []


def test_a_take_whose_publish_failed_is_handed_back_uncounted(
    store: Store, make_request: Make
) -> None:
    # Given a queued key past due, taken by the guard, whose publish then failed
    request = make_request(task_id="task-1")
    assert store.reserve(request, make_pickup(due_in=0.01)) is None
    time.sleep(PAST_DUE)
    [taken] = store.take_due(10)
    assert taken.republished == 1
    # When it is handed back with its count set back, then it is due at once, uncounted
    assert store.make_reservation_due(request.storage_key, "task-1", taken.republished - 1)
    [again] = store.take_due(10)
    assert (again.task_id, again.republished) == ("task-1", 1)


def test_a_claimed_key_is_never_made_due(store: Store, make_request: Make) -> None:
    request = make_request(task_id="task-1")
    store.reserve(request, make_pickup())
    store.claim(request)
    assert store.make_reservation_due(request.storage_key, request.task_id) is False
    record = store.get(request.storage_key)
    assert record is not None
    assert (record.status, record.owner) == (Status.PROCESSING, request.owner)
    assert store.take_due(10) == []


def test_a_dead_owners_key_whose_republish_failed_is_handed_back_at_once(
    store: Store, make_request: Make
) -> None:
    # Given a reserved key claimed by an owner that died, taken by the guard for its message
    owner = make_request(task_id="task-1", lease_seconds=0.1)
    assert store.reserve(owner, make_pickup(envelope=b"lost")) is None
    assert store.claim(owner).outcome is Outcome.ACQUIRED
    time.sleep(0.1 + TIMEOUT + 0.1)
    [due] = store.take_due(10)
    assert (due.task_id, due.republished) == ("task-1", 1)
    # When its publish fails (the broker unreachable) and it is handed back, count set back
    assert store.make_reservation_due(owner.storage_key, "task-1", 0) is True
    # Then the guard takes it again at once, not a backoff later; the owner's claim stays
    [again] = store.take_due(10)
    assert (again.task_id, again.envelope, again.republished) == ("task-1", b"lost", 1)
    record = store.get(owner.storage_key)
    assert record is not None and record.status is Status.PROCESSING
    # And another task id cannot do it
    assert store.make_reservation_due(owner.storage_key, "task-2", 0) is False


def test_a_terminated_calls_pickup_is_dropped_and_its_claim_kept(
    store: Store, make_request: Make
) -> None:
    # Given a reserved key whose call runs (a 0.1 s lease: it is about to count as dead)
    owner = make_request(task_id="task-1", lease_seconds=0.1)
    assert store.reserve(owner, make_pickup(envelope=b"terminated")) is None
    token = store.claim(owner).token
    # When the call is terminated on purpose (only its own task id can say so; said twice,
    # the record is still there, its pickup gone)
    assert store.drop_pickup(owner.storage_key, "task-2") is False
    assert store.drop_pickup(owner.storage_key, "task-1") is True
    assert store.drop_pickup(owner.storage_key, "task-1") is True
    # Then its claim stays, but nothing is ever published again for it
    record = store.get(owner.storage_key)
    assert record is not None and (record.status, record.token) == (Status.PROCESSING, token)
    time.sleep(0.1 + TIMEOUT + 0.1)
    assert store.take_due(10) == []
    assert store.take(owner.storage_key) is None
    # And once its lease has ended, another call takes the key over
    other = make_request(storage_key=owner.storage_key, task_id="task-3")
    assert store.claim(other).outcome is Outcome.ACQUIRED


def test_cancel_reservation_leaves_a_claimed_key_alone(store: Store, make_request: Make) -> None:
    request = make_request(task_id="task-1")
    store.reserve(request, make_pickup())
    store.claim(request)
    assert store.cancel_reservation(request.storage_key, request.task_id) is False
    record = store.get(request.storage_key)
    assert record is not None
    assert (record.status, record.owner) == (Status.PROCESSING, request.owner)


def test_release_with_a_pickup_queues_the_key_for_a_retry(store: Store, make_request: Make) -> None:
    # Given a claim held by task-1's execution
    request = make_request(task_id="task-1")
    token = store.claim(request).token
    # When it gives the claim up to a retry it publishes
    assert store.release(request, token, make_pickup(envelope=b"retry", due_in=1.0)) is True
    # Then the key is queued for task-1, due later (in 1 s)
    record = store.get(request.storage_key)
    assert record is not None
    assert (record.status, record.owner, record.task_id) == (Status.QUEUED, "", "task-1")
    assert record.lease_expires_at == pytest.approx(time.time() + 1.0, abs=1)
    assert store.take_due(10) == []
    time.sleep(1.0 + 0.15)
    [due] = store.take_due(10)
    assert (due.storage_key, due.task_id, due.envelope, due.republished) == (
        request.storage_key,
        "task-1",
        b"retry",
        1,
    )
    # and the retry's claim gets a higher token
    retry = store.claim(make_request(storage_key=request.storage_key, task_id="task-1"))
    assert retry.outcome is Outcome.ACQUIRED
    assert retry.token > token


def test_a_retry_with_other_arguments_leaves_the_keys_fingerprint_as_its_caller_made_it(
    store: Store, make_request: Make
) -> None:
    # Given a call whose first run gave its claim up to a retry
    first = make_request(task_id="task-1", fingerprint="fp-1")
    assert store.release(first, store.claim(first).token, make_pickup()) is True
    # When the retry runs with other arguments (self.retry(args=...)), then retries again
    retry = make_request(storage_key=first.storage_key, task_id="task-1", fingerprint="fp-2")
    claim = store.claim(retry)
    assert claim.outcome is Outcome.ACQUIRED
    assert store.release(retry, claim.token, make_pickup()) is True
    # Then the key still stands for the caller's arguments
    record = store.get(first.storage_key)
    assert record is not None
    assert (record.status, record.fingerprint) == (Status.QUEUED, "fp-1")


def test_a_key_queued_for_a_retry_is_not_taken_by_an_older_message_of_the_call(
    store: Store, make_request: Make
) -> None:
    # Given a call whose first run gave its claim up to its first retry, sitting out a
    # countdown of a minute
    first = make_request(task_id="task-1")
    token = store.claim(first).token
    assert store.release(first, token, dataclasses.replace(make_pickup(due_in=60), retries=1))
    record = store.get(first.storage_key)
    assert record is not None
    assert (record.status, record.task_id) == (Status.QUEUED, "task-1")

    def of_the_call(retries: int, previous_owner: str | None = None) -> ClaimRequest:
        return make_request(
            storage_key=first.storage_key,
            task_id="task-1",
            retries=retries,
            previous_owner=previous_owner,
        )

    # When the call's first message claims the key again (redelivered, or the guard's copy of
    # it, slow to arrive), then it finds the key in progress: queued for the retry, which it
    # would run early, its retries counted anew
    stale = store.claim(of_the_call(retries=0))
    assert stale.outcome is Outcome.IN_PROGRESS
    assert stale.record is not None
    assert (stale.record.status, stale.record.task_id) == (Status.QUEUED, "task-1")
    # And the retry's message takes it, or any copy of it (the guard's, or the one a worker
    # sends again when it found the store down, naming itself as previous owner)
    retry = of_the_call(retries=1, previous_owner="a-worker-that-found-the-store-down")
    taken = store.claim(retry)
    assert taken.outcome is Outcome.ACQUIRED
    assert taken.token > token
    # And once that run retries in turn, the first retry's message is an older one too
    assert store.release(retry, taken.token, dataclasses.replace(make_pickup(), retries=2))
    assert store.claim(of_the_call(retries=1)).outcome is Outcome.IN_PROGRESS
    assert store.claim(of_the_call(retries=2)).outcome is Outcome.ACQUIRED


def test_release_with_a_pickup_needs_the_claim_held(store: Store, make_request: Make) -> None:
    owner = make_request()
    token = store.claim(owner).token
    stranger = make_request(storage_key=owner.storage_key)
    assert store.release(stranger, token, make_pickup()) is False
    assert store.release(owner, token + 1, make_pickup()) is False
    record = store.get(owner.storage_key)
    assert record is not None
    assert (record.status, record.owner) == (Status.PROCESSING, owner.owner)


def test_release_without_a_pickup_frees_the_key(store: Store, make_request: Make) -> None:
    request = make_request()
    store.reserve(request, make_pickup(due_in=0.0))
    token = store.claim(request).token
    assert store.release(request, token) is True
    assert store.get(request.storage_key) is None
    time.sleep(0.05)
    assert store.take_due(10) == []


@pytest.mark.parametrize("vanished", ["forgotten", "expired"])
def test_complete_on_a_queued_record_recovers(
    store: Store, make_request: Make, vanished: str
) -> None:
    # Given a claim that vanished, and a new publish of the key that queued it since
    owner = make_request(task_id="task-1", lease_seconds=0.1, ttl_seconds=0.1)
    token = store.claim(owner).token
    if vanished == "forgotten":
        store.forget(owner.storage_key)
    else:
        time.sleep(0.3)
    store.reserve(make_request(storage_key=owner.storage_key, task_id="task-2"), make_pickup())
    # When the first execution finishes, its result is the key's (kept a minute)
    finished = dataclasses.replace(owner, ttl_seconds=60.0)
    assert store.complete(finished, token, RESULT) is CompleteOutcome.RECOVERED
    record = store.get(owner.storage_key)
    assert record is not None
    assert (record.status, record.result, record.task_id) == (
        Status.COMPLETED,
        RESULT,
        "task-1",
    )
    duplicate = store.claim(make_request(storage_key=owner.storage_key, task_id="task-2"))
    assert duplicate.outcome is Outcome.COMPLETED
    time.sleep(PAST_DUE)
    assert store.take_due(10) == []


def test_forget_removes_a_queued_key(store: Store, make_request: Make) -> None:
    request = make_request()
    store.reserve(request, make_pickup(due_in=0.0))
    assert store.forget(request.storage_key) is True
    assert store.get(request.storage_key) is None
    time.sleep(0.05)
    assert store.take_due(10) == []


# -- races between processes --------------------------------------------------------------

PROCESSES = 6
RACE_KEYS = 100
RACE_PREFIX = "pickup-race"


def _request(storage_key: str, task_id: str) -> ClaimRequest:
    return claim_request(key=storage_key, storage_key=storage_key, task_id=task_id)


def _sweep_all(kind: str, url: str, start: multiprocessing.synchronize.Event) -> list[str]:
    """Take due keys in small batches until none is left; the keys taken."""
    store = open_store(kind, url, prefix=RACE_PREFIX)
    store.get("warm-up")  # connect and create tables before the start line
    start.wait()
    taken: list[str] = []
    while batch := store.take_due(7):
        taken.extend(due.storage_key for due in batch)
    store.close()
    return taken


def _reserve_all(
    kind: str, url: str, keys: list[str], start: multiprocessing.synchronize.Event
) -> list[bool]:
    """Reserve every key for a task id of this process's own; which reservations won."""
    store = open_store(kind, url, prefix=RACE_PREFIX)
    store.get("warm-up")
    start.wait()
    task_id = uuid.uuid4().hex
    pickup = Pickup(envelope=task_id.encode(), due_in=60, timeout=60)
    won = [store.reserve(_request(key, task_id), pickup) is None for key in keys]
    store.close()
    return won


def _race(function: Callable[..., list[object]], *args: object) -> list[list[object]]:
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        start = manager.Event()
        with context.Pool(PROCESSES) as pool:
            jobs = [pool.apply_async(function, (*args, start)) for _ in range(PROCESSES)]
            time.sleep(0.5)
            start.set()
            return [job.get(timeout=120) for job in jobs]


@pytest.mark.parametrize("kind", SERVER_STORES)
def test_concurrent_sweeps_in_many_processes_take_each_key_once(
    kind: str, request: pytest.FixtureRequest
) -> None:
    # Given 100 queued keys whose messages are overdue (and not due again for minutes)
    url = store_url(kind, request)
    store = open_store(kind, url, prefix=RACE_PREFIX)
    keys = [f"k{i}-{uuid.uuid4().hex[:6]}" for i in range(RACE_KEYS)]
    pickup = Pickup(envelope=b"m", due_in=0.0, timeout=60)
    for key in keys:
        assert store.reserve(_request(key, f"task-{key}"), pickup) is None
    store.close()
    time.sleep(0.05)
    # When several processes sweep at once
    results = _race(_sweep_all, kind, url)
    # Then every key was taken, each by exactly one of them
    counts = collections.Counter(key for taken in results for key in taken)
    assert set(counts) == set(keys)
    assert max(counts.values()) == 1, counts.most_common(3)


@pytest.mark.parametrize("kind", SERVER_STORES)
def test_concurrent_reservations_in_many_processes_get_one_winner(
    kind: str, request: pytest.FixtureRequest
) -> None:
    url = store_url(kind, request)
    keys = [f"r{i}-{uuid.uuid4().hex[:6]}" for i in range(20)]
    results = _race(_reserve_all, kind, url, keys)
    for index in range(len(keys)):
        per_key = [won[index] for won in results]
        assert per_key.count(True) == 1, per_key
    store = open_store(kind, url, prefix=RACE_PREFIX)
    for key in keys:
        record: Record | None = store.get(key)
        assert record is not None
        assert record.status is Status.QUEUED
    store.close()


def test_a_task_id_of_the_longest_length_apply_async_takes_is_kept_whole(
    store: Store, make_request: Make
) -> None:
    from idempotent_tasks.keys import MAX_TASK_ID_CHARS

    task_id = ("t" * MAX_TASK_ID_CHARS)[:-1] + "z"
    request = make_request(task_id=task_id)
    assert store.reserve(request, make_pickup()) is None
    claim = store.claim(request)
    assert (claim.outcome, claim.takeover) == (Outcome.ACQUIRED, False)
    assert store.complete(request, claim.token, RESULT) is CompleteOutcome.STORED
    record = store.get(request.storage_key)
    assert record is not None and record.task_id == task_id
