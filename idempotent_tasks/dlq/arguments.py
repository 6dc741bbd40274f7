"""A failed task's arguments as the dead-letter table's JSON columns keep them, and back; its
error as the table's text keeps it."""

from __future__ import annotations

import json
from typing import Any

from kombu.utils import json as kombu_json


def stored_arguments(
    args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any], *, exact: bool = False
) -> tuple[list[Any], dict[str, Any], bool]:
    """The arguments as plain JSON, and whether they are kept faithfully.

    Values Celery's JSON carries (datetimes, dates, times, decimals, UUIDs, bytes) are kept in
    kombu's typed form and come back as themselves from :func:`restored_arguments`; tuples
    come back as lists, as JSON messages carry them. With ``exact`` (a call whose serializer
    keeps more than JSON: pickle), arguments that do not come back equal (a tuple, a dict with
    other keys than text) are kept, but said not to be faithful. Anything
    else (a pickle-serialized task's objects, an RQ job's, a NaN or an infinity, which
    database JSON refuses) is kept as its ``repr``: such a row cannot be retried from the
    table, only read. So is text with a lone surrogate (a file name's undecodable byte), which
    database JSON refuses too: it is kept with that character written out (``\\udcff``).
    """
    try:
        kept = as_table_json([list(args), dict(kwargs)])
        faithful = not exact or _reads_back_equal(kept, [list(args), dict(kwargs)])
        return list(kept[0]), dict(kept[1]), faithful
    except (TypeError, ValueError):
        pass
    try:
        text = json.dumps([list(args), dict(kwargs)], default=safe_repr, allow_nan=False)
        kept = _utf8_only(json.loads(text))
        return list(kept[0]), dict(kept[1]), False
    except (TypeError, ValueError):
        # Keys JSON cannot have (a tuple), or a value that holds itself: each argument whole.
        return (
            [safe_repr(arg) for arg in args],
            {str(name): safe_repr(value) for name, value in kwargs.items()},
            False,
        )


def _reads_back_equal(kept: Any, value: Any) -> bool:
    try:
        return bool(from_table_json(kept) == value)
    except Exception:  # a value whose __eq__ fails: nothing says it reads back
        return False


def as_table_json(value: Any) -> Any:
    """``value`` as the table's JSON columns keep it: Celery's JSON types (datetimes,
    decimals, UUIDs, bytes) in kombu's typed form, which :func:`from_table_json` reads back.

    Raises:
        TypeError, ValueError: for what database JSON cannot hold: a value JSON has no form
            for, a NaN or an infinity (PostgreSQL's JSON, MariaDB's check), text that is not
            UTF-8 (a lone surrogate: ``UnicodeEncodeError`` is a ``ValueError``).
    """
    kept = json.loads(kombu_json.dumps(value))  # type: ignore[no-untyped-call]
    json.dumps(kept, allow_nan=False, ensure_ascii=False).encode("utf-8")
    return kept


def from_table_json(value: Any) -> Any:
    """What :func:`as_table_json` kept, typed values as themselves again."""
    return kombu_json.loads(json.dumps(value))  # type: ignore[no-untyped-call]


def utf8_text(text: str) -> str:
    """``text`` with every character UTF-8 cannot hold (a lone surrogate, a file name's
    undecodable byte) written out, as ``\\udcff``: no database refuses it."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _utf8_only(value: Any) -> Any:
    """``value`` (parsed JSON) with every character UTF-8 cannot hold written out."""
    if isinstance(value, str):
        return utf8_text(value)
    if isinstance(value, list):
        return [_utf8_only(item) for item in value]
    if isinstance(value, dict):
        return {_utf8_only(name): _utf8_only(item) for name, item in value.items()}
    return value


def safe_repr(value: Any) -> str:
    """``repr(value)``, or a placeholder naming its type when its ``__repr__`` fails."""
    try:
        return repr(value)
    except Exception:
        return f"<{type(value).__name__} object; repr() failed>"


def restored_arguments(args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """The arguments :func:`stored_arguments` kept, typed values as themselves again.

    Raises:
        ArgumentsUnreadable: a value in kombu's typed form that does not read back (a row
            edited by hand, say): no later try would read it either.
    """
    try:
        restored = from_table_json([args, kwargs])
        return list(restored[0]), dict(restored[1])
    except Exception as exc:
        raise ArgumentsUnreadable(f"its arguments cannot be read back: {exc!r}") from exc


class ArgumentsUnreadable(ValueError):
    """A dead letter's stored arguments do not read back as the call's arguments."""


def error_text(exc: BaseException) -> str:
    """``str(exc)``; a placeholder when the exception's ``__str__`` itself fails."""
    try:
        return str(exc)
    except Exception:
        return f"<{type(exc).__name__}; str() failed>"


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s text (its type's name when it has none), for a message of
    one line."""
    return (error_text(exc).strip().splitlines() or [type(exc).__name__])[0]
