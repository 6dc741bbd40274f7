"""The docker-compose example app runs against real Redis and PostgreSQL with a real worker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import sqlalchemy as sa

from tests.integration.workers import WorkerProcess
from tests.services import require

ROOT = Path(__file__).resolve().parents[2]
CALLER = """
import uuid
from examples.compose_app import charge
order = uuid.uuid4().int % 10**9
first = charge.delay(order, 990)
value = first.get(timeout=30)
again = charge.apply_async((order, 990))
assert again.id == first.id, "the duplicate was published instead of answered from the cache"
assert again.get(timeout=30) == value
print(value["charge_id"])
"""


def test_compose_app_charges_once(redis_url: str, tmp_path: Path) -> None:
    require("PostgreSQL")
    admin = sa.create_engine(
        "postgresql+psycopg://postgres@127.0.0.1:5432/postgres", isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as connection:
        connection.execute(sa.text("DROP DATABASE IF EXISTS compose_shop WITH (FORCE)"))
        connection.execute(sa.text("CREATE DATABASE compose_shop"))
    admin.dispose()
    env = {
        "REDIS_URL": redis_url,
        "DATABASE_URL": "postgresql+psycopg://postgres@127.0.0.1:5432/compose_shop",
        "GATEWAY_TIMEOUT_RATE": "0",
    }
    worker = WorkerProcess(
        "compose", env, tmp_path, concurrency=1, pool="solo", app_module="examples.compose_app"
    )
    try:
        run = subprocess.run(
            [sys.executable, "-c", CALLER],
            cwd=ROOT,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        worker.stop()
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().startswith("ch_")
