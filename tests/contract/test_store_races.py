"""Claims racing from several processes against the real Redis store: exactly one wins."""

from __future__ import annotations

import multiprocessing
import uuid

import redis

from idempotent_tasks.records import ClaimRequest, Outcome
from idempotent_tasks.stores.redis import RedisStore
from tests.contract.conftest import CONTRACT_REDIS_DB

PROCESSES = 8
ROUNDS = 25


def _claim_all(url: str, keys: list[str], start: multiprocessing.synchronize.Event) -> list[str]:
    store = RedisStore.from_url(url, prefix="race")
    start.wait()
    outcomes = []
    for key in keys:
        request = ClaimRequest(
            storage_key=key,
            key=key,
            task_name="t",
            task_id="x",
            owner=uuid.uuid4().hex,
            fingerprint="fp",
            lease_seconds=30,
            ttl_seconds=60,
        )
        outcomes.append(store.claim(request).outcome.value)
    return outcomes


def test_concurrent_claimers_in_many_processes_get_one_winner_per_key(redis_url: str) -> None:
    url = f"{redis_url}/{CONTRACT_REDIS_DB}"
    redis.Redis.from_url(url).flushdb()
    keys = [f"k{i}-{uuid.uuid4().hex[:6]}" for i in range(ROUNDS)]
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        start = manager.Event()
        with context.Pool(PROCESSES) as pool:
            pending = [pool.apply_async(_claim_all, (url, keys, start)) for _ in range(PROCESSES)]
            start.set()
            results = [job.get(timeout=60) for job in pending]
    for index in range(ROUNDS):
        per_key = [outcomes[index] for outcomes in results]
        assert per_key.count(Outcome.ACQUIRED.value) == 1, per_key
        assert per_key.count(Outcome.IN_PROGRESS.value) == PROCESSES - 1, per_key
