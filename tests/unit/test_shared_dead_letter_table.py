"""Two apps sharing one dead-letter table (the default SQLite file is one per user of a host):
each app's sweep sends its own rows again, never the other app's rows of a task it does not
know, which its worker would refuse (a retry used each time, until the row gave up)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

import idempotent_tasks  # noqa: F401 - registers the sweep task
from idempotent_tasks import dead_letters
from idempotent_tasks.app_store import dlq_for
from idempotent_tasks.dead_letters import SWEEP_TASK
from idempotent_tasks.dlq import DeadLetterQueue, DeadLetterStatus, Failure


def _body() -> None:
    """A stand-in task body (never run here)."""


def _failure(task_name: str) -> Failure:
    return Failure(
        failure_id=f"{task_name}-id:0",
        task_name=task_name,
        task_id=f"{task_name}-id",
        idempotency_key=None,
        args=[],
        kwargs={},
        options={},
        error_type="RuntimeError",
        error_message="boom",
        traceback=None,
        max_retries=3,
    )


MakeApp = Callable[..., Celery]


@pytest.fixture()
def dlq_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'dead_letters.sqlite3'}"


@pytest.fixture()
def make_app(dlq_url: str) -> Iterator[MakeApp]:
    """Apps named ``name`` on the test's table, registering ``task_names``; their queues are
    disposed afterwards."""
    made: list[Celery] = []

    def make(name: str | None, *task_names: str) -> Celery:
        app = Celery(name, set_as_current=False, broker="memory://")
        app.conf.update(
            idempotency_dlq_url=dlq_url,
            idempotency_store_url="memory://",
            idempotency_dlq_base_delay=0,  # due at once
        )
        for task_name in task_names:
            app.task(name=task_name, shared=False)(_body)
        app.finalize()
        made.append(app)
        return app

    yield make
    for app in made:
        dlq_for(app).dispose()


def test_an_apps_sweep_sends_its_own_rows_and_leaves_another_apps(
    dlq_url: str, make_app: MakeApp
) -> None:
    # Given two apps on one table, each with a dead letter of its own task
    shop = make_app("shop", "shop.charge")
    mail = make_app("mail", "mail.send")
    own = dlq_for(shop).add(_failure("shop.charge"))
    others = dlq_for(mail).add(_failure("mail.send"))
    # When the shop's sweep runs
    sent: Any = shop.tasks[SWEEP_TASK].apply().get()
    # Then it sends its own row again, and leaves mail's as it was, for mail's sweep
    assert sent == 1
    table = DeadLetterQueue(dlq_url)
    try:
        rows = {item.id: item for item in table.items(limit=10)}
        assert (rows[own.id].status, rows[own.id].scope) == (DeadLetterStatus.RETRYING, "shop")
        assert (rows[others.id].status, rows[others.id].retry_count, rows[others.id].scope) == (
            DeadLetterStatus.PENDING,
            0,
            "mail",
        )
        assert mail.tasks[SWEEP_TASK].apply().get() == 1
    finally:
        table.dispose()


def test_an_app_without_a_name_names_none_and_leaves_named_rows_of_tasks_it_does_not_know(
    dlq_url: str, make_app: MakeApp
) -> None:
    # Given an app without a name (Celery()) and a named one on one table
    unnamed = make_app(None, "tools.report")
    shop = make_app("shop", "shop.charge")
    assert (dlq_for(unnamed).scope, dlq_for(shop).scope) == (None, "shop")
    its_own = dlq_for(unnamed).add(_failure("tools.report"))
    shops = dlq_for(shop).add(_failure("shop.charge"))
    # When the unnamed app sweeps, it sends its own row (which names no app), not the shop's
    assert unnamed.tasks[SWEEP_TASK].apply().get() == 1
    table = DeadLetterQueue(dlq_url)
    try:
        found = table.get(its_own.id)
        assert found is not None and (found.status, found.scope) == (
            DeadLetterStatus.RETRYING,
            None,
        )
        left = table.get(shops.id)
        assert left is not None and (left.status, left.retry_count) == (
            DeadLetterStatus.PENDING,
            0,
        )
    finally:
        table.dispose()


def test_a_renamed_app_recovers_the_stuck_rows_its_old_name_wrote(
    dlq_url: str, make_app: MakeApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a dead letter its app, under its old name, took and never ended (its sweep died)
    old = make_app("shop-v1", "shop.charge")
    row = dlq_for(old).add(_failure("shop.charge"))
    assert old.tasks[SWEEP_TASK].apply().get() == 1
    # When the app, renamed, sweeps once that row has been retrying past its timeout
    shop = make_app("shop", "shop.charge")
    shop.conf.idempotency_dlq_retrying_timeout = 0.01
    shop.conf.idempotency_dlq_write_retry_delay = 0.05
    monkeypatch.setattr(dead_letters, "RETRY_AFTER_ERROR", 0.1)  # a grace of 0.2 s
    time.sleep(0.05)
    # Then it makes the row due again (a row of a task it runs), after the grace a run alive
    # after all has to take it back, and sends it then
    assert shop.tasks[SWEEP_TASK].apply().get() == 0
    time.sleep(0.25)
    assert shop.tasks[SWEEP_TASK].apply().get() == 1
    table = DeadLetterQueue(dlq_url)
    try:
        found = table.get(row.id)
        assert found is not None and found.status is DeadLetterStatus.RETRYING
        assert found.sweep_id is not None
    finally:
        table.dispose()


def test_a_renamed_app_sweeps_the_rows_its_old_name_wrote(dlq_url: str, make_app: MakeApp) -> None:
    # Given a dead letter written by the app under its old name
    old = dlq_for(make_app("shop-v1", "shop.charge")).add(_failure("shop.charge"))
    # When the app, renamed, sweeps: it runs the row's task, so the row is its own to send
    assert make_app("shop", "shop.charge").tasks[SWEEP_TASK].apply().get() == 1
    table = DeadLetterQueue(dlq_url)
    try:
        found = table.get(old.id)
        assert found is not None and found.status is DeadLetterStatus.RETRYING
    finally:
        table.dispose()
