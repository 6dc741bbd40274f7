"""A dead-letter sweep facing rows it cannot send: a broker that is down, arguments kept as text.

The sweeps run in this process, against real databases (an SQLite file, Redis for RQ).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.exceptions import Ignore, Reject
from rq import Repeat
from rq.job import JobStatus
from rq.queue import Queue
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer
from rq.worker import SimpleWorker

from idempotent_tasks import IdempotentTask, dead_letters, defaults
from idempotent_tasks.dead_letters import (
    DEAD_LETTER_HEADER,
    DEAD_LETTER_SWEEP_HEADER,
    SWEEP_TASK,
)
from idempotent_tasks.dlq import DeadLetter, DeadLetterQueue, DeadLetterStatus, Failure
from idempotent_tasks.dlq.schema import claims
from idempotent_tasks.errors import DeadLettered
from idempotent_tasks.keys import fingerprint, storage_key
from idempotent_tasks.records import ClaimRequest, Outcome
from idempotent_tasks.rq import IdempotentJob, IdempotentQueue
from idempotent_tasks.rq import retry_dead_letters as rq_retry_dead_letters
from idempotent_tasks.rq.dead_letters import mark_succeeded, row_options
from idempotent_tasks.rq.options import FRAMEWORK as RQ_FRAMEWORK
from idempotent_tasks.rq.options import META_KEY, OWN_STORE, signature_of
from idempotent_tasks.stores.sql import SqlStore
from tests.claim_requests import claim_request
from tests.integration import rq_jobs
from tests.integration.conftest import BROKER_DB
from tests.integration.helpers import fresh, wait_until
from tests.integration.redis_server import RedisServer, free_port
from tests.integration.rq_support import RQ_DB

POLL_INTERVAL = 30


def _failure(
    framework: str = "celery", options: dict[str, Any] | None = None, task_id: str | None = None
) -> Failure:
    task_id = task_id or str(uuid.uuid4())
    return Failure(
        failure_id=f"{task_id}:0",
        task_name="sweep.charge",
        task_id=task_id,
        idempotency_key=None,
        args=["order"],
        kwargs={},
        options={"queue": "celery"} if options is None else options,
        error_type="RuntimeError",
        error_message="seeded",
        traceback=None,
        max_retries=3,
        framework=framework,
    )


@pytest.fixture()
def dlq_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'dead_letters.db'}"


@pytest.fixture()
def queue(dlq_url: str) -> Iterator[DeadLetterQueue]:
    dead_letters = DeadLetterQueue(dlq_url, base_delay=0)
    yield dead_letters
    dead_letters.dispose()


@pytest.fixture()
def app(dlq_url: str) -> Celery:
    """An app whose broker does not answer (nothing listens on port 1)."""
    app = Celery("sweeps", set_as_current=False, broker="redis://127.0.0.1:1/0")
    app.conf.update(
        idempotency_store_url="memory://",
        idempotency_dlq_url=dlq_url,
        idempotency_dlq_poll_interval=POLL_INTERVAL,
        task_publish_retry=False,
        broker_connection_timeout=1,
    )

    # A name of its own per app (Celery refuses one name for two callables), not shared with
    # the apps made after this one.
    @app.task(
        name=f"sweep.charge.{uuid.uuid4().hex}",
        base=IdempotentTask,
        serializer="pickle",
        shared=False,
    )
    def charge(order: Any) -> None:
        raise RuntimeError("declined")

    app.conf.sweep_test_task = charge.name
    app.finalize()
    return app


def test_rows_a_down_broker_refuses_are_due_again_later_and_the_sweep_ends(
    app: Celery, queue: DeadLetterQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given more due rows than one batch, while the broker is down
    items = [queue.add(_failure()) for _ in range(3)]
    send_task, attempts = app.send_task, []

    def counted(*args: Any, **kwargs: Any) -> Any:
        attempts.append(args)
        return send_task(*args, **kwargs)

    monkeypatch.setattr(app, "send_task", counted)
    # When a sweep runs in batches of two, then it ends, having sent nothing, at the first
    # row the broker refused (not one publish timeout per row)
    assert app.tasks[SWEEP_TASK].run(batch=2) == 0
    assert len(attempts) == 1
    # And each row is pending, with no retry used: the batch it took is due a poll interval
    # later, the row it never took is due as it was
    now = queue.now()
    later = 0
    for item in items:
        row = queue.get(item.id)
        assert row is not None and row.next_retry_at is not None
        assert (row.status, row.retry_count) == (DeadLetterStatus.PENDING, 0)
        if row.next_retry_at > now:
            assert now + timedelta(seconds=POLL_INTERVAL - 5) < row.next_retry_at
            assert row.next_retry_at <= now + timedelta(seconds=POLL_INTERVAL)
            later += 1
    assert later == 2
    assert len(queue.take_due()) == 1


@contextmanager
def _root_logging_kept() -> Iterator[None]:
    """Put the root and task loggers back as they were after an in-process worker set them up
    (their levels and handlers, and the task loggers' propagation, which Celery turns off),
    for the tests after this one that read what is logged."""
    loggers = [logging.getLogger(), logging.getLogger("celery.task")]
    kept = [(logger.level, list(logger.handlers), logger.propagate) for logger in loggers]
    try:
        yield
    finally:
        for logger, (level, handlers, propagate) in zip(loggers, kept, strict=True):
            logger.setLevel(level)
            logger.handlers = handlers
            logger.propagate = propagate


@pytest.mark.parametrize("error", [RuntimeError, FileNotFoundError])
def test_rows_a_failing_router_refuses_use_a_retry_each_sweep_and_then_give_up(
    app: Celery, queue: DeadLetterQueue, error: type[Exception]
) -> None:
    # Given more due rows than one batch, and a router that fails for every message (an
    # error each publish meets again, unlike a broker that is down; an OSError of the
    # router's own is no outage either)
    def broken_router(*_: Any, **__: Any) -> Any:
        raise error("no route for this task")

    app.conf.task_routes = (broken_router,)
    items = [queue.add(_failure()) for _ in range(3)]
    # When a sweep runs in batches of two, then it tries every row (not ending at the first)
    assert app.tasks[SWEEP_TASK].run(batch=2) == 0
    # And each row used a retry, saying why, due again on its backoff
    for item in items:
        row = queue.get(item.id)
        assert row is not None
        assert (row.status, row.retry_count, row.error_type) == (
            DeadLetterStatus.PENDING,
            1,
            error.__name__,
        )
        assert row.error_message == "no route for this task"
    # And when sweeps go on meeting it (each row made due at once rather than waiting out
    # its backoff), each row gives up at its limit (3) instead of being sent every poll
    # interval for ever
    for _ in range(2):
        for item in items:
            assert queue.retry_now(item.id)
        app.tasks[SWEEP_TASK].run(batch=2)
    for item in items:
        row = queue.get(item.id)
        assert row is not None
        assert (row.status, row.retry_count) == (DeadLetterStatus.PERMANENT_FAILURE, 3)


def test_a_sweep_tries_each_row_once_however_short_its_backoff(app: Celery, dlq_url: str) -> None:
    # Given a backoff of nothing, more due rows than one batch, and a router that always fails
    def broken_router(*_: Any, **__: Any) -> Any:
        raise RuntimeError("no route for this task")

    app.conf.update(idempotency_dlq_base_delay=0, task_routes=(broken_router,))
    queue = DeadLetterQueue(dlq_url, base_delay=0)
    try:
        items = [queue.add(_failure()) for _ in range(3)]
        # When one sweep runs in batches of two, then each row used one retry, not all three
        assert app.tasks[SWEEP_TASK].run(batch=2) == 0
        for item in items:
            row = queue.get(item.id)
            assert row is not None
            assert (row.status, row.retry_count) == (DeadLetterStatus.PENDING, 1)
    finally:
        queue.dispose()


def _sweeping_app(broker_url: str, dlq_url: str, **conf: Any) -> Celery:
    """An app whose sweep sends the rows of ``dlq_url`` to ``broker_url`` (its store in memory)."""
    app = Celery("sweeps", set_as_current=False, broker=broker_url)
    app.conf.update(
        idempotency_store_url="memory://",
        idempotency_dlq_url=dlq_url,
        idempotency_dlq_poll_interval=POLL_INTERVAL,
        **conf,
    )
    return app


@contextmanager
def _redis_unable_to_take_writes(directory: Path, refusal: str) -> Iterator[redis.Redis]:
    """A Redis server of the test's own that answers but takes no write for now: a replica
    during a failover (READONLY), full with no eviction (OOM), short of the replicas it
    wants (NOREPLICAS), or running a script past its time (BUSY)."""
    server = RedisServer(directory, persistent=False)
    client = redis.Redis.from_url(server.url)
    script: threading.Thread | None = None
    try:
        if refusal == "read-only replica":
            client.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
        elif refusal == "out of memory":
            client.config_set("maxmemory", "1")
            client.config_set("maxmemory-policy", "noeviction")
        elif refusal == "too few replicas":  # NOREPLICAS: no class of redis-py's
            client.config_set("min-replicas-to-write", "1")
        else:
            client.config_set("busy-reply-threshold", "10")
            script = threading.Thread(target=_run_for_ever, args=(server.url,))
            script.start()
            wait_until(lambda: _answers_busy(client), 10, "the script to keep Redis busy")
        yield client
    finally:
        try:
            if script is not None:
                with contextlib.suppress(redis.ResponseError):  # NOTBUSY: it never started
                    client.script_kill()
                script.join(timeout=10)
        finally:
            client.close()
            server.stop()  # killed if a script still keeps it busy


def _run_for_ever(url: str) -> None:
    """Run a script that loops until it is killed (its end, or the wait's, is no concern: it
    runs on in the server whoever waits for it)."""
    with redis.Redis.from_url(url) as connection, contextlib.suppress(redis.RedisError):
        connection.eval("while true do end", 0)


def _answers_busy(client: redis.Redis) -> bool:
    try:
        client.ping()
    except redis.ResponseError as exc:
        return str(exc).startswith("BUSY ")
    return False


def _none_used_a_retry(queue: DeadLetterQueue, items: list[Any]) -> None:
    """Each row is due again later, no retry used, as for a broker that is down."""
    for item in items:
        row = queue.get(item.id)
        assert row is not None
        assert (row.status, row.retry_count) == (DeadLetterStatus.PENDING, 0)


REFUSALS = ["read-only replica", "out of memory", "too few replicas", "busy script"]


@pytest.mark.parametrize("refusal", REFUSALS)
def test_rq_rows_a_redis_that_cannot_take_jobs_refuses_use_no_retry(
    dlq_url: str, queue: DeadLetterQueue, tmp_path: Path, refusal: str
) -> None:
    # Given due RQ rows, and RQ's Redis unable to take writes for now
    items = [
        queue.add(_failure(RQ_FRAMEWORK, row_options(f"sweep-{uuid.uuid4().hex[:8]}")))
        for _ in range(2)
    ]
    with _redis_unable_to_take_writes(tmp_path, refusal) as connection:
        # When the sweep runs, then it ends having enqueued nothing, and no row used a retry
        assert rq_retry_dead_letters(connection, dlq_url) == 0
    _none_used_a_retry(queue, items)


@pytest.mark.parametrize("refusal", REFUSALS)
def test_celery_rows_a_broker_that_cannot_take_messages_refuses_use_no_retry(
    dlq_url: str, queue: DeadLetterQueue, tmp_path: Path, refusal: str
) -> None:
    # Given due rows, and a Redis broker that answers but cannot take messages for now
    items = [queue.add(_failure()) for _ in range(2)]
    with _redis_unable_to_take_writes(tmp_path, refusal) as broker:
        port = broker.connection_pool.connection_kwargs["port"]
        app = _sweeping_app(f"redis://127.0.0.1:{port}/0", dlq_url, task_publish_retry=False)
        # When the sweep runs, then it ends having sent nothing, and no row used a retry
        assert app.tasks[SWEEP_TASK].run(batch=5) == 0
    _none_used_a_retry(queue, items)


@pytest.mark.parametrize("publish_retry", [False, True], ids=["publish-once", "kombu-retries"])
def test_a_celery_row_whose_queue_the_broker_refuses_uses_a_retry_and_the_sweep_goes_on(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue, publish_retry: bool
) -> None:
    # Given a due row for a queue whose Redis key holds a string (WRONGTYPE at every push),
    # due before a row for a queue that takes messages
    broker = redis.Redis.from_url(f"{redis_url}/{BROKER_DB}")
    refused, taken = f"refused-{uuid.uuid4().hex}", f"taken-{uuid.uuid4().hex}"
    broker.set(refused, "not a list")
    try:
        stuck = queue.add(_failure(options={"queue": refused}))
        sent = queue.add(_failure(options={"queue": taken}))
        # (kombu, retrying a publish, reconnects and tries again before it gives up)
        app = _sweeping_app(f"{redis_url}/{BROKER_DB}", dlq_url, task_publish_retry=publish_retry)
        # When the sweep runs, then it goes on past the refused row and sends the other
        assert app.tasks[SWEEP_TASK].run(batch=5) == 1
        assert broker.llen(taken) == 1
        # And the refused row used a retry, saying why, so it gives up at its limit rather
        # than end every sweep
        row = queue.get(stuck.id)
        assert row is not None
        assert (row.status, row.retry_count) == (DeadLetterStatus.PENDING, 1)
        assert "WRONGTYPE" in row.error_message
        other = queue.get(sent.id)
        assert other is not None and other.retry_count == 0
    finally:
        broker.delete(refused, taken)
        broker.close()


def test_an_rq_row_whose_queue_redis_refuses_uses_a_retry_and_the_sweep_goes_on(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue
) -> None:
    # Given a due RQ row for a queue whose Redis key holds a string, due before a row for a
    # queue that takes jobs
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    refused = Queue(f"refused-{uuid.uuid4().hex[:8]}", connection=connection)
    taken = Queue(f"taken-{uuid.uuid4().hex[:8]}", connection=connection)
    connection.set(refused.key, "not a list")
    try:
        stuck = queue.add(_failure(RQ_FRAMEWORK, row_options(refused.name)))
        queue.add(_failure(RQ_FRAMEWORK, row_options(taken.name)))
        # When the sweep runs, then it goes on past the refused row and enqueues the other
        assert rq_retry_dead_letters(connection, dlq_url) == 1
        assert taken.count == 1
        # And the refused row used a retry, saying why, and uses one at each later sweep
        # (the job RQ wrote as queued before the refused push passes for no live job)
        for retries in (1, 2):
            if retries > 1:
                assert queue.retry_now(stuck.id)  # due at once, not after its backoff
                assert rq_retry_dead_letters(connection, dlq_url) == 0
            row = queue.get(stuck.id)
            assert row is not None
            assert (row.status, row.retry_count) == (DeadLetterStatus.PENDING, retries)
            assert "WRONGTYPE" in row.error_message
    finally:
        taken.delete(delete_jobs=True)
        connection.delete(refused.key)
        connection.close()


def test_a_row_sent_to_a_worker_without_its_task_uses_a_retry(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue
) -> None:
    queue_name = f"unknown-{uuid.uuid4().hex}"
    app = _sweeping_app(
        f"{redis_url}/{BROKER_DB}",
        dlq_url,
        task_default_queue=queue_name,
        broker_connection_retry_on_startup=True,
    )

    @app.task(name=f"unknown.known.{uuid.uuid4().hex}", base=IdempotentTask, shared=False)
    def known() -> None:
        return None

    # Given a dead letter of a task no worker has any more (renamed since it failed)
    row = queue.add(
        dataclasses.replace(_failure(options={"queue": queue_name}), task_name="unknown.renamed")
    )
    # When a sweep sends it again, to a worker that discards it as unregistered
    with _root_logging_kept(), start_worker(app, pool="solo", perform_ping_check=False):
        assert app.tasks[SWEEP_TASK].run() == 1
        found = wait_until(
            lambda: (item := queue.get(row.id)) is not None and item.retry_count == 1 and item,
            timeout=20,
            what="the unknown task's retry recorded on its row",
        )
    # Then that retry counts as failed: the row waits for its next try, a retry used (left
    # retrying, it would be sent again at its timeout, for ever)
    assert found.status is DeadLetterStatus.PENDING
    assert found.error_type == "NotRegistered"
    assert "unknown.renamed" in (found.error_message or "")


def test_a_row_whose_arguments_are_kept_as_text_is_never_sent_again(
    app: Celery, queue: DeadLetterQueue
) -> None:
    # Given a call whose arguments JSON cannot hold, failed for good
    task = app.tasks[app.conf.sweep_test_task]
    task_id = str(uuid.uuid4())
    task.push_request(id=task_id, retries=0, delivery_info={"routing_key": "celery"})
    try:
        task.on_final_failure(RuntimeError("declined"), None, (object(),), {})
    finally:
        task.pop_request()
    (row,) = [item for item in queue.items() if item.task_id == task_id]
    assert row.options["args_lossy"] is True
    assert row.status is DeadLetterStatus.PERMANENT_FAILURE
    # When an operator asks for it to be retried anyway, and the sweep runs
    assert queue.retry_now(row.id)
    assert app.tasks[SWEEP_TASK].run(batch=2) == 0
    # Then it is refused before anything is sent (the broker would have failed it otherwise),
    # and the row gives up again at once, its failure kept, saying why
    after = queue.get(row.id)
    assert after is not None
    assert (after.status, after.retry_count, after.error_type) == (
        DeadLetterStatus.PERMANENT_FAILURE,
        0,
        "RuntimeError",
    )
    assert after.traceback == row.traceback
    assert (after.error_message or "").startswith("declined\n[not sent again: its arguments")


def _headers_of_the_resent_failure(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue, **request: Any
) -> dict[str, Any]:
    """The headers of the message a sweep, running as a task, sends again for a call (of a
    request made of ``request``) that failed for good."""
    queue_name = f"resent-{uuid.uuid4().hex[:8]}"
    app = _sweeping_app(f"{redis_url}/{BROKER_DB}", dlq_url)

    @app.task(base=IdempotentTask, name=f"sweep.resent.{uuid.uuid4().hex}", shared=False)
    def charge(order: str) -> None:
        raise RuntimeError("declined")

    task_id = str(uuid.uuid4())
    charge.push_request(id=task_id, retries=0, delivery_info={"routing_key": queue_name}, **request)
    try:
        charge.on_final_failure(RuntimeError("declined"), None, ("o-7",), {})
    finally:
        charge.pop_request()
    (row,) = [item for item in queue.items() if item.task_id == task_id]
    assert queue.retry_now(row.id)
    assert app.tasks[SWEEP_TASK].apply(kwargs={"batch": 5}).get() == 1
    broker = redis.Redis.from_url(f"{redis_url}/{BROKER_DB}")
    try:
        [raw] = broker.lrange(queue_name, 0, -1)
        broker.delete(queue_name)
    finally:
        broker.close()
    headers: dict[str, Any] = json.loads(raw)["headers"]
    assert headers["id"] == task_id
    return headers


def test_a_dead_letters_retry_keeps_the_calls_shadow_name_and_stamps(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue
) -> None:
    # Given a call sent with a shadow name and a stamp (one more stamp JSON cannot hold), that
    # failed for good, when the sweep sends it again
    headers = _headers_of_the_resent_failure(
        redis_url,
        dlq_url,
        queue,
        shadow="charge order o-7",
        stamped_headers=["on_behalf", "probe"],
        stamps={"on_behalf": "ops", "probe": object()},
    )
    # Then the message carries the call's shadow name and the stamp JSON could keep
    assert headers["shadow"] == "charge order o-7"
    assert (headers["stamped_headers"], headers["stamps"]) == (["on_behalf"], {"on_behalf": "ops"})


def test_a_dead_letters_retry_keeps_the_calls_place_in_its_workflow_not_the_sweeps(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue
) -> None:
    # Given a call of a workflow (its root and parent ids) that failed for good, when the
    # sweep, running as a task, sends it again
    headers = _headers_of_the_resent_failure(
        redis_url, dlq_url, queue, root_id="the-root", parent_id="the-parent"
    )
    # Then the message names the call's root and parent, not the sweep
    assert (headers["root_id"], headers["parent_id"]) == ("the-root", "the-parent")


def test_a_keyless_calls_long_task_id_is_kept_whole_for_its_retry(
    app: Celery, queue: DeadLetterQueue
) -> None:
    # Given a keyless call sent with a task id longer than the table's column
    long_id = "x" * 300
    charge = app.tasks[app.conf.sweep_test_task]
    charge.push_request(id=long_id, retries=0, delivery_info={"routing_key": "celery"})
    try:
        # When it fails for good
        charge.on_final_failure(RuntimeError("declined"), None, ("order",), {})
    finally:
        charge.pop_request()
    # Then its row reads back with the whole id, which its retry is sent under (its callers
    # wait on that id)
    assert [item.task_id for item in queue.items()] == [long_id]


def test_a_dead_letters_retry_waiting_out_a_long_countdown_keeps_its_row(
    dlq_url: str, queue: DeadLetterQueue
) -> None:
    app = _sweeping_app("memory://", dlq_url)

    @app.task(name=f"sweep.later.{uuid.uuid4().hex}", base=IdempotentTask, shared=False)
    def later(order: str) -> None:
        raise RuntimeError("declined")

    # Given a dead letter a sweep took over a second ago and re-published, whose run retries
    # with a countdown of two hours
    row = queue.add(dataclasses.replace(_failure(), task_name=later.name))
    [taken] = queue.take_due()
    time.sleep(1.2)
    later.push_request(
        id=row.task_id,
        called_directly=False,  # as a worker runs it: its retry is published
        args=["order"],
        kwargs={},
        retries=0,
        delivery_info={"routing_key": "celery"},
        headers={DEAD_LETTER_HEADER: taken.id, DEAD_LETTER_SWEEP_HEADER: taken.sweep_id},
    )
    try:
        later.retry(exc=RuntimeError("declined"), countdown=7200, throw=False)
    finally:
        later.pop_request()
    # Then a sweep looking for rows stuck for a second meanwhile does not take it (it would
    # send it again, uncounted, while the retry waits)
    assert queue.recover_stuck(timedelta(seconds=1), framework="celery") == 0
    found = queue.get(row.id)
    assert found is not None and found.status is DeadLetterStatus.RETRYING


@pytest.mark.parametrize("cause", ["dlq-off", "key-template"])
def test_a_dead_letters_retry_that_fails_is_counted_though_its_task_changed_since(
    dlq_url: str, queue: DeadLetterQueue, cause: str
) -> None:
    app = _sweeping_app("memory://", dlq_url, result_backend="cache+memory://")
    # Given a task whose dead-letter queue was turned off since its row was written, or that
    # has a key template since, which the row's arguments do not fit
    options: dict[str, Any] = (
        {"dlq": False} if cause == "dlq-off" else {"idempotency_key": "order-{missing}"}
    )

    @app.task(
        name=f"sweep.changed.{uuid.uuid4().hex}", base=IdempotentTask, shared=False, **options
    )
    def changed(order: str) -> None:
        raise RuntimeError("declined again")

    row = queue.add(dataclasses.replace(_failure(), task_name=changed.name))
    [taken] = queue.take_due()
    headers = {DEAD_LETTER_HEADER: taken.id, DEAD_LETTER_SWEEP_HEADER: taken.sweep_id}
    # When the sweep's run of it fails
    changed.apply(("order",), task_id=row.task_id, headers=headers)
    # Then the failure is counted on its row (unrecorded, the row would be sent every
    # retrying timeout for ever)
    found = queue.get(row.id)
    assert found is not None
    assert (found.status, found.retry_count) == (DeadLetterStatus.PENDING, 1)


def test_a_dead_letters_retry_of_a_task_with_its_dlq_off_adds_no_row_once_its_row_is_gone(
    dlq_url: str, queue: DeadLetterQueue
) -> None:
    app = _sweeping_app("memory://", dlq_url, result_backend="cache+memory://")

    @app.task(name=f"sweep.off.{uuid.uuid4().hex}", base=IdempotentTask, shared=False, dlq=False)
    def switched_off(order: str) -> None:
        raise RuntimeError("declined again")

    # Given a dead letter re-published by a sweep, purged since by an operator who also turned
    # the task's dead-letter queue off
    row = queue.add(dataclasses.replace(_failure(), task_name=switched_off.name))
    [taken] = queue.take_due()
    assert queue.purge() == 1
    headers = {DEAD_LETTER_HEADER: taken.id, DEAD_LETTER_SWEEP_HEADER: taken.sweep_id}
    # When that retry fails, then no row is written for it: the task's dead letters are off
    switched_off.apply(("order",), task_id=row.task_id, headers=headers)
    assert queue.items() == []


def test_a_celery_row_whose_key_no_worker_takes_is_never_sent_again(
    app: Celery, queue: DeadLetterQueue
) -> None:
    # Given a due row whose key a worker would refuse, an empty one (an older version kept
    # str() of a message's key header; or a row edited by hand)
    item = queue.add(dataclasses.replace(_failure(), idempotency_key=""))
    assert queue.retry_now(item.id)
    # When the sweep runs, then it refuses the row before anything is sent (a worker would
    # refuse the message, leaving its row retrying, due again and again), and gives it up at
    # once, its failure kept, saying why
    assert app.tasks[SWEEP_TASK].run(batch=2) == 0
    row = queue.get(item.id)
    assert row is not None
    assert (row.status, row.retry_count, row.error_type) == (
        DeadLetterStatus.PERMANENT_FAILURE,
        0,
        "RuntimeError",
    )
    assert (row.error_message or "").startswith("seeded\n[not sent again: ")


def test_the_rq_sweep_given_an_sql_claim_store_deletes_its_expired_claims(
    redis_url: str, dlq_url: str, tmp_path: Path
) -> None:
    # Given an SQL claim store (IdempotentQueue(store_url=...)) holding an expired claim and a
    # live one: unlike Redis, it expires nothing by itself
    store_url = f"sqlite:///{tmp_path / 'claims.db'}"
    store = SqlStore(store_url, prefix=defaults.KEY_PREFIX)
    try:
        expired = claim_request(key="gone", lease_seconds=0.1, ttl_seconds=0.1)
        live = claim_request(key="kept")
        assert store.claim(expired).outcome is Outcome.ACQUIRED
        assert store.claim(live).outcome is Outcome.ACQUIRED
        time.sleep(0.3)
        # When the RQ sweep runs, given that store
        connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
        rq_retry_dead_letters(connection, dlq_url, store_url=store_url)
        # Then the expired claim's row is gone, and the live one's kept
        with store.engine.connect() as db:
            ids = set(db.execute(sa.select(claims.c.id)).scalars())
        assert ids == {store.claim_id(live.storage_key)}
    finally:
        store.close()


def test_an_rq_row_that_cannot_be_enqueued_is_given_up_and_the_sweep_ends(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue
) -> None:
    # Given more due RQ rows than one batch whose arguments are kept as text and whose
    # original jobs RQ no longer has
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    queue_name = f"sweep-{uuid.uuid4().hex[:8]}"
    lossy = row_options(queue_name, args_lossy=True)
    items = [queue.add(_failure(RQ_FRAMEWORK, lossy)) for _ in range(3)]
    # When the sweep runs in batches of two, then it ends, having enqueued nothing
    assert rq_retry_dead_letters(connection, dlq_url, batch=2) == 0
    # And each row is given up at once, its failure kept, saying why
    for item in items:
        row = queue.get(item.id)
        assert row is not None
        _given_up(row)
    assert Queue(queue_name, connection=connection).count == 0


def _given_up(row: DeadLetter) -> None:
    """``row``, seeded by ``_failure``, was given up by a sweep that could not send it."""
    assert (row.status, row.retry_count, row.error_type) == (
        DeadLetterStatus.PERMANENT_FAILURE,
        0,
        "RuntimeError",
    )
    assert (row.error_message or "").startswith("seeded\n[not sent again: ")


def test_rows_whose_arguments_or_serializer_cannot_be_read_back_are_given_up(
    app: Celery, redis_url: str, dlq_url: str, queue: DeadLetterQueue
) -> None:
    # Given a Celery row whose arguments were edited into a typed value that does not read
    # back, and RQ rows of both kinds: that, and one whose job's serializer is not importable
    unreadable = [{"__type__": "datetime", "__value__": "not a date"}]
    celery_row = queue.add(dataclasses.replace(_failure(), args=unreadable))
    rq_options = row_options(f"sweep-{uuid.uuid4().hex[:8]}")
    rq_rows = [
        queue.add(dataclasses.replace(_failure(RQ_FRAMEWORK, rq_options), args=unreadable)),
        queue.add(_failure(RQ_FRAMEWORK, {**rq_options, "serializer": "no.such.Serializer"})),
    ]
    # When both sweeps run
    assert app.tasks[SWEEP_TASK].run(batch=2) == 0
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    assert rq_retry_dead_letters(connection, dlq_url, batch=2) == 0
    # Then each row is given up at once, its failure kept, saying why (rather than be sent
    # again every poll interval for ever; `dlq retry` sends it once it is mended)
    for item in (celery_row, *rq_rows):
        row = queue.get(item.id)
        assert row is not None
        _given_up(row)


def test_a_dead_letters_run_renews_its_row_so_no_sweep_sends_it_again_meanwhile(
    dlq_url: str, queue: DeadLetterQueue
) -> None:
    app = Celery("renews", set_as_current=False, broker="memory://")
    app.conf.update(
        idempotency_store_url="memory://",
        idempotency_dlq_url=dlq_url,
        result_backend="cache+memory://",
    )
    stuck_seen: list[int] = []

    @app.task(name=f"renews.charge.{uuid.uuid4().hex}", base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        # What a sweep would find stuck (retrying for over a second) while this run goes on
        stuck_seen.append(queue.recover_stuck(timedelta(seconds=1), framework="celery"))
        return order

    # Given a dead letter a sweep took over a second ago and re-published
    row = queue.add(dataclasses.replace(_failure(), task_name=charge.name))
    [taken] = queue.take_due()
    time.sleep(1.2)
    # When its run begins, then its row is not stuck while it runs, and succeeds after
    headers = {DEAD_LETTER_HEADER: taken.id, DEAD_LETTER_SWEEP_HEADER: taken.sweep_id}
    assert charge.apply(("order",), task_id=row.task_id, headers=headers).get() == "order"
    assert stuck_seen == [0]
    found = queue.get(row.id)
    assert found is not None and found.status is DeadLetterStatus.SUCCEEDED


@pytest.mark.parametrize("keyed", [False, True], ids=["without-a-key", "keyed"])
def test_a_dead_letters_run_longer_than_the_retrying_timeout_keeps_its_row_and_is_counted(
    dlq_url: str, queue: DeadLetterQueue, keyed: bool
) -> None:
    timeout = 1.5
    app = Celery("renews-long", set_as_current=False, broker="memory://")
    app.conf.update(
        idempotency_store_url="memory://",
        idempotency_dlq_url=dlq_url,
        idempotency_dlq_retrying_timeout=timeout,
        result_backend="cache+memory://",
    )
    stuck_seen: list[int] = []

    @app.task(name=f"renews.charge.{uuid.uuid4().hex}", base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        # A run longer than the retrying timeout: what a sweep would find stuck at its end
        time.sleep(timeout * 1.7)
        stuck_seen.append(queue.recover_stuck(timedelta(seconds=timeout), framework="celery"))
        raise RuntimeError("declined again")

    # Given a dead letter a sweep took and re-published
    row = queue.add(dataclasses.replace(_failure(), task_name=charge.name))
    [taken] = queue.take_due()
    headers = {DEAD_LETTER_HEADER: taken.id, DEAD_LETTER_SWEEP_HEADER: taken.sweep_id}
    if keyed:
        headers["idempotency_key"] = f"order-{uuid.uuid4().hex}"
    # When its run outlasts the timeout and fails again
    charge.apply(("order",), task_id=row.task_id, headers=headers)
    # Then no sweep could have taken the row for stuck meanwhile, and the failure is counted:
    # the row waits for its next backoff step, not sent again at once
    assert stuck_seen == [0]
    found = queue.get(row.id)
    assert found is not None
    assert (found.status, found.retry_count) == (DeadLetterStatus.PENDING, 1)


def test_an_rq_dead_letters_run_longer_than_the_retrying_timeout_keeps_its_row_and_is_counted(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    timeout = 1.5
    monkeypatch.setattr(defaults, "DLQ_RETRYING_TIMEOUT", timeout)
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    rq_queue = Queue(f"sweep-{uuid.uuid4().hex[:8]}", connection=connection)
    # Given an RQ dead letter whose job, sent again by the sweep, outlasts the retrying timeout
    # (a sweep at its end would find the row stuck) and fails again
    row = queue.add(
        dataclasses.replace(
            _failure(RQ_FRAMEWORK, row_options(rq_queue.name)),
            task_name=f"{rq_jobs.__name__}.fails_after_recovering",
            args=[dlq_url, timeout * 1.7, timeout],
        )
    )
    rq_jobs.recovered_while_running.clear()
    try:
        assert rq_retry_dead_letters(connection, dlq_url) == 1
        # When a worker runs it
        SimpleWorker([rq_queue], connection=connection, job_class=IdempotentJob).work(burst=True)
        # Then no sweep could have taken the row for stuck meanwhile, and the failure is
        # counted: the row waits for its next backoff step, not sent again at once
        assert rq_jobs.recovered_while_running == [0]
        found = queue.get(row.id)
        assert found is not None
        assert (found.status, found.retry_count) == (DeadLetterStatus.PENDING, 1)
    finally:
        rq_queue.delete(delete_jobs=True)


def test_a_row_left_retrying_by_a_sweep_that_died_is_sent_again_once_its_timeout_passed(
    dlq_url: str, queue: DeadLetterQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    timeout = 2.0  # a sweep's first steps (its database, the schema) well inside it
    app = _sweeping_app(
        "memory://",
        dlq_url,
        idempotency_dlq_retrying_timeout=timeout,
        idempotency_dlq_write_retry_delay=0.1,
    )
    # The grace a row made due again waits (for a run alive after all): 0.5 s here
    monkeypatch.setattr(dead_letters, "RETRY_AFTER_ERROR", 0.3)
    sent: list[str] = []
    send_task = app.send_task

    def recorded(*args: Any, **kwargs: Any) -> Any:
        sent.append(kwargs["task_id"])
        return send_task(*args, **kwargs)

    monkeypatch.setattr(app, "send_task", recorded)
    # Given a row a sweep took (marked retrying) and then died before sending
    row = queue.add(_failure())
    [taken] = queue.take_due()
    # When a sweep runs within the timeout, then it leaves the row to the sweep that took it
    assert app.tasks[SWEEP_TASK].run() == 0
    # And when one runs after the timeout, it makes the row due again, after a grace in
    # which the run it sent could still take it back; a sweep after that sends it
    time.sleep(timeout + 0.2)
    assert app.tasks[SWEEP_TASK].run() == 0
    assert sent == []
    time.sleep(0.6)
    assert app.tasks[SWEEP_TASK].run() == 1
    assert sent == [row.task_id]
    found = queue.get(row.id)
    assert found is not None and found.status is DeadLetterStatus.RETRYING
    assert found.sweep_id not in (None, taken.sweep_id)


def test_an_rq_row_left_retrying_by_a_sweep_that_died_is_enqueued_once_its_timeout_passed(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    timeout = 2.0  # a sweep's first steps (its database, the schema) well inside it
    monkeypatch.setattr(defaults, "DLQ_RETRYING_TIMEOUT", timeout)
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    rq_queue = Queue(f"sweep-{uuid.uuid4().hex[:8]}", connection=connection)
    # Given an RQ row a sweep took (marked retrying) and then died before enqueueing
    row = queue.add(_failure(RQ_FRAMEWORK, row_options(rq_queue.name)))
    [taken] = queue.take_due(framework=RQ_FRAMEWORK)
    try:
        # When a sweep runs within the timeout, then it leaves the row alone
        assert rq_retry_dead_letters(connection, dlq_url) == 0
        # And when one runs after the timeout, it enqueues the row's job
        time.sleep(timeout + 0.2)
        assert rq_retry_dead_letters(connection, dlq_url) == 1
        assert rq_queue.job_ids == [row.task_id]
        found = queue.get(row.id)
        assert found is not None and found.status is DeadLetterStatus.RETRYING
        assert found.sweep_id not in (None, taken.sweep_id)
    finally:
        rq_queue.delete(delete_jobs=True)


def test_an_rq_row_whose_failed_job_left_its_registry_is_enqueued_from_that_job(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue
) -> None:
    # Given a failed job whose arguments JSON cannot hold, taken out of RQ's failed registry
    # by a requeue that was cut short before it enqueued the job, and its dead letter
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    rq_queue = Queue(
        f"sweep-{uuid.uuid4().hex[:8]}", connection=connection, job_class=IdempotentJob
    )
    job = rq_queue.enqueue(rq_jobs.starts, Decimal("1.5"))
    rq_queue.remove(job)
    job.set_status(JobStatus.FAILED)
    item = queue.add(
        _failure(RQ_FRAMEWORK, row_options(rq_queue.name, args_lossy=True), task_id=job.id)
    )
    try:
        # When the sweep runs, then it enqueues that very job again, arguments and all
        assert rq_retry_dead_letters(connection, dlq_url) == 1
        assert rq_queue.job_ids == [job.id]
        again = IdempotentJob.fetch(job.id, connection=connection)
        assert again.args == (Decimal("1.5"),)
        row = queue.get(item.id)
        assert row is not None and row.status is DeadLetterStatus.RETRYING
    finally:
        rq_queue.delete(delete_jobs=True)


def test_an_rq_row_whose_job_rq_dropped_is_enqueued_with_its_key_scope_and_timeout(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue
) -> None:
    # Given a keyed job of a queue with its own key prefix and a job timeout, failed for good
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    shop = IdempotentQueue(
        f"sweep-{uuid.uuid4().hex[:8]}",
        connection=connection,
        key_prefix="shop",
        dlq_url=dlq_url,
        is_async=False,
    )
    key = f"key-{uuid.uuid4().hex[:8]}"
    job = shop.enqueue(rq_jobs.exits, f"exits-{key}", idempotency_key=key, job_timeout=600)
    [row] = [item for item in queue.items() if item.task_id == job.id]
    assert (row.options["prefix"], row.options["timeout"]) == ("shop", 600)
    # and whose job RQ no longer has (its failure TTL passed, say)
    job.delete()
    assert queue.retry_now(row.id)
    try:
        # When the sweep re-enqueues it, then the new job claims under the queue's prefix and
        # the function's scoped name (so a key completed since answers it), with its timeout
        assert rq_retry_dead_letters(connection, dlq_url) == 1
        again = IdempotentJob.fetch(job.id, connection=connection)
        state = again.meta[META_KEY]
        assert (state["prefix"], state["task_name"], state["key"]) == (
            "shop",
            "tests.integration.rq_jobs.exits",
            key,
        )
        assert again.timeout == 600
    finally:
        Queue(shop.name, connection=connection).delete(delete_jobs=True)


def test_the_rq_sweep_with_only_a_connection_uses_the_local_sqlite_table(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given no dead-letter URL anywhere, and a due RQ row in the local SQLite file
    monkeypatch.delenv("IDEMPOTENT_TASKS_DLQ_URL", raising=False)
    monkeypatch.setenv("IDEMPOTENT_TASKS_DATA_DIR", str(tmp_path))
    local = DeadLetterQueue(None, base_delay=0)  # due at once
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    rq_queue = Queue(f"sweep-{uuid.uuid4().hex[:8]}", connection=connection)
    try:
        row = local.add(_failure(RQ_FRAMEWORK, row_options(rq_queue.name)))
        assert list(tmp_path.glob("*.sqlite3"))
        # When the sweep is called as documented, with the connection alone
        assert rq_retry_dead_letters(connection) == 1
        # Then the row's job is enqueued and the row is retrying
        assert rq_queue.job_ids == [row.task_id]
        found = local.get(row.id)
        assert found is not None and found.status is DeadLetterStatus.RETRYING
    finally:
        local.dispose()
        rq_queue.delete(delete_jobs=True)


def test_rq_rows_a_down_redis_refuses_are_due_again_later_and_the_sweep_ends(
    dlq_url: str, queue: DeadLetterQueue
) -> None:
    # Given due RQ rows, while the queue's Redis does not answer (nothing listens on port 1)
    connection = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1)
    items = [queue.add(_failure(RQ_FRAMEWORK, row_options("sweep-down"))) for _ in range(3)]
    # When the sweep runs, then it ends, having enqueued nothing and used no retry
    assert rq_retry_dead_letters(connection, dlq_url, batch=2) == 0
    rows = [queue.get(item.id) for item in items]
    assert all(row is not None and row.status is DeadLetterStatus.PENDING for row in rows)
    assert all(row is not None and row.retry_count == 0 for row in rows)
    # And the row it never took (the batch after the refused one) is still due
    assert len(queue.take_due(framework=RQ_FRAMEWORK)) == 1


@pytest.fixture()
def rq_queue(redis_url: str, dlq_url: str) -> Iterator[IdempotentQueue]:
    """A queue of its own on RQ's Redis, dead-lettering into ``dlq_url``; no worker runs it."""
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    made = IdempotentQueue(fresh("rq-sweep"), connection=connection, dlq_url=dlq_url)
    yield made
    made.delete(delete_jobs=True)
    connection.close()


def _work(rq_queue: IdempotentQueue, max_jobs: int | None = None) -> None:
    """Run ``rq_queue``'s jobs here (at most ``max_jobs``), as a worker would."""
    worker = SimpleWorker([rq_queue], connection=rq_queue.connection, job_class=IdempotentJob)
    worker.work(burst=True, max_jobs=max_jobs)


def test_an_rq_row_of_a_function_whose_dead_letters_were_turned_off_since_records_its_failure(
    rq_queue: IdempotentQueue, dlq_url: str, queue: DeadLetterQueue
) -> None:
    name = fresh("turned-off")
    # Given a row written while the function dead-lettered its failures, the function now
    # deployed with dlq=False, and still failing
    item = queue.add(
        dataclasses.replace(
            _failure(RQ_FRAMEWORK, row_options(rq_queue.name)),
            task_name="tests.integration.rq_jobs.fails_without_dlq",
            args=[name],
        )
    )
    # When the sweep sends it again and it fails
    assert queue.retry_now(item.id)
    assert rq_retry_dead_letters(rq_queue.connection, dlq_url) == 1
    _work(rq_queue)
    assert rq_jobs.starts(name) == 1
    # Then its failure is counted on its row (the backoff goes on, towards giving up), rather
    # than the row left retrying, sent again every retrying timeout for ever
    row = queue.get(item.id)
    assert row is not None and (row.status, row.retry_count) == (DeadLetterStatus.PENDING, 1)
    # and no row of its own is written for it
    assert [found.id for found in queue.items(limit=1000) if found.task_id == item.task_id] == [
        item.id
    ]


def test_an_rq_repeating_jobs_failure_after_its_dead_letter_succeeded_gets_a_row_of_its_own(
    rq_queue: IdempotentQueue, dlq_url: str, queue: DeadLetterQueue
) -> None:
    name = fresh("repeats")

    def rows() -> list[DeadLetter]:
        return [item for item in queue.items(limit=1000) if item.task_id == job.id]

    # Given a repeating job whose first run failed for good, dead-lettered
    job = rq_queue.enqueue(rq_jobs.fails_odd_runs, name, repeat=Repeat(times=1))
    _work(rq_queue, max_jobs=1)
    [first] = rows()
    # When its dead letter's retry succeeds, and the repeat after it fails for good
    assert queue.retry_now(first.id)
    assert rq_retry_dead_letters(rq_queue.connection, dlq_url) == 1
    _work(rq_queue, max_jobs=2)
    assert rq_jobs.starts(name) == 3
    # Then the row stays succeeded, and the new failure has a row of its own
    by_status = {item.status: item for item in rows()}
    assert set(by_status) == {DeadLetterStatus.SUCCEEDED, DeadLetterStatus.PENDING}
    assert by_status[DeadLetterStatus.SUCCEEDED].id == first.id
    assert by_status[DeadLetterStatus.PENDING].error_message == f"run 3 of {name} failed"


def test_an_rq_dead_letters_job_sent_again_does_not_keep_the_calls_queue_ttl(
    rq_queue: IdempotentQueue, dlq_url: str, queue: DeadLetterQueue
) -> None:
    connection = rq_queue.connection
    # Given a job enqueued with ttl=60 (it may wait a minute to start), which failed for good
    job = rq_queue.enqueue(rq_jobs.flaky, fresh("ttl"), 99, ttl=60)
    _work(rq_queue, max_jobs=1)
    [row] = [item for item in queue.items(limit=1000) if item.task_id == job.id]
    # When the sweep sends its dead letter again
    assert queue.retry_now(row.id)
    assert rq_retry_dead_letters(connection, dlq_url) == 1
    # Then the job waits in its queue without that minute's expiry (nor RQ's failed-job one),
    # and keeps none for a later enqueue either
    assert connection.ttl(job.key) == -1
    assert IdempotentJob.fetch(job.id, connection=connection).ttl is None


def test_an_rq_row_of_a_job_claiming_in_a_store_of_its_own_is_sent_again_only_with_it(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue
) -> None:
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    rq_queue = Queue(f"own-store-{uuid.uuid4().hex[:8]}", connection=connection)
    # Given a keyed RQ row of a queue built with store_url=, whose job RQ no longer has
    row = queue.add(
        dataclasses.replace(
            _failure(RQ_FRAMEWORK, {**row_options(rq_queue.name), OWN_STORE: True}),
            idempotency_key=f"key-{uuid.uuid4().hex[:8]}",
        )
    )
    try:
        # When a sweep given no store runs, then it sends nothing (claimed in RQ's Redis, the
        # key would be found free): the row waits for a sweep that is, no retry used
        assert rq_retry_dead_letters(connection, dlq_url) == 0
        assert rq_queue.count == 0
        found = queue.get(row.id)
        assert found is not None and (found.status, found.retry_count) == (
            DeadLetterStatus.PENDING,
            0,
        )
        # And a sweep given the store sends its job, claiming there
        assert queue.retry_now(row.id)
        assert rq_retry_dead_letters(connection, dlq_url, store_url="memory://") == 1
        [job] = rq_queue.jobs
        assert job.meta[META_KEY]["store_url"] == "memory://"
        # While a row of a queue that claims in RQ's Redis never gets a sweep's store
        other = queue.add(
            dataclasses.replace(
                _failure(RQ_FRAMEWORK, {**row_options(rq_queue.name), OWN_STORE: False}),
                idempotency_key=f"key-{uuid.uuid4().hex[:8]}",
            )
        )
        assert rq_retry_dead_letters(connection, dlq_url, store_url="memory://") == 1
        [sent] = [job for job in rq_queue.jobs if job.id == other.task_id]
        assert "store_url" not in sent.meta[META_KEY]
    finally:
        rq_queue.delete(delete_jobs=True)
        connection.close()


def test_an_rq_row_whose_retry_succeeded_while_the_database_was_down_is_marked_not_resent(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue, tmp_path: Path
) -> None:
    # Given an RQ row taken by a sweep, whose re-enqueued job succeeded while the database
    # was down (its mark not written)
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    queue_name = f"sweep-{uuid.uuid4().hex[:8]}"
    item = queue.add(_failure(RQ_FRAMEWORK, row_options(queue_name)))
    [taken] = queue.take_due(framework=RQ_FRAMEWORK)
    down = DeadLetterQueue(f"sqlite:///{tmp_path}")  # a directory: the database cannot open
    mark_succeeded(lambda: down, taken.id, taken.sweep_id, connection)
    down.dispose()
    # When the row comes back as stuck in retrying, and the sweep runs
    assert queue.recover_stuck(timedelta(0)) == 1
    assert rq_retry_dead_letters(connection, dlq_url) == 0
    # Then it is marked succeeded, and nothing was enqueued to run again
    row = queue.get(item.id)
    assert row is not None and row.status is DeadLetterStatus.SUCCEEDED
    assert Queue(queue_name, connection=connection).count == 0


def test_an_rq_row_whose_job_was_requeued_by_hand_is_not_sent_twice(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue
) -> None:
    # Given an RQ row whose job an operator requeued by hand: first still queued, then finished
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    rq_queue = IdempotentQueue(f"sweep-{uuid.uuid4().hex[:8]}", connection=connection)
    name = f"requeued-{uuid.uuid4().hex[:8]}"
    job = rq_queue.enqueue(rq_jobs.record, name, 1)
    item = queue.add(_failure(RQ_FRAMEWORK, row_options(rq_queue.name), task_id=job.id))
    assert queue.retry_now(item.id)
    # When the sweep runs while the job is queued, then it does not push its id again: the
    # row waits for that job, under this sweep
    assert rq_retry_dead_letters(connection, dlq_url) == 1
    assert rq_queue.count == 1
    row = queue.get(item.id)
    assert row is not None and (row.status, row.retry_count) == (DeadLetterStatus.RETRYING, 0)
    # And once that run has succeeded, the row is marked succeeded, and not run again by a
    # later sweep
    SimpleWorker([rq_queue], connection=connection, job_class=IdempotentJob).work(burst=True)
    assert rq_jobs.starts(name) == 1
    row = queue.get(item.id)
    assert row is not None and row.status is DeadLetterStatus.SUCCEEDED
    assert queue.retry_now(item.id)
    assert rq_retry_dead_letters(connection, dlq_url) == 0
    row = queue.get(item.id)
    assert row is not None and row.status is DeadLetterStatus.SUCCEEDED
    assert rq_queue.count == 0


@pytest.mark.parametrize("status", [JobStatus.RATE_LIMITED, JobStatus.READY_TO_ENQUEUE])
def test_an_rq_row_whose_job_rq_will_enqueue_by_itself_is_not_sent_twice(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue, status: JobStatus
) -> None:
    # Given an RQ row whose job RQ holds back, to enqueue it by itself later (rate limited,
    # or ready once its dependencies finished)
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    rq_queue = IdempotentQueue(f"sweep-{uuid.uuid4().hex[:8]}", connection=connection)
    job = rq_queue.enqueue(rq_jobs.record, f"held-{uuid.uuid4().hex[:8]}", 1)
    rq_queue.remove(job)
    job.set_status(status)
    item = queue.add(_failure(RQ_FRAMEWORK, row_options(rq_queue.name), task_id=job.id))
    assert queue.retry_now(item.id)
    # When the sweep runs, then it sends nothing: the row waits for that job, no retry used
    assert rq_retry_dead_letters(connection, dlq_url) == 0
    assert rq_queue.count == 0
    assert job.get_status(refresh=True) == status
    row = queue.get(item.id)
    assert row is not None and (row.status, row.retry_count) == (DeadLetterStatus.PENDING, 0)


def test_an_rq_row_taken_for_stuck_while_its_job_waits_in_a_long_queue_counts_its_failure(
    rq_queue: IdempotentQueue, dlq_url: str, queue: DeadLetterQueue
) -> None:
    name = fresh("backlog")
    # Given an RQ row a sweep sent again, whose job still waits in its queue when the row is
    # taken for stuck (over an hour in retrying) and made due
    job = rq_queue.enqueue(rq_jobs.flaky, name, 99)
    item = queue.add(_failure(RQ_FRAMEWORK, row_options(rq_queue.name), task_id=job.id))
    [taken] = queue.take_due(framework=RQ_FRAMEWORK)
    job.meta[META_KEY].update(dead_letter_id=item.id, dead_letter_sweep=taken.sweep_id)
    job.save_meta()
    assert queue.recover_stuck(timedelta(0), framework=RQ_FRAMEWORK) == 1
    # When a sweep takes the row while the job is still queued, then the job's failure, once
    # it runs, is counted on the row (the backoff goes on, towards giving up)
    rq_retry_dead_letters(rq_queue.connection, dlq_url)
    _work(rq_queue)
    assert rq_jobs.starts(name) == 1
    row = queue.get(item.id)
    assert row is not None and (row.status, row.retry_count) == (DeadLetterStatus.PENDING, 1)
    assert rq_queue.count == 0


def test_an_rq_row_of_a_job_with_its_own_serializer_is_requeued_readable(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue
) -> None:
    # Given a keyed job of a JSON-serializer queue that failed for good and was dead-lettered
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    name, key = f"json-{uuid.uuid4().hex[:8]}", f"key-{uuid.uuid4().hex[:8]}"
    rq_queue = IdempotentQueue(
        f"sweep-{uuid.uuid4().hex[:8]}",
        connection=connection,
        dlq_url=dlq_url,
        serializer=JSONSerializer,
    )
    job = rq_queue.enqueue(rq_jobs.flaky, name, 99, idempotency_key=key)
    SimpleWorker(
        [rq_queue], connection=connection, job_class=IdempotentJob, serializer=JSONSerializer
    ).work(burst=True)
    [row] = [item for item in queue.items() if item.task_id == job.id]
    assert row.options["serializer"] == "rq.serializers.JSONSerializer"
    # When the sweep sends it again
    assert queue.retry_now(row.id)
    assert rq_retry_dead_letters(connection, dlq_url) == 1
    # Then the job a JSON worker reads still carries its key and its row
    again = IdempotentJob.fetch(job.id, connection=connection, serializer=JSONSerializer)
    state = again.meta[META_KEY]
    assert (state["key"], state["dead_letter_id"]) == (key, row.id)


def test_an_rq_success_that_can_be_neither_marked_nor_noted_still_ends_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The job succeeded: neither a database nor a Redis that are down make that a failure
    down = DeadLetterQueue(f"sqlite:///{tmp_path}")  # a directory: the database cannot open
    unreachable = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1)
    row_id = str(uuid.uuid4())
    try:
        mark_succeeded(lambda: down, row_id, None, unreachable)  # raises nothing
    finally:
        down.dispose()
    assert f"could not note dead letter {row_id} succeeded" in caplog.text


