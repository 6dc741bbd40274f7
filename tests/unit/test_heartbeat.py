"""The process's lease keeper: one thread renewing every running attempt's lease."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from idempotent_tasks import heartbeat, signals
from idempotent_tasks.codec import ResultCodec
from idempotent_tasks.core import Attempt
from idempotent_tasks.errors import StoreUnavailable
from idempotent_tasks.heartbeat import LeaseKeeper
from idempotent_tasks.records import ClaimRequest, Outcome
from idempotent_tasks.stores import MemoryStore
from tests.claim_requests import claim_request


def test_every_registered_lease_is_renewed_until_removed() -> None:
    keeper = LeaseKeeper()
    renewals = {"a": 0, "b": 0}

    def renewer(name: str):  # type: ignore[no-untyped-def]
        def renew() -> bool:
            renewals[name] += 1
            return True

        return renew

    started = time.monotonic()
    first = keeper.add(renewer("a"), lambda: None, lease_seconds=0.3)  # every 0.1 s
    second = keeper.add(renewer("b"), lambda: None, lease_seconds=0.6)  # every 0.2 s
    deadline = started + 10
    while renewals["b"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    keeper.remove(first)
    keeper.remove(second)
    elapsed = time.monotonic() - started
    seen = dict(renewals)
    # Each renewed at its own pace: never sooner than its interval (a busy machine may make
    # it later, never earlier), the shorter one at least as often
    assert seen["b"] >= 3
    assert seen["a"] <= elapsed / 0.1 + 1
    assert seen["b"] <= elapsed / 0.2 + 1
    assert seen["a"] >= seen["b"]
    time.sleep(0.3)
    assert renewals == seen  # nothing renewed after removal


def test_a_lost_lease_is_reported_once_and_dropped() -> None:
    keeper = LeaseKeeper()
    lost = threading.Event()
    calls = []

    def renew() -> bool:
        calls.append(1)
        return False

    keeper.add(renew, lost.set, lease_seconds=0.15)
    assert lost.wait(2)
    time.sleep(0.2)
    assert len(calls) == 1


def test_a_renewal_failing_after_removal_is_not_reported() -> None:
    # The attempt finished (and completed its key) while a renewal was under way.
    keeper = LeaseKeeper()
    lost = threading.Event()
    started, finish = threading.Event(), threading.Event()
    lease = None

    def renew() -> bool:
        started.set()
        finish.wait(2)
        return False

    lease = keeper.add(renew, lost.set, lease_seconds=0.15)
    assert started.wait(2)
    keeper.remove(lease)
    finish.set()
    time.sleep(0.1)
    assert not lost.is_set()


def test_a_renewal_that_raises_is_retried() -> None:
    keeper = LeaseKeeper()
    attempts = []

    def renew() -> bool:
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionError("store restarting")
        return True

    lease = keeper.add(renew, lambda: None, lease_seconds=0.15)
    deadline = time.monotonic() + 10
    while len(attempts) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    keeper.remove(lease)
    assert len(attempts) >= 2


def test_a_lease_whose_removal_was_interrupted_is_dropped_once_no_longer_held() -> None:
    # remove() marks the lease finished, then takes it out of the set: an exception raised
    # between the two (a soft time limit, say) must not leave it renewed for ever.
    keeper = LeaseKeeper()
    lost = threading.Event()
    calls = []

    def renew() -> bool:
        calls.append(1)
        return False  # the attempt released its claim

    lease = keeper.add(renew, lost.set, lease_seconds=0.15)
    lease.finished = True  # remove() got this far only
    time.sleep(0.4)
    assert len(calls) <= 1  # at most a renewal under way when it was marked
    assert lease not in keeper._leases
    time.sleep(0.3)
    assert len(calls) <= 1  # never renewed again
    assert not lost.is_set()  # and not reported lost: its attempt had finished


def test_a_forked_child_renews_its_own_leases_only_even_if_the_lock_was_held() -> None:
    keeper = LeaseKeeper()
    parent_renewals = []
    keeper.add(lambda: parent_renewals.append(1) or True, lambda: None, lease_seconds=0.15)
    read, write = os.pipe()
    with keeper._lock:  # another thread of the parent holds it at the fork
        pid = os.fork()
        if pid == 0:  # the child: report how its keeper behaves, then exit at once
            signal.alarm(5)  # a child stuck on the parent's lock dies instead of hanging
            try:
                renewed = threading.Event()
                lease = keeper.add(lambda: renewed.set() or True, lambda: None, 0.15)
                ok = renewed.wait(2) and len(keeper._leases) == 1
                keeper.remove(lease)
                os.write(write, b"ok" if ok else b"no")
            finally:
                os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    answer = os.read(read, 2)
    os.close(read)
    assert answer == b"ok"
    assert os.waitstatus_to_exitcode(status) == 0


def _claimed_attempt(store: MemoryStore, lease_seconds: float) -> Attempt:
    """An attempt that claimed key ``k`` of task ``t`` in ``store``."""
    request = claim_request(owner="owner-1", lease_seconds=lease_seconds)
    attempt = Attempt(
        store=store, request=request, codec=ResultCodec(serializer="json", max_bytes=1024)
    )
    assert attempt.claim().outcome is Outcome.ACQUIRED
    return attempt


def test_an_attempt_that_gave_its_key_up_while_its_body_runs_reports_no_lost_lease() -> None:
    # Given a running attempt (0.3 s lease: renewed every 0.1 s) that releases its key for a
    # retry while still inside its body (as retry() does before Celery publishes)
    store = MemoryStore()
    attempt = _claimed_attempt(store, lease_seconds=0.3)
    lost: list[object] = []

    def count(**message: object) -> None:
        lost.append(message)

    signals.lease_lost.connect(count)
    try:
        with attempt.heartbeat():
            assert attempt.release() is True
            time.sleep(0.35)  # renewals come due, and find the claim gone
    finally:
        signals.lease_lost.disconnect(count)
    # Then that is no takeover: nothing is reported lost
    assert lost == []
    assert attempt.lost is False


def test_a_renewal_that_fails_is_tried_again_within_seconds_not_a_third_of_the_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a lease of 30 s (renewed every 10 s) whose first renewal meets a store that is down
    monkeypatch.setattr(heartbeat, "RETRY_AFTER_ERROR", 0.2)
    clock = _FastClock()
    keeper = LeaseKeeper(clock=clock)
    calls: list[float] = []

    def renew() -> bool:
        calls.append(clock())
        if len(calls) == 1:
            raise StoreUnavailable("down")
        return True

    lease = keeper.add(renew, lambda: None, lease_seconds=30)
    clock.skip(10)  # the first renewal is due
    keeper._wake.set()
    # Then the next try comes RETRY_AFTER_ERROR later, not 10 s later
    deadline = time.monotonic() + 5
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    keeper.remove(lease)
    assert len(calls) >= 2
    assert calls[1] - calls[0] < 5


class _FastClock:
    """Monotonic time that a test can move on at once."""

    def __init__(self) -> None:
        self._skipped = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self._skipped

    def skip(self, seconds: float) -> None:
        self._skipped += seconds


class _StoreDownForRenewals(MemoryStore):
    """A memory store whose first ``failures`` renewals find it out of reach."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures
        self.renewals: list[float] = []

    def extend(self, request: ClaimRequest, token: int) -> bool:
        self.renewals.append(time.monotonic())
        if len(self.renewals) <= self.failures:
            raise StoreUnavailable("connection refused")
        return super().extend(request, token)


def test_an_attempts_renewal_that_meets_a_store_down_is_tried_again_soon(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a running attempt with a 6 s lease (renewed every 2 s) whose store is out of
    # reach for its first two renewals
    monkeypatch.setattr(heartbeat, "RETRY_AFTER_ERROR", 0.05)
    store = _StoreDownForRenewals(failures=2)
    attempt = _claimed_attempt(store, lease_seconds=6.0)
    with attempt.heartbeat():
        deadline = time.monotonic() + 10
        while len(store.renewals) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    # Then each failed renewal was tried again RETRY_AFTER_ERROR later, not a third of the
    # lease later (when two failures would have let the lease run out)
    first, second, third = store.renewals[:3]
    assert second - first < 1.0
    assert third - second < 1.0
    assert "lease of key 'k': connection refused" in caplog.text
    assert attempt.lost is False
