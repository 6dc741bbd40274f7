"""The defaults and the error family SPEC.md documents, as a task sees them with nothing set."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

import idempotent_tasks
from idempotent_tasks import IdempotentTask
from idempotent_tasks.app_store import dlq_for
from idempotent_tasks.dlq import DeadLetterQueue


def _task(app: Celery, **options: object) -> IdempotentTask:
    @app.task(base=IdempotentTask, shared=False, **options)
    def charge(order: str) -> str:
        return order

    return charge  # type: ignore[no-any-return]


@pytest.fixture()
def app() -> Celery:
    return Celery("defaults", set_as_current=False, broker="memory://")


@pytest.mark.parametrize(
    "name",
    ["IdempotencyKeyMismatch", "IdempotencyConflict", "StoreUnavailable", "SchemaVersionError"],
)
def test_every_documented_error_is_an_idempotency_error(name: str) -> None:
    assert issubclass(getattr(idempotent_tasks, name), idempotent_tasks.IdempotencyError)


def test_cached_results_are_limited_to_one_mebibyte(app: Celery) -> None:
    assert _task(app)._codec.max_bytes == 1024 * 1024


def test_a_claim_lives_a_day_once_completed_and_its_lease_is_300_s(app: Celery) -> None:
    assert _task(app)._lease_and_ttl == (300, 86400)


def test_the_lease_is_the_tasks_time_limit_when_it_has_one(app: Celery) -> None:
    assert _task(app, time_limit=900)._lease_and_ttl[0] == 900


def test_an_app_wide_lease_wins_over_the_tasks_time_limit(app: Celery) -> None:
    app.conf.idempotency_lease = 60
    assert _task(app, time_limit=900)._lease_and_ttl[0] == 60


def test_dead_letters_back_off_from_60_s(app: Celery, tmp_path: Path) -> None:
    app.conf.idempotency_dlq_url = f"sqlite:///{tmp_path / 'app.db'}"
    assert dlq_for(app).base_delay == 60
    dlq_for(app).dispose()
    queue = DeadLetterQueue(f"sqlite:///{tmp_path / 'plain.db'}")
    assert queue.base_delay == 60
    queue.dispose()
