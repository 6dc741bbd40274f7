"""How IdempotentTask resolves its store, serializer and lease from the app's settings."""

from __future__ import annotations

import json
import ssl
import uuid
import warnings
from pathlib import Path

import pytest
from celery import Celery
from kombu.serialization import register, unregister
from redis.connection import SSLConnection

from idempotent_tasks import IdempotentTask, StoreUnavailable
from idempotent_tasks.app_store import store_for, store_url
from idempotent_tasks.keys import storage_key
from idempotent_tasks.stores import MemoryStore
from idempotent_tasks.stores.redis import RedisStore
from idempotent_tasks.stores.sql import SqlStore
from idempotent_tasks.task import KEY_HEADER


def _app(**conf: object) -> Celery:
    app = Celery("t", set_as_current=False, broker="memory://")
    app.conf.update(conf)
    return app


def test_store_defaults_to_the_redis_result_backend() -> None:
    app = _app(result_backend="redis://127.0.0.1:6379/3")
    assert store_url(app) == "redis://127.0.0.1:6379/3"


def test_explicit_store_url_wins_over_the_backend() -> None:
    app = _app(result_backend="redis://127.0.0.1:6379/3", idempotency_store_url="memory://")
    assert isinstance(store_for(app), MemoryStore)


def test_store_without_a_redis_backend_is_a_local_sqlite_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IDEMPOTENT_TASKS_DATA_DIR", str(tmp_path))
    app = _app(result_backend="cache+memory://")
    assert store_url(app) == f"sqlite:///{tmp_path / 'claims.sqlite3'}"
    store = store_for(app)
    assert isinstance(store, SqlStore)
    store.close()


def test_store_is_built_once_per_process() -> None:
    app = _app(idempotency_store_url="memory://")
    assert store_for(app) is store_for(app)


def test_unknown_store_scheme_is_a_clear_error() -> None:
    app = _app(idempotency_store_url="mongodb://x")
    with pytest.raises(ValueError, match="no store for scheme 'mongodb'"):
        store_for(app)


def test_cached_results_use_json_unless_the_task_says_otherwise() -> None:
    app = _app()

    @app.task(base=IdempotentTask, shared=False)
    def plain() -> None: ...

    assert plain._codec.serializer == "json"


def test_task_serializer_pickle_falls_back_to_json_without_the_opt_in() -> None:
    app = _app()

    @app.task(base=IdempotentTask, serializer="pickle", shared=False)
    def pickled() -> None: ...

    assert pickled._codec.serializer == "json"


def test_pickle_is_used_when_the_app_opts_in() -> None:
    app = _app(idempotency_allow_pickle=True)

    @app.task(base=IdempotentTask, serializer="pickle", shared=False)
    def pickled() -> None: ...

    assert pickled._codec.serializer == "pickle"
    assert pickled._codec.allow_unsafe


@pytest.mark.parametrize(("setting", "allowed"), [("false", False), ("no", False), ("True", True)])
def test_a_pickle_opt_in_given_as_text_is_read_as_celery_reads_text(
    setting: str, allowed: bool
) -> None:
    # An environment variable's "false" is no opt-in (bool("false") would be)
    app = _app(idempotency_allow_pickle=setting)

    @app.task(base=IdempotentTask, serializer="pickle", shared=False)
    def pickled() -> None: ...

    assert pickled._codec.serializer == ("pickle" if allowed else "json")
    assert pickled._codec.allow_unsafe is allowed


def test_a_pickle_opt_in_that_is_no_yes_or_no_is_refused() -> None:
    app = _app(idempotency_store_url="memory://", idempotency_allow_pickle="sometimes")

    @app.task(base=IdempotentTask, serializer="pickle", shared=False)
    def pickled() -> None: ...

    with pytest.raises(ValueError, match="idempotency_allow_pickle must be true or false"):
        pickled.apply_async(idempotency_key="k")


def test_a_serializer_not_installed_here_falls_back_to_json() -> None:
    app = _app(idempotency_result_serializer="not-installed-here")

    @app.task(base=IdempotentTask, shared=False)
    def plain() -> None: ...

    assert plain._codec.serializer == "json"