def test_an_rq_dead_letters_job_meeting_its_key_in_progress_waits_whatever_on_duplicate(
    redis_url: str, tmp_path: Path
) -> None:
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    queue = IdempotentQueue(
        fresh("dead-letter-waits"), connection=connection, dlq_url=f"sqlite:///{tmp_path}/dlq.db"
    )
    name = fresh("owed")
    try:
        # Given a dead letter's re-enqueued job of a skipping function
        job = queue.enqueue(rq_jobs.record_or_skip, name)
        job.meta[META_KEY]["dead_letter_id"] = "row-1"
        job.save_meta()
        # whose key another execution holds, its lease (1 s) ending soon
        holder = _holder(rq_jobs.record_or_skip, f"skip:{name}", (name,), lease_seconds=1)
        assert queue.store.claim(holder).outcome is Outcome.ACQUIRED
        # When a worker runs it, then it is not dropped as a duplicate: it waits, takes the
        # key over once the holder's lease ends, and runs
        SimpleWorker([queue], connection=connection, job_class=IdempotentJob).work(burst=True)
        assert rq_jobs.starts(name) == 1
        ran = IdempotentJob.fetch(job.id, connection=connection).return_value()
        assert ran == {"name": name, "value": 0, "run": 1}
    finally:
        queue.delete(delete_jobs=True)


