"""The pickup guard: a keyed message the broker loses is published again, by the beat sweep
or by the next publish of its key.

Kombu's Redis transport loses a message popped by a worker that dies (or whose Redis
restarts) before the message is recorded as unacknowledged. These tests lose the message
deliberately, by taking it out of the broker's list, and expect the task to run anyway, once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu.exceptions import EncodeError, OperationalError

from idempotent_tasks.app_store import store_for
from idempotent_tasks.keys import storage_key
from idempotent_tasks.pickups import republish_lost
from idempotent_tasks.records import Outcome, Status
from tests.integration import worker_app
from tests.integration.helpers import (
    IDLE_QUEUE,
    fresh,
    ledger_events,
    publish_in_two_trips,
    queue_length,
    set_pickup_timeout,
    wait_until,
)
from tests.integration.workers import BeatProcess, WorkerProcess

pytestmark = pytest.mark.slow
app = worker_app.app
PICKUP_TIMEOUT = 1.0


@pytest.fixture()
def short_pickup(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process publishes with a 1 s pickup timeout."""
    set_pickup_timeout(monkeypatch, app, PICKUP_TIMEOUT)


@pytest.fixture()
def worker_and_beat(it_env: dict[str, str], tmp_path: Path) -> Iterator[Any]:
    """Starts a ``-c 1`` worker (and beat) of its own: the default queue is emptied of earlier
    tests' leftovers first, and dead letters go to a table of this test alone. Else the sweep
    sends earlier tests' pending rows again, every half second, to the one pool process this
    test waits on."""
    started: list[Any] = []
    redis.Redis.from_url(app.conf.broker_url).delete("celery")
    own_dead_letters = f"sqlite:///{tmp_path / 'dead-letters.db'}"

    def start(beat: bool = True, queue: str | None = None, **extra_env: str) -> WorkerProcess:
        env = {
            **it_env,
            "IT_PICKUP_TIMEOUT": str(PICKUP_TIMEOUT),
            "IT_DLQ_URL": own_dead_letters,
            **extra_env,
        }
        worker = WorkerProcess(
            f"pickup{len(started)}",
            env,
            tmp_path,
            concurrency=1,
            extra_args=("-Q", queue) if queue else (),
        )
        started.append(worker)
        if beat:
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


def _lose_unacked(task_id: str) -> None:
    """Take the message of ``task_id`` out of kombu's unacked records, as a redelivery lost
    in a Redis restart would."""
    broker = redis.Redis.from_url(app.conf.broker_url)
    for tag, raw in broker.hgetall("unacked").items():
        if task_id.encode() in raw:
            broker.hdel("unacked", tag)
            broker.zrem("unacked_index", tag)
            return
    raise AssertionError(f"no unacked message of {task_id}")


def _status(task: Any, key: str) -> Status | None:
    record = store_for(app).get(storage_key(task.name, key))
    return None if record is None else record.status


@pytest.mark.usefixtures("short_pickup")
def test_a_lost_message_is_published_again_and_runs_once(worker_and_beat: Any) -> None:
    # Given a keyed task published while no worker runs, whose message the broker then loses
    # (with a link, a signature the message carries along)
    name, key = fresh("lost"), fresh("key")
    result = worker_app.ledgered.apply_async(
        (name,), idempotency_key=key, link=worker_app.noted_callback.s(name)
    )
    _lose_message("celery", result.id)
    assert _status(worker_app.ledgered, key) is Status.QUEUED

    # When a worker and beat run
    worker_and_beat()

    # Then the sweep publishes it again under the same id, and its caller gets the value
    assert result.get(timeout=30) == name
    assert ledger_events(name, "start") == 1
    assert _status(worker_app.ledgered, key) is Status.COMPLETED
    # And its link runs
    wait_until(lambda: ledger_events(name, "callback") == 1, 30, "the link")


@pytest.mark.usefixtures("short_pickup")
def test_a_lost_retry_is_published_again_to_its_own_queue(worker_and_beat: Any) -> None:
    # Given a task whose retry message goes to a queue of its own (retry(queue=...)), where
    # no worker reads it, and is lost there
    name, key = fresh("lost-retry"), fresh("key")
    worker_and_beat()
    result = worker_app.retries_into_the_void.apply_async((name,), idempotency_key=key)
    broker = redis.Redis.from_url(app.conf.broker_url)
    wait_until(lambda: _messages_of("nowhere", result.id) == 1, 30, "the retry message")
    broker.delete("nowhere")

    # Then the key stays queued for the retry, and the guard publishes it again, as Celery
    # sent it: to that queue
    assert _status(worker_app.retries_into_the_void, key) is Status.QUEUED
    wait_until(lambda: _messages_of("nowhere", result.id) == 1, 30, "the guard's copy")
    assert ledger_events(name, "start") == 1
    broker.delete("nowhere")


