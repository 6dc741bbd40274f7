"""The Redis store under bad conditions: unreachable, corrupt records, scripts flushed."""

from __future__ import annotations

import uuid

import pytest
import redis
from redis.crc import key_slot

from idempotent_tasks.errors import CorruptRecord, StoreUnavailable
from idempotent_tasks.records import ClaimRequest, Outcome
from idempotent_tasks.stores.redis import RedisStore
from tests.contract.conftest import CONTRACT_REDIS_DB
from tests.services import answers


def _request(key: str) -> ClaimRequest:
    return ClaimRequest(
        storage_key=key,
        key=key,
        task_name="t",
        task_id="x",
        owner=uuid.uuid4().hex,
        fingerprint="fp",
        lease_seconds=30,
        ttl_seconds=60,
    )


@pytest.fixture()
def url(redis_url: str) -> str:
    url = f"{redis_url}/{CONTRACT_REDIS_DB}"
    redis.Redis.from_url(url).flushdb()
    return url


def test_unreachable_redis_raises_store_unavailable() -> None:
    port = 1  # nothing listens on port 1 of loopback
    assert not answers(port)
    store = RedisStore.from_url(f"redis://127.0.0.1:{port}/0", prefix="down")
    with pytest.raises(StoreUnavailable, match="unreachable"):
        store.claim(_request("k"))
    with pytest.raises(StoreUnavailable):
        store.get("k")


def test_key_of_another_type_is_a_corrupt_record(url: str) -> None:
    store = RedisStore.from_url(url, prefix="corrupt")
    record_name = store.names("k")[0]
    redis.Redis.from_url(url).set(record_name, "not a hash")
    with pytest.raises(CorruptRecord):
        store.claim(_request("k"))
    with pytest.raises(CorruptRecord):
        store.get("k")


def test_record_missing_fields_is_a_corrupt_record_and_a_claim_repairs_it(url: str) -> None:
    store = RedisStore.from_url(url, prefix="corrupt")
    record_name = store.names("k")[0]
    redis.Redis.from_url(url).hset(record_name, mapping={"owner": "someone"})
    with pytest.raises(CorruptRecord, match="missing or unreadable"):
        store.get("k")
    # A record without a status protects nothing: a claim replaces it.
    assert store.claim(_request("k")).outcome is Outcome.ACQUIRED
    record = store.get("k")
    assert record is not None


def test_scripts_are_reloaded_after_a_script_flush(url: str) -> None:
    # A restarted Redis has forgotten every script: EVALSHA answers NOSCRIPT and must reload.
    store = RedisStore.from_url(url, prefix="noscript")
    assert store.claim(_request("a")).outcome is Outcome.ACQUIRED
    store.client.script_flush()
    assert store.claim(_request("b")).outcome is Outcome.ACQUIRED


def test_a_keys_record_and_fence_share_one_cluster_slot(url: str) -> None:
    store = RedisStore.from_url(url, prefix="slots")
    slots = set()
    for storage_key in ("tasks.charge:order-42", "tasks.charge:order-43", "sha256:" + "ab" * 32):
        record, fence, _ = store.names(storage_key)
        assert key_slot(record.encode()) == key_slot(fence.encode())
        slots.add(key_slot(record.encode()))
    assert len(slots) == 3  # different keys still spread over the cluster