def test_an_rq_dead_letters_job_waiting_for_its_key_renews_its_row_at_each_run(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue
) -> None:
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    rq_queue = IdempotentQueue(fresh("dead-letter-renews"), connection=connection, dlq_url=dlq_url)
    name = fresh("waits")
    # Given an RQ dead letter's row, taken by a sweep a while ago
    row = queue.add(_failure(RQ_FRAMEWORK, row_options(rq_queue.name)))
    [taken] = queue.take_due(framework=RQ_FRAMEWORK)
    time.sleep(3.0)
    try:
        # and its re-enqueued job, whose key another execution holds for long
        job = rq_queue.enqueue(rq_jobs.record_keyed, name, 1)
        job.meta[META_KEY].update(dead_letter_id=taken.id, dead_letter_sweep=taken.sweep_id)
        job.save_meta()
        holder = _holder(rq_jobs.record_keyed, f"keyed:{name}", (name, 1), lease_seconds=60)
        assert rq_queue.store.claim(holder).outcome is Outcome.ACQUIRED
        # When a worker runs it once: it waits for the key, then goes back to its queue
        SimpleWorker([rq_queue], connection=connection, job_class=IdempotentJob).work(
            burst=True, max_jobs=1
        )
        assert rq_jobs.starts(name) == 0
        assert rq_queue.job_ids == [job.id]
        # Then that run renewed the row: a sweep does not take it for stuck (its failure would
        # then be dropped as another sweep's, and the row sent again ahead of its backoff)
        assert queue.recover_stuck(timedelta(seconds=2.5), framework=RQ_FRAMEWORK) == 0
        found = queue.get(row.id)
        assert found is not None
        assert (found.status, found.sweep_id) == (DeadLetterStatus.RETRYING, taken.sweep_id)
    finally:
        rq_queue.delete(delete_jobs=True)


