"""Fixtures shared by every test layer."""

from __future__ import annotations

import os

import pytest

REDIS_URL = os.environ.get("IT_REDIS_URL", "redis://127.0.0.1:6379")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """Base URL of the Redis server the tests use (checked to answer)."""
    from tests.services import require

    require("Redis")
    return REDIS_URL
