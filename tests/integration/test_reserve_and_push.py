"""A keyed call's reservation and its message's push in one Redis round trip (broker, result
backend and store on one Redis server), with real Redis and real prefork workers."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult, EagerResult
from kombu import Exchange
from kombu.exceptions import OperationalError

from idempotent_tasks import IdempotentTask, reserve_and_push
from idempotent_tasks.app_store import store_for
from idempotent_tasks.errors import StoreUnavailable
from idempotent_tasks.keys import storage_key
from idempotent_tasks.publishing import RESERVED_HEADER
from idempotent_tasks.records import Outcome, Record, Status
from tests.integration import worker_app
from tests.integration.conftest import BACKEND_DB, BROKER_DB
from tests.integration.helpers import (
    IDLE_QUEUE,
    charge_at_once,
    fresh,
    ledger_events,
    queue_length,
)


@pytest.fixture()
def every_process_new(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every publish as from a process that never published its key (so none takes the
    two-trip way a key sent again by the same process takes)."""
    monkeypatch.setattr(reserve_and_push, "_recent", reserve_and_push._RecentKeys(0))


class _Reserves:
    """Every reservation an app's store makes: whether with its message's push."""

    def __init__(self, app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
        self.with_push: list[bool] = []
        store = store_for(app)
        reserve = store.reserve

        def counted(request: Any, pickup: Any, push: Any = None) -> Any:
            self.with_push.append(push is not None)
            return reserve(request, pickup, push)

        monkeypatch.setattr(store, "reserve", counted)


def _app(redis_url: str, **transport_options: Any) -> Celery:
    app = Celery("one-trip", broker=f"{redis_url}/{BROKER_DB}", backend=f"{redis_url}/{BACKEND_DB}")
    app.conf.broker_transport_options = transport_options
    return app


@pytest.fixture()
def one_trip_app(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Celery, Any, _Reserves]]:
    """A new app on the integration databases, its task, and its store's reservations."""
    app = _app(redis_url)

    @app.task(base=IdempotentTask, name=fresh("one_trip.add"))
    def add(x: int, y: int) -> int:
        return x + y

    yield app, add, _Reserves(app, monkeypatch)
    monkeypatch.undo()
    store_for(app).close()


def _queued(queue: str, prefix: str = "") -> list[dict[str, Any]]:
    broker = redis.Redis.from_url(worker_app.app.conf.broker_url)
    return [json.loads(raw) for raw in broker.lrange(prefix + queue, 0, -1)]


def _queued_record(app: Celery, task: Any, key: str) -> Record:
    """The record of ``task``'s ``key``, which must be queued."""
    record = store_for(app).get(storage_key(task.name, key))
    assert record is not None and record.status is Status.QUEUED
    return record


def test_a_keyed_call_is_reserved_and_pushed_in_the_same_step(
    one_trip_app: tuple[Celery, Any, _Reserves], every_process_new: None
) -> None:
    app, add, reserves = one_trip_app
    queue, key = fresh("queue"), fresh("key")
    result = add.apply_async((1, 2), idempotency_key=key, queue=queue)
    # One reservation, which pushed the message; kombu pushed none of its own
    assert reserves.with_push == [True]
    [message] = _queued(queue)
    assert message["headers"]["id"] == result.id
    assert message["headers"][RESERVED_HEADER] is True
    assert _queued_record(app, add, key).task_id == result.id


def test_with_rpc_results_a_keyed_call_is_pushed_once(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, every_process_new: None
) -> None:
    # rpc:// hands a result to its own caller alone: a call answered from another's record is
    # published all the same, which must not make a call pushed by its reservation go twice
    app = Celery("one-trip-rpc", broker=f"{redis_url}/{BROKER_DB}", backend="rpc://")
    app.conf.idempotency_store_url = f"{redis_url}/{BACKEND_DB}"

    @app.task(base=IdempotentTask, name=fresh("one_trip.rpc_add"))
    def add(x: int, y: int) -> int:
        return x + y

    reserves = _Reserves(app, monkeypatch)
    queue, key = fresh("queue"), fresh("key")
    try:
        result = add.apply_async((1, 2), idempotency_key=key, queue=queue)
        assert reserves.with_push == [True]
        [message] = _queued(queue)
        assert message["headers"]["id"] == result.id
    finally:
        monkeypatch.undo()
        store_for(app).close()


