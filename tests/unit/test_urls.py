"""URLs shown in messages and prompts keep their secrets to themselves."""

from __future__ import annotations

import pytest

from idempotent_tasks.stores import store_from_url
from idempotent_tasks.urls import shown_url


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
    ],
)
def test_passwords_are_hidden_wherever_the_url_holds_them(url: str, shown: str) -> None:
    assert shown_url(url) == shown
    assert "s3cret" not in shown_url(url)


@pytest.mark.parametrize(
    "url",
    ["sqlite:////tmp/x.db", "sqlite:///rel.db", "memory://", "redis+socket:///tmp/r.sock"],
)
def test_a_url_without_secrets_is_shown_as_it_is(url: str) -> None:
    assert shown_url(url) == url


def test_a_store_url_no_store_handles_is_refused_with_its_password_hidden() -> None:
    with pytest.raises(ValueError, match="no store for scheme") as refused:
        store_from_url("redis+sentinel://:s3cret@sentinel:26379/0", prefix="p")
    assert "s3cret" not in str(refused.value)
    assert "redis+sentinel://:***@sentinel:26379/0" in str(refused.value)
