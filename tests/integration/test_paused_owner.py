"""A process paused between asking for its claim and starting its body (frozen, swapped out,
its claim's reply held up) runs no body on a claim it lost meanwhile: another execution may have
taken the key over and even completed it."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.exceptions import SoftTimeLimitExceeded, TaskRevokedError
from celery.result import AsyncResult
from celery.signals import task_received
from rq import SimpleWorker

from idempotent_tasks import IdempotentTask, defaults
from idempotent_tasks.app_store import store_for
from idempotent_tasks.core import Attempt, lease_clock
from idempotent_tasks.dlq import DeadLetterQueue
from idempotent_tasks.errors import StoreUnavailable
from idempotent_tasks.keys import storage_key
from idempotent_tasks.pickups import make_pickup
from idempotent_tasks.records import ClaimRequest, Outcome, Status, retry_marker
from idempotent_tasks.rq import IdempotentJob, IdempotentQueue
from idempotent_tasks.stores import MemoryStore
from idempotent_tasks.stores.redis import RedisStore
from idempotent_tasks.task import HARD_LIMIT_MARGIN
from tests.claim_requests import claim_request
from tests.integration import rq_jobs
from tests.integration.conftest import BACKEND_DB, BROKER_DB
from tests.integration.helpers import fresh, wait_until
from tests.integration.rq_support import RQ_DB

LEASE = 2.0
#: The expiry the expiry tests send a call with: long enough for the worker to receive it
#: before it, even on a loaded machine (a message received past it Celery drops unseen, which
#: is not what those tests are about).
EXPIRES = 2.0


def _request(owner: str, previous_owner: str | None = None) -> ClaimRequest:
    return claim_request(
        task_id=f"task-{owner}",
        owner=owner,
        lease_seconds=LEASE,
        previous_owner=previous_owner,
    )


class _CountedExtends(MemoryStore):
    extends = 0

    def extend(self, request: ClaimRequest, token: int) -> bool:
        self.extends += 1
        return super().extend(request, token)


def _attempt(store: MemoryStore) -> Attempt:
    attempt = Attempt(store=store, request=_request("a"), codec=None)  # type: ignore[arg-type]
    assert attempt.claim().outcome is Outcome.ACQUIRED
    return attempt


def test_a_claim_just_made_is_held_without_asking_the_store() -> None:
    store = _CountedExtends()
    assert _attempt(store).held_at_start()
    assert store.extends == 0


def test_a_claim_asked_for_half_a_lease_ago_is_checked_with_the_store() -> None:
    store = _CountedExtends()
    attempt = _attempt(store)
    attempt.asked_at = lease_clock() - LEASE / 2
    # Still held: the store says so (and its lease is renewed)
    assert attempt.held_at_start()
    assert store.extends == 1
    # Taken over by another execution meanwhile: not held
    assert store.claim(_request("b", previous_owner="a")).outcome is Outcome.ACQUIRED
    assert not attempt.held_at_start()


@pytest.fixture()
def app(redis_url: str) -> Celery:
    app = Celery(
        "paused-owner", broker=f"{redis_url}/{BROKER_DB}", backend=f"{redis_url}/{BACKEND_DB}"
    )
    app.conf.update(
        idempotency_store_url=f"{redis_url}/{BACKEND_DB}",
        idempotency_lease=LEASE,
        task_default_queue=fresh("paused-owner"),
    )
    return app


@pytest.mark.parametrize(
    "took_over_a_lost_call", [False, True], ids=["own-key", "key-of-a-lost-call"]
)
def test_a_worker_paused_until_its_claim_was_taken_over_and_completed_runs_no_body(
    took_over_a_lost_call: bool, app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[str] = []

    @app.task(base=IdempotentTask, name=fresh("paused.charge"), shared=False)
    def charge(order: str) -> str:
        runs.append(order)
        return f"charged {order} here"

    # Given a call paused after its claim until another execution took the key over and
    # completed it (a claim that had itself taken the key over from a call whose message was
    # lost, in one case)
    lost_call = str(uuid.uuid4()) if took_over_a_lost_call else None
    paused = _paused_after_asking("charged o-1 by the other", taken_from=lost_call)
    monkeypatch.setattr(Attempt, "claim", paused)
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        result = charge.apply_async(("o-1",), idempotency_key=fresh("key"))
        # Then its body never ran, and the call answers with the key's completed value
        assert result.get(timeout=30) == "charged o-1 by the other"
        if lost_call is not None:
            # and so does the lost call, whose callers wait on its task id
            assert AsyncResult(lost_call, app=app).get(timeout=10) == "charged o-1 by the other"
    assert runs == []


def test_a_call_taken_over_while_its_body_ran_past_its_expiry_gets_the_keys_value(
    app: Celery,
) -> None:
    key = fresh("key")
    taken: list[tuple[ClaimRequest, int]] = []
    body_ends = threading.Event()

    @app.task(base=IdempotentTask, bind=True, name=fresh("paused.expiring"), shared=False)
    def charge(self: Any, order: str) -> str:
        # While its body runs past the call's expiry, another execution takes its key over
        # (its lease lapsed in a long pause, say), and has not finished when the body ends
        store = store_for(app)
        record = store.get(storage_key(self.name, key))
        assert record is not None
        taker = self._claim_request(
            key, (order,), {}, "the-taker", owner="taker", previous_owner=record.owner
        )
        taker = dataclasses.replace(taker, lease_seconds=60.0)
        taken.append((taker, store.claim(taker).token))
        time.sleep(EXPIRES + 0.5)  # the body began after the call was sent
        body_ends.set()
        return f"charged {order} here"

    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        result = _sent_and_received(
            lambda task_id: charge.apply_async(
                ("o-1",), idempotency_key=key, expires=EXPIRES, task_id=task_id
            )
        )
        # When the taker completes the key, after the call's body ended and began to wait
        assert body_ends.wait(30), "the body never ended"
        time.sleep(0.3)
        (taker, token), store = taken[0], store_for(app)
        store.complete(taker, token, charge._codec.encode("charged by the other")[0])
        # Then the copy the call waits with, sent past its expiry, was not dropped as expired:
        # its body had run, and its caller gets the key's value (not TaskRevokedError)
        assert result.get(timeout=30) == "charged by the other"


def _sent_and_received(send: Callable[[str], AsyncResult]) -> AsyncResult:
    """The call ``send(task_id)`` sends, once the worker (in this process) has received it.

    A worker drops a message received past its expiry unseen; the expiry tests need one
    received before it, whose copies then wait past it."""
    task_id, received = str(uuid.uuid4()), threading.Event()

    def on_received(request: Any, **_: Any) -> None:
        if request.id == task_id:
            received.set()

    task_received.connect(on_received, weak=False)
    try:
        result = send(task_id)
        assert received.wait(EXPIRES), "the worker did not receive the call before its expiry"
    finally:
        task_received.disconnect(on_received)
    return result


def _sent_duplicate(app: Celery, charge: Any, key: str) -> AsyncResult:
    """A duplicate of ``charge``'s call under ``key``, sent with an expiry of ``EXPIRES`` (not
    through apply_async, which would answer with the owner's result), once the worker received
    it; returns past that expiry, its first look at the key long done."""
    sent = time.monotonic()
    duplicate = _sent_and_received(
        lambda task_id: app.send_task(
            charge.name,
            ("o-1",),
            headers={"idempotency_key": key},
            expires=EXPIRES,
            task_id=task_id,
        )
    )
    time.sleep(max(0.0, sent + EXPIRES + 0.5 - time.monotonic()))
    return duplicate


def _owner_dies(app: Celery, owner: ClaimRequest, token: int) -> None:
    """The key's owner renews its lease a last time, for 0.2 s, and is gone."""
    assert store_for(app).extend(dataclasses.replace(owner, lease_seconds=0.2), token)


