"""An owner whose claim was taken over while its body ran waits for the new owner, whatever
the task's ``on_duplicate``: it is no duplicate caller, and its body succeeded."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import celery
import pytest
from celery import Celery
from celery.exceptions import Ignore, Retry

from idempotent_tasks import IdempotencyConflict, IdempotentTask
from idempotent_tasks.app_store import store_for
from idempotent_tasks.dead_letters import DEAD_LETTER_HEADER, DEAD_LETTER_SWEEP_HEADER, dlq_for
from idempotent_tasks.replacements import REPLACED, WAIT_SINCE_HEADER
from idempotent_tasks.task import (
    _REPUBLISH,
    KEY_HEADER,
    PREVIOUS_OWNER_HEADER,
    RESERVED_HEADER,
    SUPERSEDED_HEADER,
    WAITS_HEADER,
)
from tests.dead_letter_rows import taken_row


@pytest.fixture()
def app() -> Celery:
    app = Celery("superseded", set_as_current=False, broker="memory://")
    app.conf.update(idempotency_store_url="memory://", result_backend="cache+memory://")
    return app


def _sent_by_a_sweep(app: Celery, task_name: str) -> dict[str, Any]:
    """The headers of a dead letter's retry a sweep just sent (its row taken, ``retrying``)."""
    taken = taken_row(
        dlq_for(app), task_name=task_name, task_id="task-of-the-slow-call", key="key-3", args=["k"]
    )
    return {DEAD_LETTER_HEADER: taken.id, DEAD_LETTER_SWEEP_HEADER: taken.sweep_id}


def _deliver(task: Any, key: str, headers: dict[str, Any], **request: Any) -> Any:
    """Run ``task`` as a worker runs a delivered message with ``headers`` (and ``request``
    fields, such as its ``delivery_info``)."""
    task.push_request(
        **{
            "id": "task-of-the-taken-over-owner",
            "args": ("k",),
            "kwargs": {},
            "headers": {KEY_HEADER: key, **headers},
            "called_directly": False,
            "delivery_info": {"routing_key": "celery", "exchange": ""},
            "retries": 0,
            **request,
        }
    )
    try:
        return task("k")
    finally:
        task.pop_request()


def _held_by_another_call(task: Any, key: str) -> None:
    """Make ``key`` claimed, running, by another call (another task id)."""
    other = task._claim_request(key, ("k",), {}, "task-of-the-other-call", owner="other")
    assert store_for(task.app).claim(other).outcome.value == "acquired"


@pytest.mark.parametrize("on_duplicate", ["skip", "raise"])
def test_a_taken_over_owner_waits_for_the_new_one_whatever_on_duplicate(
    app: Celery, on_duplicate: str
) -> None:
    @app.task(base=IdempotentTask, on_duplicate=on_duplicate, shared=False)
    def charge(order: str) -> str:
        return order

    # Given a key another execution (another task id) holds, running
    _held_by_another_call(charge, "key-1")
    # When the owner it took the key over from comes back to wait for its value
    with pytest.raises(Retry):
        _deliver(charge, "key-1", {SUPERSEDED_HEADER: True})
    # Then it waits (a Retry), where a plain duplicate is handled per on_duplicate
    with pytest.raises(Ignore if on_duplicate == "skip" else IdempotencyConflict):
        _deliver(charge, "key-1", {})


@pytest.mark.parametrize("on_duplicate", ["skip", "raise"])
@pytest.mark.parametrize(
    "delivery",
    [
        {"headers": {RESERVED_HEADER: True}},
        {"delivery_info": {"redelivered": True}},
        {"headers": {PREVIOUS_OWNER_HEADER: "first-owner"}},
        {"dead_letter": True},
    ],
    ids=["reserved-for-it", "redelivered", "a-retry", "a-dead-letters-retry"],
)
def test_the_keys_own_message_a_redelivery_or_a_retry_waits_whatever_on_duplicate(
    app: Celery, on_duplicate: str, delivery: dict[str, Any], tmp_path: Path
) -> None:
    app.conf.idempotency_dlq_url = f"sqlite:///{tmp_path / 'dlq.db'}"  # (a retry renews its row)

    @app.task(base=IdempotentTask, on_duplicate=on_duplicate, shared=False)
    def charge(order: str) -> str:
        return order

    headers = delivery.get("headers", {})
    if delivery.get("dead_letter"):
        headers = _sent_by_a_sweep(app, charge.name)

    # Given a key another call took (the message it was queued for was slow to arrive, its
    # owner died and the broker redelivers it, or it retried and its key was free meanwhile)
    _held_by_another_call(charge, "key-3")
    # When it arrives, then it waits for the value (a Retry), and its copy waits too
    with pytest.raises(Retry) as waited:
        _deliver(
            charge,
            "key-3",
            headers,
            id="task-of-the-slow-call",
            delivery_info={"routing_key": "celery", **delivery.get("delivery_info", {})},
        )
    assert waited.value.sig.options[_REPUBLISH][SUPERSEDED_HEADER] is True


