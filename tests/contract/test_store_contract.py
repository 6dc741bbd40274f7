"""The store contract: every store answers every step of the claim protocol the same way."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from idempotent_tasks.keys import storage_key
from idempotent_tasks.records import (
    ClaimRequest,
    CompleteOutcome,
    EncodedResult,
    Outcome,
    Pickup,
    Status,
)
from idempotent_tasks.stores import Store, sql_statements
from idempotent_tasks.stores.sql import SqlStore

Make = Callable[..., ClaimRequest]
RESULT = EncodedResult(content_type="application/json", content_encoding="utf-8", body=b'{"a": 1}')


def test_first_claim_acquires_with_token_one(store: Store, make_request: Make) -> None:
    claim = store.claim(make_request())
    assert claim.outcome is Outcome.ACQUIRED
    assert claim.token == 1
    assert not claim.takeover
    assert claim.taken_from_task_id is None


def test_record_shows_the_processing_claim(store: Store, make_request: Make) -> None:
    request = make_request(task_id="t-9")
    store.claim(request)
    record = store.get(request.storage_key)
    assert record is not None
    assert record.status is Status.PROCESSING
    assert (record.owner, record.token, record.task_id) == (request.owner, 1, "t-9")
    assert (record.key, record.task_name, record.fingerprint) == (
        request.key,
        request.task_name,
        request.fingerprint,
    )
    assert record.lease_expires_at == pytest.approx(time.time() + 30, abs=2)
    assert record.result is None


def test_same_owner_claiming_again_gets_the_same_token(store: Store, make_request: Make) -> None:
    # A claim whose reply was lost is sent again by the client: it must not block itself.
    request = make_request()
    first = store.claim(request)
    again = store.claim(request)
    assert again.outcome is Outcome.ACQUIRED
    assert again.token == first.token


def test_other_owner_while_lease_alive_is_in_progress(store: Store, make_request: Make) -> None:
    owner = make_request(task_id="owner-task")
    store.claim(owner)
    duplicate = store.claim(make_request(storage_key=owner.storage_key, task_id="dup-task"))
    assert duplicate.outcome is Outcome.IN_PROGRESS
    assert duplicate.record is not None
    assert duplicate.record.task_id == "owner-task"


def test_completed_key_answers_with_the_cached_result(store: Store, make_request: Make) -> None:
    owner = make_request(task_id="owner-task")
    token = store.claim(owner).token
    assert store.complete(owner, token, RESULT) is CompleteOutcome.STORED
    duplicate = store.claim(make_request(storage_key=owner.storage_key))
    assert duplicate.outcome is Outcome.COMPLETED
    assert duplicate.record is not None
    assert duplicate.record.result == RESULT
    assert duplicate.record.result_cached
    assert duplicate.record.task_id == "owner-task"


def test_completing_twice_is_harmless(store: Store, make_request: Make) -> None:
    owner = make_request()
    token = store.claim(owner).token
    store.complete(owner, token, RESULT)
    assert store.complete(owner, token, RESULT) is CompleteOutcome.STORED


def test_uncached_result_still_completes_the_key(store: Store, make_request: Make) -> None:
    owner = make_request()
    store.complete(owner, store.claim(owner).token, None)
    duplicate = store.claim(make_request(storage_key=owner.storage_key))
    assert duplicate.outcome is Outcome.COMPLETED
    assert duplicate.record is not None
    assert duplicate.record.result is None
    assert not duplicate.record.result_cached


@pytest.mark.parametrize("finished", [False, True])
def test_other_fingerprint_is_a_mismatch(store: Store, make_request: Make, finished: bool) -> None:
    owner = make_request(fingerprint="fp-a")
    token = store.claim(owner).token
    if finished:
        store.complete(owner, token, RESULT)
    other = store.claim(
        make_request(storage_key=owner.storage_key, fingerprint="fp-b", task_id="task-2")
    )
    assert other.outcome is Outcome.MISMATCH
    assert other.record is not None
    assert other.record.fingerprint == "fp-a"


@pytest.mark.parametrize("released", [True, False], ids=["released", "release-lost"])
def test_a_retry_with_other_arguments_is_the_same_call(
    store: Store, make_request: Make, released: bool
) -> None:
    # Given a call whose attempt retries itself with other arguments (same task id), its claim
    # released for the retry's message (or the release lost: the retry names it as previous
    # owner)
    first = make_request(task_id="t-1", fingerprint="fp-a")
    token = store.claim(first).token
    if released:
        assert store.release(first, token, Pickup(envelope=b"retry", due_in=60, timeout=60))
    retry = make_request(
        task_id="t-1", fingerprint="fp-b", previous_owner=None if released else first.owner
    )
    # When the retry claims the key, then it runs: it is no other caller
    claim = store.claim(retry)
    assert claim.outcome is Outcome.ACQUIRED
    # And the key still stands for the caller's arguments: a duplicate of the call waits, a
    # call with the retry's arguments is another call
    duplicate = store.claim(make_request(task_id="t-2", fingerprint="fp-a"))
    assert duplicate.outcome is Outcome.IN_PROGRESS
    stranger = store.claim(make_request(task_id="t-3", fingerprint="fp-b"))
    assert stranger.outcome is Outcome.MISMATCH


def test_validation_off_ignores_the_fingerprint(store: Store, make_request: Make) -> None:
    owner = make_request(fingerprint="fp-a")
    store.complete(owner, store.claim(owner).token, RESULT)
    other = make_request(storage_key=owner.storage_key, fingerprint="fp-b", validate=False)
    assert store.claim(other).outcome is Outcome.COMPLETED


def test_completed_key_expires_after_its_ttl(store: Store, make_request: Make) -> None:
    owner = make_request(ttl_seconds=0.3)
    store.complete(owner, store.claim(owner).token, RESULT)
    time.sleep(0.5)
    assert store.get(owner.storage_key) is None
    later = store.claim(make_request(storage_key=owner.storage_key))
    assert later.outcome is Outcome.ACQUIRED


def test_a_key_not_completed_outlives_its_lease_or_due_time_by_its_claim_ttl(
    store: Store, make_request: Make
) -> None:
    # Given keys whose records are to outlive their lease or due time by longer than their
    # TTL (the pickup guard must find them): one claimed and renewed once, one queued
    owner = make_request(lease_seconds=0.2, ttl_seconds=0.1, claim_ttl_seconds=30.0)
    token = store.claim(owner).token
    assert store.extend(owner, token)
    queued = make_request(
        storage_key=f"{owner.storage_key}-queued", ttl_seconds=0.1, claim_ttl_seconds=30.0
    )
    assert store.reserve(queued, Pickup(envelope=b"{}", due_in=0.1, timeout=60)) is None
    # When their lease or due time and TTL have passed, then the records are still there
    time.sleep(0.5)
    record = store.get(owner.storage_key)
    assert record is not None and record.status is Status.PROCESSING
    assert record.expires_at == pytest.approx(time.time() + 30, abs=2)
    record = store.get(queued.storage_key)
    assert record is not None and record.status is Status.QUEUED
    assert record.expires_at == pytest.approx(time.time() + 30, abs=2)
    # And a completion keeps the result for the TTL alone
    assert store.complete(owner, token, RESULT) is CompleteOutcome.STORED
    time.sleep(0.3)
    assert store.get(owner.storage_key) is None


def test_expired_lease_is_taken_over_with_token_plus_one(store: Store, make_request: Make) -> None:
    # Given an owner that died without releasing (its lease simply runs out)
    dead = make_request(lease_seconds=0.2)
    assert store.claim(dead).token == 1
    time.sleep(0.35)
    # When another execution claims, it takes over with a higher fencing token
    heir = make_request(storage_key=dead.storage_key, task_id="heir")
    takeover = store.claim(heir)
    assert takeover.outcome is Outcome.ACQUIRED
    assert takeover.takeover
    assert takeover.token == 2
    # (told whose call it took over: that call's callers wait on its task id)
    assert takeover.taken_from_task_id == dead.task_id
    # Then the dead owner's late writes are all refused, and the heir's record stands
    assert store.complete(dead, 1, RESULT) is CompleteOutcome.STALE
    assert store.release(dead, 1) is False
    assert store.extend(dead, 1) is False
    record = store.get(dead.storage_key)
    assert record is not None
    assert (record.status, record.owner, record.token) == (Status.PROCESSING, heir.owner, 2)
    assert store.complete(heir, 2, RESULT) is CompleteOutcome.STORED


def test_previous_owner_is_taken_over_at_once(store: Store, make_request: Make) -> None:
    # A retry message names the attempt it retries: it may take its claim over unexpired.
    first = make_request()
    store.claim(first)
    retry = make_request(
        storage_key=first.storage_key, previous_owner=first.owner, task_id=first.task_id
    )
    claim = store.claim(retry)
    assert claim.outcome is Outcome.ACQUIRED
    assert claim.takeover
    assert claim.token == 2
    assert claim.taken_from_task_id is None  # the same call


def test_previous_owner_does_not_unlock_a_completed_key(store: Store, make_request: Make) -> None:
    first = make_request()
    store.complete(first, store.claim(first).token, RESULT)
    retry = make_request(storage_key=first.storage_key, previous_owner=first.owner)
    assert store.claim(retry).outcome is Outcome.COMPLETED


def test_release_frees_the_key_and_tokens_keep_growing(store: Store, make_request: Make) -> None:
    first = make_request()
    token = store.claim(first).token
    assert store.release(first, token) is True
    assert store.get(first.storage_key) is None
    again = store.claim(make_request(storage_key=first.storage_key))
    assert again.outcome is Outcome.ACQUIRED
    assert again.token == token + 1


def test_tokens_keep_growing_past_a_retry_whose_queued_record_outlives_the_claim(
    store: Store, make_request: Make
) -> None:
    # Given a short claim (its record ends 0.8 s on: time for its release on a busy machine)
    # released for a retry due well after the claim would have ended
    first = make_request(lease_seconds=0.4, ttl_seconds=0.4)
    token = store.claim(first).token
    pickup = Pickup(envelope=b"{}", due_in=5.0, timeout=5.0)
    assert store.release(first, token, pickup) is True
    time.sleep(2.0)  # past the claim's end, and its counter's with it (Redis: 1 s later)
    # When the retry claims the key, then its token is still the next one
    again = store.claim(first)
    assert again.outcome is Outcome.ACQUIRED
    assert again.token == token + 1


def test_release_by_a_stranger_is_refused(store: Store, make_request: Make) -> None:
    owner = make_request()
    token = store.claim(owner).token
    stranger = make_request(storage_key=owner.storage_key)
    assert store.release(stranger, token) is False
    assert store.release(owner, token + 1) is False
    assert store.get(owner.storage_key) is not None


def test_release_does_not_undo_a_completion(store: Store, make_request: Make) -> None:
    owner = make_request()
    token = store.claim(owner).token
    store.complete(owner, token, RESULT)
    assert store.release(owner, token) is False
    record = store.get(owner.storage_key)
    assert record is not None
    assert record.status is Status.COMPLETED


def test_extend_keeps_a_live_owner_from_being_taken_over(store: Store, make_request: Make) -> None:
    # Given an owner with a 1 s lease that renews it every 0.25 s, on past its first lease's end
    # (each renewal 0.75 s before its lease would end: room for a busy machine)
    owner = make_request(lease_seconds=1.0)
    token = store.claim(owner).token
    for _ in range(5):
        time.sleep(0.25)
        assert store.extend(owner, token) is True
    # When another call claims the key, then it waits: the renewed lease lives (1 s to go)
    other = store.claim(make_request(storage_key=owner.storage_key))
    assert other.outcome is Outcome.IN_PROGRESS


def test_complete_after_the_record_vanished_recovers(store: Store, make_request: Make) -> None:
    # Given a claim whose record is gone (a store restarted without persistence)
    owner = make_request(task_id="owner-task")
    token = store.claim(owner).token
    store.forget(owner.storage_key)
    # When the owner finishes, its result is written anew
    assert store.complete(owner, token, RESULT) is CompleteOutcome.RECOVERED
    record = store.get(owner.storage_key)
    assert record is not None
    assert (record.status, record.result, record.task_id) == (
        Status.COMPLETED,
        RESULT,
        "owner-task",
    )


def test_a_recovering_completion_never_hands_a_token_out_again(
    store: Store, make_request: Make
) -> None:
    # Given an owner taken over (token 1, then 2), and the key's record expired since (a
    # claim's record ends 0.2 s on; a completed one is kept 0.8 s: time for the steps after
    # the completion on a busy machine)
    first = make_request(lease_seconds=0.1, ttl_seconds=0.8, claim_ttl_seconds=0.1)
    assert store.claim(first).token == 1
    second = make_request(
        storage_key=first.storage_key,
        previous_owner=first.owner,
        lease_seconds=0.1,
        ttl_seconds=0.8,
        claim_ttl_seconds=0.1,
    )
    assert store.claim(second).token == 2
    # past the record's expiry; Redis keeps its counter a second longer (0.8 s still to go)
    time.sleep(0.4)
    # When the first owner finishes, its result is written anew under the highest token
    assert store.complete(first, 1, RESULT) is CompleteOutcome.RECOVERED
    record = store.get(first.storage_key)
    assert record is not None
    assert (record.status, record.owner, record.token) == (Status.COMPLETED, first.owner, 2)
    # and completing again is harmless
    assert store.complete(first, 1, RESULT) is CompleteOutcome.STORED
    # Then once that record expired too (Redis keeps its counter a second longer), the next
    # claim gets a token never given before
    time.sleep(0.8 + 0.15)
    assert store.claim(make_request(storage_key=first.storage_key)).token == 3


def test_forget_removes_any_record(store: Store, make_request: Make) -> None:
    owner = make_request()
    store.claim(owner)
    assert store.forget(owner.storage_key) is True
    assert store.forget(owner.storage_key) is False
    assert store.claim(make_request(storage_key=owner.storage_key)).outcome is Outcome.ACQUIRED


def test_large_result_round_trips(store: Store, make_request: Make) -> None:
    body = b"x" * (900 * 1024)
    big = EncodedResult(content_type="application/data", content_encoding="binary", body=body)
    owner = make_request()
    store.complete(owner, store.claim(owner).token, big)
    record = store.get(owner.storage_key)
    assert record is not None
    assert record.result == big


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("order-42", "ORDER-42"),
        ("order-42", "order-42 "),
        ("café", "cafe"),
        ("gift-😀", "gift-😎"),
        ("   ", "  "),
    ],
    ids=["case", "trailing-space", "accent", "emoji", "whitespace-only"],
)
def test_keys_differing_only_in_case_spaces_accents_or_emoji_are_different_keys(
    store: Store, make_request: Make, first: str, second: str
) -> None:
    # Given one key completed with its result
    done = make_request(storage_key=f"tasks.charge:{first}", key=first)
    store.complete(done, store.claim(done).token, RESULT)
    # When a key that a case- or accent-blind comparison would take for it is claimed
    other = make_request(storage_key=f"tasks.charge:{second}", key=second, fingerprint="fp-2")
    claim = store.claim(other)
    # Then it is a key of its own: acquired, and each keeps its own record
    assert claim.outcome is Outcome.ACQUIRED
    other_result = EncodedResult(
        content_type="application/json", content_encoding="utf-8", body=b"2"
    )
    assert store.complete(other, claim.token, other_result) is CompleteOutcome.STORED
    first_record, second_record = store.get(done.storage_key), store.get(other.storage_key)
    assert first_record is not None and second_record is not None
    assert (first_record.key, first_record.result) == (first, RESULT)
    assert (second_record.key, second_record.result) == (second, other_result)


def test_a_key_of_thousands_of_characters_works_like_any_other(
    store: Store, make_request: Make
) -> None:
    long_key = "report:" + "x" * 3000
    request = make_request(storage_key=storage_key("tasks.charge", long_key), key=long_key)
    claim = store.claim(request)
    assert claim.outcome is Outcome.ACQUIRED
    assert store.complete(request, claim.token, RESULT) is CompleteOutcome.STORED
    record = store.get(request.storage_key)
    assert record is not None and record.result == RESULT
    assert long_key.startswith(record.key)  # SQL keeps the first 1024 characters to show


def test_sqlite_without_returning_tells_a_fresh_claim_from_a_taken_key(
    tmp_path: Path, make_request: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the SQLite store of a Python whose SQLite predates RETURNING (before 3.35)
    monkeypatch.setattr(sql_statements, "SQLITE_RETURNING", False)
    store = SqlStore(f"sqlite:///{tmp_path / 'old.sqlite3'}", prefix="old")
    try:
        # When a key is claimed, then claimed by another owner, then reserved and reserved
        first = make_request()
        other = make_request(storage_key=first.storage_key, task_id="task-2")
        queued = make_request(storage_key="tasks.charge:queued", task_id="task-3")
        # Then the insert's count of changes tells each outcome, as RETURNING does
        assert (store.claim(first).outcome, store.claim(first).token) == (Outcome.ACQUIRED, 1)
        assert store.claim(other).outcome is Outcome.IN_PROGRESS
        assert store.reserve(queued, Pickup(envelope=b"{}", due_in=30, timeout=30)) is None
        again = store.reserve(queued, Pickup(envelope=b"{}", due_in=30, timeout=30))
        assert again is not None and again.status is Status.QUEUED
        # And a completion whose row vanished writes it anew
        store.forget(first.storage_key)
        assert store.complete(first, 1, RESULT) is CompleteOutcome.RECOVERED
    finally:
        store.close()
