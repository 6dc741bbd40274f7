"""Claim store on any SQLAlchemy database: PostgreSQL, MySQL/MariaDB, SQLite.

A fresh key is claimed by one ``INSERT`` that does nothing on conflict. A key that has a row is
read, decided on exactly as the Redis script decides, and taken over (when allowed) by an
``UPDATE`` that only matches the owner and token it read: a compare-and-set, so two claimers
racing for an expired lease cannot both win, on any database, without locks. Released claims
keep their row (``status = released``) so fencing tokens keep growing. Times are POSIX seconds
from this process's clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Delete, Engine, Insert, Select, Update, delete, insert, select
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.exc import SQLAlchemyError

from ..dlq.engine import create_dlq_engine
from ..dlq.schema import CLAIMS_COMPONENT, CLAIMS_SCHEMA_VERSION, claims
from ..dlq.schema_setup import ensure_component
from ..errors import CorruptRecord, StoreUnavailable
from ..records import (
    ClaimRequest,
    ClaimResult,
    CompleteOutcome,
    EncodedResult,
    Outcome,
    Record,
    Status,
)

PROCESSING, COMPLETED, RELEASED = "processing", "completed", "released"
#: Compare-and-set rounds a claim tries before calling the key contended.
MAX_CLAIM_ROUNDS = 10


# -- statements ---------------------------------------------------------------------------


def insert_if_absent(dialect: str, row: dict[str, Any]) -> Insert:
    """Insert a claim row unless one exists (no error, no change on conflict).

    PostgreSQL and SQLite return the id when a row was inserted (their drivers' row counts are
    not reliable for INSERT); MySQL's affected-rows count says it.
    """
    if dialect == "postgresql":
        on_pg = postgresql.insert(claims).values(**row).on_conflict_do_nothing()
        return on_pg.returning(claims.c.id)
    if dialect == "sqlite":
        on_sqlite = sqlite.insert(claims).values(**row).on_conflict_do_nothing()
        return on_sqlite.returning(claims.c.id)
    if dialect in ("mysql", "mariadb"):
        return mysql.insert(claims).values(**row).prefix_with("IGNORE")
    return insert(claims).values(**row)


def select_claim(claim_id: str) -> Select[Any]:
    """A claim row by id."""
    return select(claims).where(claims.c.id == claim_id)


def replace_if_unchanged(claim_id: str, owner: str, token: int, values: dict[str, Any]) -> Update:
    """Overwrite a row only if it still has the owner and token read (compare-and-set)."""
    return (
        claims.update()
        .where(claims.c.id == claim_id, claims.c.owner == owner, claims.c.token == token)
        .values(**values)
    )


def update_held(claim_id: str, owner: str, token: int, values: dict[str, Any]) -> Update:
    """Update a ``processing`` row held by ``owner`` with ``token``."""
    return (
        claims.update()
        .where(
            claims.c.id == claim_id,
            claims.c.owner == owner,
            claims.c.token == token,
            claims.c.status == PROCESSING,
        )
        .values(**values)
    )


def delete_claim(claim_id: str) -> Delete:
    """Delete a claim row whatever its state."""
    return delete(claims).where(claims.c.id == claim_id)


def delete_expired(before: float) -> Delete:
    """Delete rows whose expiry passed before ``before``."""
    return delete(claims).where(claims.c.expires_at < before)


# -- the store ----------------------------------------------------------------------------


class SqlStore:
    """A :class:`~idempotent_tasks.stores.base.Store` on a SQLAlchemy database.

    Args:
        url: SQLAlchemy URL (``postgresql+psycopg://``, ``mysql+pymysql://``, ``sqlite:///``).
        prefix: first part of every row id, as for the Redis store.
        clock: POSIX seconds (for tests).
    """

    def __init__(self, url: str, prefix: str, clock: Callable[[], float] = time.time) -> None:
        self.url = url
        self.prefix = prefix
        self.engine: Engine = create_dlq_engine(url)
        self.dialect = self.engine.dialect.name
        self._clock = clock
        self._schema_ready = False
        self._schema_lock = threading.Lock()

    def claim_id(self, storage_key: str) -> str:
        """The row id of a key."""
        return f"{self.prefix}:{storage_key}"

    def claim(self, request: ClaimRequest) -> ClaimResult:
        claim_id = self.claim_id(request.storage_key)
        # Each statement is its own short transaction: the compare-and-set needs no locks held
        # across statements, so concurrent claimers cannot deadlock (InnoDB would otherwise).
        for _ in range(MAX_CLAIM_ROUNDS):
            now = self._clock()
            fresh = self._processing_row(request, now, token=1, takeover=False)
            if self._rowcount(insert_if_absent(self.dialect, fresh)) == 1:
                return ClaimResult(outcome=Outcome.ACQUIRED, token=1)
            found = self._one(select_claim(claim_id))
            if found is None:
                continue  # deleted between the two statements: insert again
            decision = self._decide(request, found, now)
            if decision is not None:
                return decision
            token = int(found["token"]) + 1
            takeover = found["status"] == PROCESSING and found["expires_at"] > now
            values = self._processing_row(request, now, token=token, takeover=takeover)
            if takeover:
                values["created_at"] = found["created_at"]
            swap = replace_if_unchanged(claim_id, found["owner"], int(found["token"]), values)
            if self._rowcount(swap) == 1:
                return ClaimResult(outcome=Outcome.ACQUIRED, token=token, takeover=takeover)
        raise StoreUnavailable(f"claim of {request.storage_key!r} kept losing races; try again")

    def _decide(self, request: ClaimRequest, row: Any, now: float) -> ClaimResult | None:
        """The outcome for an existing row, or ``None`` when this claim may replace it."""
        live = row["status"] != RELEASED and row["expires_at"] > now
        if not live:
            return None
        if row["status"] == PROCESSING and row["owner"] == request.owner:
            return ClaimResult(outcome=Outcome.ACQUIRED, token=int(row["token"]))
        record = _record(request.storage_key, row)
        if request.validate and row["fingerprint"] != request.fingerprint:
            return ClaimResult(outcome=Outcome.MISMATCH, record=record)
        if row["status"] == COMPLETED:
            return ClaimResult(outcome=Outcome.COMPLETED, record=record)
        previous = request.previous_owner
        if (previous and row["owner"] == previous) or row["lease_expires_at"] <= now:
            return None
        return ClaimResult(outcome=Outcome.IN_PROGRESS, record=record)

    def complete(
        self, request: ClaimRequest, token: int, result: EncodedResult | None
    ) -> CompleteOutcome:
        claim_id = self.claim_id(request.storage_key)
        now = self._clock()
        done = {
            "status": COMPLETED,
            "updated_at": now,
            "expires_at": now + request.ttl_seconds,
            "result_cached": result is not None,
            "content_type": result.content_type if result else None,
            "content_encoding": result.content_encoding if result else None,
            "result": result.body if result else None,
        }
        if self._rowcount(update_held(claim_id, request.owner, token, done)) == 1:
            return CompleteOutcome.STORED
        found = self._one(select_claim(claim_id))
        if found is not None and found["owner"] == request.owner:
            if found["status"] == COMPLETED and int(found["token"]) == token:
                return CompleteOutcome.STORED  # a repeated completion
        if found is not None and found["status"] != RELEASED and found["expires_at"] > now:
            return CompleteOutcome.STALE
        # The claim vanished (expired, or forgotten): write the result anew, unless another
        # claimer took the key meanwhile.
        row = {**self._processing_row(request, now, token=token, takeover=False), **done}
        if found is None:
            inserted = self._rowcount(insert_if_absent(self.dialect, row))
        else:
            swap = replace_if_unchanged(claim_id, found["owner"], int(found["token"]), row)
            inserted = self._rowcount(swap)
        return CompleteOutcome.RECOVERED if inserted == 1 else CompleteOutcome.STALE

    def release(self, request: ClaimRequest, token: int) -> bool:
        values = {"status": RELEASED, "updated_at": self._clock()}
        claim_id = self.claim_id(request.storage_key)
        return self._rowcount(update_held(claim_id, request.owner, token, values)) == 1

    def extend(self, request: ClaimRequest, token: int) -> bool:
        now = self._clock()
        values = {
            "lease_expires_at": now + request.lease_seconds,
            "updated_at": now,
            "expires_at": now + request.lease_seconds + request.ttl_seconds,
        }
        claim_id = self.claim_id(request.storage_key)
        return self._rowcount(update_held(claim_id, request.owner, token, values)) == 1

    def get(self, storage_key: str) -> Record | None:
        row = self._one(select_claim(self.claim_id(storage_key)))
        if row is None or row["status"] == RELEASED or row["expires_at"] <= self._clock():
            return None
        return _record(storage_key, row)

    def forget(self, storage_key: str) -> bool:
        return self._rowcount(delete_claim(self.claim_id(storage_key))) > 0

    def cleanup(self, older_than: float = 0.0) -> int:
        """Delete rows that expired more than ``older_than`` seconds ago; how many."""
        return self._rowcount(delete_expired(self._clock() - older_than))

    def close(self) -> None:
        self.engine.dispose()

    def _processing_row(
        self, request: ClaimRequest, now: float, *, token: int, takeover: bool
    ) -> dict[str, Any]:
        return {
            "id": self.claim_id(request.storage_key),
            "key": request.key,
            "task_name": request.task_name,
            "status": PROCESSING,
            "owner": request.owner,
            "token": token,
            "takeover": takeover,
            "task_id": request.task_id,
            "fingerprint": request.fingerprint,
            "lease_expires_at": now + request.lease_seconds,
            "created_at": now,
            "updated_at": now,
            "expires_at": now + request.lease_seconds + request.ttl_seconds,
            "result_cached": False,
            "content_type": None,
            "content_encoding": None,
            "result": None,
        }

    def _rowcount(self, statement: Insert | Update | Delete) -> int:
        """Rows a statement wrote (counting returned rows where it returns any)."""
        with self._begin() as connection:
            result = connection.execute(statement)
            if result.returns_rows:
                return len(result.all())
            return int(result.rowcount)

    def _one(self, statement: Select[Any]) -> Any:
        with self._begin() as connection:
            return connection.execute(statement).mappings().one_or_none()

    @contextmanager
    def _begin(self) -> Iterator[Connection]:
        self._ensure_schema()
        try:
            with self.engine.begin() as connection:
                yield connection
        except SQLAlchemyError as exc:
            raise StoreUnavailable(f"SQL store error: {exc}") from exc

    def _ensure_schema(self) -> None:
        if self._schema_ready:
            return
        with self._schema_lock:
            if not self._schema_ready:
                ensure_component(
                    self.engine,
                    component=CLAIMS_COMPONENT,
                    version=CLAIMS_SCHEMA_VERSION,
                    tables=[claims],
                    what="claim store",
                )
                self._schema_ready = True


def _record(storage_key: str, row: Any) -> Record:
    try:
        result = None
        if row["result_cached"] and row["result"] is not None:
            result = EncodedResult(
                content_type=row["content_type"],
                content_encoding=row["content_encoding"],
                body=bytes(row["result"]),
            )
        return Record(
            storage_key=storage_key,
            key=row["key"],
            task_name=row["task_name"],
            status=Status(row["status"]),
            owner=row["owner"],
            token=int(row["token"]),
            task_id=row["task_id"],
            fingerprint=row["fingerprint"],
            lease_expires_at=float(row["lease_expires_at"]),
            created_at=float(row["created_at"]),
            updated_at=float(row["updated_at"]),
            expires_at=float(row["expires_at"]),
            result=result,
            result_cached=result is not None,
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise CorruptRecord(f"claim row of {storage_key!r} is unreadable: {exc}") from exc
