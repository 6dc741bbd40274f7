"""Differential test of the claim stores: seeded random sequences, every step compared.

Each sequence (reserve, cancel_reservation, claim, complete, release, extend, get, forget and
take_due on two or three keys, a few owners, task ids and fingerprints, with a fake clock
moved on between steps, often past leases, ttls and pickup due times) runs on the memory
store and on the SQL store (SQLite, PostgreSQL, MariaDB) in lockstep, both reading one
clock. Every answer is compared (outcomes, tokens, takeover flags, records, the pickups the
sweep takes), and every key's record after every step. The Redis store reads the server's
clock, so it cannot follow a fake one; the Lua scripts are the reference the memory store
and the SQL store must both decide as.

Normalised, because it differs without anyone deciding on it: a queued record's token (see
:meth:`Runner.record`), the order of ``take_due`` (each store takes due keys in its own
order, so the sweeps are asked for more than there are keys, and compared sorted). Times
are compared relative to the clock, exactly: both stores compute them from the same clock.

Disagreements found are fixed, and kept in :data:`REGRESSIONS` as the smallest sequences that
showed them.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from idempotent_tasks.records import (
    ClaimRequest,
    EncodedResult,
    Outcome,
    Pickup,
    Record,
    Status,
)
from idempotent_tasks.stores import MemoryStore, Store
from idempotent_tasks.stores.sql import SqlStore
from tests.contract.conftest import store_url

SQL_STORES = ["sqlite", "postgresql", "mariadb"]
SEQUENCES = 30
STEPS = 40
START = 1_800_000_000.0
TASK_NAME = "tasks.charge"
KEYS = ("a", "b", "c")
OWNERS = ("o1", "o2", "o3")
TASK_IDS = ("t1", "t2", "t3")
FINGERPRINTS = ("fp1", "fp2")
RESULTS: tuple[EncodedResult | None, ...] = (
    None,
    EncodedResult(content_type="application/json", content_encoding="utf-8", body=b"1"),
    EncodedResult(content_type="application/x-python", content_encoding="binary", body=b"\0\xff"),
)
ENVELOPES = (b"env-1", b"env-2\x00\xff")


class Clock:
    """The fake clock every store of one sequence reads."""

    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass(frozen=True, kw_only=True)
class Op:
    """One step of a sequence. ``token`` picks which token an owner presents: the last one it
    acquired on the key (``own``), the one before (``stale``) or one never given (``wrong``)."""

    kind: str
    key: str = "a"
    owner: str = "o1"
    task_id: str = "t1"
    fingerprint: str = "fp1"
    lease: float = 10.0
    ttl: float = 30.0
    validate: bool = True
    previous_owner: str | None = None
    retries: int = 0
    token: str = "own"
    result: int = 0
    pickup: Pickup | None = None
    seconds: float = 0.0
    limit: int = 10

    def __str__(self) -> str:
        """Only the fields the operation uses."""
        if self.kind == "advance":
            return f"advance {self.seconds:g}s"
        if self.kind == "take_due":
            return f"take_due(limit={self.limit})"
        if self.kind in ("get", "forget"):
            return f"{self.kind} {self.key}"
        used = {
            "reserve": ("task_id", "fingerprint", "ttl", "pickup"),
            "cancel": ("task_id",),
            "claim": (
                *("owner", "task_id", "fingerprint", "lease", "ttl"),
                *("validate", "previous_owner", "retries"),
            ),
            "complete": ("owner", "token", "task_id", "fingerprint", "lease", "ttl", "result"),
            "release": ("owner", "token", "task_id", "fingerprint", "ttl", "pickup"),
            "extend": ("owner", "token", "lease", "ttl"),
        }[self.kind]
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in used)
        return f"{self.kind} {self.key}: {fields}"


def advance(seconds: float) -> Op:
    return Op(kind="advance", seconds=seconds)


# -- generating sequences -----------------------------------------------------------------


KINDS = {  # operation: weight
    "advance": 14,
    "reserve": 7,
    "cancel": 3,
    "claim": 14,
    "complete": 8,
    "release": 6,
    "extend": 5,
    "get": 2,
    "forget": 2,
    "take_due": 6,
}


def generate(seed: int, steps: int = STEPS) -> list[Op]:
    """A random sequence of ``steps`` operations on a few keys, owners and task ids.

    Steps are mostly what the protocol does (a claim delivers the message last reserved, the
    last claimer completes, releases or renews), often not (any owner, task id, fingerprint
    or token): the stores must agree either way.
    """
    rng = random.Random(seed)
    # Retry counts drawn apart, so that the operations are those of the seed without them.
    retry_rng = random.Random(f"retries of {seed}")
    keys = KEYS[: rng.choice((2, 3))]
    # key: task id, fingerprint and retries of its message
    reserved: dict[str, tuple[str, str, int]] = {}
    claimed: dict[str, tuple[str, str, str]] = {}  # key: its last claimer, task id, fingerprint
    ops: list[Op] = []
    while len(ops) < steps:
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        key = rng.choice(keys)
        owner = rng.choice(OWNERS)
        task_id, fingerprint = rng.choice(TASK_IDS), rng.choice(FINGERPRINTS)
        retries = retry_rng.choice((0, 0, 1, 2))
        if kind in ("claim", "cancel") and key in reserved and rng.random() < 0.7:
            task_id, fingerprint, queued_for = reserved[key]
            # that message, or an older or newer one of its call
            retries = max(queued_for + retry_rng.choice((0, 0, -1, 1)), 0)
        if kind in ("complete", "release", "extend") and key in claimed and rng.random() < 0.8:
            owner, task_id, fingerprint = claimed[key]
        op = Op(
            kind=kind,
            key=key,
            owner=owner,
            task_id=task_id,
            fingerprint=fingerprint,
            lease=rng.choice((10.0, 20.0)),
            ttl=rng.choice((30.0, 60.0)),
            token=rng.choices(("own", "stale", "wrong"), weights=(8, 1, 1))[0],
        )
        if kind == "advance":
            seconds = rng.choices(
                (
                    rng.choice((0.5, 1.0, 2.25, 4.0)),
                    rng.choice((5.0, 10.0, 15.0)),  # exactly to many leases and due times
                    rng.uniform(3.0, 25.0),
                    rng.uniform(30.0, 90.0),  # past ttls
                ),
                weights=(7, 6, 4, 3),
            )[0]
            op = Op(kind="advance", seconds=round(seconds * 4) / 4)
        elif kind == "reserve":
            op = dataclasses.replace(op, pickup=make_pickup(rng, retries=0))
            reserved[key] = (task_id, fingerprint, 0)
        elif kind == "claim":
            previous = rng.choice((None, None, *OWNERS))
            op = dataclasses.replace(
                op,
                previous_owner=previous,
                validate=rng.random() < 0.8,
                retries=retries,
            )
            claimed[key] = (owner, task_id, fingerprint)
        elif kind == "complete":
            op = dataclasses.replace(op, result=rng.randrange(len(RESULTS)))
        elif kind == "release" and rng.random() < 0.5:
            # a requeued message, or a retry's (its call's message counting one or two more)
            pickup = make_pickup(rng, retries=retry_rng.choice((0, 1, 2)))
            op = dataclasses.replace(op, pickup=pickup)
            reserved[key] = (task_id, fingerprint, pickup.retries)
        elif kind == "take_due":
            # Limit above the number of keys: each store takes due keys in its own order.
            op = Op(kind="take_due", limit=10)
            if rng.random() < 0.3:  # a sweep left running: lost messages published again
                for _ in range(rng.randint(1, 3)):
                    ops += [advance(rng.choice((4.0, 8.0, 10.0, 16.0, 20.0))), op]
        ops.append(op)
    return ops[:steps]


def make_pickup(rng: random.Random, retries: int) -> Pickup:
    return Pickup(
        envelope=rng.choice(ENVELOPES),
        due_in=rng.choice((5.0, 15.0)),
        timeout=rng.choice((4.0, 10.0)),
        retries=retries,
    )


# -- running them -------------------------------------------------------------------------


class Runner:
    """Applies operations to one store and describes what each returned."""

    def __init__(self, store: Store, clock: Clock) -> None:
        self.store = store
        self.clock = clock
        #: Tokens each owner acquired on each storage key, in order.
        self.tokens: dict[tuple[str, str], list[int]] = {}

    def token_for(self, op: Op, storage_key: str) -> int:
        """The token ``op``'s owner presents, from what this store gave it."""
        got = self.tokens.get((storage_key, op.owner), [])
        last = got[-1] if got else 1
        if op.token == "stale":
            return got[-2] if len(got) > 1 else last - 1
        if op.token == "wrong":
            return last + 5
        return last

    def apply(self, op: Op, storage_key: str) -> Any:
        """Run ``op`` on ``storage_key``; what it returned, times relative to the clock."""
        store, req = self.store, request(op, storage_key)
        if op.kind == "reserve":
            assert op.pickup is not None
            return self.record(store.reserve(req, op.pickup))
        if op.kind == "cancel":
            return store.cancel_reservation(req.storage_key, req.task_id)
        if op.kind == "claim":
            result = store.claim(req)
            if result.outcome is Outcome.ACQUIRED:
                self.tokens.setdefault((storage_key, op.owner), []).append(result.token)
            return (result.outcome.value, result.token, result.takeover, self.record(result.record))
        if op.kind == "complete":
            token = self.token_for(op, storage_key)
            return store.complete(req, token, RESULTS[op.result]).value
        if op.kind == "release":
            return store.release(req, self.token_for(op, storage_key), op.pickup)
        if op.kind == "extend":
            return store.extend(req, self.token_for(op, storage_key))
        if op.kind == "get":
            return self.record(store.get(storage_key))
        if op.kind == "forget":
            return store.forget(storage_key)
        if op.kind == "take_due":
            taken = store.take_due(op.limit)
            return sorted(
                (due.storage_key, due.task_name, due.task_id, due.envelope, due.republished)
                for due in taken
            )
        raise AssertionError(f"unknown operation {op.kind!r}")

    def record(self, record: Record | None) -> dict[str, Any] | None:
        """What the comparison looks at of a record: all of it, times relative to the clock.

        A queued record's token is left out: nobody holds it, and no decision reads it (the
        memory store and the Redis script write 0 there, the SQL store keeps its fencing
        counter in that column)."""
        if record is None:
            return None
        now = self.clock.now
        return {
            "storage_key": record.storage_key,
            "key": record.key,
            "task_name": record.task_name,
            "status": record.status.value,
            "owner": record.owner,
            "token": None if record.status is Status.QUEUED else record.token,
            "task_id": record.task_id,
            "fingerprint": record.fingerprint,
            "result": record.result,
            "result_cached": record.result_cached,
            "lease_expires_in": record.lease_expires_at - now,
            "expires_in": record.expires_at - now,
            "created_ago": now - record.created_at,
            "updated_ago": now - record.updated_at,
        }