@pytest.mark.usefixtures("short_pickup")
def test_a_message_only_slow_to_arrive_runs_once(worker_and_beat: Any) -> None:
    # Given a queued key whose message is still in the broker when the sweep publishes it again
    name, key = fresh("slow-queue"), fresh("key")
    result = worker_app.ledgered.apply_async((name,), idempotency_key=key)
    wait_until(
        lambda: republish_lost(app, store_for(app)) >= 0 and _messages_of("celery", result.id) == 2,
        5,
        "the sweep to publish it again (another test's due key may go first)",
    )

    # When a worker reads both messages (the beat may send one more, should the worker be slow
    # to start), and has answered each it received
    worker = worker_and_beat()
    assert result.get(timeout=30) == name

    def all_answered() -> bool:
        log = worker.log()
        answered = log.count(f"[{result.id}] succeeded")
        return (
            _queue_empty("celery")
            and answered >= 2
            and answered == log.count(f"[{result.id}] received")
        )

    wait_until(all_answered, 30, "every copy answered")

    # Then the body ran once
    assert ledger_events(name, "start") == 1


@pytest.mark.usefixtures("short_pickup")
def test_an_owner_killed_with_its_message_lost_is_published_again(worker_and_beat: Any) -> None:
    # Given a worker (1 s lease) running a keyed task
    name, key = fresh("owner-lost"), fresh("key")
    first = worker_and_beat(beat=False, IT_LEASE="1")
    result = worker_app.charge.apply_async((name, 5), {"sleep": 2.0}, idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 15, "the first run to start")
    # When the worker is SIGKILLed and the broker loses the message it held
    first.kill()
    _lose_unacked(result.id)
    assert _status(worker_app.charge, key) is Status.PROCESSING
    # Then, once the lease and a pickup timeout have passed, the sweep publishes it again
    worker_and_beat(IT_LEASE="1")
    value = result.get(timeout=40)
    assert value["order_id"] == name and value["task_id"] == result.id
    assert ledger_events(name, "start") == 2  # the documented crash window
    assert ledger_events(name, "finish") == 1
    assert _status(worker_app.charge, key) is Status.COMPLETED


@pytest.mark.usefixtures("short_pickup")
def test_a_dead_owners_lost_message_is_published_again_though_keys_live_less_than_the_timeout(
    worker_and_beat: Any,
) -> None:
    # Given a worker and beat whose keys live 0.5 s once done, less than the 1 s pickup
    # timeout, running a keyed task (1 s lease)
    name, key = fresh("short-ttl"), fresh("key")
    first = worker_and_beat(IT_LEASE="1", IT_TTL="0.5")
    result = worker_app.charge.apply_async((name, 5), {"sleep": 2.0}, idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 15, "the first run to start")
    # When the worker is SIGKILLed and the broker loses the message it held
    first.kill()
    _lose_unacked(result.id)
    # Then the claim outlives its lease by more than a pickup timeout (not by the TTL: gone
    # before the sweep looked), so the sweep publishes it again, and a worker runs it
    worker_and_beat(beat=False, IT_LEASE="1", IT_TTL="0.5")
    value = result.get(timeout=40)
    assert value["order_id"] == name and value["task_id"] == result.id
    assert ledger_events(name, "finish") == 1


@pytest.mark.usefixtures("short_pickup")
def test_a_lost_message_is_published_again_by_the_next_publish_of_its_key(
    worker_and_beat: Any,
) -> None:
    # Given a keyed task whose message the broker lost, and no beat to sweep for it
    name, key = fresh("lost-no-beat"), fresh("key")
    first = worker_app.ledgered.apply_async((name,), idempotency_key=key)
    _lose_message("celery", first.id)
    time.sleep(PICKUP_TIMEOUT + 0.2)  # the message now counts as lost

    # When the key is published again, and again at once
    again = worker_app.ledgered.apply_async((name,), idempotency_key=key)
    once_more = worker_app.ledgered.apply_async((name,), idempotency_key=key)

    # Then the lost message went out again, once, under its own id, and every caller gets its
    # value from a worker running without beat
    assert again.id == once_more.id == first.id
    assert _messages_of("celery", first.id) == 1
    worker_and_beat(beat=False)
    assert first.get(timeout=30) == again.get(timeout=30) == name
    assert ledger_events(name, "start") == 1
    assert _status(worker_app.ledgered, key) is Status.COMPLETED


