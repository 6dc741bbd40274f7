"""The SQL claim store's statements: one small SQLAlchemy Core builder each.

Dialect-dependent ones (the insert that does nothing on conflict, the pickup upsert, the server's
clock) pick their form by the engine's dialect name; ``tests/unit/test_claim_statements.py``
compiles them for each dialect.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from sqlalchemy import (
    Delete,
    Insert,
    Select,
    Update,
    and_,
    bindparam,
    delete,
    func,
    insert,
    literal_column,
    or_,
    select,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.types import Boolean

from ..dlq.schema import ExactText, claims, pickups

#: Whether the SQLite library this Python uses knows ``RETURNING`` (3.35 on).
SQLITE_RETURNING = sqlite3.sqlite_version_info >= (3, 35)

#: Row statuses (a released row is kept so fencing tokens keep growing).
QUEUED, PROCESSING, COMPLETED, RELEASED = "queued", "processing", "completed", "released"


def insert_if_absent(dialect: str, row: dict[str, Any]) -> Insert:
    """Insert a claim row unless one exists (no error, no change on conflict).

    PostgreSQL and SQLite return the id when a row was inserted (their drivers' row counts are
    not reliable for INSERT); MySQL's affected-rows count says it, and so does SQLite's before
    3.35, which has no ``RETURNING`` (Debian 11 and RHEL 9 ship 3.34): its count of changes is 0
    for an ignored conflict.
    """
    if dialect == "postgresql":
        on_pg = postgresql.insert(claims).values(**row).on_conflict_do_nothing()
        return on_pg.returning(claims.c.id)
    if dialect == "sqlite":
        on_sqlite = sqlite.insert(claims).values(**row).on_conflict_do_nothing()
        return on_sqlite.returning(claims.c.id) if SQLITE_RETURNING else on_sqlite
    if dialect in ("mysql", "mariadb"):
        return mysql.insert(claims).values(**row).prefix_with("IGNORE")
    return insert(claims).values(**row)


def select_claim(claim_id: str) -> Select[Any]:
    """A claim row by id."""
    return select(claims).where(claims.c.id == claim_id)


def lock_claim(claim_id: str) -> Select[Any]:
    """A claim row by id, locked for this transaction (``FOR UPDATE``; SQLite locks the whole
    database on its first write instead, and SQLAlchemy leaves the clause out there)."""
    return select(claims.c.id).where(claims.c.id == claim_id).with_for_update()


def replace_if_unchanged(claim_id: str, read: Any, values: dict[str, Any]) -> Update:
    """Overwrite a row only if it is still the row ``read`` (compare-and-set).

    Owner and token alone would not do: a completion, a release, a renewal or a new
    reservation keeps both but changes the status, the lease or the last update, and a
    takeover decided on the older row must not overwrite it.
    """
    return (
        claims.update()
        .where(
            claims.c.id == claim_id,
            claims.c.owner == read["owner"],
            claims.c.token == read["token"],
            claims.c.status == read["status"],
            claims.c.lease_expires_at == read["lease_expires_at"],
            claims.c.updated_at == read["updated_at"],
        )
        .values(**values)
    )


def update_held(
    claim_id: str, owner: str, token: int, now: float, values: dict[str, Any]
) -> Update:
    """Update a live ``processing`` row held by ``owner`` with ``token``."""
    held = _live_row(claim_id, PROCESSING, now, claims.c.owner == owner, claims.c.token == token)
    return claims.update().where(held).values(**values)


def settle_owed(claim_id: str, owner: str, now: float) -> Update:
    """Clear the debt of a live ``completed`` or ``processing`` row of ``owner`` that owes the
    message it took over (one row updated: it did)."""
    owing = and_(
        claims.c.id == claim_id,
        claims.c.status.in_((COMPLETED, PROCESSING)),
        claims.c.expires_at > now,
        claims.c.owner == owner,
        claims.c.owes_message.is_(True),
    )
    # updated_at too: a claim or completion that read the row before must not write its
    # older debt back (replace_if_unchanged compares it).
    return claims.update().where(owing).values(owes_message=False, updated_at=now)


def set_debt(claim_id: str, task_id: str, now: float, *, owes: bool) -> Update:
    """Set whether a key's live ``processing`` row owes the message of call ``task_id``, when
    its pickup row keeps that message and that call is not the row's own."""
    kept = select(pickups.c.id).where(_keeps_message_of(claim_id, task_id)).exists()
    others = _live_row(claim_id, PROCESSING, now, ~_of_task(claims.c.task_id, task_id), kept)
    return claims.update().where(others).values(owes_message=owes, updated_at=now)


def forget_claim(claim_id: str, now: float) -> Update:
    """Release a row whatever its state, keeping its token (the key's fencing counter)."""
    return claims.update().where(claims.c.id == claim_id).values(status=RELEASED, updated_at=now)


