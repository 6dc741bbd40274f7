"""Two apps sharing one dead-letter table (the default SQLite file is one per user of a host):
each app's sweep sends its own rows again, never the other app's rows of a task it does not
know, which its worker would refuse (a retry used each time, until the row gave up)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

import idempotent_tasks  # noqa: F401 - registers the sweep task
from idempotent_tasks.app_store import dlq_for
from idempotent_tasks.dead_letters import SWEEP_TASK
from idempotent_tasks.dlq import DeadLetterQueue, DeadLetterStatus, Failure


def _body() -> None:
    """A stand-in task body (never run here)."""


def _app(name: str, dlq_url: str, *task_names: str) -> Celery:
    app = Celery(name, set_as_current=False, broker="memory://")
    app.conf.update(
        idempotency_dlq_url=dlq_url,
        idempotency_store_url="memory://",
        idempotency_dlq_base_delay=0,  # due at once
    )
    for task_name in task_names:
        app.task(name=task_name, shared=False)(_body)
    app.finalize()
    return app


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


@pytest.fixture()
def dlq_url(tmp_path: Path) -> Iterator[str]:
    url = f"sqlite:///{tmp_path / 'dead_letters.sqlite3'}"
    yield url
    DeadLetterQueue(url).dispose()


def test_an_apps_sweep_sends_its_own_rows_and_leaves_another_apps(dlq_url: str) -> None:
    # Given two apps on one table, each with a dead letter of its own task
    shop = _app("shop", dlq_url, "shop.charge")
    mail = _app("mail", dlq_url, "mail.send")
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


def test_an_app_without_a_name_names_no_app_on_its_rows(dlq_url: str) -> None:
    app = _app("", dlq_url)
    assert dlq_for(app).scope is None
    assert dlq_for(_app("shop", dlq_url)).scope == "shop"


def test_a_renamed_app_sweeps_the_rows_its_old_name_wrote(dlq_url: str) -> None:
    # Given a dead letter written by the app under its old name
    old = dlq_for(_app("shop-v1", dlq_url, "shop.charge")).add(_failure("shop.charge"))
    # When the app, renamed, sweeps: it runs the row's task, so the row is its own to send
    assert _app("shop", dlq_url, "shop.charge").tasks[SWEEP_TASK].apply().get() == 1
    table = DeadLetterQueue(dlq_url)
    try:
        found = table.get(old.id)
        assert found is not None and found.status is DeadLetterStatus.RETRYING
    finally:
        table.dispose()
