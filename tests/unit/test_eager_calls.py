"""Keyed calls run eagerly (``task.apply()``, ``task_always_eager``): no copy of the call is ever
published to wait or to try again; the caller gets the error."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Reject
from celery.signals import after_task_publish
from celery.utils.log import task_logger
from pydantic import BaseModel

from idempotent_tasks import IdempotentTask, StoreUnavailable
from idempotent_tasks.app_store import store_for
from idempotent_tasks.core import Attempt
from idempotent_tasks.keys import storage_key
from idempotent_tasks.replacements import REPLACED
from idempotent_tasks.task import KEY_HEADER


@pytest.fixture()
def published() -> Iterator[list[Any]]:
    sent: list[Any] = []

    def count(**message: Any) -> None:
        sent.append(message)

    after_task_publish.connect(count, weak=False)
    yield sent
    after_task_publish.disconnect(count)


def test_an_eager_call_meeting_a_store_down_fails_and_publishes_nothing(
    monkeypatch: pytest.MonkeyPatch, published: list[Any]
) -> None:
    app = Celery("eager", set_as_current=False, broker="memory://")
    app.conf.update(idempotency_store_url="memory://", result_backend="cache+memory://")
    runs: list[str] = []

    @app.task(base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        runs.append(order)
        return order

    def down(self: Attempt) -> None:
        raise StoreUnavailable("store down")

    monkeypatch.setattr(Attempt, "claim", down)
    # When a keyed call runs eagerly while the store is down
    result = charge.apply(("o-1",), headers={KEY_HEADER: "k"})
    # Then it fails with the store's error: not run unclaimed, nothing sent to a broker, and
    # not re-run in a loop until Python's recursion limit
    assert result.state == "FAILURE"
    assert isinstance(result.result, StoreUnavailable)
    assert runs == []
    assert published == []


def test_an_eager_call_failing_while_the_dead_letter_database_is_down_raises_its_own_error(
    tmp_path: Any, published: list[Any]
) -> None:
    app = Celery("eager-dlq", set_as_current=False, broker="memory://")
    app.conf.update(
        idempotency_store_url="memory://",
        result_backend="cache+memory://",
        # A directory where the SQLite file should be: the database cannot be opened
        idempotency_dlq_url=f"sqlite:///{tmp_path}",
    )

    @app.task(base=IdempotentTask, shared=False)
    def declines(order: str) -> None:
        raise LookupError(f"{order} declined")

    result = declines.apply(("o-2",), headers={KEY_HEADER: "k"})
    assert result.state == "FAILURE"
    assert isinstance(result.result, LookupError)
    assert published == []


@pytest.mark.parametrize("acks_late", [True, False])
def test_a_call_that_rejects_with_requeue_leaves_no_queued_key_unless_its_message_goes_back(
    acks_late: bool,
) -> None:
    app = Celery("eager-reject", set_as_current=False, broker="memory://")
    app.conf.update(idempotency_store_url="memory://", result_backend="cache+memory://")

    @app.task(base=IdempotentTask, shared=False, acks_late=acks_late)
    def rejects(order: str) -> None:
        raise Reject("not now", requeue=True)

    # Eagerly there is no broker to hand the message back to: the key is free again
    rejects.apply(("o-3",), headers={KEY_HEADER: "k"})
    assert store_for(app).get(storage_key(rejects.name, "k")) is None
    # In a worker, the message goes back only when it was not acknowledged yet (late acks)
    rejects.push_request(
        id="t-r",
        args=["o-3"],
        kwargs={},
        headers={KEY_HEADER: "k"},
        called_directly=False,
        delivery_info={"exchange": "", "routing_key": "celery"},
        retries=0,
    )
    try:
        with pytest.raises(Reject):
            rejects("o-3")
    finally:
        rejects.pop_request()
    record = store_for(app).get(storage_key(rejects.name, "k"))
    assert (record is not None) is acks_late


def test_apply_and_a_signatures_apply_claim_the_key_they_are_given() -> None:
    app = Celery("eager-apply", set_as_current=False, broker="memory://")
    app.conf.update(idempotency_store_url="memory://", result_backend="cache+memory://")
    runs: list[str] = []

    @app.task(base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        runs.append(order)
        return f"charged {order}"

    # Given a call run here and now under a key
    assert charge.apply(("o-1",), idempotency_key="k").get() == "charged o-1"
    # When the key is run again, by apply or a signature's apply
    again = charge.apply(("o-1",), idempotency_key="k")
    by_signature = charge.s("o-1").set(idempotency_key="k").apply()
    # Then the body ran once and each gets its value; a bad key is refused before running
    assert again.get() == by_signature.get() == "charged o-1"
    assert runs == ["o-1"]
    assert store_for(app).get(storage_key(charge.name, "k")) is not None
    with pytest.raises(ValueError):
        charge.apply(("o-2",), idempotency_key=42)
    with pytest.raises(ValueError, match="not None"):
        charge.apply(("o-2",), idempotency_key=None)
    with pytest.raises(ValueError, match="not None"):
        charge.s("o-2").set(idempotency_key=None).apply()
    with pytest.raises(ValueError, match="not None"):
        charge.apply(("o-2",), headers={"idempotency_key": None})
    with pytest.raises(ValueError, match="not int"):
        charge.apply(("o-2",), headers={"idempotency_key": 42})
    assert runs == ["o-1"]
    # And a key given as the header, as apply_async takes it too, is claimed
    assert charge.apply(("o-1",), headers={"idempotency_key": "k"}).get() == "charged o-1"
    assert runs == ["o-1"]


@pytest.mark.parametrize("per_call_key", [False, True], ids=["task-key", "caller-key"])
def test_an_eager_call_that_replaces_itself_runs_each_replacement(per_call_key: bool) -> None:
    app = Celery("eager-replace", set_as_current=False, broker="memory://")
    app.conf.update(idempotency_store_url="memory://", result_backend="cache+memory://")
    runs: list[int] = []

    @app.task(base=IdempotentTask, bind=True, shared=False, idempotency_key="loop:{name}")
    def loop(self: Any, name: str, left: int) -> Any:
        runs.append(left)
        if left > 0:
            return self.replace(self.si(name, left - 1))  # eager: runs it, returns its value
        return name

    options = {"idempotency_key": "mine"} if per_call_key else {}
    # When a polling loop runs here and now, then each replacement runs, once
    assert loop.apply(("n", 2), **options).get() == "n"
    assert runs == [2, 1, 0]
    # And the loop's key holds its last value
    again = loop.apply(("n", 2), **options)
    assert again.get() == "n"
    assert runs == [2, 1, 0]


def test_the_claim_s_warnings_go_through_celery_s_task_logger(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (a worker's task logger prefixes each line with the task's name and id; a worker
    # started earlier in this process left it at ERROR, not propagating to caplog's handler)
    monkeypatch.setattr(task_logger, "propagate", True)
    app = Celery("eager-log", set_as_current=False, broker="memory://")
    app.conf.update(
        idempotency_store_url="memory://",
        result_backend="cache+memory://",
        idempotency_result_max_bytes=10,
    )

    @app.task(base=IdempotentTask, shared=False)
    def big() -> str:
        return "z" * 100

    # When a keyed call's result is too big to cache
    with caplog.at_level("WARNING", logger=task_logger.name):
        assert big.apply(headers={KEY_HEADER: "k"}).get() == "z" * 100
    # Then the warning saying so comes from a Celery task logger
    warned = [record for record in caplog.records if "not cached" in record.getMessage()]
    assert warned
    assert all(logging.getLogger(record.name).parent is task_logger for record in warned)


class _Order(BaseModel):
    """A model of a pydantic=True task (at module level: Celery resolves the annotation)."""

    order_id: int


class _Shadowed(IdempotentTask):
    def shadow_name(self, args: Any, kwargs: Any, options: Any) -> str:
        return f"charge {args[0].order_id}"


def test_a_pydantic_tasks_shadow_name_reads_the_models_it_was_called_with() -> None:
    app = Celery("pydantic-shadow", set_as_current=False, broker="memory://")
    app.conf.update(task_always_eager=True, idempotency_store_url="memory://")

    @app.task(base=_Shadowed, pydantic=True, shared=False)
    def charge(order: _Order) -> int:
        return order.order_id

    # Celery names the call before it dumps the models: so must a keyed call
    assert charge.apply_async((_Order(order_id=7),), idempotency_key="k-7").get() == 7


def test_an_eager_call_taken_over_by_a_call_that_replaced_itself_gets_no_marker() -> None:
    app = Celery("eager-replaced", set_as_current=False, broker="memory://")
    app.conf.update(task_always_eager=True, idempotency_store_url="memory://")

    @app.task(base=IdempotentTask, bind=True, shared=False)
    def charge(self: Any, order: str) -> str:
        # While the body runs, another execution takes the key over and replaces itself
        store = store_for(app)
        record = store.get(storage_key(self.name, "k-1"))
        assert record is not None
        taker = self._claim_request(
            "k-1", (order,), {}, "other", owner="taker", previous_owner=record.owner
        )
        taken = store.claim(taker)
        store.complete(taker, taken.token, self._codec.encode(REPLACED)[0])
        return f"charged {order}"

    # Then the eager caller is answered as an eager duplicate of the key would be (no backend
    # here to read the replacement's value from: None), not handed the internal marker
    assert charge.apply_async(("o-1",), idempotency_key="k-1").get() is None


def test_a_keyed_call_sent_with_a_task_id_no_store_holds_fails_running_nothing() -> None:
    # Given a keyed message whose task id holds a NUL (sent by other means than apply_async,
    # which refuses it)
    app = Celery("eager-nul", set_as_current=False, broker="memory://")
    app.conf.update(idempotency_store_url="memory://", result_backend="cache+memory://")
    runs: list[str] = []

    @app.task(base=IdempotentTask, shared=False, dlq=False)
    def charge(order: str) -> str:
        runs.append(order)
        return order

    # When it runs, then it fails for good with a clear error, its body never run
    result = charge.apply(("o-1",), task_id="t-\x00-1", headers={KEY_HEADER: "order-1"})
    assert isinstance(result.result, ValueError) and "NUL" in str(result.result)
    assert runs == []


def test_an_eager_call_without_the_key_its_task_requires_fails_and_runs_nothing(
    published: list[Any],
) -> None:
    app = Celery("eager-required", set_as_current=False, broker="memory://")
    app.conf.update(idempotency_store_url="memory://", result_backend="cache+memory://")
    runs: list[str] = []

    @app.task(base=IdempotentTask, shared=False, idempotency_key_required=True)
    def charge(order: str) -> str:
        runs.append(order)
        return order

    # When a task that requires a key is applied here without one
    result = charge.apply(("o-1",))
    # Then it fails as apply_async would have refused it, and runs nothing
    assert result.state == "FAILURE"
    assert isinstance(result.result, ValueError)
    assert "requires an idempotency key" in str(result.result)
    assert runs == []
    assert published == []
    # With a key it runs
    assert charge.apply(("o-1",), idempotency_key="k").get() == "o-1"
    assert runs == ["o-1"]