def delete_claim(claim_id: str) -> Delete:
    """Delete a row whatever its state (one that cannot be read)."""
    return delete(claims).where(claims.c.id == claim_id)


def delete_expired(before: float) -> Delete:
    """Delete rows whose expiry passed before ``before``."""
    return delete(claims).where(claims.c.expires_at < before)


def delete_orphan_pickups(before: float) -> Delete:
    """Delete pickups due before ``before`` whose claim row is gone (the cleanup deleted it).

    The due time is checked on the pickup row itself, so a reservation that writes the row
    anew meanwhile (due later) is never deleted by a statement that read the claims before.
    """
    claimed = select(claims.c.id).where(claims.c.id == pickups.c.id).exists()
    return delete(pickups).where((pickups.c.due_at < before) & ~claimed)


class _SameText(FunctionElement[bool]):
    """``column = value``, comparing the text exactly on every database (MySQL's and
    MariaDB's default collations ignore case, accents and trailing spaces: a call whose task
    id differs from another's only so would release or drop that call's reservation)."""

    type = Boolean()
    name = "same_text"
    inherit_cache = True


@compiles(_SameText)
def _same_text(element: _SameText, compiler: Any, **kw: Any) -> str:
    left, right = element.clauses
    return f"({compiler.process(left, **kw)} = {compiler.process(right, **kw)})"


@compiles(_SameText, "mysql")
@compiles(_SameText, "mariadb")
def _same_bytes(element: _SameText, compiler: Any, **kw: Any) -> str:
    # The column's utf8mb4 text as bytes, against the value sent as its UTF-8 bytes (as
    # ExactText sends it): whatever the connection's character set.
    left, right = element.clauses
    return f"(CAST({compiler.process(left, **kw)} AS BINARY) = {compiler.process(right, **kw)})"


def _of_task(column: Any, task_id: str) -> Any:
    """Rows whose ``column`` is ``task_id``, exactly."""
    return _SameText(column, bindparam(None, task_id, type_=ExactText(column.type.length)))


def _live_row(claim_id: str, status: str, now: float, *also: Any) -> Any:
    """The key's claim row, live and in ``status``, meeting the conditions ``also`` (the
    execution attempt or the call it is for, say)."""
    return and_(
        claims.c.id == claim_id, claims.c.status == status, claims.c.expires_at > now, *also
    )


def _keeps_message_of(claim_id: str, task_id: str) -> Any:
    """The key's pickup row, keeping the message of call ``task_id``."""
    return (pickups.c.id == claim_id) & _of_task(pickups.c.task_id, task_id)


def release_queued(claim_id: str, task_id: str, now: float) -> Update:
    """Release a live ``queued`` row reserved for ``task_id``."""
    live = _live_row(claim_id, QUEUED, now, _of_task(claims.c.task_id, task_id))
    return claims.update().where(live).values(status=RELEASED, updated_at=now)


def retime_queued(claim_id: str, task_id: str, now: float, due_at: float) -> Update:
    """Move the due time of a live ``queued`` row reserved for ``task_id``."""
    live = _live_row(claim_id, QUEUED, now, _of_task(claims.c.task_id, task_id))
    return claims.update().where(live).values(lease_expires_at=due_at, updated_at=now)


def delete_pickup_of_claimed(
    claim_id: str, task_id: str, now: float, *, processing: bool = True
) -> Delete:
    """Delete a key's pickup row of ``task_id``'s message while its live claim row is
    ``completed`` keeping that message for the guard (see ``SqlStore.complete``), or, with
    ``processing``, ``processing`` (for that call, or another one that took the key over); one
    statement: nothing can land between the check and the delete."""
    held = _live_row(claim_id, COMPLETED, now, ~_of_task(claims.c.task_id, task_id))
    if processing:
        held = held | _live_row(claim_id, PROCESSING, now)
    claimed = select(claims.c.id).where(held).exists()
    return delete(pickups).where(_keeps_message_of(claim_id, task_id) & claimed)


def select_processing(claim_id: str, task_id: str, now: float) -> Select[Any]:
    """The live ``processing`` row of ``task_id``, if there is one."""
    return select(claims.c.id).where(
        _live_row(claim_id, PROCESSING, now, _of_task(claims.c.task_id, task_id))
    )


def select_abandoned_or_keeping(claim_id: str, task_id: str, now: float) -> Select[Any]:
    """The key's live row, when it is a ``processing`` one whose owner's lease ended, or a
    ``completed`` one of another call than ``task_id``'s (whose message its pickup row may
    keep: see ``SqlStore.complete``)."""
    abandoned = _live_row(claim_id, PROCESSING, now, claims.c.lease_expires_at <= now)
    keeping = _live_row(claim_id, COMPLETED, now, ~_of_task(claims.c.task_id, task_id))
    return select(claims.c.id).where(abandoned | keeping)


