"""Duplicates with real prefork workers on real Redis: the body runs once, callers agree."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from celery import Celery, chain, chord, group
from celery.app.task import Context
from celery.exceptions import NotRegistered
from celery.result import AsyncResult, EagerResult

from idempotent_tasks import IdempotencyConflict, IdempotencyKeyMismatch, IdempotentTask
from idempotent_tasks.app_store import dlq_for, store_for
from idempotent_tasks.keys import storage_key
from idempotent_tasks.records import Outcome
from idempotent_tasks.revocations import end_revoked_call
from tests.integration import worker_app
from tests.integration.helpers import (
    IDLE_QUEUE,
    charge_at_once,
    fresh,
    ledger_events,
    queue_length,
    set_pickup_timeout,
    wait_until,
)
from tests.integration.workers import WorkerProcess

pytestmark = pytest.mark.usefixtures("two_workers")
charge = worker_app.charge


def test_thirty_duplicates_at_once_on_two_workers_run_the_body_once() -> None:
    # Given 30 callers publishing the same key at the same moment
    order, key = fresh("order"), fresh("key")
    # When every result is collected
    values = charge_at_once(30, order, key)
    # Then the body ran once and every caller got its value
    assert ledger_events(order, "start") == 1
    assert ledger_events(order, "finish") == 1
    assert all(value == values[0] for value in values)
    assert values[0]["order_id"] == order


def test_duplicates_reach_both_workers_and_still_run_once(
    two_workers: list[WorkerProcess],
) -> None:
    # Given a keyed call running, and ten duplicates sent by name (no publish-side look, so
    # each reaches a worker; a worker holds two messages at most, so both workers get some)
    order, key = fresh("order"), fresh("key")
    owner = charge.apply_async((order, 5), {"sleep": 1.0}, idempotency_key=key)
    duplicates = [
        worker_app.app.send_task(
            charge.name, (order, 5), {"sleep": 1.0}, headers={"idempotency_key": key}
        )
        for _ in range(10)
    ]
    # When every result is collected
    values = [result.get(timeout=60) for result in (owner, *duplicates)]
    # Then the body ran once, every caller got its value, and both workers took duplicates
    assert ledger_events(order, "start") == 1
    assert all(value == values[0] for value in values)
    received = [
        worker
        for worker in two_workers
        if any(f"[{duplicate.id}] received" in worker.log() for duplicate in duplicates)
    ]
    assert len(received) == 2


def test_completed_key_returns_the_cached_value_and_publishes_nothing() -> None:
    order, key = fresh("order"), fresh("key")
    first = charge.apply_async((order, 10), idempotency_key=key)
    value = first.get(timeout=30)
    # A later duplicate (sent to a queue no one reads, so a publish would show there)
    again = charge.apply_async((order, 10), idempotency_key=key, queue=IDLE_QUEUE)
    assert isinstance(again, EagerResult)
    assert again.id == first.id
    assert again.get() == value
    assert queue_length(IDLE_QUEUE) == 0
    assert ledger_events(order, "start") == 1


def test_key_in_progress_returns_the_owners_result() -> None:
    order, key = fresh("order"), fresh("key")
    owner = charge.apply_async((order, 10), {"sleep": 2.0}, idempotency_key=key)
    while ledger_events(order, "start") == 0:
        pass
    duplicate = charge.apply_async(
        (order, 10), {"sleep": 2.0}, idempotency_key=key, queue=IDLE_QUEUE
    )
    assert isinstance(duplicate, AsyncResult)
    assert not isinstance(duplicate, EagerResult)
    assert duplicate.id == owner.id
    assert queue_length(IDLE_QUEUE) == 0
    assert duplicate.get(timeout=30) == owner.get(timeout=30)


def test_canvas_signature_carries_the_key() -> None:
    order, key = fresh("order"), fresh("key")
    first = charge.s(order, 3).set(idempotency_key=key).delay()
    second = charge.s(order, 3).set(idempotency_key=key).delay()
    assert first.get(timeout=30) == second.get(timeout=30)
    assert ledger_events(order, "start") == 1


def test_a_canvas_call_of_a_completed_key_is_published_so_its_chain_runs() -> None:
    # Given a completed key
    order, key = fresh("order"), fresh("key")
    value = charge.apply_async((order, 10), idempotency_key=key).get(timeout=30)
    # When it is called again as the first step of a chain, and with a link
    chained = (charge.s(order, 10).set(idempotency_key=key) | worker_app.plain.s()).delay()
    linked = charge.apply_async(
        (order, 10), idempotency_key=key, link=worker_app.noted_callback.s(order)
    )
    # Then the chain's next step runs on the cached value, and the link runs
    assert chained.get(timeout=30) == value
    assert linked.get(timeout=30) == value
    wait_until(lambda: ledger_events(order, "callback") == 1, 30, "the link")
    # And the body itself still ran once
    assert ledger_events(order, "start") == 1


def test_a_completed_key_as_a_chains_last_step_or_a_replacement_gives_its_value() -> None:
    # Given a completed key
    name, key = fresh("last"), fresh("key")
    assert worker_app.ledgered.apply_async((name,), idempotency_key=key).get(timeout=30) == name
    # When it is called again as a chain's last step (whose task id is the chain's result),
    # and as the task another one replaces itself with (which takes that one's task id)
    last = (worker_app.plain.si(1) | worker_app.ledgered.si(name).set(idempotency_key=key))()
    replaced = worker_app.replaced_by_ledgered.delay(name, key)
    # Then both give the cached value, and the body ran once
    assert last.get(timeout=30) == name
    assert replaced.get(timeout=30) == name
    assert ledger_events(name, "start") == 1


def test_a_group_and_a_chord_collect_a_completed_keys_cached_value() -> None:
    order, key = fresh("order"), fresh("key")
    value = charge.apply_async((order, 10), idempotency_key=key).get(timeout=30)
    # Each part's result is read by the task id the group gave it
    parts = group(charge.s(order, 10).set(idempotency_key=key), worker_app.plain.s(5))
    assert parts.apply_async().get(timeout=30) == [value, 5]
    assert chord(parts)(worker_app.plain.s()).get(timeout=30) == [value, 5]
    assert ledger_events(order, "start") == 1


def test_a_call_that_replaced_itself_keeps_its_key_and_duplicates_get_the_replacements_value() -> (
    None
):
    # Given a keyed call whose body did its work and replaced itself (Task.replace)
    name, key = fresh("replacing"), fresh("key")
    first = worker_app.replaces_itself.apply_async((name,), idempotency_key=key)
    assert first.get(timeout=30) == len(name)
    # When the key is called again, at publish time or as a message the worker gets
    again = worker_app.replaces_itself.apply_async((name,), idempotency_key=key)
    sent = worker_app.app.send_task(
        worker_app.replaces_itself.name, (name,), headers={"idempotency_key": key}
    )
    # Then the body does not run again, and every caller gets the replacement's value
    assert again.id == first.id
    assert again.get(timeout=30) == len(name)
    assert sent.get(timeout=30) == len(name)
    assert ledger_events(name, "start") == 1


def test_a_duplicate_of_a_call_whose_replacement_still_runs_waits_for_its_value() -> None:
    # Given a keyed call that replaced itself with a task still running
    name, key = fresh("replacing"), fresh("key")
    first = worker_app.replaces_itself.apply_async((name, 2.0), idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 30, "the call's start")
    time.sleep(0.5)
    # When a duplicate reaches a worker meanwhile, then it waits for the replacement's value
    sent = worker_app.app.send_task(
        worker_app.replaces_itself.name, (name, 2.0), headers={"idempotency_key": key}
    )
    assert sent.get(timeout=30) == first.get(timeout=30) == len(name)
    assert ledger_events(name, "start") == 1


def test_a_task_that_replaces_itself_under_its_own_key_runs_each_replacement() -> None:
    # A polling loop: each replacement is the same task, its key derived the same
    name = fresh("countdown")
    result = worker_app.counts_down.apply_async((name, 2))
    assert result.get(timeout=30) == name
    assert ledger_events(name, "start") == 3


def _called_again(task: Any, name: str, key: str, *more: Any) -> AsyncResult:
    """Call ``task`` with ``key`` to its end, then again: the second call must be answered
    with the first one's task id and value (``name``). Returns the first call's result."""
    result = task.apply_async((name, *more), idempotency_key=key)
    assert result.get(timeout=30) == name
    again = task.apply_async((name, *more), idempotency_key=key)
    assert again.id == result.id
    assert again.get(timeout=30) == name
    return result


def test_a_call_keyed_by_its_caller_that_replaces_itself_keeps_that_key_to_its_end() -> None:
    # Given a polling loop called with a key of its caller's (not the one its task derives),
    # when the call is made again with that key, then it is answered with the loop's last
    # value: no run of the loop began anew
    name, key = fresh("countdown"), fresh("key")
    result = _called_again(worker_app.counts_down, name, key, 2)
    assert ledger_events(name, "start") == 3
    record = store_for(worker_app.app).get(storage_key(worker_app.counts_down.name, key))
    assert record is not None and record.task_id == result.id


def test_a_polling_loop_sent_with_an_expiry_keeps_its_key_past_it() -> None:
    # Given a keyed polling loop whose call expires 4 s after it was sent (time enough for the
    # subprocess worker to receive it on a loaded machine: one received past it is dropped
    # unseen); Celery sends its replacements (4 s apart) without that expiry
    name, key = fresh("polls"), fresh("key")
    sent = time.monotonic()
    first = worker_app.polls.apply_async((name, 2, 4.0), idempotency_key=key, expires=4.0)
    wait_until(lambda: ledger_events(name, "start") == 1, 10, "the loop's first turn")
    time.sleep(max(0.0, sent + 4.5 - time.monotonic()))
    # When the key is called again past that expiry, while the loop waits for its next turn
    # (its last begins 8 s after the first, which began after the call was sent)
    again = worker_app.polls.apply_async((name, 2, 4.0), idempotency_key=key)
    # Then it is answered with the loop's result: no run of the loop began anew
    assert again.id == first.id
    assert first.get(timeout=30) == again.get(timeout=30) == name
    assert ledger_events(name, "start") == 3


def test_a_call_whose_replacement_has_a_key_of_its_own_keeps_its_key_done() -> None:
    # Given a keyed call that replaced itself with itself under another key, when its key is
    # called again, then it gets the replacement's value, running nothing
    name, key = fresh("rekeyed"), fresh("key")
    _called_again(worker_app.rekeys_itself, name, key, 1)
    assert ledger_events(name, "start") == 2


def test_a_chain_step_that_replaces_itself_runs_each_replacement_then_the_chain_goes_on() -> None:
    # A polling loop that is one step of a chain: Celery makes each replacement a chain of
    # the replacement and the steps after it
    name = fresh("chained-countdown")
    result = (worker_app.counts_down.s(name, 2) | worker_app.noted_callback.s(name)).apply_async()
    wait_until(lambda: ledger_events(name, "callback") == 1, 30, "the chain's next step")
    assert result.get(timeout=30) is None
    assert ledger_events(name, "start") == 3


def test_a_linked_call_of_a_key_in_progress_waits_for_the_owner_then_runs_its_link() -> None:
    order, key = fresh("order"), fresh("key")
    owner = charge.apply_async((order, 10), {"sleep": 2.0}, idempotency_key=key)
    wait_until(lambda: ledger_events(order, "start") == 1, 30, "the owner's start")
    duplicate = charge.apply_async(
        (order, 10), {"sleep": 2.0}, idempotency_key=key, link=worker_app.noted_callback.s(order)
    )
    assert duplicate.id != owner.id
    assert duplicate.get(timeout=30) == owner.get(timeout=30)
    wait_until(lambda: ledger_events(order, "callback") == 1, 30, "the link")
    assert ledger_events(order, "start") == 1


def test_a_call_that_expired_before_it_ran_frees_its_key() -> None:
    # Given a keyed call that expires before its countdown lets it run
    name, key = fresh("expired"), fresh("key")
    result = worker_app.ledgered.apply_async(
        (name,), idempotency_key=key, countdown=1.5, expires=0.5
    )
    # When the worker discards it at its eta, then the key is free again (nothing queued for
    # the pickup guard to publish later) and the call ran nothing
    store, stored_as = store_for(worker_app.app), storage_key(worker_app.ledgered.name, key)
    wait_until(lambda: store.get(stored_as) is None, 30, "the reservation cancelled")
    assert AsyncResult(result.id, app=worker_app.app).state == "REVOKED"
    assert ledger_events(name, "start") == 0
    # And a later call under the key runs
    assert worker_app.ledgered.apply_async((name,), idempotency_key=key).get(timeout=30) == name


def test_a_revoked_call_whose_owner_is_gone_releases_its_key() -> None:
    # Given the claim of a call that was terminated while it ran, its lease over
    # (as when the pickup guard's copy of it comes back and is discarded as revoked)
    task, key, task_id = worker_app.ledgered, fresh("key"), fresh("task")
    store = store_for(worker_app.app)
    gone = dataclasses.replace(
        task._claim_request(key, ("n",), {}, task_id, owner=fresh("owner")), lease_seconds=0.2
    )
    assert store.claim(gone).outcome is Outcome.ACQUIRED
    live = task._claim_request(fresh("key"), ("n",), {}, task_id, owner=fresh("owner"))
    assert store.claim(live).outcome is Outcome.ACQUIRED
    time.sleep(0.3)

    def revoked(call_key: str) -> Context:
        return Context(id=task_id, args=["n"], kwargs={}, idempotency_key=call_key)

    # When the worker reports the call revoked, then the dead owner's claim is released
    end_revoked_call(task, revoked(key))
    assert store.get(gone.storage_key) is None
    # And a claim whose lease still runs (its process may not be gone yet) is kept
    end_revoked_call(task, revoked(live.key))
    record = store.get(live.storage_key)
    assert record is not None and record.owner == live.owner


def test_positional_and_keyword_calls_share_a_fingerprint() -> None:
    order, key = fresh("order"), fresh("key")
    value = charge.apply_async((order, 7), idempotency_key=key).get(timeout=30)
    assert (
        charge.apply_async(
            (), {"order_id": order, "amount": 7, "sleep": 0.0}, idempotency_key=key
        ).get(timeout=30)
        == value
    )
    assert ledger_events(order, "start") == 1


@pytest.mark.parametrize("task_id", ["a new one", "the first call's"])
def test_key_reused_with_other_arguments_is_refused_at_publish(task_id: str) -> None:
    order, key = fresh("order"), fresh("key")
    first = charge.apply_async((order, 10), idempotency_key=key)
    first.get(timeout=30)
    # (A caller that picks its task ids is refused too: only the call's own replacement, which
    # names the claim it goes on from, may take its key with other arguments.)
    same_id = {"task_id": first.id} if task_id == "the first call's" else {}
    with pytest.raises(IdempotencyKeyMismatch, match="other arguments"):
        charge.apply_async((order, 11), idempotency_key=key, queue=IDLE_QUEUE, **same_id)
    assert queue_length(IDLE_QUEUE) == 0


def test_a_canvas_step_sent_again_under_its_id_with_other_arguments_is_answered() -> None:
    # Given a step that ran under the task id Celery fixed for it, sent again with other
    # arguments and work waiting on it (its upstream ran twice and returned another value)
    order, key, task_id = fresh("order"), fresh("key"), fresh("step")
    value = charge.apply_async((order, 10), idempotency_key=key, task_id=task_id).get(timeout=30)
    again = charge.apply_async(
        (order, 11), idempotency_key=key, task_id=task_id, link=worker_app.noted_callback.s(order)
    )
    # Then it is the same call: published, answered with the step's value, its link run
    wait_until(lambda: ledger_events(order, "callback") == 1, 30, "the link")
    assert again.get(timeout=30) == value
    assert ledger_events(order, "start") == 1


def test_key_queued_under_a_chosen_task_id_refuses_other_arguments_under_it() -> None:
    order, key, task_id = fresh("order"), fresh("key"), fresh("charge")
    first = charge.apply_async((order, 10), idempotency_key=key, task_id=task_id, countdown=2)
    with pytest.raises(IdempotencyKeyMismatch, match="other arguments"):
        charge.apply_async((order, 11), idempotency_key=key, task_id=task_id, queue=IDLE_QUEUE)
    assert queue_length(IDLE_QUEUE) == 0
    assert first.get(timeout=30)["amount"] == 10
    assert ledger_events(order, "start") == 1


def test_key_reused_with_other_arguments_fails_at_the_worker_when_unseen_at_publish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With the pickup guard off nothing is written at publish, and the countdown keeps both
    # messages from being claimed until both are out (without it, a quick worker could claim the
    # first before the second's look, which would then refuse it at publish): the worker is
    # where it is caught.
    set_pickup_timeout(monkeypatch, worker_app.app, 0)
    order, key = fresh("order"), fresh("key")
    with ThreadPoolExecutor(max_workers=2) as pool:
        first, second = pool.map(
            lambda amount: charge.apply_async(
                (order, amount), {"sleep": 0.5}, idempotency_key=key, countdown=2
            ),
            (10, 11),
        )
    outcomes: list[Any] = []
    for result in (first, second):
        try:
            outcomes.append(result.get(timeout=30))
        except IdempotencyKeyMismatch as exc:
            outcomes.append(exc)
    assert sum(isinstance(outcome, IdempotencyKeyMismatch) for outcome in outcomes) == 1
    assert ledger_events(order, "start") == 1


def test_key_reused_with_other_arguments_at_once_fails_at_publish() -> None:
    # With the pickup guard on, the first publish queues the key atomically: of two racing
    # publishes with other arguments, exactly one is refused before anything is sent.
    order, key = fresh("order"), fresh("key")

    def publish(amount: int) -> Any:
        try:
            return charge.apply_async((order, amount), idempotency_key=key)
        except IdempotencyKeyMismatch as exc:
            return exc

    with ThreadPoolExecutor(max_workers=2) as pool:
        outcomes = list(pool.map(publish, (10, 11)))
    refused = [outcome for outcome in outcomes if isinstance(outcome, IdempotencyKeyMismatch)]
    published = [outcome for outcome in outcomes if isinstance(outcome, AsyncResult)]
    assert len(refused) == 1 and len(published) == 1, outcomes
    assert published[0].get(timeout=30)["order_id"] == order
    assert ledger_events(order, "start") == 1


def test_same_key_on_two_tasks_never_collides() -> None:
    key = fresh("shared-key")
    order = fresh("order")
    charged = charge.apply_async((order, 1), idempotency_key=key).get(timeout=30)
    templated = worker_app.templated.apply_async((99,), idempotency_key=key).get(timeout=30)
    assert charged["order_id"] == order
    assert templated == 0


def test_template_key_from_the_task_option_deduplicates() -> None:
    order_id = int(fresh("1").replace("1-", "1"), 16) % 10**9
    first = worker_app.templated.delay(order_id, amount=5)
    second = worker_app.templated.apply_async((order_id,), {"amount": 5})
    assert first.get(timeout=30) == second.get(timeout=30) == 5
    assert ledger_events(f"templated-{order_id}", "start") == 1


@pytest.mark.parametrize("bad", [None, 42, b"key", ["key"], "", {"k": 1}, 4.2])
def test_bad_keys_are_refused_before_anything_is_published(bad: object) -> None:
    with pytest.raises(ValueError, match="non-empty str"):
        charge.apply_async((fresh("order"), 1), idempotency_key=bad, queue=IDLE_QUEUE)
    with pytest.raises(ValueError, match="non-empty str"):
        charge.s(fresh("order"), 1).set(idempotency_key=bad).apply_async(queue=IDLE_QUEUE)
    with pytest.raises(ValueError, match="non-empty str"):
        charge.apply_async((fresh("order"), 1), headers={"idempotency_key": bad}, queue=IDLE_QUEUE)
    assert queue_length(IDLE_QUEUE) == 0


def test_a_message_whose_key_header_is_none_runs_and_retries_as_a_plain_task(
    two_workers: list[WorkerProcess],
) -> None:
    # Sent by name with a None key header (which send_task cannot refuse): no key, and its
    # retry, which carries its message's headers on, is published as Celery's retry (not
    # refused, which would only hand the message back to the broker to run again)
    name = fresh("none-header")
    result = worker_app.app.send_task(
        worker_app.manual_retry.name, (name, 1), headers={"idempotency_key": None}
    )
    assert result.get(timeout=30) == f"{name} ok after 2 runs"
    logs = "".join(worker.log() for worker in two_workers)
    assert f"[{result.id}] retry: Retry in" in logs
    assert "not None" not in logs


def _keyed_step(queue: str) -> Any:
    """A keyed call of a task that requires a key, sent to ``queue``."""
    return worker_app.must_have_key.s(fresh("step")).set(idempotency_key=fresh("key"), queue=queue)


def _canvas_with_a_later_step(step: Any) -> dict[str, Any]:
    """Ways a keyed step can follow the first message (on the idle queue): a chain's next step,
    a chord's body, a callback."""
    first = _keyed_step(IDLE_QUEUE)
    header = [_keyed_step(IDLE_QUEUE) for _ in range(2)]
    return {
        "chain": lambda: chain(first, step).apply_async(),
        "chord": lambda: chord(header, step).apply_async(),
        "link": lambda: first.apply_async(link=step),
        "chain in a chain": lambda: chain(first, chain(worker_app.plain.s(), step)).apply_async(),
    }


