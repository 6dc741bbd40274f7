"""Claims racing from several processes against each real store: exactly one wins per key."""

from __future__ import annotations

import multiprocessing
import time
import uuid

import pytest

from idempotent_tasks.records import Outcome
from tests.claim_requests import claim_request
from tests.contract.conftest import SERVER_STORES, open_store, store_url

PROCESSES = 6
ROUNDS = 20


def _claim_all(
    kind: str, url: str, keys: list[str], lease: float, start: multiprocessing.synchronize.Event
) -> list[str]:
    store = open_store(kind, url, prefix="race")
    store.get("warm-up")  # connect and create tables before the start line
    start.wait()
    outcomes = []
    for key in keys:
        request = claim_request(key=key, storage_key=key, task_id="x", lease_seconds=lease)
        outcomes.append(store.claim(request).outcome.value)
    store.close()
    return outcomes


def _race(kind: str, url: str, keys: list[str], lease: float) -> list[list[str]]:
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        start = manager.Event()
        with context.Pool(PROCESSES) as pool:
            jobs = [
                pool.apply_async(_claim_all, (kind, url, keys, lease, start))
                for _ in range(PROCESSES)
            ]
            time.sleep(0.5)
            start.set()
            return [job.get(timeout=120) for job in jobs]


@pytest.mark.parametrize("kind", SERVER_STORES)
def test_concurrent_claimers_in_many_processes_get_one_winner_per_key(
    kind: str, request: pytest.FixtureRequest
) -> None:
    url = store_url(kind, request)
    keys = [f"k{i}-{uuid.uuid4().hex[:6]}" for i in range(ROUNDS)]
    results = _race(kind, url, keys, lease=30)
    for index in range(ROUNDS):
        per_key = [outcomes[index] for outcomes in results]
        assert per_key.count(Outcome.ACQUIRED.value) == 1, per_key
        assert per_key.count(Outcome.IN_PROGRESS.value) == PROCESSES - 1, per_key


@pytest.mark.parametrize("kind", SERVER_STORES)
def test_concurrent_takeovers_of_an_expired_lease_get_one_winner(
    kind: str, request: pytest.FixtureRequest
) -> None:
    # Given keys whose owners died: their leases have run out
    url = store_url(kind, request)
    keys = [f"dead{i}-{uuid.uuid4().hex[:6]}" for i in range(ROUNDS)]
    _race(kind, url, keys, lease=0.05)  # one winner each, leases of 50 ms
    time.sleep(0.2)
    # When several processes race to take each of them over
    results = _race(kind, url, keys, lease=30)
    # Then exactly one takes each key over
    for index in range(ROUNDS):
        per_key = [outcomes[index] for outcomes in results]
        assert per_key.count(Outcome.ACQUIRED.value) == 1, per_key
