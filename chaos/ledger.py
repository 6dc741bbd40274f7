"""The chaos run's side ledger: an append-only SQLite file (WAL) apart from the product's stores.

Worker processes, the producer and the driver append events to it; the audit reads them back.
SQLite in WAL mode survives every fault the run injects (a SIGKILLed writer's transaction is
rolled back, nothing else is lost) and does not depend on the Redis or PostgreSQL servers the
run restarts.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Seconds a writer waits for another writer's lock (a frozen writer holds it for seconds).
BUSY_TIMEOUT_S = 60.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    key TEXT,
    exec_id TEXT,
    pid INTEGER NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_key ON events (key, kind);
CREATE INDEX IF NOT EXISTS events_by_kind ON events (kind);
"""


@dataclass(frozen=True, kw_only=True)
class Event:
    """One ledger entry: when, what, for which key and body execution, by which process."""

    id: int
    ts: float
    kind: str
    key: str | None
    exec_id: str | None
    pid: int
    data: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class NewEvent:
    """An entry to append (see :meth:`Ledger.write_many`)."""

    kind: str
    key: str | None = None
    exec_id: str | None = None
    data: dict[str, Any] | None = None
    ts: float | None = None


class Ledger:
    """Appends events to, and reads them from, one SQLite file; one connection per process."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._connection: sqlite3.Connection | None = None
        self._pid = 0

    def create(self) -> None:
        """Create the file and its table (the driver does it once, before any worker starts)."""
        with self._lock:
            self._connect().executescript(SCHEMA)

    def write(
        self, kind: str, /, *, key: str | None = None, exec_id: str | None = None, **data: Any
    ) -> None:
        """Append one event, now, from this process."""
        self.write_many([NewEvent(kind=kind, key=key, exec_id=exec_id, data=data)])

    def write_many(self, events: Iterable[NewEvent]) -> None:
        """Append events in one transaction (retrying while the file is locked)."""
        pid = os.getpid()
        rows = [
            (
                event.ts if event.ts is not None else time.time(),
                event.kind,
                event.key,
                event.exec_id,
                pid,
                json.dumps(event.data or {}, sort_keys=True, default=str),
            )
            for event in events
        ]
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                with self._lock:
                    connection = self._connect()
                    with connection:
                        connection.executemany(
                            "INSERT INTO events (ts, kind, key, exec_id, pid, data) "
                            "VALUES (?, ?, ?, ?, ?, ?)",
                            rows,
                        )
                return
            except sqlite3.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def count(self, key: str, kind: str) -> int:
        """How many events of ``kind`` the ledger holds for ``key``."""
        with self._lock:
            row = (
                self._connect()
                .execute("SELECT COUNT(*) FROM events WHERE key = ? AND kind = ?", (key, kind))
                .fetchone()
            )
        return int(row[0])

    def keys_with(self, kind: str) -> set[str]:
        """Keys that have at least one event of ``kind``."""
        with self._lock:
            rows = (
                self._connect()
                .execute(
                    "SELECT DISTINCT key FROM events WHERE kind = ? AND key IS NOT NULL", (kind,)
                )
                .fetchall()
            )
        return {str(row[0]) for row in rows}

    def events(self, kind: str | None = None, last: int | None = None) -> list[Event]:
        """Every event (of ``kind``; only the ``last`` ones), in the order they were appended."""
        query = "SELECT id, ts, kind, key, exec_id, pid, data FROM events"
        params: tuple[object, ...] = ()
        if kind is not None:
            query += " WHERE kind = ?"
            params = (kind,)
        if last is not None:
            query = f"SELECT * FROM ({query} ORDER BY id DESC LIMIT ?)"
            params = (*params, last)
        with self._lock:
            rows = self._connect().execute(query + " ORDER BY id", params).fetchall()
        return [
            Event(
                id=int(row[0]),
                ts=float(row[1]),
                kind=str(row[2]),
                key=row[3],
                exec_id=row[4],
                pid=int(row[5]),
                data=json.loads(row[6]),
            )
            for row in rows
        ]

    def close(self) -> None:
        """Close this process's connection."""
        with self._lock:
            if self._connection is not None and self._pid == os.getpid():
                self._connection.close()
            self._connection = None

    def _connect(self) -> sqlite3.Connection:
        # A connection inherited through fork() belongs to the parent: open our own.
        if self._connection is None or self._pid != os.getpid():
            connection = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
            connection.execute("PRAGMA journal_mode=WAL")
            # Durable against a killed process (what the run injects), not a power cut.
            connection.execute("PRAGMA synchronous=NORMAL")
            connection.isolation_level = "IMMEDIATE"
            self._connection = connection
            self._pid = os.getpid()
        return self._connection
