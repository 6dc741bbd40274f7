"""A keyed call's reservation and its message's push in one Redis round trip (broker, result
backend and store on one Redis server), with real Redis and real prefork workers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult, EagerResult
from kombu import Exchange

from idempotent_tasks import IdempotentTask, reserve_and_push
from idempotent_tasks.app_store import store_for
from idempotent_tasks.keys import storage_key
from idempotent_tasks.records import Status
from tests.integration import worker_app
from tests.integration.conftest import BACKEND_DB, BROKER_DB
from tests.integration.helpers import IDLE_QUEUE, fresh, ledger_events, queue_length


@pytest.fixture()
def every_process_new(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every publish as from a process that never published its key (so none takes the
    two-trip way a key sent again by the same process takes)."""
    monkeypatch.setattr(reserve_and_push, "_recent", reserve_and_push._RecentKeys(0))


class _KombuPushes:
    """A producer on a connection of its own (not from the pool, which apps on one broker
    share) whose channel counts the pushes kombu makes itself."""

    def __init__(self, app: Celery) -> None:
        self.queues: list[str] = []
        self._connection = app.connection_for_write()
        self.producer = app.amqp.Producer(self._connection)
        channel = self.producer.channel
        push = channel._put

        def counted(queue: str, message: dict[str, Any], **kwargs: Any) -> None:
            self.queues.append(queue)
            push(queue, message, **kwargs)

        channel._put = counted

    def close(self) -> None:
        self._connection.release()


def _app(redis_url: str, **transport_options: Any) -> Celery:
    app = Celery("one-trip", broker=f"{redis_url}/{BROKER_DB}", backend=f"{redis_url}/{BACKEND_DB}")
    app.conf.broker_transport_options = transport_options
    return app


@pytest.fixture()
def one_trip_app(redis_url: str) -> Iterator[tuple[Celery, Any, _KombuPushes]]:
    """A new app (its own producer pool) on the integration databases, its task and pushes."""
    app = _app(redis_url)

    @app.task(base=IdempotentTask, name=fresh("one_trip.add"))
    def add(x: int, y: int) -> int:
        return x + y

    pushes = _KombuPushes(app)
    yield app, add, pushes
    pushes.close()
    store_for(app).close()


def _queued(queue: str, db: int = BROKER_DB, prefix: str = "") -> list[dict[str, Any]]:
    broker = redis.Redis(db=db)
    return [json.loads(raw) for raw in broker.lrange(prefix + queue, 0, -1)]


def test_a_keyed_call_is_reserved_and_pushed_in_the_same_step(
    one_trip_app: tuple[Celery, Any, _KombuPushes], every_process_new: None
) -> None:
    app, add, pushes = one_trip_app
    queue, key = fresh("queue"), fresh("key")
    result = add.apply_async((1, 2), idempotency_key=key, queue=queue, producer=pushes.producer)
    # kombu pushed nothing itself: the reservation script did, onto the queue's list
    assert pushes.queues == []
    [message] = _queued(queue)
    assert message["headers"]["id"] == result.id
    record = store_for(app).get(storage_key(add.name, key))
    assert record is not None and record.status is Status.QUEUED
    assert record.task_id == result.id


def test_a_key_found_pushes_nothing_and_answers_with_its_owner(
    one_trip_app: tuple[Celery, Any, _KombuPushes], every_process_new: None
) -> None:
    _, add, pushes = one_trip_app
    queue, key = fresh("queue"), fresh("key")
    first = add.apply_async((1, 2), idempotency_key=key, queue=queue, producer=pushes.producer)
    again = add.apply_async((1, 2), idempotency_key=key, queue=queue, producer=pushes.producer)
    assert isinstance(again, AsyncResult) and again.id == first.id
    assert len(_queued(queue)) == 1
    assert pushes.queues == []


