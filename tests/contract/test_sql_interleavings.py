"""The SQL store's compare-and-set, with another write landing between its read and its write.

The SQL store reads a row, decides, then writes only if the row is unchanged. These tests put a
second party's write exactly in that gap (after the read returns, before the compare-and-set),
on every SQL database: the decision made on the older row must not overwrite the newer one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from idempotent_tasks.records import (
    ClaimRequest,
    CompleteOutcome,
    EncodedResult,
    Outcome,
    Pickup,
    Status,
)
from idempotent_tasks.stores.sql import SqlStore
from tests.contract.conftest import store_url

SQL_STORES = ["sqlite", "postgresql", "mariadb"]
RESULT = EncodedResult(content_type="application/json", content_encoding="utf-8", body=b"42")


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=SQL_STORES)
def clocked_store(request: pytest.FixtureRequest) -> Iterator[tuple[SqlStore, Clock]]:
    clock = Clock()
    store = SqlStore(store_url(request.param, request), prefix="gap", clock=clock)
    yield store, clock
    store.close()


def write_after_next_read(store: SqlStore, write: Callable[[], Any]) -> list[Any]:
    """Run ``write`` right after the store's next single-row read, before it acts on it;
    returns a list that then holds what ``write`` returned."""
    original = store._one
    done: list[Any] = []

    def read_then_write(statement: Any) -> Any:
        row = original(statement)
        if store._one is read_then_write:
            store._one = original  # type: ignore[method-assign]  # once; ``write`` reads too
            done.append(write())
        return row

    store._one = read_then_write  # type: ignore[method-assign]
    return done


def request_for(make_request: Callable[..., ClaimRequest], **fields: Any) -> ClaimRequest:
    return make_request(storage_key="tasks.charge:gap", key="gap", **fields)


def test_owner_completing_during_a_takeover_is_not_overwritten(
    clocked_store: tuple[SqlStore, Clock], make_request: Callable[..., ClaimRequest]
) -> None:
    store, clock = clocked_store
    owner = request_for(make_request, lease_seconds=10.0)
    token = store.claim(owner).token
    clock.now += 11  # the owner's lease ended, but it is still about to finish
    completion = write_after_next_read(store, lambda: store.complete(owner, token, RESULT))

    claimer = request_for(make_request, task_id="task-2")
    result = store.claim(claimer)

    assert completion == [CompleteOutcome.STORED]
    assert result.outcome is Outcome.COMPLETED, "the takeover overwrote a completed key"
    record = store.get(owner.storage_key)
    assert record is not None
    assert (record.status, record.owner, record.result) == (Status.COMPLETED, owner.owner, RESULT)


def test_owner_settling_its_debt_during_a_takeover_leaves_the_taker_owing_nothing(
    clocked_store: tuple[SqlStore, Clock], make_request: Callable[..., ClaimRequest]
) -> None:
    # Given a claim that took the key over from a lost call's message (so owes it), whose
    # lease ended while it was about to give the key up for its retry
    store, clock = clocked_store
    lost = request_for(make_request, owner="", task_id="task-lost")
    assert store.reserve(lost, Pickup(envelope=b"{}", due_in=0.0, timeout=5.0)) is None
    clock.now += 1
    owner = request_for(make_request, lease_seconds=10.0)
    assert store.claim(owner).owed_task_id == "task-lost"
    clock.now += 11
    # When it settles the debt (it publishes the message) between a taker's read and write
    settled = write_after_next_read(store, lambda: store.settle_owed_message(owner))
    taken = store.claim(request_for(make_request, task_id="task-2"))
    # Then the taker owes the message no more: it was sent
    assert settled == [True]
    assert (taken.outcome, taken.owed_task_id) == (Outcome.ACQUIRED, None)


def test_owner_renewing_during_a_takeover_keeps_its_key(
    clocked_store: tuple[SqlStore, Clock], make_request: Callable[..., ClaimRequest]
) -> None:
    store, clock = clocked_store
    owner = request_for(make_request, lease_seconds=10.0)
    token = store.claim(owner).token
    clock.now += 11
    renewal = write_after_next_read(store, lambda: store.extend(owner, token))

    result = store.claim(request_for(make_request, task_id="task-2"))

    assert renewal == [True]
    assert result.outcome is Outcome.IN_PROGRESS, "the takeover overwrote a renewed lease"
    assert store.complete(owner, token, RESULT) is CompleteOutcome.STORED


def test_new_reservation_during_a_claim_of_an_expired_row_is_not_overwritten(
    clocked_store: tuple[SqlStore, Clock], make_request: Callable[..., ClaimRequest]
) -> None:
    store, clock = clocked_store
    pickup = Pickup(envelope=b"{}", due_in=5.0, timeout=5.0)
    first = request_for(make_request, owner="", ttl_seconds=10.0)
    assert store.reserve(first, pickup) is None
    clock.now += 16  # the first message's row expired unclaimed
    second = request_for(make_request, owner="", task_id="task-2", fingerprint="fp-2")
    reservation = write_after_next_read(store, lambda: store.reserve(second, pickup))

    late_delivery = request_for(make_request)  # the first message, arriving after all
    result = store.claim(late_delivery)

    assert reservation == [None]
    assert result.outcome is Outcome.MISMATCH, "a claim overwrote another message's reservation"
    record = store.get(second.storage_key)
    assert record is not None
    assert (record.status, record.task_id, record.fingerprint) == (Status.QUEUED, "task-2", "fp-2")


def test_a_claim_replacing_an_ended_row_leaves_no_pickup_of_another_call(
    clocked_store: tuple[SqlStore, Clock], make_request: Callable[..., ClaimRequest]
) -> None:
    # Given a reservation whose row expired unclaimed (its pickup row still there)
    store, clock = clocked_store
    pickup = Pickup(envelope=b'{"args": ["first"]}', due_in=5.0, timeout=5.0)
    first = request_for(make_request, owner="", ttl_seconds=1.0)
    assert store.reserve(first, pickup) is None
    clock.now += 7
    # When another call, with other arguments and no reservation, claims the key, then dies
    second = request_for(make_request, task_id="task-2", fingerprint="fp-2", lease_seconds=1.0)
    assert store.claim(second).outcome is Outcome.ACQUIRED
    clock.now += 1 + 5 + 1
    # Then the guard has nothing to publish under its task id: the pickup was the first call's
    assert store.take(second.storage_key) is None
    assert store.take_due(10) == []


def test_cleanup_takes_the_pickups_of_expired_rows_along(
    clocked_store: tuple[SqlStore, Clock], make_request: Callable[..., ClaimRequest]
) -> None:
    # Given a reservation whose row expired unclaimed, removed by the cleanup
    store, clock = clocked_store
    pickup = Pickup(envelope=b'{"args": ["first"]}', due_in=5.0, timeout=5.0)
    assert store.reserve(request_for(make_request, owner="", ttl_seconds=1.0), pickup) is None
    clock.now += 7
    assert store.cleanup() == 1
    # When another call claims the key afresh, then dies
    second = request_for(make_request, task_id="task-2", fingerprint="fp-2", lease_seconds=1.0)
    assert store.claim(second).outcome is Outcome.ACQUIRED
    clock.now += 1 + 5 + 1
    # Then the guard has nothing of the first call's to publish under its task id
    assert store.take(second.storage_key) is None


def test_a_fresh_claim_drops_the_pickup_an_expired_row_left_behind(
    clocked_store: tuple[SqlStore, Clock], make_request: Callable[..., ClaimRequest]
) -> None:
    # Given a reservation whose message the guard published again (its next try due after the
    # row expires), and the row removed by the cleanup before that try
    store, clock = clocked_store
    pickup = Pickup(envelope=b'{"args": ["first"]}', due_in=1.0, timeout=5.0)
    assert store.reserve(request_for(make_request, owner="", ttl_seconds=1.0), pickup) is None
    clock.now += 1.5
    assert len(store.take_due(10)) == 1
    clock.now += 2
    assert store.cleanup() == 1
    # When another call, with other arguments, claims the key afresh, then dies
    second = request_for(make_request, task_id="task-2", fingerprint="fp-2", lease_seconds=1.0)
    assert store.claim(second).outcome is Outcome.ACQUIRED
    clock.now += 20
    # Then the guard never publishes the first call's arguments under its task id
    assert store.take(second.storage_key) is None
    assert store.take_due(10) == []


def test_a_completion_whose_expired_row_is_cleaned_up_meanwhile_still_recovers(
    clocked_store: tuple[SqlStore, Clock], make_request: Callable[..., ClaimRequest]
) -> None:
    # Given an owner whose claim expired (its process paused past lease and TTL) whose body
    # did finish
    store, clock = clocked_store
    owner = request_for(make_request, lease_seconds=10.0, ttl_seconds=5.0)
    token = store.claim(owner).token
    clock.now += 16
    # When the beat's cleanup deletes the expired row between the completion's read and write
    cleaned = write_after_next_read(store, store.cleanup)
    outcome = store.complete(owner, token, RESULT)
    # Then the result is the key's all the same (as on Redis): not dropped as stale, which
    # would let the next call run the body again
    assert cleaned == [1]
    assert outcome is CompleteOutcome.RECOVERED
    record = store.get(owner.storage_key)
    assert record is not None
    assert (record.status, record.result) == (Status.COMPLETED, RESULT)
