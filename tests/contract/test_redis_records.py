"""What the Redis store's scripts write: times and tokens as plain digits, TTLs of any length."""

from __future__ import annotations

import dataclasses
import re
import uuid
from typing import Any

import pytest
import redis

from idempotent_tasks.records import (
    ClaimRequest,
    CompleteOutcome,
    EncodedResult,
    Outcome,
    Pickup,
    Status,
)
from idempotent_tasks.stores.redis import RedisStore
from tests.claim_requests import claim_request
from tests.contract.conftest import CONTRACT_REDIS_DB

#: Fields the scripts compute as numbers and write as text.
INTEGER_FIELDS = ("token", "lease_expires_at", "created_at", "updated_at", "expires_at")
RESULT = EncodedResult(content_type="application/json", content_encoding="utf-8", body=b"42")


@pytest.fixture()
def client(redis_url: str) -> redis.Redis:
    client = redis.Redis.from_url(f"{redis_url}/{CONTRACT_REDIS_DB}", decode_responses=True)
    client.flushdb()
    return client


def _request(**changes: Any) -> ClaimRequest:
    request = claim_request(owner="owner-1", ttl_seconds=600)
    return dataclasses.replace(request, **changes)


def _hash(client: redis.Redis, name: str) -> dict[str, str]:
    return {str(field): str(value) for field, value in client.hgetall(name).items()}


def _server_ms(client: redis.Redis) -> int:
    seconds, microseconds = client.time()
    return int(seconds) * 1000 + int(microseconds) // 1000


def test_each_step_writes_times_and_tokens_as_plain_digits(client: redis.Redis) -> None:
    store = RedisStore(client, prefix="digits")
    request = _request()
    record_name = store.names(request.storage_key)[0]
    before = _server_ms(client)
    assert store.reserve(request, Pickup(envelope=b"{}", due_in=900, timeout=900)) is None
    reserved = _hash(client, record_name)
    claim = store.claim(request)
    claimed = _hash(client, record_name)
    assert store.complete(request, claim.token, RESULT) is CompleteOutcome.STORED
    completed = _hash(client, record_name)
    after = _server_ms(client)

    for fields in (reserved, claimed, completed):
        for name in INTEGER_FIELDS:
            assert re.fullmatch(r"[0-9]+", fields[name]), (name, fields[name])
    assert re.fullmatch(r"[0-9]+", reserved["due_at"])
    assert before + 900_000 <= int(reserved["lease_expires_at"]) <= after + 900_000
    assert before + 30_000 <= int(claimed["lease_expires_at"]) <= after + 30_000
    assert before + 600_000 <= int(completed["expires_at"]) <= after + 600_000
    assert claimed["token"] == str(claim.token)
    # The claim of a queued key keeps what its reservation wrote of it.
    assert (claimed["created_at"], claimed["key"], claimed["task_name"]) == (
        reserved["created_at"],
        "k",
        "t",
    )
    record = store.get(request.storage_key)
    assert record is not None
    assert (record.status, record.token) == (Status.COMPLETED, claim.token)
    assert record.created_at == int(reserved["created_at"]) / 1000


def test_a_ttl_of_ages_keeps_the_record_for_ages(client: redis.Redis) -> None:
    store = RedisStore(client, prefix="ages")
    request = _request(ttl_seconds=1e17)  # 3 billion years: more ms than a C long holds
    claim = store.claim(request)
    assert claim.outcome is Outcome.ACQUIRED
    assert store.complete(request, claim.token, RESULT) is CompleteOutcome.STORED
    record_name = store.names(request.storage_key)[0]
    assert client.pttl(record_name) > 10**15  # capped at 2^50 ms, some 35 000 years
    fields = _hash(client, record_name)
    for name in INTEGER_FIELDS:
        assert re.fullmatch(r"[0-9]+", fields[name]), (name, fields[name])
    record = store.get(request.storage_key)
    assert record is not None and record.status is Status.COMPLETED


@pytest.mark.parametrize(
    "made", ["from a URL", "from a result backend's parameters", "on a client of the caller's"]
)
def test_a_store_asked_for_text_replies_still_reads_its_cached_results(
    redis_url: str, made: str
) -> None:
    # Given a store built from a result backend URL that asks for text replies (Celery takes
    # ?decode_responses=true), or handed a client that decodes them
    url = f"{redis_url}/{CONTRACT_REDIS_DB}?decode_responses=true"
    if made == "from a URL":
        store = RedisStore.from_url(url, prefix="text")
    elif made == "from a result backend's parameters":
        params = redis.ConnectionPool.from_url(url).connection_kwargs
        store = RedisStore.from_connection_params(params, prefix="text")
    else:
        store = RedisStore(redis.Redis.from_url(url), prefix="text")
    request = _request(storage_key=f"text:{uuid.uuid4()}")
    claim = store.claim(request)
    assert store.complete(request, claim.token, RESULT) is CompleteOutcome.STORED
    # Then the key's value reads back, to the store's reads and to a duplicate's claim
    record = store.get(request.storage_key)
    assert record is not None and (record.result_cached, record.result) == (True, RESULT)
    duplicate = store.claim(dataclasses.replace(request, owner="owner-2"))
    assert duplicate.outcome is Outcome.COMPLETED
    assert duplicate.record is not None and duplicate.record.result == RESULT


@pytest.mark.parametrize("prefix", ["idempotency", "shop:eu", "{shop}", "a{b}c", "x{", "y}"])
def test_a_keys_names_share_one_cluster_slot_whatever_its_prefix(
    client: redis.Redis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    from redis.crc import key_slot

    store = RedisStore(client, prefix)
    for key in ("order-42", "{order}", "x}{y", "é"):
        slots = {key_slot(name.encode()) for name in store.names(f"t:{key}")}
        assert len(slots) == 1, (key, slots)
    assert "empty hash tag" not in caplog.text


def test_a_prefix_holding_an_empty_hash_tag_is_warned_of(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # "shop{}" has Redis Cluster hash whole names: a key's record, fencing counter and due
    # index fall in three slots (CROSSSLOT through a cluster proxy, every keyed task retried for
    # ever); one Redis server does not mind, so it is said, not refused
    prefix = f"shop-{uuid.uuid4().hex[:8]}{{}}"
    RedisStore(client, prefix)
    assert f"key prefix {prefix!r} holds an empty hash tag {{}}" in caplog.text
    # once a process (RQ builds a store for every job)
    caplog.clear()
    RedisStore(client, prefix)
    assert "empty hash tag" not in caplog.text
