"""Reading the SQL claim store's rows: whether the protocol can decide on them, and the
:class:`~idempotent_tasks.records.Record` they hold.

SQLite keeps whatever is written into a column, so a row may hold text where a number goes;
such a row is a :class:`~idempotent_tasks.errors.CorruptRecord`, never a raw ``TypeError``.
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptRecord
from ..records import EncodedResult, Record, Status
from .sql_statements import COMPLETED, PROCESSING, QUEUED, RELEASED

_STATUSES = frozenset({QUEUED, PROCESSING, COMPLETED, RELEASED})
_NUMBERS = ("token", "lease_expires_at", "created_at", "updated_at", "expires_at")


_PICKUP_NUMBERS = ("timeout", "republished", "due_at")


def is_readable(row: Any) -> bool:
    """Whether the protocol can decide on a claim row: a known status, numbers where numbers
    go (SQLite keeps whatever is written into a column)."""
    return row["status"] in _STATUSES and _numbers_in(row, _NUMBERS)


def readable_claim(where: str, row: Any) -> Any:
    """``row`` (or ``None``), once it is known to be readable; else ``CorruptRecord``."""
    if row is not None and not is_readable(row):
        raise _unreadable("claim", where, row, ("status", *_NUMBERS))
    return row


def readable_pickup(row: Any) -> Any:
    """A pickup row (or ``None``), once it is known to be readable (a binary envelope too);
    else ``CorruptRecord``."""
    if row is not None and not (
        isinstance(row["envelope"], (bytes, bytearray, memoryview))
        and _numbers_in(row, _PICKUP_NUMBERS)
    ):
        raise _unreadable("pickup", row["id"], row, _PICKUP_NUMBERS)
    return row


def _numbers_in(row: Any, names: tuple[str, ...]) -> bool:
    return all(isinstance(row[name], (int, float)) for name in names)


def _unreadable(kind: str, where: str, row: Any, shown: tuple[str, ...]) -> CorruptRecord:
    values = ", ".join(f"{name} {row[name]!r}" for name in shown)
    return CorruptRecord(
        f"{kind} row of {where!r} is unreadable ({values}); `key forget` deletes it"
    )


def is_live(row: Any, now: float) -> bool:
    """Whether a claim row protects its key (released and expired rows do not)."""
    return bool(row["status"] != RELEASED and row["expires_at"] > now)


def record_of(storage_key: str, row: Any, read_at: float | None = None) -> Record:
    """The record a claim row holds, read at ``read_at`` (the store's time); ``CorruptRecord``
    if it cannot be read."""
    try:
        result = None
        if row["result_cached"] and row["result"] is not None:
            result = EncodedResult(
                content_type=row["content_type"],
                content_encoding=row["content_encoding"],
                body=bytes(row["result"]),
            )
        return Record(
            storage_key=storage_key,
            key=row["key"],
            task_name=row["task_name"],
            status=Status(row["status"]),
            owner=row["owner"],
            token=int(row["token"]),
            task_id=row["task_id"],
            fingerprint=row["fingerprint"],
            lease_expires_at=float(row["lease_expires_at"]),
            created_at=float(row["created_at"]),
            updated_at=float(row["updated_at"]),
            expires_at=float(row["expires_at"]),
            result=result,
            result_cached=result is not None,
            read_at=read_at,
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise CorruptRecord(f"claim row of {storage_key!r} is unreadable: {exc}") from exc
