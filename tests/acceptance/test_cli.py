"""``celery -A proj idempotency ...`` through Celery's own command, on real Redis and PostgreSQL."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery.bin.celery import celery
from click.testing import CliRunner, Result

from idempotent_tasks import cli
from idempotent_tasks.codec import ResultCodec
from idempotent_tasks.dlq import DeadLetter, DeadLetterQueue, DeadLetterStatus, Failure
from idempotent_tasks.dlq.schema import dead_letters
from idempotent_tasks.keys import storage_key
from idempotent_tasks.records import ClaimRequest, Outcome, Pickup
from idempotent_tasks.stores.redis import RedisStore
from tests.acceptance import cli_app
from tests.claim_requests import claim_request
from tests.services import require

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.acceptance.cli_app"
STORE_DB = 15
DATABASE = "cli_dead_letters"
ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
DLQ_URL = f"postgresql+psycopg://postgres@127.0.0.1:5432/{DATABASE}"
UNREACHABLE_STORE = "redis://:s3cret@127.0.0.1:1/0"
UNREACHABLE_DLQ = "postgresql+psycopg://postgres:s3cret@127.0.0.1:1/x"
DEAD_LETTER_FIELDS = {field.name for field in dataclasses.fields(DeadLetter)}

Run = Callable[..., Result]


@pytest.fixture(scope="module")
def dlq_url() -> str:
    """A dead-letter database of this module's own (never ``test``: other suites drop there)."""
    require("PostgreSQL")
    admin = sa.create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sa.text(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)"))
        connection.execute(sa.text(f"CREATE DATABASE {DATABASE}"))
    admin.dispose()
    return DLQ_URL


@pytest.fixture
def store_url(redis_url: str) -> str:
    url = f"{redis_url}/{STORE_DB}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    return url


class Clock:
    """The seeding queue's clock: real time unless set."""

    def __init__(self) -> None:
        self.fixed: datetime | None = None

    def __call__(self) -> datetime:
        return self.fixed or datetime.now(timezone.utc)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def queue(dlq_url: str, clock: Clock) -> Iterator[DeadLetterQueue]:
    """The app's dead-letter table, emptied, to seed and check through the real API."""
    opened = DeadLetterQueue(dlq_url, clock=clock)
    opened.purge()
    yield opened
    opened.dispose()


