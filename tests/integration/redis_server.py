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

import redis


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(
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
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

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
