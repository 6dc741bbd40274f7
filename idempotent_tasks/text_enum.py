"""Enums whose members read as their text."""

from __future__ import annotations

import enum


class TextEnum(str, enum.Enum):
    """An enum of text values: a member equals its value, and ``str()``, f-strings and ``%s``
    give that value (``pending``, not ``DeadLetterStatus.PENDING``), as ``enum.StrEnum``
    does from Python 3.11 on."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, format_spec: str) -> str:
        return format(str(self.value), format_spec)