@pytest.fixture()
def broker_queue() -> Iterator[str]:
    """A queue of this test's own that no worker consumes, deleted afterwards."""
    name = fresh("idle")
    yield name
    worker_app.app.connection().default_channel.queue_delete(name)


@pytest.mark.parametrize("canvas", ["chain", "chord", "link", "chain in a chain"])
@pytest.mark.parametrize("bad", [None, 42, "", b"key"])
def test_a_bad_key_later_in_a_canvas_is_refused_before_anything_is_published(
    canvas: str, bad: object
) -> None:
    later = worker_app.must_have_key.s().set(idempotency_key=bad)
    with pytest.raises(ValueError, match="non-empty str"):
        _canvas_with_a_later_step(later)[canvas]()
    assert queue_length(IDLE_QUEUE) == 0


@pytest.mark.parametrize("canvas", ["chain", "chord", "link"])
def test_a_later_step_without_the_key_its_task_requires_is_refused_before_publishing(
    canvas: str,
) -> None:
    with pytest.raises(ValueError, match="requires an idempotency key"):
        _canvas_with_a_later_step(worker_app.must_have_key.s())[canvas]()
    assert queue_length(IDLE_QUEUE) == 0


def test_an_errback_is_checked_for_a_bad_key_only(broker_queue: str) -> None:
    # (Celery may call an errback in place rather than publish it: it needs no key there)
    first = _keyed_step(broker_queue)
    with pytest.raises(ValueError, match="non-empty str"):
        first.apply_async(link_error=worker_app.must_have_key.s().set(idempotency_key=""))
    assert queue_length(broker_queue) == 0
    first.apply_async(link_error=worker_app.must_have_key.s())
    assert queue_length(broker_queue) == 1


