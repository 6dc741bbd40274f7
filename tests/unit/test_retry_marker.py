"""The owner a key queued for a retry keeps: which message of the call it waits for."""

from __future__ import annotations

import pytest

from idempotent_tasks.records import older_message, retry_marker


def test_a_key_queued_for_a_retry_waits_for_a_message_counting_as_many_retries() -> None:
    marker = retry_marker(2)
    assert older_message(marker, 0)
    assert older_message(marker, 1)
    assert not older_message(marker, 2)
    assert not older_message(marker, 3)  # (a retry's retry, its reservation lost: it runs)


def test_a_message_counting_no_retries_waits_for_any() -> None:
    assert retry_marker(0) == ""
    assert not older_message("", 0)


@pytest.mark.parametrize(
    "owner",
    ["retry", "retry ", "retry -1", "retry 1.5", "retry ²", "retry 1 ", "Retry 1", "owner-1"],
)
def test_an_owner_that_is_no_marker_waits_for_no_particular_message(owner: str) -> None:
    # (written by hand, or by another version: the key is not held back for ever)
    assert not older_message(owner, 0)
