"""How ``celery -A proj idempotency ...`` prints dead letters, key records and counts."""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import pprint
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from .dlq import DeadLetter
from .records import Record, Status

#: Width a table cell is cut to (full values are in ``show`` and ``--json``).
MAX_CELL_CHARS = 48


def to_json(value: Any) -> str:
    """``value`` as indented JSON: datetimes in ISO 8601, enums as their values."""
    return json.dumps(value, indent=2, default=_json_default, ensure_ascii=False)


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(value).decode("ascii")}
    return repr(value)


def from_timestamp(seconds: float) -> datetime:
    """A store's POSIX seconds as a timezone-aware UTC datetime; a moment past the last one a
    datetime holds (a TTL of thousands of years) as that last one."""
    latest = datetime.max.replace(tzinfo=timezone.utc)
    return (
        latest
        if seconds >= latest.timestamp()
        else datetime.fromtimestamp(seconds, tz=timezone.utc)
    )


def moment(value: datetime | None) -> str:
    """A moment in UTC to the second, or ``-``."""
    if value is None:
        return "-"
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def moment_from_now(value: datetime | None, now: datetime) -> str:
    """A moment in UTC with how far it is from ``now``: ``... UTC (in 4m 10s)``."""
    if value is None:
        return "-"
    seconds = (value - now).total_seconds()
    gap = span(abs(seconds))
    return f"{moment(value)} UTC ({f'in {gap}' if seconds >= 0 else f'{gap} ago'})"


#: Units of :func:`span`, largest first.
SPAN_UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))


def span(seconds: float) -> str:
    """``3d 4h``, ``2h``, ``4m 10s`` or ``7s``: the largest unit and, unless zero, the next."""
    whole = int(seconds)
    last = len(SPAN_UNITS) - 1
    index = next((i for i, (_, size) in enumerate(SPAN_UNITS) if whole >= size), last)
    unit, size = SPAN_UNITS[index]
    text = f"{whole // size}{unit}"
    if index < last:
        smaller, smaller_size = SPAN_UNITS[index + 1]
        if rest := whole % size // smaller_size:
            text += f" {rest}{smaller}"
    return text


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart; long cells are cut with ``…``."""
    cells = [[_cut(cell) for cell in row] for row in rows]
    widths = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)]
    lines = [headers, *cells]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def _cut(cell: str) -> str:
    cell = cell.replace("\n", " ")
    return cell if len(cell) <= MAX_CELL_CHARS else cell[: MAX_CELL_CHARS - 1] + "…"


def fields(pairs: Sequence[tuple[str, str]]) -> str:
    """``label  value`` lines with aligned values; a value's further lines are indented too."""
    width = max(len(label) for label, _ in pairs)
    lines = []
    for label, value in pairs:
        first, *rest = value.splitlines() or [""]
        lines.append(f"{label.ljust(width)}  {first}".rstrip())
        lines.extend(f"{' ' * (width + 2)}{line}".rstrip() for line in rest)
    return "\n".join(lines)


# -- dead letters ---------------------------------------------------------------------------

DEAD_LETTER_HEADERS = (
    "ID",
    "TASK",
    "STATUS",
    "RETRIES",
    "NEXT RETRY (UTC)",
    "ERROR",
    "CREATED (UTC)",
)


def dead_letter_row(item: DeadLetter) -> list[str]:
    """One dead letter as a row under :data:`DEAD_LETTER_HEADERS`."""
    return [
        item.id,
        item.task_name,
        item.status.value,
        f"{item.retry_count}/{item.max_retries}",
        moment(item.next_retry_at),
        item.error_type,
        moment(item.created_at),
    ]


def dead_letter_json(item: DeadLetter) -> dict[str, Any]:
    """Every field of a dead letter, as ``--json`` prints it."""
    return dataclasses.asdict(item)


def dead_letter_detail(item: DeadLetter, now: datetime) -> str:
    """Every field of a dead letter, one per line, the traceback last."""
    return fields(
        [
            ("id", item.id),
            ("task", item.task_name),
            ("app", item.scope or "-"),
            ("task id", item.task_id),
            ("failure id", item.failure_id),
            ("idempotency key", item.idempotency_key if item.idempotency_key is not None else "-"),
            ("status", item.status.value),
            ("retries", f"{item.retry_count}/{item.max_retries}"),
            ("next retry", moment_from_now(item.next_retry_at, now)),
            ("sweep id", item.sweep_id or "-"),
            ("created", moment_from_now(item.created_at, now)),
            ("updated", moment_from_now(item.updated_at, now)),
            ("error type", item.error_type),
            ("error message", item.error_message),
            ("args", _compact_json(item.args)),
            ("kwargs", _compact_json(item.kwargs)),
            ("options", _compact_json(item.options)),
            ("traceback", (item.traceback or "-").rstrip()),
        ]
    )


def _compact_json(value: Any) -> str:
    return json.dumps(value, default=_json_default, ensure_ascii=False)


def stats_text(counts: dict[str, int]) -> str:
    """Counts by status, the total last."""
    total = counts.get("total", 0)
    pairs = [(status, str(count)) for status, count in counts.items() if status != "total"]
    return fields([*pairs, ("total", str(total))])


# -- key records ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodedResult:
    """A record's cached result as the CLI shows it: the value, or why it cannot be shown."""

    value: Any = None
    error: str | None = None


def record_json(record: Record, decoded: DecodedResult) -> dict[str, Any]:
    """A key's record as ``--json`` prints it (the result decoded, not its bytes)."""
    return {
        "key": record.key,
        "task_name": record.task_name,
        "storage_key": record.storage_key,
        "status": record.status,
        "task_id": record.task_id,
        "owner": record.owner,
        "token": record.token,
        "lease_expires_at": from_timestamp(record.lease_expires_at),
        "created_at": from_timestamp(record.created_at),
        "updated_at": from_timestamp(record.updated_at),
        "expires_at": from_timestamp(record.expires_at),
        "fingerprint": record.fingerprint,
        "result_cached": record.result_cached,
        "result_content_type": record.result.content_type if record.result else None,
        "result": decoded.value,
        "result_error": decoded.error,
    }


def record_detail(record: Record, decoded: DecodedResult, now: datetime) -> str:
    """A key's record, one field per line, the decoded result last."""
    if record.result is not None:
        cached = f"yes ({record.result.content_type}, {len(record.result.body)} bytes)"
        shown = (
            f"(cannot be shown: {decoded.error})"
            if decoded.error
            else pprint.pformat(decoded.value, width=80)
        )
    else:
        cached, shown = "no", "-"
    if record.status is Status.PROCESSING:
        lease = moment_from_now(from_timestamp(record.lease_expires_at), now)
    elif record.status is Status.QUEUED:
        due = moment_from_now(from_timestamp(record.lease_expires_at), now)
        lease = f"- (queued; published again {due} if no worker claims it)"
    else:
        lease = "- (no lease once completed)"
    return fields(
        [
            ("key", record.key),
            ("task", record.task_name),
            ("storage key", record.storage_key),
            ("status", record.status.value),
            ("owner task id", record.task_id),
            ("owner", record.owner),
            ("token", str(record.token)),
            ("lease expires", lease),
            ("created", moment_from_now(from_timestamp(record.created_at), now)),
            ("updated", moment_from_now(from_timestamp(record.updated_at), now)),
            ("expires", moment_from_now(from_timestamp(record.expires_at), now)),
            ("fingerprint", record.fingerprint),
            ("result cached", cached),
            ("result", shown),
        ]
    )
