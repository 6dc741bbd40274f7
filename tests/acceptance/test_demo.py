"""The README's first command: the demo runs on embedded defaults and shows its guarantees."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Runs the demo with redis-py made unimportable: it must need no server and no Redis client.
WITHOUT_REDIS = (
    "import runpy, sys; sys.modules['redis'] = None; sys.path.insert(0, 'examples'); "
    "runpy.run_path('examples/demo.py', run_name='__main__')"
)


def test_demo_shows_each_guarantee_and_exits_zero() -> None:
    run = subprocess.run(
        [sys.executable, "-c", WITHOUT_REDIS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    out = run.stdout
    assert run.returncode == 0, run.stdout + run.stderr
    assert "FAILED" not in out + run.stderr and "Traceback" not in run.stderr
    first_line = out.splitlines()[0]
    for embedded in ("broker memory://", "results cache+memory://", "claims memory://"):
        assert embedded in first_line
    # 1. duplicates at once: one body run, one charge id for every caller
    assert re.search(r"body ran 1 time; \d+ published", out)
    charged = re.search(r"every caller got \{'charge_id': '(ch_[0-9a-f]{12})'", out)
    assert charged is not None
    # 2. later duplicates: nothing published, the original task id
    assert "0 published, body ran 1 time in all; both returned the cached value" in out
    assert re.search(r"their result \.id is the original task id: [0-9a-f-]{36}", out)
    # 3. the flaky task: released before each retry, sent once
    assert (
        "attempts: TimeoutError, TimeoutError, sent; key claimed 3 times, released before "
        "each retry (0 takeovers)" in out
    )
    assert "sent again: 0 published, same task id and value; body started 3 times in all" in out
    # 4. dead letters: kept in a temporary SQLite file, swept until given up or succeeded
    table = re.search(r"4\. dead letters, kept in sqlite:///(\S+/dead_letters\.sqlite3)\n", out)
    assert table is not None
    assert not Path(table.group(1)).parent.exists()  # the temporary folder is gone
    assert "retried by the task idempotent_tasks.retry_dead_letters: beat sends it every" in out
    assert "dead letter: shop.notify_warehouse, ConnectionError, pending, retry 0/2" in out
    assert "sweep 1: 1 re-published, failed again -> pending, retry 1/2" in out
    assert "sweep 2: 1 re-published, failed again -> permanent_failure, retry 2/2" in out
    assert "sweep 3: 0 re-published; body ran 3 times in all" in out
    assert "dead letter: shop.book_courier, ConnectionError, pending, retry 0/2" in out
    assert re.search(
        r"sweep 4: 1 re-published, it ran -> succeeded, retry 0/2; "
        r"got \{'tracking': 'trk_[0-9a-f]{10}', 'order_id': 42\}",
        out,
    )
    assert "sent again: 0 published, same task id and value; body ran 3 times in all" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("OK in ")
    assert f"card charged once ({charged.group(1)})" in last
    assert last.endswith(
        "dead letters: shop.notify_warehouse permanent_failure, shop.book_courier succeeded"
    )


def test_quickstart_imports_without_connecting() -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['redis'] = None; import examples.quickstart",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr


def test_quickstart_runs_against_redis_with_a_real_worker(redis_url: str, tmp_path: Path) -> None:
    from tests.integration.workers import WorkerProcess

    worker = WorkerProcess(
        "quickstart", {}, tmp_path, concurrency=1, pool="solo", app_module="examples.quickstart"
    )
    try:
        run = subprocess.run(
            [sys.executable, "examples/quickstart.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        worker.stop()
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "True"


def test_readme_example_is_the_quickstart_file() -> None:
    readme = (ROOT / "README.md").read_text()
    example = readme.split("```python\n", 1)[1].split("```\n", 1)[0]
    quickstart = (ROOT / "examples" / "quickstart.py").read_text()
    assert quickstart.endswith(example)
    assert len(example.strip().splitlines()) <= 20
