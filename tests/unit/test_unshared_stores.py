"""A worker whose app keeps its claims or dead letters where its other processes or hosts do not
see them is told so as it starts: SQLite files of its own host because no URL is set, or a
``memory://`` store under a pool of processes. Duplicates there would run again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.concurrency import prefork, thread
from celery.signals import worker_init

from idempotent_tasks import IdempotentTask
from idempotent_tasks.startup import warn_of_unshared_stores


class _Worker:
    """What worker_init hands its receivers: the worker, holding its app and pool."""

    def __init__(self, app: Celery, pool: Any = "prefork") -> None:
        self.app = app
        self.pool_cls = pool


def _app(*, keyed: bool = True, **conf: object) -> Celery:
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
    monkeypatch.setenv("IDEMPOTENT_TASKS_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def _start(
    app: Celery, caplog: pytest.LogCaptureFixture, pool: Any = "prefork", *, signal: bool = False
) -> list[str]:
    """Run the start-up check as a starting worker does (``signal``: send worker_init itself,
    with every receiver; only for apps whose databases are local); the warnings it logged."""
    caplog.set_level("WARNING", logger="idempotent_tasks.startup")
    if signal:
        worker_init.send(sender=_Worker(app, pool))
    else:
        warn_of_unshared_stores(sender=_Worker(app, pool))
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "idempotent_tasks.startup" and record.levelname == "WARNING"
    ]


def test_a_starting_worker_is_told(caplog: pytest.LogCaptureFixture, data_dir: Path) -> None:
    app = _app(idempotency_dlq_url=f"sqlite:///{data_dir.parent / 'named.db'}")

    [warning] = _start(app, caplog, signal=True)

    assert warning.startswith("idempotent_tasks: the claim store is an SQLite file on this host")


def test_both_defaults_are_named_with_their_files_and_settings(
    caplog: pytest.LogCaptureFixture, data_dir: Path
) -> None:
    [warning] = _start(_app(), caplog)

    assert not data_dir.exists()  # nothing made: the schema check makes what it uses
    assert "the claim store and the dead-letter table are SQLite files on this host" in warning
    assert f"({data_dir / 'claims.sqlite3'}, {data_dir / 'dead_letters.sqlite3'})" in warning
    assert "set idempotency_store_url and idempotency_dlq_url to a database" in warning


@pytest.mark.parametrize(
    ("conf", "named", "setting"),
    [
        ({"idempotency_dlq_url": "postgresql+psycopg://db/shop"}, "claim store", "store"),
        ({"result_backend": "redis://r:6379/1"}, "dead-letter table", "dlq"),
        ({"idempotency_store_url": "redis://r:6379/2"}, "dead-letter table", "dlq"),
    ],
    ids=["dlq-set", "redis-backend", "store-set"],
)
def test_only_the_default_left_is_named(
    conf: dict[str, object], named: str, setting: str, caplog: pytest.LogCaptureFixture
) -> None:
    [warning] = _start(_app(**conf), caplog)

    assert f"the {named} is an SQLite file on this host" in warning
    assert f"set idempotency_{setting}_url to a database" in warning


@pytest.mark.parametrize(
    "conf",
    [
        {"idempotency_store_url": "redis://r/2", "idempotency_dlq_url": "mysql+pymysql://db/x"},
        {"result_backend": "redis://r/1", "idempotency_dlq_url": "postgresql+psycopg://db/x"},
        # SQLite files named on purpose are the user's choice: nothing to say
        {"idempotency_store_url": "sqlite:////srv/c.db", "idempotency_dlq_url": "sqlite:///d.db"},
    ],
    ids=["both-set", "redis-backend", "sqlite-named"],
)
def test_databases_named_by_url_are_not_warned_of(
    conf: dict[str, object], caplog: pytest.LogCaptureFixture
) -> None:
    assert _start(_app(**conf), caplog) == []


@pytest.mark.parametrize(
    ("pool", "store", "warned"),
    [
        ("prefork", "memory://", True),
        ("processes", "memory://", True),
        ("celery.concurrency.prefork:TaskPool", "MEMORY://", True),
        (prefork.TaskPool, "memory://", True),  # what `celery worker` hands it: a class
        (None, "memory:", True),  # Celery's default pool
        ("threads", "memory://", False),
        ("solo", "memory://", False),
        (thread.TaskPool, "memory://", False),
        ("prefork", "redis://r:6379/2", False),
    ],
    ids=str,
)
def test_a_memory_store_is_warned_of_under_a_pool_of_processes(
    pool: Any, store: str, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    app = _app(idempotency_store_url=store, idempotency_dlq_url="sqlite:///d.db")

    warnings = _start(app, caplog, pool)

    assert [w for w in warnings if "memory://" in w] == (
        [
            "idempotent_tasks: the claim store is memory://, which each process keeps for "
            "itself: this worker's pool processes, and the processes that publish, each see "
            "only their own keys, so duplicates run again; use it with a solo or threads pool "
            "(tests, one process), else set idempotency_store_url to Redis or SQL"
        ]
        if warned
        else []
    )


def test_no_folder_for_the_files_is_left_to_the_schema_check(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a user without a home folder (a container's), and no folder set for the files
    monkeypatch.delenv("IDEMPOTENT_TASKS_DATA_DIR")
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", no_home)

    # When the worker starts, then its schema check stops it, saying what to set
    with pytest.raises(SystemExit, match="set IDEMPOTENT_TASKS_DATA_DIR"):
        _start(_app(), caplog, signal=True)
    # and the warning did not crash on it first
    assert [r.getMessage() for r in caplog.records if "raised" in r.getMessage()] == []


def test_a_worker_without_keyed_tasks_is_told_nothing(caplog: pytest.LogCaptureFixture) -> None:
    assert _start(_app(keyed=False), caplog) == []
