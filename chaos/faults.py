"""What a chaos run injects, and when: a seeded plan, carried out by the driver's main thread.

Faults are placed at random points of the workload (fractions of the keys published, drawn
from the run's seeded RNG), so a seed gives the same plan however fast the machine is. Every
fault is written to the ledger with the pids and time windows the audit needs to explain a body
that started twice.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass

from chaos import LEASE_S
from chaos.ledger import Ledger
from chaos.services import Cluster, WorkerProcess

#: Faults of a full run (10 000 keys); smaller runs get proportionally fewer, at least one each.
FULL_RUN_TASKS = 10_000
FULL_RUN_FAULTS = {
    "kill_worker": 3,  # SIGKILL a whole worker (main process and pool), start a new one
    "kill_child": 2,  # SIGKILL one pool process (its worker replaces it)
    "freeze_child": 2,  # SIGSTOP one pool process for longer than the lease, then SIGCONT
    "restart_redis": 3,  # broker, result backend and (--store redis) claim store
    "restart_postgres": 2,  # dead-letter table and (--store postgresql) claim store
}
#: Faults happen between these fractions of the keys published.
WINDOW = (0.05, 0.9)


@dataclass(frozen=True, kw_only=True)
class PlannedFault:
    """One fault, due once ``at`` (a fraction) of the keys have been published."""

    at: float
    kind: str


def plan_faults(tasks: int, rng: random.Random) -> list[PlannedFault]:
    """The run's faults in the order they are due."""
    scale = tasks / FULL_RUN_TASKS
    planned = [
        PlannedFault(at=rng.uniform(*WINDOW), kind=kind)
        for kind, count in FULL_RUN_FAULTS.items()
        for _ in range(max(1, round(count * scale)))
    ]
    return sorted(planned, key=lambda fault: fault.at)


class FaultInjector:
    """Carries out due faults on a :class:`~chaos.services.Cluster`, recording each."""

    def __init__(
        self, cluster: Cluster, ledger: Ledger, rng: random.Random, plan: list[PlannedFault]
    ) -> None:
        self.cluster = cluster
        self.ledger = ledger
        self.rng = rng
        self.pending = list(plan)
        self.done: list[dict[str, object]] = []

    def run_due(self, progress: float) -> bool:
        """Inject the next fault if it is due at ``progress`` (0..1); whether one ran."""
        if not self.pending or self.pending[0].at > progress:
            return False
        fault = self.pending.pop(0)
        started = time.time()
        details = getattr(self, f"_{fault.kind}")()
        record = {"fault": fault.kind, "at": started, "until": time.time(), **details}
        self.done.append(record)
        self.ledger.write("fault", **record)
        return True

    # -- the faults -----------------------------------------------------------------------

    def _kill_worker(self) -> dict[str, object]:
        worker = self.rng.choice(self._live_workers())
        children = worker.child_pids()
        killed_at = time.time()
        worker.kill()
        self.cluster.workers.remove(worker)
        replacement = self.cluster.start_worker()
        return {
            "worker": worker.name,
            "pid": worker.pid,
            "children": children,
            "killed_at": killed_at,
            "replacement": replacement.name,
        }

    def _kill_child(self) -> dict[str, object]:
        worker, pid = self._busy_child()
        killed_at = time.time()
        _signal(pid, signal.SIGKILL)
        return {"worker": worker.name, "pid": pid, "killed_at": killed_at}

    def _freeze_child(self) -> dict[str, object]:
        worker, pid = self._busy_child()
        frozen_for = self.rng.uniform(LEASE_S + 1.0, LEASE_S + 3.0)
        frozen_at = time.time()
        _signal(pid, signal.SIGSTOP)
        try:
            time.sleep(frozen_for)
        finally:
            _signal(pid, signal.SIGCONT)
        return {"worker": worker.name, "pid": pid, "frozen_at": frozen_at, "thawed_at": time.time()}

    def _restart_redis(self) -> dict[str, object]:
        assert self.cluster.redis is not None
        down_for = self.rng.uniform(0.2, 1.0)
        stopped_at = time.time()
        self.cluster.redis.restart(down_for)
        return {"down_from": stopped_at, "down_until": time.time()}

    def _restart_postgres(self) -> dict[str, object]:
        assert self.cluster.postgres is not None
        mode = self.rng.choice(["fast", "immediate"])
        down_for = self.rng.uniform(0.2, 1.0)
        stopped_at = time.time()
        self.cluster.postgres.restart(mode, down_for)
        return {"mode": mode, "down_from": stopped_at, "down_until": time.time()}

    # -- choosing a victim ----------------------------------------------------------------

    def _live_workers(self) -> list[WorkerProcess]:
        live = [worker for worker in self.cluster.workers if worker.alive()]
        if not live:
            raise RuntimeError("no live worker to inject a fault into")
        return live

    def _busy_child(self) -> tuple[WorkerProcess, int]:
        """A pool process, preferably one in the middle of a body (per the ledger)."""
        children = {pid: worker for worker in self._live_workers() for pid in worker.child_pids()}
        if not children:
            raise RuntimeError("no pool process to inject a fault into")
        open_bodies: dict[int, str] = {}
        for event in self.ledger.events(last=2000):
            if event.kind == "start":
                open_bodies[event.pid] = event.exec_id or ""
            elif event.kind in ("finish", "fail") and open_bodies.get(event.pid) == event.exec_id:
                del open_bodies[event.pid]
        busy = sorted(pid for pid in open_bodies if pid in children)
        pid = self.rng.choice(busy) if busy else self.rng.choice(sorted(children))
        return children[pid], pid


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
