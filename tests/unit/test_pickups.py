"""The pickup guard's pure parts: envelopes, timeouts, waits."""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import logging
import time
import uuid
from datetime import datetime, timedelta, timezone
from datetime import time as time_of_day
from types import SimpleNamespace
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.exceptions import Ignore, Reject, Retry
from dateutil.tz import tzutc
from kombu import Exchange, Queue
from kombu.exceptions import EncodeError, OperationalError

from idempotent_tasks import IdempotentTask, pickups, publishing
from idempotent_tasks.app_store import store_for
from idempotent_tasks.errors import CorruptRecord, StoreUnavailable
from idempotent_tasks.keys import storage_key
from idempotent_tasks.pickups import (
    REPUBLISHED_HEADER,
    envelope,
    loads,
    make_pickup,
    pickup_timeout,
    republish,
    republish_lost,
    seconds_until,
)
from idempotent_tasks.records import ClaimRequest, DuePickup, Outcome, Status
from idempotent_tasks.stores import MemoryStore
from idempotent_tasks.task import KEY_HEADER
from tests.claim_requests import claim_request


def _app(**conf: Any) -> Celery:
    app = Celery("pickups", set_as_current=False)
    app.conf.update(conf)
    return app


def test_envelope_keeps_arguments_and_routing_and_drops_the_rest() -> None:
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    ident = uuid.uuid4()
    body = envelope(
        (1, "two", when),
        {"ident": ident},
        {
            "queue": Queue("payments"),
            "priority": 3,
            "headers": {"idempotency_key": "k"},
            "countdown": 10,  # relative: make_pickup keeps the moment it stands for, as an eta
            "producer": object(),
        },
    )
    assert body is not None
    message = loads(body.decode())
    assert message["args"] == [1, "two", when]
    assert message["kwargs"] == {"ident": ident}
    assert message["options"] == {
        "queue": "payments",
        "priority": 3,
        "headers": {"idempotency_key": "k"},
    }


def test_envelope_keeps_what_events_and_logs_show_of_the_arguments() -> None:
    # A caller that hides its arguments from events and logs (argsrepr, kwargsrepr) has them
    # hidden in the guard's copy too
    hidden = {"argsrepr": "(card: ***)", "kwargsrepr": "{}", "compression": "zlib"}
    body = envelope(("4111 1111 1111 1111",), {}, hidden)
    assert body is not None
    assert loads(body.decode())["options"] == hidden


