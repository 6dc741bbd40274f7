"""Crashes, pauses, redeliveries and store restarts, with real worker processes.

Each test starts its own workers with a short lease and/or visibility timeout.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from billiard.exceptions import WorkerLostError

from idempotent_tasks import CorruptRecord
from idempotent_tasks.app_store import dlq_for, store_for
from idempotent_tasks.keys import KEY_HEADER, storage_key
from idempotent_tasks.records import Record, Status
from tests.integration import worker_app
from tests.integration.helpers import app_store_url, fresh, ledger_events, wait_until
from tests.integration.redis_server import RedisServer
from tests.integration.workers import WorkerProcess

pytestmark = pytest.mark.slow
slow_first = worker_app.slow_first


def _record(key: str, task_name: str = slow_first.name) -> Record | None:
    return store_for(worker_app.app).get(storage_key(task_name, key))


@pytest.fixture()
def start_worker(it_env: dict[str, str], tmp_path: Path) -> Iterator[Any]:
    started: list[WorkerProcess] = []

    def start(concurrency: int = 1, queue: str | None = None, **env: str) -> WorkerProcess:
        worker = WorkerProcess(
            f"crash{len(started)}",
            {**it_env, **env},
            tmp_path,
            concurrency,
            extra_args=("-Q", queue) if queue else (),
        )
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture()
def own_store(request: pytest.FixtureRequest, tmp_path: Path, worker_app: Any) -> Iterator[Any]:
    """A store on a Redis server of this test's own; the test process's app uses it too."""
    server = RedisServer(tmp_path, persistent=getattr(request, "param", True))
    with app_store_url(worker_app.app, server.url):
        yield server
    server.stop()


def test_worker_killed_mid_task_is_taken_over_after_the_lease(start_worker: Any) -> None:
    # Given a worker running a keyed task with a 2 s lease
    env = {"IT_LEASE": "2", "IT_VISIBILITY_TIMEOUT": "3"}
    first = start_worker(**env)
    name, key = fresh("killed"), fresh("key")
    result = slow_first.apply_async((name, 30.0), idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 15, "the first run to start")
    # When the whole worker is killed with SIGKILL and a new one starts
    first.kill()
    start_worker(**env)
    # Then the message comes back, the new worker takes the key over and completes it once
    value = result.get(timeout=60)
    assert value["run"] == 2
    assert ledger_events(name, "start") == 2
    assert ledger_events(name, "finish") == 1
    record = _record(key)
    assert record is not None
    assert (record.status, record.token) == (Status.COMPLETED, 2)


def test_a_waiting_duplicate_takes_the_key_over_once_its_dead_owners_lease_ends(
    start_worker: Any,
) -> None:
    # Given an owner running a keyed task with a 2 s lease, whose message will not come back
    # within the test (a visibility timeout of an hour)
    env = {"IT_LEASE": "2", "IT_VISIBILITY_TIMEOUT": "3600"}
    owner_worker = start_worker(**env)
    name, key = fresh("waiter"), fresh("key")
    owner = slow_first.apply_async((name, 30.0), idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 15, "the owner's run to start")
    # and a duplicate of its key (sent past the publish-side look), waiting on another worker
    queue = fresh("waiters")
    waiter_worker = start_worker(queue=queue, **env)
    duplicate = worker_app.app.send_task(
        slow_first.name, args=(name, 30.0), headers={KEY_HEADER: key}, queue=queue
    )
    wait_until(
        lambda: f"{duplicate.id}] retry: Retry in" in waiter_worker.log(),
        30,
        "the duplicate to wait",
    )
    # When the owner's worker is killed with SIGKILL
    owner_worker.kill()
    # Then the waiting duplicate takes the key over once the lease has run out, runs the body
    # (its second start) to its end once, and both callers get its value
    value = duplicate.get(timeout=60)
    assert value["run"] == 2
    assert ledger_events(name, "finish") == 1
    assert owner.get(timeout=30) == value
    record = _record(key)
    assert record is not None
    assert (record.status, record.token, record.task_id) == (Status.COMPLETED, 2, duplicate.id)


def test_pool_process_killed_mid_task_is_retried_and_completed_once(start_worker: Any) -> None:
    worker = start_worker(IT_LEASE="2")
    name, key = fresh("child-killed"), fresh("key")
    result = slow_first.apply_async((name, 30.0), idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 15, "the first run to start")
    for pid in worker.child_pids():
        os.kill(pid, signal.SIGKILL)
    value = result.get(timeout=60)
    assert value["run"] == 2
    assert ledger_events(name, "finish") == 1


@pytest.mark.parametrize("ends", ["killed", "exits"])
def test_a_call_whose_pool_process_dies_every_run_is_dead_lettered_after_its_retries(
    start_worker: Any, ends: str
) -> None:
    # Given a worker (a 300 s lease) and a keyed call that kills its pool process every run
    # (SIGKILL, or its body's own SystemExit)
    start_worker()
    task = worker_app.dies if ends == "killed" else worker_app.exits
    name, key = fresh(ends), fresh("key")
    result = task.apply_async((name,), idempotency_key=key)
    # Then it is retried once (max_retries=1), at once rather than after the dead owner's
    # lease, then fails for good: dead-lettered, its key free
    with pytest.raises(WorkerLostError):
        result.get(timeout=60)
    assert ledger_events(name, "start") == 2
    wait_until(lambda: _rows_of(result.id), 20, "its dead letter")
    [row] = _rows_of(result.id)
    said = "WorkerLostError" if ends == "killed" else "SystemExit"
    assert (row.idempotency_key, row.error_type) == (key, said)
    record = _record(key, task.name)
    assert record is None or record.status is not Status.PROCESSING


def _rows_of(task_id: str) -> list[Any]:
    return [row for row in dlq_for(worker_app.app).items(limit=1000) if row.task_id == task_id]


def test_visibility_timeout_redelivery_while_alive_does_not_run_again(start_worker: Any) -> None:
    # Given a visibility timeout far shorter than the task, and a heartbeat keeping its lease
    env = {"IT_VISIBILITY_TIMEOUT": "1", "IT_LEASE": "2"}
    workers = [start_worker(concurrency=2, **env) for _ in range(2)]
    name, key = fresh("redelivered"), fresh("key")
    result = slow_first.apply_async((name, 6.0), idempotency_key=key)
    # When Redis hands the still-running message out again (several times)
    value = result.get(timeout=60)
    # Then the body ran once and every delivery answered with its value
    assert value["run"] == 1
    assert ledger_events(name, "start") == 1
    # The redeliveries did happen, and waited for the owner instead of running.
    assert f"{result.id}] retry: Retry in" in "".join(worker.log() for worker in workers)


@pytest.mark.parametrize("own_store", [True, False], ids=["persistent", "volatile"], indirect=True)
def test_store_restart_between_claim_and_complete_loses_nothing(
    start_worker: Any, own_store: RedisServer
) -> None:
    # Given a task that claimed its key on a store that then restarts mid-run
    start_worker(IT_STORE_URL=own_store.url)
    name, key = fresh("restart"), fresh("key")
    result = slow_first.apply_async((name, 3.0), idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 15, "the first run to start")
    own_store.restart(down_for=1.0)
    # Then the task completes once and its key ends completed with the result
    value = result.get(timeout=60)
    assert value["run"] == 1
    assert ledger_events(name, "start") == 1
    record = wait_until(lambda: _record(key), 10, "the completed record")
    assert record.status is Status.COMPLETED
    assert slow_first.apply_async((name, 3.0), idempotency_key=key).get(timeout=10) == value


def test_store_down_at_claim_time_fails_closed_then_runs_once(
    start_worker: Any, own_store: RedisServer
) -> None:
    # Given a store that is down when the task arrives
    worker = start_worker(IT_STORE_URL=own_store.url)
    own_store.stop()
    name, key = fresh("closed"), fresh("key")
    result = slow_first.apply_async((name, 0.0), idempotency_key=key)
    # Then the worker that takes it hands it back, its body not run unclaimed
    wait_until(lambda: "store unavailable, will try again" in worker.log(), 30, "the hand-back")
    assert ledger_events(name, "start") == 0
    # And once the store is back, it runs exactly once
    own_store.start()
    assert result.get(timeout=60)["run"] == 1
    assert ledger_events(name, "start") == 1


@pytest.mark.parametrize("own_store", [False], ids=["volatile"], indirect=True)
def test_store_turned_read_only_at_claim_time_fails_closed_then_runs_once(
    start_worker: Any, own_store: RedisServer, tmp_path: Path
) -> None:
    # Given a store that has become a read-only replica (a failover under way) when the task
    # arrives
    (tmp_path / "master").mkdir()
    master = RedisServer(tmp_path / "master", persistent=False)
    store_server = redis.Redis.from_url(own_store.url)
    try:
        store_server.replicaof("127.0.0.1", master.port)
        worker = start_worker(IT_STORE_URL=own_store.url)
        name, key = fresh("read-only"), fresh("key")
        result = slow_first.apply_async((name, 0.0), idempotency_key=key)
        # Then the worker that takes it hands it back: the body not run unclaimed, the task
        # not failed
        wait_until(lambda: "store unavailable, will try again" in worker.log(), 30, "the hand-back")
        assert ledger_events(name, "start") == 0
        assert result.state in ("PENDING", "RETRY")
        # And once the store takes writes again (promoted), it runs exactly once
        store_server.replicaof("NO", "ONE")
        assert result.get(timeout=60)["run"] == 1
        assert ledger_events(name, "start") == 1
    finally:
        master.stop()


@pytest.mark.parametrize("own_store", [False], ids=["volatile"], indirect=True)
def test_a_key_whose_record_is_corrupt_is_dead_lettered_not_run(
    start_worker: Any, own_store: RedisServer
) -> None:
    # Given a key whose record was overwritten with something else than a record
    start_worker(IT_STORE_URL=own_store.url)
    name, key = fresh("corrupt"), fresh("key")
    record_name = store_for(worker_app.app).names(storage_key(slow_first.name, key))[0]
    redis.Redis.from_url(own_store.url).set(record_name, "not a record")
    # When the task is published and delivered
    result = slow_first.apply_async((name, 0.0), idempotency_key=key)
    # Then it fails with a clear error, its body not run, and it waits in the dead-letter table
    with pytest.raises(CorruptRecord):
        result.get(timeout=30)
    assert ledger_events(name, "start") == 0
    rows = [row for row in dlq_for(worker_app.app).items(limit=1000) if row.task_id == result.id]
    assert [(row.idempotency_key, row.error_type) for row in rows] == [(key, "CorruptRecord")]


def test_stale_owner_after_takeover_cannot_overwrite(start_worker: Any) -> None:
    # Given an owner frozen (SIGSTOP) in its body, so its heartbeat stops too
    env = {"IT_LEASE": "1.5", "IT_VISIBILITY_TIMEOUT": "2"}
    frozen_worker = start_worker(**env)
    name, key = fresh("stale"), fresh("key")
    result = slow_first.apply_async((name, 2.0), idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 15, "the first run to start")
    children = frozen_worker.child_pids()
    for pid in children:
        os.kill(pid, signal.SIGSTOP)
    try:
        # When the lease ends and another worker takes the redelivered task over
        start_worker(**env)
        wait_until(lambda: ledger_events(name, "finish") == 1, 30, "the takeover to finish")
        winner = _record(key)
        assert winner is not None and winner.status is Status.COMPLETED
    finally:
        for pid in children:
            os.kill(pid, signal.SIGCONT)
    # Then the stale owner finishes its body but its completion is refused
    wait_until(
        lambda: "after its claim was taken over" in frozen_worker.log(),
        30,
        "the stale owner's refused completion",
    )
    record = _record(key)
    assert record is not None
    assert (record.owner, record.token) == (winner.owner, winner.token)
    assert result.get(timeout=30)["run"] == 2


@pytest.mark.parametrize("mode", ["skip", "raise"])
def test_a_redelivered_call_whose_key_was_taken_over_gets_the_new_owners_value(
    start_worker: Any, mode: str
) -> None:
    # Given a call (on_duplicate skip or raise) whose worker was killed mid-body
    task = worker_app.skipping if mode == "skip" else worker_app.raising
    env = {"IT_LEASE": "1", "IT_VISIBILITY_TIMEOUT": "8"}
    first = start_worker(**env)
    name, key = fresh(f"taken-over-{mode}"), fresh("key")
    original = task.apply_async((name, 10.0), idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 15, "the first run to start")
    first.kill()
    killed_at = time.monotonic()
    start_worker(concurrency=2, **env)
    # and a duplicate that took the key over once the lease ended, before the broker gave
    # the call's own message back
    time.sleep(max(0.0, killed_at + 2.0 - time.monotonic()))
    duplicate = task.apply_async((name, 10.0), idempotency_key=key)
    assert duplicate.id != original.id  # published: a dead owner's key is taken over
    wait_until(lambda: ledger_events(name, "start") == 2, 5, "the duplicate's run to start")
    record = _record(key, task.name)
    assert record is not None and record.task_id == duplicate.id
    # When the broker redelivers the call's message while the duplicate runs, then the call
    # is no duplicate to drop or fail: it waits, and gets the new owner's value
    assert original.get(timeout=60) == name
    assert duplicate.get(timeout=30) == name
    assert ledger_events(name, "start") == 2
