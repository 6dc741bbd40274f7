"""Statuses and outcomes read as their text, wherever a user prints one."""

from __future__ import annotations

import json

import pytest

from idempotent_tasks.dlq import DeadLetterStatus
from idempotent_tasks.records import CompleteOutcome, Outcome, Status


@pytest.mark.parametrize(
    "member",
    [
        DeadLetterStatus.PERMANENT_FAILURE,
        Status.COMPLETED,
        Outcome.IN_PROGRESS,
        CompleteOutcome.STALE,
    ],
    ids=str,
)
def test_a_member_prints_as_its_value(member: DeadLetterStatus) -> None:
    text = member.value

    assert member == text
    assert str(member) == text
    assert f"{member}" == text and f"[{member:>20}]" == f"[{text:>20}]"
    assert "%s" % member == text  # noqa: UP031  (the logging module's way)
    assert json.dumps({"status": member}) == json.dumps({"status": text})
    assert type(member)(text) is member