def test_a_canvas_whose_later_keys_are_good_is_published(broker_queue: str) -> None:
    # The control for the tests above: the same canvas with a good key goes out.
    later = worker_app.must_have_key.s().set(idempotency_key=fresh("key"))
    chain(_keyed_step(broker_queue), later).apply_async()
    assert queue_length(broker_queue) == 1


def test_a_key_given_as_a_header_is_the_call_s_key_at_publish_too() -> None:
    order, key = fresh("order"), fresh("key")
    first = charge.apply_async((order, 1), headers={"idempotency_key": key})
    assert first.get(timeout=30)["order_id"] == order
    # The completed key answers at publish: the cached value, the first call's id
    again = charge.apply_async((order, 1), headers={"idempotency_key": key}, queue=IDLE_QUEUE)
    assert isinstance(again, EagerResult)
    assert (again.id, again.get()) == (first.id, first.get())
    assert queue_length(IDLE_QUEUE) == 0
    assert ledger_events(order, "start") == 1


def _caller_without_the_task() -> Celery:
    """An app on the workers' broker and backend that does not register their tasks (a client
    service that calls them by name, a beat process that does not import them)."""
    caller = Celery(
        "by-name", broker=worker_app.app.conf.broker_url, backend=worker_app.app.conf.result_backend
    )
    caller.tasks.pop(charge.name)  # a shared task: every app registers it once finalized
    return caller


