"""The audit of a chaos run: the invariants, checked from the side ledger, and the report.

Invariants (a run fails if any does not hold):

1. No key's body *completed* twice (two executions whose completion the product accepted).
2. Every key whose body *started* twice (a start while an earlier execution of the key had
   neither failed nor released it) is explained by a crash of the earlier owner: its worker or
   pool process SIGKILLed, the process frozen past its lease, or its lease lapsed while the
   store restarted (the heartbeat could not renew it; the product then refuses its completion).
3. No key was lost: each one called ended completed or in the dead-letter table.
4. No dead-letter row was re-published twice: at most ``retry_count + 1`` re-publications per
   row, never two for the same retry while the first could still run (a second one after
   ``idempotency_dlq_retrying_timeout`` is the documented recovery of a row whose sweep died or
   whose message never ran: noted, not a violation).
5. Every caller of a key got the same value: the completed execution's value, or, for a key in
   the dead-letter table, an error. A caller whose ``.get()`` got nothing breaks it too.

Each broken invariant becomes a :class:`Finding` with its evidence: the key's executions from
the ledger, its dead-letter rows, its callers, the faults around it and the workers' log lines.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos import DLQ_RETRYING_TIMEOUT_S
from chaos.ledger import Event
from idempotent_tasks.dlq import DeadLetter

#: Findings printed under the report, and worker log lines per finding (all of them, and up
#: to LOG_LINES log lines each, go to violations.txt).
PRINTED_FINDINGS = 6
PRINTED_LOG_LINES = 12
LOG_LINES = 60
#: Seconds of clock slack when ordering events of different processes.
SLACK_S = 0.05
#: Seconds after a body's finish within which its kill may have kept it from writing
#: ``completed`` (the completion write retries while the store is down, up to a lease).
AFTER_FINISH_S = 5.0


@dataclass
class Execution:
    """One run of a task body, as the ledger tells it."""

    exec_id: str
    key: str
    kind: str
    pid: int
    ppid: int
    worker: str
    task_id: str
    retries: int
    dead_letter_id: str | None
    dead_letter_retry: int | None
    started: float
    ended: float | None = None
    end: str | None = None  # "finish" or "fail"; None: it vanished
    value: Any = None
    completed: bool = False
    completed_value: Any = None
    refused: bool = False
    lease_lost: bool = False


@dataclass(frozen=True, kw_only=True)
class Finding:
    """A broken invariant: which check, about what, and the evidence."""

    check: str
    subject: str
    summary: str
    evidence: tuple[str, ...] = ()
    #: Task ids whose worker log lines are evidence too.
    task_ids: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """What the report says about the run besides the audit's counts."""

    store: str
    tasks: int
    seed: int
    workers: int
    concurrency: int
    lease_s: float
    visibility_timeout_s: float
    started: float
    durations: dict[str, float]
    complete: bool
    incomplete_reason: str | None = None
    unsettled: str = ""
    log_dir: Path | None = None


