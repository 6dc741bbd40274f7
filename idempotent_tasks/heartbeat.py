"""A background thread per process that renews the leases of every running attempt (and,
in a keeper of its own, the rows of re-published dead letters while they run).

A thread per task would cost a thread start and join on every execution; this one sleeps until
the earliest renewal is due. A forked child starts with no leases (they are its parent's) and
restarts the thread lazily: threads do not survive a fork.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

#: Renew each lease this many times per lease period. A renewal that fails (the store down) is
#: tried again every RETRY_AFTER_ERROR seconds, so a lease lapses only when the store stays out
#: of reach for about two thirds of it.
RENEWALS_PER_LEASE = 3
#: Never renew more often than this (seconds), however short the lease.
MIN_INTERVAL = 0.05
#: A renewal that failed (the store or database down) is tried again this soon (seconds), or
#: at its usual interval when that is sooner.
RETRY_AFTER_ERROR = 5.0


@dataclass(eq=False)
class Lease:
    """A running attempt's lease: ``renew`` returns whether the claim is still held."""

    renew: Callable[[], bool]
    on_lost: Callable[[], None]
    interval: float
    next_due: float = 0.0
    finished: bool = field(default=False)


class LeaseKeeper:
    """Renews registered leases from a single daemon thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._leases: set[Lease] = set()
        self._thread: threading.Thread | None = None
        self._pid = 0
        #: When the thread will next look at its leases (monotonic seconds).
        self._wakes_at = 0.0
        reset = weakref.WeakMethod(self._forget_parent)
        os.register_at_fork(after_in_child=lambda: (method := reset()) and method())

    def _forget_parent(self) -> None:
        """In a forked child: the parent's leases, thread and lock (perhaps held by a thread
        that did not survive the fork) are the parent's."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._leases = set()
        self._thread = None
        self._wakes_at = 0.0

    def add(
        self, renew: Callable[[], bool], on_lost: Callable[[], None], lease_seconds: float
    ) -> Lease:
        """Start renewing a lease of ``lease_seconds``; returns the handle to remove it."""
        interval = max(lease_seconds / RENEWALS_PER_LEASE, MIN_INTERVAL)
        lease = Lease(
            renew=renew, on_lost=on_lost, interval=interval, next_due=self._clock() + interval
        )
        with self._lock:
            self._leases.add(lease)
            self._ensure_thread()
            # Wake the thread only when this lease is due before it would wake anyway: waking
            # it for every task would cost a context switch per task.
            wake = lease.next_due < self._wakes_at
        if wake:
            self._wake.set()
        return lease

    def remove(self, lease: Lease) -> None:
        """Stop renewing; a renewal already under way is then ignored."""
        lease.finished = True
        with self._lock:
            self._leases.discard(lease)

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
            return
        self._pid = os.getpid()
        self._wakes_at = 0.0
        self._thread = threading.Thread(target=self._run, name="idempotency-leases", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                now = self._clock()
                # A finished lease still here had its remove() interrupted half-way.
                self._leases = {lease for lease in self._leases if not lease.finished}
                due = [lease for lease in self._leases if lease.next_due <= now]
                for lease in due:
                    lease.next_due = now + lease.interval
                self._wakes_at = min((lease.next_due for lease in self._leases), default=now + 60)
                wait = self._wakes_at - now
            for lease in due:
                self._renew(lease)
            if not due:
                self._wake.wait(max(wait, 0.0))
                self._wake.clear()

    def _renew(self, lease: Lease) -> None:
        try:
            held = lease.renew()
        except Exception as exc:
            logger.warning("could not renew a lease; will try again: %s", exc)
            retry_at = self._clock() + min(lease.interval, RETRY_AFTER_ERROR)
            with self._lock:
                if retry_at < lease.next_due:
                    lease.next_due = retry_at
                    self._wakes_at = min(self._wakes_at, retry_at)
            return
        if not held:
            finished = lease.finished
            self.remove(lease)
            if not finished:
                lease.on_lost()


#: The keeper of this process.
keeper = LeaseKeeper()