def _counting_charge(app: Celery, runs: list[str]) -> Any:
    """A keyed task of ``app`` that notes each run of its body in ``runs``."""

    @app.task(base=IdempotentTask, name=fresh("expiry.charge"), shared=False)
    def charge(order: str) -> str:
        runs.append(order)
        return f"charged {order}"

    return charge


def _held_by_the_owner(
    app: Celery, charge: Any, key: str, lease: float, *, reserved: bool = False
) -> tuple[ClaimRequest, int]:
    """Key ``key`` claimed by call "the-owner" (``reserved``: with its message kept for the
    guard) in the worker's store, as a worker elsewhere would; its request and token."""
    store = store_for(app)
    owner = charge._claim_request(key, ("o-1",), {}, "the-owner", owner="owner")
    owner = dataclasses.replace(owner, lease_seconds=lease)
    if reserved:
        pickup = make_pickup(("o-1",), {}, {}, 60.0, 0.0)
        assert pickup is not None and store.reserve(owner, pickup) is None
    claim = store.claim(owner)
    assert claim.outcome is Outcome.ACQUIRED
    return owner, claim.token


@pytest.mark.parametrize("owner_ends", ["completes", "releases"])
def test_a_duplicate_waiting_past_its_calls_expiry_gets_the_value_or_ends_expired(
    app: Celery, owner_ends: str
) -> None:
    runs: list[str] = []
    charge, key = _counting_charge(app, runs), fresh("key")
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        # Given a key another execution holds, alive throughout
        owner, token = _held_by_the_owner(app, charge, key, lease=60.0)
        store = store_for(app)
        # When a duplicate sent with an expiry waits for it past that
        duplicate = _sent_duplicate(app, charge, key)
        if owner_ends == "completes":
            # Then once the owner completes, the duplicate's caller gets its value: the copies
            # it waited with were not dropped as expired
            store.complete(owner, token, charge._codec.encode("charged by the owner")[0])
            assert duplicate.get(timeout=30) == "charged by the owner"
        else:
            # Then once the owner releases the key (it failed), the duplicate, which would now
            # run the key itself, ends expired, unrun
            assert store.release(owner, token)
            with pytest.raises(TaskRevokedError):
                duplicate.get(timeout=30)
    assert runs == []