def retime_pickup(claim_id: str, due_at: float, republished: int | None, task_id: str) -> Update:
    """Move the due time of a key's pickup row of ``task_id``'s message, and set its count of
    re-publications, when given."""
    mine = _keeps_message_of(claim_id, task_id)
    values: dict[str, Any] = {"due_at": due_at}
    if republished is not None:
        values["republished"] = republished
    return pickups.update().where(mine).values(**values)


def upsert_pickup(dialect: str, row: dict[str, Any]) -> Insert:
    """Write a pickup row, replacing any row of the same id."""
    changes = {name: value for name, value in row.items() if name != "id"}
    if dialect == "postgresql":
        on_pg = postgresql.insert(pickups).values(**row)
        return on_pg.on_conflict_do_update(index_elements=[pickups.c.id], set_=changes)
    if dialect == "sqlite":
        on_sqlite = sqlite.insert(pickups).values(**row)
        return on_sqlite.on_conflict_do_update(index_elements=[pickups.c.id], set_=changes)
    if dialect in ("mysql", "mariadb"):
        return mysql.insert(pickups).values(**row).on_duplicate_key_update(**changes)
    return insert(pickups).values(**row)


def select_due(
    prefix: str, now: float, limit: int, after: tuple[float, str] | None = None
) -> Select[Any]:
    """Pickup rows whose id starts with ``prefix``, due by ``now``, earliest first (then by
    id); only those after ``after`` (a due time and id) in that order, when given."""
    query = select(pickups).where(
        pickups.c.due_at <= now, pickups.c.id.startswith(f"{prefix}:", autoescape=True)
    )
    if after is not None:
        due_at, claim_id = after
        query = query.where(
            pickups.c.due_at >= due_at,  # (a bound the due-time index serves)
            or_(
                pickups.c.due_at > due_at,
                and_(pickups.c.due_at == due_at, pickups.c.id > claim_id),
            ),
        )
    return query.order_by(pickups.c.due_at, pickups.c.id).limit(limit)


def select_owed_pickup(claim_id: str) -> Select[Any]:
    """The pickup row of one claim, while the claim row owes its message (one statement)."""
    owed = select(claims.c.id).where(claims.c.id == claim_id, claims.c.owes_message.is_(True))
    return select(pickups).where(pickups.c.id == claim_id, owed.exists())


def select_kept_message_of(claim_id: str) -> Select[Any]:
    """The task id of the message a key's pickup row keeps (no row: none)."""
    return select(pickups.c.task_id).where(pickups.c.id == claim_id)


def select_pickup(claim_id: str) -> Select[Any]:
    """The pickup row of one claim."""
    return select(pickups).where(pickups.c.id == claim_id)


def _same_pickup(claim_id: str, republished: int, due_at: float) -> Any:
    # Count and due time change on every write of a pickup row (due times are exact doubles
    # on every dialect), so together they tell whether the row is still the one read.
    return (
        (pickups.c.id == claim_id)
        & (pickups.c.republished == republished)
        & (pickups.c.due_at == due_at)
    )


def bump_pickup(claim_id: str, republished: int, due_at: float, values: dict[str, Any]) -> Update:
    """Update a pickup row only if it is still the one read (compare-and-set)."""
    return pickups.update().where(_same_pickup(claim_id, republished, due_at)).values(**values)


def delete_pickup_if_unchanged(claim_id: str, republished: int, due_at: float) -> Delete:
    """Delete a pickup row only if it is still the one read."""
    return delete(pickups).where(_same_pickup(claim_id, republished, due_at))


def postpone_pickup(claim_id: str, due_at: float) -> Update:
    """Make a pickup row due at ``due_at`` whatever it holds (one that cannot be read)."""
    return pickups.update().where(pickups.c.id == claim_id).values(due_at=due_at)


def delete_pickup(claim_id: str) -> Delete:
    """Delete a pickup row whatever its state."""
    return delete(pickups).where(pickups.c.id == claim_id)


def select_server_time(dialect: str) -> Select[Any] | None:
    """The database server's clock as POSIX seconds (``None`` for SQLite: it has no server)."""
    if dialect == "postgresql":
        return select(func.extract("epoch", func.clock_timestamp()))
    if dialect in ("mysql", "mariadb"):
        # From UTC_TIMESTAMP, so that no session time zone (nor daylight-saving fold) is involved.
        micros = func.timestampdiff(
            literal_column("MICROSECOND"),
            "1970-01-01 00:00:00",
            func.utc_timestamp(literal_column("6")),
        )
        return select(micros * literal_column("0.000001"))
    return None
