"""Cached results: safe serializers, size limit, unserializable values."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
from kombu import serialization

from idempotent_tasks.codec import ResultCodec
from idempotent_tasks.errors import CorruptRecord
from idempotent_tasks.records import EncodedResult


def test_json_round_trip() -> None:
    codec = ResultCodec(serializer="json", max_bytes=1024)
    encoded, reason = codec.encode({"charge_id": "ch_1", "amount": 990})
    assert reason is None
    assert encoded is not None
    assert encoded.content_type == "application/json"
    assert codec.decode(encoded) == {"charge_id": "ch_1", "amount": 990}


def test_result_over_the_limit_is_not_cached() -> None:
    codec = ResultCodec(serializer="json", max_bytes=100)
    encoded, reason = codec.encode("x" * 200)
    assert encoded is None
    assert reason is not None and "100-byte limit" in reason


def test_unserializable_result_is_not_cached() -> None:
    codec = ResultCodec(serializer="json", max_bytes=1024)
    encoded, reason = codec.encode(object())
    assert encoded is None
    assert reason is not None and "not serializable" in reason


def test_pickle_is_refused_without_the_opt_in() -> None:
    with pytest.raises(ValueError, match="idempotency_allow_pickle"):
        ResultCodec(serializer="pickle", max_bytes=1024)


def test_pickled_record_is_not_loaded_without_the_opt_in() -> None:
    pickled = ResultCodec(serializer="pickle", max_bytes=1024, allow_unsafe=True)
    encoded, _ = pickled.encode({"a": 1})
    assert encoded is not None
    assert pickled.decode(encoded) == {"a": 1}
    safe = ResultCodec(serializer="json", max_bytes=1024)
    with pytest.raises(CorruptRecord, match="does not accept"):
        safe.decode(encoded)


def test_undecodable_bytes_are_a_corrupt_record() -> None:
    codec = ResultCodec(serializer="json", max_bytes=1024)
    broken = EncodedResult(content_type="application/json", content_encoding="utf-8", body=b"{")
    with pytest.raises(CorruptRecord, match="cannot be decoded"):
        codec.decode(broken)


def test_a_serializer_not_installed_here_caches_as_json() -> None:
    codec = ResultCodec(serializer="not-installed-here", max_bytes=1000)
    encoded, reason = codec.encode({"a": 1})
    assert reason is None and encoded is not None
    assert encoded.content_type == "application/json" and codec.decode(encoded) == {"a": 1}


def test_raw_caches_bytes_as_they_are_and_anything_else_as_json() -> None:
    codec = ResultCodec(serializer="raw", max_bytes=1000)
    encoded, _ = codec.encode(b"\x00\x01")
    assert encoded is not None and codec.decode(encoded) == b"\x00\x01"
    # bytes(5) would be five NULs: a duplicate would get them instead of 5
    encoded, _ = codec.encode(5)
    assert encoded is not None and encoded.content_type == "application/json"
    assert codec.decode(encoded) == 5


@pytest.fixture
def strict_serializer() -> Iterator[str]:
    """A serializer that refuses what plain JSON refuses, as msgpack refuses a datetime."""
    serialization.register(  # type: ignore[no-untyped-call]
        "strict",
        json.dumps,
        json.loads,
        content_type="application/x-strict",
        content_encoding="utf-8",
    )
    try:
        yield "strict"
    finally:
        serialization.registry.unregister("strict")  # type: ignore[no-untyped-call]


def test_a_value_the_serializer_refuses_is_cached_as_json(strict_serializer: str) -> None:
    codec = ResultCodec(serializer=strict_serializer, max_bytes=1000)
    when = datetime(2026, 11, 28, 1, 2, 3, tzinfo=timezone.utc)
    encoded, reason = codec.encode({"sent_at": when})
    assert reason is None and encoded is not None
    assert encoded.content_type == "application/json"
    assert codec.decode(encoded) == {"sent_at": when}
    # what it takes stays in its own serializer
    encoded, _ = codec.encode({"n": 1})
    assert encoded is not None and encoded.content_type == "application/x-strict"
    assert codec.decode(encoded) == {"n": 1}


def test_a_value_neither_serializer_takes_names_the_task_serializer(strict_serializer: str) -> None:
    encoded, reason = ResultCodec(serializer=strict_serializer, max_bytes=1000).encode(object())
    assert encoded is None
    assert reason is not None and reason.startswith("result is not serializable with strict:")


def test_a_value_that_would_not_decode_back_is_not_cached() -> None:
    codec = ResultCodec(serializer="json", max_bytes=1000)
    # Looks like kombu's marker of a datetime, and is none: every duplicate would fail on it
    encoded, reason = codec.encode({"__type__": "datetime", "__value__": "soon"})
    assert encoded is None
    assert reason is not None and reason.startswith("result would not decode back")
    # A real datetime, marked the same way, is cached and comes back
    when = datetime(2026, 11, 27, 16, 0, tzinfo=timezone.utc)
    encoded, _ = codec.encode({"when": when})
    assert encoded is not None and codec.decode(encoded) == {"when": when}


def test_a_record_no_serializer_here_reads_is_a_corrupt_record() -> None:
    # A content type a plugin registered on the host that cached it: kombu would hand the
    # encoded text back as if it were the value
    codec = ResultCodec(serializer="json", max_bytes=1000)
    foreign = EncodedResult(
        content_type="application/x-elsewhere", content_encoding="utf-8", body=b"\x81\xa1a"
    )
    with pytest.raises(CorruptRecord, match="no serializer registered here reads"):
        codec.decode(foreign)


def test_a_record_whose_serializer_is_not_installed_here_is_a_corrupt_record() -> None:
    # Registered, but its library missing here (kombu's yaml without PyYAML, say)
    from kombu import serialization
    from kombu.exceptions import SerializerNotInstalled

    def missing(_: Any) -> Any:
        raise SerializerNotInstalled("No decoder installed for x-missing")

    serialization.register(
        "x-missing", lambda value: b"", missing, "application/x-missing", "utf-8"
    )
    try:
        codec = ResultCodec(serializer="json", max_bytes=1000)
        record = EncodedResult(
            content_type="application/x-missing", content_encoding="utf-8", body=b"a: 1"
        )
        with pytest.raises(CorruptRecord, match="not installed here"):
            codec.decode(record)
    finally:
        serialization.registry.unregister("x-missing")