@pytest.mark.parametrize("how", ["send_task", "signature"])
def test_a_key_given_to_a_call_sent_by_name_is_carried_to_the_worker(how: str) -> None:
    caller, order, key = _caller_without_the_task(), fresh("order"), fresh("key")

    def call() -> AsyncResult:
        if how == "send_task":
            return caller.send_task(charge.name, (order, 1), idempotency_key=key)
        return caller.signature(charge.name, (order, 1)).set(idempotency_key=key).delay()

    # Given calls of a keyed task sent by name with idempotency_key= (Celery would put the
    # option in the message's properties, where no worker looks), one after the other's end
    first = call().get(timeout=30)
    again = call().get(timeout=30)
    # Then the body ran once, and both callers got its value
    assert again == first
    assert ledger_events(order, "start") == 1


def test_an_invalid_key_given_to_a_call_sent_by_name_fails_running_nothing() -> None:
    order = fresh("order")
    sent = _caller_without_the_task().send_task(charge.name, (order, 1), idempotency_key=42)
    with pytest.raises(ValueError, match="idempotency_key must"):
        sent.get(timeout=30)
    assert ledger_events(order, "start") == 0


@pytest.mark.parametrize("bad", [42, "", "a\x00b", ["key"]])
def test_a_message_sent_by_other_means_with_a_bad_key_fails_running_nothing(bad: object) -> None:
    # Sent with send_task: the key is not looked at before it goes out
    order = fresh("order")
    sent = worker_app.app.send_task(charge.name, (order, 1), headers={"idempotency_key": bad})
    with pytest.raises(ValueError, match="idempotency_key must"):
        sent.get(timeout=30)
    assert ledger_events(order, "start") == 0