def test_a_priority_message_goes_on_the_list_kombu_reads_for_it(
    one_trip_app: tuple[Celery, Any, _KombuPushes], every_process_new: None
) -> None:
    _, add, pushes = one_trip_app
    queue = fresh("queue")
    add.apply_async((1, 2), idempotency_key=fresh("key"), queue=queue, priority=9)
    channel = pushes.producer.channel
    assert _queued(channel._q_for_pri(queue, 9)) != []
    assert _queued(queue) == []


def test_a_broker_with_a_key_prefix_takes_two_trips(
    redis_url: str, every_process_new: None
) -> None:
    # kombu writes every key of such a broker under the prefix: the store's script does not
    app = _app(redis_url, global_keyprefix="pfx:")

    @app.task(base=IdempotentTask, name=fresh("one_trip.prefixed"))
    def prefixed(x: int) -> int:
        return x

    pushes = _KombuPushes(app)
    try:
        queue, key = fresh("queue"), fresh("key")
        prefixed.apply_async((1,), idempotency_key=key, queue=queue, producer=pushes.producer)
        assert pushes.queues == [queue]
        assert len(_queued(queue, prefix="pfx:")) == 1
        record = store_for(app).get(storage_key(prefixed.name, key))
        assert record is not None and record.status is Status.QUEUED
    finally:
        pushes.close()
        store_for(app).close()


def test_a_key_this_process_sent_before_takes_two_trips(
    one_trip_app: tuple[Celery, Any, _KombuPushes],
) -> None:
    _, add, pushes = one_trip_app
    queue, key = fresh("queue"), fresh("key")
    first = add.apply_async((1, 2), idempotency_key=key, queue=queue, producer=pushes.producer)
    # Forgotten (its message lost, say): sent again, the two-trip way, which kombu pushes
    store_for(add.app).forget(storage_key(add.name, key))
    second = add.apply_async((1, 2), idempotency_key=key, queue=queue, producer=pushes.producer)
    assert pushes.queues == [queue]
    assert [m["headers"]["id"] for m in _queued(queue)] == [second.id, first.id]


def test_a_message_kombu_sends_another_way_has_its_key_reserved_after(
    one_trip_app: tuple[Celery, Any, _KombuPushes], every_process_new: None
) -> None:
    # A fanout exchange: kombu publishes to its subscribers, and never pushes onto a list
    app, add, pushes = one_trip_app
    key = fresh("key")
    result = add.apply_async(
        (1, 2),
        idempotency_key=key,
        exchange=Exchange(fresh("fanout"), type="fanout"),
        routing_key="any",
        producer=pushes.producer,
    )
    # Its key is still queued for it, for the pickup guard
    record = store_for(app).get(storage_key(add.name, key))
    assert record is not None and record.status is Status.QUEUED
    assert record.task_id == result.id


def test_an_app_that_sends_task_sent_events_takes_two_trips(
    one_trip_app: tuple[Celery, Any, _KombuPushes], every_process_new: None
) -> None:
    # A duplicate found in one trip would have had its task-sent event sent
    app, add, pushes = one_trip_app
    app.conf.task_send_sent_event = True
    queue, key = fresh("queue"), fresh("key")
    add.apply_async((1, 2), idempotency_key=key, queue=queue, producer=pushes.producer)
    add.apply_async((1, 2), idempotency_key=key, queue=queue, producer=pushes.producer)
    assert pushes.queues == [queue]
    assert len(_queued(queue)) == 1


@pytest.mark.usefixtures("two_workers")
def test_thirty_callers_reserving_in_one_trip_at_once_run_the_body_once(
    every_process_new: None,
) -> None:
    order, key = fresh("order"), fresh("key")
    with ThreadPoolExecutor(max_workers=30) as pool:
        results = list(
            pool.map(
                lambda _: worker_app.charge.apply_async(
                    (order, 990), {"sleep": 0.5}, idempotency_key=key
                ),
                range(30),
            )
        )
    values = [result.get(timeout=60) for result in results]
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
