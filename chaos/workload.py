"""The chaos run's workload: which keys, how often each is called, and what every caller got.

A seeded plan of keyed calls: mostly fast tasks, a few slow ones (longer than the lease and the
visibility timeout), flaky ones (fail once or twice, then succeed through ``autoretry_for``) and
doomed ones (always fail: dead-lettered, then retried by the sweep). 30 % of the keys are called
two to five times: all at once from threads, one call and the rest after it completed, or half
at once and half after. The :class:`Producer` makes the calls from the driver process (its own
threads) while faults are injected, then collects what each caller's ``.get()`` returned.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery
from celery.exceptions import TimeoutError as ResultTimeout
from celery.result import AsyncResult, EagerResult
from celery.signals import after_task_publish

logger = logging.getLogger(__name__)

#: Shares of the keys by kind (the rest are fast); slow keys are few, they hold pool slots.
SLOW_SHARE = 0.006
FLAKY_SHARE = 0.10
DOOMED_SHARE = 0.015
#: Shares of the keys called more than once, and how their callers call.
DUPLICATE_SHARE = 0.30
CALLS = (2, 5)
MODES = {"at_once": 0.4, "after": 0.3, "mixed": 0.3}
#: Seconds a slow body sleeps (longer than the 2 s lease and the 3 s visibility timeout).
SLOW_SECONDS = (3.0, 5.0)
FAST_SECONDS = (0.0, 0.02)
#: Seconds the later calls of a key wait for its first call (whose message may be lost).
FOLLOW_UP_WAIT_S = 60.0
#: Broker queue length above which the producer waits (so faults hit a steady flow).
MAX_BACKLOG = 60
QUEUE = "celery"


@dataclass(frozen=True, kw_only=True)
class KeyPlan:
    """One key: its kind, its task's arguments, how many callers and how they call."""

    key: str
    kind: str
    seconds: float
    failures: int
    calls: int
    mode: str

    @property
    def task_name(self) -> str:
        """The Celery task the key's callers call."""
        return "chaos.doomed" if self.kind == "doomed" else "chaos.work"

    @property
    def args(self) -> tuple[Any, ...]:
        """The call's arguments (the same for every caller: one fingerprint)."""
        if self.kind == "doomed":
            return (self.key,)
        return (self.key, self.kind, self.seconds, self.failures)


def plan_keys(tasks: int, rng: random.Random, prefix: str) -> list[KeyPlan]:
    """``tasks`` keys in the order they are first called."""
    slow = max(3, round(tasks * SLOW_SHARE))
    doomed = max(3, round(tasks * DOOMED_SHARE))
    flaky = max(3, round(tasks * FLAKY_SHARE))
    kinds = ["slow"] * slow + ["doomed"] * doomed + ["flaky"] * flaky
    kinds += ["fast"] * max(0, tasks - len(kinds))
    rng.shuffle(kinds)
    plans = []
    for index, kind in enumerate(kinds[:tasks]):
        seconds = rng.uniform(*(SLOW_SECONDS if kind == "slow" else FAST_SECONDS))
        duplicated = rng.random() < DUPLICATE_SHARE
        plans.append(
            KeyPlan(
                key=f"{prefix}-{index:05d}",
                kind=kind,
                seconds=round(seconds, 3),
                failures=rng.randint(1, 2) if kind == "flaky" else 0,
                calls=rng.randint(*CALLS) if duplicated else 1,
                mode=rng.choices(list(MODES), weights=list(MODES.values()))[0]
                if duplicated
                else "single",
            )
        )
    return plans


@dataclass(kw_only=True)
class Caller:
    """One call of a key and what it got.

    ``how``: ``published`` (a message was sent), ``cached`` (the publish side answered from the
    completed key) or ``joined`` (the publish side returned the running owner's result).
    ``outcome``: ``value``, ``error`` (the task failed; ``value`` is the error's type) or
    ``timeout`` (``.get()`` did not answer in time), once collected.
    """

    key: str
    index: int
    how: str
    task_id: str
    sent_at: float
    attempts: int
    eager: EagerResult | None = None
    outcome: str | None = None
    value: Any = None


