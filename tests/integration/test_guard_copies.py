"""What the pickup guard publishes for a lost message: the call as it was sent, shadow name and
stamps included, on real Redis (broker, result backend and store)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from idempotent_tasks import IdempotentTask
from idempotent_tasks.app_store import store_for
from idempotent_tasks.keys import storage_key
from idempotent_tasks.pickups import REPUBLISHED_HEADER, hand_to_guard, republish_lost
from tests.integration.conftest import BACKEND_DB, BROKER_DB
from tests.integration.helpers import fresh


class _ShadowedByOrder(IdempotentTask):
    """Names each call after its order in logs and monitoring (Celery's ``shadow_name``, as in
    Celery's own example: it reads the arguments unchecked), counting how often it is asked."""

    named = 0

    def shadow_name(self, args: Any, kwargs: Any, options: Any) -> str:
        _ShadowedByOrder.named += 1
        return f"charge order {args[0]}"


@pytest.fixture()
def app(redis_url: str) -> Iterator[Celery]:
    app = Celery(
        "guard-copies", broker=f"{redis_url}/{BROKER_DB}", backend=f"{redis_url}/{BACKEND_DB}"
    )
    # Keys of its own, so its guard sweeps no other test's lost messages (nor they its).
    app.conf.idempotency_key_prefix = fresh("guard-copies")
    yield app
    store_for(app).close()


def _messages(app: Celery, queue: str) -> list[dict[str, Any]]:
    broker = redis.Redis.from_url(app.conf.broker_url)
    try:
        return [json.loads(raw) for raw in broker.lrange(queue, 0, -1)]
    finally:
        broker.close()


def _lose_and_guard(app: Celery, task: Any, key: str, queue: str) -> dict[str, Any]:
    """Lose the call's one message, let the guard publish it again; that copy's headers."""
    [sent] = _messages(app, queue)
    broker = redis.Redis.from_url(app.conf.broker_url)
    try:
        broker.delete(queue)  # the broker lost it
    finally:
        broker.close()
    store = store_for(app)
    hand_to_guard(store, storage_key(task.name, key), sent["headers"]["id"])
    assert republish_lost(app, store) == 1
    [copy] = _messages(app, queue)
    assert copy["headers"]["id"] == sent["headers"]["id"]
    assert copy["headers"][REPUBLISHED_HEADER] == 1
    return {"sent": sent["headers"], "copy": copy["headers"]}


def test_a_guard_copy_keeps_the_shadow_name_and_stamps_the_call_was_sent_with(
    app: Celery,
) -> None:
    @app.task(base=IdempotentTask, name=fresh("guard.charge"), shared=False)
    def charge(order: str) -> str:
        return order

    # Given a keyed call sent with a shadow name and a stamp, whose message the broker loses
    queue, key = f"guard-{uuid.uuid4().hex[:8]}", f"order-{uuid.uuid4().hex[:8]}"
    call = charge.s("o-7").set(idempotency_key=key, queue=queue, shadow="charge order o-7")
    call.stamp(on_behalf="ops")
    call.apply_async()
    # When the guard publishes it again, then the copy carries both, as the message did
    headers = _lose_and_guard(app, charge, key, queue)
    for sent_or_copy in headers.values():
        assert sent_or_copy["shadow"] == "charge order o-7"
        assert sent_or_copy["stamped_headers"] == ["on_behalf"]
        assert sent_or_copy["stamps"] == {"on_behalf": "ops"}


def test_a_guard_copy_keeps_the_shadow_name_the_task_computed(app: Celery) -> None:
    @app.task(base=_ShadowedByOrder, name=fresh("guard.shadowed"), shared=False)
    def charge(order: str) -> str:
        return order

    # Given a keyed call of a task that names its calls itself, whose message the broker loses
    queue, key = f"guard-{uuid.uuid4().hex[:8]}", f"order-{uuid.uuid4().hex[:8]}"
    named = _ShadowedByOrder.named
    charge.apply_async(("o-8",), idempotency_key=key, queue=queue)
    assert _ShadowedByOrder.named == named + 1  # named once, as Celery alone would
    # When the guard publishes it again, then the copy has the name the call was sent with
    headers = _lose_and_guard(app, charge, key, queue)
    assert headers["sent"]["shadow"] == headers["copy"]["shadow"] == "charge order o-8"


def test_a_call_that_does_not_fit_the_task_fails_as_celery_fails_it(app: Celery) -> None:
    @app.task(base=_ShadowedByOrder, name=fresh("guard.shadowed"), shared=False)
    def charge(order: str) -> str:
        return order

    # Given a keyed call missing its argument, of a task whose shadow_name reads it unchecked,
    # when it is published, then Celery's own check of the arguments refuses it (TypeError),
    # not the shadow_name's IndexError, and nothing is queued
    queue, key = f"guard-{uuid.uuid4().hex[:8]}", f"order-{uuid.uuid4().hex[:8]}"
    with pytest.raises(TypeError, match="order"):
        charge.apply_async((), idempotency_key=key, queue=queue)
    assert _messages(app, queue) == []
    # And its key is left free: the call made right is published
    charge.apply_async(("o-9",), idempotency_key=key, queue=queue)
    [sent] = _messages(app, queue)
    assert sent["headers"]["shadow"] == "charge order o-9"


def test_a_lost_message_whose_queue_redis_refuses_waits_its_backoff_and_the_sweep_goes_on(
    app: Celery,
) -> None:
    app.conf.task_publish_retry = False

    @app.task(base=IdempotentTask, name=fresh("guard.refused"), shared=False)
    def charge(order: str) -> str:
        return order

    # Given two keyed calls whose messages the broker lost, the first one's queue key now
    # holding a string (WRONGTYPE at every push)
    refused, taken = f"guard-{uuid.uuid4().hex[:8]}", f"guard-{uuid.uuid4().hex[:8]}"
    sent = {}
    for queue in (refused, taken):
        sent[queue] = charge.apply_async(("o-9",), idempotency_key=queue, queue=queue).id
    broker = redis.Redis.from_url(app.conf.broker_url)
    store = store_for(app)
    try:
        broker.delete(refused, taken)
        broker.set(refused, "not a list")
        for queue in (refused, taken):
            hand_to_guard(store, storage_key(charge.name, queue), sent[queue])
        tried: list[str] = []
        send_task = app.send_task

        def counted(*args: Any, **kwargs: Any) -> Any:
            tried.append(kwargs["task_id"])
            return send_task(*args, **kwargs)

        app.send_task = counted  # type: ignore[method-assign]
        # When the guard sweeps, then it goes on past the refused message and sends the other
        assert republish_lost(app, store) == 1
        assert [json.loads(raw)["headers"]["id"] for raw in broker.lrange(taken, 0, -1)] == [
            sent[taken]
        ]
        # And the refused one waits for its backoff: the next sweep does not try it again
        assert republish_lost(app, store) == 0
        assert sorted(tried) == sorted(sent.values())
        record = store.get(storage_key(charge.name, refused))
        assert record is not None and record.task_id == sent[refused]
    finally:
        broker.delete(refused, taken)
        broker.close()
