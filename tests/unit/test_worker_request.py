"""What the worker's request issues to a delivery, and how far the task trusts it."""

from __future__ import annotations

import json
import os
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from billiard.einfo import ExceptionInfo
from celery import Celery
from celery.app.task import Context
from celery.contrib.testing.mocks import TaskMessage
from celery.exceptions import TimeLimitExceeded

from idempotent_tasks import IdempotentTask
from idempotent_tasks import task as task_module
from idempotent_tasks.app_store import store_for
from idempotent_tasks.core import Attempt
from idempotent_tasks.dead_letters import DEAD_LETTER_HEADER, DEAD_LETTER_SWEEP_HEADER, republish
from idempotent_tasks.records import Outcome, Pickup, Status
from idempotent_tasks.worker_request import (
    ISSUED_BY,
    ISSUED_OWNER,
    IdempotentRequest,
    _owner_ids,
    issued_owner,
)


def _request(**fields: Any) -> Context:
    return Context({"id": "t-1", "args": [], "kwargs": {}, "delivery_info": {}, **fields})


def test_an_issued_owner_is_trusted_only_from_this_process_or_its_parent() -> None:
    assert issued_owner(_request(**{ISSUED_OWNER: "o", ISSUED_BY: os.getpid()})) == "o"
    assert issued_owner(_request(**{ISSUED_OWNER: "o", ISSUED_BY: os.getppid()})) == "o"
    # Stale entries a message carried in from elsewhere, or none at all
    assert issued_owner(_request(**{ISSUED_OWNER: "o", ISSUED_BY: 1})) is None
    assert issued_owner(_request(**{ISSUED_OWNER: "o"})) is None
    assert issued_owner(_request()) is None


