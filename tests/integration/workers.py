"""Celery worker subprocesses for integration tests: started, killed and stopped for real."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class WorkerProcess:
    """One ``celery worker`` process (prefork pool by default) running ``app_module``."""

    def __init__(
        self,
        name: str,
        env: dict[str, str],
        log_dir: Path,
        concurrency: int = 2,
        pool: str = "prefork",
        app_module: str = "tests.integration.worker_app",
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                app_module,
                "worker",
                "-P",
                pool,
                "-c",
                str(concurrency),
                "-n",
                f"{name}@%h",
                "-l",
                "info",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                *extra_args,
            ],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited:\n{self.log()}")
            if b" ready." in self.log_path.read_bytes():
                return
            time.sleep(0.1)
        raise RuntimeError(f"worker {self.name} not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        """Everything the worker printed so far."""
        return self.log_path.read_text(errors="replace")

    def child_pids(self) -> list[int]:
        """Pids of the pool processes (children of the main worker process)."""
        out = subprocess.run(
            ["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True, check=False
        )
        return [int(pid) for pid in out.stdout.split()]

    def kill(self) -> None:
        """SIGKILL the whole worker (main process and pool) at once: a crashed machine."""
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
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


@contextmanager
def running_workers(
    count: int, env: dict[str, str], log_dir: Path, concurrency: int = 2
) -> Iterator[list[WorkerProcess]]:
    """Start ``count`` workers; stop them all on exit."""
    workers: list[WorkerProcess] = []
    try:
        for index in range(count):
            workers.append(
                WorkerProcess(f"w{index}-{time.monotonic_ns()}", env, log_dir, concurrency)
            )
        yield workers
    finally:
        for worker in workers:
            worker.stop()


class BeatProcess:
    """``celery beat`` running tests.integration.worker_app, its schedule in a temp folder."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.log_path = log_dir / "beat.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "tests.integration.worker_app",
                "beat",
                "-l",
                "info",
                "-s",
                str(log_dir / "beat-schedule"),
            ],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self._log.close()
