"""The chaos run, small: a real workload under injected faults, then the audit (about a minute).

``python -m chaos.run`` starts a Redis server and a PostgreSQL cluster of its own (loopback, free
ports, a temporary folder), so these tests touch neither the machine's Redis nor its PostgreSQL.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

#: The report's invariant lines, with the count each must show.
ZERO_LINES = (
    r"^  0 keys whose body completed twice$",
    r"^  0 keys lost \(neither completed nor in the dead-letter table\)$",
    r"^  0 dead-letter rows re-published twice \(",
    r"^  0 keys whose callers got another value \(",
)
EXPLAINED = r"^  (\d+) keys? whose body started twice, each explained by a crash of its owner"
FAULTS = (
    "worker SIGKILLed",
    "pool process SIGKILLed",
    "pool process frozen past the lease",
    "Redis restart",
    "PostgreSQL restart",
)


def _require_servers() -> None:
    """Fail (never skip) when the servers the run starts are not installed."""
    from chaos.services import postgres_bindir

    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: apt-get install redis-server", pytrace=False)
    try:
        postgres_bindir()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


def _chaos(*args: str, timeout: float) -> tuple[int, str]:
    """Run ``python -m chaos.run`` with ``args``; its exit status and everything it printed.

    On overrun the run gets SIGTERM first, so it stops its workers and servers itself.
    """
    _require_servers()
    process = subprocess.Popen(
        [sys.executable, "-m", "chaos.run", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            out, _ = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate()
        pytest.fail(f"chaos run overran {timeout}s:\n{out}")
    return process.returncode, out


def _assert_every_invariant_holds(status: int, out: str) -> None:
    assert status == 0, out
    for pattern in ZERO_LINES:
        assert re.search(pattern, out, re.MULTILINE), f"no line {pattern!r} in:\n{out}"
    assert re.search(EXPLAINED, out, re.MULTILINE), out
    assert out.rstrip().splitlines()[-1] == "OK: every invariant holds"


def test_chaos_run_on_the_redis_store() -> None:
    # Given 600 keys (a third called 2-5 times) on the Redis store, while a worker is SIGKILLed,
    # a pool process killed and another frozen, and Redis and PostgreSQL restart
    status, out = _chaos(
        "--store=redis", "--tasks=600", "--seed=7", "--max-seconds=150", timeout=200
    )
    # Then no body completed twice, second starts are crashes', nothing was lost, no dead
    # letter was re-published twice, and every caller of a key got one value
    _assert_every_invariant_holds(status, out)
    for fault in FAULTS:
        assert re.search(rf"^  faults: .*\b1 {fault}", out, re.MULTILINE), out


def test_chaos_run_on_the_postgresql_store() -> None:
    status, out = _chaos(
        "--store=postgresql", "--tasks=300", "--seed=8", "--max-seconds=150", timeout=200
    )
    _assert_every_invariant_holds(status, out)
