"""A dead-letter queue that cannot even be set up is an unreachable one to the task (the
failure is kept, never lost), and a worker refuses to start on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

from idempotent_tasks import IdempotentTask, StoreUnavailable
from idempotent_tasks.app_store import dlq_for
from idempotent_tasks.setup_errors import DeadLetterQueueUnusable
from idempotent_tasks.startup import refuse_newer_schemas


@pytest.fixture()
def app() -> Celery:
    app = Celery("unusable", set_as_current=False, broker="memory://")
    app.conf.idempotency_store_url = "memory://"

    @app.task(base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        return order

    return app


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("mssql+pymssql://user@127.0.0.1:1/db", r"no driver for mssql\+pymssql"),
        ("not a url at all", "Could not parse"),
    ],
    ids=["driver-missing", "malformed"],
)
def test_a_dead_letter_url_no_queue_can_be_built_on_is_an_unavailable_store(
    app: Celery, url: str, said: str
) -> None:
    app.conf.idempotency_dlq_url = url
    with pytest.raises(StoreUnavailable, match=said) as raised:
        dlq_for(app)
    assert isinstance(raised.value, DeadLetterQueueUnusable)


def test_a_default_dead_letter_folder_that_cannot_be_made_is_an_unavailable_store(
    app: Celery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the default SQLite file's folder under a regular file (a read-only root, say)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("IDEMPOTENT_TASKS_DATA_DIR", str(blocker / "sub"))
    with pytest.raises(DeadLetterQueueUnusable, match="unusable"):
        dlq_for(app)


def test_a_worker_refuses_to_start_on_a_dead_letter_queue_it_cannot_set_up(app: Celery) -> None:
    app.conf.idempotency_dlq_url = "mssql+pymssql://user@127.0.0.1:1/db"

    class Worker:  # what worker_init hands its receivers: the worker, holding its app
        pass

    worker = Worker()
    worker.app = app  # type: ignore[attr-defined]
    with pytest.raises(SystemExit, match="no driver for mssql"):
        refuse_newer_schemas(sender=worker)


@pytest.mark.parametrize(
    ("base_delay", "said"),
    [
        ([60], "must be a number of seconds, not \\[60\\]"),
        ("soon", "must be a number of seconds, not 'soon'"),
        (-5, "must be a finite number of seconds, 0 or more, not -5"),
        (float("inf"), "must be a finite number of seconds, not inf"),
    ],
    ids=["list", "text", "negative", "infinite"],
)
def test_a_malformed_dead_letter_base_delay_is_named_in_the_error(
    app: Celery, tmp_path: Path, base_delay: object, said: str
) -> None:
    app.conf.idempotency_dlq_url = f"sqlite:///{tmp_path / 'dlq.sqlite3'}"
    app.conf.idempotency_dlq_base_delay = base_delay
    with pytest.raises(DeadLetterQueueUnusable, match=f"idempotency_dlq_base_delay {said}"):
        dlq_for(app)


@pytest.mark.parametrize("base_delay", [0, "2.5", 60])
def test_a_dead_letter_base_delay_is_read_as_seconds(
    app: Celery, tmp_path: Path, base_delay: object
) -> None:
    app.conf.idempotency_dlq_url = f"sqlite:///{tmp_path / 'dlq.sqlite3'}"
    app.conf.idempotency_dlq_base_delay = base_delay
    queue = dlq_for(app)
    try:
        assert queue.base_delay == float(base_delay)  # type: ignore[arg-type]
    finally:
        queue.dispose()
