"""Re-enqueueing RQ's due dead letters: :func:`retry_dead_letters`, meant to run periodically.

Run it every 30 s or so, from any of:

* cron: ``* * * * * idempotent-tasks rq retry-dead-letters --redis-url redis://host:6379/0``
  (add ``--dlq-url``, or set ``IDEMPOTENT_TASKS_DLQ_URL``);
* RQ's own cron scheduler (``rq cron``, in rq 3): a config file ::

      from rq import cron
      from idempotent_tasks.rq.sweep import retry_dead_letters_job

      cron.register(retry_dead_letters_job, "default", interval=30)

  run with ``rq cron --url redis://host:6379/0 cron_config.py`` beside your workers;
* Python: ``retry_dead_letters(Redis(...))`` from any loop or scheduler of yours.

Running it from several places at once is safe: each due row is taken by one sweep only
(``DeadLetterQueue.take_due``).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, cast

from redis import Redis
from redis.exceptions import RedisError, ResponseError, WatchError
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import JobStatus, get_current_job
from rq.queue import Queue
from rq.serializers import resolve_serializer
from rq.timeouts import JobTimeoutException

from .. import defaults
from ..dlq import DeadLetter, DeadLetterQueue
from ..dlq.arguments import ArgumentsUnreadable, restored_arguments
from ..dlq.items import ARGS_LOSSY
from ..dlq.queue import SWEEP_BATCH
from ..dlq.sweep import AlreadySucceeded, CannotResend, ResendLater, resend_due
from ..errors import StoreUnavailable
from ..redis_unavailable import is_refusal, is_unavailable
from ..setup_errors import SETUP_ERRORS
from ..stores.base import remove_expired_records
from .dead_letters import succeeded_unmarked
from .job import IdempotentJob, forget_ttl
from .options import FRAMEWORK, META_KEY, OWN_STORE
from .resources import claim_store, dlq_url_for

logger = logging.getLogger(__name__)

#: What opening a claim store raises when it is down or set up wrong.
_CANNOT_OPEN: tuple[type[Exception], ...] = (StoreUnavailable, *SETUP_ERRORS)

#: ``job.meta["idempotency"]`` entries that belong to one run, dropped when a row is retried.
_RUN_STATE = ("unwritten_failure", "previous_owner", "waits")


def retry_dead_letters(
    connection: Redis,
    dlq_url: str | None = None,
    batch: int = SWEEP_BATCH,
    *,
    store_url: str | None = None,
) -> int:
    """Re-enqueue every due RQ dead letter, in batches; returns how many were re-enqueued.

    Each due row written by the RQ adapter (``options["framework"] == "rq"``) is marked
    ``retrying`` and its job enqueued again under its original id, on its original queue, with
    its function path, arguments and idempotency key, carrying the row's id: when that run
    succeeds (or finds its key completed) the row becomes ``succeeded``; when it fails for good
    the row is rescheduled on the backoff, or becomes ``permanent_failure`` at its limit. While
    RQ still has the original (failed) job, that very job is requeued, with its meta; each
    re-enqueue gets one run (RQ's ``Retry`` of the original enqueue is used up).

    Rows ``retrying`` for over an hour (their sweep died) are made due first. Rows of other
    frameworks (Celery) sharing the table are left ``pending`` for their own sweep.

    Args:
        connection: RQ's Redis.
        dlq_url: the dead-letter database; unset, ``$IDEMPOTENT_TASKS_DLQ_URL``, else the local
            SQLite file (the workers' default too).
        batch: rows taken per round.
        store_url: the claim store, when your queues use ``IdempotentQueue(store_url=...)``:
            for rows whose original job RQ no longer has, and to delete the expired claims
            of an SQL store (nothing else does).
    """
    url = dlq_url_for(dlq_url)
    queue = DeadLetterQueue(url)
    try:
        recovered = queue.recover_stuck(
            timedelta(seconds=defaults.DLQ_RETRYING_TIMEOUT), framework=FRAMEWORK
        )
        if recovered:
            logger.warning("%s dead letters were stuck in retrying and are due again", recovered)
        resent = _sweep(connection, queue, url, store_url, batch)
    finally:
        queue.dispose()
    if store_url:
        # Nothing else deletes an SQL store's expired claims (a Celery app's beat sweep does
        # for its own store).
        try:
            store = claim_store(connection, defaults.KEY_PREFIX, store_url)
        except _CANNOT_OPEN as exc:
            logger.warning("could not open the claim store to remove expired claims: %s", exc)
        else:
            remove_expired_records(store)
    return resent


def retry_dead_letters_job(
    dlq_url: str | None = None, batch: int = SWEEP_BATCH, store_url: str | None = None
) -> int:
    """:func:`retry_dead_letters` as an RQ job function (for ``rq cron``), on the worker's
    own Redis connection."""
    job = get_current_job()
    if job is None:
        raise RuntimeError("retry_dead_letters_job runs inside an RQ worker only")
    return retry_dead_letters(job.connection, dlq_url, batch, store_url=store_url)


def _sweep(
    connection: Redis,
    queue: DeadLetterQueue,
    dlq_url: str | None,
    store_url: str | None,
    batch: int,
) -> int:
    return resend_due(
        queue,
        lambda item: _enqueue(connection, item, dlq_url, store_url),
        framework=FRAMEWORK,
        batch=batch,
        retry_delay=defaults.DLQ_POLL_INTERVAL,
        unreachable=is_unavailable,
        interrupted=(JobTimeoutException,),
    )


def _enqueue(
    connection: Redis, item: DeadLetter, dlq_url: str | None, store_url: str | None
) -> None:
    """Send a dead letter's job again, under its original id."""
    if succeeded_unmarked(connection, item.id):
        raise AlreadySucceeded(item.id)
    serializer = item.options.get("serializer")  # the job's own, when not RQ's default
    try:
        resolve_serializer(serializer)
    except Exception as exc:  # not importable here, or no serializer: no later try mends it
        raise CannotResend(f"its job's serializer {serializer!r} cannot be used: {exc!r}") from exc
    held = _held_job(connection, item.task_id, serializer)
    current = held.get_status(refresh=False) if held is not None else None
    if current == JobStatus.FINISHED:
        raise AlreadySucceeded(item.id)  # run again since (requeued by hand), and succeeded
    if current in _LIVE:
        # Requeued by hand, or sent by a sweep whose row was taken for stuck (a queue over an
        # hour behind), and not run yet: sending it again would put its id in a queue twice.
        # The row waits for that very job instead, under this sweep: its outcome counts.
        if current == JobStatus.QUEUED and held is not None:
            if _wait_for_queued(connection, held, item, dlq_url):
                return
        # Running (or just taken from its queue), scheduled or deferred: it reports under what
        # it read when it began. The row is due again a poll interval later.
        raise JobStillLive(f"job {item.task_id} is {current.value} already")
    if current == JobStatus.CANCELED:
        # Cancelled once sent again (job.cancel(), rq cancel): an operator's no, which a
        # resend would overrule. The row is given up.
        raise CannotResend(f"job {item.task_id} was cancelled")
    # The original job, while RQ keeps it as failed (or stopped).
    original = held if current in (JobStatus.FAILED, JobStatus.STOPPED) else None
    try:
        _send_again(connection, item, original, dlq_url, store_url, serializer)
    except ResponseError as exc:
        if is_refusal(exc):
            # RQ's transaction wrote the job as queued before its push was refused: left so,
            # in no queue, it would pass for live at every later sweep, its row never giving up.
            _leave_failed(connection, item.task_id, serializer)
        raise


#: Transactions tried when adopting a queued job (see :func:`_wait_for_queued`).
_ADOPTION_TRIES = 3


def _wait_for_queued(
    connection: Redis, job: IdempotentJob, item: DeadLetter, dlq_url: str | None
) -> bool:
    """Make ``job``, waiting in its queue, the run of ``item``, the row a sweep just took: its
    success or failure is recorded on the row (in ``dlq_url``, unless it names its own
    database), under this sweep (the row stays ``retrying``). ``False`` when the job is no
    longer waiting in its queue (a worker took it: it runs with the meta it read)."""
    queue_key = Queue(job.origin, connection=connection).key
    for _ in range(_ADOPTION_TRIES):  # a busy queue's pushes and pops abort a try
        with connection.pipeline() as pipe:
            try:
                # A worker's dequeue, or another write of the job, aborts the transaction.
                pipe.watch(queue_key, job.key)  # type: ignore[no-untyped-call]
                if pipe.lpos(queue_key, job.id) is None:
                    return False
                raw = cast(bytes | None, pipe.hget(job.key, "meta"))
                meta = job.serializer.loads(raw) if raw else {}
                state = meta.get(META_KEY)
                state = dict(state) if isinstance(state, dict) else {}
                state.update(dead_letter_id=item.id, dead_letter_sweep=item.sweep_id)
                if dlq_url:
                    state.setdefault("dlq_url", dlq_url)
                meta[META_KEY] = state
                pipe.multi()
                pipe.hset(job.key, "meta", job.serializer.dumps(meta))
                pipe.execute()
                return True
            except WatchError:
                continue
            except Exception as exc:
                if is_unavailable(exc):
                    raise
                # LPOS unknown (Redis before 6.0.6), meta this process cannot read (a class it
                # lacks): the row waits for the job as before.
                logger.warning("could not make queued job %s its row's run: %r", job.id, exc)
                return False
    return False


def _send_again(
    connection: Redis,
    item: DeadLetter,
    original: IdempotentJob | None,
    dlq_url: str | None,
    store_url: str | None,
    serializer: str | None,
) -> None:
    """Requeue ``original``, RQ's failed job of the row, else enqueue the row's call anew."""
    if original is not None:
        if getattr(original, "_unreadable_meta", None) is not None:
            # Its meta holds what this process cannot load (a class of the app's): written
            # back, it would lose the job's key, and the job would run unclaimed.
            raise MetaUnreadable(
                f"the meta of job {item.task_id} cannot be read in this process: run the sweep "
                "where the job's own modules import (rq cron in its workers)"
            )
        state = _fresh_state(original.meta.get(META_KEY))
        state.update(dead_letter_id=item.id, dead_letter_sweep=item.sweep_id)
        original.meta[META_KEY] = state
        # RQ's ttl= bounds how long the call's first enqueue may wait to start: kept, the dead
        # letter's job could expire waiting in a busy queue, its row left retrying.
        forget_ttl(original, connection)
        try:
            original.failed_job_registry.requeue(original)
        except InvalidJobOperation:
            # No longer in the failed registry: requeued meanwhile by someone else (by hand,
            # another row of the same job id), or a requeue cut short half-way.
            now = _held_job(connection, item.task_id, serializer)
            current = now.get_status(refresh=False) if now is not None else None
            if current == JobStatus.FINISHED:
                raise AlreadySucceeded(item.id) from None  # requeued by hand, and run to its end
            if current in _LIVE:
                # Enqueued anew here, it would run twice, and its data, meta included, be
                # overwritten: the row is due again a poll interval later.
                raise JobStillLive(f"job {item.task_id} was requeued meanwhile") from None
            # Cut short: enqueue it anew, as it is when only it has the arguments, else below
            # from the row.
            if item.options.get(ARGS_LOSSY):
                Queue(
                    original.origin,
                    connection=connection,
                    job_class=IdempotentJob,
                    serializer=serializer,
                ).enqueue_job(original)
                return
        else:
            return
    if item.options.get(ARGS_LOSSY):
        raise CannotResend("its arguments were not JSON and RQ no longer has the original job")
    state = _fresh_state(original.meta.get(META_KEY) if original is not None else None)
    # True or False on rows of this version; None on an earlier one's, which did not say.
    own_store = item.options.get(OWN_STORE)
    if item.idempotency_key is not None and own_store and not (store_url or state.get("store_url")):
        # Claimed in RQ's Redis instead, its key would be found free: run again, if completed.
        raise StoreNotGiven(
            "its job claims in a store of its own (IdempotentQueue(store_url=...)), this sweep "
            "was given none (store_url=, --store-url), and RQ no longer has the original job"
        )
    state.update(dead_letter_id=item.id, dead_letter_sweep=item.sweep_id)
    if item.idempotency_key is not None:
        state["key"] = item.idempotency_key
    for name in ("prefix", "task_name"):
        if item.options.get(name):
            state.setdefault(name, item.options[name])
    state.setdefault("prefix", defaults.KEY_PREFIX)
    if dlq_url:
        state.setdefault("dlq_url", dlq_url)
    if store_url and own_store is not False:
        state.setdefault("store_url", store_url)
    rq_queue = Queue(
        str(item.options.get("queue") or "default"),
        connection=connection,
        job_class=IdempotentJob,
        serializer=serializer,
    )
    try:
        args, kwargs = restored_arguments(item.args, item.kwargs)
    except ArgumentsUnreadable as exc:
        raise CannotResend(str(exc)) from exc
    rq_queue.enqueue_call(
        item.task_name,
        args=args,
        kwargs=kwargs,
        job_id=item.task_id,
        meta={META_KEY: state},
        timeout=item.options.get("timeout"),
    )


def _leave_failed(connection: Redis, job_id: str, serializer: str | None) -> None:
    """Mark the job a refused enqueue left ``queued`` (in no queue) as failed again."""
    try:
        job = _held_job(connection, job_id, serializer)
        if job is not None and job.get_status(refresh=True) == JobStatus.QUEUED:
            job.set_status(JobStatus.FAILED)
    except RedisError as exc:
        logger.warning("could not mark job %s failed again: %s", job_id, exc)


class MetaUnreadable(ResendLater):
    """The dead letter's failed job keeps meta this sweep's process cannot load: the row waits
    (no retry used) for a sweep that can."""


class JobStillLive(ResendLater):
    """The dead letter's job is queued or running again already: the row waits for it."""


class StoreNotGiven(ResendLater):
    """The dead letter's job claims in a store of its own, which this sweep was not given: the
    row waits (no retry used) for a sweep that is."""


#: Statuses of a job that will run (or runs) by itself: RQ enqueues a rate-limited job once a
#: slot frees, and a job ready to enqueue as its dependencies finish.
_LIVE = frozenset(
    {
        JobStatus.QUEUED,
        JobStatus.STARTED,
        JobStatus.SCHEDULED,
        JobStatus.DEFERRED,
        JobStatus.RATE_LIMITED,
        JobStatus.READY_TO_ENQUEUE,
    }
)


def _held_job(connection: Redis, job_id: str, serializer: str | None) -> IdempotentJob | None:
    """The job RQ still holds under a dead letter's id, if any."""
    try:
        job = IdempotentJob.fetch(job_id, connection=connection, serializer=serializer)
    except (NoSuchJobError, ValueError):
        return None
    return job if isinstance(job, IdempotentJob) else None


def _fresh_state(found: Any) -> dict[str, Any]:
    state = dict(found) if isinstance(found, dict) else {}
    for name in _RUN_STATE:
        state.pop(name, None)
    return state
