"""The README's other example files run, and the README shows them as they are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from idempotent_tasks.dlq import DeadLetterQueue, Failure

ROOT = Path(__file__).resolve().parents[2]


def test_readme_shows_the_dead_letter_example_as_it_is() -> None:
    readme = (ROOT / "README.md").read_text()
    example = (ROOT / "examples" / "dead_letters.py").read_text().split("\n", 2)[2]
    assert example in readme


def test_dead_letter_example_lists_and_retries_pending_items(tmp_path: Path) -> None:
    # Given a dead-letter table holding one pending item
    url = f"sqlite:///{tmp_path / 'dlq.sqlite3'}"
    queue = DeadLetterQueue(url, base_delay=3600)
    item = queue.add(
        Failure(
            failure_id="t-1:0",
            task_name="shop.charge",
            task_id="t-1",
            idempotency_key="k",
            args=[42],
            kwargs={},
            options={},
            error_type="TimeoutError",
            error_message="slow",
            traceback=None,
            max_retries=3,
        )
    )
    # When the example runs on it
    run = subprocess.run(
        [sys.executable, "examples/dead_letters.py", url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # Then it printed the counts and the item, and made the item due at once
    assert run.returncode == 0, run.stderr
    assert "'pending': 1" in run.stdout and "'total': 1" in run.stdout
    assert f"{item.id} shop.charge TimeoutError 0" in run.stdout
    assert "0 succeeded items older than a week purged" in run.stdout
    updated = queue.get(item.id)
    assert updated is not None and updated.next_retry_at is not None
    assert item.next_retry_at is not None and updated.next_retry_at < item.next_retry_at
    queue.dispose()
