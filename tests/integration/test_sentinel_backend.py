"""The default store of an app whose Celery result backend is Redis behind Sentinel: the
master the Sentinels name, reached as the backend reaches it (not a local SQLite file per
host, where duplicates on two hosts would both run)."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path
from typing import IO

import pytest
import redis
from celery import Celery
from redis.sentinel import Sentinel

from idempotent_tasks.app_store import store_for, store_url
from idempotent_tasks.records import Outcome
from idempotent_tasks.stores.redis import RedisStore
from tests.claim_requests import claim_request
from tests.integration.redis_server import RedisServer

MASTER_NAME = "shop"


class SentinelServer(RedisServer):
    """A Redis Sentinel (``redis-server --sentinel``) watching one master."""

    def __init__(self, directory: Path, master_port: int) -> None:
        self.master_port = master_port
        super().__init__(directory, persistent=False)

    def _spawn(self, log: IO[bytes]) -> subprocess.Popen[bytes]:
        config = self.directory / f"sentinel-{self.port}.conf"  # Sentinel rewrites its own
        config.write_text(
            f"bind 127.0.0.1\nport {self.port}\ndir {self.directory}\n"
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master_port} 1\n"
        )
        return subprocess.Popen(
            [self.binary, str(config), "--sentinel"], stdout=log, stderr=subprocess.STDOUT
        )


def test_a_sentinel_result_backend_gives_the_store_the_master_it_names(tmp_path: Path) -> None:
    # Given a Redis master watched by a Sentinel, and an app whose result backend is it
    (tmp_path / "master").mkdir()
    (tmp_path / "sentinel").mkdir()
    master = RedisServer(tmp_path / "master", persistent=False)
    sentinel = SentinelServer(tmp_path / "sentinel", master.port)
    app = Celery("sentinel", set_as_current=False, broker="memory://")
    app.conf.result_backend = f"sentinel://127.0.0.1:{sentinel.port}/3"
    app.conf.result_backend_transport_options = {"master_name": MASTER_NAME}
    store = None
    try:
        # When the app's store is built, and a key is claimed through it
        assert store_url(app) == app.conf.result_backend
        store = store_for(app)
        assert isinstance(store, RedisStore)
        key = f"order-{uuid.uuid4().hex[:8]}"
        request = claim_request(
            key=key,
            task_name="charge",
            storage_key=key,
            task_id="t-1",
            owner="o-1",
        )
        assert store.claim(request).outcome is Outcome.ACQUIRED
        # (its Sentinels asked with the store's timeouts, not the OS's minutes)
        pool = store.client.connection_pool
        asked = pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs
        assert (asked["socket_connect_timeout"], asked["socket_timeout"]) == (2, 5)
        # Then the claim is on the master the Sentinel names, in the backend's database
        on_master = redis.Redis(port=master.port, db=3)
        try:
            assert on_master.exists(store.names(key)[0]) == 1
        finally:
            on_master.close()
    finally:
        if store is not None:
            store.close()
        app.backend.client.close()
        sentinel.stop()
        master.stop()


@pytest.mark.parametrize(
    ("url", "pool_class"),
    [
        ("redis+socket:///run/redis.sock", "ConnectionPool"),
        ("sentinel://127.0.0.1:1/0", "SentinelConnectionPool"),
    ],
)
def test_every_redis_result_backend_is_the_default_stores(url: str, pool_class: str) -> None:
    # Nothing connects here: the store is built as the backend would reach its server, but
    # for the backend's cap on its own pool (the store keeps a connection for its scripts)
    app = Celery("schemes", set_as_current=False, broker="memory://", backend=url)
    app.conf.result_backend_transport_options = {"master_name": MASTER_NAME}
    app.conf.redis_max_connections = 1
    assert store_url(app) == url
    store = store_for(app)
    assert isinstance(store, RedisStore)
    pool = store.client.connection_pool
    assert type(pool).__name__ == pool_class
    assert app.backend.connparams.get("max_connections") == 1
    assert pool.max_connections > 1


def test_a_sentinel_store_pushes_no_message_for_a_broker_behind_sentinel() -> None:
    # Given a store on the master of one Sentinel service, and a broker on another service's
    # master: their pools look alike (no host, the default port), their servers need not be
    app = Celery("sentinel-broker", set_as_current=False, broker="memory://")
    app.conf.result_backend = "sentinel://127.0.0.1:1/3"
    app.conf.result_backend_transport_options = {"master_name": "results"}
    store = store_for(app)
    assert isinstance(store, RedisStore)
    broker_pool = Sentinel([("127.0.0.1", 1)]).master_for("broker").connection_pool
    # Then the store never takes the broker's list for one of its own server's (its script
    # would push the message where no worker reads it)
    assert not store.same_server(broker_pool)
    assert not store.same_server(store.client.connection_pool)
