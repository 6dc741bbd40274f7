"""The pickup guard: a keyed message the broker loses is published again by the beat sweep.

Kombu's Redis transport loses a message popped by a worker that dies (or whose Redis
restarts) before the message is recorded as unacknowledged. These tests lose the message
deliberately, by taking it out of the broker's list, and expect the task to run anyway, once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from idempotent_tasks.app_store import store_for
from idempotent_tasks.keys import storage_key
from idempotent_tasks.pickups import republish_lost
from idempotent_tasks.records import Status
from tests.integration import worker_app
from tests.integration.helpers import fresh, ledger_events, wait_until
from tests.integration.workers import BeatProcess, WorkerProcess

pytestmark = pytest.mark.slow
app = worker_app.app
PICKUP_TIMEOUT = 1.0


@pytest.fixture()
def short_pickup(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process publishes with a 1 s pickup timeout."""
    monkeypatch.setitem(app.conf, "idempotency_pickup_timeout", PICKUP_TIMEOUT)


@pytest.fixture()
def worker_and_beat(it_env: dict[str, str], tmp_path: Path) -> Iterator[Any]:
    started: list[Any] = []

    def start() -> WorkerProcess:
        env = {**it_env, "IT_PICKUP_TIMEOUT": str(PICKUP_TIMEOUT)}
        worker = WorkerProcess("pickup", env, tmp_path, concurrency=1)
        started.append(worker)
        started.append(BeatProcess(env, tmp_path))
        return worker

    yield start
    for process in reversed(started):
        process.stop()


def _lose_message(queue: str, task_id: str) -> None:
    """Take the message of ``task_id`` out of the broker, as a lost BRPOP would."""
    broker = redis.Redis.from_url(app.conf.broker_url)
    for raw in broker.lrange(queue, 0, -1):
        if task_id.encode() in raw:
            assert broker.lrem(queue, 1, raw) == 1
            return
    raise AssertionError(f"no message of {task_id} in {queue}")


def _status(task: Any, key: str) -> Status | None:
    record = store_for(app).get(storage_key(task.name, key))
    return None if record is None else record.status


@pytest.mark.usefixtures("short_pickup")
def test_a_lost_message_is_published_again_and_runs_once(worker_and_beat: Any) -> None:
    # Given a keyed task published while no worker runs, whose message the broker then loses
    name, key = fresh("lost"), fresh("key")
    result = worker_app.ledgered.apply_async((name,), idempotency_key=key)
    _lose_message("celery", result.id)
    assert _status(worker_app.ledgered, key) is Status.QUEUED

    # When a worker and beat run
    worker_and_beat()

    # Then the sweep publishes it again under the same id, and its caller gets the value
    assert result.get(timeout=30) == name
    assert ledger_events(name, "start") == 1
    assert _status(worker_app.ledgered, key) is Status.COMPLETED


@pytest.mark.usefixtures("short_pickup")
def test_a_lost_retry_is_published_again(worker_and_beat: Any) -> None:
    # Given a task whose retry message goes where no worker ever reads it
    name, key = fresh("lost-retry"), fresh("key")
    worker_and_beat()
    result = worker_app.retries_into_the_void.apply_async((name,), idempotency_key=key)

    # Then the key stays queued for the retry, is published again where it came from, and ends
    assert result.get(timeout=30) == f"{name} done"
    assert ledger_events(name, "start") == 2
    redis.Redis.from_url(app.conf.broker_url).delete("nowhere")


@pytest.mark.usefixtures("short_pickup")
def test_a_message_only_slow_to_arrive_runs_once(worker_and_beat: Any) -> None:
    # Given a queued key whose message is still in the broker when the sweep publishes it again
    name, key = fresh("slow-queue"), fresh("key")
    result = worker_app.ledgered.apply_async((name,), idempotency_key=key)
    wait_until(lambda: republish_lost(app, store_for(app)) == 1, 5, "the sweep to republish")

    # When a worker reads both messages
    worker_and_beat()

    # Then the body ran once and the caller got its value
    assert result.get(timeout=30) == name
    wait_until(lambda: _queue_empty("celery"), 10, "both messages to be consumed")
    assert ledger_events(name, "start") == 1


def test_a_failed_publish_leaves_no_reservation(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a broker that refuses the message
    name, key = fresh("unpublished"), fresh("key")

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("broker down")

    monkeypatch.setattr(app, "send_task", refuse)
    with pytest.raises(ConnectionError):
        worker_app.ledgered.apply_async((name,), idempotency_key=key)

    # Then the key is free again: nothing will publish it behind the caller's back
    assert _status(worker_app.ledgered, key) is None


def _queue_empty(queue: str) -> bool:
    return int(redis.Redis.from_url(app.conf.broker_url).llen(queue)) == 0
