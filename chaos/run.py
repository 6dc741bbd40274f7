"""``python -m chaos.run``: a bounded chaos run against the Redis and/or the PostgreSQL store.

    python -m chaos.run [--store redis|postgresql|both] [--tasks 10000] [--seed 1]
                        [--max-seconds 600] [--concurrency 3] [--keep] [--report PATH]

Per store: start a Redis server and a PostgreSQL cluster of the run's own (loopback, free
ports, a temporary folder), two prefork workers and beat; call every planned key while faults
are injected at seeded moments; wait until nothing is left to happen; collect what every
caller's ``.get()`` returned; stop everything; audit the ledger; print the report. ``both``
(the default) runs the two stores one after the other, each in a process of its own, sharing
``--max-seconds``, and writes ``chaos/LAST_REPORT.md`` after a full-size run.

Exit status: 0 every invariant holds, 1 one does not, 2 the run could not finish (time limit,
a service that would not start).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import Any

import redis

from chaos import ENV_BROKER_URL, ENV_DLQ_URL, LEASE_S, VISIBILITY_TIMEOUT_S
from chaos.audit import AuditResult, RunInfo, audit, findings_text, report
from chaos.faults import FULL_RUN_TASKS, FaultInjector, plan_faults
from chaos.ledger import Ledger, NewEvent
from chaos.services import Cluster
from chaos.workload import QUEUE, Producer, plan_keys

LAST_REPORT = Path(__file__).resolve().parent / "LAST_REPORT.md"
STORES = ("redis", "postgresql")
WORKERS = 2
#: Seconds kept back from the calls for settling, collecting, stopping and auditing.
MIN_RESERVE_S = 45.0
#: Seconds kept back from settling for collecting, stopping and auditing.
AFTER_SETTLE_S = 30.0
#: The run is quiet when this many looks in a row (half a second apart) find nothing to do.
QUIET_LOOKS = 4
#: Seconds with nothing in flight after which callers still waiting are taken as stuck.
STUCK_S = 20.0

EXIT_OK, EXIT_VIOLATION, EXIT_INCOMPLETE = 0, 1, 2

logger = logging.getLogger("chaos")


class Interrupted(BaseException):
    """SIGTERM or SIGINT: stop, clean up, exit."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m chaos.run", description=__doc__.split("\n")[0])
    parser.add_argument("--store", choices=[*STORES, "both"], default="both")
    parser.add_argument("--tasks", type=int, default=FULL_RUN_TASKS, help="keys to call")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--max-seconds", type=float, default=600.0, help="time limit of the whole command"
    )
    parser.add_argument("--concurrency", type=int, default=3, help="pool processes per worker")
    parser.add_argument("--keep", action="store_true", help="keep the run's folder (logs, ledger)")
    parser.add_argument("--report", type=Path, help="write the report (markdown) here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the command; its exit status."""
    args = parse_args(argv)
    if args.tasks < 1 or args.max_seconds <= 0 or args.concurrency < 1:
        print("--tasks, --max-seconds and --concurrency must be positive", file=sys.stderr)
        return EXIT_INCOMPLETE
    _install_signal_handlers()
    if args.store == "both":
        return run_both(args)
    status, text = run_store(args)
    if args.report is not None:
        write_markdown(args.report, [(args.store, text)], args)
    return status


def _install_signal_handlers() -> None:
    def interrupt(signum: int, _frame: FrameType | None) -> None:
        raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)


# -- both stores ------------------------------------------------------------------------------


def run_both(args: argparse.Namespace) -> int:
    """One child process per store, the time limit shared; writes LAST_REPORT.md."""
    started = time.monotonic()
    results: list[tuple[str, str]] = []
    statuses = []
    for index, store in enumerate(STORES):
        remaining = args.max_seconds - (time.monotonic() - started)
        budget = remaining / (len(STORES) - index)
        if budget < 30:
            results.append((store, f"not run: {remaining:.0f}s left of the time limit"))
            statuses.append(EXIT_INCOMPLETE)
            continue
        with tempfile.NamedTemporaryFile("r", suffix=".md") as out:
            command = [
                sys.executable,
                "-m",
                "chaos.run",
                f"--store={store}",
                f"--tasks={args.tasks}",
                f"--seed={args.seed}",
                f"--max-seconds={budget:.0f}",
                f"--concurrency={args.concurrency}",
                f"--report={out.name}",
                *(["--keep"] if args.keep else []),
            ]
            statuses.append(_run_child(command, budget))
            text = Path(out.name).read_text()
        results.append((store, _report_block(text) or "no report: the run failed, see above"))
    status = max(statuses)
    if args.report is not None or args.tasks >= FULL_RUN_TASKS:
        write_markdown(args.report or LAST_REPORT, results, args)
    print(f"\nchaos: both stores in {time.monotonic() - started:.0f}s, exit status {status}")
    return status


