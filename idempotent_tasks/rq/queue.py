"""``IdempotentQueue``: an ``rq.Queue`` whose ``enqueue`` takes ``idempotency_key=``."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from redis import Redis
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.results import Result
from rq.utils import import_attribute
from sqlalchemy import URL

from .. import defaults, signals
from ..errors import CorruptRecord, IdempotencyKeyMismatch, StoreUnavailable
from ..keys import (
    check_task_id,
    derive_key,
    fingerprint,
    storage_key,
    validate_key,
)
from ..records import Outcome, Record, Status
from ..stores import Store
from ..urls import url_text
from .job import CODEC, IdempotentJob
from .options import (
    DEFAULT_OPTIONS,
    META_KEY,
    IdempotencyOptions,
    options_of,
    scoped_name,
    signature_of,
)
from .resources import claim_store

logger = logging.getLogger(__name__)

#: ``Result.id`` of the in-memory result a :class:`CachedResultJob` answers with.
CACHED_RESULT_ID = "idempotency-cache"


class CachedResultJob(IdempotentJob):
    """What enqueueing a completed key returns: the original job, answering from the cache.

    ``id`` is the original job's id; ``return_value()``, ``result`` and ``latest_result()``
    give the cached value (whatever RQ still keeps of the original job: its own result may
    have expired long before the key's TTL); ``get_status()`` is ``finished``. It is never
    saved to Redis: nothing was enqueued.
    """

    #: The cached value (``None`` when the result was too big or not serializable to cache).
    cached_value: Any = None

    def return_value(self, refresh: bool = False) -> Any:
        """The cached value."""
        return self.cached_value

    @property
    def result(self) -> Any:
        """The cached value (without RQ's deprecation warning of ``Job.result``)."""
        return self.cached_value

    def latest_result(self, timeout: int = 0) -> Result:
        """A successful ``Result`` holding the cached value."""
        return Result(
            job_id=self.id,
            type=Result.Type.SUCCESSFUL,
            connection=self.connection,
            id=CACHED_RESULT_ID,
            return_value=self.cached_value,
            serializer=self.serializer,
        )

    def get_status(self, refresh: bool = True) -> JobStatus:
        """Always ``finished``."""
        return JobStatus.FINISHED


class IdempotentQueue(Queue):
    """An RQ queue that enqueues a keyed call at most once per key and TTL.

    ``enqueue(f, *args, idempotency_key="...", **kwargs)`` and
    ``enqueue_call(f, args, kwargs, idempotency_key="...")`` take RQ's usual arguments plus the
    key (``idempotency_key`` is a reserved name, like RQ's ``job_timeout``: pass a function
    argument of that name through ``enqueue_call(kwargs=...)``). Without a per-call key, the
    function's ``@idempotent(key=...)`` template or callable gives one; with neither, the job
    runs as a plain RQ job that is still dead-lettered when it fails for good.

    Before enqueueing, the queue looks at the key's record (an optimisation; the worker's claim
    is the guarantee): a completed key returns a :class:`CachedResultJob` (the original job's
    id, the cached value) and enqueues nothing; a key in progress returns the owner's job
    (fetched from Redis) and enqueues nothing. Otherwise the job is enqueued carrying the key
    and its argument fingerprint in ``job.meta["idempotency"]``. ``enqueue_at`` and
    ``enqueue_in`` take the key too (without the look-up); ``enqueue_many`` takes none
    (``@idempotent`` keys still apply in the worker, under this queue's prefix, store and
    dead-letter table, which every job it makes carries).

    Workers must run ``IdempotentJob`` (``rq worker --queue-class
    idempotent_tasks.rq.IdempotentQueue --job-class idempotent_tasks.rq.IdempotentJob``).

    Args:
        name: the queue's name.
        connection: RQ's Redis connection; claims and results live there too unless
            ``store_url`` is given.
        store_url: a claim store of its own (``redis://``, an SQLAlchemy URL ...), carried to
            the workers in each job's meta.
        dlq_url: the dead-letter database (SQLAlchemy URL) workers write to; unset, workers use
            ``$IDEMPOTENT_TASKS_DLQ_URL``, else the local SQLite file.
        key_prefix: first part of every stored key (default ``"idempotent_tasks"``).
        **kwargs: the rest of ``rq.Queue``'s arguments.
    """

    job_class: type[Job] = IdempotentJob

    def __init__(
        self,
        name: str = "default",
        connection: Redis | None = None,
        *args: Any,
        store_url: str | URL | None = None,
        dlq_url: str | URL | None = None,
        key_prefix: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(name, connection, *args, **kwargs)
        if not issubclass(self.job_class, IdempotentJob):
            logger.warning(
                "queue %s runs jobs as %s, which claims no keys: start workers with "
                "--job-class idempotent_tasks.rq.IdempotentJob",
                name,
                self.job_class.__name__,
            )
        self.store_url = url_text(store_url) if store_url else None
        self.dlq_url = url_text(dlq_url) if dlq_url else None
        self.key_prefix = key_prefix or defaults.KEY_PREFIX
        self._store: tuple[int, Store] | None = None

    def enqueue(self, f: Any, *args: Any, **kwargs: Any) -> Job:
        """RQ's ``enqueue`` with an ``idempotency_key=`` keyword (see the class docstring).

        Raises:
            ValueError: the key is not a non-empty ``str`` (nothing is enqueued), or the
                function requires a key and none was given or derived.
            IdempotencyKeyMismatch: the key was already used with other arguments.
        """
        key = _call_key(kwargs)
        parsed = self.parse_args(f, *args, **kwargs)
        return self.enqueue_call(**parsed._asdict(), idempotency_key=key)

    def enqueue_call(  # type: ignore[override]
        self,
        func: Any,
        args: tuple[Any, ...] | list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        *,
        idempotency_key: object = None,
        meta: dict[str, Any] | None = None,
        **rq_options: Any,
    ) -> Job:
        """RQ's ``enqueue_call`` with an ``idempotency_key=`` keyword (see :meth:`enqueue`).

        RQ's own options (``timeout``, ``retry``, ``job_id`` ...) are keyword-only here.
        """
        call_args = tuple(args or ())
        call_kwargs = dict(kwargs or {})
        options, task_name, carried = self._carried(func, call_args, call_kwargs, idempotency_key)
        key = carried.get("key")
        if key is not None:
            check_task_id(rq_options.get("job_id"))
        # Without the function here, no fingerprint tells the key's arguments apart: the worker
        # alone looks at the key.
        if key is not None and "fingerprint" in carried:
            answered = self._peek(
                task_name, key, carried["fingerprint"], options, func, call_args, call_kwargs
            )
            if answered is not None:
                return answered
        job_meta = dict(meta or {})
        job_meta[META_KEY] = carried
        return super().enqueue_call(func, call_args, call_kwargs, meta=job_meta, **rq_options)

    def enqueue_at(self, datetime: Any, f: Any, *args: Any, **kwargs: Any) -> Job:
        """RQ's ``enqueue_at`` (and so ``enqueue_in``) with an ``idempotency_key=`` keyword.

        The key travels with the scheduled job, whose worker claims it when it runs; nothing
        is looked up now (the key's state then is what counts). Needs RQ's scheduler
        (``rq worker --with-scheduler``), as any scheduled job does.
        """
        call_key = _call_key(kwargs)
        parsed = self.parse_args(f, *args, **kwargs)
        _, _, carried = self._carried(
            parsed.func, tuple(parsed.args or ()), dict(parsed.kwargs or {}), call_key
        )
        if carried.get("key") is not None:
            check_task_id(parsed.job_id)
        kwargs["meta"] = {**(parsed.meta or {}), META_KEY: carried}
        job: Job = super().enqueue_at(datetime, f, *args, **kwargs)
        return job

    def create_job(
        self, func: Any, args: Any = None, kwargs: Any = None, *more: Any, **options: Any
    ) -> Job:
        """RQ's ``create_job``, for every way a job is made (``enqueue_many`` ...): one that
        does not carry this queue's idempotency settings yet gets them, so its worker claims
        the key the function derives under this queue's prefix and store, and writes its dead
        letter to this queue's table. (Only ``enqueue`` looks at the key before enqueuing.)"""
        meta = options.get("meta")
        if not more and (not isinstance(meta, dict) or META_KEY not in meta):
            call_args, call_kwargs = tuple(args or ()), dict(kwargs or {})
            _, _, carried = self._carried(func, call_args, call_kwargs, None)
            if carried.get("key") is not None:
                check_task_id(options.get("job_id"))
            options["meta"] = {**(meta or {}), META_KEY: carried}
        return super().create_job(func, args, kwargs, *more, **options)

    def close(self) -> None:
        """Let go of the claim store. It is this process's one for the queue's ``store_url``
        (or RQ connection), shared with the jobs that run here; close every such store with
        ``idempotent_tasks.rq.resources.close_all()``."""
        self._store = None

    # -- helpers ------------------------------------------------------------------------------

    @property
    def store(self) -> Store:
        """This queue's claim store: the very one its jobs claim in, in this process (a
        ``memory://`` store is one object), built on first use and again in a forked child."""
        if self._store is None or self._store[0] != os.getpid():
            store = claim_store(self.connection, self.key_prefix, self.store_url)
            self._store = (os.getpid(), store)
        return self._store[1]

    def _carried(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], call_key: object
    ) -> tuple[IdempotencyOptions, str, dict[str, Any]]:
        """The function's options and scoped name, and what a job of it carries in meta."""
        target = _importable(func)
        options = options_of(target) or DEFAULT_OPTIONS
        task_name = scoped_name(func)
        key = self._call_key(call_key, options, target, task_name, args, kwargs)
        if key is not None and isinstance(func, functools.partial):
            raise ValueError(
                "a functools.partial cannot be enqueued with an idempotency key: RQ names every "
                "partial functools.partial.__call__, so its keys would be every partial's, "
                "whatever function it wraps; enqueue the function itself, with all its arguments"
            )
        carried: dict[str, Any] = {"prefix": self.key_prefix, "task_name": task_name}
        if self.store_url:
            carried["store_url"] = self.store_url
        if self.dlq_url:
            carried["dlq_url"] = self.dlq_url
        if key is not None:
            carried["key"] = key
        if key is not None and target is not None:
            # Bound to the function's parameters (a producer that cannot import it leaves that
            # to the worker: the arguments as given would not match the same call made
            # otherwise, positionally or by name).
            carried["fingerprint"] = fingerprint(task_name, signature_of(target), args, kwargs)
        return options, task_name, carried

    def _call_key(
        self,
        call_key: object,
        options: IdempotencyOptions,
        target: Any,
        task_name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> str | None:
        if call_key is not None:
            return validate_key(call_key)
        if options.key is not None:
            return derive_key(options.key, signature_of(target), args, kwargs)
        if options.key_required:
            raise ValueError(
                f"{task_name} requires an idempotency key: pass enqueue(..., idempotency_key=...) "
                "or give the function @idempotent(key=...)"
            )
        return None

    def _peek(
        self,
        task_name: str,
        key: str,
        expected_fingerprint: str,
        options: IdempotencyOptions,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Job | None:
        """Publish-side short cut (an optimisation only: the worker's claim is the guarantee)."""
        try:
            record = self.store.get(storage_key(task_name, key))
        except (StoreUnavailable, CorruptRecord) as exc:
            logger.warning("enqueueing %s without a look at its key: %s", task_name, exc)
            return None
        if record is None:
            return None
        if options.validate and record.fingerprint != expected_fingerprint:
            raise IdempotencyKeyMismatch(key, task_name, record.fingerprint, expected_fingerprint)
        if record.status is Status.COMPLETED:
            return self._cached(record, func, args, kwargs)
        if record.lease_expires_at > record.store_time():
            try:
                owner = self.job_class.fetch(
                    record.task_id, connection=self.connection, serializer=self.serializer
                )
            except NoSuchJobError:
                return None
            except ValueError as exc:  # a job hash RQ cannot read (a status, a timeout)
                logger.warning(
                    "enqueueing %s: the job %s of its key cannot be read: %s",
                    task_name,
                    record.task_id,
                    exc,
                )
                return None
            if owner.get_status(refresh=False) in _ENDED:
                return None  # stopped, failed or cancelled: the worker's claim decides
            signals.duplicate_suppressed.send(
                task_name=task_name, where="publish", outcome=Outcome.IN_PROGRESS
            )
            return owner
        return None

    def _cached(
        self, record: Record, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Job | None:
        try:
            value = CODEC.decode(record.result) if record.result else None
        except CorruptRecord as exc:
            logger.warning("cached result of key %r is unreadable: %s", record.key, exc)
            return None
        job = CachedResultJob.create(
            func,
            args=args,
            kwargs=kwargs,
            connection=self.connection,
            id=record.task_id,
            origin=self.name,
            status=JobStatus.FINISHED,
            serializer=self.serializer,
        )
        assert isinstance(job, CachedResultJob)
        job.cached_value = value
        signals.duplicate_suppressed.send(
            task_name=record.task_name, where="publish", outcome=Outcome.COMPLETED
        )
        return job


#: Statuses of an owner's job that will not run (again) by itself.
_ENDED = frozenset({JobStatus.STOPPED, JobStatus.FAILED, JobStatus.CANCELED})


def _importable(func: Any) -> Any:
    """The function itself, imported when given as a dotted path (``None`` if it cannot be).

    Its signature binds arguments for the fingerprint, and it may carry ``@idempotent``
    options. A producer that cannot import the function leaves the fingerprint to the worker.
    """
    if not isinstance(func, str):
        return func
    try:
        return import_attribute(func)
    except (ImportError, AttributeError, ValueError):
        return None


def _call_key(kwargs: dict[str, Any]) -> str | None:
    """The ``idempotency_key=`` keyword taken out of ``kwargs`` (``None`` when not given);
    ``ValueError`` for a bad one, ``None`` given included, as ``apply_async``."""
    if "idempotency_key" not in kwargs:
        return None
    return validate_key(kwargs.pop("idempotency_key"))
