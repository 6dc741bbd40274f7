"""Celery's result record written by the completion, when the store is the backend's Redis DB.

A Celery worker in this process (threads pool, so Celery's own backend write can be counted),
Redis result backend and the claim store on one database, as by default.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, states
from celery.backends.redis import RedisBackend
from celery.contrib.testing.worker import start_worker

from idempotent_tasks import IdempotentTask
from idempotent_tasks.app_store import store_for
from idempotent_tasks.celery_result import backend_shares_store, result_side_write
from idempotent_tasks.keys import storage_key
from idempotent_tasks.stores import MemoryStore
from idempotent_tasks.stores.redis import RedisStore
from tests.integration.helpers import app_store_url, wait_until

RESULT_DB = 12  # this module's own database (see tests/integration/conftest.py for the others)
OTHER_STORE_DB = 3  # a claim store apart from the backend: Celery writes its records itself
MAX_BYTES = 1 << 20

app = Celery("result_record", broker="memory://", set_as_current=False)
app.conf.update(
    idempotency_store_url=None,  # the default: the result backend's Redis database
    broker_transport_options={"polling_interval": 0.01},
    broker_connection_retry_on_startup=True,
)


@app.task(base=IdempotentTask, name="result_record.charge", shared=False)
def charge(order_id: int, delay: float = 0.0) -> dict[str, int]:
    time.sleep(delay)
    return {"order": order_id, "cents": order_id * 100}


@app.task(base=IdempotentTask, name="result_record.apart", shared=False)
def apart_charge(order_id: int) -> dict[str, int]:
    """Called only with the claim store in another database (test_a_store_apart_...)."""
    return {"order": order_id, "cents": order_id * 100}


@app.task(base=IdempotentTask, name="result_record.quiet", shared=False, ignore_result=True)
def quiet(order_id: int) -> int:
    return order_id


@app.task(name="result_record.receipt", shared=False)
def receipt(charged: dict[str, int]) -> str:
    return f"receipt {charged['order']}"


@pytest.fixture(scope="module")
def worker(redis_url: str) -> Iterator[redis.Redis]:
    url = f"{redis_url}/{RESULT_DB}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    app.conf.result_backend = url  # the claim store follows it: no idempotency_store_url
    with start_worker(
        app, pool="threads", concurrency=2, perform_ping_check=False, loglevel="WARNING"
    ):
        yield client
    client.flushdb()


@pytest.fixture()
def celery_writes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Task ids whose result Celery's Redis backend stored itself (every thread's backend)."""
    written: list[str] = []
    own_write = RedisBackend._store_result

    def counting(self: RedisBackend, task_id: str, *args: Any, **kwargs: Any) -> Any:
        written.append(task_id)
        return own_write(self, task_id, *args, **kwargs)

    monkeypatch.setattr(RedisBackend, "_store_result", counting)
    return written


def test_the_completion_writes_celerys_result_record(
    worker: redis.Redis, celery_writes: list[str]
) -> None:
    key = f"order-{uuid.uuid4().hex}"
    # Given a caller already waiting (over pub/sub) when the task completes
    result = charge.apply_async((7, 0.3), idempotency_key=key)
    assert result.get(timeout=10) == {"order": 7, "cents": 700}

    # Then Celery's backend did not write it: the completion did, as Celery would have
    assert result.id not in celery_writes
    meta = app.backend.decode_result(worker.get(app.backend.get_key_for_task(result.id)))
    assert meta["status"] == states.SUCCESS
    assert meta["result"] == {"order": 7, "cents": 700}
    assert meta["task_id"] == result.id
    assert meta["date_done"] and meta["traceback"] is None and meta["children"] == []
    assert 0 < worker.ttl(app.backend.get_key_for_task(result.id)) <= app.backend.expires
    # And a later publish of the key answers from the cache with the original task id
    again = charge.apply_async((7, 0.3), idempotency_key=key)
    assert (again.id, again.get(timeout=5)) == (result.id, {"order": 7, "cents": 700})


def test_a_task_with_callbacks_keeps_celerys_own_write(
    worker: redis.Redis, celery_writes: list[str]
) -> None:
    # Celery dispatches callbacks before it stores the result, so the record lists them.
    result = charge.apply_async((8,), idempotency_key=uuid.uuid4().hex, link=receipt.s())
    assert result.get(timeout=10) == {"order": 8, "cents": 800}
    assert celery_writes.count(result.id) == 1
    children = result.children
    assert children and children[0].get(timeout=10) == "receipt 8"


def test_a_store_apart_from_the_backend_keeps_celerys_own_write(
    worker: redis.Redis, celery_writes: list[str], redis_url: str
) -> None:
    # The worker's threads share this process's app, so its store moves for them too.
    other = f"{redis_url}/{OTHER_STORE_DB}"
    redis.Redis.from_url(other).flushdb()
    key = uuid.uuid4().hex
    with app_store_url(app, other):
        result = apart_charge.apply_async((6,), idempotency_key=key)
        assert result.get(timeout=10) == {"order": 6, "cents": 600}
        assert celery_writes.count(result.id) == 1
        assert redis.Redis.from_url(other).keys("idempotent_tasks:*")  # the claim went there
        again = apart_charge.apply_async((6,), idempotency_key=key)
        assert (again.id, again.get(timeout=5)) == (result.id, {"order": 6, "cents": 600})
    redis.Redis.from_url(other).flushdb()