@pytest.mark.parametrize("key", [None, "key"])
def test_arguments_celery_would_refuse_are_refused_before_anything_is_published(
    key: str | None,
) -> None:
    # Celery refuses them in its message; taken apart (a dict's keys, a str's letters), the call
    # would run with other arguments than its caller's
    options = {"idempotency_key": fresh(key)} if key else {}
    with pytest.raises(TypeError, match="task args must be a list or tuple"):
        charge.apply_async({"order_id": fresh("order")}, queue=IDLE_QUEUE, **options)
    with pytest.raises(TypeError, match="task args must be a list or tuple"):
        charge.apply_async("ab", queue=IDLE_QUEUE, **options)
    with pytest.raises(TypeError, match="task keyword arguments must be a mapping"):
        charge.apply_async((), [("order_id", "o"), ("amount", 1)], queue=IDLE_QUEUE, **options)
    assert queue_length(IDLE_QUEUE) == 0


@pytest.mark.parametrize("bad", ["t" * 256, "", 42, b"task-id"])
def test_task_ids_the_stores_cannot_hold_are_refused_before_anything_is_published(
    bad: object,
) -> None:
    with pytest.raises(ValueError, match="task_id"):
        charge.apply_async((fresh("order"), 1), task_id=bad, queue=IDLE_QUEUE)
    with pytest.raises(ValueError, match="task_id"):
        charge.apply_async(
            (fresh("order"), 1), task_id=bad, idempotency_key=fresh("key"), queue=IDLE_QUEUE
        )
    assert queue_length(IDLE_QUEUE) == 0


