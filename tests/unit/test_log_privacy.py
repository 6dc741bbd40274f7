"""SPEC 8: the library logs through Celery's task logger, and never a task's arguments at INFO
or above (they may hold personal data), whatever path a keyed call takes."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest
from celery import Celery
from celery.utils.log import task_logger

from idempotent_tasks import IdempotencyKeyMismatch, IdempotentTask
from idempotent_tasks.app_store import dlq_for, store_for
from idempotent_tasks.core import new_owner
from idempotent_tasks.keys import storage_key
from idempotent_tasks.task import KEY_HEADER
from tests.claim_requests import claim_request


def test_no_path_of_a_keyed_call_logs_its_arguments(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = Celery("privacy", set_as_current=False, broker="memory://")
    app.conf.update(
        idempotency_store_url="memory://",
        idempotency_dlq_url=f"sqlite:///{tmp_path / 'dlq.db'}",
        result_backend="cache+memory://",
        idempotency_result_max_bytes=100,
    )
    secret = f"jane.doe-{uuid.uuid4().hex}@example.com"

    @app.task(base=IdempotentTask, shared=False)
    def charge(email: str, size: int = 1) -> str:
        return email * size

    @app.task(base=IdempotentTask, shared=False, max_retries=0)
    def declined(email: str) -> None:
        raise RuntimeError("card declined")

    @app.task(base=IdempotentTask, shared=False, on_duplicate="skip", idempotency_validate=False)
    def skipping(email: str) -> None:
        return None

    # (a worker started earlier in the process may have left Celery's task logger at ERROR)
    monkeypatch.setattr(task_logger, "propagate", True)
    with caplog.at_level(logging.INFO), caplog.at_level(logging.INFO, logger=task_logger.name):
        # Given a keyed call published, run, and run again as a duplicate
        charge.apply_async((secret,), idempotency_key="published")
        charge.apply((secret,), headers={KEY_HEADER: "ran"}).get()
        charge.apply((secret,), headers={KEY_HEADER: "ran"}).get()
        # a call whose key stands for other arguments, one whose result is too big to cache,
        # one that fails for good (dead-lettered), one skipped while its key is in progress
        mismatched = charge.apply((secret, 2), headers={KEY_HEADER: "ran"})
        assert isinstance(mismatched.result, IdempotencyKeyMismatch)
        charge.apply((secret, 3), headers={KEY_HEADER: "big"}).get()
        declined.apply((secret,), headers={KEY_HEADER: "declined"})
        store_for(app).claim(
            claim_request(
                key="held",
                task_name=skipping.name,
                storage_key=storage_key(skipping.name, "held"),
                task_id=str(uuid.uuid4()),
                owner=new_owner(),
                fingerprint="another call",
                lease_seconds=60,
                validate=False,
            )
        )
        skipping.apply((secret,), headers={KEY_HEADER: "held"})
    ours = [record for record in caplog.records if record.name.startswith("idempotent_tasks")]
    # Then each path did log (so the check below looks at real lines)
    said = "\n".join(record.getMessage() for record in ours)
    for line in ("not cached", "failed for good", "skipped"):
        assert line in said
    # And no line of ours at INFO or above holds the arguments
    assert secret not in said
    assert [item.args for item in dlq_for(app).items()] == [[secret]]  # kept where they belong
    dlq_for(app).dispose()
