"""Every SQL statement of the dead-letter queue, as named SQLAlchemy Core builders."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Delete,
    Select,
    Update,
    bindparam,
    case,
    delete,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.elements import BindParameter, ColumnElement

from .schema import dead_letters, schema_versions

PENDING, RETRYING, SUCCEEDED, PERMANENT_FAILURE = (
    "pending",
    "retrying",
    "succeeded",
    "permanent_failure",
)
#: Options entry naming the app whose queue wrote the row (see :func:`in_scope`).
SCOPE_OPTION = "dead_letter_scope"


def insert_dead_letter(row: dict[str, Any]) -> Insert:
    """Add one dead letter (fails on a repeated ``failure_id``: the write is idempotent)."""
    return insert(dead_letters).values(**row)


def select_by_id(item_id: str) -> Select[Any]:
    """One dead letter by id."""
    return select(dead_letters).where(dead_letters.c.id == item_id)


def select_by_failure(failure_id: str) -> Select[Any]:
    """The dead letter written for one failed delivery."""
    return select(dead_letters).where(dead_letters.c.failure_id == failure_id)


def withdraw(failure_id: str) -> Delete:
    """Delete the dead letter of one failed delivery while no retry of it was sent: ``pending``,
    or ``permanent_failure`` as written (no retries allowed, arguments kept as text)."""
    return delete(dead_letters).where(
        dead_letters.c.failure_id == failure_id,
        dead_letters.c.status.in_((PENDING, PERMANENT_FAILURE)),
        dead_letters.c.retry_count == 0,
    )


def select_due_ids(
    now: datetime,
    limit: int,
    framework: str = "celery",
    skip_locked: bool = True,
    scoped: ColumnElement[bool] | None = None,
) -> Select[Any]:
    """Ids of one framework's due pending items (those ``scoped`` lets in, when given), oldest
    due first, skipping rows another sweep has locked where the database can (``skip_locked``,
    see :func:`skips_locked_rows`)."""
    due = (
        select(dead_letters.c.id)
        .where(
            dead_letters.c.status == PENDING,
            dead_letters.c.framework == framework,
            dead_letters.c.next_retry_at <= now,
        )
        .order_by(dead_letters.c.next_retry_at)
        .limit(limit)
    )
    if scoped is not None:
        due = due.where(scoped)
    return due.with_for_update(skip_locked=True) if skip_locked else due


def in_scope(scope: str | None, runs: Collection[str], dialect: Dialect) -> ColumnElement[bool]:
    """The rows a sweep of app ``scope`` takes from a table apps share: its own app's, those no
    app named (written before rows were named, or by a queue that names none), and another
    app's of a task it runs itself (``runs``: an app renamed takes its old name's rows). Never
    another app's row of a task it does not know: its worker would refuse it as unknown, a
    retry used each time. A sweep of an app without a name (``None``) takes the rows no app
    named and those of its tasks."""
    written_by = _written_scope(dialect)
    # Rendered in the statement, not bound one by one: an app may register more tasks than
    # an old SQLite takes parameters (999).
    runs_here: BindParameter[list[str]] = bindparam(
        "runs", sorted(runs), expanding=True, literal_execute=True
    )
    taken: list[ColumnElement[bool]] = [
        written_by.is_(None),
        dead_letters.c.task_name.in_(runs_here),
    ]
    if scope is not None:
        taken.append(written_by == scope)
    return or_(*taken)


def _written_scope(dialect: Dialect) -> ColumnElement[Any]:
    value: ColumnElement[Any] = dead_letters.c.options[SCOPE_OPTION].as_string()
    if dialect.name == "sqlite":
        # SQLite keeps any text in a JSON column (a row edited by hand), and JSON_EXTRACT of one
        # that does not parse fails the whole statement: such a row reads as named by none.
        return case((func.json_valid(dead_letters.c.options) == 1, value), else_=None)
    return value


def skips_locked_rows(dialect: Dialect) -> bool:
    """Whether a database takes ``FOR UPDATE SKIP LOCKED``: PostgreSQL does, MariaDB from 10.6
    and MySQL from 8.0.1 (older ones refuse the statement); SQLite has no row locks to skip.
    Without it, sweeps still never take one item twice (:func:`claim_for_sweep` marks only
    items still pending and due, and each sweep reads back its own), they only meet more
    often."""
    if dialect.name not in ("mysql", "mariadb"):
        return True
    version = tuple(part for part in dialect.server_version_info or () if isinstance(part, int))
    return version >= ((10, 6) if getattr(dialect, "is_mariadb", False) else (8, 0, 1))


def claim_for_sweep(ids: Sequence[str], sweep_id: str, now: datetime) -> Update:
    """Mark the given items ``retrying`` for one sweep, only those still pending and due: where
    the server locks no rows (SQLite, older MySQL and MariaDB), another sweep may have taken
    one since it was picked, and sent it, and its retry failed, putting it off again."""
    return (
        update(dead_letters)
        .where(
            dead_letters.c.id.in_(ids),
            dead_letters.c.status == PENDING,
            dead_letters.c.next_retry_at <= now,
        )
        .values(status=RETRYING, sweep_id=sweep_id, updated_at=now)
    )


def select_swept(sweep_id: str) -> Select[Any]:
    """The items one sweep took."""
    return (
        select(dead_letters)
        .where(dead_letters.c.sweep_id == sweep_id)
        .order_by(dead_letters.c.next_retry_at)
    )


def recover_stuck(
    stuck_before: datetime,
    now: datetime,
    due: datetime,
    framework: str | None,
    scoped: ColumnElement[bool] | None = None,
) -> Update:
    """Return items ``retrying`` since before ``stuck_before`` to ``pending``, due at ``due``
    (only ``framework``'s, when given, and those ``scoped`` lets in: each sweep judges its own
    rows by its own timeout).

    The sweep that sent the item stays named on the row: should that run be alive after all
    (its renewals failed while the database was down), it takes the row back as it renews it,
    and its outcome still counts (see :func:`renew_retrying`)."""
    stuck = (dead_letters.c.status == RETRYING) & (dead_letters.c.updated_at < stuck_before)
    if framework is not None:
        stuck = stuck & (dead_letters.c.framework == framework)
    if scoped is not None:
        stuck = stuck & scoped
    return (
        update(dead_letters).where(stuck).values(status=PENDING, next_retry_at=due, updated_at=now)
    )


def unclaim(
    item_id: str, now: datetime, due: datetime, taken: tuple[str | None, datetime] | None = None
) -> Update:
    """Return one ``retrying`` item to ``pending``, due at ``due``; with ``taken`` (the sweep id
    and time a sweep took it with), only while no run has renewed it since."""
    held = (dead_letters.c.id == item_id) & (dead_letters.c.status == RETRYING)
    if taken is not None:
        sweep_id, taken_at = taken
        unrenewed = dead_letters.c.updated_at == taken_at
        held = held & (dead_letters.c.sweep_id == sweep_id) & unrenewed
    return (
        update(dead_letters)
        .where(held)
        .values(status=PENDING, next_retry_at=due, sweep_id=None, updated_at=now)
    )


def mark_succeeded(item_id: str, now: datetime, sweep_id: str | None = None) -> Update:
    """Mark an item ``succeeded`` (from ``retrying`` or ``pending``), by the run that the sweep
    ``sweep_id`` sent, when given (kept on the row: a redelivery of that very message is told
    from another sweep's copy by it)."""
    values: dict[str, Any] = {"status": SUCCEEDED, "next_retry_at": None, "updated_at": now}
    if sweep_id is not None:
        values["sweep_id"] = sweep_id
    return (
        update(dead_letters)
        .where(dead_letters.c.id == item_id, dead_letters.c.status.in_((RETRYING, PENDING)))
        .values(**values)
    )


def give_up(item_id: str, error_message: str, now: datetime, sweep_id: str | None) -> Update:
    """Make a ``retrying`` item (held by the sweep ``sweep_id``, when given) a
    ``permanent_failure`` with ``error_message``."""
    held = dead_letters.c.status == RETRYING
    if sweep_id is not None:
        held = held & (dead_letters.c.sweep_id == sweep_id)
    return (
        update(dead_letters)
        .where(dead_letters.c.id == item_id, held)
        .values(
            status=PERMANENT_FAILURE,
            error_message=error_message,
            next_retry_at=None,
            sweep_id=None,
            updated_at=now,
        )
    )


def record_retry_failure(
    item_id: str,
    values: dict[str, Any],
    read_sweep_id: str | None,
    read_retry_count: int,
    read_status: str = RETRYING,
) -> Update:
    """Write the outcome of a failed re-publication of a ``retrying`` item (or of one made
    due again while its run was alive: see :func:`recover_stuck`), only if it is still as it
    was read (the same status, the same sweep holding it, at the same count)."""
    same_sweep = (
        dead_letters.c.sweep_id.is_(None)
        if read_sweep_id is None
        else dead_letters.c.sweep_id == read_sweep_id
    )
    return (
        update(dead_letters)
        .where(
            dead_letters.c.id == item_id,
            dead_letters.c.status == read_status,
            same_sweep,
            dead_letters.c.retry_count == read_retry_count,
        )
        .values(**values)
    )


def renew_retrying(item_id: str, sweep_id: str | None, now: datetime) -> Update:
    """Mark a ``retrying`` item (of ``sweep_id``, when given) as alive at ``now``: its run
    began (or a retry of it waits until then). A later time already set stays (a retry's
    countdown, against a renewal of the run that made it finishing after it).

    With ``sweep_id``, an item made due again as stuck while that sweep's run was alive (see
    :func:`recover_stuck`), and not sent again since, is ``retrying`` again: no sweep sends it
    a second time."""
    if sweep_id is None:
        held = (dead_letters.c.id == item_id) & (dead_letters.c.status == RETRYING)
    else:
        held = (
            (dead_letters.c.id == item_id)
            & dead_letters.c.status.in_((RETRYING, PENDING))
            & (dead_letters.c.sweep_id == sweep_id)
        )
    later = case((dead_letters.c.updated_at > now, dead_letters.c.updated_at), else_=now)
    return update(dead_letters).where(held).values(status=RETRYING, updated_at=later)


def retry_now(item_id: str, now: datetime) -> Update:
    """Make an item (of any status but ``retrying``) pending and due at once."""
    return (
        update(dead_letters)
        .where(dead_letters.c.id == item_id, dead_letters.c.status != RETRYING)
        .values(status=PENDING, next_retry_at=now, sweep_id=None, updated_at=now)
    )


def select_items(status: str | None, task_name: str | None, limit: int) -> Select[Any]:
    """Items, newest first, optionally of one status and one task."""
    query = select(dead_letters).order_by(dead_letters.c.created_at.desc()).limit(limit)
    if status is not None:
        query = query.where(dead_letters.c.status == status)
    if task_name is not None:
        query = query.where(dead_letters.c.task_name == task_name)
    return query


def count_by_status() -> Select[Any]:
    """How many items each status has."""
    return select(dead_letters.c.status, func.count()).group_by(dead_letters.c.status)


def purge(status: str | None, older_than: datetime | None) -> Delete:
    """Delete items of a status and/or last updated before a moment."""
    query = delete(dead_letters)
    if status is not None:
        query = query.where(dead_letters.c.status == status)
    if older_than is not None:
        query = query.where(dead_letters.c.updated_at < older_than)
    return query


def select_schema_version(component: str) -> Select[Any]:
    """The schema version a database records for a component."""
    return select(schema_versions.c.version).where(schema_versions.c.component == component)


def insert_schema_version(component: str, version: int) -> Insert:
    """Record a component's schema version."""
    return insert(schema_versions).values(component=component, version=version)


def advance_schema_version(component: str, from_version: int) -> Update:
    """Record that a component moved on from ``from_version`` (no row: another process did)."""
    return (
        update(schema_versions)
        .where(schema_versions.c.component == component, schema_versions.c.version == from_version)
        .values(version=from_version + 1)
    )
