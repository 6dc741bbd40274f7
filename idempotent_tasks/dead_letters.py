"""Celery's side of the dead-letter queue: writing failures, the sweep task and its beat entry."""

from __future__ import annotations

import json
import logging
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

from celery import Celery, shared_task
from celery._state import connect_on_app_finalize
from celery.exceptions import SoftTimeLimitExceeded
from celery.utils.log import get_task_logger

from . import defaults, signals
from .app_store import dlq_for, store_for
from .broker_errors import broker_cannot_take
from .dlq import DeadLetter, Failure, renewal
from .dlq.arguments import (
    as_table_json,
    from_table_json,
    restored_arguments,
)
from .dlq.items import ARGS_LOSSY
from .dlq.queue import SWEEP_BATCH
from .dlq.sweep import CannotResend, resend_due
from .errors import CorruptRecord, SchemaVersionError, StoreUnavailable
from .heartbeat import RETRY_AFTER_ERROR
from .keys import validate_key
from .pickups import republish_lost
from .settings import app_setting
from .stores.base import remove_expired_records
from .worker_request import request_header

logger = get_task_logger(__name__)
module_logger = logging.getLogger(__name__)

SWEEP_TASK = "idempotent_tasks.retry_dead_letters"
#: Header of a re-published dead letter: the id of its row.
DEAD_LETTER_HEADER = "idempotency_dead_letter_id"
#: ... and the sweep that published it (its failure counts only while that sweep holds the row).
DEAD_LETTER_SWEEP_HEADER = "idempotency_dead_letter_sweep"
#: Header of a message whose final failure still has to be written (the database was down).
UNWRITTEN_FAILURE_HEADER = "idempotency_unwritten_failure"
#: Header of such a message whose failure Celery has reported already (a call killed at its
#: hard time limit): writing the dead letter ends it quietly, not as a second failure.
FAILURE_REPORTED_HEADER = "idempotency_failure_reported"
#: Header of a quiet message that only marks its dead letter succeeded (the database was down
#: when its retry succeeded): it runs no body.
UNWRITTEN_SUCCESS_HEADER = "idempotency_unwritten_success"


def dead_letter_headers(request: Any) -> dict[str, Any]:
    """The headers naming the dead letter a request retries (its row, its sweep), to carry
    into the call's next message."""
    headers: dict[str, Any] = {}
    for name in (DEAD_LETTER_HEADER, DEAD_LETTER_SWEEP_HEADER):
        value = request_header(request, name)
        if value is not None:
            headers[name] = value
    return headers


def routing_options(delivery_info: dict[str, Any] | None) -> dict[str, Any]:
    """Where a message came from, as ``send_task`` options to send it back there."""
    info = delivery_info or {}
    exchange, routing_key = info.get("exchange") or "", info.get("routing_key")
    options: dict[str, Any] = {}
    if routing_key:
        if exchange in ("", routing_key):
            options["queue"] = routing_key
        else:
            options.update(exchange=exchange, routing_key=routing_key)
    if info.get("priority") is not None:
        options["priority"] = info["priority"]
    return options


def stamp_options(request: Any) -> dict[str, Any]:
    """The stamps of the message ``request`` runs, as ``apply_async`` options (Celery's
    stamping API: ``stamped_headers`` names them, each an option of its own)."""
    stamps = getattr(request, "stamps", None) or {}
    names = [name for name in getattr(request, "stamped_headers", None) or () if name in stamps]
    return {"stamped_headers": names, **{name: stamps[name] for name in names}} if names else {}


def _json_stamp_options(request: Any) -> dict[str, Any]:
    """:func:`stamp_options` that JSON holds as they are (a stamp it cannot is left out)."""
    stamps = stamp_options(request)
    names = [name for name in stamps.get("stamped_headers", ()) if _plain_json(stamps[name])]
    return {"stamped_headers": names, **{name: stamps[name] for name in names}} if names else {}


def _plain_json(value: Any) -> bool:
    # The standard library's JSON, which the table's column writes, not kombu's (the pickup
    # guard's check): kombu's gives datetimes back too, and a row holding one would not write.
    try:
        return bool(json.loads(json.dumps(value)) == value)
    except (TypeError, ValueError):
        return False


#: Options of a dead letter holding signatures (kept in the table's JSON form).
CANVAS_OPTIONS = ("link", "chain")


def continuation_options(request: Any) -> dict[str, Any]:
    """The options of the call ``request`` runs that its dead letter keeps, so that a retry
    that succeeds goes on as the call would have: its callbacks (``link``), the rest of its
    chain, its time limits, its shadow name, its root and parent ids, and stamps. Its errbacks
    ran when it failed, and its expiry will have passed: those are not kept; nor are callbacks
    or a chain JSON cannot hold (a pickle-serialized canvas), which a warning says, nor a stamp
    JSON cannot hold."""
    time_limit, soft_time_limit = getattr(request, "timelimit", None) or (None, None)
    wanted = {
        "link": getattr(request, "callbacks", None),
        "chain": getattr(request, "chain", None),
        "time_limit": time_limit,
        "soft_time_limit": soft_time_limit,
        "shadow": getattr(request, "shadow", None),
        "root_id": getattr(request, "root_id", None),
        "parent_id": getattr(request, "parent_id", None),
    }
    # First: a stamp takes no option of the dead letter's own over.
    stamps = _json_stamp_options(request)
    kept = {name: value for name, value in wanted.items() if value}
    try:
        stored = as_table_json(kept)
    except (TypeError, ValueError):
        module_logger.warning(
            "its callbacks or chain are not JSON: a retry of its dead letter will not run them"
        )
        plain = {name: value for name, value in kept.items() if name not in CANVAS_OPTIONS}
        return {**stamps, **plain}
    return {**stamps, **stored}