@dataclass
class AuditResult:
    """Everything the report prints."""

    info: RunInfo
    plan_counts: Counter[str] = field(default_factory=Counter)
    mode_counts: Counter[str] = field(default_factory=Counter)
    duplicated_keys: int = 0
    called_keys: int = 0
    how_counts: Counter[str] = field(default_factory=Counter)
    fault_counts: Counter[str] = field(default_factory=Counter)
    executions: int = 0
    completed_keys: int = 0
    completed_after_kill: int = 0
    dead_lettered_keys: int = 0
    row_status: Counter[str] = field(default_factory=Counter)
    completed_twice: list[str] = field(default_factory=list)
    started_twice: dict[str, set[str]] = field(default_factory=dict)
    unexplained: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    #: Keys with a caller whose (last) message no worker received: the broker lost it.
    never_received: list[str] = field(default_factory=list)
    rows: int = 0
    republications: int = 0
    #: Messages the pickup guard published again (lost by the broker, or only slow).
    pickup_republications: int = 0
    rows_republished_twice: list[str] = field(default_factory=list)
    rows_recovered: list[str] = field(default_factory=list)
    callers: int = 0
    duplicate_callers: int = 0
    wrong_callers: list[str] = field(default_factory=list)
    callers_with_other_value: int = 0
    callers_without_value: int = 0
    unexpected_ends: list[str] = field(default_factory=list)
    unexpected_exits: int = 0
    exit_reasons: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    callers_by_key: dict[str, list[Event]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every invariant holds (and the run did all it planned)."""
        return not self.findings and self.info.complete


def audit(events: list[Event], rows: list[DeadLetter], info: RunInfo) -> AuditResult:
    """Check the invariants over a run's ledger ``events`` and dead-letter ``rows``."""
    result = AuditResult(info=info)
    plans = {event.key: event.data for event in events if event.kind == "planned" and event.key}
    callers = [event for event in events if event.kind == "caller"]
    faults = [event.data for event in events if event.kind == "fault"]
    executions = _executions(events)
    by_key: dict[str, list[Execution]] = defaultdict(list)
    for execution in executions.values():
        by_key[execution.key].append(execution)
    for group in by_key.values():
        group.sort(key=lambda execution: execution.started)
    rows_by_key: dict[str, list[DeadLetter]] = defaultdict(list)
    for row in rows:
        rows_by_key[row.idempotency_key or ""].append(row)
    callers_by_key: dict[str, list[Event]] = defaultdict(list)
    for caller in callers:
        callers_by_key[caller.key or ""].append(caller)

    result.faults = faults
    result.callers_by_key = callers_by_key
    result.plan_counts = Counter(str(plan["kind"]) for plan in plans.values())
    result.mode_counts = Counter(
        str(plan["mode"]) for plan in plans.values() if plan["mode"] != "single"
    )
    result.duplicated_keys = sum(1 for plan in plans.values() if int(plan["calls"]) > 1)
    result.fault_counts = Counter(str(fault["fault"]) for fault in faults)
    result.unexpected_exits = result.fault_counts.pop("worker_exited", 0)
    result.exit_reasons = [
        str(fault.get("reason", "")) for fault in faults if fault["fault"] == "worker_exited"
    ]
    result.executions = len(executions)
    result.how_counts = Counter(str(caller.data["how"]) for caller in callers)
    result.callers = len(callers)
    result.called_keys = len(callers_by_key)
    result.rows = len(rows)
    result.row_status = Counter(row.status.value for row in rows)

    for key in sorted(callers_by_key):
        group = by_key.get(key, [])
        value, how = _key_value(group, faults)
        if len([execution for execution in group if execution.completed]) > 1:
            result.completed_twice.append(key)
            _find(result, "completed twice", key, "the body completed twice", group, rows_by_key)
        if how is not None:
            result.completed_keys += 1
            result.completed_after_kill += how == "killed after finishing"
        elif rows_by_key.get(key):
            result.dead_lettered_keys += 1
        else:
            result.lost.append(key)
            _find(result, "lost", key, "neither completed nor dead-lettered", group, rows_by_key)
        kind = str(plans.get(key, {}).get("kind", "?"))
        if key not in result.lost and (kind == "doomed") != (how is None):
            result.unexpected_ends.append(key)
        _check_restarts(result, key, group, faults, info.store, rows_by_key)
        _check_callers(result, key, callers_by_key[key], value, how, group, rows_by_key)

    _check_republications(result, events, rows, executions.values())
    timed_out = {
        str(caller.data.get("task_id")): caller.key or ""
        for caller in callers
        if caller.data.get("outcome") == "timeout"
    }
    vanished = _messages_lost(info.log_dir, set(timed_out))
    result.never_received = sorted({timed_out[task_id] for task_id in vanished})
    return result


def _messages_lost(log_dir: Path | None, task_ids: set[str]) -> set[str]:
    """Those of ``task_ids`` whose last message no worker received: no worker log names the
    task, or the last line that does says it was re-published (``retry: Retry in``)."""
    if log_dir is None or not task_ids:
        return set()
    last: dict[str, tuple[str, str]] = {}
    for path in sorted(log_dir.glob("*.log")):
        with path.open(errors="replace") as log:
            for line in log:
                if "[" not in line or "]" not in line:
                    continue
                task_id = line.rsplit("[", 1)[-1].split("]", 1)[0]
                if task_id in task_ids:
                    moment = line[1:24]  # "[2026-11-22 20:41:29,738: ..."
                    if task_id not in last or moment >= last[task_id][0]:
                        last[task_id] = (moment, line)
    return {
        task_id
        for task_id in task_ids
        if task_id not in last or "retry: Retry in" in last[task_id][1]
    }


# -- building executions ----------------------------------------------------------------------


def _executions(events: Iterable[Event]) -> dict[str, Execution]:
    executions: dict[str, Execution] = {}
    for event in events:
        if event.kind == "start" and event.exec_id and event.key:
            data = event.data
            executions[event.exec_id] = Execution(
                exec_id=event.exec_id,
                key=event.key,
                kind=str(data.get("kind")),
                pid=event.pid,
                ppid=int(data.get("ppid") or 0),
                worker=str(data.get("worker")),
                task_id=str(data.get("task_id")),
                retries=int(data.get("retries") or 0),
                dead_letter_id=data.get("dead_letter_id"),
                dead_letter_retry=data.get("dead_letter_retry"),
                started=event.ts,
            )
            continue
        execution = executions.get(event.exec_id or "")
        if execution is None:
            continue
        if event.kind in ("finish", "fail"):
            execution.end, execution.ended = event.kind, event.ts
            execution.value = event.data.get("value")
        elif event.kind == "completed":
            execution.completed, execution.completed_value = True, event.data.get("value")
        elif event.kind == "refused":
            execution.refused = True
        elif event.kind == "lease_lost":
            execution.lease_lost = True
    return executions


def _key_value(group: list[Execution], faults: list[dict[str, Any]]) -> tuple[Any, str | None]:
    """The value a key completed with, and how the ledger knows (``None``: not completed).

    A ``completed`` entry confirms it. An execution that finished, was not refused and whose
    process was killed right after (before it could write ``completed``) may have completed the
    key too, if the kill fell between the product's completion write and the ledger's: the
    callers' values then tell.
    """
    for execution in group:
        if execution.completed:
            return execution.completed_value, "completed"
    for execution in reversed(group):
        if execution.end == "finish" and not execution.refused and execution.ended is not None:
            if _killed_in(execution, execution.ended, execution.ended + AFTER_FINISH_S, faults):
                return execution.value, "killed after finishing"
    return None, None


# -- invariant 2: second starts, explained --------------------------------------------------


def _check_restarts(
    result: AuditResult,
    key: str,
    group: list[Execution],
    faults: list[dict[str, Any]],
    store: str,
    rows_by_key: dict[str, list[DeadLetter]],
) -> None:
    reasons: set[str] = set()
    unexplained: list[str] = []
    for index, later in enumerate(group):
        for earlier in group[:index]:
            if earlier.end == "fail" and (earlier.ended or 0) <= later.started + SLACK_S:
                continue  # a failed attempt released the key: a retry, not a second start
            reason = _explain(earlier, later, faults, store)
            if reason is None:
                unexplained.append(
                    f"execution {earlier.exec_id[:8]} (pid {earlier.pid}) had not failed when "
                    f"{later.exec_id[:8]} (pid {later.pid}) started"
                )
            else:
                reasons.add(reason)
    if not reasons and not unexplained:
        return
    result.started_twice[key] = reasons
    if unexplained:
        result.unexplained.append(key)
        _find(
            result,
            "started twice, unexplained",
            key,
            "; ".join(unexplained[:3]),
            group,
            rows_by_key,
        )


def _explain(
    earlier: Execution, later: Execution, faults: list[dict[str, Any]], store: str
) -> str | None:
    """Why ``later`` could start while ``earlier`` had not failed, if a fault says so."""
    if earlier.completed and earlier.ended is not None and earlier.ended <= later.started:
        return None  # a key whose completion was accepted must never start again
    # A dead process writes nothing: the kill fell after its last entry (a finished body may
    # die before its completion is written, so a little after its finish).
    if earlier.end is None:
        kill = _killed_in(earlier, earlier.started, later.started, faults)
    elif earlier.end == "finish" and earlier.ended is not None:
        upper = min(later.started, earlier.ended + AFTER_FINISH_S)
        kill = _killed_in(earlier, earlier.ended, upper, faults)
    else:
        kill = None
    if kill is not None:
        return kill
    until = later.started + SLACK_S
    for fault in faults:
        if fault["fault"] == "freeze_child" and fault["pid"] == earlier.pid:
            if fault["frozen_at"] <= until and fault["thawed_at"] >= earlier.started:
                return "frozen past its lease"
    store_fault = "restart_redis" if store == "redis" else "restart_postgres"
    if earlier.lease_lost or earlier.refused:
        for fault in faults:
            if fault["fault"] == store_fault and fault["down_from"] <= until:
                if fault["down_until"] >= earlier.started - SLACK_S:
                    return "lease lapsed while the store restarted"
    return None


def _killed_in(
    execution: Execution, since: float, until: float, faults: list[dict[str, Any]]
) -> str | None:
    """How ``execution``'s process (or its worker) was killed within ``[since, until]``."""
    for fault in faults:
        kind = fault["fault"]
        if kind == "kill_worker":
            hit = execution.ppid == fault["pid"] or execution.pid in fault["children"]
            label = "worker SIGKILLed"
        elif kind == "kill_child":
            hit, label = execution.pid == fault["pid"], "pool process SIGKILLed"
        elif kind == "worker_exited":
            hit, label = execution.ppid == fault["pid"], "worker exited by itself"
        else:
            continue
        if hit and since - SLACK_S <= fault["killed_at"] <= until + SLACK_S:
            return str(label)
    return None


# -- invariant 4: dead-letter re-publications -----------------------------------------------


def _check_republications(
    result: AuditResult,
    events: list[Event],
    rows: list[DeadLetter],
    executions: Iterable[Execution],
) -> None:
    by_row: dict[str, list[Event]] = defaultdict(list)
    for event in events:
        if event.kind == "pickup_republished":
            result.pickup_republications += 1
        if event.kind == "republished":
            by_row[str(event.data["row"])].append(event)
    rounds_run: dict[str, set[int]] = defaultdict(set)
    for execution in executions:
        if execution.dead_letter_id and execution.dead_letter_retry is not None:
            rounds_run[execution.dead_letter_id].add(int(execution.dead_letter_retry))
    result.republications = sum(len(published) for published in by_row.values())
    known = {row.id: row for row in rows}
    for row_id, published in sorted(by_row.items()):
        row = known.get(row_id)
        problems = []
        if row is None:
            problems.append("re-published, but the row is gone")
        else:
            if len(published) > row.retry_count + 1:
                problems.append(
                    f"re-published {len(published)} times with retry_count {row.retry_count}"
                )
            if len(rounds_run[row_id]) > row.retry_count + 1:
                problems.append(
                    f"ran in {len(rounds_run[row_id])} rounds with retry_count {row.retry_count}"
                )
        per_retry: dict[int, list[float]] = defaultdict(list)
        for event in published:
            if event.data.get("retry_count") is not None and event.data.get("row_status") == (
                "retrying"
            ):
                per_retry[int(event.data["retry_count"])].append(event.ts)
        for retry, moments in sorted(per_retry.items()):
            for first, second in itertools.pairwise(moments):
                if second - first < DLQ_RETRYING_TIMEOUT_S - SLACK_S:
                    problems.append(
                        f"re-published twice for retry {retry}, {second - first:.1f}s apart"
                    )
                else:
                    # The documented recovery of a row left ``retrying`` (its sweep died, or
                    # its message never ran): not concurrent, but worth telling.
                    result.rows_recovered.append(row_id)
        if problems:
            result.rows_republished_twice.append(row_id)
            evidence = [_event_line(event, published[0].ts) for event in published]
            result.findings.append(
                Finding(
                    check="re-published twice",
                    subject=f"dead-letter row {row_id} (key {published[0].key})",
                    summary="; ".join(problems),
                    evidence=tuple(evidence + ([_row_line(row)] if row else [])),
                    task_ids=(row.task_id,) if row else (),
                )
            )


# -- invariant 5: callers -------------------------------------------------------------------


def _check_callers(
    result: AuditResult,
    key: str,
    callers: list[Event],
    value: Any,
    how: str | None,
    group: list[Execution],
    rows_by_key: dict[str, list[DeadLetter]],
) -> None:
    if len(callers) > 1:
        result.duplicate_callers += len(callers)
    expected = _canonical(value) if how is not None else None
    wrong = []
    for caller in callers:
        outcome, got = caller.data.get("outcome"), caller.data.get("value")
        if outcome == "timeout":
            result.callers_without_value += 1
            wrong.append(f"caller {caller.data['index']} got nothing: {got}")
        elif how is not None and (outcome != "value" or _canonical(got) != expected):
            result.callers_with_other_value += 1
            wrong.append(f"caller {caller.data['index']} got {outcome} {got!r}")
        elif how is None and outcome != "error":
            result.callers_with_other_value += 1
            wrong.append(f"caller {caller.data['index']} got {outcome} {got!r}, not an error")
    if wrong:
        result.wrong_callers.append(key)
        summary = f"expected {value!r}" if how is not None else "expected an error"
        _find(
            result,
            "caller got another value",
            key,
            f"{summary}; " + "; ".join(wrong[:4]),
            group,
            rows_by_key,
            callers,
        )


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


# -- findings and the report ----------------------------------------------------------------


def _find(
    result: AuditResult,
    check: str,
    key: str,
    summary: str,
    group: list[Execution],
    rows_by_key: dict[str, list[DeadLetter]],
    callers: list[Event] | None = None,
) -> None:
    callers = result.callers_by_key.get(key, []) if callers is None else callers
    moments = [execution.started for execution in group] + [caller.ts for caller in callers]
    origin = min(moments, default=0.0)
    evidence = [_execution_line(execution, origin) for execution in group]
    evidence += [_row_line(row) for row in rows_by_key.get(key, [])]
    evidence += [_caller_line(caller, origin) for caller in sorted(callers, key=lambda c: c.ts)]
    # The faults around the key's life: from a second before its first call or start to five
    # seconds after its last start or end.
    ends = [execution.ended or execution.started for execution in group] + moments
    since, until = origin - 1.0, max(ends, default=origin) + 5.0
    evidence += [
        _fault_line(fault, origin)
        for fault in result.faults
        if since <= float(fault.get("at", 0)) <= until
    ]
    task_ids = {execution.task_id for execution in group}
    task_ids |= {str(caller.data.get("task_id")) for caller in callers}
    result.findings.append(
        Finding(
            check=check,
            subject=f"key {key}",
            summary=summary,
            evidence=tuple(evidence),
            task_ids=tuple(sorted(task_ids)),
        )
    )


def _caller_line(caller: Event, origin: float) -> str:
    data = caller.data
    return (
        f"caller {data.get('index')} called at +{caller.ts - origin:.3f}s ({data.get('how')}, "
        f"task {data.get('task_id')}): {data.get('outcome')} {data.get('value')!r}"
    )


def _fault_line(fault: dict[str, Any], origin: float) -> str:
    details = {
        name: value
        for name, value in fault.items()
        if name not in ("fault", "at", "until") and not isinstance(value, float)
    }
    return (
        f"fault {fault['fault']} from +{float(fault['at']) - origin:.3f}s to "
        f"+{float(fault['until']) - origin:.3f}s {details}"
    )


def _execution_line(execution: Execution, origin: float) -> str:
    end = "vanished"
    if execution.end is not None and execution.ended is not None:
        end = f"{execution.end} at +{execution.ended - origin:.3f}s"
    flags = [
        name
        for name, on in (
            ("completed", execution.completed),
            ("refused", execution.refused),
            ("lease_lost", execution.lease_lost),
        )
        if on
    ]
    return (
        f"exec {execution.exec_id[:8]} start +{execution.started - origin:.3f}s {end} "
        f"pid {execution.pid} (worker pid {execution.ppid}, {execution.worker}) "
        f"task {execution.task_id} retries {execution.retries}"
        + (
            f" dead letter {execution.dead_letter_id}#{execution.dead_letter_retry}"
            if execution.dead_letter_id
            else ""
        )
        + (f" [{', '.join(flags)}]" if flags else "")
        + (f" value {execution.value}" if execution.end == "finish" else "")
    )


def _row_line(row: DeadLetter) -> str:
    return (
        f"dead-letter row {row.id}: task {row.task_id} {row.status.value} "
        f"retry {row.retry_count}/{row.max_retries} {row.error_type}"
    )


def _event_line(event: Event, origin: float) -> str:
    return f"{event.kind} +{event.ts - origin:.3f}s pid {event.pid} {event.data}"


def log_lines(log_dir: Path | None, needles: list[str], limit: int = 20) -> list[str]:
    """Lines of the workers' logs that mention any of ``needles`` (task ids, keys)."""
    if log_dir is None or not needles:
        return []
    found = []
    for path in sorted(log_dir.glob("*.log")):
        with path.open(errors="replace") as log:
            for line in log:
                if any(needle in line for needle in needles):
                    found.append(f"{path.name}: {line.rstrip()[:300]}")
                    if len(found) >= limit:
                        return found
    return found


def _keys(count: int) -> str:
    return _plural(count, "key")


def _plural(count: int, one: str, many: str | None = None) -> str:
    return f"{count} {one if count == 1 else (many or one + 's')}"


FAULT_TITLES = {
    "kill_worker": ("worker SIGKILLed", "workers SIGKILLed"),
    "kill_child": ("pool process SIGKILLed", "pool processes SIGKILLed"),
    "freeze_child": ("pool process frozen past the lease", "pool processes frozen past the lease"),
    "restart_redis": ("Redis restart", "Redis restarts"),
    "restart_postgres": ("PostgreSQL restart", "PostgreSQL restarts"),
}


def report(result: AuditResult) -> str:
    """The one-screen report."""
    info = result.info
    plan = result.plan_counts
    lines = [
        f"chaos run, {info.store} store: {info.tasks} keys (seed {info.seed}), "
        f"{info.workers} prefork workers x {info.concurrency} + beat, lease {info.lease_s:g}s, "
        f"visibility timeout {info.visibility_timeout_s:g}s",
        f"  keys: {plan['fast']} fast, {plan['slow']} slow (3-5s), {plan['flaky']} flaky "
        f"(fail 1-2 times), {plan['doomed']} always failing; {result.duplicated_keys} called "
        f"2-5 times ({result.mode_counts['at_once']} all at once, {result.mode_counts['after']} "
        f"after completion, {result.mode_counts['mixed']} both)",
        f"  calls: {result.callers} ({result.how_counts['published']} published, "
        f"{result.how_counts['cached']} answered from the cache, {result.how_counts['joined']} "
        f"joined a running owner; {result.pickup_republications} unclaimed messages published "
        "again by the pickup guard)",
        "  faults: "
        + (
            ", ".join(
                _plural(count, *FAULT_TITLES.get(kind, (kind, kind)))
                for kind, count in sorted(result.fault_counts.items())
            )
            or "none"
        ),
        f"  body starts: {result.executions}; keys completed {result.completed_keys}, "
        f"dead-lettered {result.dead_lettered_keys} ({_plural(result.rows, 'row')}: "
        + (
            ", ".join(f"{count} {status}" for status, count in sorted(result.row_status.items()))
            or "none"
        )
        + ")",
        "  time: "
        + ", ".join(f"{name} {seconds:.0f}s" for name, seconds in info.durations.items()),
        "invariants",
        f"  {_keys(len(result.completed_twice))} whose body completed twice",
    ]
    reasons = Counter(reason for found in result.started_twice.values() for reason in found)
    explained = ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items()))
    if result.unexplained:
        lines.append(
            f"  {_keys(len(result.started_twice))} whose body started twice; "
            f"{len(result.unexplained)} of them NOT explained by a crash of its owner"
        )
    else:
        lines.append(
            f"  {_keys(len(result.started_twice))} whose body started twice, each explained by "
            f"a crash of its owner" + (f" ({explained})" if explained else "")
        )
    twice = f"  {_plural(len(result.rows_republished_twice), 'dead-letter row')} re-published twice"
    if not result.rows_republished_twice:
        twice += (
            f" ({result.rows} rows re-published {result.republications} times; none more than "
            "retry_count + 1 times, none twice for one retry)"
        )
    lines += [
        f"  {_keys(len(result.lost))} lost (neither completed nor in the dead-letter table)",
        twice,
        f"  {_keys(len(result.wrong_callers))} whose callers got another value "
        f"({result.callers} callers of {result.called_keys} keys, {result.duplicate_callers} "
        f"of them calling a key called 2-5 times"
        + (
            f"; {result.callers_with_other_value} got another value or an error, "
            f"{result.callers_without_value} got nothing"
            if result.wrong_callers
            else ""
        )
        + ")",
    ]
    notes = []
    if result.never_received:
        notes.append(
            f"{_keys(len(result.never_received))} had a caller whose message (or its last "
            f"re-publication) no worker received: the broker lost it (e.g. "
            f"{result.never_received[0]})"
        )
    if result.completed_after_kill:
        notes.append(
            f"{_keys(result.completed_after_kill)} completed by an owner killed right after its "
            "body finished (callers got its value)"
        )
    if result.unexpected_ends:
        notes.append(
            f"{_keys(len(result.unexpected_ends))} ended otherwise than planned: completed though "
            "always failing, or dead-lettered though meant to succeed "
            f"(e.g. {result.unexpected_ends[0]})"
        )
    if result.rows_recovered:
        notes.append(
            f"{_plural(len(set(result.rows_recovered)), 'dead-letter row')} re-published again "
            f"after the retrying timeout ({DLQ_RETRYING_TIMEOUT_S:g}s), the earlier "
            f"re-publication having never run (e.g. row {result.rows_recovered[0]})"
        )
    if result.unexpected_exits:
        notes.append(
            f"{_plural(result.unexpected_exits, 'worker')} exited without being killed by the run "
            "and replaced: " + "; ".join(sorted(set(result.exit_reasons)))[:300]
        )
    if info.unsettled:
        notes.append(f"settling ended with {info.unsettled}")
    lines += [f"note: {note}" for note in notes]
    if not info.complete:
        lines.append(f"INCOMPLETE: {info.incomplete_reason}")
    if result.findings:
        checks = sorted({finding.check for finding in result.findings})
        lines.append(f"FAILED: {', '.join(checks)}")
    elif info.complete:
        lines.append("OK: every invariant holds")
    return "\n".join(lines)


def findings_text(result: AuditResult, limit: int | None = PRINTED_FINDINGS) -> str:
    """The findings with their evidence (ledger entries, rows, faults, worker log lines)."""
    shown = result.findings if limit is None else result.findings[:limit]
    blocks = []
    for finding in shown:
        block = [f"[{finding.check}] {finding.subject}: {finding.summary}"]
        block += [f"    {line}" for line in finding.evidence]
        logged = log_lines(result.info.log_dir, list(finding.task_ids), limit=LOG_LINES)
        shown_lines = logged if limit is None else logged[:PRINTED_LOG_LINES]
        block += [f"    log {line}" for line in shown_lines]
        if len(shown_lines) < len(logged):
            block.append(
                f"    log ... {len(logged) - len(shown_lines)} more lines in violations.txt"
            )
        block += [
            f"    task {task_id}: no worker log line names it (no worker received it)"
            for task_id in finding.task_ids
            if result.info.log_dir is not None
            and not any(task_id in line for line in logged)
            and len(logged) < LOG_LINES
        ]
        blocks.append("\n".join(block))
    if limit is not None and len(result.findings) > limit:
        blocks.append(f"... and {len(result.findings) - limit} more findings in violations.txt")
    return "\n".join(blocks)
