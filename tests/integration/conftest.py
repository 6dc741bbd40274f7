"""Integration fixtures: real Redis databases and real worker processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.integration.workers import WorkerProcess, running_workers

# Databases of the Redis server on 6379 that the integration layer owns (flushed per session).
# The claim store shares the result backend's database, as it does by default: completions then
# write Celery's result records themselves (idempotent_tasks.celery_result).
BROKER_DB, BACKEND_DB, LEDGER_DB = 10, 11, 13


@pytest.fixture(scope="session")
def it_env(redis_url: str) -> dict[str, str]:
    """Environment of tests.integration.worker_app for this session, on emptied databases."""
    for db in (BROKER_DB, BACKEND_DB, LEDGER_DB):
        redis.Redis.from_url(f"{redis_url}/{db}").flushdb()
    from tests.integration.databases import fresh_pg_database

    return {
        "IT_DLQ_URL": fresh_pg_database("it_dead_letters"),
        "IT_BROKER_URL": f"{redis_url}/{BROKER_DB}",
        "IT_BACKEND_URL": f"{redis_url}/{BACKEND_DB}",
        "IT_STORE_URL": f"{redis_url}/{BACKEND_DB}",
        "IT_LEDGER_URL": f"{redis_url}/{LEDGER_DB}",
    }


@pytest.fixture(scope="session")
def worker_app(it_env: dict[str, str], monkeypatch_session: pytest.MonkeyPatch) -> Iterator[object]:
    """tests.integration.worker_app, imported with this session's environment."""
    for name, value in it_env.items():
        monkeypatch_session.setenv(name, value)
    from tests.integration import worker_app

    yield worker_app
    # Close this process's dead-letter connections before the interpreter tears them down.
    from idempotent_tasks.app_store import dlq_for

    dlq_for(worker_app.app).dispose()


@pytest.fixture(scope="session")
def monkeypatch_session() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def two_workers(
    it_env: dict[str, str], worker_app: object, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[WorkerProcess]]:
    """Two prefork workers (two pool processes each) shared by a test module."""
    with running_workers(2, it_env, tmp_path_factory.mktemp("workers")) as workers:
        yield workers


@pytest.fixture()
def log_dir(tmp_path: Path) -> Path:
    return tmp_path
