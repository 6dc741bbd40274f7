"""Real ``rq worker`` processes and the services the RQ integration tests share.

Redis db 9 holds RQ's queues and the claim store, db 8 the ledger of tests.integration.rq_jobs;
dead letters go to the PostgreSQL database ``it_rq_dead_letters``. Test modules import the
fixtures below.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from rq.job import Job, JobStatus

from idempotent_tasks.dlq import DeadLetter, DeadLetterQueue, Failure
from idempotent_tasks.records import ClaimRequest, Record
from idempotent_tasks.rq import resources
from idempotent_tasks.rq.dead_letters import row_options
from tests.claim_requests import claim_request
from tests.integration import rq_jobs

ROOT = Path(__file__).resolve().parents[2]
RQ_DB, LEDGER_DB = 9, 8
DLQ_DATABASE = "it_rq_dead_letters"
QUEUE_CLASS = "idempotent_tasks.rq.IdempotentQueue"
JOB_CLASS = "idempotent_tasks.rq.IdempotentJob"


@dataclass
class RQEnv:
    """URLs and clients of one test module's services (emptied when the module starts)."""

    rq_url: str
    ledger_url: str
    dlq_url: str
    connection: redis.Redis
    dlq: DeadLetterQueue
    data_dir: Path

    def worker_env(self) -> dict[str, str]:
        return {
            rq_jobs.LEDGER_URL_ENV: self.ledger_url,
            # Where a worker would put a default SQLite dead-letter file: never the home folder.
            "IDEMPOTENT_TASKS_DATA_DIR": str(self.data_dir),
        }

    def rows_of(self, job_id: str) -> list[DeadLetter]:
        return [item for item in self.dlq.items(limit=1000) if item.task_id == job_id]

    def seed_dead_letter(
        self, task_name: str, key: str, args: list[Any], queue_name: str
    ) -> tuple[str, DeadLetter]:
        """A pending dead letter of an RQ job of ``task_name`` under ``key`` (a new job id, on
        ``queue_name``), as a final failure writes one: the job id and the row."""
        job_id = str(uuid.uuid4())
        item = self.dlq.add(
            Failure(
                failure_id=f"{job_id}:0",
                task_name=task_name,
                task_id=job_id,
                idempotency_key=key,
                args=args,
                kwargs={},
                options=row_options(queue_name),
                error_type="RuntimeError",
                error_message="seeded",
                traceback=None,
                max_retries=3,
                framework="rq",
            )
        )
        return job_id, item


def rq_env_fixture(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RQEnv]:
    """Body of the module-scoped ``rq_env`` fixture each RQ test module defines."""
    from tests.integration.databases import fresh_pg_database
    from tests.services import require

    require("Redis")
    require("PostgreSQL")
    rq_url, ledger_url = f"{redis_url}/{RQ_DB}", f"{redis_url}/{LEDGER_DB}"
    for url in (rq_url, ledger_url):
        client = redis.Redis.from_url(url)
        client.flushdb()
        client.close()
    dlq_url = fresh_pg_database(DLQ_DATABASE)
    data_dir = tmp_path_factory.mktemp("rq-data")
    connection = redis.Redis.from_url(rq_url)
    dlq = DeadLetterQueue(dlq_url)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(rq_jobs.LEDGER_URL_ENV, ledger_url)
        patch.setenv("IDEMPOTENT_TASKS_DATA_DIR", str(data_dir))
        rq_jobs.close_ledger()
        try:
            yield RQEnv(rq_url, ledger_url, dlq_url, connection, dlq, data_dir)
        finally:
            dlq.dispose()
            resources.close_all()
            rq_jobs.close_ledger()
            connection.close()


class RQWorker:
    """One ``rq worker`` process (forking a work horse per job) on the given queues."""

    def __init__(self, name: str, env: RQEnv, queues: list[str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rq.cli",
                "worker",
                "--url",
                env.rq_url,
                "--queue-class",
                QUEUE_CLASS,
                "--job-class",
                JOB_CLASS,
                "--name",
                name,
                *queues,
            ],
            cwd=ROOT,
            env={**os.environ, **env.worker_env()},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Return once the worker listens on its queues."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"rq worker {self.name} exited:\n{self.log()}")
            if b"*** Listening on" in self.log_path.read_bytes():
                return
            time.sleep(0.05)
        raise RuntimeError(f"rq worker {self.name} not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the worker and its work horse (which RQ puts in a process group of its own)."""
        horses = subprocess.run(
            ["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        for pid in horses:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=10)
        if not self._log.closed:
            self._log.close()

    def stop(self) -> None:
        """Warm shutdown, then SIGKILL whatever is left."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


def start_workers(
    count: int, env: RQEnv, queues: list[str], log_dir: Path, prefix: str = "w"
) -> list[RQWorker]:
    """Start ``count`` workers at once (they boot in parallel) and wait until all listen."""
    workers: list[RQWorker] = []
    try:
        for index in range(count):
            workers.append(RQWorker(f"{prefix}{index}-{time.monotonic_ns()}", env, queues, log_dir))
        for worker in workers:
            worker.wait_ready()
    except BaseException:
        for worker in workers:
            worker.stop()
        raise
    return workers


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``condition`` until truthy; fail with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def status(job: Job) -> JobStatus:
    return job.get_status(refresh=True)


def wait_value(job: Job, timeout: float = 20.0) -> Any:
    """The return value of ``job`` once it finished; fails the test if it failed."""

    def ended() -> bool:
        return status(job) in (JobStatus.FINISHED, JobStatus.FAILED)

    wait_until(ended, timeout, f"job {job.id} to end")
    if status(job) is JobStatus.FAILED:
        latest = job.latest_result()
        raise AssertionError(f"job {job.id} failed: {latest.exc_string if latest else '?'}")
    return job.return_value(refresh=True)


def wait_failed(job: Job, timeout: float = 20.0) -> None:
    wait_until(lambda: status(job) is JobStatus.FAILED, timeout, f"job {job.id} to fail")


def taker_of(held: Record, storage_key: str, key: str) -> ClaimRequest:
    """A claim of another call taking ``held``'s key over at once (as after a lease lost to a
    stalled store), with its own owner and task id."""
    return claim_request(
        key=key,
        task_name=held.task_name,
        storage_key=storage_key,
        task_id=f"taker-{uuid.uuid4().hex[:10]}",
        owner=f"taker-owner-{uuid.uuid4().hex[:10]}",
        fingerprint=held.fingerprint,
        lease_seconds=60,
        ttl_seconds=600,
        previous_owner=held.owner,
    )
