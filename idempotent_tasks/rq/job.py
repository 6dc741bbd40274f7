"""``IdempotentJob``: RQ's job class, running the core claim protocol around the job function.

Start workers with it (and with :class:`~idempotent_tasks.rq.IdempotentQueue`)::

    rq worker --queue-class idempotent_tasks.rq.IdempotentQueue \\
              --job-class idempotent_tasks.rq.IdempotentJob default

Everything a worker needs travels in ``job.meta["idempotency"]`` (written by
``IdempotentQueue``): the key, the argument fingerprint, the key prefix and, when the producer
set them, ``store_url`` and ``dlq_url``. A worker therefore needs no configuration of its own:
claims go to ``store_url`` or else to the worker's own Redis connection (the queue's), dead
letters to ``dlq_url``, else ``$IDEMPOTENT_TASKS_DLQ_URL``, else the local SQLite file.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from traceback import format_exception
from typing import Any

from redis import Redis
from redis.client import Pipeline
from rq.exceptions import DeserializationError
from rq.job import Job, JobStatus, Retry
from rq.queue import Queue
from rq.timeouts import JobTimeoutException

from .. import defaults, signals
from ..codec import ResultCodec
from ..core import Attempt, despite_time_limit, new_owner, wait_for_owner
from ..dlq import Failure, renewal
from ..dlq.arguments import error_text, stored_arguments
from ..errors import (
    CorruptRecord,
    DeadLettered,
    IdempotencyConflict,
    IdempotencyKeyMismatch,
    SchemaVersionError,
    StoreUnavailable,
)
from ..keys import derive_key, fingerprint, storage_key
from ..records import ClaimRequest, Outcome, Record
from ..setup_errors import SETUP_ERRORS, StoreUnusable
from .dead_letters import (
    MAX_ERROR_MESSAGE_CHARS,
    MAX_TRACEBACK_CHARS,
    mark_succeeded,
    row_options,
    serializer_name,
    write_failure,
)
from .options import (
    DEFAULT_OPTIONS,
    FRAMEWORK,
    META_KEY,
    OWN_STORE,
    IdempotencyOptions,
    options_of,
    scoped_name,
    signature_of,
)
from .resources import claim_store, dead_letter_queue

logger = logging.getLogger(__name__)

#: Cached results are JSON, whatever RQ's own serializer: pickle is never read back from the store.
CODEC = ResultCodec(serializer=defaults.RESULT_SERIALIZER, max_bytes=defaults.RESULT_MAX_BYTES)
#: ``worker_name`` RQ gives jobs that run inside ``enqueue`` (``Queue(is_async=False)``).
SYNC_WORKER = "sync"


class Requeue(Retry):
    """What :meth:`IdempotentJob.perform` returns to put its job back at the end of its queue.

    RQ hands a returned ``Retry`` to the job's ``_handle_retry_result``, which
    :class:`IdempotentJob` overrides for this class: the job is re-enqueued at once, with no
    result recorded and no retry counted. It never needs RQ's scheduler.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(max=2**31 - 1)
        self.reason = reason


def forget_ttl(job: Job, redis: Redis | Pipeline) -> None:
    """Drop the expiries of a job sent back to a queue after it started: RQ's ``ttl=`` (how
    long a job may wait to start), in memory and stored (RQ's save leaves a field it no longer
    has); and the ``failure_ttl`` a failure set on its keys, which RQ's requeue keeps (a short
    one would delete the job while it waits in its queue)."""
    job.ttl = None
    redis.hdel(job.key, "ttl")
    for key in (job.key, job.dependents_key, job.dependencies_key):
        redis.persist(key)


