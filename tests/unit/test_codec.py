"""Cached results: safe serializers, size limit, unserializable values."""

from __future__ import annotations

import pytest

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
