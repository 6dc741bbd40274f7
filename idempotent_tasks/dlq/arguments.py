"""A failed task's arguments as the dead-letter table's JSON columns keep them, and back."""

from __future__ import annotations

import json
from typing import Any

from kombu.utils import json as kombu_json


def stored_arguments(
    args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, Any], bool]:
    """The arguments as plain JSON, and whether they are kept faithfully.

    Values Celery's JSON carries (datetimes, dates, times, decimals, UUIDs, bytes) are kept in
    kombu's typed form and come back as themselves from :func:`restored_arguments`. Anything
    else (a pickle-serialized task's objects, an RQ job's) is kept as its ``repr``: such a row
    cannot be retried from the table, only read.
    """
    try:
        kept = json.loads(kombu_json.dumps([list(args), dict(kwargs)]))  # type: ignore[no-untyped-call]
        return list(kept[0]), dict(kept[1]), True
    except (TypeError, ValueError):
        kept = json.loads(json.dumps([list(args), dict(kwargs)], default=repr))
        return list(kept[0]), dict(kept[1]), False


def restored_arguments(args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """The arguments :func:`stored_arguments` kept, typed values as themselves again."""
    restored = kombu_json.loads(json.dumps([args, kwargs]))  # type: ignore[no-untyped-call]
    return list(restored[0]), dict(restored[1])
