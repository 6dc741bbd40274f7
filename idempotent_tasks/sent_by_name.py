"""Keyed calls sent by name: ``app.send_task(name, ..., idempotency_key=k)``, a signature of a
task this process does not register (``app.signature(name).set(idempotency_key=k)``), a beat
entry whose options name a key for a task beat does not import.

Celery sends those without ``IdempotentTask.apply_async``, and puts options it does not know
into the message's properties, where no worker looks: the call would run unclaimed. The key is
moved into the message's headers instead, as the task's own ``apply_async`` carries it. Nothing
can be refused there (Celery logs a signal receiver's error and publishes all the same): a key
that is not a valid one is carried as it is, and the worker fails the call, running nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import before_task_publish

from .keys import KEY_HEADER, validate_key

logger = logging.getLogger(__name__)


def key_into_headers(
    sender: Any = None,
    headers: dict[str, Any] | None = None,
    properties: dict[str, Any] | None = None,
    **_: Any,
) -> None:
    """Move an ``idempotency_key`` option out of a message's properties into its headers."""
    if not properties or KEY_HEADER not in properties or headers is None:
        return
    key = properties.pop(KEY_HEADER)
    if key is None:
        return
    headers[KEY_HEADER] = key  # the option wins over a header, as with apply_async
    try:
        validate_key(key)
    except ValueError as exc:
        logger.warning("%s was sent with an invalid key, which its worker refuses: %s", sender, exc)


before_task_publish.connect(
    key_into_headers, weak=False, dispatch_uid="idempotent_tasks.sent_by_name"
)
