"""URLs shown in messages and prompts keep their secrets to themselves."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery
from sqlalchemy import URL, make_url

from idempotent_tasks.app_store import store_url
from idempotent_tasks.dlq import DeadLetterQueue
from idempotent_tasks.stores import store_from_url
from idempotent_tasks.urls import shown_url, url_text


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:s3cret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("redis://shop:s3cret@host/0", "redis://shop:***@host/0"),
        ("redis://host/0?password=s3cret&db=2", "redis://host/0?password=***&db=2"),
        (
            "postgresql+psycopg://u@h/db?sslpassword=s3cret&sslmode=require",
            "postgresql+psycopg://u@h/db?sslpassword=***&sslmode=require",
        ),
        (
            "sentinel://:s3cret@h1:26379/0;sentinel://:s3cret@h2:26379/0",
            "sentinel://:***@h1:26379/0;sentinel://:***@h2:26379/0",
        ),
        ("rediss://h/0?ssl_password=s3cret", "rediss://h/0?ssl_password=***"),
        # Characters SQLAlchemy takes in a password as they are, which urlsplit would not
        ("postgresql+psycopg://app:s3cret;x@db/shop", "postgresql+psycopg://app:***@db/shop"),
        ("postgresql+psycopg://app:s3c/ret@db/shop", "postgresql+psycopg://app:***@db/shop"),
        ("mysql+pymysql://app:s3c#ret@db/shop", "mysql+pymysql://app:***@db/shop"),
        ("mysql+pymysql://app:s3c?ret@db/shop", "mysql+pymysql://app:***@db/shop"),
        ("redis://:s3c@ret@host:6379/0", "redis://:***@host:6379/0"),
        # A scheme misspelt without its colon: the URL is refused, and shown in that error
        ("postgresql+psycopg//shop:s3cret@db/shop", "postgresql+psycopg//shop:***@db/shop"),
        ("postgresql+psycopg:/shop:s3cret@db/shop", "postgresql+psycopg:/shop:***@db/shop"),
    ],
)
def test_passwords_are_hidden_wherever_the_url_holds_them(url: str, shown: str) -> None:
    assert shown_url(url) == shown
    assert "s3cret" not in shown_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:////tmp/x.db",
        "sqlite:///rel.db",
        "sqlite:////tmp/at@sign.db",
        "memory://",
        "redis+socket:///tmp/r.sock",
        "redis://127.0.0.1:6379/0",
    ],
)
def test_a_url_without_secrets_is_shown_as_it_is(url: str) -> None:
    assert shown_url(url) == url


def test_a_store_url_no_store_handles_is_refused_with_its_password_hidden() -> None:
    with pytest.raises(ValueError, match="no store for scheme") as refused:
        store_from_url("redis+sentinel://:s3cret@sentinel:26379/0", prefix="p")
    assert "s3cret" not in str(refused.value)
    assert "redis+sentinel://:***@sentinel:26379/0" in str(refused.value)


def test_an_sqlalchemy_url_object_is_used_with_its_password() -> None:
    # (str() of an SQLAlchemy URL puts *** in its password's place)
    url = URL.create("postgresql+psycopg", username="app", password="p@ss;w/rd", host="db")
    app = Celery("urls", set_as_current=False)
    app.conf.idempotency_store_url = url.set(database="claims")
    assert make_url(store_url(app)).password == "p@ss;w/rd"
    assert make_url(url_text(url)) == url
    assert url_text("redis://h/0") == "redis://h/0"


def test_a_dead_letter_queue_takes_an_sqlalchemy_url_object(tmp_path: Path) -> None:
    queue = DeadLetterQueue(URL.create("sqlite", database=str(tmp_path / "dlq.sqlite3")))
    try:
        assert queue.url == f"sqlite:///{tmp_path / 'dlq.sqlite3'}"
        assert queue.stats()["total"] == 0
    finally:
        queue.dispose()


@pytest.mark.parametrize(
    "url",
    [
        "sqlite://",
        "sqlite:///:memory:",
        "sqlite:///file:dlq?mode=memory&uri=true",
        "sqlite:///file::memory:?cache=shared&uri=true",
    ],
)
def test_an_sqlite_database_in_memory_is_refused_for_the_store_and_the_dead_letters(
    url: str,
) -> None:
    # Each connection (the lease keeper's thread, a pool process) would get a database of its
    # own, and the one the worker checked at start would be gone once its engine closed
    with pytest.raises(ValueError, match="in memory"):
        DeadLetterQueue(url)
    with pytest.raises(ValueError, match="in memory"):
        store_from_url(url, prefix="p")
