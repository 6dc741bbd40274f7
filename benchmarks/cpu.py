"""CPU seconds used by each party of a measurement: producer, worker main process, pool, Redis.

On 2 cores every party competes for the same CPUs, so CPU per call explains throughput better
than wall time alone. Worker figures come from Linux's ``/proc``; elsewhere they read as 0.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import redis

PARTIES = ("producer", "worker_main", "pool", "redis")
#: The whole machine's busy CPU seconds (all processes): the rest is other load.
MACHINE = "machine"
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _process_cpu(pid: int) -> tuple[float, int]:
    """(user + system CPU seconds, parent pid) of a process from ``/proc/<pid>/stat``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0, 0
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICKS, int(fields[1])


def _machine_busy() -> float:
    """Busy CPU seconds of the whole machine since boot, from ``/proc/stat`` (0 elsewhere)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle, iowait = fields[3], fields[4] if len(fields) > 4 else 0
    guest = sum(fields[8:10])  # already counted in user and nice
    return (sum(fields) - idle - iowait - guest) / _TICKS


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (the prefork pool of a worker's main process)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _process_cpu(int(entry.name))[1] == pid:
            children.append(int(entry.name))
    return children


def snapshot(worker_pid: int | None, client: redis.Redis) -> dict[str, float]:
    """Cumulative CPU seconds of each party now (subtract two snapshots for an interval)."""
    info = client.info("cpu")
    worker_main = pool = 0.0
    if worker_pid:
        worker_main = _process_cpu(worker_pid)[0]
        pool = sum(_process_cpu(child)[0] for child in _children(worker_pid))
    return {
        "producer": time.process_time(),
        "worker_main": worker_main,
        "pool": pool,
        "redis": float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
        MACHINE: _machine_busy(),
    }


def used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each party, and the whole machine, used between two snapshots."""
    return {party: after[party] - before[party] for party in (*PARTIES, MACHINE)}
