"""A gevent or eventlet worker is told, as it starts, that its leases are renewed by a green
thread (a task that holds the event loop past its lease can be taken over while it runs)."""

from __future__ import annotations

import sys
import types

import pytest
from celery import Celery

from idempotent_tasks import IdempotentTask
from idempotent_tasks.startup import green_threads, warn_of_green_leases


class _Worker:
    """What worker_init hands its receivers: the worker, holding its app."""

    def __init__(self, app: Celery) -> None:
        self.app = app


def _app(*leases: float) -> Celery:
    app = Celery("green", set_as_current=False, broker="memory://")
    for name, shared in list(app.tasks.items()):  # other modules' shared tasks: not this app's
        if isinstance(shared, IdempotentTask):
            app.tasks.pop(name)
    for index, lease in enumerate(leases):

        @app.task(base=IdempotentTask, shared=False, name=f"t{index}", idempotency_lease=lease)
        def task() -> None:
            return None

    return app


def _patched(monkeypatch: pytest.MonkeyPatch, module: str, *, patched: bool) -> None:
    """Stand in for gevent's or eventlet's monkey-patching module in this process."""
    if module == "gevent":
        stub = types.SimpleNamespace(is_module_patched=lambda name: patched and name == "threading")
        monkeypatch.setitem(sys.modules, "gevent.monkey", stub)
    else:
        stub = types.SimpleNamespace(is_monkey_patched=lambda name: patched and name == "thread")
        monkeypatch.setitem(sys.modules, "eventlet.patcher", stub)


@pytest.mark.parametrize("module", ["gevent", "eventlet"])
def test_a_green_worker_is_told_what_keeps_its_leases(
    module: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _patched(monkeypatch, module, patched=True)
    assert green_threads()
    warn_of_green_leases(sender=_Worker(_app(300, 45)))
    [warning] = [r for r in caplog.records if "green thread" in r.getMessage()]
    assert warning.levelname == "WARNING"
    assert "45.0s here at the shortest" in warning.getMessage()


def test_a_worker_of_real_threads_or_without_keyed_tasks_is_told_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # gevent imported (by a library, say) but nothing patched: real threads
    _patched(monkeypatch, "gevent", patched=False)
    assert not green_threads()
    warn_of_green_leases(sender=_Worker(_app(300)))
    # patched, but no IdempotentTask on the app
    _patched(monkeypatch, "gevent", patched=True)
    warn_of_green_leases(sender=_Worker(_app()))
    assert not [r for r in caplog.records if "green thread" in r.getMessage()]
