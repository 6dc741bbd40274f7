"""The SQL store and the dead-letter table across a real network partition (see
``tests/network_partition.py``): a call to a database gone silent fails closed in seconds, as
the Redis store's does by its socket timeout, instead of hanging until TCP gives up (about a
quarter of an hour, while a lease lapses under a live owner), and the next call after the
partition heals reconnects."""

from __future__ import annotations

import select
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from idempotent_tasks.dlq import liveness
from idempotent_tasks.dlq.engine import create_dlq_engine
from tests.network_partition import Partition, partitionable

from .conftest import store_url

ROOT = Path(__file__).resolve().parents[2]
#: Seconds a step may take: the client's shortened waits (a 2 s TCP user timeout, a 2 s connect
#: timeout for the reconnect) and then some. Without them a step across the partition waits
#: until it heals.
STEP_SECONDS = 15


def _line(client: subprocess.Popen[str], seconds: float) -> str:
    """The client's next line, or a failure naming what it printed if none comes in time."""
    assert client.stdout is not None
    ready, _, _ = select.select([client.stdout], [], [], seconds)
    if not ready:
        pytest.fail(f"the client said nothing for {seconds} s: a call hangs across the partition")
    line = client.stdout.readline().strip()
    if not line:
        client.wait(5)
        assert client.stderr is not None
        pytest.fail(f"the client ended: {client.stderr.read()}")
    return line


def _step(client: subprocess.Popen[str]) -> str:
    assert client.stdin is not None
    client.stdin.write("\n")
    client.stdin.flush()
    return _line(client, STEP_SECONDS)


@pytest.mark.parametrize("kind", ["postgresql", "mariadb"])
def test_a_database_gone_silent_fails_each_call_in_seconds_and_the_healed_one_reconnects(
    kind: str, request: pytest.FixtureRequest
) -> None:
    url = make_url(store_url(kind, request))
    with partitionable() as partition:
        # Given a client in a namespace of its own, whose store holds a claim and whose
        # dead-letter table answered, over a link this test can cut
        forwarded = url.set(host=partition.host_address, port=partition.forward(url.port or 0))
        if kind == "mariadb":
            # (PyMySQL's own connect timeout, 10 s, is the URL's to set: libpq's the client sets)
            forwarded = forwarded.update_query_dict({"connect_timeout": "2"})
        client = _start_client(partition, forwarded.render_as_string(hide_password=False))
        try:
            assert _line(client, 60) == "ready"
            # When the link drops every packet (no reset, nothing acknowledged)
            partition.cut()
            # Then a lease renewal and a dead-letter read each fail closed, in seconds
            assert _seconds(_step(client), "extend failed StoreUnavailable") < STEP_SECONDS
            assert _seconds(_step(client), "stats failed StoreUnavailable") < STEP_SECONDS
            # And once it heals, the next calls reconnect: the claim is still the client's
            partition.heal()
            assert _seconds(_step(client), "extend True") < STEP_SECONDS
            assert _seconds(_step(client), "stats True") < STEP_SECONDS
            assert client.wait(10) == 0
        finally:
            partition.heal()
            client.kill()
            client.communicate()  # reaped, its pipes closed


def _start_client(partition: Partition, url: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        partition.command(sys.executable, "-m", "tests.contract.partitioned_client", url),
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _seconds(line: str, expected: str) -> float:
    """The seconds a step line (``<what> in <seconds> s``) reports, once its ``what`` is
    ``expected``."""
    what, _, took = line.rpartition(" in ")
    assert what == expected, line
    return float(took.removesuffix(" s"))


def test_a_postgresql_url_setting_its_own_keepalives_keeps_them(
    request: pytest.FixtureRequest,
) -> None:
    url = store_url("postgresql", request)
    engine = create_dlq_engine(f"{url}?keepalives_idle=60&tcp_user_timeout=90000")
    try:
        with engine.connect() as connection:
            parameters = connection.connection.dbapi_connection.info.get_parameters()  # type: ignore[union-attr]
    finally:
        engine.dispose()
    assert parameters["keepalives_idle"] == "60"
    assert parameters["tcp_user_timeout"] == "90000"
    assert parameters["keepalives_interval"] == str(liveness.KEEPALIVE_INTERVAL_SECONDS)
    assert parameters["keepalives_count"] == str(liveness.KEEPALIVE_COUNT)


def test_a_pymysql_connection_has_the_keepalives_and_user_timeout_on_its_socket(
    request: pytest.FixtureRequest,
) -> None:
    engine = create_dlq_engine(store_url("mariadb", request))
    try:
        with engine.connect() as connection:
            sock = connection.connection.dbapi_connection._sock  # type: ignore[union-attr]
            options = {
                name: sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, name))
                for name in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT", "TCP_USER_TIMEOUT")
            }
            keepalive = sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
    finally:
        engine.dispose()
    assert keepalive == 1
    assert options == {
        "TCP_KEEPIDLE": liveness.KEEPALIVE_IDLE_SECONDS,
        "TCP_KEEPINTVL": liveness.KEEPALIVE_INTERVAL_SECONDS,
        "TCP_KEEPCNT": liveness.KEEPALIVE_COUNT,
        "TCP_USER_TIMEOUT": liveness.TCP_USER_TIMEOUT_MS,
    }