def test_a_task_id_of_255_characters_runs() -> None:
    task_id = fresh("t").ljust(255, "t")
    assert (
        charge.apply_async((fresh("order"), 1), task_id=task_id).get(timeout=30)["task_id"]
        == task_id
    )


def test_a_good_key_on_the_idle_queue_does_publish(broker_queue: str) -> None:
    # The control for the test above: the queue check does see a published message.
    charge.apply_async((fresh("order"), 1), idempotency_key=fresh("key"), queue=broker_queue)
    assert queue_length(broker_queue) == 1


def test_call_without_a_key_runs_as_a_plain_task_every_time() -> None:
    order = fresh("order")
    charge.delay(order, 1).get(timeout=30)
    charge.delay(order, 1).get(timeout=30)
    assert ledger_events(order, "start") == 2


def test_on_duplicate_skip_drops_the_duplicate(two_workers: list[WorkerProcess]) -> None:
    name, key = fresh("skip"), fresh("key")
    owner = worker_app.skipping.apply_async((name, 1.5), idempotency_key=key)
    while ledger_events(name, "start") == 0:
        pass
    # Sent with send_task: no publish-side look, so the worker must drop it itself.
    duplicate = worker_app.app.send_task(
        worker_app.skipping.name, (name, 1.5), headers={"idempotency_key": key}
    )
    # The worker that took the duplicate dropped it (Ignore stores no state), unrun
    wait_until(
        lambda: any(
            f"key {key!r} is in progress elsewhere, skipped" in w.log() for w in two_workers
        ),
        30,
        "the duplicate to be skipped",
    )
    assert owner.get(timeout=30) == name
    assert ledger_events(name, "start") == 1
    assert duplicate.state == "PENDING"


