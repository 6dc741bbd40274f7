"""The servers and processes a chaos run starts, restarts, kills and always stops.

A Redis server and a PostgreSQL cluster of the run's own, on free loopback ports in the run's
folder, so restarting them disturbs nothing else on the machine; Celery workers and beat as
subprocesses. Every process is started from the driver's main thread and asked to die with it
(``PR_SET_PDEATHSIG``), so even a driver killed with SIGKILL leaves no server behind.
"""

from __future__ import annotations

import ctypes
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import redis

from chaos import ENV_BACKEND_URL, ENV_BROKER_URL, ENV_DLQ_URL, ENV_LEDGER, ENV_STORE_URL

ROOT = Path(__file__).resolve().parent.parent
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    """``preexec_fn``: SIGKILL this child when the driver dies (runs after any uid change)."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _spawn(
    args: list[str], log: Path, *, env: dict[str, str] | None = None, user: str | None = None
) -> subprocess.Popen[bytes]:
    """Start ``args`` in a session of its own, output appended to ``log``."""
    if threading.current_thread() is not threading.main_thread():
        # PR_SET_PDEATHSIG fires when the *thread* that started the child ends.
        raise RuntimeError("chaos processes are started from the main thread only")
    with log.open("ab") as out:
        return subprocess.Popen(
            args,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            user=user,
            group=user,
            extra_groups=[] if user else None,
            preexec_fn=_die_with_parent,
        )


def _kill_group(process: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def free_port() -> int:
    """A TCP port nothing listens on right now, on 127.0.0.1."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for(condition: object, timeout: float, what: str, pause: float = 0.05) -> None:
    """Poll ``condition()`` until true; ``TimeoutError`` naming ``what`` after ``timeout`` s."""
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(pause)
    raise TimeoutError(f"{what}: not within {timeout:.0f}s")


class RedisServer:
    """``redis-server`` with an append-only file fsynced on every write, in ``directory``.

    Not started until :meth:`start`.
    """

    def __init__(self, directory: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: apt-get install redis-server")
        self.binary = binary
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, db: int) -> str:
        """URL of database ``db``."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self, timeout: float = 30.0) -> None:
        """Start the server and wait until it answers (and has loaded its AOF)."""
        self.process = _spawn(
            [
                self.binary,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dir",
                str(self.directory),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--maxclients",
                "2000",
            ],
            self.directory / "redis.log",
        )
        client = redis.Redis.from_url(self.url(0), socket_timeout=2)

        def answers() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited; see {self.directory / 'redis.log'}")
            try:
                return bool(client.ping())
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                return False  # not up yet, or still loading its AOF

        try:
            wait_for(answers, timeout, f"redis-server on port {self.port}")
        finally:
            client.close()

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (Redis fsyncs its AOF and exits), SIGKILL after ``timeout`` s."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(process)
                process.wait(timeout=10)

    def restart(self, down_for: float) -> None:
        """Stop, stay down ``down_for`` s, start again."""
        self.stop()
        time.sleep(down_for)
        self.start()


def postgres_bindir() -> Path:
    """The folder of the newest installed PostgreSQL server binaries."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4])
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb is None:
        raise RuntimeError(
            "PostgreSQL's server binaries are not installed: apt-get install postgresql"
        )
    return Path(initdb).parent


class PostgresServer:
    """A throwaway PostgreSQL cluster: ``initdb`` in ``directory``, ``postgres`` in the foreground.

    Runs as the ``postgres`` user when the driver is root (PostgreSQL refuses root). The
    constructor runs ``initdb``; :meth:`start` starts the server.
    """

    def __init__(self, directory: Path) -> None:
        self.bindir = postgres_bindir()
        self.directory = directory
        self.data = directory / "data"
        self.user = "postgres" if os.geteuid() == 0 else None
        directory.mkdir(parents=True, exist_ok=True)
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(directory, entry.pw_uid, entry.pw_gid)
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        subprocess.run(
            [
                str(self.bindir / "initdb"),
                "-D",
                str(self.data),
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--no-sync",
            ],
            user=self.user,
            group=self.user,
            extra_groups=[] if self.user else None,
            cwd=directory,
            capture_output=True,
            check=True,
            timeout=120,
        )

    def url(self, database: str) -> str:
        """SQLAlchemy URL of ``database`` (psycopg 3)."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def _dsn(self, database: str) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={database} connect_timeout=3"

    def start(self, timeout: float = 60.0) -> None:
        """Start the postmaster and wait until it accepts connections."""
        self.process = _spawn(
            [
                str(self.bindir / "postgres"),
                "-D",
                str(self.data),
                "-p",
                str(self.port),
                "-k",
                str(self.directory),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "max_connections=300",
                # Only processes die in a chaos run, never the machine: no need to fsync.
                "-c",
                "fsync=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "logging_collector=off",
            ],
            self.directory / "postgres.log",
            user=self.user,
        )

        def answers() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited; see {self.directory / 'postgres.log'}")
            try:
                with psycopg.connect(self._dsn("postgres")) as connection:
                    connection.execute("SELECT 1")
                return True
            except psycopg.OperationalError:
                return False

        wait_for(answers, timeout, f"PostgreSQL on port {self.port}", pause=0.1)

    def create_database(self, name: str) -> str:
        """Create database ``name``; its URL."""
        with psycopg.connect(self._dsn("postgres"), autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self, mode: str = "fast", timeout: float = 30.0) -> None:
        """Shut down: ``fast`` (SIGINT: sessions cut, clean) or ``immediate`` (SIGQUIT: a crash,
        recovered from the WAL at the next start); SIGKILL after ``timeout`` s."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGQUIT if mode == "immediate" else signal.SIGINT)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(process)
                process.wait(timeout=10)

    def restart(self, mode: str, down_for: float) -> None:
        """Stop (``mode``), stay down ``down_for`` s, start again."""
        self.stop(mode)
        time.sleep(down_for)
        self.start()


