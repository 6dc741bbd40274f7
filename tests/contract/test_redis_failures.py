"""The Redis store under bad conditions: unreachable, corrupt records, scripts flushed."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from idempotent_tasks.errors import CorruptRecord, StoreUnavailable
from idempotent_tasks.records import (
    ClaimRequest,
    CompleteOutcome,
    Outcome,
    Pickup,
    SideWrite,
    Status,
)
from idempotent_tasks.stores.redis import _KEPT_ATTRIBUTE, RedisStore
from tests.claim_requests import claim_request
from tests.contract.conftest import CONTRACT_REDIS_DB
from tests.contract.test_store_owed_messages import RESULT, owing_claim
from tests.integration.redis_server import RedisServer, free_port
from tests.services import answers


def _request(key: str) -> ClaimRequest:
    return claim_request(key=key, storage_key=key, task_id="x")


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


@pytest.mark.parametrize(
    ("left", "takeover"),
    [
        ({"status": "queued"}, False),
        ({"status": "processing", "owner": "dead", "token": "1", "lease_expires_at": "0"}, True),
        ({"status": "processing", "owner": "dead", "token": "1"}, True),
    ],
    ids=["queued", "processing-with-expired-lease", "processing-without-lease"],
)
def test_a_claim_of_a_record_missing_fields_leaves_it_whole(
    url: str, left: dict[str, str], takeover: bool
) -> None:
    # Given a record that lost its creation time, key and task name (and perhaps its lease)
    store = RedisStore.from_url(url, prefix="corrupt-names")
    request = _request("k")
    record_name = store.names("k")[0]
    redis.Redis.from_url(url).hset(
        record_name, mapping={**left, "fingerprint": request.fingerprint}
    )
    # When a worker claims it and completes
    claim = store.claim(request)
    assert (claim.outcome, claim.takeover) == (Outcome.ACQUIRED, takeover)
    assert store.complete(request, claim.token, None) is CompleteOutcome.STORED
    # Then the record reads back whole, with the claim's names
    record = store.get("k")
    assert record is not None
    assert (record.status, record.key, record.task_name) == (
        Status.COMPLETED,
        request.key,
        request.task_name,
    )
    assert record.created_at > 0


def test_an_owner_claiming_its_own_record_with_an_unreadable_token_gets_a_new_one(
    url: str,
) -> None:
    # Given a record this very owner holds whose token was damaged
    store = RedisStore.from_url(url, prefix="corrupt-token")
    request = _request("k")
    first = store.claim(request)
    assert first.outcome is Outcome.ACQUIRED
    redis.Redis.from_url(url).hset(store.names("k")[0], "token", "oops")
    # When the owner claims again (its message delivered twice), then it holds a new token
    # (not a reply the store cannot read) with which it completes
    again = store.claim(request)
    assert again.outcome is Outcome.ACQUIRED and again.token > first.token
    assert store.complete(request, again.token, None) is CompleteOutcome.STORED


@pytest.mark.parametrize("field", ["task_id", "task_name"])
def test_a_pickup_without_its_task_id_or_name_leaves_the_sweep_to_the_others(
    url: str, field: str
) -> None:
    # Given a queued key past its due time that lost its task id or name, and another one
    store = RedisStore.from_url(url, prefix="corrupt-names-pickup")
    for key in ("k", "after"):
        assert store.reserve(_request(key), Pickup(envelope=b"m", due_in=0.01, timeout=30)) is None
    redis.Redis.from_url(url).hdel(store.names("k")[0], field)
    time.sleep(0.05)
    # When the sweep takes the due keys, then it takes the other one (no error stops it)
    assert [due.storage_key for due in store.take_due(10)] == ["after"]


@pytest.mark.parametrize("field", ["task_id", "task_name"])
def test_a_pickup_whose_task_id_or_name_is_not_text_leaves_the_sweep_to_the_others(
    url: str, field: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a queued key past its due time whose task id or name holds bytes that are not
    # UTF-8 (written by something else), and another one
    store = RedisStore.from_url(url, prefix="not-utf8-pickup")
    for key in ("k", "after"):
        assert store.reserve(_request(key), Pickup(envelope=b"m", due_in=0.01, timeout=30)) is None
    redis.Redis.from_url(url).hset(store.names("k")[0], field, b"\xff\xfe")
    time.sleep(0.05)
    # When the sweep takes the due keys, then it takes the other one (no error stops it)
    assert [due.storage_key for due in store.take_due(10)] == ["after"]
    # and says why it left the unreadable key
    assert "skipping key 'k' in the sweep: the store holds bytes that are not UTF-8" in caplog.text


def test_a_due_index_member_that_is_not_text_is_dropped_and_the_sweep_takes_the_others(
    url: str,
) -> None:
    # Given a queued key past its due time, and a member of its shard's due index that is not
    # UTF-8 (written by something else)
    store = RedisStore.from_url(url, prefix="not-utf8-member")
    assert store.reserve(_request("k"), Pickup(envelope=b"m", due_in=0.01, timeout=30)) is None
    index = store.names("k")[2]
    client = redis.Redis.from_url(url)
    client.zadd(index, {b"\xff\xfe": 0})
    time.sleep(0.05)
    # When the sweep takes the due keys, then it takes the key, and drops the member
    assert [due.storage_key for due in store.take_due(10)] == ["k"]
    assert client.zscore(index, b"\xff\xfe") is None


@pytest.mark.parametrize("field", ["pickup_timeout", "republished", "due_at", "lease_expires_at"])
@pytest.mark.parametrize("value", ["oops", "nan", "-1e300", "1e300"])
def test_a_pickup_whose_numbers_cannot_be_read_is_taken_not_lost(
    url: str, field: str, value: str
) -> None:
    # Given a queued key past its due time whose pickup has one unreadable number, and a key
    # queued after it in the same sweep
    store = RedisStore.from_url(url, prefix="corrupt-pickup")
    for key in ("k", "after"):
        assert store.reserve(_request(key), Pickup(envelope=b"m", due_in=0.01, timeout=30)) is None
    redis.Redis.from_url(url).hset(store.names("k")[0], field, value)
    time.sleep(0.05)
    # When the sweep takes the due keys
    taken = {due.storage_key: due for due in store.take_due(10)}
    # Then both are handed out once (no script error stops the sweep), and the key is due
    # again later, on a readable backoff
    assert set(taken) == {"k", "after"}
    assert taken["k"].envelope == b"m"
    assert taken["k"].republished == 1
    assert store.take("k") is None
    fields = redis.Redis.from_url(url, decode_responses=True).hgetall(store.names("k")[0])
    for name in ("pickup_timeout", "republished", "due_at"):
        assert fields[name].isdigit(), (name, fields[name])
    record = store.get("k")
    assert record is not None and record.status is Status.QUEUED


def test_a_sweep_leaves_a_key_that_holds_no_record_and_takes_the_others(url: str) -> None:
    # Given two queued keys past their due time, one of whose records was overwritten with a
    # string (a name reused by another program)
    store = RedisStore.from_url(url, prefix="not-a-record")
    for key in ("k", "other"):
        assert store.reserve(_request(key), Pickup(envelope=b"m", due_in=0.01, timeout=30)) is None
    client = redis.Redis.from_url(url)
    client.set(store.names("k")[0], "not a hash")
    time.sleep(0.05)
    # When the sweep takes the due keys, then it takes the other one, and drops the string's
    # name from the due index (it has no message to guard) without touching the string
    assert [due.storage_key for due in store.take_due(10)] == ["other"]
    assert store.take_due(10) == []
    assert client.zscore(store.names("k")[2], "k") is None
    assert client.get(store.names("k")[0]) == b"not a hash"


@pytest.fixture()
def replica(tmp_path: Path) -> Iterator[str]:
    """The URL of a read-only Redis replica (as during a failover), on servers of its own."""
    servers = [RedisServer(tmp_path, persistent=False) for _ in range(2)]
    redis.Redis.from_url(servers[1].url).replicaof("127.0.0.1", servers[0].port)
    yield servers[1].url
    for server in servers:
        server.stop()


def test_a_read_only_replica_is_an_unavailable_store(replica: str) -> None:
    # Given a store on a Redis that refuses writes for now (a failover under way)
    store = RedisStore.from_url(replica, prefix="replica")
    request = _request("k")
    side = SideWrite(key=b"celery-task-meta-x", value=b"{}", ttl_seconds=None)
    # Then every writing operation says the store is unavailable (callers fail closed and try
    # again later), none raises Redis's own error, and a completion is not taken for a refused
    # side write (that would turn the single write off for good)
    for operation in (
        lambda: store.claim(request),
        lambda: store.reserve(request, Pickup(envelope=b"m", due_in=1, timeout=1)),
        lambda: store.complete(request, 1, None),
        lambda: store.complete(request, 1, None, side),
    ):
        with pytest.raises(StoreUnavailable, match="refuses"):
            operation()
    store.close()


def test_a_read_only_reply_drops_the_connection_kept_for_scripts(replica: str) -> None:
    # Given a store whose server turned replica (its master demoted by a failover: the name it
    # connects by may point elsewhere by now)
    store = RedisStore.from_url(replica, prefix="replica")
    with pytest.raises(StoreUnavailable, match="refuses"):
        store.claim(_request("k"))
    # Then the connection kept for its scripts is dropped: the next script connects anew
    kept = getattr(store.client.connection_pool, _KEPT_ATTRIBUTE)
    assert kept.connection is None
    store.close()


def test_a_cluster_node_that_serves_no_slot_is_an_unavailable_store(tmp_path: Path) -> None:
    # Given a store on a Redis Cluster node that serves none of the slots (CLUSTERDOWN, as
    # while a cluster reshapes or fails over)
    node = RedisServer(
        tmp_path,
        persistent=False,
        options=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
    )
    store = RedisStore.from_url(node.url, prefix="cluster")
    request = _request("k")
    try:
        # Then its operations say the store is unavailable for now (the call is tried again
        # later), not that the key's record is corrupt (which dead-letters the call)
        for operation in (
            lambda: store.claim(request),
            lambda: store.reserve(request, Pickup(envelope=b"m", due_in=1, timeout=1)),
            lambda: store.complete(request, 1, None),
        ):
            with pytest.raises(StoreUnavailable, match="refuses"):
                operation()
    finally:
        store.close()
        node.stop()


def test_a_cluster_node_asked_for_a_key_another_node_serves_is_an_unavailable_store(
    tmp_path: Path,
) -> None:
    # Given a Redis Cluster of two nodes, each serving half of the slots, and a store whose
    # URL names the first (a plain client: it is not sent on to the other node)
    nodes, buses = [], []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        # The cluster bus on a port of its own (by default the node's own + 10000: over 65535
        # for the high ports free_port picks)
        buses.append(free_port())
        options = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
        options += ("--cluster-port", str(buses[-1]))
        nodes.append(RedisServer(tmp_path / name, persistent=False, options=options))
    first, second = (redis.Redis.from_url(node.url) for node in nodes)
    store = RedisStore.from_url(nodes[0].url, prefix="cluster")
    try:
        first.execute_command("CLUSTER ADDSLOTSRANGE", 0, 8191)
        second.execute_command("CLUSTER ADDSLOTSRANGE", 8192, 16383)
        first.execute_command("CLUSTER MEET", "127.0.0.1", nodes[1].port, buses[1])
        deadline = time.monotonic() + 20
        while not _cluster_ok(first):
            assert time.monotonic() < deadline, "the two nodes never formed a cluster"
            time.sleep(0.1)
        # When a key whose slot the second node serves is used through the first
        key = next(
            key
            for key in (f"k{index}" for index in range(1000))
            if key_slot(store.names(key)[0].encode()) >= 8192
        )
        # Then the store is unavailable for now (the call is tried again later, and the log
        # says why), not the key's record corrupt (which would dead-letter the call)
        for operation in (
            lambda: store.claim(_request(key)),
            lambda: store.reserve(_request(key), Pickup(envelope=b"m", due_in=1, timeout=1)),
        ):
            with pytest.raises(StoreUnavailable, match="cluster"):
                operation()
    finally:
        store.close()
        for client in (first, second):
            client.close()
        for node in nodes:
            node.stop()


def _cluster_ok(client: redis.Redis) -> bool:
    info = client.execute_command("CLUSTER INFO")  # parsed into a dict, or left as text
    if isinstance(info, dict):
        return info.get("cluster_state") in ("ok", b"ok")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text


def test_a_user_the_acl_forbids_scripts_is_an_unavailable_store(url: str) -> None:
    admin = redis.Redis.from_url(url)
    user = f"no-scripts-{uuid.uuid4().hex[:8]}"
    admin.acl_setuser(user, enabled=True, nopass=True, categories=["+@read"], keys=["*"])
    store = RedisStore(redis.Redis.from_url(url, username=user), prefix="acl")
    try:
        with pytest.raises(StoreUnavailable, match="refuses"):
            store.claim(_request("k"))
    finally:
        store.close()
        admin.acl_deluser(user)


@pytest.mark.parametrize(
    "pool",
    ["its own", "a result backend's capped at one connection", "its own capped at one connection"],
)
def test_scripts_are_reloaded_after_a_script_flush(url: str, pool: str) -> None:
    # A restarted Redis has forgotten every script: EVALSHA answers NOSCRIPT and must reload
    # (also where the result backend caps its pool at one connection, redis_max_connections,
    # which the store's pool does not take on; and where the store's own URL caps it: the
    # script is reloaded on the connection kept for scripts, the only one)
    if pool == "its own":
        store = RedisStore.from_url(url, prefix="noscript")
    elif pool == "its own capped at one connection":
        store = RedisStore.from_url(f"{url}?max_connections=1", prefix="noscript")
    else:
        params = {**redis.ConnectionPool.from_url(url).connection_kwargs, "max_connections": 1}
        store = RedisStore.from_connection_params(params, prefix="noscript")
    try:
        assert store.claim(_request("a")).outcome is Outcome.ACQUIRED
        redis.Redis.from_url(url).script_flush()
        assert store.claim(_request("b")).outcome is Outcome.ACQUIRED
        if pool != "its own capped at one connection":
            # the sweep's look, on another connection of the pool
            assert store.take_due(10) == []
    finally:
        store.close()


def test_a_keys_record_and_fence_share_one_cluster_slot(url: str) -> None:
    store = RedisStore.from_url(url, prefix="slots")
    slots = set()
    for storage_key in ("tasks.charge:order-42", "tasks.charge:order-43", "sha256:" + "ab" * 32):
        record, fence, _ = store.names(storage_key)
        assert key_slot(record.encode()) == key_slot(fence.encode())
        slots.add(key_slot(record.encode()))
    assert len(slots) == 3  # different keys still spread over the cluster


def _used_store(url: str, prefix: str) -> tuple[RedisStore, type]:
    """A store that has run a script, and the class of its connections (to patch)."""
    store = RedisStore.from_url(url, prefix=prefix)
    assert store.claim(_request("warm")).outcome is Outcome.ACQUIRED
    pool = store.client.connection_pool
    return store, type(pool.get_connection())


class _Interrupted(BaseException):
    """Stands for what can cut a round trip short: a soft time limit, a signal handler."""


def test_a_round_trip_cut_short_leaves_no_reply_for_the_next_command(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a claim whose reply is never read (the script did run in Redis)
    store, connection_class = _used_store(url, prefix="cut")

    def interrupted(self: object, *args: object, **kwargs: object) -> object:
        raise _Interrupted()

    monkeypatch.setattr(connection_class, "read_response", interrupted)
    with pytest.raises(_Interrupted):
        store.claim(_request("k"))
    monkeypatch.undo()
    # When another owner claims the same key, it reads its own reply, not the unread one
    # (which said "acquired")
    assert store.claim(_request("k")).outcome is Outcome.IN_PROGRESS


def _lose_next_reply(monkeypatch: pytest.MonkeyPatch, connection_class: type) -> None:
    """The next reply read is lost after Redis ran the command (a read that timed out, as
    on a slow network): redis-py reconnects and sends the command again."""
    real_read = connection_class.read_response
    lost = [False]

    def read_once_lost(self: object, *args: object, **kwargs: object) -> object:
        reply = real_read(self, *args, **kwargs)
        if not lost[0]:
            lost[0] = True
            raise redis.TimeoutError("Timeout reading from socket")
        return reply

    monkeypatch.setattr(connection_class, "read_response", read_once_lost)


def test_a_settlement_whose_reply_was_lost_still_settles_the_debt(
    url: str, make_request: Callable[..., ClaimRequest], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a completed claim owing another call's lost message
    store, connection_class = _used_store(url, prefix="settle-lost")
    taker, token = owing_claim(store, make_request)
    assert store.complete(taker, token, RESULT, owes_message=True) is CompleteOutcome.STORED
    # When its settlement runs, but its reply is lost and redis-py sends it again
    _lose_next_reply(monkeypatch, connection_class)
    settled = store.settle_owed_message(taker)
    monkeypatch.undo()
    # Then the second run answers as the first did: the message is owed, and goes out
    assert settled is True
    # and it is settled once all the same
    assert store.settle_owed_message(taker) is False


def test_a_take_whose_reply_was_lost_still_hands_the_message_out(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a queued key past its due time
    store, connection_class = _used_store(url, prefix="take-lost")
    assert store.reserve(_request("k"), Pickup(envelope=b"m", due_in=0.01, timeout=30)) is None
    time.sleep(0.05)
    # When the sweep takes it, but the reply is lost and redis-py sends the script again
    _lose_next_reply(monkeypatch, connection_class)
    taken = store.take("k")
    monkeypatch.undo()
    # Then the second run hands out the message the first one took (its due time moved on
    # once), not nothing
    assert taken is not None
    assert (taken.task_id, taken.envelope, taken.republished) == ("x", b"m", 1)
    # and another take finds it not due
    assert store.take("k") is None


def test_scripts_run_again_after_redis_dropped_the_connection(url: str) -> None:
    store = RedisStore.from_url(url, prefix="dropped")
    assert store.claim(_request("a")).outcome is Outcome.ACQUIRED
    killer = redis.Redis.from_url(url)
    assert killer.client_kill_filter(_type="normal", skipme=True) >= 1
    assert store.claim(_request("b")).outcome is Outcome.ACQUIRED
    killer.close()


def test_a_forked_child_runs_scripts_on_its_own_connection(url: str) -> None:
    # Given a store whose connection the parent has used, and keys the parent holds
    store = RedisStore.from_url(url, prefix="fork")
    held = [f"held-{i}" for i in range(1000)]
    fresh = [f"fresh-{i}" for i in range(1000)]
    assert all(store.claim(_request(key)).outcome is Outcome.ACQUIRED for key in held)

    def all_answered(keys: list[str], outcome: Outcome) -> bool:
        return all(store.claim(_request(key)).outcome is outcome for key in keys)

    # When parent and child claim at the same time, each with its own answer to expect (on a
    # shared socket, either could read the other's reply)
    start_reading, start_writing = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports through its exit status only
        ok = False
        try:
            os.read(start_reading, 1)
            ok = all_answered(fresh, Outcome.ACQUIRED)
        finally:
            os._exit(0 if ok else 1)
    os.write(start_writing, b"go")
    parent_ok = all_answered(held, Outcome.IN_PROGRESS)
    _, status = os.waitpid(pid, 0)
    # Then each read its own replies
    assert parent_ok
    assert os.waitstatus_to_exitcode(status) == 0


def _connections_named(url: str, name: str) -> int:
    admin = redis.Redis.from_url(url)
    try:
        return sum(1 for client in admin.client_list() if client.get("name") == name)
    finally:
        admin.close()


def test_stores_sharing_a_client_keep_one_connection_between_them(url: str) -> None:
    # Given one client, as RQ's connection is, and a store built on it per job
    client = redis.Redis.from_url(url, client_name="kept-once")
    for job in range(50):
        store = RedisStore(client, prefix="jobs")
        assert store.claim(_request(f"job-{job}")).outcome is Outcome.ACQUIRED
    # Then the scripts of all of them ran on one connection, still the only one open
    assert _connections_named(url, "kept-once") == 1
    assert len(client.connection_pool._in_use_connections) == 1
    store.close()
    assert _connections_named(url, "kept-once") == 0


def test_closing_a_store_that_ran_no_script_leaves_its_pool_as_it_was(url: str) -> None:
    client = redis.Redis.from_url(url)
    RedisStore(client, prefix="idle").close()
    assert not hasattr(client.connection_pool, _KEPT_ATTRIBUTE)


class _CountingPool(redis.ConnectionPool):
    """A real pool that counts check-outs (where a Sentinel pool looks the master up)."""

    checkouts = 0

    def get_connection(self, *args: object, **kwargs: object) -> object:
        type(self).checkouts += 1
        return super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]


def test_a_connection_that_failed_goes_back_to_the_pool_and_a_fresh_one_is_checked_out(
    url: str,
) -> None:
    # (with retries on connection errors, as RedisStore.from_url sets them)
    pool = _CountingPool.from_url(
        url, retry=Retry(NoBackoff(), retries=2), retry_on_error=[redis.ConnectionError]
    )
    store = RedisStore(redis.Redis(connection_pool=pool), prefix="failover")
    assert store.claim(_request("a")).outcome is Outcome.ACQUIRED
    assert _CountingPool.checkouts == 1
    killer = redis.Redis.from_url(url)
    killer.client_kill_filter(_type="normal", skipme=True)
    killer.close()
    assert store.claim(_request("b")).outcome is Outcome.ACQUIRED
    assert _CountingPool.checkouts == 2  # not the dead connection dialled again
    assert store.claim(_request("c")).outcome is Outcome.ACQUIRED
    assert _CountingPool.checkouts == 2  # and kept from then on
    store.close()


def test_a_thread_does_not_wait_for_another_threads_script(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a thread stuck in a script on the kept connection (a slow network, say)
    store, connection_class = _used_store(url, prefix="threads")
    entered, leave = threading.Event(), threading.Event()
    real_read = connection_class.read_response

    def slow_read(self: object, *args: object, **kwargs: object) -> object:
        if threading.current_thread().name == "stuck":
            entered.set()
            leave.wait(60)
        return real_read(self, *args, **kwargs)  # type: ignore[no-untyped-call]

    monkeypatch.setattr(connection_class, "read_response", slow_read)
    stuck = threading.Thread(target=store.claim, args=(_request("slow"),), name="stuck")
    stuck.start()
    assert entered.wait(5)
    # When another thread runs a script, it goes through the client meanwhile: it is answered
    # while the first thread is still held in its read
    assert store.claim(_request("other")).outcome is Outcome.ACQUIRED
    assert stuck.is_alive() and not leave.is_set()
    leave.set()
    stuck.join(10)
    assert store.get("slow") is not None


def test_a_finished_body_whose_record_turned_unreadable_keeps_its_value(url: str) -> None:
    from idempotent_tasks.codec import ResultCodec
    from idempotent_tasks.core import Attempt

    store = RedisStore.from_url(url, prefix="corrupt")
    attempt = Attempt(
        store=store, request=_request("k"), codec=ResultCodec(serializer="json", max_bytes=1024)
    )
    assert attempt.claim().outcome is Outcome.ACQUIRED
    redis.Redis.from_url(url).set(store.names("k")[0], "not a hash")
    # The body ran: its caller gets its value, not an error that would fail the task
    assert attempt.finish({"charged": 5}, patience_seconds=1) == {"charged": 5}


def test_a_completion_tries_an_unreachable_store_again_every_half_second_at_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from idempotent_tasks import core
    from idempotent_tasks.codec import ResultCodec

    # Given a body that finished while its store is unreachable (on a clock of our own)
    now, pauses = [0.0], []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        now[0] += seconds

    monkeypatch.setattr(core, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=sleep))
    store = RedisStore.from_url("redis://127.0.0.1:1/0", prefix="down")
    attempt = core.Attempt(
        store=store,
        request=_request("k"),
        codec=ResultCodec(serializer="json", max_bytes=1024),
        token=1,
    )
    # Then it tries again and again for as long as its patience lasts, and its caller gets
    # its value; never pausing long, so a store back in time gets the completion at once
    assert attempt.finish("value", patience_seconds=3) == "value"
    assert max(pauses) <= core.MAX_COMPLETE_PAUSE == 0.5
    assert sum(pauses) > 2.4
