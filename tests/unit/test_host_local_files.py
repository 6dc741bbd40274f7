"""A worker whose app keeps its claims or dead letters in SQLite files of its own host (no URL
set) is told so as it starts: workers on other hosts would keep files of their own."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

from idempotent_tasks import IdempotentTask
from idempotent_tasks.startup import warn_of_host_local_files


class _Worker:
    """What worker_init hands its receivers: the worker, holding its app."""

    def __init__(self, app: Celery) -> None:
        self.app = app


def _app(keyed: bool = True, **conf: object) -> Celery:
    app = Celery("hosts", set_as_current=False, broker="memory://", backend="rpc://")
    app.conf.update(conf)
    for name, shared in list(app.tasks.items()):  # other modules' shared tasks: not this app's
        if isinstance(shared, IdempotentTask):
            app.tasks.pop(name)
    if keyed:

        @app.task(base=IdempotentTask, shared=False, name="charge")
        def charge() -> None:
            return None

    return app


@pytest.fixture(autouse=True)
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("IDEMPOTENT_TASKS_DATA_DIR", str(tmp_path))
    return tmp_path


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "on this host" in r.getMessage()]


def test_both_defaults_are_named_with_their_files_and_settings(
    caplog: pytest.LogCaptureFixture, data_dir: Path
) -> None:
    warn_of_host_local_files(sender=_Worker(_app()))

    [warning] = _warnings(caplog)
    assert "the claim store and the dead-letter table are SQLite files on this host" in warning
    assert f"{data_dir / 'claims.sqlite3'}, {data_dir / 'dead_letters.sqlite3'}" in warning
    assert "set idempotency_store_url and idempotency_dlq_url" in warning


def test_a_shared_dead_letter_database_leaves_the_store_alone_named(
    caplog: pytest.LogCaptureFixture, data_dir: Path
) -> None:
    warn_of_host_local_files(
        sender=_Worker(_app(idempotency_dlq_url="postgresql+psycopg://db/shop"))
    )

    [warning] = _warnings(caplog)
    assert f"the claim store is an SQLite file on this host ({data_dir / 'claims.sqlite3'})" in (
        warning
    )
    assert "set idempotency_store_url to a database" in warning


@pytest.mark.parametrize(
    "conf",
    [
        {"idempotency_store_url": "redis://r/2", "idempotency_dlq_url": "mysql+pymysql://db/x"},
        {"result_backend": "redis://r/1", "idempotency_dlq_url": "postgresql+psycopg://db/x"},
        # An SQLite file named on purpose is the user's choice: nothing to say
        {"idempotency_store_url": "sqlite:////srv/c.db", "idempotency_dlq_url": "sqlite:///d.db"},
    ],
    ids=["both-set", "redis-backend", "sqlite-named"],
)
def test_databases_named_by_url_are_not_warned_of(
    conf: dict[str, object], caplog: pytest.LogCaptureFixture
) -> None:
    warn_of_host_local_files(sender=_Worker(_app(**conf)))

    assert _warnings(caplog) == []


def test_a_worker_without_keyed_tasks_is_told_nothing(caplog: pytest.LogCaptureFixture) -> None:
    warn_of_host_local_files(sender=_Worker(_app(keyed=False)))

    assert _warnings(caplog) == []