def failure_options(request: Any, faithful: bool) -> dict[str, Any]:
    """The options a call's dead letter keeps: how it goes on, and where it was routed
    (``faithful``: its arguments are kept exactly, else the sweep refuses to send it again)."""
    # Routing last: a stamp named like a routing option does not move the retry elsewhere.
    options = {**continuation_options(request), **routing_options(request.delivery_info)}
    if not faithful:
        options[ARGS_LOSSY] = True
    return options


def failure_id_of(task_id: str, retries: int) -> str:
    """The ``failure_id`` of a failed delivery: its task id and how many retries it counts."""
    return f"{task_id}:{retries}"


def write_failure(
    app: Any,
    failure: Failure,
    dead_letter_id: str | None,
    sweep_id: str | None = None,
    *,
    only_on_row: bool = False,
) -> str | None:
    """Record a final failure: a new row, or the next failure of a re-published row (of the
    sweep ``sweep_id``, when given); with ``only_on_row`` (a task whose dead-letter queue is
    off), only the latter.

    Returns the row's id (``None``: no row). Raises StoreUnavailable when the database cannot
    be written.
    """
    item = dlq_for(app).record_failure(failure, dead_letter_id, sweep_id, only_on_row=only_on_row)
    if item is None:
        return None
    _log_item(item)
    return item.id


def _log_item(item: DeadLetter) -> None:
    signals.dead_letter_written.send(task_name=item.task_name, status=item.status.value)
    logger.error(
        "dead-lettered as %s: %s, %s of %s retries used, next try %s",
        item.id,
        item.status.value,
        item.retry_count,
        item.max_retries,
        item.next_retry_at.isoformat() if item.next_retry_at else "never",
    )


def renew_retrying(
    app: Any, dead_letter_id: str, sweep_id: str | None, waits_for: float = 0.0
) -> bool:
    """A re-published dead letter's run begins, or goes on: its row is not stuck (so a sweep
    does not send it again while it runs, or while its own retry waits ``waits_for`` seconds
    for its countdown). Whether the row may still be this sweep's ``retrying`` one: a database
    error is logged, and counts as yes."""
    return renewal.renew_retrying(
        lambda: dlq_for(app), dead_letter_id, sweep_id, SoftTimeLimitExceeded, waits_for
    )


def retrying_kept_alive(app: Any, request: Any) -> AbstractContextManager[None]:
    """While the body of a re-published dead letter runs, renew its row every third of
    ``idempotency_dlq_retrying_timeout``: a run longer than that is not taken for a stuck row
    and sent again, uncounted and ahead of its backoff. Nothing for a call that is no dead
    letter's retry."""
    dead_letter_id = request_header(request, DEAD_LETTER_HEADER)
    if dead_letter_id is None:
        return nullcontext()
    return renewal.kept_retrying(
        lambda: dlq_for(app),
        dead_letter_id,
        request_header(request, DEAD_LETTER_SWEEP_HEADER),
        float(app_setting(app.conf, "idempotency_dlq_retrying_timeout")),
    )


def readable_row(app: Any, dead_letter_id: str) -> DeadLetter | None:
    """The row of ``dead_letter_id``, or ``None`` when there is none here (purged, or another
    host's own default table) or it cannot be read (the database down: logged)."""
    try:
        return dlq_for(app).get(str(dead_letter_id))
    except (StoreUnavailable, CorruptRecord, SchemaVersionError) as exc:
        module_logger.warning("could not read dead letter %s: %s", dead_letter_id, exc)
        return None


def mark_succeeded(app: Any, dead_letter_id: str, sweep_id: str | None = None) -> bool:
    """A re-published dead letter (sent by the sweep ``sweep_id``) succeeded: mark its row.
    Whether it was written; a database error is logged."""
    try:
        dlq_for(app).mark_succeeded(dead_letter_id, sweep_id)
    except StoreUnavailable as exc:
        module_logger.warning("could not mark dead letter %s succeeded: %s", dead_letter_id, exc)
        return False
    return True


def record_unrun_retry(
    app: Any, dead_letter_id: str, sweep_id: str | None, error_type: str, how: str
) -> None:
    """A re-published dead letter that the worker ended without running its code (revoked,
    terminated, its task unknown there): record that on its row as a failed retry (of the sweep
    ``sweep_id``). Left ``retrying``, the row would be sent again once its timeout passed,
    with no retry used. A database error is logged."""
    try:
        dlq_for(app).record_retry_failure(str(dead_letter_id), error_type, how, None, sweep_id)
    except (StoreUnavailable, CorruptRecord, SchemaVersionError) as exc:
        module_logger.warning(
            "could not record %s on dead letter %s: %s", error_type, dead_letter_id, exc
        )