@pytest.mark.usefixtures("short_pickup")
@pytest.mark.parametrize("other_message", ["runs it", "fails once and retries"])
def test_a_lost_message_whose_key_another_message_ran_still_runs_its_link(
    worker_and_beat: Any, other_message: str
) -> None:
    # Given a keyed call with a link whose message the broker lost, and no beat to sweep for it
    retries = other_message == "fails once and retries"
    task, name, key = (
        (worker_app.flaky if retries else worker_app.ledgered),
        fresh("lost"),
        fresh("key"),
    )
    args = (name, 1) if retries else (name,)
    lost = task.apply_async(args, idempotency_key=key, link=worker_app.noted_callback.s(name))
    _lose_message("celery", lost.id)
    time.sleep(PICKUP_TIMEOUT + 0.2)  # the message now counts as lost

    # When another message of the key, sent with no look at the key (by name), runs it (or
    # takes it over, fails once and retries: the key queued for its retry, which completes it)
    worker_and_beat(beat=False)
    other = app.send_task(task.name, args, idempotency_key=key)
    value = f"{name} ok after 2 runs" if retries else name
    assert other.get(timeout=30) == value

    # Then the body ran once (twice with the retry), the lost call's caller gets the value, and
    # the lost message, published again (once the key completed, or before the retry's release
    # took the key from the claim that owed it), answers with it and runs its link, once
    assert lost.get(timeout=30) == value
    wait_until(lambda: ledger_events(name, "callback") == 1, 30, "the lost call's link")
    assert ledger_events(name, "start") == (2 if retries else 1)
    time.sleep(1)
    assert ledger_events(name, "callback") == 1


def _lost_and_taken_by_a_dead_taker(prefix: str) -> tuple[str, str, Any, str]:
    """A keyed call of ``ledgered`` with a link, whose message the broker lost, and whose key
    a call of another task id then took over under an owner whose 0.2 s lease is over now:
    the call's name (its argument), key and result, and the taker's task id."""
    name, key = fresh(prefix), fresh("key")
    task = worker_app.ledgered
    lost = task.apply_async((name,), idempotency_key=key, link=worker_app.noted_callback.s(name))
    _lose_message("celery", lost.id)
    time.sleep(PICKUP_TIMEOUT + 0.2)  # the message now counts as lost
    taker_id = fresh("taker")
    taker = task._claim_request(key, (name,), {}, taker_id, owner="dead-taker")
    claim = store_for(app).claim(dataclasses.replace(taker, lease_seconds=0.2))
    assert (claim.outcome, claim.taken_from_task_id) == (Outcome.ACQUIRED, lost.id)
    time.sleep(0.3)
    return name, key, lost, taker_id


def _ran_once_answering_all(name: str, *results: Any) -> None:
    """The key of the call ``name`` (see ``_lost_and_taken_by_a_dead_taker``) ran its body once,
    every one of ``results`` resolves to its value, and the lost call's link ran, once."""
    for result in results:
        assert result.get(timeout=30) == name
    wait_until(lambda: ledger_events(name, "callback") == 1, 30, "the lost call's link")
    assert ledger_events(name, "start") == 1


@pytest.mark.usefixtures("short_pickup")
def test_a_lost_call_whose_taker_died_with_its_message_lost_still_runs_and_answers_both(
    worker_and_beat: Any,
) -> None:
    # Given a keyed call with a link whose message the broker lost, and another call that
    # took its key over, whose worker then died with its message lost
    name, _, lost, taker_id = _lost_and_taken_by_a_dead_taker("lost-taker")
    time.sleep(PICKUP_TIMEOUT)  # a pickup timeout after the taker's lease is over

    # When the guard's sweep finds the key
    worker_and_beat()

    # Then it publishes the message the key keeps under that call's own task id: the body runs
    # once, the lost call's link runs, and the taker's callers get the value as well
    _ran_once_answering_all(name, lost, app.AsyncResult(taker_id))


