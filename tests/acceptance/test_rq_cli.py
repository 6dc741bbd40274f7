"""``idempotent-tasks rq retry-dead-letters`` when what it sweeps cannot be used: one line, the
exit code of the Celery commands, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from idempotent_tasks.rq.cli import cli


@pytest.mark.parametrize(
    ("given_redis_url", "dlq_url", "exit_code", "says"),
    [
        # A database that cannot be reached (its folder is not there): 69, as a service down.
        (None, "sqlite:///{tmp}/no-such-folder/dlq.sqlite3", 69, "cannot sweep now: "),
        # A set-up no wait mends (a driver that does not exist, a URL that does not parse): 1.
        (None, "postgresql+nodriver://u:secret@127.0.0.1/db", 1, "cannot sweep: "),
        ("redis://127.0.0.1:notaport/0", "sqlite:///{tmp}/dlq.sqlite3", 1, "cannot sweep: "),
    ],
    ids=["unreachable", "misconfigured", "bad-redis-url"],
)
def test_the_rq_sweep_command_names_what_it_cannot_use_in_one_line(
    redis_url: str,
    tmp_path: Path,
    given_redis_url: str | None,
    dlq_url: str,
    exit_code: int,
    says: str,
) -> None:
    result = _sweep(
        "--redis-url", given_redis_url or redis_url, "--dlq-url", dlq_url.format(tmp=tmp_path)
    )
    assert result.exit_code == exit_code, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith(f"Error: {says}"), line
    assert "secret" not in result.output


def test_the_rq_sweep_command_sweeps_even_when_the_store_to_clean_cannot_be_opened(
    redis_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a claim store whose driver does not exist, for the sweep to remove expired claims
    result = _sweep(
        "--redis-url",
        redis_url,
        "--dlq-url",
        f"sqlite:///{tmp_path}/dlq.sqlite3",
        "--store-url",
        "postgresql+nodriver://u@127.0.0.1/claims",
    )
    # Then the sweep's own work is done and reported, the store's trouble only warned of
    assert result.exit_code == 0, result.output
    assert result.output == "re-enqueued 0 dead letters\n"
    assert any("could not open the claim store" in message for message in caplog.messages)


def _sweep(*options: str) -> Result:
    return CliRunner().invoke(cli, ["rq", "retry-dead-letters", *options])