def test_apply_async_marks_only_the_message_its_key_is_queued_for(app: Celery) -> None:
    @app.task(base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        return order

    sent: list[dict[str, Any]] = []

    def record_publish(self: Any, *args: Any, **options: Any) -> None:
        sent.append(options["headers"])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(celery.Task, "apply_async", record_publish)  # the broker's side of it
        charge.apply_async(("k",), idempotency_key="key-4")
        charge.apply_async(("k",), idempotency_key="key-4", link=charge.s())
    assert sent[0][RESERVED_HEADER] is True
    assert RESERVED_HEADER not in sent[1]  # published for its callback, as a duplicate


def _replaced_key(task: Any, key: str) -> None:
    """Make ``key`` completed by a call that replaced itself (its task id ``replaced-call``)."""
    call = task._claim_request(key, ("k",), {}, "replaced-call", owner="replaced")
    store = store_for(task.app)
    token = store.claim(call).token
    encoded, _ = task._codec.encode(REPLACED)
    assert store.complete(call, token, encoded).value == "stored"


@pytest.mark.parametrize("backend", [None, "cache+memory://"])
def test_a_duplicate_of_a_replaced_call_waits_at_most_its_lease_for_the_result(
    backend: str | None,
) -> None:
    app = Celery("replaced", set_as_current=False, broker="memory://", backend=backend)
    app.conf.update(idempotency_store_url="memory://", idempotency_lease=60)

    @app.task(base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        return order

    _replaced_key(charge, "key-3")
    if backend is None:
        # No result backend to read the replacement's result from: answered with None
        assert _deliver(charge, "key-3", {}) is None
        return
    # The replacement's result not there yet: it waits (a Retry, a growing countdown) ...
    with pytest.raises(Retry) as waited:
        _deliver(charge, "key-3", {})
    assert waited.value.sig.options[_REPUBLISH][WAITS_HEADER] == 1
    # ... but not past the lease: then it is answered with None, rather than wait for ever
    assert _deliver(charge, "key-3", {WAIT_SINCE_HEADER: time.time() - 61}) is None


def test_a_skipping_replacement_waits_for_the_value_its_replaced_task_is_owed(app: Celery) -> None:
    @app.task(base=IdempotentTask, on_duplicate="skip", shared=False)
    def charge(order: str) -> str:
        return order

    # Given a key another call holds, running
    _held_by_another_call(charge, "key-5")
    # When a call that replaced a task (Task.replace: its callers wait on it) is a duplicate,
    # then it waits for the value rather than be dropped
    with pytest.raises(Retry):
        _deliver(charge, "key-5", {}, id="the-replacement", replaced_task_nesting=1)
    # (a plain duplicate is dropped, as skip says)
    with pytest.raises(Ignore):
        _deliver(charge, "key-5", {})


@pytest.mark.parametrize("state", ["PENDING", "FAILURE", "SUCCESS"])
def test_the_taken_over_call_is_answered_unless_it_has_a_result_already(
    app: Celery, state: str
) -> None:
    @app.task(base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        return order

    # Given the call whose key this one took over, in that state (an id of this test's own:
    # the memory cache outlives the app)
    taken_over = f"taken-over-call-{uuid.uuid4()}"
    backend = charge.backend
    if state == "FAILURE":
        backend.store_result(taken_over, RuntimeError("declined"), state)
    elif state == "SUCCESS":
        backend.store_result(taken_over, "its own value", state)
    # When this call answers it
    charge.push_request(id="this-call", called_directly=False, is_eager=False)
    try:
        charge._answer_taken_over_call(taken_over, "the key's value")
    finally:
        charge.pop_request()
    # Then a call without a result gets the key's value; one that ended keeps its own
    answered = backend.get_task_meta(taken_over)
    if state == "PENDING":
        assert (answered["status"], answered["result"]) == ("SUCCESS", "the key's value")
    else:
        assert answered["status"] == state
        assert answered["result"] != "the key's value"


def test_an_rpc_backend_never_answers_a_taken_over_call_for_another_caller() -> None:
    app = Celery("rpc-answer", set_as_current=False, broker="memory://", backend="rpc://")
    app.conf.update(idempotency_store_url="memory://")

    @app.task(base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        return order

    sent: list[Any] = []
    charge.backend.store_result = lambda *args, **kwargs: sent.append(args)  # type: ignore[method-assign]
    charge.push_request(id="this-call", called_directly=False, is_eager=False)
    try:
        charge._answer_taken_over_call("taken-over-call", "the key's value")
    finally:
        charge.pop_request()
    assert sent == []  # rpc:// would reply to this call's caller, not that one's