class CeleryProcess:
    """A ``celery -A chaos.app ...`` subprocess with its log file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.process = _spawn(
            [sys.executable, "-m", "celery", "-A", "chaos.app", *args],
            self.log_path,
            env={**os.environ, **env},
        )
        self.pid = self.process.pid

    def alive(self) -> bool:
        """Whether the main process still runs."""
        return self.process.poll() is None

    def log(self) -> str:
        """Everything it printed so far."""
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the whole process group at once (main process and pool): a crashed host."""
        _kill_group(self.process)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (warm shutdown: running tasks finish), then SIGKILL what is left."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


class WorkerProcess(CeleryProcess):
    """``celery worker``, prefork pool of ``concurrency`` processes."""

    def __init__(
        self, name: str, env: dict[str, str], log_dir: Path, concurrency: int, timeout: float
    ) -> None:
        super().__init__(
            name,
            [
                "worker",
                "-P",
                "prefork",
                "-c",
                str(concurrency),
                "-n",
                f"{name}@%h",
                "-l",
                "info",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            env,
            log_dir,
        )
        try:
            wait_for(self._ready, timeout, f"worker {name} ready", pause=0.1)
        except BaseException:
            self.kill()
            raise

    def _ready(self) -> bool:
        if not self.alive():
            raise RuntimeError(f"worker {self.name} exited:\n{self.log()[-3000:]}")
        return b" ready." in self.log_path.read_bytes()

    def child_pids(self) -> list[int]:
        """Pids of its pool processes."""
        out = subprocess.run(
            ["pgrep", "-P", str(self.pid)], capture_output=True, text=True, check=False
        )
        return [int(pid) for pid in out.stdout.split()]


class BeatProcess(CeleryProcess):
    """``celery beat`` (it sends the dead-letter sweep every second), schedule in ``log_dir``."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        super().__init__(
            "beat",
            ["beat", "-l", "info", "-s", str(log_dir / "beat-schedule")],
            env,
            log_dir,
        )


class Cluster:
    """Everything one chaos run starts: Redis, PostgreSQL, two workers and beat.

    ``store`` is ``redis`` or ``postgresql``: where the claims live. The run's Redis is broker
    (db 0) and result backend (db 1), and claim store for ``redis`` (db 1 too, as by default:
    completions then write Celery's result records themselves); the run's
    PostgreSQL holds the dead-letter table, and the claims table for ``postgresql``.
    :meth:`close` stops every process and server, whatever state they are in.
    """

    def __init__(
        self,
        directory: Path,
        store: str,
        ledger_path: Path,
        concurrency: int,
        ready_timeout: float,
    ) -> None:
        self.directory = directory
        self.log_dir = directory / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.concurrency = concurrency
        self.ready_timeout = ready_timeout
        self.workers: list[WorkerProcess] = []
        self.beat: BeatProcess | None = None
        self.redis: RedisServer | None = None
        self.postgres: PostgresServer | None = None
        self._started = 0
        self._store = store
        self._ledger_path = ledger_path
        self.env: dict[str, str] = {}

    def start_servers(self) -> None:
        """Start Redis and PostgreSQL, create the database, and set :attr:`env`."""
        self.redis = RedisServer(self.directory / "redis")
        self.redis.start()
        self.postgres = PostgresServer(self.directory / "postgres")
        self.postgres.start()
        database_url = self.postgres.create_database("chaos")
        self.env = {
            ENV_BROKER_URL: self.redis.url(0),
            ENV_BACKEND_URL: self.redis.url(1),
            ENV_STORE_URL: self.redis.url(1) if self._store == "redis" else database_url,
            ENV_DLQ_URL: database_url,
            ENV_LEDGER: str(self._ledger_path),
        }

    def start_celery(self, workers: int) -> None:
        """Start ``workers`` workers and beat."""
        for _ in range(workers):
            self.start_worker()
        self.beat = BeatProcess(self.env, self.log_dir)

    def start_worker(self) -> WorkerProcess:
        """Start one more worker (named w1, w2 ... in start order) and wait until it is ready."""
        self._started += 1
        worker = WorkerProcess(
            f"w{self._started}", self.env, self.log_dir, self.concurrency, self.ready_timeout
        )
        self.workers.append(worker)
        return worker

    def close(self) -> None:
        """Stop beat, the workers, PostgreSQL and Redis; never raises."""
        stoppers: list[Callable[[], None]] = []
        if self.beat is not None:
            stoppers.append(self.beat.stop)
        # SIGTERM every worker first, so their warm shutdowns overlap.
        for worker in self.workers:
            if worker.alive():
                worker.process.terminate()
        stoppers.extend(worker.stop for worker in self.workers)
        if self.postgres is not None:
            stoppers.append(self.postgres.stop)  # a fast shutdown
        if self.redis is not None:
            stoppers.append(self.redis.stop)
        for stop in stoppers:
            try:
                stop()
            except Exception as exc:  # keep stopping the others
                print(f"chaos: could not stop a process: {exc!r}", file=sys.stderr)
