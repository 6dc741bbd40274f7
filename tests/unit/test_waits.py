"""How long a duplicate waits before it looks again at a key in progress."""

from __future__ import annotations

import time

import pytest

from idempotent_tasks import defaults
from idempotent_tasks.core import wait_for_owner
from idempotent_tasks.records import Record, Status


def in_progress(lease_left: float, store_skew: float = 0.0) -> Record:
    """A record read just now from a store whose clock is ``store_skew`` s off this host's,
    its owner's lease ending ``lease_left`` s later by that clock."""
    read_at = time.time() + store_skew
    return Record(
        storage_key="tasks.charge:k",
        key="k",
        task_name="tasks.charge",
        status=Status.PROCESSING,
        owner="owner-1",
        token=1,
        task_id="task-1",
        fingerprint="fp",
        lease_expires_at=read_at + lease_left,
        created_at=read_at,
        updated_at=read_at,
        expires_at=read_at + lease_left + 60,
        read_at=read_at,
    )


def test_waits_double_up_to_the_cap() -> None:
    record = in_progress(lease_left=600)
    waits = [wait_for_owner(record, n) for n in range(8)]
    assert waits[:3] == [
        defaults.WAIT_INITIAL_DELAY,
        defaults.WAIT_INITIAL_DELAY * 2,
        defaults.WAIT_INITIAL_DELAY * 4,
    ]
    assert waits[-1] == defaults.WAIT_MAX_DELAY


def test_a_wait_ends_when_the_owners_lease_does() -> None:
    assert wait_for_owner(in_progress(lease_left=1.0), 10) == pytest.approx(1.0, abs=0.05)
    assert wait_for_owner(in_progress(lease_left=-5.0), 10) == 0.05


@pytest.mark.parametrize("store_skew", [-3600.0, 3600.0])
def test_the_lease_is_judged_by_the_stores_clock_not_the_workers(store_skew: float) -> None:
    # Given a live owner with 30 s of lease left, read from a store whose clock is an hour off
    # this worker's
    record = in_progress(lease_left=30.0, store_skew=store_skew)
    # Then the duplicate waits as for a live owner: neither every 50 ms (a store behind makes
    # every lease look over here) nor past the owner's lease (a store ahead makes it look long)
    assert wait_for_owner(record, 0) == defaults.WAIT_INITIAL_DELAY
    assert wait_for_owner(record, 10) == defaults.WAIT_MAX_DELAY


def test_a_duplicate_that_waited_for_hours_still_waits() -> None:
    # 2.0 ** 1024 overflows a float: a duplicate behind an owner running for hours got there
    assert wait_for_owner(in_progress(lease_left=600), 5000) == defaults.WAIT_MAX_DELAY
