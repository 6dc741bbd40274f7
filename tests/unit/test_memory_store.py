"""The memory store's housekeeping (its protocol is the store contract's, in tests/contract)."""

from __future__ import annotations

import dataclasses
import math

from idempotent_tasks.records import ClaimRequest, CompleteOutcome, EncodedResult
from idempotent_tasks.stores.memory import SWEEP_EVERY, MemoryStore
from tests.claim_requests import claim_request

RESULT = EncodedResult(content_type="application/json", content_encoding="utf-8", body=b"1")


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def _request(key: str, lease_seconds: float = 10.0) -> ClaimRequest:
    return claim_request(
        key=key,
        storage_key=f"t:{key}",
        task_id=f"id-{key}",
        owner=f"owner-{key}",
        lease_seconds=lease_seconds,
        ttl_seconds=30.0,
    )


def test_expired_keys_no_call_touches_again_are_forgotten() -> None:
    # Given keys completed, and one still running, in a long-lived process
    clock = Clock()
    store = MemoryStore(clock=clock)
    for key in ("a", "b", "c"):
        request = _request(key)
        store.complete(request, store.claim(request).token, RESULT)
    running = _request("running", lease_seconds=1000.0)
    store.claim(running)
    # When their TTL and a sweep interval have passed, and another key is claimed
    clock.now += 31 + SWEEP_EVERY
    store.claim(_request("d"))
    # Then the expired keys, and their fencing counters, are gone; the others stay
    assert sorted(store._records) == ["t:d", "t:running"]
    assert sorted(store._fences) == ["t:d", "t:running"]


def test_a_released_keys_fencing_counter_outlives_its_record_as_on_redis() -> None:
    # Given a key claimed (its claim to live 1030 s) and released
    clock = Clock()
    store = MemoryStore(clock=clock)
    released = _request("r", lease_seconds=1000.0)
    token = store.claim(released).token
    assert store.release(released, token)
    # When a sweep runs before that claim would have expired
    clock.now += SWEEP_EVERY + 1
    store.claim(_request("d"))
    # Then the key's next claim gets a higher token, not the first one again
    again = _request("r")
    assert store.claim(again).token == token + 1


def test_a_store_that_never_sweeps_keeps_a_keys_tokens_growing_past_its_expiry() -> None:
    # (math.inf, as the differential test runs it beside a SQL store whose cleanup does not
    # run: it swept once, at its first claim, and gave a token again)
    clock = Clock()
    store = MemoryStore(clock=clock, sweep_every=math.inf)
    # Given a key written by a completion whose claim the store lost (token 1), then expired
    lost = _request("k")
    assert store.complete(lost, 1, RESULT) is CompleteOutcome.RECOVERED
    clock.now += 3600
    # When the store's first claim comes, then its token is still the next one
    assert store.claim(dataclasses.replace(lost, owner="next")).token == 2