def request(op: Op, storage_key: str) -> ClaimRequest:
    return ClaimRequest(
        storage_key=storage_key,
        key=storage_key.split(":", 1)[1],
        task_name=TASK_NAME,
        task_id=op.task_id,
        owner=op.owner,
        fingerprint=op.fingerprint,
        lease_seconds=op.lease,
        ttl_seconds=op.ttl,
        validate=op.validate,
        previous_owner=op.previous_owner,
        retries=op.retries,
    )


# -- comparing them -----------------------------------------------------------------------


class Differential:
    """One sequence run on the memory store and a SQL store in lockstep, on one clock."""

    def __init__(self, memory: MemoryStore, sql: SqlStore, clock: Clock) -> None:
        self.memory, self.sql, self.clock = memory, sql, clock
        self.left, self.right = Runner(memory, clock), Runner(sql, clock)
        self.answers: collections.Counter[str] = collections.Counter()

    @staticmethod
    def storage_key(key: str) -> str:
        return f"{TASK_NAME}:{key}"

    def run(self, ops: Sequence[Op]) -> str | None:
        """A description of the first step the stores answer differently (or after which
        their records differ), else ``None``."""
        for index, op in enumerate(ops):
            if op.kind == "advance":
                self.clock.now += op.seconds  # once: both stores read this clock
                continue
            storage_key = self.storage_key(op.key)
            answers = self.left.apply(op, storage_key), self.right.apply(op, storage_key)
            states = self.states()
            self.answers[describe(op, answers[0])] += 1
            if answers[0] != answers[1] or states[0] != states[1]:
                steps = "\n".join(f"  {i:2}: {o}" for i, o in enumerate(ops[: index + 1]))
                return (
                    f"step {index} ({op.kind}) differs\n"
                    f"memory answered {answers[0]!r}\n   sql answered {answers[1]!r}\n"
                    f"memory records {states[0]!r}\n   sql records {states[1]!r}\n"
                    f"sequence:\n{steps}"
                )
        return None

    def states(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Every key's record as ``get`` shows it, in each store."""
        keys = [self.storage_key(key) for key in KEYS]
        return (
            {key: self.left.record(self.memory.get(key)) for key in keys},
            {key: self.right.record(self.sql.get(key)) for key in keys},
        )


def describe(op: Op, answer: Any) -> str:
    """A coarse label of what a step answered (to show what the sequences cover)."""
    if op.kind == "claim":
        return f"claim {answer[0]}" + (" takeover" if answer[2] else "")
    if op.kind in ("complete", "cancel", "release", "extend", "forget"):
        return f"{op.kind} {answer}"
    if op.kind == "reserve":
        return "reserve " + ("queued" if answer is None else f"found {answer['status']}")
    if op.kind == "take_due":
        return "take_due " + ("some" if answer else "none")
    return f"get {'none' if answer is None else answer['status']}"


# -- disagreements found and fixed ------------------------------------------------------

PICKUP = Pickup(envelope=b"env-1", due_in=5.0, timeout=4.0)

#: The smallest sequence of each disagreement the random sequences found (now fixed).
REGRESSIONS: dict[str, tuple[Op, ...]] = {
    # A completion that recovers a vanished claim wrote the completer's token into the SQL
    # row, the key's fencing counter: a later claim got a token given before.
    "recovery-keeps-tokens-growing": (
        Op(kind="claim", owner="o1", lease=10.0, ttl=30.0),
        Op(kind="claim", owner="o2", lease=10.0, ttl=30.0, previous_owner="o1"),
        advance(40.0),
        Op(kind="complete", owner="o1", ttl=30.0),
        Op(kind="complete", owner="o1", ttl=30.0),
        advance(30.0),
        Op(kind="claim", owner="o3"),
    ),
    # The memory store and claim.lua reset a pickup's re-publication count on a claim, the SQL
    # store did not: the count (and the sweep's backoff) now runs on across claims everywhere.
    "claim-keeps-republished-count": (
        Op(kind="reserve", ttl=30.0, pickup=PICKUP),
        advance(5.0),
        Op(kind="take_due"),
        Op(kind="claim", lease=10.0, ttl=30.0),
        advance(14.0),
        Op(kind="take_due"),
    ),
    # Not a disagreement found, but the older-message rule walked through on both stores: a key
    # queued for a retry is not taken by an older message of the call (fewer retries), is by
    # the retry's, and is by another call once due.
    "older-messages-of-a-retried-call": (
        Op(kind="claim", owner="o1", retries=0),
        Op(kind="release", owner="o1", pickup=dataclasses.replace(PICKUP, retries=1)),
        Op(kind="claim", owner="o2", retries=0),
        Op(kind="claim", owner="o3", retries=1),
        Op(kind="release", owner="o3", pickup=dataclasses.replace(PICKUP, retries=2)),
        Op(kind="claim", owner="o2", retries=1),
        Op(kind="claim", owner="o2", retries=0, previous_owner="o3"),
        advance(6.0),
        Op(kind="claim", owner="o1", retries=1),
        Op(kind="claim", owner="o2", task_id="t2"),
    ),
}


# -- the tests ----------------------------------------------------------------------------


def unswept_memory_store(clock: Callable[[], float]) -> MemoryStore:
    """A memory store that never sweeps expired keys by itself: the SQL store keeps a key's row,
    and with it its fencing token, until the beat's cleanup, which no sequence here runs."""
    return MemoryStore(clock=clock, sweep_every=math.inf)


@pytest.fixture(params=SQL_STORES)
def stores(request: pytest.FixtureRequest) -> Iterator[tuple[MemoryStore, SqlStore, Clock]]:
    """The memory store and an emptied SQL store, both on one fake clock."""
    clock = Clock()
    sql = SqlStore(store_url(request.param, request), prefix="diff", clock=clock)
    yield unswept_memory_store(clock), sql, clock
    sql.close()


@pytest.mark.parametrize("seed", range(SEQUENCES))
def test_random_sequences_decide_alike(
    stores: tuple[MemoryStore, SqlStore, Clock], seed: int
) -> None:
    differential = Differential(*stores)
    found = differential.run(generate(seed))
    assert found is None, found


@pytest.mark.parametrize("ops", list(REGRESSIONS.values()), ids=list(REGRESSIONS))
def test_disagreements_found_stay_fixed(
    stores: tuple[MemoryStore, SqlStore, Clock], ops: tuple[Op, ...]
) -> None:
    differential = Differential(*stores)
    found = differential.run(ops)
    assert found is None, found


#: What the random sequences must reach (labels of :func:`describe`).
REACHED = {
    *("reserve queued", "reserve found queued", "reserve found processing"),
    *("reserve found completed", "cancel True", "cancel False"),
    *("claim acquired", "claim acquired takeover", "claim in_progress", "claim completed"),
    *("claim mismatch", "complete stored", "complete recovered", "complete stale"),
    *("release True", "release False", "extend True", "extend False", "forget True"),
    *("get none", "get queued", "get processing", "get completed"),
    *("take_due none", "take_due some"),
}


def test_random_sequences_reach_every_answer(request: pytest.FixtureRequest) -> None:
    """The sequences reach every answer of every operation (on SQLite, the quickest: the
    sequences are the same on every database)."""
    url = store_url("sqlite", request)
    answers: collections.Counter[str] = collections.Counter()
    for seed in range(SEQUENCES):
        clock = Clock()
        sql = SqlStore(url, prefix=f"reach{seed}", clock=clock)
        differential = Differential(unswept_memory_store(clock), sql, clock)
        differential.run(generate(seed))
        sql.close()
        answers += differential.answers
    assert REACHED - set(answers) == set(), answers