def test_an_ignored_result_is_written_by_nobody(
    worker: redis.Redis, celery_writes: list[str]
) -> None:
    key = uuid.uuid4().hex
    result = quiet.apply_async((9,), idempotency_key=key)
    store = store_for(app)
    assert isinstance(store, RedisStore)
    record_key = store.names(storage_key(quiet.name, key))[0]
    wait_until(lambda: worker.hget(record_key, "status") == b"completed", 10, "the completion")
    assert worker.exists(app.backend.get_key_for_task(result.id)) == 0
    assert result.id not in celery_writes


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"result_extended": True},
        {"result_compression": "zlib"},
        {"result_backend_transport_options": {"global_keyprefix": "tenant-7"}},
    ],
    ids=["default", "extended", "compressed", "keyprefix"],
)
def test_the_record_is_the_one_celery_writes(worker: redis.Redis, settings: dict[str, Any]) -> None:
    # Built by the backend's own methods: the same bytes as its own write, but for the time.
    config = Celery("same_record", set_as_current=False)
    config.conf.update(result_backend=app.conf.result_backend, **settings)
    backend = config.backend
    request = _request(args=(5,), kwargs={"delay": 0.0})
    side = result_side_write(backend, request, {"order": 5}, MAX_BYTES)
    assert side is not None
    backend.store_result(request.id, {"order": 5}, states.SUCCESS, request=request)
    key = backend.get_key_for_task(request.id)
    assert side.key == key
    ours, celerys = backend.decode_result(side.value), backend.decode_result(worker.get(key))
    assert ours.pop("date_done") and celerys.pop("date_done")
    assert ours == celerys
    assert ("args" in ours) is bool(settings.get("result_extended"))
    assert side.ttl_seconds == backend.expires


def test_a_record_over_the_cached_results_limit_is_left_to_celery(worker: redis.Redis) -> None:
    request = _request(args=(), kwargs={})
    assert result_side_write(app.backend, request, "x" * 2000, max_bytes=1000) is None
    assert result_side_write(app.backend, request, "x" * 200, max_bytes=1000) is not None


@pytest.mark.parametrize("field", ["is_eager", "callbacks", "chain", "chord", "delivery_info"])
def test_requests_celery_must_store_itself_get_no_record(worker: redis.Redis, field: str) -> None:
    values = {"is_eager": True, "delivery_info": {"redelivered": True}}
    request = _request(args=(1,), kwargs={}, **{field: values.get(field, [{"task": "x"}])})
    assert result_side_write(app.backend, request, {"order": 1}, MAX_BYTES) is None
    assert result_side_write(app.backend, _request(args=(1,), kwargs={}), 1, MAX_BYTES)


def test_a_value_the_backend_cannot_encode_gets_no_record(worker: redis.Redis) -> None:
    # Celery's own write then fails the task with its usual EncodeError.
    assert result_side_write(app.backend, _request(args=(), kwargs={}), object(), MAX_BYTES) is None


def test_only_the_plain_redis_backend_on_the_stores_database_shares_it(
    worker: redis.Redis, redis_url: str
) -> None:
    same = RedisStore.from_url(f"{redis_url}/{RESULT_DB}", prefix="t")
    other = RedisStore.from_url(f"{redis_url}/{RESULT_DB + 2}", prefix="t")
    assert backend_shares_store(app.backend, same)
    assert not backend_shares_store(app.backend, other)
    assert not backend_shares_store(app.backend, MemoryStore())
    in_memory = Celery("elsewhere", backend="cache+memory://", set_as_current=False)
    assert not backend_shares_store(in_memory.backend, same)


@pytest.mark.parametrize(
    ("backend_url", "store_url", "shared"),
    [
        ("redis://127.0.0.1", "redis://127.0.0.1:6379/0", True),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1", True),
        ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379/1", False),
        ("redis://127.0.0.1:6379/0", "redis://other@127.0.0.1:6379/0", False),
        ("redis://:one@127.0.0.1:6379/0", "redis://:two@127.0.0.1:6379/0", False),
        ("rediss://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0", False),
    ],
)
def test_urls_naming_one_database_share_it(backend_url: str, store_url: str, shared: bool) -> None:
    # Nothing connects: Celery and redis-py spell the defaults (port 6379, db 0) differently.
    backend_app = Celery("urls", backend=backend_url, set_as_current=False)
    if backend_url.startswith("rediss"):
        backend_app.conf.redis_backend_use_ssl = {"ssl_cert_reqs": "none"}
    store = RedisStore.from_url(store_url, prefix="t")
    assert backend_shares_store(backend_app.backend, store) is shared


def _request(**fields: Any) -> Any:
    from celery.app.task import Context

    base = {"id": uuid.uuid4().hex, "task": "result_record.charge", "hostname": "w@h"}
    return Context({**base, "delivery_info": {}, **fields})
