"""Checks that the services the tests need answer, with how to start each when one does not."""

from __future__ import annotations

import socket

import pytest

START_COMMANDS = {
    "Redis": 'redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no',
    "PostgreSQL": "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
    "MariaDB": "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd",
    "RabbitMQ": "rabbitmq-server -detached",
}
PORTS = {"Redis": 6379, "PostgreSQL": 5432, "MariaDB": 3306, "RabbitMQ": 5672}


def answers(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def require(service: str) -> None:
    """Fail (never skip) the calling test when ``service`` is down, saying how to start it."""
    if not answers(PORTS[service]):
        pytest.fail(
            f"{service} is not answering on 127.0.0.1:{PORTS[service]}; start it with:\n"
            f"    {START_COMMANDS[service]}\n(.ci/run starts it for you)",
            pytrace=False,
        )
