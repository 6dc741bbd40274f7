"""A tiny shop that charges orders effectively-once, on embedded defaults (no servers at all).

Everything lives in this process: an in-memory broker, result backend and claim store, and a
dead-letter table in an SQLite file of a fresh temporary folder, removed when the process exits.
A worker must therefore run in the same process, in threads (``examples/demo.py`` starts one).
The task bodies record what they really did in :data:`ledger`, so a demo or a test can count how
many times each body ran.
"""

from __future__ import annotations

import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery import Celery, Task

from idempotent_tasks import IdempotentTask

#: Folder of the dead-letter table: new for each process, deleted (with the table) at its exit.
DEAD_LETTERS_DIR = tempfile.TemporaryDirectory(
    prefix="shop-dead-letters-", ignore_cleanup_errors=True
)

# "localhost" only silences kombu's "No hostname was supplied" warning: nothing is contacted.
app = Celery("shop", broker="memory://localhost/", backend="cache+memory://")
app.conf.update(
    # Claims and cached results in this process's memory: protects one process only.
    idempotency_store_url="memory://",
    # The in-memory broker polls its queues; the default second makes every hop a second long.
    broker_transport_options={"polling_interval": 0.01},
    broker_connection_retry_on_startup=True,
    # Tasks that fail for good are kept here, and retried by the sweep task on a backoff that
    # starts at a tenth of a second (instead of a minute), so the demo sees them due at once.
    idempotency_dlq_url=f"sqlite:///{Path(DEAD_LETTERS_DIR.name) / 'dead_letters.sqlite3'}",
    idempotency_dlq_base_delay=0.1,
)

#: Seconds the fake payment gateway takes to answer: long enough for duplicates to overlap.
GATEWAY_LATENCY = 0.3
#: How many times the fake mail server times out on an order before it accepts its receipt.
RECEIPT_TIMEOUTS = 2
#: How many attempts at booking a courier fail before the courier's API answers again: one more
#: than ``book_courier``'s Celery tries (a first try and one retry), so only its dead letter's
#: retry gets through.
COURIER_OUTAGE = 2


@dataclass
class Ledger:
    """What the task bodies really did (thread-safe): the truth the demo checks against."""

    #: Every charge made at the gateway, with the id of the task that made it.
    charges: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    #: How many times ``send_receipt``'s body started, per order id.
    receipt_starts: Counter[int] = field(default_factory=Counter)
    #: How each ``send_receipt`` attempt ended: (order id, "TimeoutError" or "sent").
    receipt_outcomes: list[tuple[int, str]] = field(default_factory=list)
    #: How many times other task bodies started, per (task name, order id).
    starts: Counter[tuple[str, int]] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_charge(self, task_id: str, made: dict[str, Any]) -> None:
        """Note a charge the gateway made for the task ``task_id``."""
        with self._lock:
            self.charges.append((task_id, made))

    def charges_of(self, order_id: int) -> list[tuple[str, dict[str, Any]]]:
        """The charges made for ``order_id``, as (task id, charge) pairs."""
        with self._lock:
            return [entry for entry in self.charges if entry[1]["order_id"] == order_id]

    def start_receipt(self, order_id: int) -> int:
        """Count a start of ``send_receipt`` for ``order_id``; returns its attempt number."""
        with self._lock:
            self.receipt_starts[order_id] += 1
            return self.receipt_starts[order_id]

    def end_receipt(self, order_id: int, outcome: str) -> None:
        """Note how an attempt of ``send_receipt`` for ``order_id`` ended."""
        with self._lock:
            self.receipt_outcomes.append((order_id, outcome))

    def start(self, task_name: str, order_id: int) -> int:
        """Count a start of ``task_name``'s body for ``order_id``; returns its attempt number."""
        with self._lock:
            self.starts[task_name, order_id] += 1
            return self.starts[task_name, order_id]

    def receipts_of(self, order_id: int) -> list[str]:
        """How each ``send_receipt`` attempt for ``order_id`` ended, in order."""
        with self._lock:
            return [outcome for order, outcome in self.receipt_outcomes if order == order_id]


ledger = Ledger()


@app.task(name="shop.charge", base=IdempotentTask, bind=True)
def charge(self: Task, order_id: int, amount: int) -> dict[str, Any]:
    """Charge ``amount`` cents for ``order_id`` at the (fake) payment gateway.

    Call it with a per-call key, ``charge.apply_async((42, 990), idempotency_key="order-42")``:
    however often that is sent, the card is charged once and every caller gets this charge.

    Returns:
        The charge: a fresh ``charge_id`` (so two real charges never look alike), the order
        id and the amount.
    """
    time.sleep(GATEWAY_LATENCY)
    made = {"charge_id": f"ch_{uuid.uuid4().hex[:12]}", "order_id": order_id, "amount": amount}
    ledger.record_charge(self.request.id, made)
    return made


@app.task(
    name="shop.send_receipt",
    base=IdempotentTask,
    idempotency_key="receipt:{order_id}",
    autoretry_for=(TimeoutError,),
    max_retries=3,
    default_retry_delay=0.1,
)
def send_receipt(order_id: int, email: str) -> str:
    """Mail the receipt of ``order_id``; the mail server times out on the first attempts.

    Keyed per task by the template ``"receipt:{order_id}"``, so callers need no key of their
    own; a :class:`TimeoutError` is retried (``autoretry_for``), and each retry claims the key
    afresh because the failed attempt released it.

    Raises:
        TimeoutError: on the first :data:`RECEIPT_TIMEOUTS` attempts for an order.
    """
    attempt = ledger.start_receipt(order_id)
    if attempt <= RECEIPT_TIMEOUTS:
        ledger.end_receipt(order_id, "TimeoutError")
        raise TimeoutError(f"mail server timed out on attempt {attempt}")
    ledger.end_receipt(order_id, "sent")
    return f"receipt of order {order_id} sent to {email}"


@app.task(
    name="shop.notify_warehouse",
    base=IdempotentTask,
    idempotency_key="warehouse:{order_id}",
    dlq_max_retries=2,
)
def notify_warehouse(order_id: int) -> str:
    """Tell the warehouse to pack ``order_id``; its API is down for good.

    No Celery retries: the first failure is final, so the task lands in the dead-letter table,
    whose sweep tries it ``dlq_max_retries`` more times before marking it ``permanent_failure``.

    Raises:
        ConnectionError: always.
    """
    attempt = ledger.start("shop.notify_warehouse", order_id)
    raise ConnectionError(f"warehouse API unreachable (attempt {attempt})")


@app.task(
    name="shop.book_courier",
    base=IdempotentTask,
    autoretry_for=(ConnectionError,),
    max_retries=1,
    default_retry_delay=0.1,
    dlq_max_retries=2,
)
def book_courier(order_id: int) -> dict[str, Any]:
    """Book a courier for ``order_id``; the courier's API is down for :data:`COURIER_OUTAGE` tries.

    Celery retries a :class:`ConnectionError` once, which is not enough: the task fails for good,
    lands in the dead-letter table, and succeeds when the sweep re-publishes it.

    Returns:
        The booking, with a fresh ``tracking`` number (so two real bookings never look alike).

    Raises:
        ConnectionError: on the first :data:`COURIER_OUTAGE` attempts for an order.
    """
    attempt = ledger.start("shop.book_courier", order_id)
    if attempt <= COURIER_OUTAGE:
        raise ConnectionError(f"courier API unreachable (attempt {attempt})")
    return {"tracking": f"trk_{uuid.uuid4().hex[:10]}", "order_id": order_id}
