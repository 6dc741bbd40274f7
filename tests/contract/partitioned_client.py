"""A claim store and a dead-letter table over a connection ``test_sql_partition`` cuts.

Run in the test's client network namespace as ``python -m tests.contract.partitioned_client
URL``. Before each step it reads a line from stdin (the test cuts or heals the link between
steps); after each it prints one line: what the step did, and in how many seconds.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from idempotent_tasks.dlq import DeadLetterQueue, engine, liveness
from idempotent_tasks.stores.sql import SqlStore
from tests.claim_requests import claim_request

#: The product's waits, made short so that the test is (a partition is told from a slow
#: server by the same means, in the same number of unanswered probes).
liveness.KEEPALIVE_IDLE_SECONDS = 1
liveness.KEEPALIVE_INTERVAL_SECONDS = 1
liveness.KEEPALIVE_COUNT = 2
liveness.TCP_USER_TIMEOUT_MS = 2000
engine.CONNECT_TIMEOUT_SECONDS = 2


def step(name: str, action: Callable[[], object]) -> None:
    sys.stdin.readline()
    started = time.monotonic()
    try:
        outcome = f"{name} {action()}"
    except Exception as exc:
        outcome = f"{name} failed {type(exc).__name__}"
    print(f"{outcome} in {time.monotonic() - started:.1f} s", flush=True)


def main(url: str) -> None:
    store = SqlStore(url, prefix="partitioned")
    dead_letters = DeadLetterQueue(url)
    request = claim_request(key="cut-off", lease_seconds=120)
    claimed = store.claim(request)
    token = claimed.token
    assert token is not None, claimed
    dead_letters.stats()
    print("ready", flush=True)
    # While cut off: each call fails closed, in seconds.
    step("extend", lambda: store.extend(request, token))
    step("stats", lambda: "total" in dead_letters.stats())
    # Healed: the next calls reconnect, and the claim is still this owner's.
    step("extend", lambda: store.extend(request, token))
    step("stats", lambda: "total" in dead_letters.stats())


if __name__ == "__main__":
    main(sys.argv[1])