@pytest.mark.usefixtures("short_pickup")
def test_a_takers_redelivered_message_still_answers_the_lost_call_whose_key_it_took(
    worker_and_beat: Any,
) -> None:
    # Given a keyed call with a link whose message the broker lost, and another call that
    # took its key over, whose worker then died
    name, key, lost, taker_id = _lost_and_taken_by_a_dead_taker("redelivered-taker")

    # When the taker's message comes back (the broker's redelivery: the same task id)
    worker_and_beat(beat=False)
    redelivered = app.send_task(
        worker_app.ledgered.name, (name,), task_id=taker_id, idempotency_key=key
    )

    # Then it runs the key once and still answers the lost call, whose link runs
    _ran_once_answering_all(name, redelivered, lost)


@pytest.mark.usefixtures("short_pickup")
def test_a_dead_owners_lost_message_is_published_again_by_the_next_publish(
    worker_and_beat: Any,
) -> None:
    # Given a key whose message was claimed by an owner that then died (its 0.2 s lease ends)
    # and was lost with it
    name, key = fresh("dead-owner"), fresh("key")
    first = worker_app.ledgered.apply_async((name,), idempotency_key=key)
    _lose_message("celery", first.id)
    task = worker_app.ledgered
    owner = dataclasses.replace(
        task._claim_request(key, (name,), {}, first.id, owner="dead-owner"), lease_seconds=0.2
    )
    assert store_for(app).claim(owner).outcome is Outcome.ACQUIRED

    # While the broker may still redeliver it (a pickup timeout after the lease), a publish
    # takes the key over with a message of its own
    time.sleep(0.3)
    early = task.apply_async((name,), idempotency_key=key, queue=IDLE_QUEUE)
    assert early.id != first.id
    assert queue_length(IDLE_QUEUE) == 1
    redis.Redis.from_url(app.conf.broker_url).delete(IDLE_QUEUE)

    # Once that timeout has passed too, a publish sends the owner's message again instead
    time.sleep(PICKUP_TIMEOUT)
    late = task.apply_async((name,), idempotency_key=key, queue=IDLE_QUEUE)
    assert late.id == first.id
    assert queue_length(IDLE_QUEUE) == 0
    worker_and_beat(beat=False)
    assert first.get(timeout=30) == name
    assert ledger_events(name, "start") == 1


def test_a_producer_whose_clock_runs_behind_sees_a_dead_owners_lease_as_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a key claimed by an owner whose 0.2 s lease ended (by the store's clock)
    name, key = fresh("skewed"), fresh("key")
    task = worker_app.ledgered
    owner = dataclasses.replace(
        task._claim_request(key, (name,), {}, "dead-task", owner="dead-owner"), lease_seconds=0.2
    )
    assert store_for(app).claim(owner).outcome is Outcome.ACQUIRED
    time.sleep(0.3)

    # When a producer whose clock runs an hour behind publishes the key
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() - 3600)
    result = task.apply_async((name,), idempotency_key=key, queue=IDLE_QUEUE)
    monkeypatch.undo()

    # Then it publishes (the message takes the key over) rather than wait on the dead owner
    assert result.id != "dead-task"
    assert queue_length(IDLE_QUEUE) == 1
    redis.Redis.from_url(app.conf.broker_url).delete(IDLE_QUEUE)


