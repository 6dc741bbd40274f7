"""Connections to a database that stopped answering fail in seconds, not in a quarter of an hour.

A network partition, or a firewall or NAT that dropped an idle connection without a word,
leaves a statement waiting for a reply that never comes: TCP gives up after about fifteen
minutes of retransmissions, and with no data in flight it never does. Meanwhile a task's claim,
or the lease keeper's renewal of every running task's lease in the process, waits with it, and
the lease lapses while its owner lives. So every TCP connection to PostgreSQL or MariaDB sends
keepalives once it has heard nothing for a while, and gives up on data unacknowledged for too
long. A live server's kernel answers keepalives however long its statement runs (a lock wait),
so a slow statement is never cut short: only a silent peer is.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

#: Seconds of silence on a connection before its first keepalive.
KEEPALIVE_IDLE_SECONDS = 10
#: Seconds between keepalives while none is answered.
KEEPALIVE_INTERVAL_SECONDS = 5
#: Keepalives left unanswered before the connection counts as dead.
KEEPALIVE_COUNT = 3
#: Milliseconds data sent may stay unacknowledged before the connection counts as dead.
TCP_USER_TIMEOUT_MS = 20_000

#: libpq's name of TCP_USER_TIMEOUT came with libpq 12.
_LIBPQ_TCP_USER_TIMEOUT_SINCE = 120000


def libpq_liveness_args(driver: str, query: Mapping[str, Any]) -> dict[str, Any]:
    """libpq connection parameters for a PostgreSQL ``driver`` on libpq, except those the URL's
    ``query`` sets itself."""
    wanted: dict[str, Any] = {
        "keepalives": 1,
        "keepalives_idle": KEEPALIVE_IDLE_SECONDS,
        "keepalives_interval": KEEPALIVE_INTERVAL_SECONDS,
        "keepalives_count": KEEPALIVE_COUNT,
    }
    if _libpq_version(driver) >= _LIBPQ_TCP_USER_TIMEOUT_SINCE:
        wanted["tcp_user_timeout"] = TCP_USER_TIMEOUT_MS
    return {name: value for name, value in wanted.items() if name not in query}


def watch_pymysql_socket(connection: Any, _record: Any) -> None:
    """SQLAlchemy ``connect`` listener: the same keepalives and timeout on a new PyMySQL
    connection's TCP socket (PyMySQL has no parameter for them; it turns keepalives on with
    the system's two-hour wait)."""
    sock = getattr(connection, "_sock", None)
    if not isinstance(sock, socket.socket) or sock.family not in (
        socket.AF_INET,
        socket.AF_INET6,
    ):
        return  # a Unix socket: no network in between
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_SECONDS),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_SECONDS),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
        ("TCP_USER_TIMEOUT", TCP_USER_TIMEOUT_MS),
    ):
        if hasattr(socket, option):  # Linux has them all; other systems some
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _libpq_version(driver: str) -> int:
    """The libpq version ``driver`` runs on (as 170004), or 0 when it cannot say."""
    try:
        if driver == "psycopg":
            import psycopg

            return int(psycopg.pq.version())
        if driver == "psycopg2":
            import psycopg2.extensions  # type: ignore[import-untyped]

            return int(psycopg2.extensions.libpq_version())
    except (ImportError, AttributeError):
        pass
    return 0
