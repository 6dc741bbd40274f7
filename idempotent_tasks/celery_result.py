"""Celery's result record, written by the completion itself when it can be.

Celery's Redis result backend stores a task's result with two round trips of its own (a read of
the current state, then a write and a publish). When the claim store is that same Redis
database (the default store), the completion script can write and publish the very same record
in its own round trip, and Celery is then told the result is stored. The record is built by the
backend's own methods, so waiting callers (``AsyncResult.get()`` over pub/sub) and readers see
exactly what Celery would have written.

Anything unusual keeps Celery's own write: another backend or store, ignored or eager results,
callbacks or chains (Celery dispatches them before storing, so ``result.children`` lists them),
chord members, redeliveries, a result the backend cannot encode or larger than
``idempotency_result_max_bytes``, a completion that was not stored, and a Redis that refuses
the write (a cluster proxy, an ACL; then for the rest of the process).

Celery then sees the request's ``ignore_result`` set: so do ``on_success``, ``after_return``
and ``task_postrun`` receivers of that task.
"""

from __future__ import annotations

from typing import Any

from celery import states

from .records import SideWrite


def backend_shares_store(backend: Any, store: Any) -> bool:
    """Whether ``backend`` is Celery's plain Redis backend on ``store``'s Redis database."""
    try:  # both need redis-py, an optional dependency
        from celery.backends.redis import RedisBackend

        from .stores.redis import RedisStore
    except ImportError:
        return False
    return (
        type(backend) is RedisBackend
        and isinstance(store, RedisStore)
        and store.shares_database_with(backend.client)
    )


def result_side_write(backend: Any, request: Any, value: Any, max_bytes: int) -> SideWrite | None:
    """The record Celery's Redis ``backend`` would store for ``value`` as the result of
    ``request``, or ``None`` when Celery must store it itself (see the module's docstring).

    ``request`` is the running task's request, its result not ignored. A record over
    ``max_bytes`` (the cached result's limit) is left to Celery, so a huge result never holds
    up the completion.
    """
    if request.is_eager or request.callbacks or request.chain or request.chord:
        return None
    if (request.delivery_info or {}).get("redelivered"):
        # The task id may have a stored success already (an expired claim): Celery never
        # overwrites one, the script would.
        return None
    try:
        meta = backend._get_result_meta(
            result=backend.encode_result(value, states.SUCCESS),
            state=states.SUCCESS,
            traceback=None,
            request=request,
        )
        meta["task_id"] = request.id
        encoded = backend.encode(meta)
    except Exception:  # Celery's own write then raises its usual error
        return None
    if len(encoded) > max_bytes:
        return None
    return SideWrite(
        key=backend.get_key_for_task(request.id),
        value=encoded.encode() if isinstance(encoded, str) else encoded,
        ttl_seconds=backend.expires,
    )
