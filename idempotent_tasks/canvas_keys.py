"""The keys of the work that follows a call in its canvas, checked before the call goes out.

A chain's later steps, a chord's body and a call's callbacks are published by the worker, after
the steps before them ran: a key there that ``apply_async`` would refuse would fail the chain
half-way through, after a keyed step had completed. Their per-call keys (and the presence of a
key where a task requires one) are checked when the first message is published instead. A key
derived from the arguments (a template, a callable) is not: a later step's arguments include
results that do not exist yet.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from celery.canvas import maybe_signature

from .keys import given_key, validate_key

#: Canvas signatures whose parts are in their kwargs (the dict form Celery sends them in).
_PARTS = {"chain": ("tasks",), "group": ("tasks",), "chord": ("header", "body")}


def check_following_keys(app: Any, options: dict[str, Any], link: Any, link_error: Any) -> None:
    """``ValueError`` for a keyed task to be published after this call (the rest of its chain,
    its chord's body, its callbacks) whose key ``apply_async`` would refuse then.

    An errback may be called in the worker rather than published (one taking ``request, exc,
    traceback``): only a key it is given is checked there, not whether its task requires one.
    """
    for value in (options.get("chain"), options.get("chord"), link):
        for step, errback in _steps(app, value):
            _check_step(app, step, errback)
    for step, _ in _steps(app, link_error, errback=True):
        _check_step(app, step, errback=True)


def required_key_error(task_name: str) -> ValueError:
    """The error of a call without a key to a task that requires one."""
    return ValueError(
        f"task {task_name} requires an idempotency key: pass "
        "apply_async(..., idempotency_key=...) or set the task's idempotency_key"
    )


def _steps(app: Any, value: Any, errback: bool = False) -> Iterator[tuple[Any, bool]]:
    """The single-task signatures in ``value`` (a signature, its dict, or a list of them), each
    with whether it is an errback."""
    if not value:
        return
    if isinstance(value, list | tuple):
        for item in value:
            yield from _steps(app, item, errback)
        return
    signature = maybe_signature(value, app=app)
    if not isinstance(signature, dict):
        return
    parts = _PARTS.get(str(signature.get("subtask_type") or ""))
    if parts is None:
        yield signature, errback
    else:
        kwargs = signature.get("kwargs") or {}
        for name in parts:
            yield from _steps(app, kwargs.get(name), errback)
    options = signature.get("options") or {}
    yield from _steps(app, options.get("link"), errback)
    yield from _steps(app, options.get("link_error"), errback=True)


def _check_step(app: Any, step: Any, errback: bool) -> None:
    from .task import IdempotentTask

    task = app.tasks.get(step.get("task"))
    if not isinstance(task, IdempotentTask):
        return  # a plain task, or one this process does not know (sent by name elsewhere)
    key = given_key(step.get("options") or {})
    if key is not None:
        validate_key(key)
    elif task.idempotency_key is None and task.idempotency_key_required and not errback:
        raise required_key_error(task.name)
