"""``celery -A proj idempotency ...``: look after keys and dead letters from the shell."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import click
from celery.bin.base import CLIContext
from celery.exceptions import CeleryCommandException
from celery.platforms import EX_UNAVAILABLE

from . import cli_format, defaults
from .app_store import dlq_for, store_for, store_url
from .codec import ResultCodec
from .dead_letters import SWEEP_TASK
from .dlq import DeadLetter, DeadLetterQueue, DeadLetterStatus
from .dlq.arguments import first_line
from .dlq.items import ARGS_LOSSY
from .errors import CorruptRecord, SchemaVersionError, StoreUnavailable
from .keys import storage_key
from .records import Record, Status
from .setup_errors import SETUP_ERRORS
from .stores import MemoryStore, Store
from .urls import shown_url

STATUSES = click.Choice([status.value for status in DeadLetterStatus])


#: Units of ``--older-than``, in seconds.
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
#: Longest ``--older-than``: a thousand years.
MAX_DURATION = timedelta(days=365_000)


def parse_duration(
    _ctx: click.Context, _param: click.Parameter, value: str | None
) -> timedelta | None:
    """``7d``, ``12h``, ``30m``, ``3600s`` (or ``3600``), also weeks: ``2w``."""
    if value is None:
        return None
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", value.lower())
    if found is None:
        raise click.BadParameter(f"{value!r} is not a duration like 7d, 12h, 30m or 3600s")
    seconds = float(found[1]) * DURATION_UNITS[found[2] or "s"]
    if seconds > MAX_DURATION.total_seconds():
        # Further back than any date the databases (or Python) can hold.
        raise click.BadParameter(f"{value!r} is longer than {MAX_DURATION.days} days")
    return timedelta(seconds=seconds)


#: The most ``dlq list --limit`` takes (every database takes it as a row count).
MAX_LISTED = 1_000_000


@click.group(name="idempotency")
def idempotency() -> None:
    """Inspect and manage idempotency keys and the dead-letter table.

    Every command uses the stores of the app given with celery -A proj. A store that cannot be
    reached ends the command with exit code 69.
    """


# -- plumbing -------------------------------------------------------------------------------

_WARNED_NO_APP = "idempotent_tasks.warned_no_app"


def _app(ctx: click.Context) -> Any:
    """The Celery app of ``celery -A proj``; Celery's default app (warned) without ``-A``."""
    obj = ctx.find_object(CLIContext)
    if obj is None:
        raise click.UsageError("run this as a Celery subcommand: celery -A proj idempotency ...")
    if ctx.find_root().params.get("app") is None and not ctx.meta.get(_WARNED_NO_APP):
        ctx.meta[_WARNED_NO_APP] = True
        _warn("no app given (celery -A proj ...): using the default app and default stores")
    return obj.app


def _warn(message: str) -> None:
    click.echo(f"Warning: {message}", err=True)


@contextmanager
def _reaching(what: str, url: str) -> Iterator[None]:
    """Turn a store that cannot be used into a one-line error and exit code 69."""
    try:
        yield
    except (StoreUnavailable, SchemaVersionError) as exc:
        reason = first_line(exc)
        raise CeleryCommandException(
            message=f"cannot use the {what} at {shown_url(url)}: {reason}",
            exit_code=EX_UNAVAILABLE,
        ) from exc


@contextmanager
def _readable() -> Iterator[None]:
    """Turn a dead letter whose row cannot be read into a one-line error (exit code 1)."""
    try:
        yield
    except CorruptRecord as exc:
        raise click.ClickException(str(exc)) from exc


def _queue(ctx: click.Context) -> DeadLetterQueue:
    """The app's dead-letter queue, its connections closed when the command ends."""
    app = _app(ctx)
    try:
        queue = dlq_for(app)
    except StoreUnavailable as exc:  # not even set up: its driver, its URL, its folder
        raise click.ClickException(f"cannot open the dead-letter database: {exc}") from exc
    ctx.call_on_close(queue.dispose)
    return queue


def _store(ctx: click.Context) -> tuple[Store, str]:
    """The app's claim store and its URL, its connections closed when the command ends."""
    app = _app(ctx)
    try:
        url = store_url(app)  # the default one's folder is made here
        store = store_for(app)
    except SETUP_ERRORS as exc:
        raise click.ClickException(f"cannot open the claim store: {exc}") from exc
    ctx.call_on_close(store.close)
    if isinstance(store, MemoryStore):
        _warn(f"the claim store is {url}: it lives inside each worker process, not here")
    return store, url