@pytest.mark.parametrize("canvas", ["group", "chord", "chain", "link"])
def test_a_skipping_duplicate_in_a_canvas_gives_the_owners_value(canvas: str) -> None:
    # Given a skipping task's key in progress
    name, key = fresh("skip"), fresh("key")
    owner = worker_app.skipping.apply_async((name, 2.0), idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 30, "the owner's start")
    # When a group, a chord, a chain or a callback waits on a duplicate of it, then it does
    # not wait for ever: the duplicate resolves to the owner's value, and the work after it runs
    duplicate = worker_app.skipping.s(name, 2.0).set(idempotency_key=key)
    parts = group(duplicate, worker_app.plain.s(5))
    if canvas == "group":
        result = parts.apply_async()
    elif canvas == "chord":
        result = chord(parts)(worker_app.plain.s())
    elif canvas == "chain":
        result = (duplicate | worker_app.plain.s()).apply_async()
    else:
        result = duplicate.apply_async(link=worker_app.plain.s())
    expected = [name, 5] if canvas in ("group", "chord") else name
    assert result.get(timeout=30) == expected
    assert owner.get(timeout=30) == name
    assert ledger_events(name, "start") == 1


def test_on_duplicate_raise_fails_the_duplicate_with_a_conflict() -> None:
    name, key = fresh("raise"), fresh("key")
    owner = worker_app.raising.apply_async((name, 1.5), idempotency_key=key)
    while ledger_events(name, "start") == 0:
        pass
    duplicate = worker_app.app.send_task(
        worker_app.raising.name, (name, 1.5), headers={"idempotency_key": key}
    )
    with pytest.raises(IdempotencyConflict) as conflict:
        duplicate.get(timeout=30)
    assert conflict.value.owner_task_id == owner.id
    assert owner.get(timeout=30) == name
    assert ledger_events(name, "start") == 1


