"""A claim that took over another call's lost message owes it; the message goes out once.

Every store answers the same: the owing claim, once completed, settles its debt once
(``settle_owed_message``: it then publishes the message), unless the pickup guard took the
message first because the owner was slow past its lease and a re-publication timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from idempotent_tasks.records import ClaimRequest, CompleteOutcome, EncodedResult, Outcome, Pickup
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
    # Given a claim owing a lost call's message, still running
    taker, token = owing_claim(store, make_request)
    # Then it settles nothing before it completes
    assert store.settle_owed_message(taker, token) is False
    # When it completes
    assert store.complete(taker, token, RESULT) is CompleteOutcome.STORED
    # Then it owes the message once: the first to ask publishes it, no one else
    assert store.settle_owed_message(taker, token) is True
    assert store.settle_owed_message(taker, token) is False
    # and the guard never publishes it either
    time.sleep(TIMEOUT + 0.15)
    assert store.take_due(10) == []


def test_a_slow_owner_owes_nothing_once_the_guard_published_the_message(
    store: Store, make_request: Make
) -> None:
    # Given a claim owing a lost call's message, whose owner stalls past its lease and the
    # message's re-publication timeout, so the guard publishes the message itself
    taker, token = owing_claim(store, make_request, lease_seconds=0.2)
    time.sleep(0.2 + TIMEOUT + 0.15)
    assert [(due.task_id, due.envelope) for due in store.take_due(10)] == [("t-lost", ENVELOPE)]
    # When the owner wakes and completes (no other claim came in between)
    assert store.complete(taker, token, RESULT) is CompleteOutcome.STORED
    # Then it does not publish the message a second time
    assert store.settle_owed_message(taker, token) is False


def test_a_claim_owing_nothing_settles_nothing(store: Store, make_request: Make) -> None:
    request = make_request()
    token = store.claim(request).token
    assert store.complete(request, token, RESULT) is CompleteOutcome.STORED
    assert store.settle_owed_message(request, token) is False


def test_only_the_completed_owner_with_its_token_settles(store: Store, make_request: Make) -> None:
    # Given a completed claim owing a lost call's message
    taker, token = owing_claim(store, make_request)
    assert store.complete(taker, token, RESULT) is CompleteOutcome.STORED
    # Then another owner, or the same one with another token, settles nothing
    stranger = make_request(task_id="t-taker")
    assert store.settle_owed_message(stranger, token) is False
    assert store.settle_owed_message(taker, token + 1) is False
    # and the debt is still the owner's to settle
    assert store.settle_owed_message(taker, token) is True