def _on_a_terminal() -> bool:
    """Whether someone at a terminal can answer a question (stdin is one)."""
    try:
        return bool(sys.stdin is not None and sys.stdin.isatty())
    except (AttributeError, ValueError, OSError):  # closed, or replaced by a stand-in
        return False


def _confirm(question: str, yes: bool) -> bool:
    """Ask ``question`` (on stderr) before a change there is no undo for, unless ``--yes`` was
    given or no one can answer: a script, a cron job or a test that names what to change
    means it (as one running ``rm`` does), and its prompt could only end it. "No" ends the
    command with exit 1. Returns whether it asked."""
    if yes or not _on_a_terminal():
        return False
    click.confirm(question, abort=True, err=True)
    return True


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


# -- dead letters ---------------------------------------------------------------------------


@idempotency.group()
def dlq() -> None:
    """Dead letters: tasks that failed for good.

    The sweep task idempotent_tasks.retry_dead_letters, sent by celery beat, sends pending ones
    again on a backoff.
    """


@dlq.command(name="list")
@click.option("--status", type=STATUSES, help="Only items of this status.")
@click.option("--task", "task_name", metavar="NAME", help="Only items of this task.")
@click.option(
    "--limit",
    type=click.IntRange(min=1, max=MAX_LISTED),
    default=50,
    show_default=True,
    help="At most this many.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (every field of each item).")
@click.pass_context
def dlq_list(
    ctx: click.Context, status: str | None, task_name: str | None, limit: int, as_json: bool
) -> None:
    """List dead letters, newest first."""
    queue = _queue(ctx)
    with _reaching("dead-letter database", queue.url):
        items = queue.items(
            status=status,
            task_name=task_name,
            limit=limit,
            on_corrupt=lambda exc: _warn(f"{exc}: left out of this list"),
        )
    if as_json:
        click.echo(cli_format.to_json([cli_format.dead_letter_json(item) for item in items]))
        return
    if not items:
        filtered = status is not None or task_name is not None
        click.echo("No dead letters match." if filtered else "No dead letters.")
        return
    rows = [cli_format.dead_letter_row(item) for item in items]
    click.echo(cli_format.table(cli_format.DEAD_LETTER_HEADERS, rows))
    more = f" (the newest {limit}; --limit shows more)" if len(items) == limit else ""
    click.echo(f"{_plural(len(items), 'dead letter')}{more}")