def test_a_copy_past_its_calls_expiry_that_takes_a_dead_owners_key_over_runs_it(
    app: Celery,
) -> None:
    runs: list[str] = []
    charge, key = _counting_charge(app, runs), fresh("key")
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        # Given a key another call holds, reserved with its message for the pickup guard
        owner, token = _held_by_the_owner(app, charge, key, lease=60.0, reserved=True)
        # When a duplicate sent with an expiry waits past it, and its owner then dies, so that
        # the duplicate takes the key over
        duplicate = _sent_duplicate(app, charge, key)
        _owner_dies(app, owner, token)
        # Then it runs the key (ended as expired, its release would drop the other call's
        # message with the key, and that call would never be answered), and both calls get
        # its value
        assert duplicate.get(timeout=30) == "charged o-1"
        assert AsyncResult("the-owner", app=app).get(timeout=10) == "charged o-1"
    assert runs == ["o-1"]


@pytest.mark.parametrize("retries", ["once", "again-after-throw-false"])
def test_a_copy_past_its_calls_expiry_that_retries_without_it_runs_the_retry(
    app: Celery, retries: str
) -> None:
    runs: list[str] = []

    @app.task(base=IdempotentTask, bind=True, name=fresh("expiry.retrying"), shared=False)
    def charge(self: Any, order: str) -> str:
        runs.append(order)
        if len(runs) == 1:
            if retries == "again-after-throw-false":
                # a retry published without raising, then one that replaces it: the second
                # finds this attempt's claim already handed on
                self.retry(countdown=60, throw=False)
            raise self.retry(countdown=0.2, expires=None)
        return f"charged {order}"

    key = fresh("key")
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        # Given a copy of a call sent with an expiry that takes a dead owner's key over past it
        # (so runs), and retries itself with no expiry of its own
        owner, token = _held_by_the_owner(app, charge, key, lease=60.0, reserved=True)
        duplicate = _sent_duplicate(app, charge, key)
        _owner_dies(app, owner, token)
        # Then the retry runs, though it comes past the call's expiry: it was sent without it
        assert duplicate.get(timeout=30) == "charged o-1"
    assert runs == ["o-1", "o-1"]


