"""An attempt whose claim owes a lost call's message publishes it once it completed, unless the
pickup guard published it first; when its store cannot say, it publishes (logged)."""

from __future__ import annotations

import pytest

from idempotent_tasks.codec import ResultCodec
from idempotent_tasks.core import Attempt
from idempotent_tasks.errors import StoreUnavailable
from idempotent_tasks.records import ClaimRequest, Outcome, Pickup
from idempotent_tasks.stores import MemoryStore
from tests.claim_requests import claim_request

ENVELOPE = b"the lost call's message"
CODEC = ResultCodec(serializer="json", max_bytes=1024)


def _request(task_id: str, owner: str, lease_seconds: float = 10.0) -> ClaimRequest:
    return claim_request(
        task_name="tasks.charge",
        task_id=task_id,
        owner=owner,
        fingerprint=f"fp-{task_id}",
        lease_seconds=lease_seconds,
        validate=False,
    )


@pytest.fixture()
def clock() -> list[float]:
    return [1000.0]


@pytest.fixture()
def store(clock: list[float]) -> MemoryStore:
    return MemoryStore(clock=lambda: clock[0])


def _owing_attempt(store: MemoryStore, clock: list[float]) -> Attempt:
    """An attempt of call "taker" that took the key of call "lost", whose message counted as
    lost: its claim owes that message."""
    store.reserve(_request("lost", "lost-owner"), Pickup(envelope=ENVELOPE, due_in=1, timeout=5))
    clock[0] += 2
    attempt = Attempt(store=store, request=_request("taker", "taker-owner"), codec=CODEC)
    assert attempt.claim().outcome is Outcome.ACQUIRED
    assert (attempt.owed_task_id, attempt.taken_over_envelope) == ("lost", ENVELOPE)
    return attempt


def test_a_completed_attempt_owing_a_message_publishes_it_once(
    store: MemoryStore, clock: list[float]
) -> None:
    attempt = _owing_attempt(store, clock)
    assert attempt.settle_owed_message() is False  # not completed yet
    attempt.finish("value", patience_seconds=1)
    assert attempt.settle_owed_message() is True
    assert attempt.settle_owed_message() is False


def test_an_attempt_slow_past_its_lease_leaves_the_message_to_the_guard(
    store: MemoryStore, clock: list[float]
) -> None:
    # Given an owing attempt stalled past its lease and the message's re-publication timeout,
    # whose message the guard then published
    attempt = _owing_attempt(store, clock)
    clock[0] += 10 + 5 + 1
    assert [due.task_id for due in store.take_due(10)] == ["lost"]
    # When it completes after all, then it does not publish the message again
    attempt.finish("value", patience_seconds=1)
    assert attempt.settle_owed_message() is False


def test_an_attempt_whose_store_cannot_say_publishes(
    store: MemoryStore, clock: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    attempt = _owing_attempt(store, clock)
    attempt.finish("value", patience_seconds=1)

    def unreachable(request: ClaimRequest) -> bool:
        raise StoreUnavailable("restarting")

    monkeypatch.setattr(store, "settle_owed_message", unreachable)
    assert attempt.settle_owed_message() is True


def test_an_attempt_whose_record_vanished_still_publishes_once(
    store: MemoryStore, clock: list[float]
) -> None:
    # Given an owing attempt whose record the store lost (its completion writes it anew)
    attempt = _owing_attempt(store, clock)
    assert store.forget(attempt.request.storage_key) is True
    attempt.finish("value", patience_seconds=1)
    # Then the debt went with the record written anew: it publishes the message, once
    assert attempt.settle_owed_message() is True
    assert attempt.settle_owed_message() is False


def test_an_attempt_that_did_not_complete_publishes_nothing(
    store: MemoryStore, clock: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an owing attempt whose store stayed down past its patience as it completed
    attempt = _owing_attempt(store, clock)

    def unreachable(*args: object, **kwargs: object) -> None:
        raise StoreUnavailable("down")

    monkeypatch.setattr(store, "complete", unreachable)
    monkeypatch.setattr(store, "settle_owed_message", unreachable)
    attempt.finish("value", patience_seconds=0)
    # Then the message is not sent: the key is not completed, and the copy would run it again
    assert attempt.settle_owed_message() is False


def test_a_refused_completion_publishes_nothing(store: MemoryStore, clock: list[float]) -> None:
    # Given an owing attempt whose claim another execution took over after its lease ended
    attempt = _owing_attempt(store, clock)
    clock[0] += 11
    winner = Attempt(store=store, request=_request("taker", "winner-owner"), codec=CODEC)
    assert winner.claim().outcome is Outcome.ACQUIRED
    attempt.finish("value", patience_seconds=1)
    assert attempt.settle_owed_message() is False


def test_an_attempt_about_to_be_released_for_a_retry_publishes_the_message_once(
    store: MemoryStore, clock: list[float]
) -> None:
    # Given an owing attempt, still holding its claim, about to give it up for its retry
    attempt = _owing_attempt(store, clock)
    # Then it publishes the message now, once (the release keeps the retry's in its place)
    assert attempt.settle_owed_message_before_release() is True
    assert attempt.settle_owed_message_before_release() is False
    # and once it gave the key up, it settles nothing
    other = _owing_attempt(MemoryStore(clock=lambda: clock[0]), clock)
    other.release()
    assert other.settle_owed_message_before_release() is False


def test_an_attempt_taken_over_before_its_release_publishes_nothing(
    store: MemoryStore, clock: list[float]
) -> None:
    # Given an owing attempt whose claim another execution took over after its lease ended
    # (the debt passed on to it)
    attempt = _owing_attempt(store, clock)
    clock[0] += 11
    winner = Attempt(store=store, request=_request("taker", "winner-owner"), codec=CODEC)
    assert winner.claim().outcome is Outcome.ACQUIRED
    # Then it does not publish the message as it gives the key up: the new owner owes it
    assert attempt.settle_owed_message_before_release() is False


def test_a_release_refused_while_the_claim_owes_a_message_is_logged(
    store: MemoryStore, clock: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    # Given an owing attempt released for its next message without settling first (as the
    # worker's main process releases a terminated call that is requeued)
    attempt = _owing_attempt(store, clock)
    retry = Pickup(envelope=b"the taker's next message", due_in=1, timeout=5)
    with caplog.at_level("WARNING", logger="idempotent_tasks.core"):
        attempt.release_quietly(retry)
    # Then the store refuses, the key stays claimed for its lease, and the log says so
    assert store.get(attempt.request.storage_key).status == "processing"
    assert "was refused" in caplog.text and repr(attempt.request.key) in caplog.text
    # while a release that settled first is taken, quietly
    caplog.clear()
    settled = _owing_attempt(MemoryStore(clock=lambda: clock[0]), clock)
    assert settled.settle_owed_message_before_release() is True
    with caplog.at_level("WARNING", logger="idempotent_tasks.core"):
        settled.release_quietly(retry)
    assert settled.store.get(settled.request.storage_key).status == "queued"
    assert caplog.text == ""
