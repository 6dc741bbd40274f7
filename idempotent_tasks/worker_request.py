"""The worker's request class for ``IdempotentTask`` (Celery's ``Task.Request`` hook).

A call killed at its hard time limit never returns to the task's own code: Celery terminates
its pool process, then, in the worker's main process, marks it failed and acknowledges its
message. The claim that process held would stay until its lease ended, and the pickup guard
would then run the call again, to its limit, again and again. This request ends the call
there instead, as a failure in its body would end: dead-lettered, and its key released. So it
ends a call whose pool process died under it (``WorkerLostError``) once Celery fails it for
good, its retries used up; a terminated one (``revoke(terminate=True)``) has its key released.

Only this process can tell which claim to release: the owner id of each delivery is issued
here, in the request, and the pool process claims under that id (see :func:`issued_owner`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
from typing import Any

from billiard.common import TERM_SIGNAME
from billiard.exceptions import Terminated, WorkerLostError
from billiard.process import active_children
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded
from celery.platforms import signals as platform_signals
from celery.worker import state as worker_state
from celery.worker.request import Request

logger = logging.getLogger(__name__)

#: Request entries: the owner id the worker's main process issued to a delivery, and its pid.
ISSUED_OWNER = "idempotency_issued_owner"
ISSUED_BY = "idempotency_issued_by"


class _OwnerIds:
    """Owner ids for every delivery this process receives: a random prefix of its own and a
    counter (a uuid4 per message costs the consumer ten times as much). A forked child starts
    with a prefix of its own, so no two processes ever issue the same id."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.prefix = os.urandom(12).hex()
        self.counter = itertools.count()

    def issue(self) -> str:
        return f"{self.prefix}{next(self.counter):x}"


_owner_ids = _OwnerIds()
os.register_at_fork(after_in_child=_owner_ids.reset)


#: The signal billiard turns into SoftTimeLimitExceeded in a pool process.
_SOFT_TIME_LIMIT_SIGNAL = getattr(signal, "SIGUSR1", None)


