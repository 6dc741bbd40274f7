"""The owner a key queued for a retry keeps: which message of the call it waits for."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from idempotent_tasks import IdempotentTask
from idempotent_tasks.dead_letters import DEAD_LETTER_HEADER
from idempotent_tasks.records import LATEST_MESSAGE, older_message, retry_marker


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


def test_a_dead_letters_message_claims_as_the_latest_of_its_call() -> None:
    # (its sweep orders it after every earlier message of the call: a key an earlier series
    # left queued for a retry whose message is gone must not hold it back)
    app = Celery("retry-marker", set_as_current=False)
    app.conf.idempotency_store_url = "memory://"

    @app.task(base=IdempotentTask, shared=False)
    def charge(order: str) -> str:
        return order

    def claimed_as(headers: dict[str, Any]) -> int:
        charge.push_request(
            id="t-1", args=["o"], kwargs={}, retries=2, headers=headers, called_directly=False
        )
        try:
            return int(charge._attempt("k", ("o",), {}, charge.request).request.retries)
        finally:
            charge.pop_request()

    assert claimed_as({}) == 2
    assert claimed_as({DEAD_LETTER_HEADER: "17"}) == LATEST_MESSAGE
    assert not older_message(retry_marker(3), LATEST_MESSAGE)
