"""The checker: judge a run directory from its history alone and write `verdict.json`.

Reading. The first run directory must hold `spec.json`, `run.json`, `enqueues.csv`,
`final_jobs.csv`, a `deliveries/` directory and a `workers/` directory; `nemesis.jsonl` is
optional (absent or empty: no fault ran). Further directories add their `deliveries/*.csv`,
`workers/*.csv` and `nemesis.jsonl` (targets and workers on other machines), and may hold an
`enqueues.csv` (producers on other machines). The CSV logs are read by their header's column
names (`skiplock.reports.history`): columns the checker does not read are ignored. A history that
cannot be trusted is never judged: it is bad input (`HistoryError`, one line naming the file,
and the line where there is one) when a directory is given twice (or one log through two
paths), a file is missing, unreadable or not a regular file, no directory holds a delivery
log, a line is malformed (a wrong number of fields, a number column that holds something
else, an infinite number or a negative time, JSON that is not an object in nemesis.jsonl),
a complete line holds a NUL byte, the first line is no header, a header lacks a column the
checker needs, a record lacks its required values, or run.json's settings have the wrong
type or are not finite. A log cut off mid-line (or empty, so cut off before its header) is
judged on its whole lines and makes the answer "unknown", and the violations its lost tail
may have caused are counted but not reported (`_CUT_MAY_CAUSE`). When run.json records
`final_jobs` (the rows the runner's snapshot had) and `final_jobs.csv` holds a different
number, the answer is "unknown"; an acknowledged job with no final row is a state mismatch
when the snapshot is known to be whole, else it makes the answer "unknown".

Judging. Each job's oracle (`skiplock.reports.oracle`) comes from its enqueue (script, max_attempts,
account) and the run's configuration; the target's log says what was really delivered. The
whole-run checks are vectorised with pandas; the few suspicious rows they find are then
explained or not, one by one, against the recorded events (worker events and faults). A
job dead-lettered because attempts never reached the target (its worker recorded a timeout or
connection error, the target no delivery of that attempt) is neither valid nor a violation:
the worker is part of the system under test, so its word settles nothing, and the answer is
"unknown" unless something else is violated.

Timing tolerance: the target, the workers and the nemesis share one clock, but a worker logs
an event a little after it happened, so time comparisons allow `tolerance_seconds`. Leases
are the configured `lease_seconds` from the worker's claim or renewal, never the lease end
the queue reported.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from skiplock.reports import columnar
from skiplock.reports.checker.anomalies import ANOMALIES, BY_KIND
from skiplock.reports.checker.common import DEFAULT_TOLERANCE_SECONDS, MAX_EXAMPLES
from skiplock.reports.checker.join import History
from skiplock.reports.checker.judge import DESCRIPTIVE_COUNTS, Findings, judge
from skiplock.reports.checker.load import read_history
from skiplock.reports.checker.run_config import RunConfig
from skiplock.reports.history import (
    DELIVERIES_DIR,
    ENQUEUES_FILE,
    FINAL_JOBS_FILE,
    NEMESIS_FILE,
    VERDICT_FILE,
    WORKERS_DIR,
    HistoryError,
    write_json,
)

COUNT_KEYS: tuple[str, ...] = (*DESCRIPTIVE_COUNTS, *(a.kind for a in ANOMALIES))
# Counts that are a violated guarantee when non-zero; the rest describe the run.
VIOLATION_KEYS: tuple[str, ...] = tuple(a.kind for a in ANOMALIES if a.violation)
EXAMPLE_KINDS: tuple[str, ...] = (*VIOLATION_KEYS,
                                  *(a.kind for a in ANOMALIES if not a.violation))
# Each anomaly in a line (the README's table says it in full; a test holds the two to the
# same names). The report shows these next to the counts.
MEANINGS: dict[str, str] = {a.kind: a.meaning for a in ANOMALIES}

Valid = bool | Literal["unknown"]



@dataclass(frozen=True, kw_only=True)
class Verdict:
    """The answer for one run. `valid` is False when any violation count is non-zero,
    "unknown" when none is but the history cannot decide (see `unknown_reasons`)."""

    valid: Valid
    counts: dict[str, int]
    examples: dict[str, list[dict[str, Any]]]
    unknown_reasons: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        if self.valid is True:
            return 0
        if self.valid is False:
            return 1
        return 3

    def to_json(self) -> dict[str, Any]:
        return {
            "valid": self.valid,
            "counts": dict(self.counts),
            "examples": {k: list(v) for k, v in self.examples.items()},
            "unknown_reasons": list(self.unknown_reasons),
            "files": list(self.files),
            "details": dict(self.details),
            "timings": dict(self.timings),
        }


def write_verdict(run_dir: Path, verdict: Verdict) -> Path:
    path = Path(run_dir) / VERDICT_FILE
    write_json(path, verdict.to_json())
    return path


# What the lost tail of a log cut off mid-line (or cut before its header) may have held, and
# so the violations it may cause, which a history with such a log does not report: each
# anomaly declares the logs it is held back by (`Anomaly.held_back_by`). In short:
# - enqueues.csv: invokes (their deliveries look unexpected) and acknowledgements;
# - deliveries/: deliveries, answered or not (a delivery never answered is written when the
#   target gives up on it, so it may be older than records before it): jobs look lost,
#   final states unexplained, and redeliveries are paired and counted without it;
# - workers/: claims, renewals, call ends, failpoints, lost writes, error stops: what
#   explains a redelivery, and which lease held a slot; only stale writes (an applied write
#   after a later claim, both recorded) and stuck jobs stand;
# - nemesis.jsonl: faults, which explain redeliveries and dead letters;
# - final_jobs.csv: final states.
CUT_MAY_CAUSE: dict[str, frozenset[str]] = {
    log: frozenset(a.kind for a in ANOMALIES if a.violation and log in a.held_back_by)
    for log in (ENQUEUES_FILE, DELIVERIES_DIR, WORKERS_DIR, NEMESIS_FILE, FINAL_JOBS_FILE)
}


def _unjudged_kinds(history: History, enqueued_jobs: int,
                    worker_log_missing: bool) -> frozenset[str]:
    """The violation kinds not reported from this history: those a cut log may cause (a
    worker's log missing altogether is a workers/ log cut before its first line), and every
    kind when nothing was enqueued (the deliveries' enqueues may be elsewhere)."""
    if not enqueued_jobs:
        return frozenset(VIOLATION_KEYS)
    kinds = frozenset().union(*(CUT_MAY_CAUSE[kind] for kind in history.cut.values()))
    return kinds | CUT_MAY_CAUSE[WORKERS_DIR] if worker_log_missing else kinds


def check_run(run_dirs: Sequence[Path], *,
              tolerance_seconds: float = DEFAULT_TOLERANCE_SECONDS,
              objectives: Sequence[tuple[str, str]] = ()) -> Verdict:
    """Judge the run recorded in `run_dirs` (the first holds the run; the others add
    delivery, worker and fault logs). `objectives`: `(KEY, VALUE)` pairs that change the
    run's objectives (`skiplock.reports.objectives`). Raises HistoryError when the history
    cannot be read, ValueError for a tolerance that is negative or not finite (it would
    excuse or invent anomalies) or an objective that cannot be judged."""
    if not (math.isfinite(tolerance_seconds) and tolerance_seconds >= 0):
        raise ValueError(f"tolerance_seconds must be finite and >= 0, not {tolerance_seconds}")
    started, cpu_started = time.perf_counter(), time.process_time()
    with columnar.BackgroundWrites() as cache_writes:
        history = read_history(run_dirs, cache_writes)
        if objectives:
            history = dataclasses.replace(history, config=dataclasses.replace(
                history.config, objectives=history.config.objectives.with_overrides(objectives)))
        loaded, cpu_loaded = time.perf_counter(), time.process_time()
        found = judge(history, tolerance_seconds)
        judged, cpu_judged = time.perf_counter(), time.process_time()
    # What the cache writes still needed once the judging was done (they overlap it).
    cached, cpu_cached = time.perf_counter(), time.process_time()
    valid = _decide(history, found)
    details = found.details
    details["worker_files"] = history.worker_files
    if history.config.objectives:
        details["objectives"] = history.config.objectives.to_json()
        if objectives:
            details["objectives_changed_by_check"] = [f"{k}={v}" for k, v in objectives]
    if history.repicks:
        # Claims of a job under the number of an earlier pick, told apart by lease token.
        details["repicks_keyed_by_lease"] = history.repicks
    return Verdict(
        valid=valid,
        counts=found.counts,
        examples={k: found.examples[k] for k in EXAMPLE_KINDS if found.examples.get(k)},
        unknown_reasons=tuple(found.unknown),
        files=tuple(history.files),
        details=details,
        timings={
            "load_seconds": round(loaded - started, 4),
            "judge_seconds": round(judged - loaded, 4),
            "cache_seconds": round(cached - judged, 4),
            "total_seconds": round(cached - started, 4),
            # CPU time of this process: on a shared machine, wall time includes waiting.
            # The cache is written beside the load and the judging, and its CPU counted in
            # theirs; `cache_cpu_seconds` is what it still took after them.
            "load_cpu_seconds": round(cpu_loaded - cpu_started, 4),
            "judge_cpu_seconds": round(cpu_judged - cpu_loaded, 4),
            "cache_cpu_seconds": round(cpu_cached - cpu_judged, 4),
        },
    )


def _decide(history: History, found: Findings) -> Valid:
    """The verdict from what was found: adds to `found.unknown` what the history as read
    cannot decide, and holds back the violations a missing part of it may have caused
    (they are counted, and listed in `found.details["not_judged"]`)."""
    unknown, details = found.unknown, found.details
    unknown.extend(history.truncated)
    if history.config.exit_reason != "completed":
        unknown.append(f"the run ended with {history.config.exit_reason!r}")
    no_events = bool(found.counts["delivered"]) and not len(history.events)
    if no_events:
        unknown.append("deliveries were recorded but no worker events: nothing can explain a "
                       "redelivery")
    # Violations win over unknown, except those a part of the history that is missing may
    # have caused: they are counted, and not reported as violations.
    worker_log_missing = no_events or bool(details.get("workers_without_log"))
    unjudged = _unjudged_kinds(history, len(history.job_ids), worker_log_missing)
    held = {k: found.counts[k] for k in VIOLATION_KEYS if found.counts[k] > 0 and k in unjudged}
    if held:
        cut = list(history.cut)
        why = ("nothing was enqueued (its enqueues.csv may be in a directory not given)"
               if not len(history.job_ids) else
               f"{', '.join(cut[:3])}{' ...' if len(cut) > 3 else ''} was cut off and may "
               "have lost the records that decide them" if cut else
               "a worker's event log is missing, and may have held the events that explain "
               "them")
        unknown.append(f"not judged: {', '.join(f'{n} {k}' for k, n in held.items())}: {why}")
        details["not_judged"] = held
    if any(found.counts[k] > 0 for k in VIOLATION_KEYS if k not in held):
        return False
    return "unknown" if unknown else True


__all__ = [
    "ANOMALIES",
    "BY_KIND",
    "COUNT_KEYS",
    "CUT_MAY_CAUSE",
    "DEFAULT_TOLERANCE_SECONDS",
    "MAX_EXAMPLES",
    "MEANINGS",
    "VIOLATION_KEYS",
    "HistoryError",
    "RunConfig",
    "Verdict",
    "check_run",
    "write_verdict",
]
