"""``IdempotentTask``: the Celery adapter over the framework-free claim protocol in ``core``."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import time
import warnings
from collections.abc import Mapping
from datetime import datetime
from functools import cached_property
from traceback import format_exception
from typing import Any, ClassVar, NoReturn, cast

from celery import Task, states
from celery.app.task import Context, get_actual_ignore_result
from celery.backends.base import DisabledBackend
from celery.backends.rpc import RPCBackend
from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded
from celery.result import AsyncResult
from celery.utils import uuid
from celery.utils.log import get_task_logger
from kombu.exceptions import OperationalError
from kombu.utils.imports import symbol_by_name

from . import (
    defaults,
    publishing,
    reserve_and_push,
    revocations,  # noqa: F401  (connects the receiver of Celery's task_revoked)
    signals,
    startup,  # noqa: F401  (connects the worker_init check of the schema versions)
    unknown_tasks,  # noqa: F401  (connects the receiver of Celery's task_unknown)
)
from .app_store import dlq_for, store_for
from .canvas_keys import check_following_keys, required_key_error
from .celery_result import backend_shares_store, result_side_write
from .codec import UNSAFE_SERIALIZERS, ResultCodec, serializer_installed
from .core import Attempt, despite_time_limit, new_owner, wait_delay, wait_for_owner
from .dead_letters import (
    DEAD_LETTER_HEADER,
    DEAD_LETTER_SWEEP_HEADER,
    FAILURE_REPORTED_HEADER,
    UNWRITTEN_FAILURE_HEADER,
    UNWRITTEN_SUCCESS_HEADER,
    dead_letter_headers,
    failure_id_of,
    failure_options,
    mark_succeeded,
    readable_row,
    record_unrun_retry,
    renew_retrying,
    retrying_kept_alive,
    routing_options,
    stamp_options,
    write_failure,
)
from .dlq import DeadLetterStatus, Failure
from .dlq.arguments import error_text, stored_arguments
from .errors import (
    CorruptRecord,
    DeadLettered,
    IdempotencyConflict,
    IdempotencyError,
    IdempotencyKeyMismatch,
    SchemaVersionError,
    StoreUnavailable,
)
from .keys import (
    KEY_HEADER,
    KeySource,
    check_task_id,
    derive_key,
    fingerprint,
    given_key,
    storage_key,
    validate_key,
)
from .pickups import (
    call_expired,
    claim_ttl,
    expired,
    hand_to_guard,
    make_pickup,
    pickup_timeout,
    republish_taken,
    seconds_until,
)
from .publishing import PREVIOUS_OWNER_HEADER, RESERVED_HEADER
from .records import (
    LATEST_MESSAGE,
    ClaimRequest,
    DuePickup,
    Outcome,
    Pickup,
    Record,
    SideWrite,
    Status,
)
from .replacements import REPLACED, WAIT_SINCE_HEADER, is_replaced
from .settings import (
    app_setting,
    byte_count,
    dead_letter_retries,
    positive_seconds,
    resolve,
    switch,
)
from .startup import WORKER_TIME_LIMIT
from .worker_request import (
    ISSUED_BY,
    ISSUED_OWNER,
    IdempotentRequest,
    issued_owner,
    request_header,
)

logger = get_task_logger(__name__)
module_logger = logging.getLogger(__name__)

#: Celery's name for a chain signature (``celery.canvas.chain``).
CHAIN_TASK = "celery.chain"
#: Seconds before a call's hard time limit at which storing its result stops waiting for an
#: unreachable store (the limit counts from the pool's start of the call, a little earlier).
HARD_LIMIT_MARGIN = 1.0
WAITS_HEADER = "idempotency_waits"
#: Header of an owner whose claim was taken over while its body ran, waiting for the new owner.
SUPERSEDED_HEADER = "idempotency_superseded"
#: Header naming the task id of another call whose key this call (or the call it retries or
#: waits for) took over: this call answers that call's callers too.
TAKEN_FROM_HEADER = "idempotency_taken_from"
#: When the call a copy of a message stands for expires (ISO 8601): the copy itself does not,
#: so it is answered with the key's value past it, and ends expired only if it would run a key
#: it found free or queued for itself (see the claim in ``IdempotentTask.__call__``).
EXPIRES_HEADER = "idempotency_expires"
#: ``apply_async`` option our own re-publishes carry: headers to add, and no publish-side peek.
_REPUBLISH = "_idempotency_republish"
#: ``_message_pickup``'s default expiry: the running call's own.
_THIS_CALLS: Any = object()

ON_DUPLICATE_CHOICES = ("wait", "skip", "raise")
#: Bounds of what a dead letter keeps of an error.
MAX_ERROR_MESSAGE_CHARS = 10_000
MAX_TRACEBACK_CHARS = 60_000
#: The same, in the header of the message that writes a failure later (the database down):
#: AMQP carries a message's headers in one frame (128 KiB on RabbitMQ by default), and one
#: too large makes the broker close the connection, the message lost though kombu sent it.
HEADER_ERROR_MESSAGE_CHARS = 2_000
HEADER_TRACEBACK_CHARS = 8_000
HEADER_OPTIONS_CHARS = 32_000


class IdempotentTask(Task):  # type: ignore[misc]
    """A Celery task that runs to success at most once per idempotency key.

    Use it as ``@app.task(base=IdempotentTask)`` and call with
    ``apply_async(..., idempotency_key="...")`` or ``sig.set(idempotency_key="...")``. Calls
    without a key (per call or per task) are not deduplicated; like keyed ones, a final
    failure of theirs is written to the dead-letter table, whose sweep runs them again (set
    ``dlq = False`` on a task that must not run again).

    Messages are acknowledged after the task runs (``acks_late``). A worker process that dies
    under a call fails it with ``WorkerLostError``, which Celery retries
    (``retry_on_worker_lost``) within ``max_retries`` (for ever when that is ``None``); after
    those it is dead-lettered, so a crash never loses a keyed task. Where Celery cannot send
    that retry, the message goes back to the broker (``reject_on_worker_lost``). Override
    these per task if you must.
    """

    #: Per-task key when a call gives none: a template over the call's arguments
    #: (``"order:{order_id}"``) or a callable ``(args, kwargs) -> str``.
    idempotency_key: ClassVar[KeySource | None] = None
    #: Refuse calls that have no key: ``ValueError`` at ``apply_async``, and at the worker for
    #: one sent by other means (by name, by beat, ``apply()``), which runs nothing.
    idempotency_key_required: ClassVar[bool] = False
    #: Seconds a completed key answers duplicates (default: ``app.conf.idempotency_ttl``).
    idempotency_ttl: ClassVar[float | None] = None
    #: Seconds a claim lives without a heartbeat (default: app setting, time_limit, then 300).
    idempotency_lease: ClassVar[float | None] = None
    #: Compare argument fingerprints of calls that share a key.
    idempotency_validate: ClassVar[bool] = True
    #: What a duplicate does while another execution holds the key: wait, skip or raise.
    on_duplicate: ClassVar[str] = defaults.ON_DUPLICATE
    #: Write the task to the dead-letter table when it fails for good.
    dlq: ClassVar[bool] = True
    #: Dead-letter retries for this task (default: ``app.conf.idempotency_dlq_max_retries``).
    dlq_max_retries: ClassVar[int | None] = None

    acks_late = True
    reject_on_worker_lost = True
    #: A call whose pool process died under it (the OOM killer, a crash in C code) is retried
    #: as Celery 5.7 retries it, within ``max_retries``, then dead-lettered: handed back to the
    #: broker instead, a call that kills its process every time would run for ever.
    retry_on_worker_lost = True
    #: Ends a call killed at its hard time limit as a failure (see ``end_killed_call``).
    Request = "idempotent_tasks.worker_request:IdempotentRequest"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.on_duplicate not in ON_DUPLICATE_CHOICES:
            raise ValueError(
                f"on_duplicate must be one of {', '.join(ON_DUPLICATE_CHOICES)}, "
                f"not {cls.on_duplicate!r}"
            )
        name = cls.__dict__.get("name")
        if isinstance(name, str) and len(name) > publishing.MAX_TASK_NAME_CHARS:
            # Its calls could be neither claimed in an SQL store nor dead-lettered.
            raise ValueError(
                f"task name {name[:60]!r}... is {len(name)} characters long; an IdempotentTask's "
                f"may have at most {publishing.MAX_TASK_NAME_CHARS}"
            )
        request_class = cls.__dict__.get("Request")
        if request_class is not None and not _ends_killed_calls(request_class):
            warnings.warn(
                f"{cls.__name__}.Request does not subclass "
                "idempotent_tasks.worker_request.IdempotentRequest: a call killed at its hard "
                "time limit will not be dead-lettered, and its key stays claimed until its "
                "lease ends",
                stacklevel=2,
            )
        source = cls.__dict__.get("idempotency_key")
        if callable(source) and not isinstance(source, staticmethod):
            # A plain function as a class attribute would be bound to the task instance.
            cls.idempotency_key = staticmethod(source)

    # -- publishing -----------------------------------------------------------------------

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> AsyncResult:
        """Publish the task, unless its key is already completed or in progress.

        Takes Celery's options plus ``idempotency_key``. A completed key returns a result whose
        ``.get()`` is the cached value and whose ``.id`` is the original task id; a key in
        progress returns the owner's ``AsyncResult``. Nothing is published in either case,
        unless work waits on this message (link callbacks, a chain, a chord or a group): it is
        then published, and the worker answers it as a duplicate.

        Raises:
            ValueError: the key is not a non-empty ``str``, or the task requires one; the
                ``task_id`` given is not a non-empty ``str`` of at most 255 characters.
            IdempotencyKeyMismatch: the key was used with other arguments.
            TypeError: ``args`` is not a list or tuple, or ``kwargs`` not a mapping (as Celery).
        """
        republish_headers = options.pop(_REPUBLISH, None)
        call_key = given_key(options, refuse_none=republish_headers is None)
        options.pop(KEY_HEADER, None)
        if republish_headers is None:
            # Not our own re-publish (a retry, a wait) of a message that already runs here:
            # one sent by other means is not refused half-way through its life.
            check_task_id(task_id)
            check_following_keys(self.app, options, link, link_error)
        if args and not isinstance(args, list | tuple):
            raise TypeError("task args must be a list or tuple")  # as Celery's own message
        if kwargs and not isinstance(kwargs, Mapping):
            raise TypeError("task keyword arguments must be a mapping")
        args = tuple(args or ())
        kwargs = dict(kwargs or {})
        # A message sent without a key by other means (send_task) is not refused half-way
        # through its life either: its retry would be rejected back to the queue for ever.
        key = publishing.publish_key(
            self, call_key, args, kwargs, required=republish_headers is None
        )
        if key is not None or republish_headers:
            headers = dict(options.pop("headers", None) or {})
            headers.update(republish_headers or {})
            if key is not None:
                headers[KEY_HEADER] = key
            options["headers"] = headers
        if key is not None and republish_headers is None:
            task_id = task_id or uuid()
            # In the message, and in the envelope the guard would publish again.
            options["headers"][RESERVED_HEADER] = True
            shadow = shadow or self._shadow_of(args, kwargs, options)
            # A pydantic=True task's models (its key and shadow name read them above) go out
            # dumped, as Celery would dump them a moment later: the fingerprint and the guard's
            # copy must be of what the worker gets.
            args, kwargs = _dumped_models(self, args, kwargs, options)
            message_options = {**options, "link": link, "link_error": link_error, "shadow": shadow}
            request, pickup = publishing.prepare(self, key, args, kwargs, task_id, message_options)
            answer = None
            # Work waits on this message (a link, a canvas): it is published whatever the key.
            continues = publishing.continues(options, link, link_error)
            if pickup is not None and not continues:
                celery_apply_async = super().apply_async
                answer = reserve_and_push.publish(
                    self,
                    request,
                    pickup,
                    producer,
                    lambda ready: celery_apply_async(
                        args, kwargs, task_id, ready, link, link_error, shadow, **options
                    ),
                )
            if isinstance(answer, reserve_and_push.Published):
                return answer.result
            if answer is reserve_and_push.TAKE_OVER:
                reservation, short_circuit = None, None  # its record looked at already
            elif answer is not None:
                if publishing.reaches_this_caller(self, answer):
                    return answer
                reservation, short_circuit = None, answer
            else:
                reservation, short_circuit = publishing.reserve(
                    self, request, pickup, continues=continues
                )
            owed = short_circuit is not None and not publishing.reaches_this_caller(
                self, short_circuit
            )
            if reservation is None and not owed:
                # The key was not queued for it. (A call published as it cannot be handed
                # another's result keeps the header: the worker answers it, never drops it.)
                del options["headers"][RESERVED_HEADER]
            if short_circuit is not None and not owed and not continues:
                return short_circuit
            if reservation is not None:
                try:
                    return super().apply_async(
                        args, kwargs, task_id, producer, link, link_error, shadow, **options
                    )
                except OperationalError as error:
                    publishing.publish_failed(
                        self, reservation.storage_key, reservation.task_id, error
                    )
                    raise
                except Exception:
                    publishing.cancel_reservation(
                        self, reservation.storage_key, reservation.task_id
                    )
                    raise
                except BaseException:
                    # Interrupted (Ctrl-C, a green thread's timeout, an exit) somewhere in
                    # kombu's publish: sent or not, the guard publishes it (once more at most).
                    hand_to_guard(store_for(self.app), reservation.storage_key, reservation.task_id)
                    raise
        return super().apply_async(
            args, kwargs, task_id, producer, link, link_error, shadow, **options
        )

    def _shadow_of(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], options: dict[str, Any]
    ) -> str | None:
        """The name a task's own ``shadow_name`` gives a call, computed once for its message
        and the pickup guard's copy of it; ``None`` when the task names none, or its
        ``shadow_name`` fails (Celery then calls it itself, and raises as it would, after its
        own check of the arguments). A name that is empty Celery asks for again, as it asks
        when given none. Asked for a keyed call a record then answers too (nothing published):
        the envelope is made before the store is asked."""
        if self.__v2_compat__ or type(self).shadow_name is Task.shadow_name:
            return None
        try:
            return cast(str | None, self.shadow_name(args, kwargs, dict(options))) or None
        except Exception:
            return None

    def apply(
        self,
        args: Any = None,
        kwargs: Any = None,
        link: Any = None,
        link_error: Any = None,
        task_id: str | None = None,
        retries: int | None = None,
        throw: bool | None = None,
        logfile: Any = None,
        loglevel: Any = None,
        headers: dict[str, Any] | None = None,
        **options: Any,
    ) -> Any:
        """Celery's ``apply`` (run here and now), taking ``idempotency_key`` as
        :meth:`apply_async` does, or as the header of that name: the call is claimed under it
        (``ValueError`` for a bad key, ``None`` included)."""
        key = given_key({**options, "headers": headers})
        options.pop(KEY_HEADER, None)
        if key is not None:
            headers = {**(headers or {}), KEY_HEADER: validate_key(key)}
        return super().apply(
            args,
            kwargs,
            link,
            link_error,
            task_id,
            retries,
            throw,
            logfile,
            loglevel,
            headers,
            **options,
        )

    def signature_from_request(
        self,
        request: Any = None,
        args: Any = None,
        kwargs: Any = None,
        queue: Any = None,
        **extra_options: Any,
    ) -> Any:
        """Celery's re-publish signature (retries, replacements), carrying our headers along."""
        request = self.request if request is None else request
        key = request_header(request, KEY_HEADER)  # a running call's: _call_key took it
        if key is None:
            # A message without one, keyed by the task's template (sent by send_task, say):
            # the key its claim runs under, not one derived from the next message's arguments.
            attempt = _current_attempt(request)
            key = attempt.request.key if attempt is not None else None
        if key is not None:
            extra_options.setdefault(KEY_HEADER, key)
        carried = extra_options.setdefault(_REPUBLISH, {})
        for name, value in _carried_headers(request).items():
            carried.setdefault(name, value)
        if request is not self.request and getattr(request, ISSUED_BY, None) == os.getpid():
            # The worker's main process retrying a delivery whose pool process died (Celery
            # 5.7's retry_on_worker_lost): the retry may take the dead owner's claim over.
            dead_owner = issued_owner(request)
            if dead_owner is not None:
                carried.setdefault(PREVIOUS_OWNER_HEADER, dead_owner)
        signature = super().signature_from_request(request, args, kwargs, queue, **extra_options)
        # The owner this delivery was issued is its own: the next one is issued another.
        headers = signature.options.get("headers") or {}
        headers.pop(ISSUED_OWNER, None)
        headers.pop(ISSUED_BY, None)
        if request is self.request and getattr(request, "idempotency_retrying", None):
            self._release_for_retry(signature)  # Celery's retry() made this message
        return signature

    # -- running ----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Claim the key, then run the body once, or answer as a duplicate."""
        request = self.request
        if request.called_directly or getattr(request, "idempotency_entered", False):
            # Called as a function (from the task's own body, say): a plain call, as Celery's.
            return super().__call__(*args, **kwargs)
        started = time.monotonic()  # about when the pool began the call (its time limits)
        request.idempotency_entered = True
        if request_header(request, UNWRITTEN_SUCCESS_HEADER):
            self._dead_letter_succeeded()
            raise Ignore()
        unwritten = request_header(request, UNWRITTEN_FAILURE_HEADER)
        if unwritten is not None:
            self._write_failure(self._unwritten_failure(unwritten, args, kwargs))
        dead_letter_id = request_header(request, DEAD_LETTER_HEADER)
        if dead_letter_id is not None:
            sweep_id = request_header(request, DEAD_LETTER_SWEEP_HEADER)
            if not renew_retrying(self.app, dead_letter_id, sweep_id):
                self._end_stale_retry(dead_letter_id, sweep_id, args, kwargs)
        try:
            key = self._call_key(request, args, kwargs)
        except ValueError as exc:
            if dead_letter_id is not None:
                # Its row records it (a key template that no longer fits the stored
                # arguments): unrecorded, the row would be sent again for ever.
                self.on_final_failure(exc, None, args, kwargs)
            raise
        if key is None:
            return self._run_unclaimed(args, kwargs)
        try:
            # Sent by other means than apply_async, which refuses it: no store can claim it.
            check_task_id(request.id)
        except ValueError as refused:
            self.on_final_failure(refused, key, args, kwargs)
            raise

        attempt = self._attempt(key, args, kwargs, request)
        try:
            claim = attempt.claim()
            lost = claim.outcome is Outcome.ACQUIRED and not attempt.held_at_start()
        except StoreUnavailable as exc:
            logger.warning("store unavailable, will try again: %s", exc)
            self._republish_self(
                defaults.STORE_UNAVAILABLE_DELAY, exc, _taking_back_headers(attempt)
            )
        except SoftTimeLimitExceeded as exc:
            # Fired before the body began (a slow store, a process paused past it): the call
            # fails as it would have a moment later in its body. Fired during the claim's round
            # trip, the store may hold a claim whose token never came back.
            release = attempt.release_quietly if attempt.token else attempt.release_dead_owner
            despite_time_limit(SoftTimeLimitExceeded, release)
            self.on_final_failure(exc, key, args, kwargs)
            raise
        except CorruptRecord as exc:
            # Nothing can tell whether the key ran: the task waits in the dead-letter table
            # (its key to be looked at, or forgotten) rather than run or vanish.
            self.on_final_failure(exc, key, args, kwargs)
            raise

        if lost:
            logger.warning(
                "key %r was taken over while this process was paused, before its body ran: "
                "it waits for the new owner's value",
                key,
            )
            self._wait_for_new_owner(attempt, body_ran=False)
        if claim.outcome is Outcome.ACQUIRED:
            # Only a copy that found the key free or queued for itself ends so. One that took
            # a claim over (a dead owner's, perhaps its own earlier delivery's), or whose call
            # took another call's key over, runs: the release would drop a message kept with
            # the key for the guard, of a call owed the key's value.
            if (
                _copy_expired(request)
                and not claim.takeover
                and _taken_from(request, attempt) is None
            ):
                self._end_expired_copy(attempt)
            return self._run_claimed(attempt, args, kwargs, started)
        record = claim.record
        assert record is not None
        if claim.outcome is Outcome.MISMATCH:
            mismatch = IdempotencyKeyMismatch(
                key, self.name, record.fingerprint, attempt.request.fingerprint
            )
            if request_header(request, DEAD_LETTER_HEADER) is not None:
                # A dead letter's retry whose key stands for other arguments by now (its caller
                # called again, corrected): its row records the failure, or it stays retrying.
                self.on_final_failure(mismatch, key, args, kwargs)
            raise mismatch
        if not request_header(request, WAITS_HEADER):  # once per duplicate, not per look
            signals.duplicate_suppressed.send(
                task_name=self.name, where="worker", outcome=claim.outcome
            )
        if claim.outcome is Outcome.COMPLETED:
            value = attempt.cached_value(record)
            if is_replaced(value):
                value = self._replacement_value(record, attempt.request.lease_seconds)
            elif (taken_from := request_header(request, TAKEN_FROM_HEADER)) is not None:
                self._answer_taken_over_call(taken_from, value)  # it waited for the key's value
            self._dead_letter_succeeded()
            return value
        return self._on_in_progress(key, record)

    def _run_unclaimed(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call without a key: a plain Celery task, still dead-lettered when it fails."""
        try:
            with retrying_kept_alive(self.app, self.request):
                value = self.run(*args, **kwargs)
        except Retry:
            raise
        except (Ignore, Reject) as ended:
            if getattr(self.request, "idempotency_replaced", False):
                self._dead_letter_succeeded()  # its work is done, its replacement sent
            elif not self._requeued(ended):
                self._dead_letter_ended_by_body(ended)
            raise
        except Exception as exc:
            self.on_final_failure(exc, None, args, kwargs)
            raise
        self._dead_letter_succeeded()
        return value

    def _run_claimed(
        self, attempt: Attempt, args: tuple[Any, ...], kwargs: dict[str, Any], started: float
    ) -> Any:
        self.request.idempotency_attempt = attempt
        try:
            with attempt.heartbeat(), retrying_kept_alive(self.app, self.request):
                value = self.run(*args, **kwargs)
        except Retry:
            # retry() released the claim before publishing its retry; an eager call's retry
            # (run in place once this ends), or a Retry raised by hand, did not.
            if getattr(self.request, "idempotency_attempt", None) is attempt:
                attempt.release_quietly()
            raise
        except (Ignore, Reject) as ended:
            if getattr(self.request, "idempotency_replaced", False):
                # Its work is done and its replacement sent: the key stays done (stored before
                # the hard time limit, whose kill would dead-letter a call that did its work).
                finish_by = self._completion_deadline(attempt.request.lease_seconds, started)
                despite_time_limit(
                    SoftTimeLimitExceeded,
                    lambda: attempt.finish(REPLACED, finish_by - time.monotonic()),
                )
                self._dead_letter_succeeded()
            elif self._requeued(ended):
                pickup = self._requeued_pickup(attempt.request.key, args, kwargs)
                despite_time_limit(
                    SoftTimeLimitExceeded, lambda: self._release_for_next_message(attempt, pickup)
                )
            elif (
                replacement := getattr(self.request, "idempotency_replacement", None)
            ) is not None:
                despite_time_limit(
                    SoftTimeLimitExceeded, lambda: self._hand_key_to(replacement, attempt)
                )
            else:
                despite_time_limit(SoftTimeLimitExceeded, attempt.release_quietly)
                self._dead_letter_ended_by_body(ended)
            raise
        except Exception as exc:
            despite_time_limit(SoftTimeLimitExceeded, attempt.release_quietly)
            self.on_final_failure(exc, attempt.request.key, args, kwargs)
            raise
        except BaseException:
            # Worker shutdown, a terminating revoke (SIGTERM is SystemExit in the pool process),
            # a green pool's hard time limit: whether the message comes back is Celery's to say.
            attempt.release_quietly()
            raise
        if (
            self.request.is_eager
            and getattr(self.request, "idempotency_replacement", None) is not None
        ):
            # Its replacement ran here and now (Celery runs an eager one at once), taking this
            # claim over: the value is the replacement's, which it stored itself.
            self._dead_letter_succeeded()
            return value
        side_write = self._celery_result(value)
        # One deadline: storing it again after the soft time limit fired has no more time.
        finish_by = self._completion_deadline(attempt.request.lease_seconds, started)
        value = despite_time_limit(
            SoftTimeLimitExceeded,
            lambda: attempt.finish(value, finish_by - time.monotonic(), side_write),
        )
        if attempt.side_written:
            # The completion wrote and published Celery's result record: Celery need not.
            self.request.ignore_result = True
        elif attempt.side_write_refused:
            # Redis will not take it (a cluster proxy, an ACL): Celery writes, from now on.
            self.__dict__["_completion_writes_result"] = False
        # (This attempt's: a retry(throw=False) of its body has made it the running one no more.)
        taken_from = _taken_from(self.request, attempt)
        if taken_from is not None and not (attempt.superseded or is_replaced(value)):
            self._answer_taken_over_call(taken_from, value)
            if attempt.owed_task_id not in (None, taken_from):
                # A lost call whose message a dead owner owed: its callers too have the value,
                # should its message not go out again.
                self._answer_taken_over_call(attempt.owed_task_id, value)
            self._republish_taken_over_message(attempt)
        if (attempt.superseded or is_replaced(value)) and not self.request.is_eager:
            # Taken over while the body ran, and the new owner has not finished.
            self._wait_for_new_owner(attempt, body_ran=True)
        if is_replaced(value):
            # An eager call taken over by one that replaced itself: answered as an eager
            # duplicate of that key is, with the replacement's value if it is ready (None if
            # not); the marker is no value to hand its caller.
            value = self._eager_replacement_value(attempt.request)
        self._dead_letter_succeeded()
        return value

    def _end_expired_copy(self, attempt: Attempt) -> NoReturn:
        """A copy of this call's message (it waited, or its store was down) that would run a
        key it found free or queued for itself, past the call's expiry: it ends as Celery ends
        an expired call, unrun and REVOKED, its key free for the next call."""
        despite_time_limit(SoftTimeLimitExceeded, attempt.release_quietly)
        request = self.request
        logger.warning("%s[%s] expired before it could run: revoked", self.name, request.id)
        stores = not get_actual_ignore_result(self, request) or self.store_errors_even_if_ignored
        self.backend.mark_as_revoked(request.id, "expired", request=request, store_result=stores)
        raise Ignore()

    def _wait_for_new_owner(self, attempt: Attempt, *, body_ran: bool) -> NoReturn:
        """This call lost its ``attempt``'s claim to another execution (while its body ran,
        or before it started): wait for that one's value like a duplicate, so every caller of
        this task id gets the stored one; its copies are owed the value too, and so is the
        call whose key the attempt took over, if any.

        Once its body ran, the copies never expire: dropped as expired, they would leave the
        caller with REVOKED though the key completes. One whose body did not run keeps its
        expiry, as it could still take the key over and run it."""
        headers = {WAITS_HEADER: 0, SUPERSEDED_HEADER: True, **_taken_from_header(attempt)}
        self._republish_self(defaults.WAIT_INITIAL_DELAY, None, headers, never_expires=body_ran)

    def _answer_taken_over_call(self, task_id: str, value: Any) -> None:
        """Store ``value`` as the result of the call whose claim or queued message this one
        (or the call it retries, or waited for) took over: its owner died, or its message
        counted as lost, and that message may never come back (lost with its worker), while its
        callers wait on its task id. Should it come back, it finds the key completed and
        answers with this same value. A result it has already (it ended after all) stays."""
        backend = self.backend
        if (
            self.request.is_eager
            or self.ignore_result
            or isinstance(backend, DisabledBackend | RPCBackend)  # rpc:// answers one caller
            or task_id == self.request.id
        ):
            return
        try:
            if backend.get_state(task_id) in states.READY_STATES:
                return
            # That call's own record: not this one's children, nor its place in a workflow.
            own = Context({"id": task_id, "task": self.name, "children": []})
            despite_time_limit(
                SoftTimeLimitExceeded,
                lambda: backend.store_result(task_id, value, states.SUCCESS, request=own),
            )
        except Exception as exc:
            logger.warning(
                "could not store the result of %s, whose key this call took over: %s", task_id, exc
            )

    def _republish_taken_over_message(self, attempt: Attempt) -> None:
        """Publish again the queued message of the call whose key this one took over (it
        counted as lost), now that the key is completed: that call then answers with the key's
        value, as a slow copy of it would, and its callbacks, chord part and ``rpc://`` reply
        follow, which no stored result alone brings."""
        if not attempt.result_cached:
            # Not stored (the store down, a corrupt record), the copy would find the key
            # unfinished and run it again; not cached (too big, not serializable), it would
            # answer None. That call keeps the value stored as its result.
            return
        self._publish_owed_message(attempt)

    def _release_for_next_message(self, attempt: Attempt, pickup: Pickup | None) -> None:
        """Give the key up, queued for this call's next message (``pickup``: a retry, a
        requeue, a replacement), having first published the message of another call its claim
        owes: the release keeps the next message in that one's place. Published now, that
        message waits for the key's value, which this call's next message brings. (Without a
        pickup, the release hands the key back to that call, whose message the guard sends.)

        If the store cannot say whether it is still owed, or the broker cannot take it for now,
        the claim is left as it is, still owing it, its lease no longer renewed: a retry or a
        replacement (naming this attempt as its previous owner) takes it over at once, a
        message handed back once the lease ends; or the guard publishes the owed message a
        pickup timeout after that."""
        if attempt.given_up:
            return  # released already, or left owing (a retry whose publish failed, requeued)
        if pickup is None:
            attempt.release_quietly()
            return
        try:
            left_owing = not self._publish_owed_message(attempt, before_release=True)
        except (StoreUnavailable, CorruptRecord) as exc:
            logger.warning(
                "could not ask whether key %r still owes the message of %s (%s): its claim is "
                "left for the next message to take over",
                attempt.request.key,
                attempt.owed_task_id,
                exc,
            )
            left_owing = True
        if left_owing:
            attempt.given_up = True  # its lease ends: not taken over, only handed on
            return
        attempt.release_quietly(pickup)

    def _publish_owed_message(self, attempt: Attempt, *, before_release: bool = False) -> bool:
        """Publish the message ``attempt``'s claim owes, if the store says it still does
        (clearing the debt): once the key completed, or ``before_release`` of the held claim.
        ``False`` only when it was owed, ``before_release``, and the broker could not take it
        for now (it is then owed again: see :func:`~idempotent_tasks.pickups.republish_taken`).
        """
        envelope = attempt.taken_over_envelope
        task_id = attempt.owed_task_id
        if envelope is None or task_id is None or self.request.is_eager:
            return True
        lost = DuePickup(
            storage_key=attempt.request.storage_key,
            task_name=self.name,
            task_id=task_id,
            envelope=envelope,
            republished=1,
        )
        expired = call_expired(lost)  # a worker would drop it unrun (REVOKED)
        if expired and not before_release:
            return True  # its stored result stands
        settle = (
            attempt.settle_owed_message_before_release
            if before_release
            else attempt.settle_owed_message
        )
        if not settle():
            return True  # the guard published it meanwhile (this call was slow past its lease)
        if expired:
            # Settled all the same, or the store would refuse the release its pickup.
            attempt.owed_message_sent = True
            return True
        try:
            republish_taken(self.app, attempt.store, lost, raise_unreachable=before_release)
        except OperationalError:  # the broker cannot take it for now: owed again (logged)
            return False
        attempt.owed_message_sent = True  # or refused for good (logged)
        return True

    def _requeued(self, ended: Exception) -> bool:
        """Whether the body handed its message back to the broker: ``Reject(requeue=True)``,
        with the message not acknowledged yet (late acks), outside an eager call."""
        return (
            isinstance(ended, Reject)
            and bool(ended.requeue)
            and bool(self.acks_late)
            and not self.request.is_eager
        )

    def _requeued_pickup(self, key: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The guard's copy of this very message, handed back to the broker: the key stays
        queued for it, so it runs even if the broker loses it on the way back."""
        return self._message_pickup(key, args, kwargs, 0.0, retries=self.request.retries)

    def on_replace(self, sig: Any) -> Any:
        """Celery's replacement of this call by ``sig``, under its task id.

        A keyed call's key then counts as completed: its body does not run again, and its
        duplicates are answered with the replacement's result. A call replaced by its own task
        under its own task id (a polling loop) hands its key on instead: the replacement runs
        under the same key (unless given one of its own) and may take this claim over at once,
        so a duplicate waits for the loop's last value rather than begin the loop anew.
        """
        request = self.request
        attempt: Attempt | None = getattr(request, "idempotency_attempt", None)
        # A call in a chain is replaced by a chain of its replacement and the steps after it
        # (the replacement keeps this task id); in a chain the body made, the last step does.
        first = sig.tasks[0] if getattr(sig, "task", None) == CHAIN_TASK and sig.tasks else sig
        handed_on = False
        if (
            attempt is not None
            and getattr(first, "task", None) == self.name
            and first.options.get("task_id") == request.id
        ):
            key = attempt.request.key
            if KEY_HEADER not in first.options:
                first.set(**{KEY_HEADER: key})
            if first.options[KEY_HEADER] == key:
                headers = dict(first.options.get("headers") or {})
                headers[PREVIOUS_OWNER_HEADER] = attempt.request.owner
                # The same call goes on: the dead letter it retries, the call it took over.
                for name, value in _carried_headers(request, attempt).items():
                    headers.setdefault(name, value)
                first.set(headers=headers)
                request.idempotency_replacement = first
                handed_on = True
        # Not handed on: the key is done, and its duplicates get the replacement's result.
        request.idempotency_replaced = not handed_on
        return super().on_replace(sig)

    def _hand_key_to(self, replacement: Any, attempt: Attempt) -> None:
        """Release the key queued for ``replacement`` (this task, under this task id), which
        claims it as the same call, the guard keeping its message meanwhile. With the guard
        off, the claim stays instead, for the replacement to take over (it names this attempt
        as its previous owner): no duplicate can take the key between the two."""
        pickup = self._message_pickup(
            attempt.request.key,
            replacement.args,
            replacement.kwargs,
            seconds_until(replacement.options.get("countdown"), replacement.options.get("eta")),
            retries=0,
            routing=_routing_of(replacement),
            # Celery sends the replacement with its own expiry (its task's default), not this
            # call's: kept, it would make the key count as expired, free for a duplicate to
            # begin the loop anew.
            expires=_expiry_of(replacement),
        )
        if pickup is not None:
            self._release_for_next_message(attempt, pickup)

    def _eager_replacement_value(self, claim: ClaimRequest) -> Any:
        """The replacement's value of a key completed as replaced, for an eager call."""
        try:
            record = store_for(self.app).get(claim.storage_key)
        except (StoreUnavailable, CorruptRecord) as exc:
            logger.warning("the key %r cannot be read again: %s", claim.key, exc)
            return None
        if record is None:
            return None
        return self._replacement_value(record, claim.lease_seconds)

    def _replacement_value(self, record: Record, lease_seconds: float) -> Any:
        """A duplicate's answer for a key whose call replaced itself: the replacement's result
        from Celery's backend, waited for (re-published with a growing countdown) for at most
        the lease; ``None`` when the backend cannot tell (none, ``rpc://``, unreachable) or
        the result does not come (a replacement with ``ignore_result``)."""
        replacement = self.AsyncResult(record.task_id)
        try:
            ready = replacement.ready()
        except Exception as exc:  # no backend (it raises AttributeError), rpc://, unreachable
            logger.warning("the replacement's result of %s cannot be read: %s", record.task_id, exc)
            return None
        if ready:  # the replacement's value, or its error (as its own caller gets it)
            return replacement.get(disable_sync_subtasks=False, propagate=True)
        waits = int(request_header(self.request, WAITS_HEADER) or 0)
        since = float(request_header(self.request, WAIT_SINCE_HEADER) or time.time())
        if time.time() - since > lease_seconds or self.request.is_eager:
            logger.warning("no result from the replacement of %s; answering None", record.task_id)
            return None
        self._republish_self(
            wait_delay(waits), None, {WAITS_HEADER: waits + 1, WAIT_SINCE_HEADER: since}
        )

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: Any = None,
        throw: bool = True,
        eta: Any = None,
        countdown: Any = None,
        max_retries: Any = None,
        **options: Any,
    ) -> Any:
        """Celery's retry, releasing this attempt's claim before the retry is published.

        The retry message also names this attempt as its previous owner, so it can take the key
        over at once even if the release did not reach the store.
        """
        attempt: Attempt | None = getattr(self.request, "idempotency_attempt", None)
        dead_letter_id = request_header(self.request, DEAD_LETTER_HEADER)
        limit = self.max_retries if max_retries is None else max_retries
        will_publish = not self.request.is_eager and (limit is None or self.request.retries < limit)
        wait = 0.0
        if will_publish and (attempt is not None or dead_letter_id is not None):
            wait = seconds_until(
                self.default_retry_delay if countdown is None and eta is None else countdown, eta
            )
        if will_publish and dead_letter_id is not None:
            # A dead letter's run retrying: its row must not look stuck while the retry waits
            # out a countdown longer than its retrying timeout (a sweep would send it again).
            sweep_id = request_header(self.request, DEAD_LETTER_SWEEP_HEADER)
            renew_retrying(self.app, dead_letter_id, sweep_id, waits_for=wait)
        if attempt is not None:
            if will_publish:
                self.request.idempotency_attempt = None
                # Released with the guard's copy of the retry as Celery makes it (its merged
                # arguments, its queue): see signature_from_request.
                self.request.idempotency_retrying = (attempt, wait)
            # Else the attempt keeps its key: Celery raises (the retries are used up, or an
            # eager call retries in place, after _run_claimed released the key), and the body
            # may catch that and go on; the attempt ends as the body does.
            options[_REPUBLISH] = {PREVIOUS_OWNER_HEADER: attempt.request.owner}
        if "expires" in options:
            # Its own expiry, the broker's to keep: not the one a copy's message carries (also
            # for a retry after one that took the attempt along, sent with throw=False).
            options.setdefault(_REPUBLISH, {})[EXPIRES_HEADER] = None
        try:
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        except Reject as rejected:
            # Celery rejects without requeueing when it cannot publish the retry (broker down):
            # that would drop the task, so hand the message back to the broker instead.
            if rejected.requeue:
                raise
            if (
                attempt is not None
                and will_publish
                and getattr(self.request, "idempotency_retrying", None) is None
            ):
                # The key is queued for the retry's message, which did not go out (the message
                # handed back, an older one, is dropped when it comes): the guard sends it as
                # soon as it can, its countdown kept, not at its due time.
                hand_to_guard(store_for(self.app), attempt.request.storage_key, self.request.id)
            raise Reject(rejected.reason, requeue=True) from rejected
        finally:
            unreleased = getattr(self.request, "idempotency_retrying", None)
            if unreleased is not None:  # Celery made no retry message after all
                self.request.idempotency_retrying = None
                unreleased[0].release_quietly()

    def _release_for_retry(self, signature: Any) -> None:
        """Release a retrying attempt's claim, before its retry message (``signature``) is
        published, keeping that very message for the pickup guard."""
        attempt, wait = self.request.idempotency_retrying
        self.request.idempotency_retrying = None
        routing = _routing_of(signature)
        pickup = self._message_pickup(
            attempt.request.key,
            signature.args,
            signature.kwargs,
            wait,
            retries=self.request.retries + 1,
            previous_owner=attempt.request.owner,
            routing=routing,
            attempt=attempt,
            expires=_retry_expiry(signature, self.request),
        )
        self._release_for_next_message(attempt, pickup)

    def _message_pickup(
        self,
        key: str,
        args: Any,
        kwargs: Any,
        wait: float,
        *,
        retries: int,
        previous_owner: str | None = None,
        routing: dict[str, Any] | None = None,
        attempt: Attempt | None = None,
        expires: Any = _THIS_CALLS,
    ) -> Any:
        """This call's next message (a retry, a requeue) as the pickup guard keeps it, so it
        runs even if that message is lost; ``routing``: where it goes, if not back where this
        one came from; ``attempt``: the one it follows, if not the running one; ``expires``:
        when it expires, if not when this call does."""
        request = self.request
        # The key is queued for this copy, as for a published call's message.
        headers = {KEY_HEADER: key, RESERVED_HEADER: True, **_carried_headers(request, attempt)}
        if previous_owner is not None:
            headers[PREVIOUS_OWNER_HEADER] = previous_owner
        time_limit, soft_time_limit = request.timelimit or (None, None)
        options = {
            # How Celery's retry encodes the message (its apply_async adds these), then the
            # stamps (before ours: a stamp takes no option of ours over).
            **publishing.own_publish_options(self, "serializer", "compression"),
            **stamp_options(request),
            **routing_options(request.delivery_info),
            **(routing or {}),
            "headers": headers,
            "retries": retries,
            "link": request.callbacks,
            "link_error": request.errbacks,
            "chain": request.chain,
            "chord": request.chord,
            "group_id": request.group,
            "group_index": request.group_index,
            "root_id": request.root_id,
            "parent_id": request.parent_id,
            "shadow": request.shadow,
            "ignore_result": get_actual_ignore_result(self, request) or None,
            "reply_to": request.reply_to,
            "expires": _call_expiry(request) if expires is _THIS_CALLS else expires,
            "time_limit": time_limit,
            "soft_time_limit": soft_time_limit,
        }
        return make_pickup(
            request.args if args is None else args,
            request.kwargs if kwargs is None else kwargs,
            options,
            self._pickup_timeout,
            wait,
            self.serializer,
        )

    def on_final_failure(
        self, exc: Exception, key: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Called once the body failed for good (and its claim, if any, was released).

        Writes the task to the dead-letter table unless the task sets ``dlq=False``. If the
        write fails, the task is re-published to write it later (raising ``Retry``), so it is
        never lost. Override to add to this; call ``super()``.
        """
        # The body's soft time limit may fire in any step after it (a slow dump of large
        # arguments): the row is made to its end all the same, as it is written.
        failure = despite_time_limit(
            SoftTimeLimitExceeded, lambda: self._dead_letter_of(exc, key, args, kwargs)
        )
        if failure is not None:
            self._write_failure(failure)

    def _dead_letter_of(
        self, exc: Exception, key: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Failure | None:
        """The dead letter of a call failed for good with ``exc`` (logged); ``None`` when the
        task keeps none."""
        request = self.request
        message = error_text(exc)
        logger.error("failed for good: %s: %s", type(exc).__name__, message)
        if not self.dlq and request_header(request, DEAD_LETTER_HEADER) is None:
            # (A dead letter's retry records its failure on its row all the same, the task's
            # dead-letter queue turned off since: unrecorded, the row would be sent for ever.)
            return None
        stored_args, stored_kwargs, faithful = self._table_arguments(args, kwargs)
        max_retries = dead_letter_retries(self.dlq_max_retries, self.app.conf)
        if not faithful:
            logger.error(
                "its arguments are not JSON: the dead letter keeps them as text, not retried"
            )
        # A keyed call's id longer than a store keeps could never claim its key: its retry
        # runs under a shorter one naming it. A keyless call's retry keeps its id (its callers
        # wait on it): the table keeps it whole in the row's options.
        task_id = request.id if key is None else publishing.fitted_task_id(request.id)
        return Failure(
            failure_id=failure_id_of(task_id, request.retries),
            task_name=self.name,
            task_id=task_id,
            idempotency_key=key,
            args=stored_args,
            kwargs=stored_kwargs,
            options=failure_options(request, faithful),
            error_type=type(exc).__name__,
            error_message=message[:MAX_ERROR_MESSAGE_CHARS],
            # exc's own traceback: one killed in another process has none, and names itself.
            traceback="".join(format_exception(exc))[-MAX_TRACEBACK_CHARS:],
            # Arguments kept as text would run the task with the wrong values: kept, not retried.
            max_retries=max_retries if faithful else 0,
        )

    def end_killed_call(self, request_dict: dict[str, Any], exc: Exception) -> None:
        """End a call whose pool process was killed at its hard time limit, as a failure of
        its body ends: dead-lettered (``on_final_failure``), then its key released.

        Runs in the worker's main process, just before Celery fails the call (its errbacks
        run) and acknowledges its message. Should the dead letter be neither written nor
        re-published to be written later, the key stays claimed: its pickup guard runs the call
        again once the lease ends, rather than let it be lost. When Celery hands the message
        back to the broker instead (``acks_on_timeout`` off), the call has not failed for good:
        it is not dead-lettered, and its key is released for the requeued message.
        """
        self._end_dead_call(request_dict, exc, _timeout_requeues(self), "its time limit")

    def lost_call_fails(self, request_dict: dict[str, Any]) -> bool:
        """Whether Celery fails for good a call whose pool process died under it
        (``WorkerLostError``), rather than retry it (``retry_on_worker_lost``, within
        ``max_retries``) or hand it back to the broker (``reject_on_worker_lost``)."""
        retries = int(request_dict.get("retries") or 0)
        retrying = bool(self.retry_on_worker_lost)
        exhausted = retrying and self.max_retries is not None and retries >= self.max_retries
        if retrying and not exhausted:
            return False
        return not (self.acks_late and self.reject_on_worker_lost and not exhausted)

    def end_lost_call(self, request_dict: dict[str, Any], exc: Exception) -> None:
        """End a call whose pool process died under it, failed for good (see
        :meth:`lost_call_fails`): dead-lettered and its key released, as
        :meth:`end_killed_call`. Runs in the worker's main process."""
        self._end_dead_call(request_dict, exc, False, "the death of its pool process")

    def _end_dead_call(
        self, request_dict: dict[str, Any], exc: Exception, requeued: bool, cause: str
    ) -> None:
        """End a call whose pool process is gone (killed by ``cause``): dead-lettered unless
        ``requeued``, then its key released (queued for the message, when ``requeued``)."""
        self.push_request(request_dict, called_directly=False)
        try:
            request = self.request
            # An attribute, not a push_request keyword: those become headers that a
            # re-publish (of the unwritten dead letter) would carry into the next run.
            request.idempotency_entered = True
            # Celery fails the call itself (its result, errbacks, chord part), as this returns.
            setattr(request, FAILURE_REPORTED_HEADER, True)
            args, kwargs = tuple(request.args or ()), dict(request.kwargs or {})
            key = self._delivered_key(request, args, kwargs)
            if key is not None and self._completed_by_delivery(key, request):
                # Killed after its body succeeded and its value was stored (publishing its
                # callbacks, say): a dead letter's retry would send those again.
                logger.warning(
                    "key %r was completed before %s ended its process: not dead-lettered",
                    key,
                    cause,
                )
                # A dead letter's retry that did succeed: its row says so (left retrying, it
                # would be sent again at its timeout).
                self._dead_letter_succeeded()
                return
            if not requeued:
                try:
                    self.on_final_failure(exc, key, args, kwargs)
                except (Retry, Ignore):
                    pass  # the dead letter could not be written: the re-published message will
                except Exception:
                    logger.exception("could not dead-letter the call ended by %s", cause)
                    return
            if key is not None and issued_owner(request) is not None:
                # The killed process took its token with it: release under the owner id this
                # worker issued to the delivery (not delivered by IdempotentRequest: the lease
                # frees the key).
                pickup = self._requeued_pickup(key, args, kwargs) if requeued else None
                self._attempt(key, args, kwargs, request).release_dead_owner(pickup)
        finally:
            self.pop_request()

    def release_terminated_call(self, request_dict: dict[str, Any], requeued: bool = False) -> None:
        """Release the claim of a delivery terminated while it ran (``revoke(...,
        terminate=True)``, or cancelled: ``requeued``, its message coming back) once its pool
        process is gone, under the owner id this worker issued to it (never a claim a later
        delivery took over). Its body's own code releases it when the process ends through it
        (SIGTERM); one killed outright (SIGKILL) cannot. A requeued call's key stays queued
        for the guard, should its message be lost on the way back; unless its claim owes
        another call's message the key keeps (this process cannot publish it, knowing not its
        envelope): the store then refuses, and the claim stays until its lease ends, for the
        message coming back to take over, owing it in turn. Called by
        :class:`~idempotent_tasks.worker_request.IdempotentRequest` in the worker's main
        process."""
        self.push_request(request_dict, called_directly=False)
        try:
            request = self.request
            args, kwargs = tuple(request.args or ()), dict(request.kwargs or {})
            key = self._delivered_key(request, args, kwargs)
            if key is not None and issued_owner(request) is not None:
                pickup = self._requeued_pickup(key, args, kwargs) if requeued else None
                self._attempt(key, args, kwargs, request).release_dead_owner(pickup)
        finally:
            self.pop_request()

    def withdraw_revoked_failure(self, request_dict: dict[str, Any]) -> None:
        """Delete the dead letter a call revoked with ``terminate=True, signal="SIGUSR1"``
        wrote as it ended: billiard raises ``SoftTimeLimitExceeded`` in its body, which then
        fails as at its soft time limit. It was revoked, not failed: no sweep may send it again
        (a worker that never heard of the revoke would run it). Called by
        :class:`~idempotent_tasks.worker_request.IdempotentRequest` in the worker's main
        process, once the body ended."""
        self.push_request(request_dict, called_directly=False)
        try:
            request = self.request
            if not self.dlq or request_header(request, DEAD_LETTER_HEADER) is not None:
                return  # no row; or a dead letter's retry, which recorded a failed retry
            queue = dlq_for(self.app)
            # (A keyed call's row names it by the task id its retry can claim under.)
            ids = {request.id, publishing.fitted_task_id(request.id)}
            withdrawn = [queue.withdraw(failure_id_of(task_id, request.retries)) for task_id in ids]
            if any(withdrawn):
                logger.info(
                    "%s[%s] was revoked as it ran: its dead letter withdrawn", self.name, request.id
                )
        finally:
            self.pop_request()

    def _completed_by_delivery(self, key: str, request: Any) -> bool:
        """Whether the delivery ``request`` (its owner id issued by this worker) completed
        ``key`` itself; ``False`` when the store cannot say."""
        owner = issued_owner(request)
        if owner is None:
            return False
        try:
            record = store_for(self.app).get(storage_key(self.name, key))
        except (StoreUnavailable, CorruptRecord):
            return False
        return record is not None and record.status is Status.COMPLETED and record.owner == owner

    def _call_key(self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The key a delivered call runs under: its message's, else the task's own.

        Raises:
            ValueError: the message's key is not one ``apply_async`` would take (a message
                sent by other means, with a key of another type, say), or the task requires
                a key and a first delivery came without one (sent by name, by beat, by a
                client in another language): the call fails at once, as a mismatch does,
                running nothing. A retry or a dead letter's retry without one runs as before.
        """
        key = request_header(request, KEY_HEADER)
        if key is not None:
            return validate_key(key)
        if self.idempotency_key is not None:
            return derive_key(self.idempotency_key, self._signature, args, kwargs)
        if self.idempotency_key_required and _first_delivery(request):
            raise required_key_error(self.name)
        return None

    def _delivered_key(
        self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> str | None:
        """The key a delivered call ran under, for its bookkeeping once it ended out of its
        own sight (killed, revoked); ``None`` also for a key no call runs under (refused)."""
        try:
            return self._call_key(request, args, kwargs)
        except ValueError:
            return None

    def _write_failure(self, failure: Failure) -> None:
        """Write a final failure; if the database is down, re-publish to write it later."""
        dead_letter_id = request_header(self.request, DEAD_LETTER_HEADER)
        sweep_id = request_header(self.request, DEAD_LETTER_SWEEP_HEADER)
        try:
            despite_time_limit(
                SoftTimeLimitExceeded,
                lambda: write_failure(
                    self.app, failure, dead_letter_id, sweep_id, only_on_row=not self.dlq
                ),
            )
        except (StoreUnavailable, SchemaVersionError) as exc:
            if self.request.is_eager:
                # Nothing to send a copy to: the eager caller gets the task's own error.
                logger.error("could not write its dead letter: %s", exc)
                return
            delay = float(app_setting(self.app.conf, "idempotency_dlq_write_retry_delay"))
            logger.error(
                "could not write its dead letter (%s); will write it in %ss",
                exc,
                delay,
            )
            headers: dict[str, Any] = {UNWRITTEN_FAILURE_HEADER: _failure_header(failure)}
            if request_header(self.request, FAILURE_REPORTED_HEADER):
                # Celery stores the call's failure itself: the message that writes its dead
                # letter (later) must store no state over it (STARTED, RETRY).
                headers[FAILURE_REPORTED_HEADER] = True
                self._republish_self(delay, exc, headers, quiet=True)
            else:
                self._republish_self(delay, exc, headers)
        if request_header(self.request, UNWRITTEN_FAILURE_HEADER) is not None:
            if request_header(self.request, FAILURE_REPORTED_HEADER):
                raise Ignore()  # its failure ran its errbacks already: not twice
            raise DeadLettered(failure.error_type, failure.error_message, failure.task_id)

    def _table_arguments(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[list[Any], dict[str, Any], bool]:
        """A call's arguments as its dead letter keeps them, and whether they are exact."""
        # A JSON message carries tuples as lists, as the table keeps them; pickle, say, does not.
        return stored_arguments(args, kwargs, exact=self.serializer != "json")

    def _unwritten_failure(
        self, header: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Failure:
        """The failure a message carries to write (see :func:`_failure_header`), its
        arguments read back from the message's own, as ``on_final_failure`` stored them."""
        if "args" not in header:
            stored_args, stored_kwargs, faithful = self._table_arguments(args, kwargs)
            header = {**header, "args": stored_args, "kwargs": stored_kwargs}
            if "options" not in header:  # too large to carry: this copy's own are the call's
                header["options"] = failure_options(self.request, faithful)
        return Failure(**header)

    def _end_stale_retry(
        self,
        dead_letter_id: str,
        sweep_id: str | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """A dead letter's retry whose row is not ``retrying`` for the sweep that sent it:
        end it without running its body where its row says how, else return (it runs).

        Sent again since (this message slower than the retrying timeout), or waiting for its
        next retry: the other copy's run is the one counted, and answers. Given up on: it ends
        as its last retry did. Succeeded: a call with a key answers from it (a redelivery of
        the run that succeeded, whose callbacks may not have gone out); one without a key runs
        again only as that very message's redelivery. No row here (purged, another host's own
        table) or none readable: it runs, as a retry always did.
        """
        row = readable_row(self.app, dead_letter_id)
        if row is None:
            return
        request = self.request
        if row.status in (DeadLetterStatus.RETRYING, DeadLetterStatus.PENDING):
            logger.warning(
                "%s[%s]: dead letter %s is %s for another message: this one is not run",
                self.name,
                request.id,
                row.id,
                row.status.value,
            )
            raise Ignore()
        if row.status is DeadLetterStatus.PERMANENT_FAILURE:
            raise DeadLettered(row.error_type, row.error_message, row.task_id)
        if self._delivered_key(request, args, kwargs) is None and row.sweep_id != sweep_id:
            raise Ignore()

    def _dead_letter_ended_by_body(self, ended: Exception) -> None:
        """A dead letter's retry whose body ended it with ``Ignore`` or ``Reject`` (not handed
        back to the broker): a failed retry on its row, which would otherwise stay ``retrying``
        and be sent again after its timeout, for ever and uncounted."""
        dead_letter_id = request_header(self.request, DEAD_LETTER_HEADER)
        if dead_letter_id is not None:
            sweep_id = request_header(self.request, DEAD_LETTER_SWEEP_HEADER)
            how = f"ended without a value ({ended!r})"
            despite_time_limit(
                SoftTimeLimitExceeded,
                lambda: record_unrun_retry(
                    self.app, dead_letter_id, sweep_id, type(ended).__name__, how
                ),
            )

    def _dead_letter_succeeded(self) -> None:
        dead_letter_id = request_header(self.request, DEAD_LETTER_HEADER)
        if dead_letter_id is None or despite_time_limit(
            SoftTimeLimitExceeded,
            lambda: mark_succeeded(
                self.app, dead_letter_id, request_header(self.request, DEAD_LETTER_SWEEP_HEADER)
            ),
        ):
            return
        if self.request.is_eager:
            return  # nothing to send a copy to: the row's retrying timeout brings it back
        # Left `retrying`, the row would come back after its timeout and run a call without a
        # key again: a quiet copy of the message marks it later, running no body.
        delay = float(app_setting(self.app.conf, "idempotency_dlq_write_retry_delay"))
        try:
            self._quiet_copy(delay, {UNWRITTEN_SUCCESS_HEADER: True}).apply_async()
        except Exception as exc:
            logger.error("dead letter %s stays retrying: %s", dead_letter_id, exc)

    def _on_in_progress(self, key: str, record: Record) -> NoReturn:
        if record.status is Status.QUEUED and record.task_id == self.request.id:
            self._drop_older_copy(key)
        owed = self._owed_a_value()
        mode = "wait" if owed or record.task_id == self.request.id else self.on_duplicate
        if mode == "skip" and self._awaited_by_a_canvas():
            # A dropped step would leave its chain, callbacks, group or chord waiting for
            # ever: it waits for the owner's value instead.
            mode = "wait"
        if mode == "skip":
            logger.info("key %r is in progress elsewhere, skipped", key)
            raise Ignore()
        if mode == "raise" or self.request.is_eager:
            raise IdempotencyConflict(key, self.name, record.task_id)
        waits = int(request_header(self.request, WAITS_HEADER) or 0)
        headers: dict[str, Any] = {WAITS_HEADER: waits + 1}
        if owed:
            headers[SUPERSEDED_HEADER] = True  # its copies are owed it too
        self._republish_self(wait_for_owner(record, waits), None, headers)

    def _drop_older_copy(self, key: str) -> NoReturn:
        """An older message of this call (redelivered, or the guard's copy of a slow one) came
        while the key is queued for a retry of the call (see
        :func:`~idempotent_tasks.records.retry_marker`): the retry's message runs the call, its
        retries counted, and the guard keeps it should it be lost. This copy would run it early,
        its retries counted anew: it is dropped."""
        logger.warning(
            "%s[%s] (key %r): an older copy of the call's message, dropped: its retry runs it",
            self.name,
            self.request.id,
            key,
        )
        raise Ignore()

    def _owed_a_value(self) -> bool:
        """Whether this call is no duplicate to drop or fail, whatever ``on_duplicate`` says,
        though another call holds its key: dropped or failed, its callers would never get the
        value (or a task id whose body succeeded would fail), so it waits for it.

        Such are an owner taken over while its body ran (and the copies it waits with), the
        retry of a call whose key another call took meanwhile, the message its key was queued
        for at publish (a duplicate sent to a worker may take its key over as lost while it is
        on its way), a message the broker delivers again (its owner may have died, and a
        duplicate taken its key over since), and a dead letter's retry (its row waits for its
        outcome: dropped, it would stay ``retrying`` until its timeout).
        """
        request = self.request
        return (
            bool(request_header(request, SUPERSEDED_HEADER))
            or request_header(request, PREVIOUS_OWNER_HEADER) is not None
            or bool(request_header(request, RESERVED_HEADER))
            or bool((request.delivery_info or {}).get("redelivered"))
            or request_header(request, DEAD_LETTER_HEADER) is not None
        )

    def _awaited_by_a_canvas(self) -> bool:
        """Whether work waits on this very call: callbacks, a chain's next steps (the last
        step's id is the chain's result), a group or a chord collecting its result, or the
        callers of a task that replaced itself with it."""
        request = self.request
        return bool(
            request.group
            or request.chord
            or request.chain is not None
            or request.callbacks
            or request.errbacks
            or getattr(request, "replaced_task_nesting", 0)
        )

    def _republish_self(
        self,
        countdown: float,
        exc: Exception | None,
        headers: dict[str, Any] | None = None,
        *,
        quiet: bool = False,
        never_expires: bool = False,
    ) -> NoReturn:
        """Publish this very message again after ``countdown`` s, not counting it as a retry.

        Ends this run with ``Retry``; ``quiet``, for a call whose failure Celery has stored
        already, with ``Ignore``, and the message published with ``ignore_result``: neither
        run stores any state over that failure (RETRY, STARTED).
        """
        if self.request.is_eager:
            # Task.apply would run a Retry's copy again at once, in this very call, and send
            # one copy to the broker per round: an eager call ends with the error instead.
            raise (
                exc
                if exc is not None
                else IdempotencyError(
                    f"{self.name} cannot wait for another execution when called eagerly"
                )
            )
        if quiet:
            signature = self._quiet_copy(countdown, headers or {})
        else:
            signature = self._copy(countdown, headers or {}, never_expires=never_expires)
        try:
            signature.apply_async()
        except Exception as publish_error:
            # The broker is unreachable too: hand the message back rather than lose it.
            raise Reject(publish_error, requeue=True) from publish_error
        if quiet:
            raise Ignore()
        raise Retry(exc=exc, when=countdown, sig=signature)

    def _copy(
        self, countdown: float, headers: dict[str, Any], *, never_expires: bool = False
    ) -> Any:
        """This very message, to publish again after ``countdown`` s with ``headers`` added;
        ``never_expires``: without the call's expiry.

        No copy expires at the broker: one that only writes down how the call ended (its dead
        letter, or its dead letter's success) must run whenever it arrives, and the others
        carry the call's expiry in a header instead, so that past it they are still answered
        with the key's value (a duplicate's caller waits for it), and end expired, unrun, only
        where they would run a key they found free or queued for themselves.
        """
        # Never dropped unread by the worker: a copy may be owed the key's value past the
        # call's expiry, which it carries instead (see _end_expired_copy).
        options: dict[str, Any] = {"expires": None}
        if (
            never_expires
            or UNWRITTEN_FAILURE_HEADER in headers
            or UNWRITTEN_SUCCESS_HEADER in headers
        ):
            # Over the one this message may carry, which Celery copies along with its headers.
            headers = {**headers, EXPIRES_HEADER: None}
        elif (expiry := _call_expiry(self.request)) is not None:
            headers = {**headers, EXPIRES_HEADER: expiry}
        return self.signature_from_request(
            self.request,
            countdown=countdown,
            retries=self.request.retries,
            **options,
            **{_REPUBLISH: headers},
        )

    def _quiet_copy(self, countdown: float, headers: dict[str, Any]) -> Any:
        """... storing no result or state over this call's own."""
        signature = self._copy(countdown, headers)
        signature.set(ignore_result=True)
        return signature

    def _attempt(
        self, key: str, args: tuple[Any, ...], kwargs: dict[str, Any], request: Any
    ) -> Attempt:
        claim = self._claim_request(
            key,
            args,
            kwargs,
            request.id,
            owner=issued_owner(request) or new_owner(),
            previous_owner=request_header(request, PREVIOUS_OWNER_HEADER),
            retries=_claimed_as_retry(request),
        )
        return Attempt(store=store_for(self.app), request=claim, codec=self._codec, log=logger)

    def _claim_request(
        self,
        key: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        task_id: str,
        *,
        owner: str,
        previous_owner: str | None = None,
        retries: int = 0,
    ) -> ClaimRequest:
        lease_seconds, ttl_seconds = self._lease_and_ttl
        _ = self._codec  # its settings checked too, before anything is published
        return ClaimRequest(
            storage_key=storage_key(self.name, key),
            key=key,
            task_name=self.name,
            task_id=task_id,
            owner=owner,
            fingerprint=fingerprint(self.name, self._signature, args, kwargs),
            lease_seconds=lease_seconds,
            ttl_seconds=ttl_seconds,
            validate=bool(self.idempotency_validate),
            previous_owner=previous_owner,
            claim_ttl_seconds=self._claim_ttl,
            retries=retries,
        )

    def _celery_result(self, value: Any) -> SideWrite | None:
        """Celery's result record for the completion to write, when it can (see
        :mod:`idempotent_tasks.celery_result`)."""
        if not self._completion_writes_result or get_actual_ignore_result(self, self.request):
            return None
        return result_side_write(self.backend, self.request, value, self._codec.max_bytes)

    def _completion_deadline(self, lease: float, started: float) -> float:
        """Until when (monotonic) storing the result of the call that ``started`` then may wait
        for an unreachable store: a lease from now, and at least
        :data:`~idempotent_tasks.defaults.MIN_COMPLETION_PATIENCE`, but never up to the call's
        hard time limit, whose kill would fail a body that succeeded."""
        deadline = time.monotonic() + max(lease, defaults.MIN_COMPLETION_PATIENCE)
        hard_limit = (self.request.timelimit or (None, None))[0] or self._hard_time_limit
        if hard_limit:
            deadline = min(deadline, started + float(hard_limit) - HARD_LIMIT_MARGIN)
        return deadline

    # -- per-task constants: settings are read once per task, when first needed, as Celery
    # reads its own task options (a lookup in app.conf costs more than a Redis round trip) --

    @cached_property
    def _lease_and_ttl(self) -> tuple[float, float]:
        conf = self.app.conf
        lease = resolve(
            self.idempotency_lease,
            conf.get("idempotency_lease"),
            self.time_limit,
            default=defaults.LEASE,
        )
        ttl = resolve(self.idempotency_ttl, default=app_setting(conf, "idempotency_ttl"))
        lease_seconds = positive_seconds(lease, "idempotency_lease")
        ttl_seconds = positive_seconds(ttl, "idempotency_ttl")
        return lease_seconds, ttl_seconds

    @cached_property
    def _claim_ttl(self) -> float | None:
        return claim_ttl(self.app.conf, self._lease_and_ttl[1])

    @cached_property
    def _hard_time_limit(self) -> float | None:
        """The task's hard time limit when its message names none (else the worker's)."""
        limit = (
            self.time_limit
            or getattr(self.app, WORKER_TIME_LIMIT, None)
            or self.app.conf.task_time_limit
        )
        return float(limit) if limit else None

    @cached_property
    def _completion_writes_result(self) -> bool:
        return backend_shares_store(self.backend, store_for(self.app))

    @cached_property
    def _pickup_timeout(self) -> float:
        return pickup_timeout(self.app.conf)

    @cached_property
    def _signature(self) -> inspect.Signature | None:
        try:
            return inspect.signature(self.run)
        except (TypeError, ValueError):
            return None

    @cached_property
    def _codec(self) -> ResultCodec:
        conf = self.app.conf
        allow_pickle = switch(
            app_setting(conf, "idempotency_allow_pickle"), "idempotency_allow_pickle"
        )
        serializer = resolve(
            app_setting(conf, "idempotency_result_serializer"),
            self.serializer,
            default=defaults.RESULT_SERIALIZER,
        )
        if serializer in UNSAFE_SERIALIZERS and not allow_pickle:
            module_logger.warning(
                "%s uses %s; its cached results use %s instead (set "
                "idempotency_allow_pickle=True to cache with pickle)",
                self.name,
                serializer,
                defaults.RESULT_SERIALIZER,
            )
            serializer = defaults.RESULT_SERIALIZER
        elif not serializer_installed(serializer):
            module_logger.warning(
                "%s: serializer %r is not installed here; its cached results use %s instead",
                self.name,
                serializer,
                defaults.RESULT_SERIALIZER,
            )
            serializer = defaults.RESULT_SERIALIZER
        return ResultCodec(
            serializer=serializer,
            max_bytes=byte_count(
                app_setting(conf, "idempotency_result_max_bytes"), "idempotency_result_max_bytes"
            ),
            allow_unsafe=allow_pickle,
        )


def _failure_header(failure: Failure) -> dict[str, Any]:
    """A failure as the message that writes it later carries it in a header: without its
    arguments (the message's own), nor its options when they are large (a long chain: the
    message's own too), its error message and traceback cut to fit a broker's frame (the
    traceback's end kept: where it failed)."""
    kept = dataclasses.asdict(failure)
    del kept["args"], kept["kwargs"]
    if len(json.dumps(kept["options"], default=str)) > HEADER_OPTIONS_CHARS:
        del kept["options"]
    kept["error_message"] = failure.error_message[:HEADER_ERROR_MESSAGE_CHARS]
    if failure.traceback is not None:
        kept["traceback"] = failure.traceback[-HEADER_TRACEBACK_CHARS:]
    return kept


def _ends_killed_calls(request_class: Any) -> bool:
    """Whether a task's ``Request`` (a class or its ``"module:Class"`` name) is ours; ``True``
    when it cannot be told yet (its module still being imported, say)."""
    try:
        resolved = symbol_by_name(request_class)  # type: ignore[no-untyped-call]
    except Exception:
        return True
    return isinstance(resolved, type) and issubclass(resolved, IdempotentRequest)


def _timeout_requeues(task: Task) -> bool:
    """Whether Celery hands a message killed at its hard time limit back to the broker: an
    ``acks_late`` task with ``acks_on_timeout`` off (its default is the deprecated
    ``acks_on_failure_or_timeout``)."""
    if not task.acks_late:
        return False
    acks = task.acks_on_timeout
    if acks is None:
        acks = task.acks_on_failure_or_timeout
    return acks is not None and not acks


def _routing_of(signature: Any) -> dict[str, Any]:
    """Where a signature sends its message, when it says (else: where this delivery came from)."""
    routing = {
        name: signature.options[name]
        for name in ("queue", "routing_key", "exchange", "priority")
        if signature.options.get(name) is not None
    }
    if "queue" in routing:
        # A queue of its own: not this delivery's exchange and routing key, which Celery would
        # prefer over it.
        routing.setdefault("exchange", None)
        routing.setdefault("routing_key", None)
    return routing


def _first_delivery(request: Any) -> bool:
    """Whether a delivered call is its caller's first message: not a retry of it, nor a dead
    letter's retry, nor a re-publish to write its dead letter."""
    return not request.retries and all(
        request_header(request, header) is None
        for header in (DEAD_LETTER_HEADER, UNWRITTEN_FAILURE_HEADER)
    )


def _current_attempt(request: Any) -> Attempt | None:
    """The attempt whose claim ``request`` runs under, or the one its retry() is giving up."""
    attempt = getattr(request, "idempotency_attempt", None)
    if attempt is None:
        retrying = getattr(request, "idempotency_retrying", None)
        attempt = retrying[0] if retrying else None
    return attempt if isinstance(attempt, Attempt) else None


def _taken_from(request: Any, attempt: Attempt | None = None) -> str | None:
    """The task id of another call whose key this call (its ``attempt``: by default the
    running one, or the one retrying) took over, or the call it retries or waits for took over
    (see ``TAKEN_FROM_HEADER``)."""
    if attempt is None:
        attempt = _current_attempt(request)
    if attempt is not None and attempt.taken_from_task_id is not None:
        return attempt.taken_from_task_id
    taken_from = request_header(request, TAKEN_FROM_HEADER)
    return taken_from if isinstance(taken_from, str) else None


def _retry_expiry(signature: Any, request: Any) -> Any:
    """When the retry ``signature`` of the call ``request`` runs for expires: the ``expires``
    it was given (``retry(expires=...)``, ``None`` included), else the call's, which a copy's
    message carries in a header rather than in its own ``expires``."""
    expires = signature.options.get("expires")
    given = EXPIRES_HEADER in (signature.options.get(_REPUBLISH) or {})
    if expires is None and not given:
        return request_header(request, EXPIRES_HEADER)
    return expires


def _call_expiry(request: Any) -> Any:
    """When the call ``request`` runs for expires: its message's ``expires``, or the expiry a
    copy of its message carries in a header (ISO 8601); ``None`` for one that does not."""
    expiry = request.expires or request_header(request, EXPIRES_HEADER)
    return expiry.isoformat() if isinstance(expiry, datetime) else expiry


def _copy_expired(request: Any) -> bool:
    """Whether the call a copy of its message stands for has expired (see ``EXPIRES_HEADER``);
    the message the call was sent as is Celery's to expire."""
    return expired(request_header(request, EXPIRES_HEADER))


def _expiry_of(signature: Any) -> Any:
    """The ``expires`` Celery sends ``signature`` with: its own option, else its task's."""
    if "expires" in signature.options:
        return signature.options["expires"]
    try:
        task = signature.type
    except Exception:  # a task this process does not know: Celery applies none either
        return None
    return getattr(task, "expires", None)


def _dumped_models(
    task: IdempotentTask, args: tuple[Any, ...], kwargs: dict[str, Any], options: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments as Celery sends those of a ``pydantic=True`` task (its models
    dumped, unless pickled); as they are for any other task."""
    dump = getattr(task, "_dump_pydantic_arguments", None)
    if dump is None or (options.get("serializer") or task.serializer) == "pickle":
        return args, kwargs
    dumped_args, dumped_kwargs = dump(args, kwargs)
    return tuple(dumped_args or ()), dict(dumped_kwargs or {})


def _claimed_as_retry(request: Any) -> int:
    """How many retries a delivered message counts for its claim (see
    :func:`~idempotent_tasks.records.retry_marker`): a dead letter's counts as the latest."""
    if request_header(request, DEAD_LETTER_HEADER) is not None:
        return LATEST_MESSAGE
    return int(request.retries or 0)


def _taking_back_headers(attempt: Attempt) -> dict[str, Any]:
    """What the copy of a call sent again before its body began needs: to take back at once
    the claim its ``attempt`` may hold (acquired, or applied with its reply lost), rather than
    wait out the lease, and to answer the call whose key that claim took over."""
    return {PREVIOUS_OWNER_HEADER: attempt.request.owner, **_taken_from_header(attempt)}


def _taken_from_header(attempt: Attempt) -> dict[str, Any]:
    """The header naming the call whose key ``attempt``'s claim took over, if it did."""
    taken_from = attempt.taken_from_task_id
    return {} if taken_from is None else {TAKEN_FROM_HEADER: taken_from}


def _carried_headers(request: Any, attempt: Attempt | None = None) -> dict[str, Any]:
    """What every next message of a call carries along (its retries, the copies it waits
    with, the guard's copies): the dead letter it retries, the call whose key it took over."""
    headers = dead_letter_headers(request)
    taken_from = _taken_from(request, attempt)
    if taken_from is not None:
        headers[TAKEN_FROM_HEADER] = taken_from
    return headers
