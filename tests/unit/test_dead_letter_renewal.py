"""A re-sent dead letter's row renewal, made in the run's own thread before its body: a
database error never fails the run, and the framework's time limit is never taken for one."""

from __future__ import annotations

import logging

import pytest
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded
from rq.timeouts import JobTimeoutException

from idempotent_tasks import dead_letters
from idempotent_tasks.dlq import DeadLetterQueue, renewal
from idempotent_tasks.errors import StoreUnavailable


def _raising(error: BaseException) -> DeadLetterQueue:
    raise error


def test_a_database_error_is_logged_and_the_run_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        held = renewal.renew_retrying(
            lambda: _raising(StoreUnavailable("database down")),
            "row-1",
            "sweep-1",
            SoftTimeLimitExceeded,
        )
    assert held is True
    assert "could not renew dead letter row-1: database down" in caplog.text


@pytest.mark.parametrize("limit", [SoftTimeLimitExceeded, JobTimeoutException])
def test_the_runs_time_limit_firing_during_the_renewal_ends_the_run(
    limit: type[Exception],
) -> None:
    with pytest.raises(limit):
        renewal.renew_retrying(lambda: _raising(limit("time is up")), "row-1", "sweep-1", limit)


def test_celerys_renewal_lets_the_soft_time_limit_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dead_letters, "dlq_for", lambda app: _raising(SoftTimeLimitExceeded()))
    with pytest.raises(SoftTimeLimitExceeded):
        dead_letters.renew_retrying(Celery("renewal"), "row-1", "sweep-1")
