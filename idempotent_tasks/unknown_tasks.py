"""Dead letters sent again to a worker that does not know their task.

Celery's worker discards a message naming a task it has not registered (a task renamed or
removed since it failed, a worker without its module) and runs none of this package's code for
it. A dead letter's retry would then stay ``retrying`` until its timeout, go back to
``pending`` and be sent again, for ever, never using a retry. The worker's ``task_unknown``
signal records such a retry on its row instead, as a failed one (``NotRegistered``): the row is
rescheduled, and gives up at its limit as any retry that keeps failing.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import task_unknown

from .dead_letters import DEAD_LETTER_HEADER, DEAD_LETTER_SWEEP_HEADER, record_unrun_retry

logger = logging.getLogger(__name__)  # the worker's main process: no task runs here


@task_unknown.connect  # type: ignore[untyped-decorator]
def _on_task_unknown(
    sender: Any = None, name: str | None = None, message: Any = None, **_: Any
) -> None:
    headers = getattr(message, "headers", None) or {}
    dead_letter_id = headers.get(DEAD_LETTER_HEADER)
    app = getattr(sender, "app", None)
    if dead_letter_id is None or app is None:
        return
    how = f"the worker that received its retry has no task named {name!r}"
    try:
        record_unrun_retry(
            app, dead_letter_id, headers.get(DEAD_LETTER_SWEEP_HEADER), "NotRegistered", how
        )
    except Exception:  # never break the worker's consumer
        logger.exception("could not record the unknown task on dead letter %s", dead_letter_id)
