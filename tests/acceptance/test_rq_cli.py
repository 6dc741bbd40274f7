"""``idempotent-tasks rq retry-dead-letters`` when what it sweeps cannot be used: one line, the
exit code of the Celery commands, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from idempotent_tasks.rq.cli import cli


@pytest.mark.parametrize(
    ("dlq_url", "exit_code", "says"),
    [
        # A database that cannot be reached (its folder is not there): 69, as a service down.
        ("sqlite:///{tmp}/no-such-folder/dlq.sqlite3", 69, "cannot sweep now: "),
        # A set-up no wait mends (a driver that does not exist): 1.
        ("postgresql+nodriver://u:secret@127.0.0.1/db", 1, "cannot sweep: "),
    ],
    ids=["unreachable", "misconfigured"],
)
def test_the_rq_sweep_command_names_what_it_cannot_use_in_one_line(
    redis_url: str, tmp_path: Path, dlq_url: str, exit_code: int, says: str
) -> None:
    result = CliRunner().invoke(
        cli,
        [
            "rq",
            "retry-dead-letters",
            "--redis-url",
            redis_url,
            "--dlq-url",
            dlq_url.format(tmp=tmp_path),
        ],
    )
    assert result.exit_code == exit_code, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith(f"Error: {says}"), line
    assert "secret" not in result.output