def republish(app: Any, item: DeadLetter) -> None:
    """Send a dead letter's task again: same name, id, arguments, key and routing.

    Raises:
        CannotResend: its arguments are kept only as text, or do not read back; its key is
            none a worker would run a call under.
    """
    if item.options.get(ARGS_LOSSY):
        raise CannotResend("its arguments were not JSON and are kept only as text")
    try:
        args, kwargs = restored_arguments(item.args, item.kwargs)
        if item.idempotency_key is not None:
            # A row an older version wrote, or one edited by hand: the worker would refuse it.
            validate_key(item.idempotency_key)
    except ValueError as exc:  # ArgumentsUnreadable is one
        raise CannotResend(str(exc)) from exc
    headers: dict[str, Any] = {DEAD_LETTER_HEADER: item.id}
    if item.sweep_id is not None:
        headers[DEAD_LETTER_SWEEP_HEADER] = item.sweep_id
    if item.idempotency_key is not None:
        headers["idempotency_key"] = item.idempotency_key
    options = dict(item.options)
    for name in CANVAS_OPTIONS:
        if options.get(name):
            options[name] = from_table_json(options[name])
    # Its own place in a workflow, not the sweep's: no child of the sweep task, and the root
    # (else itself) and parent the call had (one that had none gets the sweep as parent).
    options.setdefault("root_id", item.task_id)
    app.send_task(
        item.task_name,
        args=args,
        kwargs=kwargs,
        task_id=item.task_id,
        headers=headers,
        add_to_parent=False,
        # Said outright: send_task would give it the task's own expiry, counted from now, and
        # a retry waiting in a long queue would expire unrun (on RabbitMQ, dropped unseen).
        expires=options.pop("expires", None),
        **options,
    )


@shared_task(name=SWEEP_TASK, bind=True, ignore_result=False)  # type: ignore[untyped-decorator]
def retry_dead_letters(self: Any, batch: int = SWEEP_BATCH) -> int:
    """Re-publish every due dead letter, in batches; returns how many were re-published.

    Runs from beat every ``idempotency_dlq_poll_interval`` seconds. Items still ``retrying``
    after ``idempotency_dlq_retrying_timeout`` (their sweep died) are made due again first.
    The same sweep publishes again keyed messages the broker lost (see
    :mod:`idempotent_tasks.pickups`) and removes expired claims from SQL stores.
    """
    app = self.app
    republish_lost(app, store_for(app))
    _clean_expired_claims(app)
    queue = dlq_for(app)
    runs = frozenset(app.tasks)  # another app's rows of these are this app's to send too
    timeout = float(app_setting(app.conf, "idempotency_dlq_retrying_timeout"))
    recovered = queue.recover_stuck(
        timedelta(seconds=timeout), framework="celery", runs=runs, grace=_recovery_grace(app)
    )
    if recovered:
        logger.warning("%s dead letters were stuck in retrying and are due again", recovered)
    published = resend_due(
        queue,
        lambda item: republish(app, item),
        framework="celery",
        batch=batch,
        retry_delay=float(app_setting(app.conf, "idempotency_dlq_poll_interval")),
        unreachable=broker_cannot_take,
        interrupted=(SoftTimeLimitExceeded,),
        runs=runs,
    )
    _count_rows(queue)
    return published


def _recovery_grace(app: Any) -> timedelta:
    """How long a row made due again as stuck waits before it is sent again: a row is also
    "stuck" when the database was down longer than the timeout, its run's renewals lost. That
    run, or the copy that writes its outcome later, then reaches the row within this time
    (a renewal tried again within RETRY_AFTER_ERROR seconds, the copy every
    ``idempotency_dlq_write_retry_delay``), and the row is not sent a second time."""
    write_retry = float(app_setting(app.conf, "idempotency_dlq_write_retry_delay"))
    return timedelta(seconds=2 * write_retry + RETRY_AFTER_ERROR)


def _count_rows(queue: Any) -> None:
    """Tell metrics how many rows each status has (one cheap query per sweep, not per task)."""
    try:
        counts = queue.stats()
    except StoreUnavailable:
        return
    signals.dead_letters_counted.send(counts=counts)


def _clean_expired_claims(app: Any) -> None:
    """Stores that do not expire rows by themselves (SQL) are swept here, cheaply."""
    remove_expired_records(store_for(app))


@connect_on_app_finalize  # type: ignore[untyped-decorator]
def _add_beat_entry(app: Celery) -> None:
    """Schedule the sweep on every app that loads idempotent_tasks (``None`` disables it)."""
    interval = app.conf.get("idempotency_dlq_poll_interval", defaults.DLQ_POLL_INTERVAL)
    if interval is None:
        return
    app.add_periodic_task(
        float(interval),
        app.signature(SWEEP_TASK),
        name=SWEEP_TASK,
    )
