"""A claim that took over another call's lost message owes it; the message goes out once.

Every store answers the same: the owing claim, once completed (or about to be released for a
retry), settles its debt once (``settle_owed_message``: it then publishes the message), unless
the pickup guard took the message first because the owner was slow past its lease and a
re-publication timeout.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import pytest

from idempotent_tasks.records import (
    ClaimRequest,
    CompleteOutcome,
    EncodedResult,
    Outcome,
    Pickup,
    Status,
)
from idempotent_tasks.stores import Store

Make = Callable[..., ClaimRequest]
RESULT = EncodedResult(content_type="application/json", content_encoding="utf-8", body=b"1")
ENVELOPE = b"the lost call's message"
#: The re-publication timeout of the lost call's pickup, seconds.
TIMEOUT = 0.5


def owing_claim(
    store: Store, make_request: Make, lease_seconds: float = 30.0
) -> tuple[ClaimRequest, int]:
    """A claim by call "t-taker" of a key whose reserved message, call "t-lost"'s, counts as
    lost (the claim owes that message), and its token."""
    lost = make_request(task_id="t-lost")
    assert store.reserve(lost, Pickup(envelope=ENVELOPE, due_in=0.0, timeout=TIMEOUT)) is None
    time.sleep(0.01)  # due at once (Redis: 1 ms on)
    taker = make_request(task_id="t-taker", lease_seconds=lease_seconds)
    claim = store.claim(taker)
    assert (claim.outcome, claim.owed_task_id, claim.taken_over_envelope) == (
        Outcome.ACQUIRED,
        "t-lost",
        ENVELOPE,
    )
    return taker, claim.token


def test_a_completed_owing_claim_settles_its_debt_once(store: Store, make_request: Make) -> None:
    # Given a claim owing a lost call's message, when it completes
    taker, token = owing_claim(store, make_request)
    assert store.complete(taker, token, RESULT, owes_message=True) is CompleteOutcome.STORED
    # Then it owes the message once: the first to ask publishes it, no one else
    assert store.settle_owed_message(taker) is True
    assert store.settle_owed_message(taker) is False
    # and the guard never publishes it either
    time.sleep(TIMEOUT + 0.15)
    assert store.take_due(10) == []


def test_a_held_owing_claim_settles_its_debt_once_before_its_release_for_a_retry(
    store: Store, make_request: Make
) -> None:
    # Given a claim owing a lost call's message, still held, about to give the key up for its
    # retry (whose release keeps the retry's message in the lost one's place)
    taker, token = owing_claim(store, make_request)
    # Then only its owner settles the debt, once: it publishes the message, no one else
    assert store.settle_owed_message(make_request(task_id="t-taker")) is False
    assert store.settle_owed_message(taker) is True
    assert store.settle_owed_message(taker) is False
    # When it is released for its retry, whose message is then lost too
    retry = Pickup(envelope=b"the retry's message", due_in=0.0, timeout=TIMEOUT, retries=1)
    assert store.release(taker, token, retry) is True
    # Then the key is queued for the retry, the guard publishes the retry's message alone (the
    # lost call's is kept no more), and the retry's claim owes nothing
    record = store.get(taker.storage_key)
    assert record is not None
    assert (record.status, record.task_id) == (Status.QUEUED, "t-taker")
    time.sleep(0.01)
    due = [(due.task_id, due.envelope) for due in store.take_due(10)]
    assert due == [("t-taker", b"the retry's message")]
    again = store.claim(make_request(task_id="t-taker", retries=1))
    assert (again.outcome, again.owed_task_id, again.taken_over_envelope) == (
        Outcome.ACQUIRED,
        None,
        None,
    )


def test_an_owing_claim_is_not_released_for_a_retry_before_it_settles(
    store: Store, make_request: Make
) -> None:
    # Given a claim owing a lost call's message, still held
    taker, token = owing_claim(store, make_request)
    retry = Pickup(envelope=b"the retry's message", due_in=5.0, timeout=TIMEOUT, retries=1)
    # Then a release for its retry is refused: the retry's message would take the owed one's
    # place, which nothing would publish then
    assert store.release(taker, token, retry) is False
    record = store.get(taker.storage_key)
    assert record is not None
    assert (record.status, record.owner) == (Status.PROCESSING, taker.owner)
    # and once it settled the debt (its owner publishes the message), it is released
    assert store.settle_owed_message(taker) is True
    assert store.release(taker, token, retry) is True


def test_a_stalled_owner_whose_taker_settled_before_its_retry_owes_nothing_on_completing(
    store: Store, make_request: Make
) -> None:
    # Given a claim owing a lost call's message, whose owner stalls past its lease; a claim of
    # another call takes the key over (owing the message in its place), settles the debt and
    # gives the key up for its retry
    stalled, stalled_token = owing_claim(store, make_request, lease_seconds=0.2)
    time.sleep(0.3)
    taker = make_request(task_id="t-other")
    claim = store.claim(taker)
    assert (claim.outcome, claim.owed_task_id) == (Outcome.ACQUIRED, "t-lost")
    assert store.settle_owed_message(taker) is True
    retry = Pickup(envelope=b"the retry's message", due_in=5.0, timeout=TIMEOUT, retries=1)
    assert store.release(taker, claim.token, retry) is True
    # When the stalled owner wakes and completes, writing the key anew over the key queued
    # for that retry
    completed = store.complete(stalled, stalled_token, RESULT, owes_message=True)
    assert completed is CompleteOutcome.RECOVERED
    # Then it owes the message no more: the taker sent it
    assert store.settle_owed_message(stalled) is False


def test_a_slow_owner_owes_nothing_once_the_guard_published_the_message(
    store: Store, make_request: Make
) -> None:
    # Given a claim owing a lost call's message, whose owner stalls past its lease and the
    # message's re-publication timeout, so the guard publishes the message itself
    taker, token = owing_claim(store, make_request, lease_seconds=0.2)
    time.sleep(0.2 + TIMEOUT + 0.15)
    assert [(due.task_id, due.envelope) for due in store.take_due(10)] == [("t-lost", ENVELOPE)]
    # When the owner wakes and completes (no other claim came in between)
    assert store.complete(taker, token, RESULT, owes_message=True) is CompleteOutcome.STORED
    # Then it does not publish the message a second time
    assert store.settle_owed_message(taker) is False


def test_a_revoked_calls_message_is_owed_no_more(store: Store, make_request: Make) -> None:
    # Given a claim owing a lost call's message, and that call then revoked (its kept message
    # dropped, so that nothing publishes it again)
    taker, token = owing_claim(store, make_request)
    assert store.drop_pickup(taker.storage_key, "t-lost") is True
    # When the claim completes, then it does not publish that message either
    assert store.complete(taker, token, RESULT, owes_message=True) is CompleteOutcome.STORED
    assert store.settle_owed_message(taker) is False


def test_a_claim_owing_nothing_settles_nothing(store: Store, make_request: Make) -> None:
    request = make_request()
    token = store.claim(request).token
    assert store.complete(request, token, RESULT) is CompleteOutcome.STORED
    assert store.settle_owed_message(request) is False


def test_only_the_completed_owner_settles(store: Store, make_request: Make) -> None:
    # Given a completed claim owing a lost call's message
    taker, token = owing_claim(store, make_request)
    assert store.complete(taker, token, RESULT, owes_message=True) is CompleteOutcome.STORED
    # Then another owner settles nothing
    stranger = make_request(task_id="t-taker")
    assert store.settle_owed_message(stranger) is False
    # and the debt is still the owner's to settle
    assert store.settle_owed_message(taker) is True


def test_a_completion_writing_a_lost_record_anew_keeps_its_debt(
    store: Store, make_request: Make
) -> None:
    # Given a claim owing a lost call's message, whose record the store then lost
    taker, token = owing_claim(store, make_request)
    assert store.forget(taker.storage_key) is True
    # When it completes, writing the record anew, and completes again (its reply was lost)
    assert store.complete(taker, token, RESULT, owes_message=True) is CompleteOutcome.RECOVERED
    assert store.complete(taker, token, RESULT, owes_message=True) is CompleteOutcome.STORED
    # Then it still owes the message, once
    assert store.settle_owed_message(taker) is True
    assert store.settle_owed_message(taker) is False


@pytest.mark.parametrize("owner", ["still stalled", "renewed its lease meanwhile"])
def test_a_message_the_guard_could_not_publish_is_owed_again(
    store: Store, make_request: Make, owner: str
) -> None:
    # Given a claim owing a lost call's message, whose owner stalled past its lease and the
    # re-publication timeout, and whose message the guard took but could not publish
    taker, token = owing_claim(store, make_request, lease_seconds=0.2)
    time.sleep(0.2 + TIMEOUT + 0.15)
    [taken] = store.take_due(10)
    if owner == "renewed its lease meanwhile":
        assert store.extend(dataclasses.replace(taker, lease_seconds=30.0), token) is True
    made_due = store.make_reservation_due(taker.storage_key, taken.task_id)
    assert made_due is (owner == "still stalled")  # a live owner's lease decides
    # When the owner completes before the guard's next try
    assert store.complete(taker, token, RESULT, owes_message=True) is CompleteOutcome.STORED
    # Then the owner publishes the message itself
    assert store.settle_owed_message(taker) is True


# -- a claim given up for good ------------------------------------------------------------


def test_a_claim_given_up_hands_the_key_back_to_the_call_it_took_it_from(
    store: Store, make_request: Make
) -> None:
    # Given a claim that took the key from a lost call's message, and failed for good
    taker, token = owing_claim(store, make_request)
    # When it gives the key up (no retry to queue it for)
    assert store.release(taker, token) is True
    # Then the key is queued again for the lost call's message, and due now
    record = store.get(taker.storage_key)
    assert record is not None
    assert (record.status, record.task_id, record.owner) == (Status.QUEUED, "t-lost", "")
    time.sleep(0.01)
    # so the guard publishes that message again, under its own task id, once
    assert [(due.task_id, due.envelope) for due in store.take_due(10)] == [("t-lost", ENVELOPE)]
    assert store.take_due(10) == []
    # and that message, delivered, runs the key, owing no one
    again = store.claim(make_request(task_id="t-lost"))
    assert (again.outcome, again.owed_task_id, again.taken_over_envelope) == (
        Outcome.ACQUIRED,
        None,
        None,
    )


def test_a_claim_given_up_by_a_stranger_hands_nothing_back(
    store: Store, make_request: Make
) -> None:
    taker, token = owing_claim(store, make_request)
    stranger = make_request(task_id="t-taker")
    assert store.release(stranger, token) is False
    record = store.get(taker.storage_key)
    assert record is not None
    assert (record.status, record.task_id) == (Status.PROCESSING, "t-taker")


def test_a_claim_on_its_own_message_given_up_frees_the_key(
    store: Store, make_request: Make
) -> None:
    # Given a key reserved for call "t-own", claimed by its own message, which failed for good
    own = make_request(task_id="t-own")
    assert store.reserve(own, Pickup(envelope=ENVELOPE, due_in=0.0, timeout=TIMEOUT)) is None
    token = store.claim(own).token
    assert store.release(own, token) is True
    # Then nothing is kept: its message is not published again
    assert store.get(own.storage_key) is None
    time.sleep(0.05)
    assert store.take_due(10) == []
