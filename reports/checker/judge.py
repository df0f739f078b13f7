"""Judging a loaded history: the frame, the explanations (once), then each anomaly of the
table in turn. A rule that raises makes its own answer unknown, not the whole check. Then
what the history cannot decide (unknown reasons) and the run's descriptive details."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd

from skiplock.reports.checker.anomalies import ANOMALIES, Anomaly, lost, state_mismatch
from skiplock.reports.checker.common import (
    MAX_EXAMPLES,
    Example,
    attempt_label,
    fmt,
    objects,
    records,
    times_from,
)
from skiplock.reports.checker.excuses import Excuses
from skiplock.reports.checker.frame import Frame, build
from skiplock.reports.checker.join import History
from skiplock.reports.checker.slots import account_slots
from skiplock.reports.history import FINAL_JOBS_FILE

DESCRIPTIVE_COUNTS: tuple[str, ...] = ("enqueued", "delivered", "completed", "failed")


@dataclass
class Findings:
    counts: dict[str, int]
    examples: dict[str, list[dict[str, Any]]]
    unknown: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


def judge(h: History, tolerance: float) -> Findings:
    with times_from(h.config.time_origin):
        found = _judge(h, tolerance)
    if h.config.time_origin is not None:
        started = datetime.fromtimestamp(h.config.time_origin, UTC)
        found.details["times"] = {
            "load_started": started.isoformat(timespec="milliseconds"),
            "load_started_epoch": h.config.time_origin,
            "examples_say": "seconds since the load started, as the report's plots count",
        }
    return found


def _judge(h: History, tolerance: float) -> Findings:
    frame = build(h, tolerance)
    excuses = Excuses(frame)
    found = Findings(counts=_descriptive_counts(frame), examples={})
    found.unknown.extend(_unknown_state(frame, excuses))
    failed_rules: dict[str, str] = {}
    not_applicable: dict[str, str] = {}
    for anomaly in ANOMALIES:
        reason = anomaly.not_applicable(h.config.guarantees)
        if reason is not None:
            # A promise the queue does not make is not judged: counted as 0, listed as not
            # applicable with the reason, never reported as kept.
            not_applicable[anomaly.kind] = reason
            found.counts[anomaly.kind] = 0
            found.examples[anomaly.kind] = []
            continue
        try:
            count, shown = _apply(anomaly, frame, excuses)
        except Exception as exc:
            failed_rules[anomaly.kind] = f"{type(exc).__name__}: {exc}"
            count, shown = 0, []
        found.counts[anomaly.kind] = count
        found.examples[anomaly.kind] = shown
    for kind, error in failed_rules.items():
        found.unknown.append(f"the {kind} check failed ({error}): its answer is unknown")
    if failed_rules:
        found.details["rules_failed"] = failed_rules
    if not_applicable:
        found.details["not_applicable"] = not_applicable
    found.unknown.extend(_unknown_history(frame, found.details))
    found.details.update(_details(frame, excuses))
    return found


def _apply(anomaly: Anomaly, frame: Frame, excuses: Excuses
           ) -> tuple[int, list[dict[str, Any]]]:
    """How many times the anomaly occurs, and its first examples as the verdict shows them:
    the job, the sentence, and the evidence it was said from."""
    count = 0
    kept: list[Example] = []
    for example in anomaly.find(frame, excuses):
        count += 1
        if len(kept) < MAX_EXAMPLES:
            kept.append(example)
    return count, [{"job_id": x.job_id, "why": anomaly.say(x), "case": x.case,
                    "evidence": x.evidence} for x in kept]


def _descriptive_counts(f: Frame) -> dict[str, int]:
    return {
        "enqueued": int((f.h.job_ack == 1).sum()),
        "delivered": len(f.h.deliveries),
        "completed": f.jobs.completed_rows,
        "failed": f.jobs.failed_rows,
    }


def _unknown_state(f: Frame, e: Excuses) -> list[str]:
    """What the final states and the drain leave undecided."""
    jobs, cfg = f.jobs, f.cfg
    unknown: list[str] = []
    if jobs.snapshot_complete is False:
        unknown.append(f"final snapshot incomplete: run.json says {cfg.final_jobs} rows, "
                       f"{FINAL_JOBS_FILE} has {len(f.h.final)}")
    for rec in records(jobs.never_enqueued.head(MAX_EXAMPLES)):
        unknown.append(f"final state for job {rec['job_id']}, which was never enqueued")
    live = int((jobs.is_live & jobs.exists).sum())
    if not cfg.drained and live:
        unknown.append(f"the drain timed out with {live} jobs still live")
    unseen = np.flatnonzero(lost.candidates(f) & jobs.is_missing)
    e.explainer.prefetch(unseen.tolist())
    absent = sum(1 for j in unseen.tolist()
                 if e.absence_unjudged(j))
    if not jobs.snapshot_complete:
        absent += int(state_mismatch.absent_with_2xx(f).sum())
    if absent:
        unknown.append(f"{absent} acknowledged jobs have no row in {FINAL_JOBS_FILE} "
                       "and the snapshot is not known to be whole")
    if e.unreached:
        shown = ", ".join(f.job_id(j) for j in list(e.unreached)[:3])
        unknown.append(f"{len(e.unreached)} jobs dead-lettered after attempts that never "
                       "reached the target (the worker logged a timeout or connection error, "
                       "the target no delivery): the history cannot say whether the queue or "
                       f"the network lost them; examples: {shown}")
    return unknown


def _unknown_history(f: Frame, details: dict[str, Any]) -> list[str]:
    """What the history as a whole cannot show."""
    h = f.h
    unknown: list[str] = []
    if len(h.job_ids) == 0:
        unknown.append("no job was enqueued: there is nothing to judge")
    # Every worker the target saw must have left its event log, or its faults are unknown.
    silent = sorted(set(h.deliveries["worker"].dropna().unique().tolist())
                    - set(h.events["worker"].dropna().unique().tolist()))
    if silent and len(h.events):
        shown = ", ".join(map(str, silent[:5])) + (" ..." if len(silent) > 5 else "")
        unknown.append(f"no worker event log for {shown}, though the target saw its "
                       "deliveries")
        details["workers_without_log"] = len(silent)
    stopped = stopped_on_error(h)
    if stopped:
        first = stopped[0]
        unknown.append(
            f"{len(stopped)} worker{'s' if len(stopped) > 1 else ''} stopped on an error, so "
            "the history cannot show what the queue did with what they held; first, "
            f"{first['worker']} at {fmt(first['time'])}: {first['reason']}")
        details["workers_stopped_on_error"] = {"count": len(stopped), "examples": [
            {"worker": r["worker"], "time": r["time"], "why": r["reason"]}
            for r in stopped[:MAX_EXAMPLES]]}
    failing, failed_calls = never_succeeded(h)
    unknown.extend(failing)
    if failed_calls:
        details["failed_calls"] = failed_calls
    return unknown


def _details(f: Frame, e: Excuses) -> dict[str, Any]:
    h, jobs = f.h, f.jobs
    details: dict[str, Any] = {}
    slots = f.derived(account_slots)
    if len(slots.excused):
        details["limit_excused"] = {"count": len(slots.excused), "examples": [
            {"job_id": f.job_id(int(f.rows.job[r])),
             "why": f"delivered at {fmt(f.rows.received[r])}, after the lease of attempt "
                    f"{attempt_label(f.rows.attempt[r])} had run out: it held no slot"}
            for r in slots.excused[:MAX_EXAMPLES].tolist()]}
    if e.unreached:
        details["unreached_dead_letters"] = {"count": len(e.unreached), "examples": [
            {"job_id": f.job_id(j),
             "why": f"FAILED after {int(jobs.delivered[j])} deliveries; "
                    f"attempt{'s' if len(attempts) > 1 else ''} "
                    f"{', '.join(map(str, attempts))} of "
                    f"{h.job_max_attempts[j]} never reached the target"}
            for j, attempts in list(e.unreached.items())[:MAX_EXAMPLES]]}
    details.update({
        "enqueue_invoked": len(h.job_ids),
        "enqueue_unknown": int((h.job_ack == 0).sum()),
        "enqueue_failed": int((h.job_ack == -1).sum()),
        "jobs_live": int((jobs.is_live & jobs.exists).sum()),
        "faults": len(h.faults),
        "faults_skipped": sum(1 for f_ in h.faults if f_.get("skipped")),
        "worker_events": len(h.events),
        "distinct_oracles": f.oracle.count,
    })
    return details


def stopped_on_error(h: History) -> list[dict[str, Any]]:
    """The `stop` events whose reason is an error (a worker loop that raised: a library's
    consumer that gave up on its connection), in time order."""
    ev = h.events
    rows = np.flatnonzero((ev["kind"] == "stop").to_numpy())
    if not len(rows):
        return []
    reasons = h.event_data.field("reason", ev.index.to_numpy()[rows])
    workers, times = objects(ev["worker"])[rows], ev["time"].to_numpy()[rows]
    found = [{"worker": str(worker), "time": float(time), "reason": reason}
             for worker, time, reason in zip(workers.tolist(), times.tolist(), reasons.tolist(),
                                             strict=True)
             if isinstance(reason, str) and reason.startswith("error")]
    return sorted(found, key=lambda r: r["time"])


def never_succeeded(h: History) -> tuple[list[str], dict[str, int]]:
    """Calls to the queue that failed (`error` events) and never once succeeded, so the
    history cannot show that the queue did that part of its job: recovery (no `recover`
    event anywhere), claims (failed in every worker, no `claim` event anywhere) and result
    writes (no write applied or fenced anywhere). A few failures among successes, as under
    database faults, are not a reason. Returns the unknown reasons and the failed calls by
    operation."""
    ev = h.events
    rows = np.flatnonzero((ev["kind"] == "error").to_numpy())
    if not len(rows):
        return [], {}
    failed = pd.DataFrame({
        "op": h.event_data.field("op", rows),
        "error": h.event_data.field("error", rows),
        "worker": objects(ev["worker"])[rows],
        "time": ev["time"].to_numpy()[rows],
    }).sort_values("time", kind="stable")
    kinds = ev["kind"]
    writes = (kinds == "write") & ev["result"].isin(["applied", "fenced"])
    workers = set(ev["worker"].dropna().unique().tolist())
    reasons: list[str] = []
    for op, what, succeeded, everywhere in (
        ("recover", "recovery", bool((kinds == "recover").any()), False),
        ("claim", "claims", bool((kinds == "claim").any()), True),
        ("finish", "result writes", bool(writes.any()), False),
    ):
        mine = failed[failed["op"] == op]
        if not len(mine) or succeeded:
            continue
        failing = set(mine["worker"].dropna().unique().tolist())
        if everywhere and failing != workers:
            continue
        first = records(mine.head(1))[0]
        reasons.append(
            f"{what} failed {len(mine)} time{'s' if len(mine) > 1 else ''} in "
            f"{len(failing)} worker{'s' if len(failing) != 1 else ''} and never succeeded "
            f"(the history cannot show that {_NEVER_RAN[op]}); first error, "
            f"{first['worker']} at {fmt(first['time'])}: {first['error']}")
    counts = failed["op"].fillna("unnamed").value_counts()
    return reasons, {str(k): int(v) for k, v in counts.items()}


_NEVER_RAN = {
    "recover": "expired leases were ever recovered",
    "claim": "any job was claimed",
    "finish": "any result was written",
}