@dlq.command(name="show")
@click.argument("item_id", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def dlq_show(ctx: click.Context, item_id: str, as_json: bool) -> None:
    """Show every field of one dead letter, its traceback included."""
    queue = _queue(ctx)
    with _reaching("dead-letter database", queue.url), _readable():
        item = queue.get(item_id)
        now = queue.now()  # "due in ..." as the sweep will judge it
    if item is None:
        raise click.ClickException(f"no dead letter with id {item_id!r}")
    if as_json:
        click.echo(cli_format.to_json(cli_format.dead_letter_json(item)))
    else:
        click.echo(cli_format.dead_letter_detail(item, now))


@dlq.command(name="retry")
@click.argument("item_id", metavar="ID")
@click.option(
    "--yes", "-y", is_flag=True, help="Do not ask (on a terminal) before retrying a succeeded item."
)
@click.pass_context
def dlq_retry(ctx: click.Context, item_id: str, yes: bool) -> None:
    """Make a dead letter due now: the next sweep re-publishes its task.

    Works on an item of any status but retrying (a sweep has it right now); a
    permanent_failure or succeeded item becomes pending again (a succeeded one only once
    confirmed: its task runs again).
    """
    queue = _queue(ctx)
    with _reaching("dead-letter database", queue.url), _readable():
        item = queue.get(item_id)
        if item is None:
            raise click.ClickException(f"no dead letter with id {item_id!r}")
        if item.status is DeadLetterStatus.RETRYING:
            raise click.ClickException(_being_retried(item_id))
        if item.options.get(ARGS_LOSSY) and item.framework != "rq":
            # (An RQ row is sent from RQ's own copy of its job, while RQ has it.)
            raise click.ClickException(
                f"dead letter {item.id} keeps its task's arguments as text only: it cannot be "
                "sent again (call its task again by hand, or purge it)"
            )
        if item.status is DeadLetterStatus.SUCCEEDED:
            _confirm(
                f"Dead letter {item.id} ({item.task_name}) succeeded already: retrying it runs "
                "its task again (a call without a key runs its body again). Retry it?",
                yes,
            )
        if not queue.retry_now(item_id):
            # Between the read and the write, a sweep took it or someone purged it.
            now = queue.get(item_id)
            raise click.ClickException(
                _being_retried(item_id) if now else f"dead letter {item_id!r} was just deleted"
            )
    click.echo(
        f"Dead letter {item.id} ({item.task_name}) is pending and due now "
        f"(was {item.status.value}, retries {item.retry_count}/{item.max_retries}); "
        f"the next sweep ({_sweep_of(item)}) re-publishes it."
    )


def _sweep_of(item: DeadLetter) -> str:
    """Which sweep sends an item again."""
    if item.framework == "rq":
        return "idempotent-tasks rq retry-dead-letters"
    return f"{SWEEP_TASK}, sent by celery beat"


def _being_retried(item_id: str) -> str:
    return f"dead letter {item_id!r} is being retried by a sweep right now (status retrying)"


@dlq.command(name="purge")
@click.option("--status", type=STATUSES, help="Only items of this status.")
@click.option(
    "--older-than",
    callback=parse_duration,
    metavar="DURATION",
    help="Only items not updated for this long: 7d, 12h, 30m, 3600s.",
)
@click.option(
    "--all", "purge_all", is_flag=True, help="Every item (needed off a terminal to delete all)."
)
@click.option("--yes", "-y", is_flag=True, help="Do not ask first (on a terminal).")
@click.pass_context
def dlq_purge(
    ctx: click.Context,
    status: str | None,
    older_than: timedelta | None,
    purge_all: bool,
    yes: bool,
) -> None:
    """Delete dead letters by status and/or age, or every one (--all).

    On a terminal, asks first unless --yes is given, and no filter means every item;
    elsewhere, deleting every item takes --all. There is no undo.
    """
    filtered = status is not None or older_than is not None
    if filtered and purge_all:
        raise click.UsageError("--all deletes every item: give it without --status/--older-than")
    if not (filtered or purge_all or _on_a_terminal()):
        # Where no one is asked (ssh or kubectl exec without a terminal, a cron line whose
        # filter came out empty, --yes or not), deleting every item takes saying so.
        raise click.UsageError(
            "not on a terminal: give --status and/or --older-than, or --all to delete every item"
        )
    queue = _queue(ctx)
    if not filtered:
        what = "every dead letter"
    else:
        what = "the dead letters" + (f" with status {status}" if status else "")
        if older_than is not None:
            what += f" not updated for {cli_format.span(older_than.total_seconds())}"
    _confirm(f"Delete {what} in {shown_url(queue.url)}?", yes)
    with _reaching("dead-letter database", queue.url):
        deleted = queue.purge(status=status, older_than=older_than)
    click.echo(f"Deleted {_plural(deleted, 'dead letter')}.")


@dlq.command(name="stats")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def dlq_stats(ctx: click.Context, as_json: bool) -> None:
    """Count dead letters by status, plus the total."""
    queue = _queue(ctx)
    with _reaching("dead-letter database", queue.url):
        counts = queue.stats()
    click.echo(cli_format.to_json(counts) if as_json else cli_format.stats_text(counts))


# -- keys -----------------------------------------------------------------------------------


@idempotency.group()
def key() -> None:
    """Idempotency keys: show a key's record, or forget it."""


TASK_OPTION = click.option(
    "--task",
    "task_name",
    required=True,
    metavar="NAME",
    help="The task the key belongs to (keys are scoped by task name).",
)


@key.command(name="show")
@click.argument("idempotency_key", metavar="KEY")
@TASK_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def key_show(ctx: click.Context, idempotency_key: str, task_name: str, as_json: bool) -> None:
    """Show a key's record and its cached result.

    Status, owner task, fencing token, lease, expiry, fingerprint and the result, decoded with
    the task's serializer (pickle only if the app allows it).
    """
    store, url = _store(ctx)
    codec = _codec(_task(_app(ctx), task_name))
    record = _record(store, url, task_name, idempotency_key)
    decoded = _decode(codec, record)
    if as_json:
        click.echo(cli_format.to_json(cli_format.record_json(record, decoded)))
    else:
        read_at = datetime.fromtimestamp(record.store_time(), timezone.utc)
        click.echo(cli_format.record_detail(record, decoded, read_at))


@key.command(name="forget")
@click.argument("idempotency_key", metavar="KEY")
@TASK_OPTION
@click.option("--yes", "-y", is_flag=True, help="Do not ask first (on a terminal).")
@click.pass_context
def key_forget(ctx: click.Context, idempotency_key: str, task_name: str, yes: bool) -> None:
    """Delete a key's record, so its next call runs the task again.

    On a terminal, asks first unless --yes is given.
    """
    store, url = _store(ctx)
    _task(_app(ctx), task_name)  # warns about a misspelt task name
    unreadable: CorruptRecord | None = None
    try:
        record: Record | None = _record(store, url, task_name, idempotency_key, raise_corrupt=True)
    except CorruptRecord as exc:
        record, unreadable = None, exc  # forgetting an unreadable record is the way out of it
    state = record.status.value if record is not None else "unreadable"
    running, risk = "", ""
    if record is None:
        running = f" Its record cannot be read ({unreadable})."
        risk = f"its record could not be read ({unreadable})"
    elif record.status is Status.PROCESSING:
        running = (
            f" It is processing (task {record.task_id}): a duplicate could then run beside it."
        )
        risk = f"it was processing (task {record.task_id}): a duplicate may run beside it"
    elif record.status is Status.QUEUED:
        running = f" Task {record.task_id} is queued: a lost message is then not sent again."
        risk = f"task {record.task_id} was queued: a lost message of it is not sent again"
    asked = _confirm(f"Forget key {idempotency_key!r} of task {task_name} ({state})?{running}", yes)
    if risk and not asked:
        click.echo(f"Warning: key {idempotency_key!r} of task {task_name}: {risk}.", err=True)
    with _reaching("claim store", url):
        if not store.forget(storage_key(task_name, idempotency_key)):
            raise click.ClickException(f"key {idempotency_key!r} of task {task_name} just vanished")
    click.echo(f"Forgot key {idempotency_key!r} of task {task_name} (it was {state}).")


def _record(
    store: Store, url: str, task_name: str, idempotency_key: str, *, raise_corrupt: bool = False
) -> Record:
    """The key's record; a clear error when there is none or it cannot be read (or, with
    ``raise_corrupt``, the ``CorruptRecord`` itself)."""
    with _reaching("claim store", url):
        try:
            record = store.get(storage_key(task_name, idempotency_key))
        except CorruptRecord as exc:
            if raise_corrupt:
                raise
            raise click.ClickException(
                f"the record of key {idempotency_key!r} of task {task_name} is unreadable: {exc}"
            ) from exc
    if record is None:
        raise click.ClickException(
            f"no record of key {idempotency_key!r} for task {task_name} "
            "(never used, expired, or forgotten)"
        )
    return record


def _task(app: Any, task_name: str) -> Any:
    """The app's task of that name, or ``None`` (warned: the key is looked up anyway)."""
    task = app.tasks.get(task_name)
    if task is None:
        try:
            app.loader.import_default_modules()  # the app's include/imports, as a worker does
        except Exception as exc:  # any module's error as it is imported: a warning
            _warn(f"could not import the app's task modules: {type(exc).__name__}: {exc}")
        task = app.tasks.get(task_name)
    if task is None:
        _warn(f"task {task_name!r} is not registered in app {app.main!r}; looking it up anyway")
    return task


def _codec(task: Any) -> ResultCodec:
    """The task's result codec, else one accepting a record's own type only (never pickle)."""
    try:
        codec = getattr(task, "_codec", None)
    except ValueError as exc:  # a setting it is built from is malformed
        _warn(f"the task's result settings are unusable ({exc}); decoding its record's own type")
        codec = None
    if isinstance(codec, ResultCodec):
        return codec
    return ResultCodec(serializer=defaults.RESULT_SERIALIZER, max_bytes=defaults.RESULT_MAX_BYTES)


def _decode(codec: ResultCodec, record: Record) -> cli_format.DecodedResult:
    if record.result is None:
        return cli_format.DecodedResult()
    try:
        return cli_format.DecodedResult(value=codec.decode(record.result))
    except CorruptRecord as exc:
        return cli_format.DecodedResult(error=str(exc))