def test_an_rq_row_whose_job_has_a_short_failure_ttl_is_requeued_to_stay_until_it_runs(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue
) -> None:
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    rq_queue = IdempotentQueue(fresh("sweep-failure-ttl"), connection=connection)
    # Given a job RQ keeps as failed for 30 s (failure_ttl=30: RQ expires its data then), and
    # its row
    job = rq_queue.enqueue(rq_jobs.record, fresh("short"), 1, failure_ttl=30)
    rq_queue.remove(job)
    job.set_status(JobStatus.FAILED)
    FailedJobRegistry(queue=rq_queue).add(job, ttl=job.failure_ttl)
    assert 0 < connection.ttl(job.key) <= 30
    item = queue.add(_failure(RQ_FRAMEWORK, row_options(rq_queue.name), task_id=job.id))
    try:
        # When the sweep requeues it
        assert rq_retry_dead_letters(connection, dlq_url) == 1
        assert rq_queue.job_ids == [job.id]
        # Then its data no longer expires: in a busy queue it would vanish before it ran, its
        # row left retrying
        assert connection.ttl(job.key) == -1
        assert queue.get(item.id) is not None
    finally:
        rq_queue.delete(delete_jobs=True)


def test_an_rq_row_whose_failed_jobs_meta_cannot_be_loaded_here_waits_with_its_job_untouched(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue
) -> None:
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    rq_queue = IdempotentQueue(fresh("sweep-meta"), connection=connection)
    # Given a keyed job RQ keeps as failed, whose meta this process cannot load (pickled with
    # a class only the app's workers import), and its row
    job = rq_queue.enqueue(rq_jobs.record, fresh("meta"), 1, idempotency_key=fresh("key"))
    rq_queue.remove(job)
    job.set_status(JobStatus.FAILED)
    FailedJobRegistry(queue=rq_queue).add(job, ttl=600)
    unloadable = b"\x80\x04\x95not a pickle this process can load"
    connection.hset(job.key, "meta", unloadable)
    item = queue.add(_failure(RQ_FRAMEWORK, row_options(rq_queue.name), task_id=job.id))
    try:
        # When the sweep runs, then it sends nothing, and the row waits, no retry used
        assert rq_retry_dead_letters(connection, dlq_url) == 0
        row = queue.get(item.id)
        assert row is not None and (row.status, row.retry_count) == (DeadLetterStatus.PENDING, 0)
        # And the job is as it was: failed, its meta (its key among it) not overwritten
        assert rq_queue.count == 0
        assert connection.hget(job.key, "meta") == unloadable
        assert job.get_status(refresh=True) == JobStatus.FAILED
    finally:
        rq_queue.delete(delete_jobs=True)


