"""One store contract, run against every store."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
import redis

from idempotent_tasks.records import ClaimRequest
from idempotent_tasks.stores import MemoryStore, Store
from idempotent_tasks.stores.redis import RedisStore

CONTRACT_REDIS_DB = 14
STORES = ["memory", "redis"]


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """Each store, empty."""
    if request.param == "memory":
        yield MemoryStore()
        return
    url = f"{request.getfixturevalue('redis_url')}/{CONTRACT_REDIS_DB}"
    redis.Redis.from_url(url).flushdb()
    redis_store = RedisStore.from_url(url, prefix="contract")
    yield redis_store
    redis_store.close()


@pytest.fixture()
def make_request() -> Callable[..., ClaimRequest]:
    """Build claim requests for one fresh key; keyword arguments override any field."""
    key = f"key-{uuid.uuid4().hex[:8]}"

    def build(**overrides: object) -> ClaimRequest:
        fields: dict[str, object] = {
            "storage_key": f"tasks.charge:{key}",
            "key": key,
            "task_name": "tasks.charge",
            "task_id": "task-1",
            "owner": uuid.uuid4().hex,
            "fingerprint": "fp-1",
            "lease_seconds": 30.0,
            "ttl_seconds": 60.0,
            **overrides,
        }
        return ClaimRequest(**fields)  # type: ignore[arg-type]

    return build
