"""One measurement's producer: publish N calls, wait for every result, print JSON timings.

``benchmarks.run`` starts a fresh one per measurement (a long-lived producer accumulates unread
result-backend pub/sub replies and stalls)::

    python -m benchmarks.produce --impl idempotent --workload duplicates --n 3000

The clock starts just before the first publish and stops once every call's result is ready.
Calls short-circuited at publish (celery-once's graceful drop, IdempotentTask's cached or
in-progress answer) are ready as soon as ``apply_async`` returns.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from celery import states
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult, EagerResult

from . import cpu
from .app import (
    IMPLEMENTATIONS,
    TASKS,
    app,
    bare_round_trip_key,
    counter_client,
    expected_result,
    runs_key,
    store_db_client,
)

WORKLOADS = ("distinct", "duplicates")
#: Longest single ``.get()`` before looking the result up in the backend directly.
GET_SLICE_SECONDS = 5.0


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What one producer run measured (printed as JSON, read by ``benchmarks.run``)."""

    impl: str
    workload: str
    n: int
    seconds: float
    publish_seconds: float
    tasks_per_s: float
    published: int
    suppressed_at_publish: int
    dropped: int
    wrong_results: int
    pubsub_misses: int
    runs_before: int
    #: CPU seconds each party used while the clock ran (see :mod:`benchmarks.cpu`).
    cpu_seconds: dict[str, float]


def calls(workload: str, n: int, keys: int) -> list[tuple[int, str]]:
    """The ``(item, idempotency key)`` of each call; the same item always has the same key."""
    if workload == "distinct":
        return [(i, f"distinct-{i}") for i in range(n)]
    return [(i % keys, f"dup-{i % keys}") for i in range(n)]


def publish(impl: str, item: int, key: str) -> AsyncResult:
    """Send one call the way a user of ``impl`` would."""
    task = TASKS[impl]
    if impl in ("idempotent", "twotrips"):
        return task.apply_async((item,), idempotency_key=key)
    if impl == "bare3":
        store_db_client().get(bare_round_trip_key(item))  # the publish-side look's round trip
    return task.apply_async((item,))


def wait_for(result: AsyncResult, deadline: float) -> tuple[Any, bool]:
    """Block until ``result`` is ready; returns its value and whether pub/sub missed it."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"task {result.id} not ready before the deadline")
        try:
            return result.get(timeout=min(remaining, GET_SLICE_SECONDS), propagate=False), False
        except CeleryTimeoutError:
            # A reply lost on the pub/sub channel would stall .get() forever: read the key.
            meta = result.backend.get_task_meta(result.id)
            if meta.get("status") in states.READY_STATES:
                return meta.get("result"), True


def measure(
    impl: str,
    workload: str,
    n: int,
    keys: int,
    warmup: int,
    timeout: float,
    worker_pid: int | None = None,
) -> Measurement:
    """Warm up, then publish every call, wait for all results and check their values."""
    deadline = time.monotonic() + timeout
    # Warm-up: connections, script loading and imports in the producer and each pool process.
    warm = [publish(impl, 1_000_000 + i, f"warmup-{i}") for i in range(warmup)]
    for result in warm:
        wait_for(result, deadline)
    runs_before = int(counter_client().get(runs_key(impl)) or 0)

    plan = calls(workload, n, keys)
    cpu_before = cpu.snapshot(worker_pid, counter_client())
    started = time.perf_counter()
    results = [publish(impl, item, key) for item, key in plan]
    published_at = time.perf_counter()
    # One wait per published task id (IdempotentTask answers an in-progress key with the
    # owner's AsyncResult, so several calls may share an id).
    pending: dict[str, AsyncResult] = {}
    for result in results:
        if not isinstance(result, EagerResult):
            pending.setdefault(result.id, result)
    values: dict[str, Any] = {}
    misses = 0
    for task_id, result in pending.items():
        values[task_id], missed = wait_for(result, deadline)
        misses += missed
    finished = time.perf_counter()
    cpu_after = cpu.snapshot(worker_pid, counter_client())

    dropped = wrong = 0
    for (item, _), result in zip(plan, results, strict=True):
        if isinstance(result, EagerResult) and result.state == states.REJECTED:
            dropped += 1  # celery-once's graceful drop: the call gets no value
            continue
        value = result.result if isinstance(result, EagerResult) else values[result.id]
        wrong += value != expected_result(item)
    seconds = finished - started
    return Measurement(
        impl=impl,
        workload=workload,
        n=n,
        seconds=seconds,
        publish_seconds=published_at - started,
        tasks_per_s=n / seconds,
        published=len(pending),
        suppressed_at_publish=n - len(pending),
        dropped=dropped,
        wrong_results=wrong,
        pubsub_misses=misses,
        runs_before=runs_before,
        cpu_seconds=cpu.used(cpu_before, cpu_after),
    )


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, measure once and print the measurement as one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=IMPLEMENTATIONS, required=True)
    parser.add_argument("--workload", choices=WORKLOADS, required=True)
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--worker-pid", type=int, help="worker main process, for CPU figures")
    args = parser.parse_args(argv)
    if args.impl == "twotrips":
        app.conf.idempotency_publish_in_one_trip = False
    result = measure(
        args.impl, args.workload, args.n, args.keys, args.warmup, args.timeout, args.worker_pid
    )
    print(json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