def test_a_retry_sent_without_its_calls_expiry_keeps_its_key_queued_past_it(app: Celery) -> None:
    @app.task(base=IdempotentTask, bind=True, name=fresh("retry.expiry"), shared=False)
    def charge(self: Any, order: str) -> str:
        raise self.retry(countdown=60, expires=None)

    key = fresh("key")
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        # Given a call sent with an expiry, which retries itself in a minute without it
        sent = time.monotonic()
        _sent_and_received(
            lambda task_id: charge.apply_async(
                ("o-1",), idempotency_key=key, expires=EXPIRES, task_id=task_id
            )
        )
        store, stored_as = store_for(app), storage_key(charge.name, key)  # the worker's store

        def queued_for_the_retry() -> bool:
            record = store.get(stored_as)
            return record is not None and record.owner == retry_marker(1)

        wait_until(queued_for_the_retry, 10, "the key queued for the retry")
        time.sleep(max(0.0, sent + EXPIRES + 0.5 - time.monotonic()))
        # Then past that expiry the key stays queued for the retry, not due as if it expired
        # (the guard or a call of the key would free it, and the retry go unguarded)
        record = store.get(stored_as)
        assert record is not None and record.status is Status.QUEUED
        assert record.lease_expires_at > record.store_time() + 30


def test_an_rq_job_paused_until_its_claim_was_taken_over_and_completed_runs_no_body(
    redis_url: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    connection = redis.Redis.from_url(f"{redis_url}/{RQ_DB}")
    queue = IdempotentQueue(
        fresh("paused-owner"), connection=connection, dlq_url=f"sqlite:///{tmp_path}/dlq.db"
    )
    name = fresh("paused")
    value = {"name": name, "value": 1, "run": 99}
    monkeypatch.setattr(Attempt, "claim", _paused_after_asking(value))
    try:
        job = queue.enqueue(rq_jobs.record, name, 1, idempotency_key=fresh("key"))
        SimpleWorker([queue], connection=connection, job_class=IdempotentJob).work(burst=True)
        # Then its body never ran, and the job ends with the key's completed value
        assert rq_jobs.starts(name) == 0
        assert IdempotentJob.fetch(job.id, connection=connection).return_value() == value
    finally:
        queue.delete(delete_jobs=True)


def test_a_claim_whose_pause_check_meets_a_down_store_is_taken_back_at_once(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[str] = []

    @app.task(base=IdempotentTask, name=fresh("paused.charge"), shared=False, idempotency_lease=60)
    def charge(order: str) -> str:
        runs.append(order)
        return f"charged {order}"

    # Given a claim acquired, whose check after a pause finds the store down
    monkeypatch.setattr(defaults, "STORE_UNAVAILABLE_DELAY", 0.2)
    monkeypatch.setattr(Attempt, "held_at_start", _failing_once(StoreUnavailable("down")))
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        # When the call runs, then its copy, sent again, takes that claim back at once rather
        # than wait out its 60 s lease, and the body runs once
        result = charge.apply_async(("o-1",), idempotency_key=fresh("key"))
        assert result.get(timeout=20) == "charged o-1"
    assert runs == ["o-1"]


def test_a_soft_time_limit_before_the_body_fails_the_call_into_the_dead_letter_table(
    app: Celery, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    app.conf.idempotency_dlq_url = f"sqlite:///{tmp_path}/dlq.db"
    runs: list[str] = []

    @app.task(base=IdempotentTask, name=fresh("paused.charge"), shared=False, idempotency_lease=60)
    def charge(order: str) -> str:
        runs.append(order)
        return f"charged {order}"

    # Given a claim acquired, and the call's soft time limit firing before its body begins
    # (the process paused past it)
    monkeypatch.setattr(Attempt, "held_at_start", _failing_once(SoftTimeLimitExceeded()))
    key = fresh("key")
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        result = charge.apply_async(("o-1",), idempotency_key=key)
        # When it runs, then it fails as a body reaching its limit would
        with pytest.raises(SoftTimeLimitExceeded):
            result.get(timeout=20)
    assert runs == []
    # And it waits in the dead-letter table, its key released for that retry to claim
    dead_letters = DeadLetterQueue(app.conf.idempotency_dlq_url)
    try:
        [row] = [item for item in dead_letters.items() if item.task_id == result.id]
        assert (row.error_type, row.idempotency_key) == ("SoftTimeLimitExceeded", key)
    finally:
        dead_letters.dispose()
    record = store_for(app).get(storage_key(charge.name, key))
    assert record is None or record.status is not Status.PROCESSING


def test_a_soft_time_limit_during_the_claims_round_trip_leaves_no_claim_behind(
    app: Celery, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    app.conf.idempotency_dlq_url = f"sqlite:///{tmp_path}/dlq.db"

    @app.task(base=IdempotentTask, name=fresh("paused.charge"), shared=False, idempotency_lease=60)
    def charge(order: str) -> str:
        return f"charged {order}"

    # Given a call whose soft time limit fires while its claim is on its way: the store made
    # the claim, its reply never read
    def claimed_then_interrupted(self: Attempt) -> None:
        self.store.claim(self.request)
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(Attempt, "claim", claimed_then_interrupted)
    key = fresh("key")
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        result = charge.apply_async(("o-1",), idempotency_key=key)
        with pytest.raises(SoftTimeLimitExceeded):
            result.get(timeout=20)
    # Then the claim its owner never heard of is released, not left for its 60 s lease (its
    # dead letter's retry and every duplicate would wait that out)
    record = store_for(app).get(storage_key(charge.name, key))
    assert record is None or record.status is not Status.PROCESSING, record


def test_a_completion_meeting_a_store_down_past_its_lease_keeps_trying_and_stores_it(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[str] = []

    @app.task(base=IdempotentTask, name=fresh("paused.outage"), shared=False)
    def charge(order: str) -> str:
        runs.append(order)
        return f"charged {order}"

    # Given a store that, as the body finishes, is unreachable for twice the (2 s) lease (a
    # Redis restarting, loading its data)
    complete = RedisStore.complete
    back_at: list[float] = []

    def restarting(self: RedisStore, *args: Any, **kwargs: Any) -> Any:
        if not back_at:
            back_at.append(time.monotonic() + 2 * LEASE)
        if time.monotonic() < back_at[0]:
            raise StoreUnavailable("Redis is loading the dataset in memory")
        return complete(self, *args, **kwargs)

    monkeypatch.setattr(RedisStore, "complete", restarting)
    key = fresh("key")
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        # When a keyed call runs
        assert charge.apply_async(("o-1",), idempotency_key=key).get(timeout=30) == "charged o-1"
        # Then its completion outlasted the outage and its lease: the key is done, and a
        # duplicate is answered with its value rather than run the body again
        assert back_at, "the completion never met the outage"
        record = store_for(app).get(storage_key(charge.name, key))
        assert record is not None and record.status is Status.COMPLETED
        duplicate = charge.apply_async(("o-1",), idempotency_key=key)
        assert duplicate.get(timeout=20) == "charged o-1"
    assert runs == ["o-1"]


def test_a_replaced_calls_completion_waits_for_a_store_down_only_until_its_hard_limit(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.task(name=fresh("paused.next"), shared=False)
    def next_step(order: str) -> str:
        return f"next {order}"

    # Given a call with a 60 s lease and a 5 s hard time limit that replaces itself
    @app.task(
        base=IdempotentTask,
        bind=True,
        name=fresh("paused.replaced"),
        shared=False,
        idempotency_lease=60,
        time_limit=5,
    )
    def replaced(self: Any, order: str) -> None:
        raise self.replace(next_step.s(order))

    patience: list[tuple[Any, float]] = []
    finish = Attempt.finish

    def noted_finish(self: Attempt, value: Any, patience_seconds: float, *more: Any) -> Any:
        patience.append((value, patience_seconds))
        return finish(self, value, patience_seconds, *more)

    monkeypatch.setattr(Attempt, "finish", noted_finish)
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        result = replaced.apply_async(("o-1",), idempotency_key=fresh("key"))
        assert result.get(timeout=20) == "next o-1"
    # Then marking its key done (a store down would have it wait) may take no longer than its
    # hard limit leaves, not a whole lease: killed at it, a call that did its work would be
    # dead-lettered, and its replacement sent again
    [(_, seconds)] = patience
    assert seconds <= 5 - HARD_LIMIT_MARGIN


def _failing_once(error: BaseException) -> Any:
    """``Attempt.held_at_start`` raising ``error`` the first time it is asked."""
    checked = Attempt.held_at_start
    raised: list[BaseException] = []

    def held_at_start(self: Attempt) -> bool:
        if not raised:
            raised.append(error)
            raise error
        return checked(self)

    return held_at_start


def _paused_after_asking(
    others_value: Any, taken_from: str | None = None, pause: float = 0.0
) -> Any:
    """``Attempt.claim`` whose first acquired claim comes back after a pause (of ``pause``
    seconds on the clock too) in which its lease ran out and another execution took the key
    over and completed it with ``others_value``; with ``taken_from``, that claim had taken the
    key over from that call."""
    asked = Attempt.claim
    paused: list[str] = []

    def claim_then_pause(self: Attempt) -> Any:
        result = asked(self)
        if result.outcome is Outcome.ACQUIRED and not paused:
            paused.append(self.request.task_id)
            time.sleep(pause)
            if taken_from is not None:
                self.taken_from_task_id = taken_from
            self.asked_at = lease_clock() - self.request.lease_seconds
            other = dataclasses.replace(
                self.request,
                owner=uuid.uuid4().hex,
                task_id=str(uuid.uuid4()),
                previous_owner=self.request.owner,
            )
            taken = self.store.claim(other)
            assert taken.outcome is Outcome.ACQUIRED
            encoded, _ = self.codec.encode(others_value)
            self.store.complete(other, taken.token, encoded)
        return result

    return claim_then_pause


def test_a_call_that_took_over_a_lost_calls_key_and_replaced_itself_answers_that_call(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[int] = []

    @app.task(base=IdempotentTask, name=fresh("polls"), bind=True, shared=False)
    def polls(self: Any, left: int) -> str:
        runs.append(left)
        if left > 0:
            raise self.replace(polls.si(left - 1))
        return "polled"

    # Given a call whose claim took the key over from another call (whose message was lost)
    lost_call = str(uuid.uuid4())
    asked = Attempt.claim

    def claim_taken_from_a_lost_call(self: Attempt) -> Any:
        result = asked(self)
        if result.outcome is Outcome.ACQUIRED and not runs:
            self.taken_from_task_id = lost_call
        return result

    monkeypatch.setattr(Attempt, "claim", claim_taken_from_a_lost_call)
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        # When it replaces itself (a polling loop) under its key until it is done
        result = polls.apply_async((1,), idempotency_key=fresh("key"))
        assert result.get(timeout=30) == "polled"
        # Then the lost call's callers get the loop's value too
        assert AsyncResult(lost_call, app=app).get(timeout=10) == "polled"
    assert runs == [1, 0]
