"""The dead-letter sweep is registered and scheduled on every app that loads the plugin."""

from __future__ import annotations

from celery import Celery, _state

import idempotent_tasks  # noqa: F401 - registers the sweep task and its beat entry
from idempotent_tasks.dead_letters import SWEEP_TASK, routing_options


def _finalized(**conf: object) -> Celery:
    app = Celery("t", set_as_current=False, broker="memory://")
    app.conf.update(conf)
    app.finalize()
    return app


def test_sweep_task_is_registered() -> None:
    assert SWEEP_TASK in _finalized().tasks


def test_the_sweep_is_importable_by_its_task_name() -> None:
    # ``idempotent_tasks.retry_dead_letters`` is both the task's name and where it lives
    from idempotent_tasks import retry_dead_letters

    previous = _state._tls.current_app  # None when no app was made current: left so
    app = Celery("t", set_as_current=True, broker="memory://")
    try:
        assert retry_dead_letters.name == SWEEP_TASK
        assert app.tasks[SWEEP_TASK] is retry_dead_letters._get_current_object()
    finally:
        _state._set_current_app(previous)


def test_beat_entry_defaults_to_every_30_seconds() -> None:
    entry = _finalized().conf.beat_schedule[SWEEP_TASK]
    assert entry["task"] == SWEEP_TASK
    assert entry["schedule"] == 30.0


def test_poll_interval_setting_sets_the_schedule() -> None:
    assert (
        _finalized(idempotency_dlq_poll_interval=5).conf.beat_schedule[SWEEP_TASK]["schedule"]
        == 5.0
    )


def test_poll_interval_none_disables_the_entry() -> None:
    assert SWEEP_TASK not in _finalized(idempotency_dlq_poll_interval=None).conf.beat_schedule


def test_routing_options_send_a_task_back_where_it_came_from() -> None:
    assert routing_options({"exchange": "", "routing_key": "celery", "priority": 0}) == {
        "queue": "celery",
        "priority": 0,
    }
    assert routing_options({"exchange": "billing", "routing_key": "charge"}) == {
        "exchange": "billing",
        "routing_key": "charge",
    }
    assert routing_options(None) == {}