@dataclass
class _FollowUp:
    """Calls of a key that wait until an earlier call of it is ready."""

    plan: KeyPlan
    first: Caller
    indices: list[int]
    since: float


class Producer:
    """Makes every planned call from background threads; :meth:`collect` gathers the values.

    Args:
        app: the chaos Celery app (configured for this run).
        plans: the keys, in order.
        broker: a client of the broker's Redis (for the backlog check).
        stop: set to make every thread give up.
    """

    def __init__(
        self, app: Celery, plans: list[KeyPlan], broker: redis.Redis, stop: threading.Event
    ) -> None:
        self.app = app
        self.plans = plans
        self.broker = broker
        self.stop = stop
        self.callers: list[Caller] = []
        self.keys_started = 0
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._follow_ups: deque[_FollowUp] = deque()
        self._publishing_done = threading.Event()
        self._local = threading.local()
        self._threads: list[threading.Thread] = []
        after_task_publish.connect(self._note_publish, weak=False)

    # -- progress -------------------------------------------------------------------------

    @property
    def progress(self) -> float:
        """Fraction of the keys whose first call was made."""
        return self.keys_started / max(1, len(self.plans))

    def done(self) -> bool:
        """Every call was made (or the producer gave up)."""
        finished = self._publishing_done.is_set() and not self._follow_ups
        return finished or self.error is not None

    def start(self) -> None:
        """Start the publishing thread and the follow-up thread."""
        for target, name in ((self._publish_all, "publisher"), (self._follow_up, "follow-up")):
            thread = threading.Thread(target=self._guard(target), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def join(self, timeout: float) -> None:
        """Wait for the threads (after :attr:`stop` is set or :meth:`done`)."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _guard(self, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:
                logger.exception("producer thread failed")
                self.error = exc
                self.stop.set()

        return run

    # -- calling --------------------------------------------------------------------------

    def _publish_all(self) -> None:
        for number, plan in enumerate(self.plans):
            if self.stop.is_set():
                return
            if number % 10 == 0:
                self._wait_for_backlog()
            if plan.mode in ("at_once", "mixed"):
                together = plan.calls if plan.mode == "at_once" else (plan.calls + 1) // 2
                callers = self._call_at_once(plan, list(range(together)))
                rest = list(range(together, plan.calls))
            else:
                caller = self._call(plan, 0)
                callers = [caller] if caller is not None else []
                rest = list(range(1, plan.calls))
            with self._lock:
                self.keys_started += 1
                if rest and callers:
                    self._follow_ups.append(
                        _FollowUp(plan=plan, first=callers[0], indices=rest, since=time.monotonic())
                    )
        self._publishing_done.set()

    def _call_at_once(self, plan: KeyPlan, indices: list[int]) -> list[Caller]:
        """Call the key from one thread per caller, released together by a barrier."""
        barrier = threading.Barrier(len(indices))
        made: list[Caller] = []

        def call(index: int) -> None:
            try:
                barrier.wait(timeout=10)
            except threading.BrokenBarrierError:
                pass
            caller = self._call(plan, index)
            if caller is not None:
                with self._lock:
                    made.append(caller)

        threads = [threading.Thread(target=call, args=(index,), daemon=True) for index in indices]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        return sorted(made, key=lambda caller: caller.index)

    def _call(self, plan: KeyPlan, index: int) -> Caller | None:
        """One ``apply_async`` with the key, tried again while the broker is down."""
        task = self.app.tasks[plan.task_name]
        attempts = 0
        while not self.stop.is_set():
            attempts += 1
            self._local.published = None
            sent_at = time.time()
            try:
                result = task.apply_async(plan.args, idempotency_key=plan.key)
            except Exception as exc:
                logger.warning("call %s of %s failed, again in 0.5s: %r", index, plan.key, exc)
                time.sleep(0.5)
                continue
            if isinstance(result, EagerResult):
                how, eager = "cached", result
            else:
                how = "published" if self._local.published == result.id else "joined"
                eager = None
            caller = Caller(
                key=plan.key,
                index=index,
                how=how,
                task_id=str(result.id),
                sent_at=sent_at,
                attempts=attempts,
                eager=eager,
            )
            with self._lock:
                self.callers.append(caller)
            return caller
        return None

    def _note_publish(self, headers: dict[str, Any] | None = None, **_: Any) -> None:
        self._local.published = (headers or {}).get("id")

    def _wait_for_backlog(self) -> None:
        while not self.stop.is_set():
            try:
                if int(self.broker.llen(QUEUE)) <= MAX_BACKLOG:
                    return
            except redis.RedisError:
                pass  # the broker restarts: wait for it
            time.sleep(0.02)

    def _follow_up(self) -> None:
        """Make the calls that come after an earlier call of their key is ready."""
        while not self.stop.is_set():
            with self._lock:
                pending = list(self._follow_ups)
            if not pending and self._publishing_done.is_set():
                return
            for item in pending:
                if self.stop.is_set():
                    return
                waited = time.monotonic() - item.since
                if waited < FOLLOW_UP_WAIT_S and not self._ready(item.first):
                    continue
                if waited >= FOLLOW_UP_WAIT_S:
                    logger.warning(
                        "%s: first call not ready after %.0fs, calling again anyway",
                        item.plan.key,
                        waited,
                    )
                for index in item.indices:
                    self._call(item.plan, index)
                with self._lock:
                    self._follow_ups.remove(item)
            time.sleep(0.1)

    def _ready(self, caller: Caller) -> bool:
        if caller.eager is not None:
            return True
        try:
            return bool(AsyncResult(caller.task_id, app=self.app).ready())
        except Exception:
            return False  # the backend restarts: look again later

    # -- results --------------------------------------------------------------------------

    def pending_task_ids(self, task_ids: set[str]) -> set[str]:
        """Those of ``task_ids`` whose result is not ready yet."""
        pending = set()
        for task_id in task_ids:
            try:
                if not AsyncResult(task_id, app=self.app).ready():
                    pending.add(task_id)
            except Exception:
                pending.add(task_id)
        return pending

    def collect(
        self,
        deadline: float,
        threads: int = 4,
        per_call: float = 30.0,
        stuck: set[str] | None = None,
    ) -> None:
        """Fill in every caller's outcome from its ``.get()`` (each bounded by ``per_call`` s
        and by ``deadline``, a ``time.monotonic()`` value; 1 s for the ``stuck`` task ids)."""
        stuck = stuck or set()
        todo: queue.SimpleQueue[Caller] = queue.SimpleQueue()
        for caller in self.callers:
            todo.put(caller)

        def drain() -> None:
            while True:
                try:
                    caller = todo.get_nowait()
                except queue.Empty:
                    return
                limit = 1.0 if caller.task_id in stuck else per_call
                self._collect_one(caller, min(limit, max(0.1, deadline - time.monotonic())))

        workers = [threading.Thread(target=drain, daemon=True) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(max(1.0, deadline - time.monotonic() + per_call))

    def _collect_one(self, caller: Caller, timeout: float) -> None:
        if caller.eager is not None:
            caller.outcome, caller.value = "value", caller.eager.get()
            return
        result = AsyncResult(caller.task_id, app=self.app)
        try:
            value = result.get(timeout=timeout, propagate=False)
        except ResultTimeout:
            caller.outcome, caller.value = "timeout", result.state
            _forget_pending(result)
            return
        except Exception as exc:
            caller.outcome, caller.value = "timeout", f"get() raised {exc!r}"
            _forget_pending(result)
            return
        if isinstance(value, BaseException):
            caller.outcome, caller.value = "error", type(value).__name__
        else:
            caller.outcome, caller.value = "value", value


def _forget_pending(result: AsyncResult) -> None:
    """Stop listening for a result that timed out, while the backend is still up (else the
    result's finalizer tries, and fails loudly, once the run's Redis is gone)."""
    try:
        result.backend.remove_pending_result(result)
    except Exception:
        logger.warning("could not stop listening for %s", result.id, exc_info=True)