@pytest.mark.parametrize("size", ["1MiB", -1, 1.5, float("inf"), float("nan")])
def test_a_result_size_limit_that_is_no_number_of_bytes_is_refused_before_publishing(
    size: object,
) -> None:
    app = _app(idempotency_store_url="memory://", idempotency_result_max_bytes=size)

    @app.task(base=IdempotentTask, shared=False)
    def plain(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="idempotency_result_max_bytes must be a whole number"):
        plain.apply_async((1,), idempotency_key="k")


def test_a_tasks_own_safe_serializer_caches_its_results() -> None:
    # Given a serializer of the app's own in kombu's registry (JSON, tagged), set on a task
    name = f"tagged-{uuid.uuid4().hex[:8]}"
    content_type = f"application/x-{name}"
    register(
        name,
        lambda value: "tagged:" + json.dumps(value),
        lambda data: json.loads(bytes(data).removeprefix(b"tagged:")),
        content_type=content_type,
        content_encoding="utf-8",
    )
    try:
        app = _app(idempotency_store_url="memory://", result_backend="cache+memory://")

        @app.task(base=IdempotentTask, serializer=name, shared=False)
        def totals(n: int) -> dict[str, int]:
            return {"total": n * 2}

        # When a keyed call runs, and a duplicate of it
        assert totals.apply((21,), headers={KEY_HEADER: "k"}).get() == {"total": 42}
        again = totals.apply((21,), headers={KEY_HEADER: "k"}).get()
        # Then the cached value was written with the task's serializer and read back with it
        record = store_for(app).get(storage_key(totals.name, "k"))
        assert record is not None and record.result is not None
        assert record.result.content_type == content_type
        assert bytes(record.result.body).startswith(b"tagged:")
        assert again == {"total": 42}
    finally:
        unregister(name)


def test_a_subclass_with_a_request_class_not_ours_is_warned_of_what_it_loses() -> None:
    from celery.worker.request import Request

    from idempotent_tasks.worker_request import IdempotentRequest

    class OwnRequest(Request):  # type: ignore[misc]
        pass

    class KeepsHandling(IdempotentRequest):
        pass

    with pytest.warns(UserWarning, match="IdempotentRequest"):

        class Loses(IdempotentTask):
            Request = OwnRequest

    with pytest.warns(UserWarning, match="IdempotentRequest"):

        class LosesByName(IdempotentTask):
            Request = "celery.worker.request:Request"

    with warnings.catch_warnings():
        warnings.simplefilter("error")

        class Keeps(IdempotentTask):
            Request = KeepsHandling

        class Inherits(Keeps):
            pass


def test_a_task_name_the_tables_cannot_keep_is_refused_when_the_task_is_made() -> None:
    app = _app()

    def body() -> None:
        return None

    # (the app builds a task class when first used, as a worker or producer does at start)
    # (not shared: a shared one would be built again by every app finalized later)
    assert app.task(base=IdempotentTask, name="n" * 255, shared=False)(body).name == "n" * 255
    with pytest.raises(ValueError, match="256 characters long; an IdempotentTask's may have"):
        _ = app.task(base=IdempotentTask, name="n" * 256, shared=False)(body).name


def test_the_default_store_connects_as_the_redis_backend_does() -> None:
    # Given a Redis result backend reached over TLS, as a user, with settings beside its URL
    app = _app(
        result_backend="rediss://backend.example:6380/3?ssl_cert_reqs=CERT_REQUIRED",
        redis_username="shop",
        redis_password="secret",
    )
    # Then the store it defaults to uses them too, with its own timeouts
    store = store_for(app)
    assert isinstance(store, RedisStore)
    settings = store.client.connection_pool.connection_kwargs
    assert (settings["host"], settings["port"], settings["db"]) == ("backend.example", 6380, 3)
    assert (settings["username"], settings["password"]) == ("shop", "secret")
    assert store.client.connection_pool.connection_class is SSLConnection
    assert settings["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    assert settings["socket_timeout"] == 5


def test_a_redis_store_redis_py_cannot_connect_as_configured_is_unavailable() -> None:
    # redis-py refuses the flag Celery's own message asks for in a URL, when it connects
    store = RedisStore.from_url(
        "rediss://127.0.0.1:6379/0?ssl_cert_reqs=CERT_REQUIRED", prefix="tls"
    )
    with pytest.raises(StoreUnavailable, match="cannot be used"):
        store.get("k")