@pytest.mark.parametrize("made", ["in a task", "outside any task"])
def test_a_copy_of_a_call_made_in_a_task_keeps_its_root_and_parent_ids(
    made: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a keyed call made by a running task (Celery gives its message that task's root
    # and parent ids), or made outside any task
    app = _app(idempotency_store_url="memory://")

    @app.task(base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        return order

    running = SimpleNamespace(request=SimpleNamespace(id="parent-id", root_id="root-id"))
    monkeypatch.setattr(
        Celery, "current_worker_task", property(lambda _: running if made == "in a task" else None)
    )
    _, pickup = publishing.prepare(charge, "k", ("o",), {}, "call-id", {})
    assert pickup is not None
    carried = loads(pickup.envelope.decode())["options"]
    # Then the copy the sweep sends keeps them (sent from the sweep task, it would get that
    # task's), unless the caller gave its own
    if made == "in a task":
        assert (carried["root_id"], carried["parent_id"]) == ("root-id", "parent-id")
        _, given = publishing.prepare(
            charge, "k", ("o",), {}, "call-id", {"root_id": "r", "parent_id": "p"}
        )
        assert given is not None
        assert loads(given.envelope.decode())["options"]["root_id"] == "r"
    else:  # its own root, as a dead letter's retry is
        assert carried["root_id"] == "call-id" and "parent_id" not in carried


@pytest.mark.parametrize("when", ["countdown", "eta"])
def test_a_copy_of_a_call_that_waits_keeps_the_moment_it_is_to_run(when: str) -> None:
    # Given a call to run ten minutes from now, by a countdown or an eta
    run_at = datetime.now(timezone.utc) + timedelta(minutes=10)
    options = {"countdown": 600} if when == "countdown" else {"eta": run_at}
    pickup = make_pickup(("o",), {}, options, timeout=30, wait=600)
    assert pickup is not None
    # Then its copy carries that moment, so that a copy sent early (its first publish failed,
    # and the guard sends it at once) still waits for it
    carried = loads(pickup.envelope.decode())["options"]
    assert set(carried) == {"eta"}
    assert abs((carried["eta"] - run_at).total_seconds()) < 5
    sent: dict[str, Any] = {}
    republish(
        SimpleNamespace(send_task=lambda name, **options: sent.update(options)),
        DuePickup(
            storage_key="t:k",
            task_id="id-1",
            task_name="t",
            envelope=pickup.envelope,
            republished=1,
        ),
    )
    assert sent["eta"] == carried["eta"]
    # And a call that runs at once carries none
    at_once = make_pickup(("o",), {}, {}, timeout=30, wait=0)
    assert at_once is not None and "eta" not in loads(at_once.envelope.decode())["options"]


def test_envelope_keeps_stamps_and_drops_with_its_name_a_stamp_json_cannot_hold() -> None:
    body = envelope(
        ("o",),
        {},
        {"stamped_headers": ["on_behalf", "monitor"], "on_behalf": "ops", "monitor": object()},
    )
    assert body is not None
    options = loads(body.decode())["options"]
    # Celery publishes each name of stamped_headers from the options: none may be missing
    assert options == {"stamped_headers": ["on_behalf"], "on_behalf": "ops"}


def test_envelope_names_no_stamp_it_does_not_hold() -> None:
    body = envelope(("o",), {}, {"stamped_headers": ["on_behalf", "gone"], "on_behalf": "ops"})
    assert body is not None
    assert loads(body.decode())["options"] == {"stamped_headers": ["on_behalf"], "on_behalf": "ops"}


def test_arguments_that_are_not_json_give_no_envelope() -> None:
    assert envelope((object(),), {}, {}) is None


def test_pickup_timeout_defaults_to_the_visibility_timeout_then_an_hour() -> None:
    assert pickup_timeout(_app().conf) == 3600
    visibility = _app(broker_transport_options={"visibility_timeout": 42})
    assert pickup_timeout(visibility.conf) == 42
    configured = _app(
        idempotency_pickup_timeout=7, broker_transport_options={"visibility_timeout": 42}
    )
    assert pickup_timeout(configured.conf) == 7


def test_a_zero_timeout_turns_the_guard_off() -> None:
    assert make_pickup([1], {}, {}, 0.0, wait=5) is None
    pickup = make_pickup([1], {}, {}, 10.0, wait=0)
    assert pickup is not None and pickup.due_in == 10 and pickup.timeout == 10
    assert pickup.envelope == envelope([1], {}, {})
    waiting = make_pickup([1], {}, {}, 10.0, wait=5)
    assert waiting is not None and waiting.due_in == 15


def test_a_message_that_cannot_be_kept_gets_no_pickup() -> None:
    assert make_pickup([object()], {}, {}, 10.0, wait=0) is None


@pytest.mark.parametrize(
    ("countdown", "eta_in", "expected"),
    [
        (None, None, 0.0),
        (5, None, 5.0),
        (-3, None, 0.0),
        (None, 30, 30.0),
        (None, -30, 0.0),
        # both given: a countdown wins, as Celery's message makes its eta from it; 0 does not
        (7200, 0, 7200.0),
        (0, 30, 30.0),
    ],
)
def test_seconds_until_reads_countdowns_and_etas(
    countdown: float | None, eta_in: float | None, expected: float
) -> None:
    eta = None
    if eta_in is not None:
        eta = datetime.now(timezone.utc) + timedelta(seconds=eta_in)
    assert seconds_until(countdown, eta) == pytest.approx(expected, abs=0.5)


def test_seconds_until_reads_iso_etas_too() -> None:
    eta = (datetime.now(timezone.utc) + timedelta(seconds=60)).isoformat()
    assert seconds_until(None, eta) == pytest.approx(60, abs=0.5)


def test_a_naive_eta_is_utc_as_celerys_worker_reads_it_whatever_the_local_zone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A host nine hours east of UTC, whose local clock a naive datetime.now() would read
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        naive_utc = datetime.now(timezone.utc).replace(tzinfo=None) + timedelta(hours=2)
        assert seconds_until(None, naive_utc) == pytest.approx(7200, abs=1)
        assert seconds_until(None, naive_utc.isoformat()) == pytest.approx(7200, abs=1)
    finally:
        monkeypatch.undo()
        time.tzset()


def test_an_option_that_is_not_json_is_left_out_and_the_rest_kept(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pickups, "_WARNED_LEFT_OUT", set())
    body = envelope((1,), {}, {"queue": "q", "link": object()})
    assert body is not None
    assert loads(body.decode()) == {"args": [1], "kwargs": {}, "options": {"queue": "q"}}
    # and it is said which (a copy sent again would go without its callback), once a process
    assert envelope((2,), {}, {"queue": "q", "link": object()}) is not None
    warned = [line for line in caplog.messages if "leave out" in line and "(link)" in line]
    assert len(warned) == 1


def test_an_envelope_keeps_canvas_signatures_whole_and_an_expiry_as_a_moment() -> None:
    app = _app()

    @app.task(shared=False)
    def step(value: Any) -> Any:
        return value

    link, errback, body = step.s("linked"), step.s("failed"), step.s()
    before = datetime.now(timezone.utc)
    kept = envelope(
        (1,),
        {},
        {
            "link": link,
            "link_error": [errback],
            "chord": body,
            "exchange": Exchange("payments"),
            "expires": 60,
            "ignore_result": True,
        },
    )
    assert kept is not None
    options = loads(kept.decode())["options"]
    # Signatures stay signatures (not their task names), kombu objects become their names
    assert options["link"] == json.loads(json.dumps(link))
    assert options["link_error"] == [json.loads(json.dumps(errback))]
    assert options["chord"] == json.loads(json.dumps(body))
    assert options["exchange"] == "payments"
    assert options["ignore_result"] is True
    # A relative expiry becomes the moment it ends, so a later re-publication does not renew it
    expires = datetime.fromisoformat(options["expires"])
    assert (
        before + timedelta(seconds=59)
        < expires
        < datetime.now(timezone.utc) + timedelta(seconds=61)
    )


def test_a_retrys_pickup_keeps_its_chord_expiry_time_limits_shadow_and_stamps() -> None:
    app = _app(idempotency_store_url="memory://")

    @app.task(base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        return order

    body = json.loads(json.dumps(charge.s("body")))
    charge.push_request(
        id="t-1",
        args=["o"],
        kwargs={},
        retries=0,
        delivery_info={"exchange": "", "routing_key": "payments"},
        chord=body,
        group="g-1",
        group_index=2,
        expires="2030-01-02T03:04:05+00:00",
        timelimit=(30, 20),
        shadow="charge (shadow)",
        ignore_result=True,
        reply_to="caller-oid",
        stamped_headers=["on_behalf", "queue"],
        stamps={"on_behalf": "ops", "queue": "elsewhere"},
    )
    try:
        pickup = charge._message_pickup("k", None, None, 0.0, retries=1)
    finally:
        charge.pop_request()
    assert pickup is not None
    message = loads(pickup.envelope.decode())
    assert message["args"] == ["o"]
    options = message["options"]
    assert options["chord"] == body
    assert (options["group_id"], options["group_index"]) == ("g-1", 2)
    assert options["expires"] == "2030-01-02T03:04:05+00:00"
    assert (options["time_limit"], options["soft_time_limit"]) == (30, 20)
    assert options["reply_to"] == "caller-oid"
    assert options["ignore_result"] is True
    assert (options["shadow"], options["queue"], options["retries"]) == (
        "charge (shadow)",
        "payments",
        1,
    )
    # Its stamps go along, as Celery's retry sends them; one named like an option of the
    # message's own does not move it elsewhere
    assert options["stamped_headers"] == ["on_behalf", "queue"]
    assert options["on_behalf"] == "ops"


def test_a_sweep_that_meets_an_unreachable_broker_ends_and_hands_every_key_back_uncounted() -> None:
    # Given more lost messages than one batch, and a broker that cannot be reached
    app = _app(idempotency_store_url="memory://")
    store = MemoryStore(clock=lambda: now[0])
    now = [1000.0]
    for index in range(5):
        request = claim_request(
            key=f"k{index}",
            storage_key=f"t:k{index}",
            task_id=f"task-{index}",
            owner="",
            ttl_seconds=3600,
        )
        assert store.reserve(request, make_pickup([index], {}, {}, 10.0, wait=0)) is None
    now[0] += 11
    sent: dict[str, int] = {}

    def unreachable(*args: Any, **kwargs: Any) -> None:
        raise OperationalError("broker unreachable")

    app.send_task = unreachable  # type: ignore[method-assign]
    # When the sweep runs in batches of three, then it ends at once, having sent nothing
    assert republish_lost(app, store, batch=3) == 0
    # And every key is due at once, its count of re-publications untouched: once the broker
    # is back, the next sweep sends each one, as its first re-publication
    app.send_task = lambda name, **options: sent.update(  # type: ignore[method-assign]
        {options["task_id"]: options["headers"][REPUBLISHED_HEADER]}
    )
    assert republish_lost(app, store, batch=3) == 5
    assert sent == {f"task-{index}": 1 for index in range(5)}


def _kept_message(task: Any, key: str = "k") -> dict[str, Any]:
    """The message the pickup guard keeps for ``key`` of ``task`` (its memory store's)."""
    store = store_for(task.app)
    assert isinstance(store, MemoryStore)
    return dict(loads(store._pending[storage_key(task.name, key)].pickup.envelope.decode()))


def _run_delivered(
    task: Any,
    args: list[Any],
    task_id: str,
    ends_with: type[BaseException],
    publish: Any = lambda *args, **kwargs: None,
    **request: Any,
) -> Any:
    """Run ``task`` as a worker runs a delivered message of key ``k`` (``publish`` taking
    what it sends: nothing is sent), which ends with ``ends_with``; what it raised."""
    with pytest.raises(ends_with) as raised:
        _call_delivered(task, args, task_id, publish, **request)
    return raised.value


def _call_delivered(
    task: Any,
    args: list[Any],
    task_id: str,
    publish: Any = lambda *args, **kwargs: None,
    **request: Any,
) -> Any:
    """Run ``task`` as a worker runs a delivered message of key ``k`` (``publish`` taking
    what it sends: nothing is sent); what it returned."""
    task.push_request(
        id=task_id,
        args=args,
        kwargs={},
        retries=0,
        headers={KEY_HEADER: "k"},
        called_directly=False,
        delivery_info=request.pop("delivery_info", {"exchange": "", "routing_key": "celery"}),
        **request,
    )
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(task, "apply_async", publish)
            return task(*args)
    finally:
        task.pop_request()


def _publish(task: Any, task_id: str, **options: Any) -> None:
    """A keyed publish of ``task`` under key ``k``, nothing sent to a broker."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(task.app, "send_task", lambda *args, **kwargs: None)
        task.apply_async(("o",), idempotency_key="k", task_id=task_id, **options)


@pytest.mark.parametrize(
    ("explicit", "extra"),
    [({"kwargs": {"amount": 991}}, {}), ({}, {"queue": "slow", "priority": 3})],
)
def test_a_retrys_pickup_is_the_message_celery_sends(
    explicit: dict[str, Any], extra: dict[str, Any]
) -> None:
    app = _app(idempotency_store_url="memory://")

    @app.task(base=IdempotentTask, bind=True, shared=False)
    def charge(self: Any, order: int, amount: int) -> int:
        raise self.retry(countdown=60, **explicit, **extra)

    retried = _run_delivered(charge, [42, 990], "t-2", Retry)
    # The key is queued for the retry, and the guard's copy is the retry Celery made
    record = store_for(app).get(storage_key(charge.name, "k"))
    assert record is not None and record.status is Status.QUEUED
    message = _kept_message(charge)
    assert (message["args"], message["kwargs"]) == (
        list(retried.sig.args),
        dict(retried.sig.kwargs),
    )
    for name, value in extra.items():
        assert message["options"][name] == value


def test_a_retry_the_broker_cannot_take_is_handed_to_the_guard_at_once() -> None:
    app = _app(idempotency_store_url="memory://")

    @app.task(base=IdempotentTask, bind=True, shared=False)
    def charge(self: Any, order: str) -> str:
        if self.request.retries == 0:
            raise self.retry(countdown=60)
        return order

    def broker_down(*args: Any, **kwargs: Any) -> None:
        raise OperationalError("the broker is down")

    # Given a call whose retry the broker cannot take: its message goes back to the broker
    _run_delivered(charge, ["o"], "t-9", Reject, publish=broker_down)
    # Then the key is due at once, for the guard to send the retry's message (its countdown
    # kept), not in a minute and a pickup timeout
    [due] = store_for(app).take_due(10)
    options = loads(due.envelope.decode())["options"]
    assert (due.task_id, options["retries"]) == ("t-9", 1)
    assert options["eta"] is not None
    # And the message handed back, which counts no retries, is dropped when it comes
    _run_delivered(charge, ["o"], "t-9", Ignore)


def _retrying_taker_of_a_lost_call(
    app: Celery, *, requeues: bool = False, throw: bool = True, lost_expires: float | None = None
) -> Any:
    """A task whose first run retries (``requeues``: hands its message back; ``throw=False``:
    sends its retry without raising, and returns), and a lost call "t-lost" of it, whose
    message its key kept (counted as lost; ``lost_expires``: sent with that expiry): a
    delivered message of the task takes the key over and owes it."""

    @app.task(base=IdempotentTask, bind=True, shared=False)
    def charge(self: Any, order: str) -> str:
        if requeues:
            raise Reject("not now", requeue=True)
        if self.request.retries == 0:
            if not throw:
                self.retry(countdown=60, throw=False)
                return order
            raise self.retry(countdown=60)
        return order

    lost = charge._claim_request("k", ("o",), {}, "t-lost", owner="lost-owner")
    options = {"headers": {KEY_HEADER: "k"}, "expires": lost_expires}
    pickup = make_pickup(("o",), {}, options, 60.0, 0.0)
    assert pickup is not None
    store_for(app).reserve(lost, dataclasses.replace(pickup, due_in=0.0))
    time.sleep(0.01)  # counted as lost
    return charge


@pytest.mark.parametrize(
    "publish", ["goes out", "finds the broker down", "is refused for good", "meets a store down"]
)
def test_a_retry_publishes_the_lost_message_its_claim_owes_before_its_release(
    publish: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = _app(idempotency_store_url="memory://")
    charge = _retrying_taker_of_a_lost_call(app)
    store, stored_as = store_for(app), storage_key(charge.name, "k")
    sent: list[str] = []

    def send_task(name: str, *args: Any, task_id: str, **kwargs: Any) -> None:
        if publish == "finds the broker down":
            raise OperationalError("the broker is down")
        if publish == "is refused for good":
            raise EncodeError("cannot be encoded")
        sent.append(task_id)

    def store_down(request: ClaimRequest) -> bool:
        raise StoreUnavailable("restarting")

    monkeypatch.setattr(app, "send_task", send_task)
    if publish == "meets a store down":
        monkeypatch.setattr(store, "settle_owed_message", store_down)
    retries: list[dict[str, Any]] = []
    # When a message of the key takes it over from the lost call, and retries
    _run_delivered(charge, ["o"], "t-taker", Retry, publish=lambda *a, **o: retries.append(o))
    record = store.get(stored_as)
    assert record is not None
    previous = retries[0]["_idempotency_republish"]["idempotency_previous_owner"]
    retry = charge._claim_request(
        "k", ("o",), {}, "t-taker", owner="retry", previous_owner=previous
    )
    claim = store.claim(dataclasses.replace(retry, retries=1))
    if publish in ("goes out", "is refused for good"):
        # Then the lost call's message went out first (it waits for the key's value), or was
        # refused for good (logged), and the key is queued for the retry, which owes nothing
        assert sent == (["t-lost"] if publish == "goes out" else [])
        assert (record.status, record.task_id) == (Status.QUEUED, "t-taker")
        assert (claim.outcome, claim.owed_task_id) == (Outcome.ACQUIRED, None)
    else:
        # Then the claim stays, still owing that message: the retry takes it over at once
        # (it names the claim's owner) and owes it in turn
        assert sent == []
        assert (record.status, record.task_id, record.owner) == (
            Status.PROCESSING,
            "t-taker",
            previous,
        )
        assert (claim.outcome, claim.owed_task_id) == (Outcome.ACQUIRED, "t-lost")


@pytest.mark.parametrize("first_publish", ["goes out", "finds the broker down"])
def test_a_call_retrying_without_raising_then_completing_sends_the_owed_message_once(
    first_publish: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = _app(idempotency_store_url="memory://")
    charge = _retrying_taker_of_a_lost_call(app, throw=False)
    attempts: list[str] = []

    def send_task(name: str, *args: Any, task_id: str, **kwargs: Any) -> None:
        attempts.append(task_id)
        if first_publish == "finds the broker down" and len(attempts) == 1:
            raise OperationalError("the broker is down for a moment")

    monkeypatch.setattr(app, "send_task", send_task)
    # When a message of the key takes it over from the lost call, sends a retry without
    # raising (throw=False) and then returns a value
    assert _call_delivered(charge, ["o"], "t-taker") == "o"
    # Then the lost call's message goes out once: before the retry's release, or (the broker
    # down then, the claim kept owing it) once the key completed
    if first_publish == "goes out":
        assert attempts == ["t-lost"]
    else:
        assert attempts == ["t-lost", "t-lost"]
    record = store_for(app).get(storage_key(charge.name, "k"))
    assert record is not None and record.status is Status.COMPLETED


def test_a_retry_after_taking_an_expired_calls_key_over_keeps_its_own_pickup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = _app(idempotency_store_url="memory://")
    charge = _retrying_taker_of_a_lost_call(app, lost_expires=0.005)
    time.sleep(0.01)  # the lost call expired
    sent: list[str] = []
    monkeypatch.setattr(app, "send_task", lambda *args, task_id, **kwargs: sent.append(task_id))
    # When a message of the key takes it over from the lost call, and retries
    _run_delivered(charge, ["o"], "t-taker", Retry)
    # Then the expired call's message is not sent (a worker would drop it unrun), yet its debt
    # is settled: the key is queued for the retry, whose pickup the guard keeps
    assert sent == []
    record = store_for(app).get(storage_key(charge.name, "k"))
    assert record is not None and (record.status, record.task_id) == (Status.QUEUED, "t-taker")


def test_a_message_handed_back_with_no_pickup_gives_the_key_back_to_the_owed_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a worker whose guard is off (its next message cannot be kept for the guard)
    app = _app(idempotency_store_url="memory://", idempotency_pickup_timeout=0)
    charge = _retrying_taker_of_a_lost_call(app, requeues=True)
    sent: list[str] = []
    monkeypatch.setattr(app, "send_task", lambda *args, task_id, **kwargs: sent.append(task_id))
    # When a message of the key takes it over from the lost call, and hands itself back
    _run_delivered(charge, ["o"], "t-taker", Reject)
    # Then the lost call's message is not sent from here: the key goes back to that call,
    # queued and due now, for the guard to send it once
    assert sent == []
    store = store_for(app)
    record = store.get(storage_key(charge.name, "k"))
    assert record is not None and (record.status, record.task_id) == (Status.QUEUED, "t-lost")
    assert [due.task_id for due in store.take_due(10)] == ["t-lost"]


def test_a_retry_the_broker_cannot_take_keeps_the_claim_owing_the_lost_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = _app(idempotency_store_url="memory://")
    charge = _retrying_taker_of_a_lost_call(app)

    def broker_down(*args: Any, **kwargs: Any) -> None:
        raise OperationalError("the broker is down")

    monkeypatch.setattr(app, "send_task", broker_down)
    # When a message of the key takes it over from the lost call and retries, while the
    # broker takes neither the lost call's message nor the retry (the message is handed back)
    _run_delivered(charge, ["o"], "t-taker", Reject, publish=broker_down)
    # Then the claim stays, still owing the lost call's message (the message handed back did
    # not take its place): the next claim of the call takes it over and owes it in turn
    store = store_for(app)
    record = store.get(storage_key(charge.name, "k"))
    assert record is not None
    assert (record.status, record.task_id) == (Status.PROCESSING, "t-taker")
    again = charge._claim_request(
        "k", ("o",), {}, "t-taker", owner="again", previous_owner=record.owner
    )
    assert store.claim(again).owed_task_id == "t-lost"


def test_a_message_handed_back_publishes_the_lost_message_its_claim_owes_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = _app(idempotency_store_url="memory://")
    charge = _retrying_taker_of_a_lost_call(app, requeues=True)
    sent: list[str] = []
    monkeypatch.setattr(app, "send_task", lambda *args, task_id, **kwargs: sent.append(task_id))
    # When a message of the key takes it over from the lost call, and hands itself back
    _run_delivered(charge, ["o"], "t-taker", Reject)
    # Then the lost call's message went out, and the key is queued for the message handed back
    assert sent == ["t-lost"]
    record = store_for(app).get(storage_key(charge.name, "k"))
    assert record is not None and (record.status, record.task_id) == (Status.QUEUED, "t-taker")


def test_a_call_that_hands_its_message_back_keeps_its_key_queued_for_it() -> None:
    app = _app(idempotency_store_url="memory://")

    @app.task(base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        raise Reject("not now", requeue=True)

    _run_delivered(charge, ["o"], "t-3", Reject)
    # The key is queued for the very message going back to the broker, guarded on its way
    record = store_for(app).get(storage_key(charge.name, "k"))
    assert record is not None and (record.status, record.task_id) == (Status.QUEUED, "t-3")


class _Currency(str, enum.Enum):
    EUR = "EUR"


@pytest.mark.parametrize(
    "changed_by_json",
    [
        {1: (3, 4)},
        _Currency.EUR,  # equal to "EUR", which JSON gives back
        collections.defaultdict(list),  # equal to {}
        datetime(2026, 7, 1, tzinfo=ZoneInfo("Europe/Paris")),  # equal, at a fixed offset
        time_of_day(12, tzinfo=ZoneInfo("Europe/Paris")),  # naive
    ],
    ids=["int-keys-and-tuple", "str-enum", "defaultdict", "named-zone", "time-in-a-named-zone"],
)
def test_a_pickle_message_json_would_change_is_not_kept_for_the_guard(
    changed_by_json: Any,
) -> None:
    changed = make_pickup((42, changed_by_json), {}, {}, 60.0, 0.0, serializer="pickle")
    # (a zone of one offset all year stays what it was, whatever object it is)
    fixed = [datetime(2026, 7, 1, tzinfo=zone) for zone in (timezone.utc, ZoneInfo("UTC"), tzutc())]
    kept = make_pickup((42, {"1": [3, 4]}, fixed), {}, {}, 60.0, 0.0, serializer="pickle")
    as_json = make_pickup((42, {1: (3, 4)}), {}, {}, 60.0, 0.0)
    assert changed is None
    # Arguments JSON gives back as they are are kept; and a JSON task's message is as Celery's
    # own JSON carries it anyway
    assert kept is not None and as_json is not None


def test_a_published_calls_copy_replies_to_the_caller() -> None:
    # rpc:// sends a result to the publishing thread's reply queue: the guard's copy must too
    app = _app(idempotency_store_url="memory://")

    @app.task(base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        return order

    _publish(charge, "t-4")
    assert _kept_message(charge)["options"]["reply_to"] == app.thread_oid


def test_a_tasks_own_expiry_is_kept_as_the_moment_it_ends() -> None:
    app = _app(idempotency_store_url="memory://")

    @app.task(base=IdempotentTask, shared=False, expires=60)
    def charge(order: str) -> str:
        return order

    before = datetime.now(timezone.utc)
    _publish(charge, "t-5")
    # A copy published an hour later expires when the call did, not 60 s after the copy
    expires = datetime.fromisoformat(_kept_message(charge)["options"]["expires"])
    assert before + timedelta(seconds=59) < expires < before + timedelta(seconds=62)


def test_a_retry_to_a_queue_of_its_own_is_kept_for_that_queue_alone() -> None:
    app = _app(idempotency_store_url="memory://")

    @app.task(base=IdempotentTask, bind=True, shared=False)
    def charge(self: Any, order: str) -> str:
        raise self.retry(countdown=60, queue="slow")

    delivered_from = {"exchange": "payments", "routing_key": "charge"}
    _run_delivered(charge, ["o"], "t-6", Retry, delivery_info=delivered_from)
    options = _kept_message(charge)["options"]
    # Not the delivery's exchange and routing key, which send_task would prefer to the queue
    assert options["queue"] == "slow"
    assert "exchange" not in options and "routing_key" not in options


@pytest.mark.filterwarnings("ignore::celery.exceptions.CDeprecationWarning")
@pytest.mark.parametrize("declared", [True, False], ids=["in-task-queues", "not-declared"])
def test_a_tasks_own_queue_given_as_an_entity_is_kept_as_celery_routes_it(declared: bool) -> None:
    orders = Queue("orders", Exchange("shop", "topic"), "order.new")
    app = _app(idempotency_store_url="memory://", task_queues=[orders] if declared else None)

    @app.task(base=IdempotentTask, shared=False, queue=orders)
    def charge(order: str) -> str:
        return order

    _publish(charge, "t-9")
    options = _kept_message(charge)["options"]
    # By its name where the app declares it (Celery's router finds it so); else by where it
    # goes (by name alone, it would stand for a plain queue "orders", routing key "orders")
    kept = {name: options.get(name) for name in ("queue", "exchange", "routing_key")}
    if declared:
        assert kept == {"queue": "orders", "exchange": None, "routing_key": None}
    else:
        assert kept == {"queue": None, "exchange": "shop", "routing_key": "order.new"}


def test_a_retrys_copy_is_encoded_as_celerys_retry_is() -> None:
    app = _app(idempotency_store_url="memory://", accept_content=["json", "pickle"])

    @app.task(base=IdempotentTask, bind=True, shared=False, serializer="pickle")
    def charge(self: Any, order: str) -> str:
        raise self.retry(countdown=60)

    _run_delivered(charge, ["o"], "t-10", Retry)
    options = _kept_message(charge)["options"]
    # A sweep without the task would send it as JSON, which a pickle-only worker refuses
    assert options["serializer"] == "pickle"


def test_an_explicit_expires_none_clears_the_tasks_own_in_the_copy() -> None:
    app = _app(idempotency_store_url="memory://")

    @app.task(base=IdempotentTask, shared=False, expires=60)
    def charge(order: str) -> str:
        return order

    _publish(charge, "t-7", expires=None)
    kept = _kept_message(charge)
    assert kept["options"]["expires"] is None
    # and the copy the sweep sends, from a process that has the task too, has no expiry
    queue = f"expires-{uuid.uuid4().hex}"  # (memory:// queues are the whole process's)
    app.conf.update(broker_url="memory://", task_default_queue=queue)
    body = json.dumps(kept).encode()
    republish(
        app,
        DuePickup(
            storage_key="charge:k",
            task_name=charge.name,
            task_id="t-7",
            envelope=body,
            republished=1,
        ),
    )
    with app.connection_for_read() as connection:
        message = connection.SimpleQueue(queue).get(timeout=1)
    assert message.headers["id"] == "t-7" and message.headers["expires"] is None


# (Celery 5.7 deprecates routing attributes of tasks, priority among them, for task_routes.)
@pytest.mark.filterwarnings("ignore::celery.exceptions.CDeprecationWarning")
def test_a_copy_keeps_the_tasks_own_priority_and_limits_for_a_sweep_without_the_task() -> None:
    app = _app(idempotency_store_url="memory://")

    @app.task(base=IdempotentTask, shared=False, priority=7, soft_time_limit=30, time_limit=60)
    def charge(order: str) -> str:
        return order

    _publish(charge, "t-8")
    options = _kept_message(charge)["options"]
    # Celery's apply_async gives the message these (a task's queue= too); a sweep's send_task
    # in a worker that does not import the task could not
    assert (options["priority"], options["soft_time_limit"], options["time_limit"]) == (7, 30, 60)


@pytest.mark.parametrize("as_moment", [False, True], ids=["seconds", "moment"])
def test_a_call_that_expires_is_due_when_it_does(as_moment: bool) -> None:
    # Expired, its message may be dropped unseen (RabbitMQ does): its key must not wait out
    # the whole pickup timeout for it
    expires: Any = datetime.now(timezone.utc) + timedelta(seconds=5) if as_moment else 5
    pickup = make_pickup([1], {}, {"expires": expires}, 3600.0, wait=0)
    assert pickup is not None and 4 <= pickup.due_in <= 5
    assert make_pickup([1], {}, {"expires": -3}, 3600.0, wait=0).due_in == 0  # type: ignore[union-attr]


def test_a_sweep_frees_the_key_of_a_call_that_expired_instead_of_sending_it_again() -> None:
    # Given a queued key whose call expired before any worker took it, and one that did not
    app = _app(idempotency_store_url="memory://")
    now = [1000.0]
    store = MemoryStore(clock=lambda: now[0])
    for name, expires in (("expired", 1), ("lasting", 3600)):
        request = claim_request(
            key=name,
            storage_key=f"t:{name}",
            task_id=f"task-{name}",
            owner="",
            ttl_seconds=3600,
        )
        pickup = make_pickup([name], {}, {"expires": expires}, 10.0, wait=0)
        assert store.reserve(request, pickup) is None
    sent: list[str] = []
    app.send_task = lambda *args, **kwargs: sent.append(kwargs["task_id"])  # type: ignore[method-assign]
    time.sleep(1.1)  # the first call's expiry is a moment on this host's clock
    now[0] += 11
    # When the sweep runs
    republish_lost(app, store)
    # Then the expired call is not sent again, and its key is free; the other goes out again
    assert sent == ["task-lasting"]
    assert store.get("t:expired") is None
    lasting = store.get("t:lasting")
    assert lasting is not None and lasting.status is Status.QUEUED


def test_a_sweep_drops_the_expired_message_a_completed_key_keeps_for_its_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a completed key keeping the message of another call (reserved while the owner's
    # record had vanished, see Store.complete), a call that expired before any worker took it
    app = _app(idempotency_store_url="memory://")
    now = [1000.0]
    store = MemoryStore(clock=lambda: now[0])

    def request(task_id: str) -> ClaimRequest:
        return claim_request(task_id=task_id, owner=task_id, ttl_seconds=3600)

    owner = request("task-owner")
    token = store.claim(owner).token
    assert token is not None
    store.forget(owner.storage_key)
    pickup = make_pickup(["k"], {}, {"expires": 1}, 10.0, wait=0)
    assert pickup is not None
    assert store.reserve(request("task-expired"), pickup) is None
    store.complete(owner, token, None)
    sent: list[str] = []
    app.send_task = lambda *args, **kwargs: sent.append(kwargs["task_id"])  # type: ignore[method-assign]
    time.sleep(1.1)  # the call's expiry is a moment on this host's clock
    now[0] += 11
    # When the sweep runs, then the message is not sent, and dropped: no sweep takes it again
    with caplog.at_level(logging.WARNING, logger="idempotent_tasks.pickups"):
        republish_lost(app, store)
    assert sent == []
    assert "task-expired) expired: its copy is dropped" in caplog.text
    now[0] += 100  # past the backoff a message sent again would have been given
    assert store.take("t:k") is None
    record = store.get("t:k")
    assert record is not None and record.status is Status.COMPLETED


def test_a_publish_interrupted_after_its_reservation_hands_the_call_to_the_guard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from celery.app.task import Task

    app = Celery("interrupted", set_as_current=False, broker="memory://")
    app.conf.update(idempotency_store_url="memory://")

    @app.task(base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        return order

    # Given a publish interrupted (Ctrl-C) inside kombu's send, after the key was reserved
    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Task, "apply_async", interrupted)
    with pytest.raises(KeyboardInterrupt):
        charge.apply_async(("o-1",), idempotency_key="k-1")
    # Then the key stays queued for the call, due at once: the guard publishes it, rather
    # than every call of the key meanwhile being handed a result that never comes
    record = store_for(app).get(storage_key(charge.name, "k-1"))
    assert record is not None and record.status.value == "queued"
    assert record.lease_expires_at <= record.store_time()


def test_a_due_index_that_cannot_be_read_ends_the_guards_look_not_the_sweep(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a store whose due index holds something else than an index (written by hand)
    class Unreadable(MemoryStore):
        def take_due(self, limit: int) -> list[Any]:
            raise CorruptRecord("due index holds a string")

    # When the sweep looks for lost messages, then it logs why and goes on (its dead letters
    # next), having published nothing
    assert republish_lost(_app(idempotency_store_url="memory://"), Unreadable()) == 0
    assert "could not look for lost messages: due index holds a string" in caplog.text
