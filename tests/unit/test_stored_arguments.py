"""How a failed task's arguments are kept in the dead-letter table's JSON columns."""

from __future__ import annotations

import json
import uuid
from datetime import date, datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded

from idempotent_tasks import IdempotentTask
from idempotent_tasks.dlq import DeadLetterQueue
from idempotent_tasks.dlq.arguments import restored_arguments, stored_arguments


def test_values_celerys_json_carries_are_kept_faithfully_as_plain_json() -> None:
    args = (datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc), date(2026, 1, 2), b"\x00\xff")
    kwargs = {"amount": Decimal("1.10"), "id": uuid.UUID(int=7), "items": (1, 2)}
    kept_args, kept_kwargs, faithful = stored_arguments(args, kwargs)
    assert faithful
    json.dumps([kept_args, kept_kwargs])  # what the JSON columns take, as they are
    assert kept_kwargs["items"] == [1, 2]
    assert kept_args[0] == {"__type__": "datetime", "__value__": "2026-01-02T03:04:05+00:00"}
    assert restored_arguments(kept_args, kept_kwargs) == (list(args), {**kwargs, "items": [1, 2]})


class Opaque:
    def __repr__(self) -> str:
        return "<Opaque 7>"


def test_other_objects_are_kept_as_text_and_said_to_be() -> None:
    kept_args, kept_kwargs, faithful = stored_arguments((1, Opaque()), {"x": Opaque()})
    assert not faithful
    assert (kept_args, kept_kwargs) == ([1, "<Opaque 7>"], {"x": "<Opaque 7>"})


class BrokenRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def test_arguments_json_cannot_even_hold_as_text_are_kept_one_by_one() -> None:
    looped: list[Any] = []
    looped.append(looped)
    kept_args, kept_kwargs, faithful = stored_arguments(
        ({(1, 2): "x"}, looped), {"broken": BrokenRepr()}
    )
    assert not faithful
    assert kept_args == ["{(1, 2): 'x'}", "[[...]]"]
    assert kept_kwargs == {"broken": "<BrokenRepr object; repr() failed>"}


class UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str")


def _app_keeping_dead_letters(name: str, tmp_path: Path) -> tuple[Celery, str]:
    """An app with its claims in memory and its dead letters in a SQLite file (its URL)."""
    app = Celery(name, set_as_current=False, broker="memory://")
    url = f"sqlite:///{tmp_path}/dead.sqlite3"
    app.conf.update(
        idempotency_store_url="memory://", idempotency_dlq_url=url, result_backend="cache+memory://"
    )
    return app, url


def _failed_for_good(task: Any, task_id: str, args: tuple[Any, ...], error: type) -> None:
    """Run ``task`` on ``args`` as a worker delivers it, its body raising ``error``."""
    task.push_request(
        id=task_id,
        args=args,
        kwargs={},
        headers={},
        called_directly=False,
        delivery_info={"routing_key": "celery", "exchange": ""},
        retries=0,
    )
    try:
        with pytest.raises(error):
            task(*args)
    finally:
        task.pop_request()


def _rows(url: str) -> list[Any]:
    queue = DeadLetterQueue(url)
    try:
        return queue.items()
    finally:
        queue.dispose()


def test_a_failure_whose_arguments_and_error_defy_text_is_still_dead_lettered(
    tmp_path: Path,
) -> None:
    # Given a task whose arguments JSON cannot hold even as text (pickle sent them), failing
    # with an error whose str() fails
    app, url = _app_keeping_dead_letters("unprintable", tmp_path)

    @app.task(base=IdempotentTask, shared=False)
    def fails(mapping: dict[Any, str]) -> None:
        raise UnprintableError()

    # When it fails for good, then its own error goes on, and the dead letter is written
    _failed_for_good(fails, "failing-task", ({(1, 2): "x"},), UnprintableError)
    [row] = _rows(url)
    assert (row.task_id, row.args) == ("failing-task", ["{(1, 2): 'x'}"])
    assert row.error_message == "<UnprintableError; str() failed>"


def test_a_soft_time_limit_firing_as_the_dead_letter_is_made_still_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a call failed for good, whose soft time limit fires while its dead letter is made
    # (as its arguments are dumped for the table)
    app, url = _app_keeping_dead_letters("late-limit", tmp_path)

    @app.task(base=IdempotentTask, shared=False)
    def fails(order: str) -> None:
        raise ValueError(order)

    dump = IdempotentTask._table_arguments
    fired: list[bool] = []

    def dump_as_the_limit_fires(task: Any, args: Any, kwargs: Any) -> Any:
        if not fired:
            fired.append(True)
            raise SoftTimeLimitExceeded()
        return dump(task, args, kwargs)

    monkeypatch.setattr(IdempotentTask, "_table_arguments", dump_as_the_limit_fires)
    # When it fails, then its own error goes on, and its dead letter is written all the same
    _failed_for_good(fails, "late-task", ("o-1",), ValueError)
    assert fired
    assert [(row.task_id, row.args, row.error_type) for row in _rows(url)] == [
        ("late-task", ["o-1"], "ValueError")
    ]


def test_nan_and_infinity_which_database_json_refuses_are_kept_as_text() -> None:
    kept_args, kept_kwargs, faithful = stored_arguments(
        (1.5, float("nan")), {"limit": float("inf")}
    )
    assert not faithful
    # The database's JSON takes it
    json.dumps([kept_args, kept_kwargs], allow_nan=False)
    assert (kept_args, kept_kwargs) == (["1.5", "nan"], {"limit": "inf"})


def test_exactly_kept_arguments_are_those_that_read_back_equal() -> None:
    # (a pickle-serialized call, an RQ job: a tuple stays a tuple, which JSON gives back as a
    # list; so does a dict's int key, which JSON gives back as text)
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    assert stored_arguments((1, when, b"\x00"), {"amount": Decimal("1.10")}, exact=True)[2]
    for args, kwargs in (((1, (2, 3)), {}), ((1,), {"items": (4,)}), (({1: "a"},), {})):
        kept_args, kept_kwargs, faithful = stored_arguments(args, kwargs, exact=True)
        assert not faithful
        json.dumps([kept_args, kept_kwargs])  # still kept, to be read
        assert stored_arguments(args, kwargs)[2]  # as a JSON message carries them: faithful