class IdempotentJob(Job):
    """An RQ job whose function runs to success at most once per idempotency key.

    Before the function runs, the job claims its key (one store round trip):

    * acquired: the function runs; its lease is renewed in the background; its result is cached
      (only while this execution still holds the key: fencing) and returned;
    * completed: the function does not run; the job returns the cached result;
    * in progress elsewhere: per the function's ``on_duplicate`` — ``"wait"`` (default) polls
      the owner inside the worker for up to ``wait_slice`` seconds, then goes back to the end
      of the queue (no scheduler needed, no retry used, nothing dead-lettered) until the owner
      finishes, and returns its value; it takes the key over if the owner dies and its lease
      ends. ``"skip"`` finishes at once with ``None``; ``"raise"`` fails with
      ``IdempotencyConflict``. A re-run of the owner's own job always waits.
    * mismatch: fails with ``IdempotencyKeyMismatch`` (not retried, not dead-lettered).

    A failure RQ will retry (``Retry(max=..., interval=...)``) releases the key first, so the
    retry claims afresh. A final failure releases it and writes the dead-letter row; if the
    database is down, the job goes back to its queue and writes the row on its next run. A
    work horse that dies, or a job RQ finds abandoned, is dead-lettered too when RQ gives up
    on it (through RQ's own failure handling), and goes back to its queue to write that row
    when the database is down. A dead work horse's key is released by its worker; an
    abandoned job's key frees itself when its lease ends.

    Jobs that neither came from an ``IdempotentQueue`` nor call an ``@idempotent`` function
    run as plain RQ jobs.
    """

    def __init__(self, id: str | None = None, connection: Any = None, serializer: Any = None):
        super().__init__(id, connection=connection, serializer=serializer)
        #: This run's failure went through :meth:`perform` (so RQ's failure hook ignores it).
        self._idempotency_settled = False
        #: This run failed in a way no retry can fix (a caller's error, or already dead-lettered).
        self._idempotency_no_retry = False
        #: The owner id this job's run claims under. Made here, before RQ forks the work horse,
        #: so the worker knows it too and can release that claim should the horse die.
        self._idempotency_owner = new_owner()
        self._idempotency_performed = False
        #: What ended this run, when it was no ordinary exception (SystemExit, a cancellation).
        self._idempotency_ended_by: BaseException | None = None

    # -- what RQ calls ------------------------------------------------------------------------

    def perform(self) -> Any:
        """Claim the key, then run the function once, or answer as a duplicate."""
        self._idempotency_settled = False
        self._idempotency_no_retry = False
        self._idempotency_ended_by = None
        if self._idempotency_performed:
            self._idempotency_owner = new_owner()  # one owner per run
        self._idempotency_performed = True
        try:
            value = self._perform_idempotently()
        except Exception:
            # A failure of the function was seen here (and dead-lettered if it had to be):
            # RQ's failure hook below must not write it again. What ended the run otherwise
            # (SystemExit, a cancellation, a platform's shutdown) is left to that hook, which
            # dead-letters it should RQ fail the job for good.
            self._idempotency_settled = True
            raise
        except BaseException as exc:
            self._idempotency_ended_by = exc
            raise
        if not isinstance(value, Retry):
            # Done: the key completed (or answered). What fails after, in RQ's hands (a success
            # callback that raises, saving the result), is RQ's to report: a dead letter would
            # only find the key completed, and the callback failing again, for ever.
            self._idempotency_settled = True
        self._result = value
        return value

    @property
    def should_retry(self) -> bool:
        """RQ's own answer, except for failures no retry can fix."""
        if self._idempotency_no_retry:
            return False
        return super().should_retry

    def _handle_retry_result(
        self, queue: Queue, pipeline: Pipeline, retry: Retry, *args: Any, **kwargs: Any
    ) -> None:
        """RQ's handling of a returned ``Retry``; a :class:`Requeue` just re-enqueues the job."""
        if not isinstance(retry, Requeue):
            super()._handle_retry_result(queue, pipeline, retry, *args, **kwargs)
            return
        self._result = None
        logger.info("job %s goes back to queue %s: %s", self.id, queue.name, retry.reason)
        # RQ's ttl= bounds how long a job may wait to start, and this one started: re-armed,
        # it could expire in a busy queue, and with it a dead letter still to write.
        forget_ttl(self, pipeline)
        queue._enqueue_job(self, pipeline=pipeline)

    def dependencies_are_met(
        self,
        parent_job: Job | None = None,
        pipeline: Pipeline | None = None,
        exclude_job_id: str | None = None,
        refresh_job_status: bool = True,
    ) -> bool:
        """RQ's answer, except that a parent back on its queue has not ended.

        RQ asks once a parent ended, and takes any parent not failed, stopped or cancelled for
        finished (it asks a succeeding one before marking it finished). A lost run whose dead
        letter could not be written goes back to its queue from RQ's failure handling, which
        then asks: its dependents must wait for the run that ends it. (A parent cancelled with
        ``enqueue_dependents=True`` is asked about while still queued, and left out by name.)
        """
        if parent_job is not None and parent_job.id != exclude_job_id:
            status = parent_job.get_status(refresh=refresh_job_status)
            if status in (JobStatus.QUEUED, JobStatus.SCHEDULED, JobStatus.DEFERRED):
                return False
            refresh_job_status = False  # just read: RQ's own look need not read it again
        return super().dependencies_are_met(
            parent_job=parent_job,
            pipeline=pipeline,
            exclude_job_id=exclude_job_id,
            refresh_job_status=refresh_job_status,
        )

    def retry(self, queue: Queue, pipeline: Pipeline) -> None:
        """RQ retrying a run; one that ended out of our code's sight (a work horse that died)
        has its claim released first, so the retry claims the key afresh at once rather than
        wait out the dead horse's lease. A failure our code saw released its claim already."""
        if not self._idempotency_settled:
            try:
                state = self._release_dead_horse_claim()
            except Exception:
                logger.exception("could not release the key of job %s before its retry", self.id)
            else:
                if state is not None:
                    # The retry is the call that held the key (saved with the job's meta): it
                    # waits for the value of a call that took the key meanwhile, whatever
                    # on_duplicate says, as the retry of a failure our code saw does.
                    state["previous_owner"] = self._idempotency_owner
                    self.meta[META_KEY] = state  # a plain Queue's job had none
        super().retry(queue, pipeline)

    def _handle_failure(
        self, exc_string: str, pipeline: Pipeline, *args: Any, **kwargs: Any
    ) -> None:
        """RQ recording a final failure; dead-letters those no code of ours saw happen.

        That is a work horse that died (killed, out of memory) and a job RQ's registry cleanup
        found abandoned by a dead worker, once RQ has no retries left for it. A dead horse's
        claim is then released (this worker made its owner id), so a new call with the key runs
        at once rather than wait for the lease to end.
        """
        super()._handle_failure(exc_string, pipeline, *args, **kwargs)
        if self._idempotency_settled:
            return
        try:
            if self.get_status(refresh=False) == JobStatus.STOPPED:
                self._release_stopped_run()
            else:
                self._settle_lost_run(exc_string, kwargs.get("execution_id"), pipeline)
        except Exception:
            logger.exception("could not settle job %s, which ended for good", self.id)

    # -- the protocol -------------------------------------------------------------------------

    def _perform_idempotently(self) -> Any:
        found = self.meta.get(META_KEY)
        try:
            func = self.func
        except Exception:
            if not isinstance(found, dict):
                return super().perform()  # RQ reports the import error as it always does
            # The function cannot be imported here: no claim, and a final failure (this very
            # import error, raised again by RQ) is dead-lettered.
            return self._run_body(None, found.get("key"), DEFAULT_OPTIONS, found)
        options = options_of(func)
        if options is None and not isinstance(found, dict):
            return super().perform()
        state: dict[str, Any] = found if isinstance(found, dict) else {}
        self.meta[META_KEY] = state  # RQ saves meta whenever it re-enqueues the job
        options = options or DEFAULT_OPTIONS

        unwritten = state.get("unwritten_failure")
        if unwritten:
            return self._write_unwritten(Failure(**unwritten), state, only_on_row=not options.dlq)
        self._renew_dead_letter(state)
        try:
            key = self._job_key(func, options, state)
        except ValueError:
            self._caller_error()
            raise
        if key is None:
            return self._run_body(None, None, options, state)
        try:
            attempt = self._attempt(func, key, options, state)
        except StoreUnavailable as exc:
            return self._wait_for_store(exc)
        return self._claim_and_run(attempt, options, state)

    def _job_key(self, func: Any, options: IdempotencyOptions, state: dict[str, Any]) -> str | None:
        key = state.get("key")
        if key is None and options.key is not None:
            key = derive_key(options.key, signature_of(func), self.args, self.kwargs)
            state["key"] = key
        return None if key is None else str(key)

    def _attempt(
        self, func: Any, key: str, options: IdempotencyOptions, state: dict[str, Any]
    ) -> Attempt:
        # The name its queue scoped the key by (a bound method's class included); a job that
        # came another way (enqueue_many, a plain Queue) scopes it here the same way.
        task_name = str(state.get("task_name") or _scoped_name_of(self, func))
        prefix = str(state.get("prefix") or defaults.KEY_PREFIX)
        lease = options.lease
        if lease is None:
            lease = float(self.timeout) if self.timeout and self.timeout > 0 else defaults.LEASE
        request = ClaimRequest(
            storage_key=storage_key(task_name, key),
            key=key,
            task_name=task_name,
            task_id=self.id,
            owner=self._idempotency_owner,
            fingerprint=state.get("fingerprint")
            or fingerprint(task_name, signature_of(func), self.args, self.kwargs),
            lease_seconds=float(lease),
            ttl_seconds=float(options.ttl),
            validate=options.validate,
            previous_owner=state.get("previous_owner"),
        )
        try:
            store = claim_store(self.connection, prefix, state.get("store_url"))
        except SETUP_ERRORS as exc:
            # A driver this worker lacks, say: the job waits, as for a store that is down.
            raise StoreUnusable(f"claim store unusable here: {exc}") from exc
        return Attempt(store=store, request=request, codec=CODEC)

    def _claim_and_run(
        self, attempt: Attempt, options: IdempotencyOptions, state: dict[str, Any]
    ) -> Any:
        request = attempt.request
        deadline = time.monotonic() + self._time_budget(options.wait_slice)
        waits = 0
        while True:
            try:
                claim = attempt.claim()
                lost = claim.outcome is Outcome.ACQUIRED and not attempt.held_at_start()
            except StoreUnavailable as exc:
                # A claim acquired (or applied, its reply lost) is taken back at once.
                state["previous_owner"] = request.owner
                return self._wait_for_store(exc)
            except JobTimeoutException as exc:
                # Fired before the body began (a slow store): the job fails as it would have a
                # moment later in its body, its claim (if made) released.
                return self._after_failure(exc, attempt, request.key, options, state)
            except CorruptRecord as exc:
                # Nothing can tell whether the key ran: the job waits in the dead-letter table
                # (its key to be looked at, or forgotten) rather than run, or vanish.
                self._idempotency_no_retry = True
                return self._after_failure(exc, None, request.key, options, state)
            if lost:
                # Lost while this process was paused (see Attempt.held_at_start): no body runs.
                if self._is_sync:
                    self._caller_error()
                    raise IdempotencyConflict(request.key, request.task_name, None)
                return self._wait_for_new_owner(state, request.key)
            if claim.outcome is Outcome.ACQUIRED:
                if waits:
                    # The wait came out of this run's timeout: the key is given back, and the
                    # body runs in a run of its own, with its whole timeout (the key taken at
                    # its first look, unless another call took it meanwhile: then that one
                    # runs). Kept instead, the key would sit claimed, unrenewed, in the queue.
                    attempt.release_quietly()
                    # Should that give-back have failed, the next run takes the key back at
                    # once rather than wait out this claim's lease as another's.
                    state["previous_owner"] = request.owner
                    return Requeue(f"key {request.key!r} is free: its body runs next")
                return self._run_body(attempt, request.key, options, state)
            record = claim.record
            assert record is not None
            if claim.outcome is Outcome.MISMATCH:
                mismatch = IdempotencyKeyMismatch(
                    request.key, request.task_name, record.fingerprint, request.fingerprint
                )
                self._caller_error()
                if state.get("dead_letter_id"):
                    # A dead letter's job whose key stands for other arguments by now (its
                    # caller called again, corrected): its row records the failure, or it would
                    # stay retrying, and in the end run the old arguments once the key expired.
                    return self._after_failure(mismatch, None, request.key, options, state)
                raise mismatch
            if waits == 0:
                signals.duplicate_suppressed.send(
                    task_name=request.task_name, where="worker", outcome=claim.outcome
                )
            if claim.outcome is Outcome.COMPLETED:
                try:
                    value = attempt.cached_value(record)
                except CorruptRecord as exc:
                    # As for a claim that cannot be read: the job waits in the dead-letter
                    # table (its key to be looked at, or forgotten) rather than vanish.
                    self._idempotency_no_retry = True
                    return self._after_failure(exc, None, request.key, options, state)
                self._dead_letter_succeeded(state)
                return value
            pause = self._on_in_progress(record, request, options, waits, state)
            if pause is None:
                return None
            held = f"key {request.key!r} is still held by job {record.task_id}"
            if time.monotonic() + pause > deadline:
                state["waits"] = int(state.get("waits") or 0) + 1
                return Requeue(held)
            try:
                time.sleep(pause)
            except JobTimeoutException:
                # The job's timeout counts from its start (its imports, the store's set-up
                # before this wait): it ended the wait, not a run. Back to the queue.
                state["waits"] = int(state.get("waits") or 0) + 1
                return Requeue(held)
            waits += 1

    def _on_in_progress(
        self,
        record: Record,
        request: ClaimRequest,
        options: IdempotencyOptions,
        waits: int,
        state: dict[str, Any],
    ) -> float | None:
        """Seconds to wait before looking again, or ``None`` to finish as a skipped duplicate."""
        # No duplicate caller either, so it always waits (dropped or failed, its caller would
        # never get the value, or a job whose body succeeded would fail): a re-run of the
        # owner's own job; an owner taken over while its body ran; the retry of a run that
        # held the key (another job took it meanwhile); a dead letter's re-enqueued job (its
        # row waits for its outcome).
        owed = bool(
            state.get("superseded") or state.get("previous_owner") or state.get("dead_letter_id")
        )
        mode = "wait" if owed or record.task_id == self.id else options.on_duplicate
        if mode == "skip":
            logger.info("job %s: key %r is in progress elsewhere, skipped", self.id, request.key)
            return None
        if mode == "raise" or self._is_sync:
            self._caller_error()
            raise IdempotencyConflict(request.key, request.task_name, record.task_id)
        return wait_for_owner(record, waits)

    def _run_body(
        self,
        attempt: Attempt | None,
        key: str | None,
        options: IdempotencyOptions,
        state: dict[str, Any],
    ) -> Any:
        try:
            if attempt is None:
                with self._dead_letter_kept_retrying(state):
                    value = super().perform()
            else:
                # The lease is renewed first: the row's renewal may wait on its database.
                with attempt.heartbeat(), self._dead_letter_kept_retrying(state):
                    value = super().perform()
        except Exception as exc:
            return self._after_failure(exc, attempt, key, options, state)
        except BaseException:
            # Worker shutdown and the like: RQ re-enqueues or fails the job as it sees fit.
            if attempt is not None:
                attempt.release_quietly()
            raise
        if isinstance(value, Retry):
            return self._returned_retry(value, attempt, key, options, state)
        if attempt is not None:
            # One deadline: storing it again after the job timeout fired has no more time.
            patience = max(attempt.request.lease_seconds, defaults.MIN_COMPLETION_PATIENCE)
            finish_by = time.monotonic() + self._time_budget(patience)
            value = despite_time_limit(
                JobTimeoutException, lambda: attempt.finish(value, finish_by - time.monotonic())
            )
            if attempt.superseded and not self._is_sync:
                # Taken over mid-run and the new owner is still running. (A synchronous queue
                # has no queue to wait in: its caller gets the value its body returned.)
                return self._wait_for_new_owner(state, attempt.request.key)
        self._dead_letter_succeeded(state)
        return value

    def _after_failure(
        self,
        exc: Exception,
        attempt: Attempt | None,
        key: str | None,
        options: IdempotencyOptions,
        state: dict[str, Any],
    ) -> Requeue:
        """A run failed with ``exc`` (being handled): its claim is released, then RQ retries
        it, or it is dead-lettered and fails; a :class:`Requeue` when the dead letter must wait
        for its database."""
        # A synchronous queue (is_async=False) never retries: its failure is final.
        will_retry = self.should_retry and not self._is_sync
        if attempt is not None:
            despite_time_limit(JobTimeoutException, attempt.release_quietly)
            if will_retry:
                # The retry may take the key over at once even if the release was lost.
                state["previous_owner"] = attempt.request.owner
        if will_retry:
            raise exc
        # The job's timeout may fire in any step after the function (a slow dump of large
        # arguments): the dead letter is made to its end all the same, as it is written.
        message, traceback = despite_time_limit(
            JobTimeoutException, lambda: (error_text(exc), "".join(format_exception(exc)))
        )
        requeue = self._final_failure(
            type(exc).__name__, message, traceback, key, options, state, attempt
        )
        if requeue is not None:
            return requeue
        raise exc

    def _returned_retry(
        self,
        retry: Retry,
        attempt: Attempt | None,
        key: str | None,
        options: IdempotencyOptions,
        state: dict[str, Any],
    ) -> Any:
        """The function returned ``Retry`` (RQ's other retry): release; dead-letter if it is
        the last one RQ allows."""
        if attempt is not None:
            despite_time_limit(JobTimeoutException, attempt.release_quietly)
            state["previous_owner"] = attempt.request.owner
        if self._is_sync:
            # A synchronous queue never retries (RQ ends the job finished, its value the
            # Retry): final, as a failure there is.
            message = "returned Retry on a synchronous queue, which never retries"
        elif (self.number_of_retries or 0) < retry.max:
            return retry
        else:
            message = f"returned Retry after {self.number_of_retries} retries (max {retry.max})"
        requeue = self._final_failure(
            "MaxRetriesExceeded", message, None, key, options, state, attempt
        )
        return requeue if requeue is not None else retry

    # -- dead letters -------------------------------------------------------------------------

    def _final_failure(
        self,
        error_type: str,
        message: str,
        traceback: str | None,
        key: str | None,
        options: IdempotencyOptions,
        state: dict[str, Any],
        attempt: Attempt | None,
    ) -> Requeue | None:
        """The function failed for good: write the dead letter (``None``), or, if the database
        cannot be written, return the :class:`Requeue` that writes it on the next run."""
        self._idempotency_settled = True
        logger.error("job %s (%s) failed for good: %s", self.id, self.func_name, error_type)
        if not options.dlq and state.get("dead_letter_id") is None:
            return None  # (a row's run with the queue turned off since records on its row)
        occurrence = attempt.request.owner if attempt is not None else new_owner()
        failure = despite_time_limit(
            JobTimeoutException,
            lambda: self._build_failure(occurrence, error_type, message, traceback, key, options),
        )
        return self._write_failure(failure, state, only_on_row=not options.dlq)

    def _write_failure(
        self, failure: Failure, state: dict[str, Any], only_on_row: bool = False
    ) -> Requeue | None:
        try:
            self._write_dead_letter(failure, state, only_on_row)
        except (StoreUnavailable, SchemaVersionError) as exc:
            if self._is_sync:
                logger.error("job %s: could not write its dead letter: %s", self.id, exc)
                return None
            delay = self._time_budget(defaults.DLQ_WRITE_RETRY_DELAY)
            logger.error(
                "job %s: could not write its dead letter (%s); will write it in %ss",
                self.id,
                exc,
                delay,
            )
            state["unwritten_failure"] = dataclasses.asdict(failure)
            return self._requeue_later(delay, "its dead letter is still to be written")
        return None

    def _write_dead_letter(
        self, failure: Failure, state: dict[str, Any], only_on_row: bool = False
    ) -> None:
        """Write ``failure`` as a new row, or as the next failure of the row this job retries
        (only the latter with ``only_on_row``: the function's dead-letter queue is off)."""
        despite_time_limit(
            JobTimeoutException,
            lambda: write_failure(
                dead_letter_queue(state.get("dlq_url")),
                failure,
                state.get("dead_letter_id"),
                state.get("dead_letter_sweep"),
                only_on_row=only_on_row,
            ),
        )

    def _write_unwritten(
        self, failure: Failure, state: dict[str, Any], only_on_row: bool = False
    ) -> Any:
        """A run that only writes the dead letter an earlier run could not write."""
        self._idempotency_settled = True
        requeue = self._write_failure(failure, state, only_on_row)
        if requeue is not None:
            return requeue
        state.pop("unwritten_failure", None)
        self.save_meta()  # type: ignore[no-untyped-call]  # RQ saves no meta on failure
        self._idempotency_no_retry = True
        raise DeadLettered(failure.error_type, failure.error_message, failure.task_id)

    def _build_failure(
        self,
        attempt_id: str,
        error_type: str,
        message: str,
        traceback: str | None,
        key: str | None,
        options: IdempotencyOptions,
    ) -> Failure:
        found = self.meta.get(META_KEY)
        state = found if isinstance(found, dict) else {}
        call = self._readable_call()
        args: list[Any]
        kwargs: dict[str, Any]
        if call is None:
            # Data RQ cannot read here (a class this worker cannot import): the row keeps none
            # of the call, and only RQ's own copy is sent again.
            args, kwargs, lossy, task_name = [], {}, True, str(state.get("task_name") or "")
        else:
            call_args, call_kwargs, instance, task_name = call
            # An RQ job's serializer (pickle unless set) may keep what JSON gives back otherwise.
            args, kwargs, faithful = stored_arguments(call_args, call_kwargs, exact=True)
            # A method's job (RQ names it by the method alone) needs its object too, which the
            # row does not keep: as with arguments JSON cannot hold, only RQ's own copy is sent
            # again.
            lossy = not faithful or instance is not None
        kept_options = row_options(self.origin, lossy)
        # What a re-enqueue needs once RQ no longer has this job: the key's scope (never the
        # stores' URLs, which may hold passwords: the sweep is given its own) and the timeout.
        for name in ("prefix", "task_name"):
            if state.get(name):
                kept_options[name] = state[name]
        kept_options[OWN_STORE] = bool(state.get("store_url"))
        if self.timeout:
            kept_options["timeout"] = self.timeout
        serializer = serializer_name(self.serializer)
        if serializer is not None:
            kept_options["serializer"] = serializer  # the sweep reads and writes the job so
        return Failure(
            failure_id=f"{self.id}:{attempt_id}",
            task_name=task_name,
            task_id=self.id,
            idempotency_key=key,
            args=args,
            kwargs=kwargs,
            options=kept_options,
            error_type=error_type,
            error_message=message[:MAX_ERROR_MESSAGE_CHARS],
            traceback=traceback[-MAX_TRACEBACK_CHARS:] if traceback else None,
            max_retries=options.dlq_max_retries,
            framework=FRAMEWORK,
        )

    def _readable_call(self) -> tuple[tuple[Any, ...], dict[str, Any], Any, str] | None:
        """The job's arguments, keyword arguments, object and function name; ``None`` when RQ
        cannot read its data here."""
        try:
            return tuple(self.args), dict(self.kwargs), self.instance, self.func_name or ""
        except DeserializationError:
            return None

    def _ended_run_scope(self) -> tuple[Any, IdempotencyOptions, dict[str, Any]] | None:
        """For a run that ended out of our code's sight: its function (``None`` when it cannot
        be imported in this process: the meta still says what it was), options and state;
        ``None`` for a job that is none of ours (no ``@idempotent`` options, no meta)."""
        try:
            func = self.func
        except Exception:
            func = None
        options = options_of(func)
        found = self.meta.get(META_KEY)
        if options is None and not isinstance(found, dict):
            return None
        state: dict[str, Any] = found if isinstance(found, dict) else {}
        return func, options or DEFAULT_OPTIONS, state

    def _release_dead_horse_claim(self) -> dict[str, Any] | None:
        """Release the claim this worker's work horse made for this job (it was forked from
        this very job object, so it claimed under this owner id); the job's state, ``None``
        for a job that is none of ours. A claim another owner holds is left alone."""
        scope = self._ended_run_scope()
        if scope is None:
            return None
        func, options, state = scope
        key = self._job_key(func, options, state)
        if key is not None:
            self._release_dead_owner(func, key, options, state)
        return state

    def _release_dead_owner(
        self, func: Any, key: str, options: IdempotencyOptions, state: dict[str, Any]
    ) -> None:
        try:
            attempt = self._attempt(func, key, options, state)
        except StoreUnavailable as exc:
            logger.warning("could not release key %r (%s): its lease frees it", key, exc)
            return
        attempt.release_dead_owner()

    def _release_stopped_run(self) -> None:
        """A job stopped on purpose (``send_stop_job_command``): not dead-lettered, but its
        work horse's claim is released, so a new call of the key runs at once rather than
        wait out the lease (or be answered with this stopped job)."""
        state = self._release_dead_horse_claim()
        if state is None:
            return
        dead_letter_id = state.get("dead_letter_id")
        if dead_letter_id:
            # A dead letter's retry stopped: a failed retry on its row, which would otherwise
            # stay retrying and be sent again once its timeout passed.
            try:
                dead_letter_queue(state.get("dlq_url")).record_retry_failure(
                    str(dead_letter_id),
                    "StopJobCommand",
                    "stopped while it ran",
                    None,
                    state.get("dead_letter_sweep"),
                )
            except StoreUnavailable as exc:
                logger.warning(
                    "could not record the stop on dead letter %s: %s", dead_letter_id, exc
                )

    def _settle_lost_run(
        self, exc_string: str, execution_id: str | None, pipeline: Pipeline
    ) -> None:
        """Dead-letter a run that failed for good out of our code's sight, then, if it was this
        worker's dead work horse, release its key.

        Should the dead letter not be written (its database is down), the job goes back to its
        queue in RQ's own ``pipeline``, carrying the failure: its next run only writes it.
        """
        scope = self._ended_run_scope()
        if scope is None:
            return
        func, options, state = scope
        abandoned = "AbandonedJobError" in exc_string
        key = self._job_key(func, options, state)
        if key is not None and not abandoned:
            # The horse was forked from this very job object: it claimed under this owner id.
            self._release_dead_owner(func, key, options, state)
        if not options.dlq and state.get("dead_letter_id") is None:
            return
        started = self.started_at.isoformat() if self.started_at else "unknown"
        ended_by = self._idempotency_ended_by
        traceback = None
        if ended_by is not None:  # a run of this process, ended by a BaseException
            error_type, message = type(ended_by).__name__, str(ended_by)
        elif self._readable_call() is None:
            # RQ failed it before it could run: it could not read its data.
            error_type, traceback = DeserializationError.__name__, exc_string
            message = "RQ cannot read the job's function and arguments here"
        else:
            error_type = "AbandonedJobError" if abandoned else "WorkHorseKilled"
            lines = exc_string.strip().splitlines()
            message = lines[0] if lines else "work horse lost"
        failure = self._build_failure(
            f"lost:{execution_id or started}", error_type, message, traceback, key, options
        )
        try:
            self._write_dead_letter(failure, state, only_on_row=not options.dlq)
        except (StoreUnavailable, SchemaVersionError) as exc:
            if self._is_sync:
                raise
            logger.error(
                "job %s: could not write its dead letter (%s); it goes back to queue %s to "
                "write it",
                self.id,
                exc,
                self.origin,
            )
            state["unwritten_failure"] = dataclasses.asdict(failure)
            self.meta[META_KEY] = state  # a job a plain Queue made had none: saved with it
            self.failed_job_registry.remove(self, pipeline=pipeline)
            queue = Queue(
                self.origin,
                connection=self.connection,
                job_class=type(self),
                serializer=self.serializer,
            )
            forget_ttl(self, pipeline)  # see _handle_retry_result
            queue._enqueue_job(self, pipeline=pipeline)

    def _wait_for_new_owner(self, state: dict[str, Any], key: str) -> Requeue:
        """This job lost its claim to another execution (while its body ran, or before it
        started): it waits for that one's value, whatever ``on_duplicate`` says."""
        state["superseded"] = True
        return self._requeue_later(defaults.WAIT_INITIAL_DELAY, f"key {key!r} was taken over")

    def _wait_for_store(self, exc: StoreUnavailable) -> Requeue:
        """The claim store cannot be reached: the job goes back to its queue, to try later
        (a synchronous queue raises ``exc``)."""
        if self._is_sync:
            raise exc
        delay = self._time_budget(defaults.STORE_UNAVAILABLE_DELAY)
        if isinstance(exc, StoreUnusable):
            # Configuration (a driver this worker lacks, a URL it cannot read): said loudly.
            logger.error("job %s: %s; it goes back to its queue, unrun", self.id, exc)
        else:
            logger.warning(
                "job %s: store unreachable, will try again in %ss: %s", self.id, delay, exc
            )
        return self._requeue_later(delay, f"store: {exc}")

    def _renew_dead_letter(self, state: dict[str, Any]) -> None:
        """A dead letter's re-enqueued job begins a run (its body's, or a look at its key that
        may wait again): its row is renewed, so the sweep's retrying timeout counts from its
        last run, not from the re-enqueue. A job that waits for its key longer than that
        timeout is then not taken for a stuck row, its failure dropped as another sweep's."""
        dead_letter_id = state.get("dead_letter_id")
        if dead_letter_id:
            renewal.renew_retrying(
                functools.partial(dead_letter_queue, state.get("dlq_url")),
                str(dead_letter_id),
                state.get("dead_letter_sweep"),
                JobTimeoutException,
            )

    @contextmanager
    def _dead_letter_kept_retrying(self, state: dict[str, Any]) -> Iterator[None]:
        """While a dead letter's re-enqueued job runs its body, its row is renewed every third
        of the retrying timeout (see :mod:`idempotent_tasks.dlq.renewal`); the run's start
        renewed it already."""
        dead_letter_id = state.get("dead_letter_id")
        if not dead_letter_id:
            yield
            return
        queue_of = functools.partial(dead_letter_queue, state.get("dlq_url"))
        with renewal.kept_retrying(
            queue_of,
            str(dead_letter_id),
            state.get("dead_letter_sweep"),
            defaults.DLQ_RETRYING_TIMEOUT,
        ):
            yield

    def _dead_letter_succeeded(self, state: dict[str, Any]) -> None:
        """A dead letter's job succeeded: its row is marked, and the job is a dead letter's no
        more (a repeating job's next run that fails is a new failure, with a row of its own)."""
        dead_letter_id = state.get("dead_letter_id")
        sweep_id = state.get("dead_letter_sweep")
        if dead_letter_id:
            despite_time_limit(
                JobTimeoutException,
                lambda: mark_succeeded(
                    functools.partial(dead_letter_queue, state.get("dlq_url")),
                    str(dead_letter_id),
                    sweep_id,
                    self.connection,
                ),
            )
            # Saved with the job when RQ schedules its next repeat.
            state.pop("dead_letter_id", None)
            state.pop("dead_letter_sweep", None)

    # -- small things -------------------------------------------------------------------------

    @property
    def _is_sync(self) -> bool:
        return self.worker_name == SYNC_WORKER

    def _caller_error(self) -> None:
        """This run fails for a reason of the caller's: no retry, no dead letter."""
        self._idempotency_no_retry = True
        self._idempotency_settled = True

    def _time_budget(self, wanted: float) -> float:
        """``wanted`` seconds, but at most half the job's timeout (its death penalty)."""
        if self.timeout and self.timeout > 0:
            return min(wanted, float(self.timeout) / 2)
        return wanted

    def _requeue_later(self, delay: float, reason: str) -> Requeue:
        """Pause ``delay`` s in the worker (so the job does not spin through its queue and no
        scheduler is needed), then go back to the queue: even if the job timeout fires during
        the pause, as what goes back may be a failure still to dead-letter."""
        try:
            time.sleep(delay)
        except JobTimeoutException:
            logger.info("job %s: its timeout ended the pause before its requeue", self.id)
        return Requeue(reason)


def _scoped_name_of(job: Job, func: Any) -> str:
    """The name a job's key is scoped by when its meta does not say (see ``scoped_name``)."""
    if func is not None and job.instance is not None:
        return scoped_name(func)
    return job.func_name or ""