def test_a_key_found_pushes_nothing_and_answers_with_its_owner(
    one_trip_app: tuple[Celery, Any, _Reserves], every_process_new: None
) -> None:
    _, add, reserves = one_trip_app
    queue, key = fresh("queue"), fresh("key")
    first = add.apply_async((1, 2), idempotency_key=key, queue=queue)
    again = add.apply_async((1, 2), idempotency_key=key, queue=queue)
    assert isinstance(again, AsyncResult) and again.id == first.id
    assert reserves.with_push == [True, True]
    assert len(_queued(queue)) == 1


def test_a_dead_owners_key_is_taken_over_with_one_look_at_its_record(
    one_trip_app: tuple[Celery, Any, _Reserves], every_process_new: None
) -> None:
    app, add, reserves = one_trip_app
    # Given a key whose owner died (its 0.2 s lease has ended), its message not counted as lost
    queue, key = fresh("queue"), fresh("key")
    owner = dataclasses.replace(
        add._claim_request(key, (1, 2), {}, fresh("dead-task"), owner="dead-owner"),
        lease_seconds=0.2,
    )
    assert store_for(app).claim(owner).outcome is Outcome.ACQUIRED
    time.sleep(0.3)
    # When a call of the key is published, then its one look at the record (the reservation
    # that found it) is the only one: its message goes out marked unreserved, to take the
    # key over
    result = add.apply_async((1, 2), idempotency_key=key, queue=queue)
    assert reserves.with_push == [True]
    [message] = _queued(queue)
    assert message["headers"]["id"] == result.id != owner.task_id
    assert RESERVED_HEADER not in message["headers"]


def test_a_priority_message_goes_on_the_list_kombu_reads_for_it(
    one_trip_app: tuple[Celery, Any, _Reserves], every_process_new: None
) -> None:
    app, add, reserves = one_trip_app
    queue = fresh("queue")
    add.apply_async((1, 2), idempotency_key=fresh("key"), queue=queue, priority=9)
    assert reserves.with_push == [True]
    with app.producer_or_acquire() as producer:
        priority_list = producer.channel._q_for_pri(queue, 9)
    assert priority_list != queue
    assert len(_queued(priority_list)) == 1
    assert _queued(queue) == []


def test_a_producer_on_a_connection_of_its_own_reserves_in_one_trip(
    one_trip_app: tuple[Celery, Any, _Reserves], every_process_new: None
) -> None:
    app, add, reserves = one_trip_app
    queue = fresh("queue")
    with app.connection_for_write() as connection:
        add.apply_async((1, 2), idempotency_key=fresh("key"), queue=queue, connection=connection)
    assert reserves.with_push == [True]
    assert len(_queued(queue)) == 1


def test_a_broker_with_a_key_prefix_takes_two_trips(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, every_process_new: None
) -> None:
    # kombu writes every key of such a broker under the prefix: the store's script does not
    app = _app(redis_url, global_keyprefix="pfx:")

    @app.task(base=IdempotentTask, name=fresh("one_trip.prefixed"))
    def prefixed(x: int) -> int:
        return x

    reserves = _Reserves(app, monkeypatch)
    try:
        queue, key = fresh("queue"), fresh("key")
        prefixed.apply_async((1,), idempotency_key=key, queue=queue)
        assert reserves.with_push == [False]
        assert len(_queued(queue, prefix="pfx:")) == 1
        _queued_record(app, prefixed, key)
    finally:
        monkeypatch.undo()
        store_for(app).close()