@pytest.fixture
def store(store_url: str) -> Iterator[RedisStore]:
    """The app's claim store (same prefix), empty."""
    opened = RedisStore.from_url(store_url, prefix=cli_app.KEY_PREFIX)
    yield opened
    opened.close()


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Commands run as if someone sat at a terminal: they ask before they delete (the runner's
    input answers)."""
    monkeypatch.setattr(cli, "_on_a_terminal", lambda: True)


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch, dlq_url: str, store_url: str) -> Run:
    """``celery -A tests.acceptance.cli_app idempotency *args``, in this process."""

    def invoke(
        *args: str, input: str | None = None, store: str = store_url, dlq: str = dlq_url
    ) -> Result:
        monkeypatch.setenv("CLI_STORE_URL", store)
        monkeypatch.setenv("CLI_DLQ_URL", dlq)
        importlib.reload(cli_app)  # the app module reads the URLs at import
        return CliRunner().invoke(celery, ["-A", APP, "idempotency", *args], input=input)

    return invoke


def failure(number: int, **overrides: Any) -> Failure:
    fields: dict[str, Any] = {
        "failure_id": f"task-{number}:1",
        "task_name": "shop.notify_warehouse",
        "task_id": f"task-{number}",
        "idempotency_key": f"order-{number}",
        "args": [number],
        "kwargs": {"express": True},
        "options": {"queue": "warehouse"},
        "error_type": "ConnectionError",
        "error_message": "warehouse API refused the connection",
        "traceback": 'Traceback (most recent call last):\n  File "shop.py", line 9\n'
        "ConnectionError: warehouse API refused the connection\n",
        "max_retries": 3,
    }
    fields.update(overrides)
    return Failure(**fields)


def add_at(queue: DeadLetterQueue, clock: Clock, moment: datetime, failure: Failure) -> DeadLetter:
    clock.fixed = moment
    try:
        return queue.add(failure)
    finally:
        clock.fixed = None


def seed_three(queue: DeadLetterQueue, clock: Clock) -> list[DeadLetter]:
    """Three dead letters a minute apart, oldest first; the oldest gave up at once."""
    now = datetime.now(timezone.utc)
    return [
        add_at(queue, clock, now - timedelta(minutes=3), failure(1, max_retries=0)),
        add_at(queue, clock, now - timedelta(minutes=2), failure(2)),
        add_at(
            queue,
            clock,
            now - timedelta(minutes=1),
            failure(3, task_name="shop.book_courier", error_type="TimeoutError"),
        ),
    ]


def claim(store: RedisStore, task_name: str, key: str) -> tuple[ClaimRequest, int]:
    request = claim_request(
        key=key,
        task_name=task_name,
        storage_key=storage_key(task_name, key),
        task_id=f"id-of-{key}",
        owner=f"owner-of-{key}",
        fingerprint="ab" * 32,
        lease_seconds=300,
        ttl_seconds=3600,
    )
    result = store.claim(request)
    return request, result.token


def complete(store: RedisStore, task_name: str, key: str, value: Any, serializer: str) -> None:
    request, token = claim(store, task_name, key)
    codec = ResultCodec(serializer=serializer, max_bytes=1 << 20, allow_unsafe=True)
    encoded, reason = codec.encode(value)
    assert encoded is not None, reason
    store.complete(request, token, encoded)


def next_retry_day(item: DeadLetter) -> str:
    assert item.next_retry_at is not None
    return item.next_retry_at.strftime("%Y-%m-%d")


def table_ids(output: str) -> list[str]:
    rows = output.splitlines()[1:]
    return [row.split()[0] for row in rows if len(row.split()[0]) == 36]


def assert_failed_cleanly(result: Result, message: str, exit_code: int = 1) -> None:
    assert result.exit_code == exit_code, result.output
    assert message in result.stderr
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)


# -- dlq list -------------------------------------------------------------------------------


def test_list_prints_a_table_newest_first(run: Run, queue: DeadLetterQueue, clock: Clock) -> None:
    oldest, middle, newest = seed_three(queue, clock)

    result = run("dlq", "list")

    assert result.exit_code == 0, result.output
    header, *rows = result.stdout.splitlines()
    assert header.split("  ")[0] == "ID"
    for column in ("TASK", "STATUS", "RETRIES", "NEXT RETRY (UTC)", "ERROR", "CREATED (UTC)"):
        assert column in header
    assert table_ids(result.stdout) == [newest.id, middle.id, oldest.id]
    assert rows[0].split()[1:5] == ["shop.book_courier", "pending", "0/3", next_retry_day(newest)]
    assert "TimeoutError" in rows[0]
    # given up at once: no next retry
    assert rows[2].split()[1:5] == ["shop.notify_warehouse", "permanent_failure", "0/0", "-"]
    assert rows[-1] == "3 dead letters"


def test_list_filters_by_status_and_task_and_limits(
    run: Run, queue: DeadLetterQueue, clock: Clock
) -> None:
    oldest, middle, newest = seed_three(queue, clock)

    given_up = run("dlq", "list", "--status", "permanent_failure")
    warehouse = run("dlq", "list", "--task", "shop.notify_warehouse", "--status", "pending")
    one = run("dlq", "list", "--limit", "1")
    none = run("dlq", "list", "--task", "shop.nothing")

    assert table_ids(given_up.stdout) == [oldest.id]
    assert table_ids(warehouse.stdout) == [middle.id]
    assert table_ids(one.stdout) == [newest.id]
    assert "1 dead letter (the newest 1; --limit shows more)" in one.stdout
    assert none.exit_code == 0 and none.stdout == "No dead letters match.\n"


def test_list_refuses_a_limit_no_database_takes_as_a_usage_error(
    run: Run, queue: DeadLetterQueue
) -> None:
    result = run("dlq", "list", "--limit", "100000000000000000000")

    assert_failed_cleanly(result, "--limit", exit_code=2)
    assert "1000000" in result.stderr


def test_list_of_an_empty_table_says_so(run: Run, queue: DeadLetterQueue) -> None:
    result = run("dlq", "list")

    assert result.exit_code == 0 and result.stdout == "No dead letters.\n"


def test_list_rejects_an_unknown_status(run: Run) -> None:
    result = run("dlq", "list", "--status", "lost")

    assert result.exit_code == 2
    assert "'lost' is not one of" in result.stderr


def test_list_json_has_every_field_iso_times_and_status_values(
    run: Run, queue: DeadLetterQueue, clock: Clock
) -> None:
    oldest, middle, newest = seed_three(queue, clock)

    result = run("dlq", "list", "--json")

    assert result.exit_code == 0, result.output
    items = json.loads(result.stdout)
    assert [item["id"] for item in items] == [newest.id, middle.id, oldest.id]
    assert all(set(item) == DEAD_LETTER_FIELDS for item in items)
    assert [item["status"] for item in items] == ["pending", "pending", "permanent_failure"]
    assert datetime.fromisoformat(items[0]["created_at"]) == newest.created_at
    assert datetime.fromisoformat(items[0]["next_retry_at"]) == newest.next_retry_at
    assert items[2]["next_retry_at"] is None
    assert items[1]["args"] == [2] and items[1]["kwargs"] == {"express": True}


# -- dlq show -------------------------------------------------------------------------------


def test_show_prints_every_field_and_the_traceback(
    run: Run, queue: DeadLetterQueue, clock: Clock
) -> None:
    item = seed_three(queue, clock)[1]

    result = run("dlq", "show", item.id)

    assert result.exit_code == 0, result.output
    lines = dict(line.split(None, 1) for line in result.stdout.splitlines()[:2])
    assert lines == {"id": item.id, "task": "shop.notify_warehouse"}
    for expected in (
        "app              -",  # written by a queue that names no app
        "task id          task-2",
        "failure id       task-2:1",
        "idempotency key  order-2",
        "status           pending",
        "retries          0/3",
        "sweep id         -",
        "error type       ConnectionError",
        "error message    warehouse API refused the connection",
        "args             [2]",
        'kwargs           {"express": true}',
        'options          {"queue": "warehouse"}',
        "traceback        Traceback (most recent call last):",
        '                   File "shop.py", line 9',
        "                 ConnectionError: warehouse API refused the connection",
    ):
        assert expected in result.stdout.splitlines(), expected
    assert re.search(r"^created +\S+ \S+ UTC \(2m( \d+s)? ago\)$", result.stdout, re.M)


def test_show_json_is_the_whole_item(run: Run, queue: DeadLetterQueue, clock: Clock) -> None:
    item = seed_three(queue, clock)[0]

    result = run("dlq", "show", item.id, "--json")

    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert set(shown) == DEAD_LETTER_FIELDS
    assert shown["status"] == "permanent_failure"
    assert shown["traceback"] == item.traceback
    assert datetime.fromisoformat(shown["updated_at"]) == item.updated_at


def test_show_of_an_unknown_id_fails_clearly(run: Run, queue: DeadLetterQueue) -> None:
    result = run("dlq", "show", "no-such-id")

    assert_failed_cleanly(result, "Error: no dead letter with id 'no-such-id'")


def test_a_row_edited_by_hand_is_one_clear_line_and_the_others_are_listed(
    run: Run, queue: DeadLetterQueue
) -> None:
    # Given two dead letters, one edited by hand into a status no write makes
    kept = queue.add(failure(1))
    edited = queue.add(failure(2))
    with queue.engine.begin() as connection:
        connection.execute(
            sa.update(dead_letters).where(dead_letters.c.id == edited.id).values(status="bogus")
        )
    # When they are listed, then the readable one is, and the other is named in a warning
    listed = run("dlq", "list")
    assert listed.exit_code == 0, listed.output
    assert kept.id in listed.stdout and edited.id not in listed.stdout
    assert f"Warning: dead letter {edited.id} cannot be read" in listed.stderr
    # And showing it fails with one line, no traceback
    assert_failed_cleanly(run("dlq", "show", edited.id), f"dead letter {edited.id} cannot be read")


# -- dlq retry ------------------------------------------------------------------------------


def test_retry_makes_a_given_up_item_pending_and_due_now(
    run: Run, queue: DeadLetterQueue, clock: Clock
) -> None:
    given_up = seed_three(queue, clock)[0]

    result = run("dlq", "retry", given_up.id)

    assert result.exit_code == 0, result.output
    assert f"Dead letter {given_up.id} (shop.notify_warehouse) is pending and due now" in (
        result.stdout
    )
    assert "(was permanent_failure, retries 0/0)" in result.stdout
    assert "idempotent_tasks.retry_dead_letters" in result.stdout
    now = queue.get(given_up.id)
    assert now is not None and now.status is DeadLetterStatus.PENDING
    assert now.next_retry_at is not None
    assert now.next_retry_at <= datetime.now(timezone.utc)


def test_retry_of_a_succeeded_item_asks_first_as_its_task_runs_again(
    run: Run, queue: DeadLetterQueue, terminal: None
) -> None:
    # Given an item whose retry succeeded
    item = queue.add(failure(21))
    assert queue.retry_now(item.id)
    [taken] = queue.take_due()
    queue.mark_succeeded(taken.id)

    declined = run("dlq", "retry", item.id, input="n\n")
    forced = run("dlq", "retry", item.id, "--yes")

    assert declined.exit_code == 1 and "succeeded already" in declined.output
    assert "Aborted" in declined.output
    assert forced.exit_code == 0, forced.output
    now = queue.get(item.id)
    assert now is not None and now.status is DeadLetterStatus.PENDING


def test_retry_of_an_rq_item_names_the_rq_sweep(run: Run, queue: DeadLetterQueue) -> None:
    item = queue.add(failure(22, max_retries=0, framework="rq"))

    result = run("dlq", "retry", item.id)

    assert result.exit_code == 0, result.output
    assert "the next sweep (idempotent-tasks rq retry-dead-letters)" in result.stdout


def test_retry_refuses_an_item_kept_without_its_arguments(run: Run, queue: DeadLetterQueue) -> None:
    # Given an item whose arguments JSON could not hold, kept as text only
    item = queue.add(failure(23, args=[], options={"args_lossy": True}))

    result = run("dlq", "retry", item.id)

    # Then the command says it cannot be sent again, and leaves the row as it was
    assert_failed_cleanly(result, "keeps its task's arguments as text only")
    assert queue.get(item.id) == item


def test_retry_refuses_an_item_a_sweep_is_retrying(
    run: Run, queue: DeadLetterQueue, clock: Clock
) -> None:
    # Given an item a sweep has taken (status retrying)
    item = queue.add(failure(7))
    assert item.next_retry_at is not None
    clock.fixed = item.next_retry_at + timedelta(seconds=1)
    assert [taken.id for taken in queue.take_due()] == [item.id]

    result = run("dlq", "retry", item.id)

    assert_failed_cleanly(result, "is being retried by a sweep right now (status retrying)")
    still = queue.get(item.id)
    assert still is not None and still.status is DeadLetterStatus.RETRYING


def test_retry_of_an_unknown_id_fails_clearly(run: Run, queue: DeadLetterQueue) -> None:
    result = run("dlq", "retry", "no-such-id")

    assert_failed_cleanly(result, "Error: no dead letter with id 'no-such-id'")


# -- dlq purge ------------------------------------------------------------------------------


def test_purge_asks_first_and_deletes_on_yes(
    run: Run, queue: DeadLetterQueue, clock: Clock, terminal: None
) -> None:
    seed_three(queue, clock)

    declined = run("dlq", "purge", "--status", "permanent_failure", input="n\n")
    assert declined.exit_code == 1 and "Aborted" in declined.output
    assert queue.stats()["total"] == 3

    confirmed = run("dlq", "purge", "--status", "permanent_failure", input="y\n")

    assert confirmed.exit_code == 0, confirmed.output
    assert "Delete the dead letters with status permanent_failure in postgresql" in (
        confirmed.output
    )
    assert confirmed.stdout.endswith("Deleted 1 dead letter.\n")
    assert queue.stats() == {
        "pending": 2,
        "retrying": 0,
        "succeeded": 0,
        "permanent_failure": 0,
        "total": 2,
    }


def test_purge_older_than_keeps_recent_items(
    run: Run, queue: DeadLetterQueue, clock: Clock
) -> None:
    now = datetime.now(timezone.utc)
    ancient = add_at(queue, clock, now - timedelta(days=10), failure(1))
    add_at(queue, clock, now - timedelta(days=8), failure(2, max_retries=0))
    recent = add_at(queue, clock, now - timedelta(days=6), failure(3))

    both = run("dlq", "purge", "--older-than", "9d", "--status", "pending", "--yes")
    old = run("dlq", "purge", "--older-than", "168h", "-y")

    assert both.stdout == "Deleted 1 dead letter.\n"
    assert queue.get(ancient.id) is None
    assert old.stdout == "Deleted 1 dead letter.\n"
    assert [item.id for item in queue.items()] == [recent.id]


def test_purge_asks_with_the_age_in_words(run: Run, queue: DeadLetterQueue, terminal: None) -> None:
    result = run("dlq", "purge", "--older-than", "3600s", input="n\n")

    assert "Delete the dead letters not updated for 1h in postgresql" in result.output


def test_purge_refuses_bad_filters_and_off_a_terminal_deletes_everything_only_with_all(
    run: Run, queue: DeadLetterQueue, clock: Clock
) -> None:
    seed_three(queue, clock)

    mixed = run("dlq", "purge", "--all", "--status", "pending", "--yes")
    bad_age = run("dlq", "purge", "--older-than", "a week", "--yes")
    too_old = [run("dlq", "purge", "--older-than", age) for age in ("800000d", "99999999999w")]
    # No filter where no one is asked (ssh without a terminal, a cron line whose filter came
    # out empty): refused, as deleting everything takes saying so
    bare = run("dlq", "purge")
    bare_yes = run("dlq", "purge", "--yes")  # a line whose filter came out empty, say
    assert queue.stats()["total"] == 3
    everything = run("dlq", "purge", "--all")

    assert mixed.exit_code == 2 and "--all deletes every item" in mixed.stderr
    assert bad_age.exit_code == 2
    assert "'a week' is not a duration like 7d, 12h, 30m or 3600s" in bad_age.stderr
    # Ages no date can reach are refused at once: no traceback, nothing deleted
    for refused in too_old:
        assert refused.exit_code == 2, refused.stderr
        assert "is longer than 365000 days" in refused.stderr
        assert "Delete" not in refused.stdout
    for refused in (bare, bare_yes):
        assert refused.exit_code == 2
        assert "not on a terminal: give --status and/or --older-than, or --all" in refused.stderr
    assert everything.exit_code == 0 and everything.stdout == "Deleted 3 dead letters.\n"
    assert queue.stats()["total"] == 0


def test_purge_without_a_filter_asks_on_a_terminal_and_yes_skips_the_question(
    run: Run, queue: DeadLetterQueue, clock: Clock, terminal: None
) -> None:
    seed_three(queue, clock)

    declined = run("dlq", "purge", "--all", input="n\n")
    assert declined.exit_code == 1 and "Aborted" in declined.stderr
    assert "Delete every dead letter in postgresql" in declined.stderr
    assert queue.stats()["total"] == 3
    confirmed = run("dlq", "purge", input="y\n")
    assert confirmed.exit_code == 0 and confirmed.stdout.endswith("Deleted 3 dead letters.\n")
    assert "Delete every dead letter in postgresql" in confirmed.stderr
    seed_three(queue, clock)
    forced = run("dlq", "purge", "--yes")

    assert forced.exit_code == 0 and forced.output == "Deleted 3 dead letters.\n"
    assert queue.stats()["total"] == 0


def test_commands_run_by_a_script_do_not_ask(
    run: Run, queue: DeadLetterQueue, store: RedisStore, clock: Clock
) -> None:
    # Given no terminal (a script, cron, a test runner): no one could answer a question
    item = queue.add(failure(21))
    assert queue.retry_now(item.id)
    [taken] = queue.take_due()
    queue.mark_succeeded(taken.id)
    seed_three(queue, clock)
    complete(store, "shop.charge", "order-42", 1, "json")

    claim(store, "shop.charge", "order-7")

    retried = run("dlq", "retry", item.id)
    purged = run("dlq", "purge", "--status", "permanent_failure")
    forgot = run("key", "forget", "order-42", "--task", "shop.charge")
    forgot_running = run("key", "forget", "order-7", "--task", "shop.charge")

    # Then each does what it was told, and says so; what a question would have said of a
    # running key is said anyway
    for result in (retried, purged, forgot, forgot_running):
        assert result.exit_code == 0, result.output
        assert "[y/N]" not in result.output
    now = queue.get(item.id)
    assert now is not None and now.status is DeadLetterStatus.PENDING
    assert purged.stdout == "Deleted 1 dead letter.\n"
    assert forgot.output == "Forgot key 'order-42' of task shop.charge (it was completed).\n"
    assert store.get(storage_key("shop.charge", "order-42")) is None
    assert forgot_running.stderr == (
        "Warning: key 'order-7' of task shop.charge: it was processing (task id-of-order-7): "
        "a duplicate may run beside it.\n"
    )
    assert store.get(storage_key("shop.charge", "order-7")) is None


class _Stdin:
    def __init__(self, tty: bool | None) -> None:
        self.tty = tty

    def isatty(self) -> bool:
        if self.tty is None:
            raise ValueError("I/O operation on closed file")
        return self.tty


@pytest.mark.parametrize(
    ("stdin", "asks"),
    [(_Stdin(True), True), (_Stdin(False), False), (_Stdin(None), False), (None, False)],
    ids=["terminal", "pipe", "closed", "none"],
)
def test_a_question_is_asked_only_of_a_terminal(
    monkeypatch: pytest.MonkeyPatch, stdin: _Stdin | None, asks: bool
) -> None:
    monkeypatch.setattr(sys, "stdin", stdin)

    assert cli._on_a_terminal() is asks


# -- dlq stats ------------------------------------------------------------------------------


def test_stats_counts_by_status_with_a_total(
    run: Run, queue: DeadLetterQueue, clock: Clock
) -> None:
    seed_three(queue, clock)

    text = run("dlq", "stats")
    as_json = run("dlq", "stats", "--json")

    assert text.exit_code == 0, text.output
    assert text.stdout.splitlines() == [
        "pending            2",
        "retrying           0",
        "succeeded          0",
        "permanent_failure  1",
        "total              3",
    ]
    assert json.loads(as_json.stdout) == {
        "pending": 2,
        "retrying": 0,
        "succeeded": 0,
        "permanent_failure": 1,
        "total": 3,
    }


# -- key show -------------------------------------------------------------------------------


def test_key_show_prints_the_record_and_the_decoded_result(run: Run, store: RedisStore) -> None:
    complete(store, "shop.charge", "order-42", {"charge_id": "ch_42", "order_id": 42}, "json")

    result = run("key", "show", "order-42", "--task", "shop.charge")

    assert result.exit_code == 0, result.output
    assert result.stderr == ""  # the task is registered: no warning
    lines = result.stdout.splitlines()
    for expected in (
        "key            order-42",
        "task           shop.charge",
        "storage key    shop.charge:order-42",
        "status         completed",
        "owner task id  id-of-order-42",
        "owner          owner-of-order-42",
        "token          1",
        "lease expires  - (no lease once completed)",
        "fingerprint    " + "ab" * 32,
        "result         {'charge_id': 'ch_42', 'order_id': 42}",
    ):
        assert expected in lines, expected
    assert any(line.startswith("result cached  yes (application/json, ") for line in lines)
    assert any(line.startswith("expires ") and "(in 59m" in line for line in lines)


def test_key_show_json(run: Run, store: RedisStore) -> None:
    complete(store, "shop.charge", "order-42", {"charge_id": "ch_42"}, "json")
    stored = store.get(storage_key("shop.charge", "order-42"))
    assert stored is not None

    result = run("key", "show", "order-42", "--task", "shop.charge", "--json")

    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["status"] == "completed"
    assert shown["task_id"] == "id-of-order-42" and shown["token"] == 1
    assert shown["result_cached"] is True
    assert shown["result_content_type"] == "application/json"
    assert shown["result"] == {"charge_id": "ch_42"} and shown["result_error"] is None
    expires = datetime.fromisoformat(shown["expires_at"])
    assert expires.tzinfo is not None
    assert abs(expires.timestamp() - stored.expires_at) < 0.001


def test_key_show_of_a_key_kept_longer_than_dates_go_shows_the_last_date(
    run: Run, store: RedisStore
) -> None:
    # Given a key claimed with a TTL the settings take (any positive number of seconds) that
    # ends past the year 9999
    request = claim_request(
        key="order-7",
        task_name="shop.charge",
        storage_key=storage_key("shop.charge", "order-7"),
        ttl_seconds=10**12,
    )
    assert store.claim(request).outcome is Outcome.ACQUIRED
    # Then key show prints it, its expiry the last moment a date holds
    shown = run("key", "show", "order-7", "--task", "shop.charge")
    assert shown.exit_code == 0, shown.output
    assert any(
        line.startswith("expires        9999-12-31 23:59:59") for line in shown.stdout.splitlines()
    )
    as_json = run("key", "show", "order-7", "--task", "shop.charge", "--json")
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout)["expires_at"].startswith("9999-12-31T23:59:59")


def test_key_show_of_a_queued_key_says_when_it_is_published_again(
    run: Run, store: RedisStore
) -> None:
    request, _ = claim(store, "shop.charge", "order-8")
    store.forget(request.storage_key)
    assert store.reserve(request, Pickup(envelope=b"{}", due_in=600, timeout=600)) is None

    result = run("key", "show", "order-8", "--task", "shop.charge")

    assert result.exit_code == 0, result.output
    assert "status         queued" in result.stdout
    assert "owner task id  id-of-order-8" in result.stdout
    assert any(
        line.startswith("lease expires  - (queued; published again ") and "(in 9m" in line
        for line in result.stdout.splitlines()
    ), result.stdout


def test_key_show_of_a_running_key_shows_its_lease(run: Run, store: RedisStore) -> None:
    claim(store, "shop.charge", "order-7")

    result = run("key", "show", "order-7", "--task", "shop.charge")
    as_json = json.loads(run("key", "show", "order-7", "--task", "shop.charge", "--json").stdout)

    assert result.exit_code == 0, result.output
    assert "status         processing" in result.stdout
    assert "result cached  no" in result.stdout
    assert "result         -" in result.stdout
    assert any(
        line.startswith("lease expires") and "(in 4m" in line for line in result.stdout.splitlines()
    )
    assert as_json["status"] == "processing" and as_json["result_cached"] is False
    assert as_json["result"] is None


class _HourBehind(datetime):
    """``datetime`` on a host whose clock runs an hour behind."""

    @classmethod
    def now(cls, tz: Any = None) -> Any:
        return datetime.now(tz) - timedelta(hours=1)


def test_times_shown_are_from_the_stores_clock_on_a_host_whose_clock_is_wrong(
    run: Run,
    store: RedisStore,
    queue: DeadLetterQueue,
    clock: Clock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a running key and a dead letter written two minutes ago
    claim(store, "shop.charge", "order-7")
    item = seed_three(queue, clock)[1]
    # When the command runs on a host whose clock is an hour behind the servers'
    monkeypatch.setattr("idempotent_tasks.cli.datetime", _HourBehind)
    monkeypatch.setattr("idempotent_tasks.dlq.queue.datetime", _HourBehind)
    key = run("key", "show", "order-7", "--task", "shop.charge")
    dead_letter = run("dlq", "show", item.id)
    # Then "how long from now" is told by the clocks the sweeps and leases go by
    assert key.exit_code == 0 and dead_letter.exit_code == 0, key.output + dead_letter.output
    assert re.search(r"^lease expires .*\(in 4m( \d+s)?\)$", key.stdout, re.M), key.stdout
    assert re.search(r"^created +\S+ \S+ UTC \(2m( \d+s)? ago\)$", dead_letter.stdout, re.M)


def test_key_show_of_a_long_key_finds_its_hashed_record(run: Run, store: RedisStore) -> None:
    long_key = "report:{2024}:" + "x" * 300
    complete(store, "shop.charge", long_key, [1, 2], "json")

    result = run("key", "show", long_key, "--task", "shop.charge", "--json")

    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["storage_key"].startswith("sha256:") and shown["result"] == [1, 2]


def test_key_show_of_an_unregistered_task_warns_and_decodes_its_own_type(
    run: Run, store: RedisStore
) -> None:
    complete(store, "billing.refund", "refund-1", {"refunded": True}, "json")

    result = run("key", "show", "refund-1", "--task", "billing.refund")

    assert result.exit_code == 0, result.output
    assert "Warning: task 'billing.refund' is not registered in app 'cli_app'" in result.stderr
    assert "result         {'refunded': True}" in result.stdout


def test_key_show_never_unpickles_for_an_unregistered_task(run: Run, store: RedisStore) -> None:
    complete(store, "billing.refund", "refund-2", {"refunded": True}, "pickle")

    result = run("key", "show", "refund-2", "--task", "billing.refund")
    as_json = json.loads(
        run("key", "show", "refund-2", "--task", "billing.refund", "--json").stdout
    )

    assert result.exit_code == 0, result.output
    assert "result cached  yes (application/x-python-serialize, " in result.stdout
    assert "result         (cannot be shown: cached result has content type" in result.stdout
    assert as_json["result"] is None
    assert "does not accept" in as_json["result_error"]


def test_key_show_with_a_task_module_that_fails_to_import_warns_and_goes_on(
    run: Run, store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the app's task modules, one raising as it is imported (not an ImportError)
    monkeypatch.setenv("CLI_IMPORTS", "tests.acceptance.cli_broken_tasks")
    complete(store, "billing.refund", "refund-1", {"refunded": True}, "json")

    result = run("key", "show", "refund-1", "--task", "billing.refund")

    # Then the command says why in one line, and shows the record all the same
    assert result.exit_code == 0, result.output
    assert (
        "Warning: could not import the app's task modules: RuntimeError: the tasks' settings "
        "module is missing" in result.stderr
    )
    assert "Traceback" not in result.output
    assert "refunded" in result.stdout


def test_key_show_of_an_unknown_key_fails_clearly(run: Run, store: RedisStore) -> None:
    complete(store, "shop.charge", "order-42", 1, "json")

    unknown = run("key", "show", "order-43", "--task", "shop.charge")
    other_task = run("key", "show", "order-42", "--task", "shop.refund")
    no_task = run("key", "show", "order-42")

    assert_failed_cleanly(
        unknown, "Error: no record of key 'order-43' for task shop.charge (never used, expired"
    )
    assert_failed_cleanly(other_task, "Error: no record of key 'order-42' for task shop.refund")
    assert "not registered" in other_task.stderr
    assert no_task.exit_code == 2 and "Missing option '--task'" in no_task.stderr


def test_key_show_with_a_default_store_folder_that_cannot_be_made_fails_clearly(
    run: Run, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Given no store URL (the default SQLite file) and a data folder no one can make
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("IDEMPOTENT_TASKS_DATA_DIR", str(blocker / "data"))

    result = run("key", "show", "order-42", "--task", "shop.charge", store="")

    assert_failed_cleanly(result, "Error: cannot open the claim store: ")


# -- key forget -----------------------------------------------------------------------------


def test_key_forget_asks_first_then_deletes(run: Run, store: RedisStore, terminal: None) -> None:
    complete(store, "shop.charge", "order-42", 1, "json")
    name = storage_key("shop.charge", "order-42")

    declined = run("key", "forget", "order-42", "--task", "shop.charge", input="n\n")
    assert declined.exit_code == 1 and "Aborted" in declined.output
    assert store.get(name) is not None

    confirmed = run("key", "forget", "order-42", "--task", "shop.charge", input="y\n")

    assert confirmed.exit_code == 0, confirmed.output
    assert "Forget key 'order-42' of task shop.charge (completed)? [y/N]" in confirmed.output
    assert confirmed.stdout.endswith(
        "Forgot key 'order-42' of task shop.charge (it was completed).\n"
    )
    assert store.get(name) is None


def test_key_forget_of_a_running_key_says_so_and_yes_skips_the_question(
    run: Run, store: RedisStore, terminal: None
) -> None:
    claim(store, "shop.charge", "order-7")

    asked = run("key", "forget", "order-7", "--task", "shop.charge", input="n\n")
    forced = run("key", "forget", "order-7", "--task", "shop.charge", "--yes")

    assert "It is processing (task id-of-order-7)" in asked.output
    assert forced.exit_code == 0 and "[y/N]" not in forced.output
    assert store.get(storage_key("shop.charge", "order-7")) is None


def test_key_forget_deletes_an_unreadable_record(
    run: Run, store: RedisStore, store_url: str, terminal: None
) -> None:
    # Given a key whose record cannot be read (calls of it are dead-lettered until it goes)
    name = storage_key("shop.charge", "order-9")
    redis.Redis.from_url(store_url).set(store.names(name)[0], "not a hash")
    shown = run("key", "show", "order-9", "--task", "shop.charge")
    assert_failed_cleanly(shown, "Error: the record of key 'order-9' of task shop.charge is")

    # When it is forgotten, then the question says why, and the record is gone
    asked = run("key", "forget", "order-9", "--task", "shop.charge", input="n\n")
    assert "(unreadable)? Its record cannot be read" in asked.output
    forgot = run("key", "forget", "order-9", "--task", "shop.charge", "--yes")
    assert forgot.exit_code == 0, forgot.output
    assert forgot.stdout.endswith("Forgot key 'order-9' of task shop.charge (it was unreadable).\n")
    assert store.get(name) is None


def test_key_forget_of_an_unknown_key_fails_clearly(run: Run, store: RedisStore) -> None:
    result = run("key", "forget", "order-43", "--task", "shop.charge", "--yes")

    assert_failed_cleanly(result, "Error: no record of key 'order-43' for task shop.charge")


# -- unreachable stores ---------------------------------------------------------------------

DLQ_COMMANDS = [
    ["dlq", "list"],
    ["dlq", "list", "--json"],
    ["dlq", "show", "some-id"],
    ["dlq", "retry", "some-id"],
    ["dlq", "purge", "--all", "--yes"],
    ["dlq", "stats"],
]
KEY_COMMANDS = [
    ["key", "show", "order-42", "--task", "shop.charge"],
    ["key", "forget", "order-42", "--task", "shop.charge", "--yes"],
]


@pytest.mark.parametrize("command", DLQ_COMMANDS, ids=" ".join)
def test_an_unreachable_database_is_one_clear_line(run: Run, command: list[str]) -> None:
    result = run(*command, dlq=UNREACHABLE_DLQ)

    assert_unavailable(
        result,
        "Error: cannot use the dead-letter database at "
        "postgresql+psycopg://postgres:***@127.0.0.1:1/x: ",
    )


@pytest.mark.parametrize("command", KEY_COMMANDS, ids=" ".join)
def test_an_unreachable_store_is_one_clear_line(run: Run, command: list[str]) -> None:
    result = run(*command, store=UNREACHABLE_STORE)

    assert_unavailable(result, "Error: cannot use the claim store at redis://:***@127.0.0.1:1/0: ")


def test_a_password_in_the_urls_query_is_hidden_too(run: Run) -> None:
    # redis-py takes a password as a query parameter as well as in the address
    result = run(*KEY_COMMANDS[0], store="redis://127.0.0.1:1/0?password=s3cret")

    assert_unavailable(
        result, "Error: cannot use the claim store at redis://127.0.0.1:1/0?password=***: "
    )


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("not a url at all", "Could not parse"),
        ("postgres://postgres@127.0.0.1:1/x", "use postgresql+psycopg://postgres@127.0.0.1:1/x"),
    ],
    ids=["malformed", "heroku-style"],
)
def test_a_dead_letter_url_no_queue_can_be_opened_on_is_one_clear_line(
    run: Run, url: str, said: str
) -> None:
    result = run("dlq", "stats", dlq=url)

    assert_failed_cleanly(result, "Error: cannot open the dead-letter database: ")
    assert said in result.stderr and result.stderr.count("\n") == 1


def assert_unavailable(result: Result, start: str) -> None:
    assert_failed_cleanly(result, start, exit_code=69)
    assert result.stdout == ""
    assert result.stderr.startswith(start) and result.stderr.count("\n") == 1
    assert "s3cret" not in result.stderr


# -- the real command -----------------------------------------------------------------------


def test_the_celery_executable_has_the_subcommand(dlq_url: str) -> None:
    # Given a fresh interpreter: only the installed entry point can add `idempotency`
    run = subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "idempotency", "dlq", "stats"],
        cwd=ROOT,
        env={**os.environ, "CLI_DLQ_URL": dlq_url},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[-1].startswith("total ")


def test_help_lists_both_groups(run: Run) -> None:
    result = run("--help")

    assert result.exit_code == 0
    assert "dlq  Dead letters: tasks that failed for good." in result.stdout
    assert "key  Idempotency keys: show a key's record, or forget it." in result.stdout


def test_without_an_app_it_warns_and_uses_the_default_stores(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "celery", "idempotency", "dlq", "stats", "--json"],
        cwd=tmp_path,
        env={**os.environ, "IDEMPOTENT_TASKS_DATA_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stderr.count("Warning: no app given (celery -A proj ...)") == 1
    assert json.loads(run.stdout)["total"] == 0
    assert (tmp_path / "dead_letters.sqlite3").exists()
