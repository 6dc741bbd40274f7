"""Claim stores, chosen by URL: Redis, any SQLAlchemy database, or ``memory://``."""

from __future__ import annotations

from urllib.parse import urlsplit

from ..urls import shown_url
from .base import Store
from .memory import MemoryStore

__all__ = ["MemoryStore", "Store", "store_from_url"]

#: URL schemes (before any ``+driver``) that name an SQLAlchemy database.
SQL_SCHEMES = frozenset({"postgresql", "postgres", "mysql", "mariadb", "sqlite"})


def store_from_url(url: str, *, prefix: str) -> Store:
    """Build the store ``url`` names; ``prefix`` scopes its keys (server stores only).

    Raises:
        ValueError: for a scheme no store handles.
        ImportError: when the store's optional driver is missing, naming the extra to install.
    """
    scheme = urlsplit(url).scheme.lower()
    if scheme == "memory":
        return MemoryStore()
    if scheme in ("redis", "rediss", "unix"):
        try:
            from .redis import RedisStore
        except ImportError as exc:  # pragma: no cover - redis ships with celery[redis]
            raise ImportError(
                "the Redis store needs redis-py: pip install 'idempotent-tasks[redis]'"
            ) from exc
        return RedisStore.from_url(url, prefix=prefix)
    if scheme.split("+")[0] in SQL_SCHEMES:
        from .sql import SqlStore

        return SqlStore(url, prefix=prefix)
    raise ValueError(
        f"idempotency_store_url {shown_url(url)!r}: no store for scheme {scheme!r} (use redis://, "
        "rediss://, memory:// or an SQLAlchemy URL: postgresql+psycopg://, mysql+pymysql://, "
        "sqlite:///)"
    )
