"""Where a keyed call's CPU goes, process by process, measured apart from one another.

The throughput benchmark (``benchmarks.run``) runs producer and worker at once on shared CPUs,
so each party's CPU per call moves with the others'. This one separates them: it publishes N
calls with no worker running (the producer's CPU per publish), then starts a prefork worker that
drains them (CPU per task of its main process, of its pool processes, and of Redis meanwhile),
for each implementation in turn, round after round::

    python -m benchmarks.drain [--n 5000] [--repeat 3] [--impls late idempotent]

Redis's figure while draining counts what the worker makes it do (for IdempotentTask the claim
and the completion); the reservation's share is Redis's work at publish, not counted here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from . import cpu
from .app import IMPLEMENTATIONS, counter_client, runs_key
from .produce import publish
from .run import RESULTS, flush_bench_dbs, worker

#: Calls published and drained before the counted ones: imports, connections, scripts loaded.
WARMUP = 50


@dataclass(frozen=True)
class Drained:
    """CPU microseconds per call of one implementation's publish and drain."""

    impl: str
    publish: float
    worker_main: float
    pool: float
    redis: float
    tasks_per_s: float


def publish_all(impl: str, n: int) -> float:
    """Publish ``n`` calls of ``impl`` (after a warm-up), as the throughput benchmark's
    producer does, and return the CPU µs per publish."""
    for item in range(WARMUP):
        publish(impl, 1_000_000 + item, f"drain-warmup-{item}")
    results = []  # kept, as a caller keeps them: dropping one ends its result subscription
    started = time.process_time()
    for item in range(n):
        results.append(publish(impl, item, f"drain-{item}"))
    return (time.process_time() - started) / n * 1e6


def drain(impl: str, n: int, timeout: float) -> Drained:
    """Publish, then start a worker and measure it while it drains the queue."""
    flush_bench_dbs()
    publish = publish_all(impl, n)
    counter = counter_client()
    total = n + WARMUP
    log = RESULTS / "logs" / f"drain-{impl}.log"
    with worker(log, concurrency=2, env=dict(os.environ), ready_timeout=60) as worker_pid:
        deadline = time.monotonic() + timeout
        # Counted from the first call run, once the pool processes are up and busy.
        while _runs(counter, impl) < WARMUP:
            _check(deadline)
            time.sleep(0.01)
        done_before, started = _runs(counter, impl), time.monotonic()
        before = cpu.snapshot(worker_pid, counter)
        while (done_after := _runs(counter, impl)) < total:
            _check(deadline)
            time.sleep(0.02)
        after, seconds = cpu.snapshot(worker_pid, counter), time.monotonic() - started
    used, calls = cpu.used(before, after), done_after - done_before
    return Drained(
        impl=impl,
        publish=publish,
        worker_main=used["worker_main"] / calls * 1e6,
        pool=used["pool"] / calls * 1e6,
        redis=used["redis"] / calls * 1e6,
        tasks_per_s=calls / seconds,
    )


def _runs(counter: Any, impl: str) -> int:
    return int(counter.get(runs_key(impl)) or 0)


def _check(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError("the worker did not drain the queue in time")


def table(rows: list[Drained]) -> str:
    """The measurements as a markdown table, one row per implementation and round."""
    lines = [
        "| implementation | publish, µs | worker main, µs | pool, µs | Redis, µs | drained/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.impl} | {row.publish:.0f} | {row.worker_main:.0f} | {row.pool:.0f} | "
            f"{row.redis:.0f} | {row.tasks_per_s:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, measure every implementation in each round and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000, help="calls per measurement")
    parser.add_argument("--repeat", type=int, default=3, help="rounds")
    parser.add_argument(
        "--impls", nargs="+", choices=IMPLEMENTATIONS, default=["late", "idempotent"]
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per drain")
    args = parser.parse_args(argv)
    rows = []
    for round_ in range(1, args.repeat + 1):
        for impl in args.impls:
            row = drain(impl, args.n, args.timeout)
            rows.append(row)
            print(
                f"round {round_} {impl:12s} publish {row.publish:5.0f} µs  main "
                f"{row.worker_main:5.0f} µs  pool {row.pool:5.0f} µs  redis {row.redis:5.0f} µs",
                flush=True,
            )
    print()
    print("CPU per call (publish: the producer's; the rest while a -c 2 worker drains):")
    print()
    print(table(rows))
    flush_bench_dbs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
