"""Settings precedence, task option checks and signals."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from idempotent_tasks import IdempotentTask
from idempotent_tasks.rq import idempotent
from idempotent_tasks.settings import app_setting, resolve, switch
from idempotent_tasks.signals import Signal


def test_resolve_takes_the_most_specific_value_set() -> None:
    assert resolve(None, 5, 7, default=9) == 5
    assert resolve(None, None, default=9) == 9
    assert resolve(0, 5, default=9) == 0


def test_app_setting_falls_back_to_the_documented_default() -> None:
    app = Celery("t", set_as_current=False)
    assert app_setting(app.conf, "idempotency_ttl") == 86400
    app.conf.idempotency_ttl = 60
    assert app_setting(app.conf, "idempotency_ttl") == 60


@pytest.mark.parametrize(
    ("value", "read"),
    [
        *[(True, True), (False, False), (1, True), (0, False), ("false", False), ("Off", False)],
        *[("no", False), ("0", False), ("yes", True), ("on", True), ("1", True), ("TRUE", True)],
    ],
)
def test_a_switch_setting_reads_text_as_celery_does(value: object, read: bool) -> None:
    assert switch(value, "idempotency_publish_in_one_trip") is read


@pytest.mark.parametrize("value", ["maybe", "", 2, 0.5, [True]])
def test_a_switch_setting_that_is_no_yes_or_no_is_refused_by_name(value: object) -> None:
    with pytest.raises(ValueError, match="idempotency_publish_in_one_trip must be true or false"):
        switch(value, "idempotency_publish_in_one_trip")


def test_unknown_on_duplicate_is_refused_when_the_task_is_defined() -> None:
    app = Celery("t", set_as_current=False)
    with pytest.raises(ValueError, match="on_duplicate must be one of"):

        @app.task(base=IdempotentTask, on_duplicate="drop", shared=False)
        def task() -> None:
            """Never defined."""

        task.name  # noqa: B018 - touching the proxy creates the task class


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("idempotency_ttl", float("inf")),
        ("idempotency_ttl", 0),
        ("idempotency_lease", float("nan")),
        ("idempotency_lease", -5),
        ("idempotency_lease", "soon"),
    ],
)
def test_a_lease_or_ttl_that_is_no_finite_positive_number_is_refused_before_publishing(
    option: str, value: object
) -> None:
    app = Celery("t", set_as_current=False, broker="memory://")
    app.conf.update(idempotency_store_url="memory://")
    sent: list[Any] = []

    @app.task(base=IdempotentTask, shared=False, **{option: value})
    def task(x: int) -> int:
        return x

    task.app.amqp.send_task_message = lambda *args, **kwargs: sent.append(args)
    with pytest.raises(ValueError, match=option):
        task.apply_async((1,), idempotency_key="k")
    assert sent == []


@pytest.mark.parametrize(("option", "value"), [("ttl", float("inf")), ("lease", 0)])
def test_an_rq_lease_or_ttl_that_is_no_finite_positive_number_is_refused(
    option: str, value: float
) -> None:
    with pytest.raises(ValueError, match=option):
        idempotent(**{option: value})


def test_callable_key_option_is_not_bound_to_the_task() -> None:
    app = Celery("t", set_as_current=False)

    def key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return f"k-{args[0]}"

    @app.task(base=IdempotentTask, idempotency_key=key, shared=False)
    def task(x: int) -> int:
        return x

    assert task.idempotency_key((3,), {}) == "k-3"


def test_signal_receivers_get_the_payload_and_their_errors_are_contained() -> None:
    signal = Signal("s", "doc")
    got: list[dict[str, Any]] = []

    def broken(**_: Any) -> None:
        raise RuntimeError("receiver bug")

    signal.connect(broken)
    signal.connect(lambda **payload: got.append(payload))
    signal.send(a=1)
    assert got == [{"signal": signal, "a": 1}]


def test_a_claim_outlives_its_lease_long_enough_for_the_pickup_guard() -> None:
    app = Celery("t", set_as_current=False, broker="memory://")
    app.conf.update(
        idempotency_store_url="memory://",
        idempotency_pickup_timeout=3600,
        idempotency_dlq_poll_interval=30,
    )

    @app.task(base=IdempotentTask, shared=False, idempotency_ttl=600)
    def short(x: int) -> int:
        return x

    @app.task(base=IdempotentTask, shared=False, idempotency_ttl=86400)
    def long(x: int) -> int:
        return x

    # A TTL shorter than the guard needs: the claim outlives its lease by two pickup timeouts
    # and a sweep interval (the guard looks a pickup timeout after the lease)
    request = short._claim_request("k", (1,), {}, "id", owner="o")
    assert (request.ttl_seconds, request.claim_ttl) == (600.0, 7230.0)
    # A longer one: by the TTL
    request = long._claim_request("k", (1,), {}, "id", owner="o")
    assert (request.ttl_seconds, request.claim_ttl) == (86400.0, 86400.0)
    # With the guard off, by the TTL too
    app.conf.idempotency_pickup_timeout = 0
    short.__dict__.pop("_claim_ttl")
    assert short._claim_request("k", (1,), {}, "id", owner="o").claim_ttl == 600.0