def test_a_reservation_sent_twice_after_a_lost_reply_is_still_published(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a store whose reply to a reservation is lost, so the client sends it again (as
    # redis-py does after a timeout): the second run finds the first one's record
    name, key = fresh("twice"), fresh("key")
    store = store_for(app)
    reserve = store.reserve

    def reserve_twice(*args: Any, **kwargs: Any) -> Any:
        reserve(*args, **kwargs)
        return reserve(*args, **kwargs)

    monkeypatch.setattr(store, "reserve", reserve_twice)
    # When the call is published, then it is sent: its own reservation is no other caller's
    result = worker_app.ledgered.apply_async((name,), idempotency_key=key, queue=IDLE_QUEUE)
    monkeypatch.undo()
    assert _messages_of(IDLE_QUEUE, result.id) == 1
    assert _status(worker_app.ledgered, key) is Status.QUEUED
    redis.Redis.from_url(app.conf.broker_url).delete(IDLE_QUEUE)


def test_a_failed_publish_leaves_no_reservation(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a publish that fails otherwise than for want of a broker (a message its
    # serializer refuses)
    name, key = fresh("unpublished"), fresh("key")

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise EncodeError("cannot serialize")

    monkeypatch.setattr(app, "send_task", refuse)
    with pytest.raises(EncodeError):
        worker_app.ledgered.apply_async((name,), idempotency_key=key)

    # Then the key is free again: nothing will publish it behind the caller's back
    assert _status(worker_app.ledgered, key) is None


@pytest.mark.usefixtures("short_pickup")
def test_a_call_the_broker_could_not_take_runs_for_the_duplicate_that_joined_it(
    monkeypatch: pytest.MonkeyPatch, worker_and_beat: Any
) -> None:
    # Given a call whose publish fails because the broker (apart from the store) cannot be
    # reached, after a duplicate (a client retrying, say) joined its reservation
    publish_in_two_trips(monkeypatch)
    name, key = fresh("refused"), fresh("key")
    send_task, joined = app.send_task, []

    def refuse_after_a_duplicate_joined(*args: Any, **kwargs: Any) -> None:
        monkeypatch.setattr(app, "send_task", send_task)
        joined.append(worker_app.ledgered.apply_async((name,), idempotency_key=key))
        raise OperationalError("broker unreachable")

    monkeypatch.setattr(app, "send_task", refuse_after_a_duplicate_joined)
    with pytest.raises(OperationalError):
        worker_app.ledgered.apply_async((name,), idempotency_key=key)
    [duplicate] = joined
    # Then the caller got the error, but the call is kept, queued and due at once
    assert _status(worker_app.ledgered, key) is Status.QUEUED

    # And a caller trying again while the broker is still unreachable gets the error again
    # (not a result nothing would write), and the call stays due at once
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OperationalError("broker still unreachable")

    monkeypatch.setattr(app, "send_task", refuse)
    with pytest.raises(OperationalError):
        worker_app.ledgered.apply_async((name,), idempotency_key=key)
    record = store_for(app).get(storage_key(worker_app.ledgered.name, key))
    assert record is not None and record.status is Status.QUEUED
    assert record.lease_expires_at <= record.store_time()
    monkeypatch.setattr(app, "send_task", send_task)
    # And once a worker and beat run, the guard publishes it, and the duplicate gets its value
    worker_and_beat()
    assert duplicate.get(timeout=30) == name
    assert ledger_events(name, "start") == 1


def _newcomer_over_a_vanished_claim(
    worker_and_beat: Any, name: str, key: str, *, beat: bool, due_in: float = PICKUP_TIMEOUT
) -> tuple[Any, Any]:
    """A keyed call running (2 s) on a worker (one process), with ``beat`` or not, whose
    record vanished (a store restarted without persistence), and a new call of the key, with a
    callback, reserved for its own message meanwhile (due in ``due_in`` s, as this process
    publishes): both calls' results."""
    worker_and_beat(beat=beat)
    owner = worker_app.charge.apply_async((name, 5), {"sleep": 2.0}, idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 15, "the owner's run to start")
    store_for(app).forget(storage_key(worker_app.charge.name, key))
    with pytest.MonkeyPatch.context() as patch:
        set_pickup_timeout(patch, app, due_in)
        newcomer = worker_app.charge.apply_async(
            (name, 5), {"sleep": 2.0}, idempotency_key=key, link=worker_app.noted_callback.s(name)
        )
    assert _status(worker_app.charge, key) is Status.QUEUED
    return owner, newcomer


@pytest.mark.usefixtures("short_pickup")
def test_a_call_reserved_over_a_vanished_claim_and_lost_is_answered_by_the_guard(
    worker_and_beat: Any,
) -> None:
    # Given a new call reserved over a running call's vanished claim, due after that call
    # completes (so that only the pickup the completion keeps can publish it), whose message
    # the broker loses (the worker, busy, has not fetched it)
    name, key = fresh("vanished"), fresh("key")
    owner, newcomer = _newcomer_over_a_vanished_claim(
        worker_and_beat, name, key, beat=True, due_in=4.0
    )
    _lose_message("celery", newcomer.id)
    # When the running call completes, over the new call's reservation (not due yet: the new
    # call is not answered)
    value = owner.get(timeout=30)
    assert _status(worker_app.charge, key) is Status.COMPLETED
    assert not newcomer.ready()
    # Then the guard publishes the new call's message, which gets the key's value, and its
    # callback runs (a stored result alone runs no callback); the body ran once
    assert newcomer.get(timeout=30) == value
    wait_until(lambda: ledger_events(name, "callback") == 1, 30, "the new call's callback")
    assert ledger_events(name, "start") == 1
    assert _status(worker_app.charge, key) is Status.COMPLETED


@pytest.mark.usefixtures("short_pickup")
def test_a_call_reserved_over_a_vanished_claim_is_answered_once_by_its_own_message(
    worker_and_beat: Any,
) -> None:
    # Given a new call reserved over a running call's vanished claim, its message not lost (no
    # beat: its sweep could publish the kept message, due before the key completes, before
    # the worker fetches the first)
    name, key = fresh("vanished-kept"), fresh("key")
    owner, newcomer = _newcomer_over_a_vanished_claim(worker_and_beat, name, key, beat=False)
    # When the running call completes, and then the new call's message comes
    value = owner.get(timeout=30)
    assert newcomer.get(timeout=30) == value
    wait_until(lambda: ledger_events(name, "callback") == 1, 30, "the new call's callback")
    # Then, past its due time, the guard keeps nothing to publish for it: its callback ran
    # once (a second copy would run it again), and the body once
    time.sleep(PICKUP_TIMEOUT)  # (its due time passed as the key completed: to be sure)
    assert store_for(app).take(storage_key(worker_app.charge.name, key)) is None
    assert ledger_events(name, "callback") == 1
    assert ledger_events(name, "start") == 1


def _messages_of(queue: str, task_id: str) -> int:
    """Messages of ``task_id`` waiting in ``queue``."""
    broker = redis.Redis.from_url(app.conf.broker_url)
    return sum(task_id.encode() in raw for raw in broker.lrange(queue, 0, -1))


def _queue_empty(queue: str) -> bool:
    return int(redis.Redis.from_url(app.conf.broker_url).llen(queue)) == 0


@pytest.mark.usefixtures("short_pickup")
@pytest.mark.parametrize("mode", ["skip", "raise"])
def test_a_message_only_slow_whose_key_a_duplicate_took_over_still_gets_the_value(
    worker_and_beat: Any, mode: str
) -> None:
    # Given a call (on_duplicate skip or raise) whose message waits, past its pickup timeout,
    # in a queue no worker reads yet
    task = worker_app.skipping if mode == "skip" else worker_app.raising
    name, key, later = fresh(f"slow-original-{mode}"), fresh("key"), fresh("later-queue")
    original = task.apply_async((name, 4.0), idempotency_key=key, queue=later)
    time.sleep(PICKUP_TIMEOUT + 0.5)
    # and a duplicate sent straight to a worker, which takes the key over (its message counts
    # as lost) and runs
    worker_and_beat(beat=False)
    duplicate = app.send_task(task.name, (name, 4.0), headers={"idempotency_key": key})
    wait_until(lambda: ledger_events(name, "start") == 1, 15, "the duplicate's run to start")
    # When the call's own message reaches a worker while the duplicate runs
    worker_and_beat(beat=False, queue=later)
    # Then it is no duplicate to drop or fail: its caller gets the value, which ran once
    assert original.get(timeout=30) == name
    assert duplicate.get(timeout=30) == name
    assert ledger_events(name, "start") == 1


@pytest.mark.parametrize("retried", [False, True], ids=["completes", "retries-then-completes"])
def test_a_dead_owners_lost_call_gets_the_value_of_the_call_that_took_its_key_over(
    worker_and_beat: Any, monkeypatch: pytest.MonkeyPatch, retried: bool
) -> None:
    # Given a keyed call whose worker (1 s lease) was SIGKILLed mid-body, its message lost
    task = worker_app.slow_first_then_flaky if retried else worker_app.slow_first
    set_pickup_timeout(monkeypatch, app, 5.0)
    env = {"IT_LEASE": "1", "IT_PICKUP_TIMEOUT": "5"}
    name, key = fresh("owner-lost-taken-over"), fresh("key")
    first = worker_and_beat(beat=False, **env)
    original = task.apply_async((name, 30.0), idempotency_key=key)
    wait_until(lambda: ledger_events(name, "start") == 1, 15, "the first run to start")
    first.kill()
    killed = time.monotonic()
    _lose_unacked(original.id)
    # When the key is called again once the lease ended, before the lost message is sent again
    # (a pickup timeout later): the new call takes the dead owner's key over, and completes
    # (or fails once, and its retry completes)
    time.sleep(max(0.0, killed + 1.8 - time.monotonic()))
    duplicate = task.apply_async((name, 30.0), idempotency_key=key)
    assert duplicate.id != original.id
    worker_and_beat(beat=False, **env)
    value = duplicate.get(timeout=30)
    assert value["run"] == (3 if retried else 2)
    # Then the call whose message was lost is answered too, with that value, though its
    # message never comes back
    assert original.get(timeout=10) == value
    assert ledger_events(name, "finish") == 1
