"""A dead-letter queue that cannot even be set up is an unreachable one to the task (the
failure is kept, never lost), and a worker refuses to start on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

from idempotent_tasks import IdempotentTask, StoreUnavailable
from idempotent_tasks.app_store import dlq_for
from idempotent_tasks.setup_errors import DeadLetterQueueUnusable
from idempotent_tasks.startup import refuse_newer_schemas, refuse_unusable_dead_letter_settings


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


class _StartingWorker:
    """What worker_init hands its receivers: the worker, holding its app."""

    def __init__(self, app: Celery) -> None:
        self.app = app


@pytest.mark.parametrize(
    ("setting", "value", "said"),
    [
        ("idempotency_dlq_max_retries", "three", "idempotency_dlq_max_retries must be a whole"),
        ("idempotency_dlq_max_retries", -1, "idempotency_dlq_max_retries must be a whole"),
        ("idempotency_dlq_max_retries", 2.5, "idempotency_dlq_max_retries must be a whole"),
        ("idempotency_dlq_retrying_timeout", 0, "idempotency_dlq_retrying_timeout must be"),
        ("idempotency_dlq_retrying_timeout", "an hour", "idempotency_dlq_retrying_timeout must"),
    ],
)
def test_a_worker_refuses_to_start_on_unusable_dead_letter_settings(
    app: Celery, setting: str, value: object, said: str
) -> None:
    app.conf[setting] = value
    with pytest.raises(SystemExit, match=said):
        refuse_unusable_dead_letter_settings(sender=_StartingWorker(app))


def test_a_worker_refuses_to_start_on_a_tasks_unusable_dlq_max_retries(app: Celery) -> None:
    @app.task(base=IdempotentTask, shared=False, dlq_max_retries="many")
    def refund(order: str) -> str:
        return order

    with pytest.raises(SystemExit, match="refund's dlq_max_retries must be a whole number"):
        refuse_unusable_dead_letter_settings(sender=_StartingWorker(app))
    # while usable ones, given as text from the environment too, start it
    refund.dlq_max_retries = "5"
    app.conf.idempotency_dlq_retrying_timeout = "600"
    refuse_unusable_dead_letter_settings(sender=_StartingWorker(app))


def test_a_failure_under_a_retry_limit_changed_to_no_count_since_is_dead_lettered_all_the_same(
    app: Celery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app.conf.update(
        idempotency_dlq_url=f"sqlite:///{tmp_path}/dead_letters.sqlite3",
        idempotency_dlq_max_retries="three",
        task_always_eager=True,
    )

    @app.task(base=IdempotentTask, shared=False)
    def fails(order: str) -> None:
        raise RuntimeError(f"{order} failed")

    with pytest.raises(RuntimeError, match="o-1 failed"):
        fails.apply_async(("o-1",), idempotency_key="o-1").get()
    (row,) = dlq_for(app).items()
    assert (row.error_message, row.max_retries) == ("o-1 failed", 3)
    assert "idempotency_dlq_max_retries must be a whole number" in caplog.text


def test_a_tasks_retry_limit_changed_to_no_count_falls_back_to_the_apps(
    app: Celery, tmp_path: Path
) -> None:
    app.conf.update(
        idempotency_dlq_url=f"sqlite:///{tmp_path}/dead_letters.sqlite3",
        idempotency_dlq_max_retries="5",
        task_always_eager=True,
    )

    @app.task(base=IdempotentTask, shared=False, dlq_max_retries="many")
    def fails(order: str) -> None:
        raise RuntimeError(f"{order} failed")

    with pytest.raises(RuntimeError, match="o-2 failed"):
        fails.apply_async(("o-2",), idempotency_key="o-2").get()
    (row,) = dlq_for(app).items()
    assert row.max_retries == 5