def _terminated_while_running(signal: str) -> AsyncResult:
    """A keyed call (its lease 300 s) revoked with terminate=True and ``signal`` while its
    body runs, once its key is free again and a new call of it ran: the call's result."""
    name, key = fresh("terminated"), fresh("key")
    task = worker_app.no_retries
    result = task.apply_async((name, 30.0), idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 15, "the body to start")
    worker_app.app.control.revoke(result.id, terminate=True, signal=signal)
    store = store_for(worker_app.app)
    wait_until(lambda: store.get(storage_key(task.name, key)) is None, 15, "the key to be freed")
    again = task.apply_async((name, 0.1), idempotency_key=key)
    assert again.id != result.id
    assert again.get(timeout=30) == f"{name} done"
    return result


def test_a_call_terminated_with_sigkill_frees_its_key_once_its_process_is_gone() -> None:
    # A call revoked with SIGKILL runs no more of its code: its key is freed once the worker
    # sees the process gone, not at its lease's end, and a new call of the key runs
    _terminated_while_running("SIGKILL")


def test_a_call_terminated_with_sigusr1_frees_its_key_and_leaves_no_dead_letter(
    two_workers: list[WorkerProcess],
) -> None:
    # Given a keyed call revoked with SIGUSR1 as it runs (billiard raises SoftTimeLimitExceeded
    # in its body: a graceful revoke, its own code runs to its end): its key is freed
    result = _terminated_while_running("SIGUSR1")
    task = worker_app.no_retries
    # and the dead letter its body's failure wrote is withdrawn by the worker (it says so), so
    # none is left for a sweep to send again
    withdrawn = f"[{result.id}] was revoked as it ran: its dead letter withdrawn"
    wait_until(
        lambda: any(withdrawn in worker.log() for worker in two_workers), 15, "the withdrawal"
    )
    rows = dlq_for(worker_app.app).items(task_name=task.name)
    assert [item for item in rows if item.task_id == result.id] == []


def test_a_keyed_call_of_a_task_the_workers_do_not_know_is_dead_lettered_and_frees_its_key() -> (
    None
):
    # Given a task this process has and the workers do not (a new task in a rolling upgrade)
    @worker_app.app.task(base=IdempotentTask, name=fresh("it.not_deployed"), shared=False)
    def not_deployed(name: str) -> str:
        return name

    name, key = fresh("unknown"), fresh("key")
    # When a keyed call of it reaches a worker, then it fails as Celery fails it
    first = not_deployed.apply_async((name,), idempotency_key=key)
    with pytest.raises(NotRegistered):
        first.get(timeout=30)
    # and it waits in the dead-letter table (whose sweep sends it again, to run once a worker
    # knows the task), its key freed: not left queued for that failed call, every caller of the
    # key handed its failure until the pickup guard sent it again unseen
    store = store_for(worker_app.app)
    wait_until(lambda: store.get(storage_key(not_deployed.name, key)) is None, 15, "the key")
    rows = dlq_for(worker_app.app).items(task_name=not_deployed.name)
    assert [(row.task_id, row.idempotency_key, row.error_type) for row in rows] == [
        (first.id, key, "NotRegistered")
    ]
    assert rows[0].args == [name]
    again = not_deployed.apply_async((name,), idempotency_key=key)
    assert again.id != first.id


def test_a_pydantic_task_called_again_with_an_equal_model_gets_the_cached_value() -> None:
    # Given a pydantic=True task keyed by its model's field, called once and completed
    order_id = int(fresh("1").replace("1-", "1"), 16) % 10**9
    first = worker_app.charge_order.apply_async((worker_app.Order(id=order_id, amount=990),))
    assert first.get(timeout=30) == 990
    # When it is called again with an equal model (Celery sends models dumped: the worker
    # fingerprinted the call's dict)
    again = worker_app.charge_order.apply_async((worker_app.Order(id=order_id, amount=990),))
    # Then it is the same call: answered from the cache, not refused as other arguments
    assert isinstance(again, EagerResult) and again.get() == 990
    assert again.id == first.id
    assert ledger_events(f"order-model-{order_id}", "start") == 1
