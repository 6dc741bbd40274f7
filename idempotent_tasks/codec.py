"""Serializing cached results through kombu's serializer registry, safely."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kombu import serialization
from kombu.exceptions import ContentDisallowed, DecodeError, EncodeError, SerializerNotInstalled

from .errors import CorruptRecord
from .records import EncodedResult

logger = logging.getLogger(__name__)

#: Serializers that can run code when loading, used only when the app opts in.
UNSAFE_SERIALIZERS = frozenset({"pickle", "application/x-python-serialize"})
#: What kombu's "raw" serializer (no serializer) writes: read back as the bytes or text.
_RAW_CONTENT_TYPES = frozenset({"application/data", "application/text"})
#: What a result the codec's serializer refuses is cached with, when it can be.
FALLBACK_SERIALIZER = "json"
#: The key of kombu's JSON type markers (datetime, Decimal, UUID, bytes ...).
_TYPE_MARKER = b'"__type__"'


def serializer_installed(serializer: str) -> bool:
    """Whether kombu can encode with ``serializer`` here (yaml needs PyYAML, say)."""
    try:
        serialization.dumps("", serializer)  # type: ignore[no-untyped-call]
    except SerializerNotInstalled:
        return False
    except Exception:  # installed, only not for this probe
        return True
    return True


@dataclass(frozen=True, kw_only=True)
class ResultCodec:
    """Encodes task results for the store and decodes cached ones.

    Args:
        serializer: a name in kombu's registry (``"json"``, ``"msgpack"``, ``"yaml"`` ...).
        max_bytes: encoded results larger than this are not cached.
        allow_unsafe: whether pickle may be used (the app's explicit opt-in).
    """

    serializer: str
    max_bytes: int
    allow_unsafe: bool = False

    def __post_init__(self) -> None:
        if self.serializer in UNSAFE_SERIALIZERS and not self.allow_unsafe:
            raise ValueError(
                "cached results are never pickled unless the app opts in with "
                "app.conf.idempotency_allow_pickle = True"
            )

    def encode(self, value: Any) -> tuple[EncodedResult | None, str | None]:
        """Return the encoded value, or ``None`` and the reason it cannot be cached: it cannot
        be serialized, is too big, or would not decode back to a value.

        A value the codec's serializer refuses (msgpack and a ``datetime``, say) is cached as
        JSON when JSON takes it: the record names its content type, so duplicates read it
        back all the same, where they would otherwise get ``None``.
        """
        try:
            data, content_type, encoding = self._dump(value, self.serializer)
        except Exception as exc:  # any serializer's error, a plugin's or one not installed
            reason = f"result is not serializable with {self.serializer}: {exc}"
            if self.serializer == FALLBACK_SERIALIZER:
                return None, reason
            try:
                data, content_type, encoding = self._dump(value, FALLBACK_SERIALIZER)
            except Exception:
                return None, reason
        if len(data) > self.max_bytes:
            return None, f"result is {len(data)} bytes, over the {self.max_bytes}-byte limit"
        encoded = EncodedResult(content_type=content_type, content_encoding=encoding, body=data)
        if _TYPE_MARKER in encoded.body:
            # kombu's JSON reads {"__type__": ..., "__value__": ...} back as the type it names:
            # a value that only looks like one would fail every duplicate.
            try:
                self.decode(encoded)
            except CorruptRecord as exc:
                return None, f"result would not decode back: {exc}"
        return encoded, None

    @staticmethod
    def _dump(value: Any, serializer: str) -> tuple[bytes, str, str]:
        """``value`` encoded with ``serializer``: its bytes, content type and encoding."""
        content_type, encoding, body = serialization.dumps(value, serializer)  # type: ignore[no-untyped-call]
        data = body.encode("utf-8") if isinstance(body, str) else body
        if not isinstance(data, bytes | bytearray | memoryview):
            # kombu's "raw" passes anything else through: bytes(5) would be five NULs.
            raise EncodeError(f"it gave {type(data).__name__}, not bytes")
        return bytes(data), content_type, encoding

    def decode(self, encoded: EncodedResult) -> Any:
        """Decode a cached result, refusing pickle unless the app opted in."""
        accept = {encoded.content_type}
        if encoded.content_type in UNSAFE_SERIALIZERS and not self.allow_unsafe:
            accept = set()
        elif (
            encoded.content_type not in _RAW_CONTENT_TYPES
            and encoded.content_type not in serialization.registry.type_to_name
        ):
            # kombu would hand the encoded text back as if it were the value.
            raise CorruptRecord(
                f"cached result has content type {encoded.content_type!r}, which no serializer "
                "registered here reads"
            )
        try:
            return serialization.loads(  # type: ignore[no-untyped-call]
                encoded.body, encoded.content_type, encoded.content_encoding, accept=accept
            )
        except ContentDisallowed as exc:
            raise CorruptRecord(
                f"cached result has content type {encoded.content_type!r}, which this app "
                "does not accept"
            ) from exc
        except SerializerNotInstalled as exc:
            raise CorruptRecord(
                f"cached result has content type {encoded.content_type!r}, whose serializer "
                f"is not installed here: {exc}"
            ) from exc
        except (DecodeError, ValueError, TypeError) as exc:
            raise CorruptRecord(f"cached result cannot be decoded: {exc}") from exc