def test_a_push_interrupted_after_the_reservation_hands_the_call_to_the_guard(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, every_process_new: None
) -> None:
    # Given a broker kombu pushes onto apart from the store's script (a key prefix): the key is
    # reserved first, then kombu pushes
    app = _app(redis_url, global_keyprefix="pfx:")

    @app.task(base=IdempotentTask, name=fresh("one_trip.interrupted"))
    def interrupted(x: int) -> int:
        return x

    def ctrl_c(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    try:
        key = fresh("key")
        # When that push is interrupted (Ctrl-C, a green thread's timeout)
        monkeypatch.setattr(redis.Redis, "lpush", ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            interrupted.apply_async((1,), idempotency_key=key, queue=fresh("queue"))
        monkeypatch.undo()
        # Then the call is kept, queued and due at once, for the guard to publish (not left
        # for the whole pickup timeout, every call of the key answered with it meanwhile)
        record = _queued_record(app, interrupted, key)
        assert record.lease_expires_at <= record.store_time()
    finally:
        store_for(app).close()


def test_a_key_this_process_sent_before_takes_two_trips(
    one_trip_app: tuple[Celery, Any, _Reserves],
) -> None:
    _, add, reserves = one_trip_app
    queue, key = fresh("queue"), fresh("key")
    first = add.apply_async((1, 2), idempotency_key=key, queue=queue)
    # Forgotten (its message lost, say): sent again, the two-trip way
    store_for(add.app).forget(storage_key(add.name, key))
    second = add.apply_async((1, 2), idempotency_key=key, queue=queue)
    assert reserves.with_push == [True, False]
    assert [m["headers"]["id"] for m in _queued(queue)] == [second.id, first.id]


def test_a_message_kombu_sends_another_way_has_its_key_reserved_after(
    one_trip_app: tuple[Celery, Any, _Reserves], every_process_new: None
) -> None:
    # A fanout exchange: kombu publishes to its subscribers, and never pushes onto a list
    app, add, reserves = one_trip_app
    key = fresh("key")
    result = add.apply_async(
        (1, 2),
        idempotency_key=key,
        exchange=Exchange(fresh("fanout"), type="fanout"),
        routing_key="any",
    )
    # Its key is still queued for it, for the pickup guard
    assert reserves.with_push == [False]
    assert _queued_record(app, add, key).task_id == result.id


def test_an_app_that_sends_task_sent_events_takes_two_trips(
    one_trip_app: tuple[Celery, Any, _Reserves], every_process_new: None
) -> None:
    # A duplicate found in one trip would have had its task-sent event sent
    app, add, reserves = one_trip_app
    app.conf.task_send_sent_event = True
    queue, key = fresh("queue"), fresh("key")
    add.apply_async((1, 2), idempotency_key=key, queue=queue)
    add.apply_async((1, 2), idempotency_key=key, queue=queue)
    assert reserves.with_push == [False, False]
    assert len(_queued(queue)) == 1


def test_an_app_can_publish_in_two_trips(
    one_trip_app: tuple[Celery, Any, _Reserves], every_process_new: None
) -> None:
    app, add, reserves = one_trip_app
    app.conf.idempotency_publish_in_one_trip = False
    queue = fresh("queue")
    add.apply_async((1, 2), idempotency_key=fresh("key"), queue=queue)
    assert reserves.with_push == [False]
    assert len(_queued(queue)) == 1


def test_a_store_that_fails_the_reservation_lets_the_message_out_marked_unreserved(
    one_trip_app: tuple[Celery, Any, _Reserves],
    monkeypatch: pytest.MonkeyPatch,
    every_process_new: None,
) -> None:
    app, add, _ = one_trip_app

    def unreachable(*args: Any, **kwargs: Any) -> None:
        raise StoreUnavailable("Redis store unreachable")

    monkeypatch.setattr(store_for(app), "reserve", unreachable)
    queue, key = fresh("queue"), fresh("key")
    result = add.apply_async((1, 2), idempotency_key=key, queue=queue)
    # Published as with two trips: unguarded, and not marked as reserved
    [message] = _queued(queue)
    assert message["headers"]["id"] == result.id
    assert RESERVED_HEADER not in message["headers"]


def test_a_broker_failing_before_the_push_answers_a_key_found_or_keeps_the_call(
    one_trip_app: tuple[Celery, Any, _Reserves],
    monkeypatch: pytest.MonkeyPatch,
    every_process_new: None,
) -> None:
    app, add, reserves = one_trip_app
    queue, key = fresh("queue"), fresh("key")
    first = add.apply_async((1, 2), idempotency_key=key, queue=queue)
    assert reserves.with_push == [True]

    def unreachable(*args: Any, **kwargs: Any) -> None:
        raise OperationalError("broker unreachable")

    monkeypatch.setattr(app.amqp, "send_task_message", unreachable)
    # A key with a record is answered from it, as it would be before any publish
    again = add.apply_async((1, 2), idempotency_key=key, queue=queue)
    assert again.id == first.id
    # A new key gets the broker's error, and is kept queued, due at once, for the guard
    other = fresh("key")
    with pytest.raises(OperationalError):
        add.apply_async((1, 2), idempotency_key=other, queue=queue)
    record = _queued_record(app, add, other)
    assert record.lease_expires_at <= record.store_time()
    assert len(_queued(queue)) == 1


@pytest.mark.parametrize("one_trip", [True, False])
def test_a_message_the_broker_refuses_leaves_no_reservation_behind(
    one_trip_app: tuple[Celery, Any, _Reserves], every_process_new: None, one_trip: bool
) -> None:
    # Given a queue whose key in the broker's Redis holds a string, not a list: the broker
    # refuses every message for it (WRONGTYPE), however often it is sent
    app, add, _ = one_trip_app
    app.conf.idempotency_publish_in_one_trip = one_trip
    queue, key = fresh("queue"), fresh("key")
    broker = redis.Redis.from_url(app.conf.broker_url)
    broker.set(queue, "not a list")
    try:
        # When a keyed call is published onto it
        with pytest.raises(OperationalError, match="WRONGTYPE"):
            add.apply_async((1, 2), idempotency_key=key, queue=queue)
        # Then the call's error is the caller's, and its key is not kept for the guard to
        # send again (nor answers a later call with the id of a message that never went)
        assert store_for(app).get(storage_key(add.name, key)) is None
    finally:
        broker.delete(queue)


def test_a_broker_down_apart_from_the_store_keeps_the_call_as_two_trips_do(
    redis_url: str, every_process_new: None
) -> None:
    # A broker nobody answers at, the store on a Redis that does
    app = Celery("broker-down", broker="redis://127.0.0.1:1/0", backend=f"{redis_url}/{BACKEND_DB}")
    app.conf.broker_transport_options = {"max_retries": 1, "interval_start": 0}
    app.conf.task_publish_retry_policy = {"max_retries": 1, "interval_start": 0}

    @app.task(base=IdempotentTask, name=fresh("one_trip.unsent"))
    def unsent(x: int) -> int:
        return x

    try:
        key = fresh("key")
        with pytest.raises(OperationalError):
            unsent.apply_async((1,), idempotency_key=key)
        # The call is kept, queued and due at once, for the guard to publish
        record = _queued_record(app, unsent, key)
        assert record.lease_expires_at <= record.store_time()
    finally:
        store_for(app).close()


@pytest.mark.usefixtures("two_workers")
def test_thirty_callers_reserving_in_one_trip_at_once_run_the_body_once(
    monkeypatch: pytest.MonkeyPatch, every_process_new: None
) -> None:
    reserves = _Reserves(worker_app.app, monkeypatch)
    order, key = fresh("order"), fresh("key")
    values = charge_at_once(30, order, key)
    assert reserves.with_push == [True] * 30
    assert ledger_events(order, "start") == 1
    assert all(value == values[0] for value in values)
    # A later caller is answered from the cached value, and nothing is published
    again = worker_app.charge.apply_async(
        (order, 990), {"sleep": 0.5}, idempotency_key=key, queue=IDLE_QUEUE
    )
    assert isinstance(again, EagerResult)
    assert again.get() == values[0]
    assert queue_length(IDLE_QUEUE) == 0
    assert ledger_events(order, "start") == 1