def test_an_rq_row_whose_failed_job_someone_requeues_meanwhile_is_not_sent_twice(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    rq_queue = IdempotentQueue(fresh("sweep-requeued"), connection=connection)
    # Given an RQ row whose job RQ keeps as failed
    job = rq_queue.enqueue(rq_jobs.record, fresh("requeued"), 1)
    rq_queue.remove(job)
    job.set_status(JobStatus.FAILED)
    FailedJobRegistry(queue=rq_queue).add(job, ttl=600)
    item = queue.add(_failure(RQ_FRAMEWORK, row_options(rq_queue.name), task_id=job.id))
    # and someone else (an operator, another row's sweep) requeuing that job just before the
    # sweep does
    requeue = FailedJobRegistry.requeue

    def requeued_first(registry: FailedJobRegistry, job_or_id: Any, at_front: bool = False) -> Any:
        requeue(registry, job_or_id.id, at_front)  # theirs
        return requeue(registry, job_or_id, at_front)  # the sweep's: no longer failed

    monkeypatch.setattr(FailedJobRegistry, "requeue", requeued_first)
    try:
        # When the sweep runs, then the job is queued once, and the row is due again later
        assert rq_retry_dead_letters(connection, dlq_url) == 0
        assert rq_queue.job_ids == [job.id]
        row = queue.get(item.id)
        assert row is not None and (row.status, row.retry_count) == (DeadLetterStatus.PENDING, 0)
    finally:
        rq_queue.delete(delete_jobs=True)


def test_an_rq_row_whose_failed_job_someone_requeues_and_runs_meanwhile_is_marked_succeeded(
    rq_queue: IdempotentQueue, dlq_url: str, queue: DeadLetterQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = fresh("requeued-run")
    # Given an RQ row whose keyless job RQ keeps as failed
    job = rq_queue.enqueue(rq_jobs.record, name, 1)
    rq_queue.remove(job)
    job.set_status(JobStatus.FAILED)
    FailedJobRegistry(queue=rq_queue).add(job, ttl=600)
    item = queue.add(_failure(RQ_FRAMEWORK, row_options(rq_queue.name), task_id=job.id))
    # and an operator requeuing that job just before the sweep does, and a worker running it
    # to its end
    requeue = FailedJobRegistry.requeue

    def requeued_and_run_first(
        registry: FailedJobRegistry, job_or_id: Any, at_front: bool = False
    ) -> Any:
        requeue(registry, job_or_id.id, at_front)
        _work(rq_queue)
        return requeue(registry, job_or_id, at_front)  # the sweep's: no longer failed

    monkeypatch.setattr(FailedJobRegistry, "requeue", requeued_and_run_first)
    # When the sweep runs, then it sends nothing again (a keyless body would run twice), and
    # the row is marked succeeded
    assert rq_retry_dead_letters(rq_queue.connection, dlq_url) == 0
    assert rq_jobs.starts(name) == 1
    assert rq_queue.count == 0
    row = queue.get(item.id)
    assert row is not None and row.status is DeadLetterStatus.SUCCEEDED


def _holder(
    function: Any, key: str, args: tuple[Any, ...], *, lease_seconds: float
) -> ClaimRequest:
    """A claim of another execution on the key ``function``'s job with ``args`` runs under."""
    task_name = f"{function.__module__}.{function.__name__}"
    return claim_request(
        key=key,
        task_name=task_name,
        storage_key=storage_key(task_name, key),
        task_id=fresh("holder"),
        owner=fresh("holder-owner"),
        fingerprint=fingerprint(task_name, signature_of(function), args, {}),
        lease_seconds=lease_seconds,
    )


def _eager_app(dlq_url: str, name: str) -> Celery:
    app = Celery(name, set_as_current=False, broker="memory://")
    app.conf.update(
        idempotency_store_url="memory://",
        idempotency_dlq_url=dlq_url,
        result_backend="cache+memory://",
    )
    return app


def _counting_charge(app: Celery, ran: list[str]) -> Any:
    """A keyed-or-not task of ``app`` returning its order, noting each run in ``ran``."""

    @app.task(name=f"{app.main}.charge.{uuid.uuid4().hex}", base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        ran.append(order)
        return order

    return charge


def _sent_by(taken: Any, key: str | None) -> dict[str, Any]:
    """The headers of the message a sweep sends for the row it took."""
    headers = {DEAD_LETTER_HEADER: taken.id, DEAD_LETTER_SWEEP_HEADER: taken.sweep_id}
    if key is not None:
        headers["idempotency_key"] = key
    return headers


@pytest.mark.parametrize("keyed", [False, True], ids=["without-a-key", "keyed"])
def test_a_dead_letters_message_sent_again_since_or_whose_row_ended_does_not_run(
    dlq_url: str, queue: DeadLetterQueue, keyed: bool
) -> None:
    ran: list[str] = []
    charge = _counting_charge(_eager_app(dlq_url, "stale"), ran)

    key = f"order-{uuid.uuid4().hex}" if keyed else None
    # Given a row a sweep took and sent, then (its message slower than the retrying timeout)
    # found stuck and took and sent again
    row = queue.add(dataclasses.replace(_failure(), task_name=charge.name, idempotency_key=key))
    [first] = queue.take_due()
    time.sleep(0.01)
    assert queue.recover_stuck(timedelta(0), framework="celery") == 1
    [second] = queue.take_due()
    # When the first message arrives, then its body does not run: the row is the second's
    charge.apply(("order",), task_id=row.task_id, headers=_sent_by(first, key))
    assert ran == []
    found = queue.get(row.id)
    assert found is not None
    assert (found.status, found.sweep_id) == (DeadLetterStatus.RETRYING, second.sweep_id)
    # And the second one runs, and marks the row
    charge.apply(("order",), task_id=row.task_id, headers=_sent_by(second, key))
    assert ran == ["order"]
    found = queue.get(row.id)
    assert found is not None and found.status is DeadLetterStatus.SUCCEEDED
    # And the first message, delivered again once the row succeeded, does not run the body
    # again either (with a key, it is answered from its completed key)
    answered = charge.apply(("order",), task_id=row.task_id, headers=_sent_by(first, key))
    assert ran == ["order"]
    if keyed:
        assert answered.get() == "order"


def test_a_dead_letters_message_whose_row_gave_up_ends_as_its_last_retry_did(
    dlq_url: str, queue: DeadLetterQueue
) -> None:
    ran: list[str] = []
    charge = _counting_charge(_eager_app(dlq_url, "gave-up"), ran)

    # Given a row whose last retry failed (a Celery retry of it still on its way, say)
    row = queue.add(dataclasses.replace(_failure(), task_name=charge.name, max_retries=1))
    [taken] = queue.take_due()
    queue.record_retry_failure(taken.id, "RuntimeError", "declined again", None, taken.sweep_id)
    # When a message of that retry arrives, then it fails as the row did, running nothing
    ended = charge.apply(("order",), task_id=row.task_id, headers=_sent_by(taken, None))
    with pytest.raises(DeadLettered, match="declined again"):
        ended.get()
    assert ran == []
    # And a retry whose row is not in this table (another host's, or purged) runs
    headers = {DEAD_LETTER_HEADER: str(uuid.uuid4()), DEAD_LETTER_SWEEP_HEADER: "elsewhere"}
    assert charge.apply(("order",), task_id=row.task_id, headers=headers).get() == "order"
    assert ran == ["order"]


@pytest.mark.parametrize("keyed", [False, True], ids=["without-a-key", "keyed"])
@pytest.mark.parametrize("ending", ["ignore", "reject"])
def test_a_dead_letters_retry_its_body_ends_without_a_value_uses_a_retry(
    dlq_url: str, queue: DeadLetterQueue, keyed: bool, ending: str
) -> None:
    app = _eager_app(dlq_url, "ended")

    @app.task(name=f"ended.charge.{uuid.uuid4().hex}", base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        raise Ignore() if ending == "ignore" else Reject("not now", requeue=False)

    key = f"order-{uuid.uuid4().hex}" if keyed else None
    # Given a row a sweep took and sent
    row = queue.add(dataclasses.replace(_failure(), task_name=charge.name, idempotency_key=key))
    [taken] = queue.take_due()
    # When its body ends it with Ignore or Reject
    charge.apply(("order",), task_id=row.task_id, headers=_sent_by(taken, key))
    # Then that is a failed retry on its row (left retrying, it would be sent again after its
    # timeout, for ever, no retry used)
    found = queue.get(row.id)
    assert found is not None
    assert (found.status, found.retry_count) == (DeadLetterStatus.PENDING, 1)
    assert found.error_type == ("Ignore" if ending == "ignore" else "Reject")


def test_a_dead_letters_retry_without_a_key_that_replaces_itself_succeeds(
    redis_url: str, dlq_url: str, queue: DeadLetterQueue
) -> None:
    queue_name = f"replaced-{uuid.uuid4().hex}"
    app = _sweeping_app(
        f"{redis_url}/{BROKER_DB}",
        dlq_url,
        task_default_queue=queue_name,
        broker_connection_retry_on_startup=True,
    )
    added: list[str] = []

    @app.task(name=f"replaced.add.{uuid.uuid4().hex}", shared=False)
    def add(order: str) -> None:
        added.append(order)

    @app.task(
        name=f"replaced.charge.{uuid.uuid4().hex}", base=IdempotentTask, shared=False, bind=True
    )
    def charge(self: Any, order: str) -> None:
        raise self.replace(add.s(order))

    # Given a dead letter of a call without a key
    failure = _failure(options={"queue": queue_name})
    row = queue.add(dataclasses.replace(failure, task_name=charge.name))
    # When a sweep sends it again, and its body replaces itself on a worker
    with _root_logging_kept(), start_worker(app, pool="solo", perform_ping_check=False):
        assert app.tasks[SWEEP_TASK].run() == 1
        found = wait_until(
            lambda: (
                (item := queue.get(row.id)) is not None
                and item.status is not DeadLetterStatus.RETRYING
                and item
            ),
            timeout=20,
            what="the retry's outcome on its row",
        )
        wait_until(lambda: added == ["order"], 20, "the replacement to run")
    # Then its row succeeded: its work is handed on (left retrying, it would be sent again at
    # its timeout, for ever)
    assert found.status is DeadLetterStatus.SUCCEEDED


def test_a_dead_letters_run_that_succeeds_after_its_row_was_sent_again_is_not_run_twice(
    dlq_url: str, queue: DeadLetterQueue
) -> None:
    app = _eager_app(dlq_url, "outlived")
    ran: list[str] = []
    resent: list[Any] = []

    @app.task(name=f"outlived.charge.{uuid.uuid4().hex}", base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        ran.append(order)
        if len(ran) == 1:
            # A run that outlives the retrying timeout (its renewals failing): a sweep finds
            # the row stuck meanwhile, and sends it again
            time.sleep(0.01)
            assert queue.recover_stuck(timedelta(0), framework="celery") == 1
            resent.extend(queue.take_due())
        return order

    # Given a row a sweep took and sent, of a call without a key, whose run succeeds after
    # another sweep sent the row again
    row = queue.add(dataclasses.replace(_failure(), task_name=charge.name))
    [first] = queue.take_due()
    assert charge.apply(("order",), task_id=row.task_id, headers=_sent_by(first, None)).get()
    found = queue.get(row.id)
    assert found is not None and found.status is DeadLetterStatus.SUCCEEDED
    # When the second sweep's message arrives, then it does not run the body again
    [second] = resent
    charge.apply(("order",), task_id=row.task_id, headers=_sent_by(second, None))
    assert ran == ["order"]


def test_a_failure_of_a_retry_whose_row_succeeded_already_gets_a_row_of_its_own(
    dlq_url: str, queue: DeadLetterQueue
) -> None:
    from idempotent_tasks.dead_letters import write_failure

    app = _eager_app(dlq_url, "failed-anew")
    # Given a row whose retry succeeded (marked), and a message of it that runs again later
    # and fails (its key forgotten or expired meanwhile)
    row = queue.add(_failure())
    [taken] = queue.take_due()
    assert queue.mark_succeeded(taken.id, taken.sweep_id)
    anew = dataclasses.replace(_failure(task_id=row.task_id), error_message="declined anew")
    # When its failure is written, then it is kept, in a row of its own
    written = write_failure(app, anew, taken.id, taken.sweep_id)
    assert written != row.id
    found = queue.get(written)
    assert found is not None and found.error_message == "declined anew"
    kept = queue.get(row.id)
    assert kept is not None and kept.status is DeadLetterStatus.SUCCEEDED
    # And a failure another sweep's message reports late (written once its database was back)
    # adds nothing: the row succeeded after it
    late = dataclasses.replace(anew, error_message="declined before")
    assert write_failure(app, late, taken.id, "an-earlier-sweep") == row.id
    assert queue.stats()["total"] == 2