def test_issued_owners_never_repeat_and_a_forked_child_issues_its_own() -> None:
    issued = {_owner_ids.issue() for _ in range(1000)}
    assert len(issued) == 1000 and all(len(owner) <= 64 for owner in issued)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its first id, then leave at once, whatever happens
        try:
            os.write(write, _owner_ids.issue().encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as from_child:
        child_owner = from_child.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert child_owner and child_owner[:24] != _owner_ids.issue()[:24]


def test_a_republished_message_carries_no_issued_owner() -> None:
    app = Celery("t", set_as_current=False, broker="memory://")

    @app.task(base=IdempotentTask, bind=True)
    def charge(self: Any, order_id: str) -> str:
        return order_id

    request = _request(**{ISSUED_OWNER: "o", ISSUED_BY: os.getpid(), "other": "kept"})
    headers = charge.signature_from_request(request).options["headers"]
    assert ISSUED_OWNER not in headers and ISSUED_BY not in headers
    assert headers["other"] == "kept"


@pytest.mark.parametrize(
    ("acks_on_timeout", "acks_on_failure_or_timeout", "requeues"),
    [
        # acks_on_timeout decides
        (False, True, True),
        (True, False, False),
        # unset, the deprecated acks_on_failure_or_timeout stands in for it
        (None, False, True),
        (None, True, False),
        (None, None, False),
    ],
)
def test_whether_celery_requeues_a_killed_call_follows_acks_on_timeout(
    acks_on_timeout: bool | None,
    acks_on_failure_or_timeout: bool | None,
    requeues: bool,
) -> None:
    task = SimpleNamespace(
        acks_late=True,
        acks_on_timeout=acks_on_timeout,
        acks_on_failure_or_timeout=acks_on_failure_or_timeout,
    )
    assert task_module._timeout_requeues(task) is requeues  # type: ignore[arg-type]
    task.acks_late = False
    assert task_module._timeout_requeues(task) is False  # type: ignore[arg-type]


def test_a_killed_call_celery_requeues_keeps_its_callbacks_and_chain_in_its_pickup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a keyed delivery, with a link, an errback and a chain in its message body, of a
    # task whose message Celery requeues when its hard time limit kills it
    app = Celery("requeues", set_as_current=False, broker="memory://")
    app.conf.update(idempotency_store_url="memory://", result_backend="cache+memory://")

    @app.task(
        base=IdempotentTask,
        acks_late=True,
        acks_on_timeout=False,
    )
    def overruns(name: str) -> str:
        return name

    @app.task
    def after(value: Any, note: str) -> str:
        return note

    link, errback, chained = (
        json.loads(json.dumps(after.s(note))) for note in ("linked", "errback", "chained")
    )
    message = TaskMessage(
        overruns.name,
        args=("n",),
        callbacks=[link],
        errbacks=[errback],
        chain=[chained],
        idempotency_key="k",
    )
    rejected: list[bool] = []
    request = IdempotentRequest(
        message,
        app=app,
        task=overruns,
        on_reject=lambda logger, errors, requeue: rejected.append(requeue),
    )
    # whose pool process claimed the key under the owner this worker issued it
    store = store_for(app)
    claim = overruns._claim_request(
        "k", ("n",), {}, request.id, owner=request.request_dict[ISSUED_OWNER]
    )
    assert store.claim(claim).outcome is Outcome.ACQUIRED
    released_with: list[Pickup | None] = []
    release_dead_owner = Attempt.release_dead_owner

    def spy(attempt: Attempt, pickup: Pickup | None = None) -> None:
        released_with.append(pickup)
        release_dead_owner(attempt, pickup)

    monkeypatch.setattr(Attempt, "release_dead_owner", spy)
    # When the worker's main process handles the hard time limit
    request.on_timeout(soft=False, timeout=1)
    # Then Celery requeued the message, and the key waits for it, queued
    assert rejected == [True]
    record = store.get(claim.storage_key)
    assert record is not None and record.status is Status.QUEUED
    # And the pickup that stands for it keeps the message's link, errback and chain
    (pickup,) = released_with
    assert pickup is not None
    options = json.loads(pickup.envelope)["options"]
    assert (options["link"], options["link_error"], options["chain"]) == (
        [link],
        [errback],
        [chained],
    )
    assert options["headers"]["idempotency_key"] == "k"


def test_a_dead_letters_retry_carries_its_row_and_sweep_through_republishes() -> None:
    app = Celery("sweep-headers", set_as_current=False, broker="memory://")

    @app.task(base=IdempotentTask, shared=False)
    def charge(order_id: str) -> str:
        return order_id

    # The sweep's publish names the row and the sweep that took it
    sent: dict[str, Any] = {}
    fake = SimpleNamespace(send_task=lambda name, **options: sent.update(options))
    item = SimpleNamespace(
        id="row-1",
        sweep_id="sweep-1",
        idempotency_key="k",
        args=["o"],
        kwargs={},
        task_name=charge.name,
        task_id="t-1",
        options={"queue": "celery"},
    )
    republish(fake, item)  # type: ignore[arg-type]
    assert sent["headers"] == {
        DEAD_LETTER_HEADER: "row-1",
        DEAD_LETTER_SWEEP_HEADER: "sweep-1",
        "idempotency_key": "k",
    }
    # and the retry's own re-publishes (a retry, a wait, a write-later) carry both along
    request = _request(**{DEAD_LETTER_HEADER: "row-1", DEAD_LETTER_SWEEP_HEADER: "sweep-1"})
    headers = charge.signature_from_request(request).options["headers"]
    assert (headers[DEAD_LETTER_HEADER], headers[DEAD_LETTER_SWEEP_HEADER]) == ("row-1", "sweep-1")


def test_a_dead_letters_retry_has_no_expiry_of_its_task_unless_its_row_keeps_one() -> None:
    queue = f"dead-letter-expiry-{uuid.uuid4().hex}"  # (memory:// queues are the whole process's)
    app = Celery("sweep-expiry", set_as_current=False, broker="memory://")

    @app.task(base=IdempotentTask, shared=False, expires=60)
    def charge(order_id: str) -> str:
        return order_id

    def sent_expiry(row_options: dict[str, Any]) -> Any:
        item = SimpleNamespace(
            id="row-1",
            sweep_id="sweep-1",
            idempotency_key=None,
            args=["o"],
            kwargs={},
            task_name=charge.name,
            task_id=str(uuid.uuid4()),
            options={"queue": queue, **row_options},
        )
        republish(app, item)  # type: ignore[arg-type]
        with app.connection_for_read() as connection:
            message = connection.SimpleQueue(queue).get(timeout=1)
        message.ack()
        assert message.headers["id"] == item.task_id
        return message.headers["expires"]

    # A retry sent from a process that has the task (whose own expiry Celery's send_task
    # gives every message) runs whenever it is taken, as the README says: its queue may be long
    assert sent_expiry({}) is None
    # while a row that keeps its call's own expiry (an unknown task's) sends it as it was
    assert sent_expiry({"expires": "2999-01-01T00:00:00+00:00"}) == "2999-01-01T00:00:00+00:00"


def _watched_delivery(monkeypatch: pytest.MonkeyPatch) -> tuple[IdempotentRequest, list[str]]:
    """A keyed delivery of an ``acks_late`` task (Celery acknowledges its message when its
    hard time limit kills it, by default), and the list of what happens to it: its message
    acknowledged, the call ended as killed."""
    app = Celery("acks", set_as_current=False, broker="memory://")
    app.conf.update(idempotency_store_url="memory://", result_backend="cache+memory://")

    @app.task(base=IdempotentTask, shared=False, acks_late=True)
    def overruns(name: str) -> str:
        return name

    happened: list[str] = []
    request = IdempotentRequest(
        TaskMessage(overruns.name, args=("n",), idempotency_key="k"),
        app=app,
        task=overruns,
        on_ack=lambda logger, errors: happened.append("acknowledged"),
    )
    monkeypatch.setattr(
        overruns,
        "end_killed_call",
        lambda request_dict, exc: happened.append(f"ended: {type(exc).__name__}"),
    )
    return request, happened


def _time_limit_exceeded() -> ExceptionInfo:
    try:
        raise TimeLimitExceeded(1.0)
    except TimeLimitExceeded:
        return ExceptionInfo()


def test_a_call_killed_at_its_hard_time_limit_is_ended_before_its_message_is_acknowledged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    request, happened = _watched_delivery(monkeypatch)
    # When billiard fails the call at its hard time limit, then calls the timeout handler
    # (its order: billiard.pool.Pool.on_hard_timeout)
    request.on_failure(_time_limit_exceeded())
    request.on_timeout(soft=False, timeout=1.0)
    # Then the call was ended (dead-lettered, its key released) before its message went, once
    assert happened == ["ended: TimeLimitExceeded", "acknowledged"]


def test_a_body_that_raises_time_limit_exceeded_itself_is_not_taken_for_a_killed_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    request, happened = _watched_delivery(monkeypatch)
    # When the body raised TimeLimitExceeded itself (a result it waited for failed so), which
    # Celery hands on as a failure of the body
    request.on_success((True, _time_limit_exceeded(), 0.01))
    # Then its pool process is not killed, nor the call ended again: its own code ended it
    assert happened == ["acknowledged"]
