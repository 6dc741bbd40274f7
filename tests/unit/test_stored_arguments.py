"""How a failed task's arguments are kept in the dead-letter table's JSON columns."""

from __future__ import annotations

import json
import uuid
from datetime import date, datetime, timezone
from decimal import Decimal

from idempotent_tasks.dlq.arguments import restored_arguments, stored_arguments


def test_values_celerys_json_carries_are_kept_faithfully_as_plain_json() -> None:
    args = (datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc), date(2026, 1, 2), b"\x00\xff")
    kwargs = {"amount": Decimal("1.10"), "id": uuid.UUID(int=7), "items": (1, 2)}
    kept_args, kept_kwargs, faithful = stored_arguments(args, kwargs)
    assert faithful
    json.dumps([kept_args, kept_kwargs])  # what the JSON columns take, as they are
    assert kept_kwargs["items"] == [1, 2]
    assert kept_args[0] == {"__type__": "datetime", "__value__": "2026-01-02T03:04:05+00:00"}
    assert restored_arguments(kept_args, kept_kwargs) == (list(args), {**kwargs, "items": [1, 2]})


class Opaque:
    def __repr__(self) -> str:
        return "<Opaque 7>"


def test_other_objects_are_kept_as_text_and_said_to_be() -> None:
    kept_args, kept_kwargs, faithful = stored_arguments((1, Opaque()), {"x": Opaque()})
    assert not faithful
    assert (kept_args, kept_kwargs) == ([1, "<Opaque 7>"], {"x": "<Opaque 7>"})
