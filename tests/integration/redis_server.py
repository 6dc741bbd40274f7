"""A Redis server of a test's own, on a free loopback port, that the test may restart; Redis
holding writes for a while."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import redis


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


#: Ports a new server tries, each free when picked, before it gives up.
STARTS_ON_NEW_PORTS = 3


class ServerExited(RuntimeError):
    """The server exited before it answered (its port taken, say)."""


class RedisServer:
    """``redis-server`` in the foreground of a subprocess; ``persistent`` turns AOF on, and
    ``options`` are more of its command-line options."""

    def __init__(self, directory: Path, persistent: bool, options: tuple[str, ...] = ()) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.directory = directory
        self.persistent = persistent
        self.options = options
        self.process: subprocess.Popen[bytes] | None = None
        for _ in range(STARTS_ON_NEW_PORTS - 1):
            self._on_new_port()
            try:
                self.start()
                return
            except ServerExited:
                continue  # the port, free a moment ago, was taken meanwhile: another one
        self._on_new_port()
        self.start()

    def _on_new_port(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start it on its port (a restart keeps it: clients know it); ``ServerExited`` when
        it exits before answering. Its output goes to ``redis-<port>.log`` in its folder."""
        with (self.directory / f"redis-{self.port}.log").open("ab") as log:
            self.process = self._spawn(log)
        client = redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise ServerExited(
                        f"redis-server on port {self.port} exited with {self.process.returncode}"
                        f"; see {self.directory}/redis-{self.port}.log"
                    )
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError):
                    time.sleep(0.05)
        finally:
            client.close()
        self.stop()  # never left running unwaited (a ResourceWarning in a later test)
        raise RuntimeError(f"redis-server on port {self.port} did not answer within 10 s")

    def _spawn(self, log: IO[bytes]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
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
                "yes" if self.persistent else "no",
                "--appendfsync",
                "always",
                *self.options,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:  # busy in a script, it takes no SIGTERM
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def restart(self, down_for: float = 0.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()


@contextmanager
def writes_held(client: redis.Redis, seconds: float) -> Iterator[None]:
    """Make ``client``'s Redis server hold every write (scripts included) for ``seconds``
    from now (``CLIENT PAUSE … WRITE``), and take the pause back when the block ends."""
    client.execute_command("CLIENT", "PAUSE", str(int(seconds * 1000)), "WRITE")
    try:
        yield
    finally:
        client.execute_command("CLIENT", "UNPAUSE")