class IdempotentRequest(Request):  # type: ignore[misc]
    """Celery's request, ending an ``IdempotentTask`` call whose pool process is gone: killed
    at its hard time limit, terminated, or dead under it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Each delivery is a new request, so a redelivered message is a new owner too.
        self.request_dict[ISSUED_OWNER] = _owner_ids.issue()
        self.request_dict[ISSUED_BY] = os.getpid()

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> None:
        exc = getattr(exc_info.exception, "exc", exc_info.exception)  # ExceptionWithTraceback
        if isinstance(exc, TimeLimitExceeded) and not return_ok:
            # Billiard fails a call at its hard time limit (Celery then acknowledges its
            # message) before it calls on_timeout: the call is ended first, its dead letter
            # written before its message goes. (return_ok: the body raised one itself, from a
            # result it waited for, say, and its own code ended it.)
            self._end_killed_call(exc)
        elif isinstance(exc, Terminated):
            # Billiard reports a terminated call once its process is gone. One that ended
            # without running Python (SIGKILL) took its token along: its claim would stay
            # until its lease ends, a new call of the key answered with this revoked one.
            release: Any = getattr(self.task, "release_terminated_call", None)
            if release is not None:
                try:
                    # Cancelled (cold shutdown, a lost connection): its message comes back.
                    release(self.request_dict, requeued=bool(self._already_cancelled))
                except Exception:
                    logger.exception("could not release the key of terminated %s", self.id)
        elif isinstance(exc, SoftTimeLimitExceeded) and self._idempotency_interrupted:
            # Revoked with terminate=True and SIGUSR1: its body failed as at its soft time
            # limit, dead-lettered. It was revoked: its row goes.
            withdraw: Any = getattr(self.task, "withdraw_revoked_failure", None)
            if withdraw is not None:
                try:
                    withdraw(self.request_dict)
                except Exception:
                    logger.exception("could not withdraw the dead letter of revoked %s", self.id)
        elif self._process_lost(exc) and getattr(self.task, "end_lost_call", None) is not None:
            # Its pool process died under it (the OOM killer, a crash in C code, the body's own
            # SystemExit): Celery retries it (see _retry_worker_lost), hands it back, or fails it
            # for good, which ends it here first: dead-lettered, its key released.
            try:
                if self.task.lost_call_fails(self.request_dict) and not self._success_was_stored():
                    _ = self._context  # its callbacks and chain, for a dead letter's options
                    self.task.end_lost_call(self.request_dict, exc)
            except Exception:
                logger.exception("could not end %s[%s] after its process died", self.name, self.id)
        try:
            super().on_failure(exc_info, send_failed_event, return_ok)
        finally:
            unretried = self._idempotency_unretried
            if unretried is not None and not (
                self.task.acks_late and self.task.reject_on_worker_lost
            ):
                # Its retry could not be sent, and Celery failed it instead of handing it back.
                try:
                    self.task.end_lost_call(self.request_dict, unretried)
                except Exception:
                    logger.exception(
                        "could not end %s[%s] after its process died", self.name, self.id
                    )

    _idempotency_unretried: BaseException | None = None
    _idempotency_success: Any = None
    #: Revoked with terminate=True and SIGUSR1, which billiard turns into SoftTimeLimitExceeded
    #: in the body (a soft time limit's own exception).
    _idempotency_interrupted = False

    def terminate(self, pool: Any, signal: Any = None) -> None:
        signum = platform_signals.signum(signal or TERM_SIGNAME)
        self._idempotency_interrupted = signum == _SOFT_TIME_LIMIT_SIGNAL
        super().terminate(pool, signal)

    def _retry_worker_lost(self, exc: BaseException, exc_info: Any) -> bool:
        """Celery's retry of a call whose process died. The key stays the dead owner's: the
        retry names it as previous owner (see ``IdempotentTask.signature_from_request``) and
        takes it over at once, and should the retry not be sent the call ends as Celery ends
        it, its message handed back or its key released with its dead letter."""
        retried = bool(super()._retry_worker_lost(exc, exc_info))
        if not retried:
            self._idempotency_unretried = exc
        return retried

    def _success_was_stored(self) -> Any:
        """Celery's look for a success the call stored before its process died (Celery then
        only acknowledges it), asked once (``on_failure`` asks too): two looks could disagree,
        and each may wait on the backend."""
        if self._idempotency_success is None:
            self._idempotency_success = (super()._success_was_stored(),)
        return self._idempotency_success[0]

    def _process_lost(self, exc: BaseException) -> bool:
        """Whether Celery takes ``exc`` for the loss of the call's pool process: billiard's
        ``WorkerLostError``, or the body's own ``SystemExit``/``KeyboardInterrupt`` that it
        did not cause itself (a revoke, a cancel)."""
        if isinstance(exc, WorkerLostError):
            return True
        return isinstance(exc, SystemExit | KeyboardInterrupt) and not (
            self._already_cancelled or self._already_revoked
        )

    def on_timeout(self, soft: bool, timeout: float) -> None:
        if not soft:
            self._end_killed_call(TimeLimitExceeded(timeout))  # if on_failure did not
        super().on_timeout(soft, timeout)

    _idempotency_killed_ended = False

    def _end_killed_call(self, exc: TimeLimitExceeded) -> None:
        """End a call killed at its hard time limit (once): dead-lettered, its key released."""
        # A cold shutdown kills running tasks through this path too: their messages are
        # redelivered, so they have not failed.
        if self._idempotency_killed_ended or worker_state.should_terminate:
            return
        self._idempotency_killed_ended = True
        end_killed_call: Any = getattr(self.task, "end_killed_call", None)
        if end_killed_call is None:
            return
        # Billiard terminates the process only after on_timeout: make sure the body is gone
        # before its key is released, or a duplicate could run beside it. (Only a pool
        # process of ours: a green pool's worker_pid is a greenlet's id.)
        try:
            if self.worker_pid in {child.pid for child in active_children()}:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.worker_pid, signal.SIGKILL)
            # The message body's callbacks, errbacks and chain join the request dict only
            # once Celery builds its context: a re-published message needs them.
            _ = self._context
            end_killed_call(self.request_dict, exc)
        except Exception:
            logger.exception("could not end %s[%s] after its time limit", self.name, self.id)


def issued_owner(request: Any) -> str | None:
    """The owner id this worker issued to the delivery ``request`` runs, if any.

    Trusted only from this process or its parent (the prefork pool's main process): the
    entries are request fields, and a message could carry stale ones in its headers.
    """
    if getattr(request, ISSUED_BY, None) not in (os.getpid(), os.getppid()):
        return None
    owner = getattr(request, ISSUED_OWNER, None)
    return owner if isinstance(owner, str) and owner else None


def request_header(request: Any, name: str) -> Any:
    """A custom header of a task request: a request attribute from a worker, else in headers."""
    value = getattr(request, name, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(name)
    return value
