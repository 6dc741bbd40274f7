"""Prometheus metrics: each signal, sent with the payload the package sends, moves its metric."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from prometheus_client import CollectorRegistry

from idempotent_tasks import signals
from idempotent_tasks.dead_letters import SWEEP_TASK
from idempotent_tasks.dlq import DeadLetterQueue, Failure
from idempotent_tasks.prometheus import INSTALL_HINT, disable, enable, update_dead_letter_gauge
from idempotent_tasks.records import Outcome

ROOT = Path(__file__).resolve().parents[2]
TASK = "shop.charge"


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    """A fresh registry whose metrics are fed by the signals during the test."""
    registry = CollectorRegistry()
    enable(registry)
    yield registry
    disable(registry)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    """The value of one sample, ``None`` when it was never set."""
    return registry.get_sample_value(name, labels)


def failure(number: int, task_name: str = TASK) -> Failure:
    """A final failure of ``task_name``, distinct per ``number``."""
    return Failure(
        failure_id=f"task-{number}:0",
        task_name=task_name,
        task_id=f"task-{number}",
        idempotency_key=f"order:{number}",
        args=[number, 990],
        kwargs={},
        options={},
        error_type="examples.compose_app.GatewayTimeout",
        error_message="gateway timed out",
        traceback=None,
        max_retries=3,
    )


def test_claims_are_counted_by_outcome_and_takeovers_apart(registry: CollectorRegistry) -> None:
    signals.claim_finished.send(task_name=TASK, outcome=Outcome.ACQUIRED, takeover=False)
    signals.claim_finished.send(task_name=TASK, outcome=Outcome.ACQUIRED, takeover=True)
    signals.claim_finished.send(task_name=TASK, outcome=Outcome.COMPLETED, takeover=False)
    signals.claim_finished.send(task_name=TASK, outcome=Outcome.IN_PROGRESS, takeover=False)

    claims = "idempotent_tasks_claims_total"
    assert sample(registry, claims, task=TASK, outcome="acquired") == 2
    assert sample(registry, claims, task=TASK, outcome="completed") == 1
    assert sample(registry, claims, task=TASK, outcome="in_progress") == 1
    assert sample(registry, claims, task=TASK, outcome="mismatch") is None
    assert sample(registry, "idempotent_tasks_takeovers_total", task=TASK) == 1


def test_duplicates_are_counted_where_they_were_suppressed(registry: CollectorRegistry) -> None:
    send = signals.duplicate_suppressed.send
    send(task_name=TASK, where="publish", outcome=Outcome.COMPLETED)
    send(task_name=TASK, where="publish", outcome=Outcome.IN_PROGRESS)
    send(task_name=TASK, where="worker", outcome=Outcome.COMPLETED)

    name = "idempotent_tasks_duplicates_suppressed_total"
    assert sample(registry, name, task=TASK, where="publish") == 2
    assert sample(registry, name, task=TASK, where="worker") == 1


def test_takeover_losses_and_uncached_results_are_counted(registry: CollectorRegistry) -> None:
    signals.stale_complete_refused.send(task_name=TASK, key="order:1")
    signals.lease_lost.send(task_name=TASK, key="order:1")
    signals.lease_lost.send(task_name=TASK, key="order:2")
    signals.result_not_cached.send(task_name=TASK, key="order:3", reason="too big")

    assert sample(registry, "idempotent_tasks_stale_completes_refused_total", task=TASK) == 1
    assert sample(registry, "idempotent_tasks_leases_lost_total", task=TASK) == 2
    assert sample(registry, "idempotent_tasks_results_not_cached_total", task=TASK) == 1


def test_lost_messages_published_again_are_counted(registry: CollectorRegistry) -> None:
    signals.lost_message_republished.send(task_name=TASK)
    signals.lost_message_republished.send(task_name=TASK)

    assert sample(registry, "idempotent_tasks_lost_messages_republished_total", task=TASK) == 2


def test_dead_letters_written_are_counted_by_status(registry: CollectorRegistry) -> None:
    signals.dead_letter_written.send(task_name=TASK, status="pending")
    signals.dead_letter_written.send(task_name=TASK, status="permanent_failure")

    name = "idempotent_tasks_dead_letters_written_total"
    assert sample(registry, name, task=TASK, status="pending") == 1
    assert sample(registry, name, task=TASK, status="permanent_failure") == 1


def test_dead_letter_gauge_follows_the_table(registry: CollectorRegistry, tmp_path: Path) -> None:
    # Given a real dead-letter table with two pending rows, one of them then succeeded
    queue = DeadLetterQueue(f"sqlite:///{tmp_path / 'dlq.db'}")
    try:
        first = queue.add(failure(1))
        queue.add(failure(2))
        queue.mark_succeeded(first.id)

        # When the gauge is refreshed from it
        counts = update_dead_letter_gauge(queue, registry)
    finally:
        queue.dispose()

    # Then it holds one sample per status, zeros included, and no "total"
    assert counts["total"] == 2
    gauge = "idempotent_tasks_dead_letters"
    assert sample(registry, gauge, status="pending") == 1
    assert sample(registry, gauge, status="succeeded") == 1
    assert sample(registry, gauge, status="retrying") == 0
    assert sample(registry, gauge, status="permanent_failure") == 0
    assert sample(registry, gauge, status="total") is None


def test_the_sweep_refreshes_the_dead_letter_gauge(
    registry: CollectorRegistry, tmp_path: Path
) -> None:
    # Given an app whose dead-letter table holds three rows not yet due
    url = f"sqlite:///{tmp_path / 'dlq.db'}"
    app = Celery("sweep", broker="memory://", set_as_current=False)
    app.conf.update(idempotency_store_url="memory://", idempotency_dlq_url=url)
    queue = DeadLetterQueue(url)
    try:
        for number in range(3):
            queue.add(failure(number))
    finally:
        queue.dispose()

    # When beat's sweep runs once
    assert app.tasks[SWEEP_TASK].apply().get() == 0

    # Then the gauge counts the rows, with no query of its own
    assert sample(registry, "idempotent_tasks_dead_letters", status="pending") == 3


def test_enable_is_idempotent_and_disable_stops_the_feed(registry: CollectorRegistry) -> None:
    metrics = enable(registry)
    assert enable(registry) is metrics
    signals.lease_lost.send(task_name=TASK, key="order:1")
    assert sample(registry, "idempotent_tasks_leases_lost_total", task=TASK) == 1

    disable(registry)
    signals.lease_lost.send(task_name=TASK, key="order:1")
    assert sample(registry, "idempotent_tasks_leases_lost_total", task=TASK) == 1

    enable(registry)
    signals.lease_lost.send(task_name=TASK, key="order:1")
    assert sample(registry, "idempotent_tasks_leases_lost_total", task=TASK) == 2


def test_a_receiver_error_never_reaches_the_sender(
    registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    # A payload without "outcome" breaks the claim receiver; the sender must not notice
    signals.claim_finished.send(task_name=TASK, takeover=False)
    assert "claim_finished" in caplog.text


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter at the project root."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_importing_the_package_does_not_import_prometheus_client() -> None:
    run = run_python(
        "import sys, idempotent_tasks, idempotent_tasks.prometheus; "
        "assert 'prometheus_client' not in sys.modules, 'prometheus_client was imported'"
    )
    assert run.returncode == 0, run.stderr


def eager_app_script(app_name: str, task_name: str, then: str, before: str = "") -> str:
    """A script for a fresh interpreter: ``before``, then an eager app with a keyed task
    ``task_name`` (the function ``charge``) on the memory store, then ``then``."""
    return (
        "from celery import Celery\n"
        "from prometheus_client import REGISTRY\n"
        "from idempotent_tasks import IdempotentTask\n"
        f"{before}"
        f"app = Celery({app_name!r}, broker='memory://')\n"
        "app.conf.update(task_always_eager=True, idempotency_store_url='memory://',\n"
        "                idempotency_dlq_poll_interval=None)\n"
        f"@app.task(base=IdempotentTask, name={task_name!r})\n"
        "def charge(order):\n"
        "    return order\n"
        f"{then}"
    )


def test_any_process_using_an_app_counts_into_the_default_registry() -> None:
    # Given a process that is no worker: eager calls of a keyed task, the second a duplicate
    run = run_python(
        eager_app_script(
            "producer",
            "shop.charge",
            "assert charge.apply_async((1,), idempotency_key='order:1').get() == 1\n"
            "assert charge.apply_async((1,), idempotency_key='order:1').get() == 1\n"
            "claims = REGISTRY.get_sample_value('idempotent_tasks_claims_total',\n"
            "    {'task': 'shop.charge', 'outcome': 'acquired'})\n"
            "suppressed = REGISTRY.get_sample_value(\n"
            "    'idempotent_tasks_duplicates_suppressed_total',\n"
            "    {'task': 'shop.charge', 'where': 'publish'})\n"
            "print(claims, suppressed)\n",
        )
    )
    # Then its counters are in prometheus_client's default registry without an enable() call
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1.0", "1.0"]


def test_a_registry_that_refuses_the_metrics_never_fails_a_call() -> None:
    # Given a process whose default registry has one of the metrics' names taken already
    run = run_python(
        eager_app_script(
            "producer",
            "shop.charge",
            "for _ in range(2):\n"
            "    print(charge.apply_async((1,), idempotency_key='order:1').get())\n",
            before="from prometheus_client import Counter\n"
            "Counter('idempotent_tasks_takeovers', 'taken', ['task'])\n",
        )
    )
    # Then its keyed calls run, and the refusal is logged once
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1", "1"]
    assert run.stderr.count("could not register the Prometheus metrics") == 1


def test_disable_sticks_after_the_automatic_enable() -> None:
    # Given a process whose metrics were enabled on its first keyed call, then disabled
    first_app = eager_app_script(
        "producer",
        "shop.charge",
        "charge.apply_async((1,), idempotency_key='order:1').get()\n"
        "from idempotent_tasks.prometheus import disable\n"
        "disable()\n",
    )
    # When a second app builds its own store and runs a keyed call
    second_app = eager_app_script(
        "other",
        "shop.refund",
        "charge.apply_async((2,), idempotency_key='order:2').get()\n"
        "print(REGISTRY.get_sample_value('idempotent_tasks_claims_total',\n"
        "    {'task': 'shop.refund', 'outcome': 'acquired'}))\n",
    )
    run = run_python(first_app + second_app)
    # Then nothing enabled the metrics again
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["None"]


@pytest.mark.parametrize("registry_argument", ["", "object()"])
def test_enable_without_prometheus_client_names_the_extra(registry_argument: str) -> None:
    # Given an interpreter where prometheus_client cannot be imported
    run = run_python(
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from idempotent_tasks.prometheus import enable\n"
        "try:\n"
        f"    enable({registry_argument})\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == INSTALL_HINT
    assert "pip install 'idempotent-tasks[prometheus]'" in run.stdout


def test_metric_names_are_the_documented_ones(registry: CollectorRegistry) -> None:
    names: set[str] = {metric.name for metric in registry.collect()}
    assert names == {
        "idempotent_tasks_claims",
        "idempotent_tasks_takeovers",
        "idempotent_tasks_duplicates_suppressed",
        "idempotent_tasks_stale_completes_refused",
        "idempotent_tasks_leases_lost",
        "idempotent_tasks_results_not_cached",
        "idempotent_tasks_dead_letters_written",
        "idempotent_tasks_lost_messages_republished",
        "idempotent_tasks_dead_letters",
    }


def test_a_refused_enable_leaves_the_registry_as_it_was() -> None:
    # Given a registry where the name of the metrics' second one is taken
    from prometheus_client import Counter

    registry = CollectorRegistry()
    taken = Counter("idempotent_tasks_takeovers", "someone else's", registry=registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        enable(registry)
    # Then none of the metrics made before the refusal stays registered
    assert [metric.name for metric in registry.collect()] == ["idempotent_tasks_takeovers"]
    # and once the name is free, enable() registers them all
    registry.unregister(taken)
    enable(registry)
    try:
        signals.lease_lost.send(task_name=TASK, key="order:1")
        assert sample(registry, "idempotent_tasks_leases_lost_total", task=TASK) == 1
        assert sample(registry, "idempotent_tasks_claims_total", task=TASK, outcome="x") is None
    finally:
        disable(registry)