def _run_child(command: list[str], budget: float) -> int:
    child = subprocess.Popen(command)
    try:
        return child.wait(timeout=budget + 60)
    except subprocess.TimeoutExpired:
        print(
            f"chaos: {' '.join(command[3:5])} overran its time limit; stopping it", file=sys.stderr
        )
        return EXIT_INCOMPLETE
    finally:
        if child.poll() is None:
            child.terminate()  # its own clean-up stops its servers
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def _report_block(markdown: str) -> str:
    if "```text\n" not in markdown:
        return ""
    return markdown.split("```text\n", 1)[1].split("```", 1)[0].rstrip()


def write_markdown(path: Path, results: list[tuple[str, str]], args: argparse.Namespace) -> None:
    """The report(s) as markdown: how they were made, then each store's report."""
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Last chaos run",
        "",
        f"`python -m chaos.run --store {args.store} --tasks {args.tasks} --seed {args.seed} "
        f"--max-seconds {args.max_seconds:g}` on {when}: {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, {_versions()}.",
        "",
    ]
    for store, text in results:
        lines += [f"## {store} store", "", "```text", text, "```", ""]
    path.write_text("\n".join(lines))


def _versions() -> str:
    import celery

    server = shutil.which("redis-server")
    redis_version = "?"
    if server:
        out = subprocess.run([server, "--version"], capture_output=True, text=True, check=False)
        redis_version = out.stdout.split("v=")[1].split()[0] if "v=" in out.stdout else "?"
    from chaos.services import postgres_bindir

    out = subprocess.run(
        [str(postgres_bindir() / "postgres"), "--version"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout  # "postgres (PostgreSQL) 15.20 (Debian 15.20-0+deb12u1)"
    postgres = out.split("(PostgreSQL)")[-1].split()[0] if "(PostgreSQL)" in out else "?"
    return f"Celery {celery.__version__}, Redis {redis_version}, PostgreSQL {postgres}"


# -- one store --------------------------------------------------------------------------------


def run_store(args: argparse.Namespace) -> tuple[int, str]:
    """One chaos run on ``args.store``; its exit status and report."""
    started_wall, started = time.time(), time.monotonic()
    deadline = started + args.max_seconds
    directory = Path(tempfile.mkdtemp(prefix=f"chaos-{args.store}-"))
    directory.chmod(0o755)  # PostgreSQL runs as its own user beneath it
    driver_log = _log_to(directory / "driver.log")
    ledger = Ledger(directory / "ledger.sqlite3")
    ledger.create()
    cluster = Cluster(directory, args.store, ledger.path, args.concurrency, ready_timeout=90)
    stop = threading.Event()
    producer: Producer | None = None
    durations: dict[str, float] = {}
    incomplete: str | None = None
    unsettled = ""
    result: AuditResult | None = None
    _say(f"{args.store}: run folder {directory}")
    try:
        mark = time.monotonic()
        cluster.start_servers()
        os.environ.update(cluster.env)
        app = importlib.import_module("chaos.app").app
        cluster.start_celery(WORKERS)
        plans = plan_keys(args.tasks, random.Random(args.seed), prefix=f"s{args.seed}")
        ledger.write_many(
            NewEvent(
                kind="planned",
                key=plan.key,
                data={"kind": plan.kind, "calls": plan.calls, "mode": plan.mode},
            )
            for plan in plans
        )
        injector = FaultInjector(
            cluster,
            ledger,
            random.Random(args.seed + 1),
            plan_faults(args.tasks, random.Random(args.seed + 2)),
        )
        broker = redis.Redis.from_url(cluster.env[ENV_BROKER_URL], socket_timeout=5)
        durations["setup"] = time.monotonic() - mark

        mark = time.monotonic()
        producer = Producer(app, plans, broker, stop)
        producer.start()
        reserve = max(MIN_RESERVE_S, 0.2 * args.max_seconds)
        last_said = time.monotonic()
        while not producer.done() or injector.pending:
            if time.monotonic() > deadline - reserve:
                incomplete = (
                    f"time limit: {producer.keys_started} of {len(plans)} keys called, "
                    f"{len(injector.pending)} faults not injected"
                )
                stop.set()
                break
            injector.run_due(1.0 if producer.done() else producer.progress)
            _supervise(cluster, ledger)
            if time.monotonic() - last_said > 15:
                last_said = time.monotonic()
                _say(
                    f"{args.store}: {time.monotonic() - started:.0f}s, "
                    f"{producer.keys_started}/{len(plans)} keys called, "
                    f"{len(injector.done)} faults injected"
                )
            time.sleep(0.05)
        if producer.error is not None:
            raise RuntimeError(f"the producer failed: {producer.error!r}")
        durations["calls"] = time.monotonic() - mark

        mark = time.monotonic()
        stuck, unsettled = _settle(producer, cluster, ledger, broker, deadline - AFTER_SETTLE_S)
        if unsettled and "nothing in flight" not in unsettled and incomplete is None:
            incomplete = f"did not settle within the time limit: {unsettled}"
        durations["settling"] = time.monotonic() - mark

        mark = time.monotonic()
        producer.collect(deadline=deadline - 15, per_call=10.0, stuck=stuck)
        ledger.write_many(
            NewEvent(
                kind="caller",
                key=caller.key,
                ts=caller.sent_at,
                data={
                    "index": caller.index,
                    "how": caller.how,
                    "task_id": caller.task_id,
                    "attempts": caller.attempts,
                    "outcome": caller.outcome or "timeout",
                    "value": caller.value,
                },
            )
            for caller in producer.callers
        )
        durations["collecting"] = time.monotonic() - mark

        mark = time.monotonic()
        for process in [cluster.beat, *cluster.workers]:
            if process is not None:
                process.stop(timeout=15)
        rows = _dead_letter_rows(cluster.env[ENV_DLQ_URL])
        durations["stopping"] = time.monotonic() - mark
        durations["total"] = time.monotonic() - started
        info = RunInfo(
            store=args.store,
            tasks=args.tasks,
            seed=args.seed,
            workers=WORKERS,
            concurrency=args.concurrency,
            lease_s=LEASE_S,
            visibility_timeout_s=VISIBILITY_TIMEOUT_S,
            started=started_wall,
            durations=durations,
            complete=incomplete is None,
            incomplete_reason=incomplete,
            unsettled=unsettled,
            log_dir=cluster.log_dir,
        )
        result = audit(ledger.events(), rows, info)
    except Interrupted as exc:
        _say(f"{args.store}: interrupted ({exc}); stopping everything")
        return EXIT_INCOMPLETE, f"interrupted ({exc})"
    except Exception:
        text = traceback.format_exc()
        print(text, file=sys.stderr)
        logger.error("run failed:\n%s", text)
        return EXIT_INCOMPLETE, f"the run failed:\n{text}"
    finally:
        # A second SIGTERM or Ctrl-C must not cut the clean-up short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop.set()
        if producer is not None:
            producer.join(timeout=5)
        cluster.close()
        ledger.close()
        for server_dir in ("redis", "postgres"):
            shutil.rmtree(directory / server_dir, ignore_errors=True)
        _stop_logging_to(driver_log)
    assert result is not None
    return _finish(result, directory, args)


def _finish(result: AuditResult, directory: Path, args: argparse.Namespace) -> tuple[int, str]:
    text = report(result)
    status = EXIT_VIOLATION if result.findings else EXIT_OK if result.ok else EXIT_INCOMPLETE
    print(text, flush=True)
    (directory / "report.txt").write_text(text + "\n")
    if result.findings:
        print(findings_text(result), flush=True)
        (directory / "violations.txt").write_text(findings_text(result, limit=None) + "\n")
    if status == EXIT_OK and not args.keep:
        shutil.rmtree(directory, ignore_errors=True)
    else:
        print(f"run folder (ledger, logs): {directory}", flush=True)
    return status, text


def _log_to(path: Path) -> logging.FileHandler:
    """Send the driver's log records (INFO and up) to ``path``; the handler, to stop it."""
    handler = logging.FileHandler(path)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return handler


def _stop_logging_to(handler: logging.FileHandler) -> None:
    """Close the driver's log before its folder may be removed.

    Producer threads still waiting on a reply are daemons: they may log until the interpreter
    exits. A closed file handler would open its file again (raising when the folder is gone)
    and no handler at all would print to stderr after the report; their records are dropped.
    """
    root = logging.getLogger()
    root.removeHandler(handler)
    handler.close()
    root.addHandler(logging.NullHandler())


def _say(message: str) -> None:
    print(f"chaos: {message}", file=sys.stderr, flush=True)
    logger.info(message)


def _supervise(cluster: Cluster, ledger: Ledger) -> None:
    """Record and replace a worker that exited without the run killing it."""
    for worker in list(cluster.workers):
        if not worker.alive():
            reason = next(
                (
                    line.split("] ", 1)[-1]
                    for line in worker.log().splitlines()
                    if "CRITICAL" in line
                ),
                f"exit status {worker.process.returncode}",
            )
            ledger.write(
                "fault",
                fault="worker_exited",
                worker=worker.name,
                pid=worker.pid,
                children=[],
                killed_at=time.time(),
                at=time.time(),
                until=time.time(),
                reason=f"{worker.name}: {reason[:200]}",
            )
            logger.error("worker %s exited by itself (%s); starting another", worker.name, reason)
            cluster.workers.remove(worker)
            cluster.start_worker()


def _settle(
    producer: Producer, cluster: Cluster, ledger: Ledger, broker: redis.Redis, deadline: float
) -> tuple[set[str], str]:
    """Wait until nothing is left to happen: every caller's result ready, every dead letter
    final, no message of the run's tasks in the broker.

    Callers still waiting once the broker has held nothing of the run's and every dead letter
    has been final for ``STUCK_S`` seconds wait for nothing (their message is gone): settling
    ends then too. Returns the task ids still waiting and a sentence on what is unsettled.
    """
    from idempotent_tasks.dlq import DeadLetterQueue
    from idempotent_tasks.errors import StoreUnavailable

    dlq = DeadLetterQueue(cluster.env[ENV_DLQ_URL])
    waiting = {caller.task_id for caller in producer.callers if caller.eager is None}
    looks = 0
    idle_since: float | None = None
    unsettled = "nothing looked at yet"
    try:
        while time.monotonic() < deadline:
            _supervise(cluster, ledger)
            waiting = producer.pending_task_ids(waiting)
            try:
                stats = dlq.stats()
                open_rows = stats["pending"] + stats["retrying"]
            except StoreUnavailable:
                open_rows = -1
            in_broker = _messages_in_broker(broker)
            unsettled = (
                f"{len(waiting)} callers without a result, {open_rows} dead-letter rows not "
                f"final, {in_broker} task messages in the broker"
            )
            idle = open_rows == 0 and in_broker == 0
            looks = looks + 1 if idle and not waiting else 0
            if looks >= QUIET_LOOKS:
                return set(), ""
            idle_since = (idle_since or time.monotonic()) if idle else None
            if idle_since is not None and time.monotonic() - idle_since > STUCK_S:
                return waiting, f"{unsettled}: nothing in flight for {STUCK_S:.0f}s"
            time.sleep(0.5)
        return waiting, unsettled
    finally:
        dlq.dispose()


def _messages_in_broker(broker: redis.Redis) -> int:
    """Messages of the run's tasks waiting in the queue or delivered and not acknowledged
    (kombu keeps those in the ``unacked`` hash); the sweep's own messages do not count."""
    try:
        raw = list(broker.lrange(QUEUE, 0, -1)) + list(broker.hvals("unacked"))
    except redis.RedisError:
        return -1
    count = 0
    for item in raw:
        try:
            payload = json.loads(item)
            message = payload[0] if isinstance(payload, list) else payload
            task = message["headers"]["task"]
        except (ValueError, KeyError, IndexError, TypeError):
            count += 1
            continue
        count += task.startswith("chaos.")
    return count


def _dead_letter_rows(url: str) -> list[Any]:
    from idempotent_tasks.dlq import DeadLetterQueue

    dlq = DeadLetterQueue(url)
    try:
        return dlq.items(limit=1_000_000)
    finally:
        dlq.dispose()


if __name__ == "__main__":
    sys.exit(main())
