"""What the worker's request issues to a delivery, and how far the task trusts it."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context

from idempotent_tasks import IdempotentTask
from idempotent_tasks import task as task_module
from idempotent_tasks.worker_request import ISSUED_BY, ISSUED_OWNER, _owner_ids, issued_owner


def _request(**fields: Any) -> Context:
    return Context({"id": "t-1", "args": [], "kwargs": {}, "delivery_info": {}, **fields})


def test_an_issued_owner_is_trusted_only_from_this_process_or_its_parent() -> None:
    assert issued_owner(_request(**{ISSUED_OWNER: "o", ISSUED_BY: os.getpid()})) == "o"
    assert issued_owner(_request(**{ISSUED_OWNER: "o", ISSUED_BY: os.getppid()})) == "o"
    # Stale entries a message carried in from elsewhere, or none at all
    assert issued_owner(_request(**{ISSUED_OWNER: "o", ISSUED_BY: 1})) is None
    assert issued_owner(_request(**{ISSUED_OWNER: "o"})) is None
    assert issued_owner(_request()) is None


def test_issued_owners_never_repeat_and_a_forked_child_issues_its_own() -> None:
    issued = {_owner_ids.issue() for _ in range(1000)}
    assert len(issued) == 1000 and all(len(owner) <= 64 for owner in issued)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its first id, then leave at once, whatever happens
        try:
            os.write(write, _owner_ids.issue().encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as from_child:
        child_owner = from_child.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert child_owner and child_owner[:24] != _owner_ids.issue()[:24]


def test_a_republished_message_carries_no_issued_owner() -> None:
    app = Celery("t", set_as_current=False, broker="memory://")

    @app.task(base=IdempotentTask, bind=True)
    def charge(self: Any, order_id: str) -> str:
        return order_id

    request = _request(**{ISSUED_OWNER: "o", ISSUED_BY: os.getpid(), "other": "kept"})
    headers = charge.signature_from_request(request).options["headers"]
    assert ISSUED_OWNER not in headers and ISSUED_BY not in headers
    assert headers["other"] == "kept"


@pytest.mark.parametrize(
    ("version", "acks_on_timeout", "acks_on_failure_or_timeout", "requeues"),
    [
        # Celery 5.7: acks_on_timeout decides
        ((5, 7, 0), False, True, True),
        ((5, 7, 0), True, False, False),
        # 5.5 and 5.6 know only acks_on_failure_or_timeout
        ((5, 6, 0), False, True, False),
        ((5, 5, 0), None, False, True),
        # before 5.5 a killed message is rejected without requeueing
        ((5, 4, 0), None, False, False),
    ],
)
def test_whether_celery_requeues_a_killed_call_follows_its_version(
    monkeypatch: pytest.MonkeyPatch,
    version: tuple[int, int, int],
    acks_on_timeout: bool | None,
    acks_on_failure_or_timeout: bool,
    requeues: bool,
) -> None:
    monkeypatch.setattr(task_module.celery, "VERSION", version)
    task = SimpleNamespace(
        acks_late=True,
        acks_on_timeout=acks_on_timeout,
        acks_on_failure_or_timeout=acks_on_failure_or_timeout,
    )
    assert task_module._timeout_requeues(task) is requeues  # type: ignore[arg-type]
    task.acks_late = False
    assert task_module._timeout_requeues(task) is False  # type: ignore[arg-type]
