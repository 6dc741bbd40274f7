"""A completion's side write (Celery's result record beside the claim): Redis makes it in the
same script only when the completion is stored; every other store refuses one."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis

from idempotent_tasks.codec import ResultCodec
from idempotent_tasks.core import Attempt
from idempotent_tasks.errors import SideWriteRefused
from idempotent_tasks.records import ClaimRequest, CompleteOutcome, EncodedResult, SideWrite
from idempotent_tasks.stores import MemoryStore, Store
from idempotent_tasks.stores.redis import RedisStore
from tests.contract.conftest import CONTRACT_REDIS_DB, open_store, store_url

Make = Callable[..., ClaimRequest]
RESULT = EncodedResult(content_type="application/json", content_encoding="utf-8", body=b"42")


@pytest.fixture()
def redis_store(request: pytest.FixtureRequest) -> Iterator[RedisStore]:
    store = open_store("redis", store_url("redis", request))
    assert isinstance(store, RedisStore)
    yield store
    store.close()


def side(name: str, ttl: float | None = 60.0) -> SideWrite:
    return SideWrite(
        key=f"celery-task-meta-{name}".encode(), value=b'{"status": "SUCCESS"}', ttl_seconds=ttl
    )


def test_a_stored_completion_writes_and_publishes_the_side_value(
    redis_store: RedisStore, make_request: Make
) -> None:
    request = make_request()
    token = redis_store.claim(request).token
    subscriber = redis_store.client.pubsub()
    subscriber.subscribe(b"celery-task-meta-a")
    assert subscriber.get_message(timeout=1)["type"] == "subscribe"  # type: ignore[index]

    outcome = redis_store.complete(request, token, RESULT, side("a"))

    assert outcome is CompleteOutcome.STORED
    assert redis_store.client.get(b"celery-task-meta-a") == b'{"status": "SUCCESS"}'
    assert 59_000 < redis_store.client.pttl(b"celery-task-meta-a") <= 60_000
    message = subscriber.get_message(timeout=2)
    assert message is not None and message["data"] == b'{"status": "SUCCESS"}'
    subscriber.close()
    record = redis_store.get(request.storage_key)
    assert record is not None and record.result == RESULT


def test_a_side_value_without_ttl_never_expires(
    redis_store: RedisStore, make_request: Make
) -> None:
    request = make_request()
    token = redis_store.claim(request).token
    redis_store.complete(request, token, RESULT, side("forever", ttl=None))
    assert redis_store.client.pttl(b"celery-task-meta-forever") == -1


def test_a_stale_completion_writes_no_side_value(
    redis_store: RedisStore, make_request: Make
) -> None:
    first = make_request(lease_seconds=0.2)
    stale_token = redis_store.claim(first).token
    time.sleep(0.3)
    second = make_request()
    assert redis_store.claim(second).takeover

    outcome = redis_store.complete(first, stale_token, RESULT, side("stale"))

    assert outcome is CompleteOutcome.STALE
    assert redis_store.client.exists(b"celery-task-meta-stale") == 0


def test_a_recovering_completion_leaves_the_side_value_to_the_framework(
    redis_store: RedisStore, make_request: Make
) -> None:
    # The framework then writes its own record, with its own checks (Celery never overwrites a
    # success): a completion that found no claim does not know what else happened meanwhile.
    request = make_request()
    token = redis_store.claim(request).token
    redis_store.forget(request.storage_key)

    outcome = redis_store.complete(request, token, RESULT, side("recovered"))

    assert outcome is CompleteOutcome.RECOVERED
    assert redis_store.client.exists(b"celery-task-meta-recovered") == 0


def test_a_repeated_completion_writes_the_side_value_again(
    redis_store: RedisStore, make_request: Make
) -> None:
    # A completion retried after a lost reply: the first one may or may not have written it.
    request = make_request()
    token = redis_store.claim(request).token
    redis_store.complete(request, token, RESULT)
    assert redis_store.complete(request, token, RESULT, side("again")) is CompleteOutcome.STORED
    assert redis_store.client.exists(b"celery-task-meta-again") == 1


@pytest.mark.parametrize("kind", ["memory", "sqlite", "postgresql", "mariadb"])
def test_other_stores_refuse_a_side_write_and_change_nothing(
    kind: str, request: pytest.FixtureRequest, make_request: Make
) -> None:
    store: Store = MemoryStore() if kind == "memory" else open_store(kind, store_url(kind, request))
    claim = make_request()
    token = store.claim(claim).token

    with pytest.raises(ValueError, match="cannot write beside a completion"):
        store.complete(claim, token, RESULT, side("other"))

    record = store.get(claim.storage_key)
    assert record is not None and record.status.value == "processing"
    store.close()


def test_shares_database_with_compares_server_and_database(
    redis_store: RedisStore, redis_url: str
) -> None:
    same = redis.Redis.from_url(f"{redis_url}/{CONTRACT_REDIS_DB}")
    other_db = redis.Redis.from_url(f"{redis_url}/{CONTRACT_REDIS_DB - 1}")
    other_port = redis.Redis.from_url(f"redis://127.0.0.1:6390/{CONTRACT_REDIS_DB}")
    assert redis_store.shares_database_with(same)
    assert not redis_store.shares_database_with(other_db)
    assert not redis_store.shares_database_with(other_port)


@pytest.fixture()
def restricted_store(request: pytest.FixtureRequest, redis_url: str) -> Iterator[RedisStore]:
    """The Redis store as an ACL user allowed its own keys only (no ``celery-task-meta-*``)."""
    url = store_url("redis", request)
    admin = redis.Redis.from_url(url)
    user = f"claims-only-{uuid.uuid4().hex[:8]}"
    admin.acl_setuser(user, enabled=True, nopass=True, categories=["+@all"], keys=["contract:*"])
    store = RedisStore(redis.Redis.from_url(url, username=user), prefix="contract")
    yield store
    store.close()
    admin.acl_deluser(user)
    admin.close()


def test_a_refused_side_write_is_reported(restricted_store: RedisStore, make_request: Make) -> None:
    request = make_request()
    token = restricted_store.claim(request).token
    with pytest.raises(SideWriteRefused, match="no permissions"):
        restricted_store.complete(request, token, RESULT, side("refused"))


def test_an_attempt_completes_without_a_refused_side_write(
    restricted_store: RedisStore, make_request: Make, redis_url: str
) -> None:
    request = make_request()
    codec = ResultCodec(serializer="json", max_bytes=1 << 20)
    attempt = Attempt(store=restricted_store, request=request, codec=codec)
    attempt.claim()

    outcome = attempt.complete({"cents": 42}, side("refused-again"))

    assert outcome is CompleteOutcome.STORED
    assert (attempt.side_written, attempt.side_write_refused) == (False, True)
    record = restricted_store.get(request.storage_key)
    assert record is not None and record.status.value == "completed"
    assert attempt.cached_value(record) == {"cents": 42}
    admin = redis.Redis.from_url(f"{redis_url}/{CONTRACT_REDIS_DB}")
    assert admin.exists(b"celery-task-meta-refused-again") == 0
    admin.close()
