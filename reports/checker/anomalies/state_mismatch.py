"""`state_mismatch`: the final state disagrees with what the target saw.

- COMPLETED, but the target never answered 2xx, or every 2xx came past the HTTP timeout
  (no worker could have seen it; a paused worker excepted);
- FAILED, although the target answered 2xx in time and nothing explains running it again;
- FAILED, though its script completes within max_attempts, or after fewer deliveries than a
  correct queue makes before dead-lettering it, and no fault used up attempts (jobs short
  of attempts that never reached the target are unknown, not judged here);
- delivered with 2xx but absent from a final snapshot that run.json says is whole."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from skiplock.reports.checker.common import Example, attempt_number, shown
from skiplock.reports.checker.excuses import Excuses
from skiplock.reports.checker.frame import Frame


def absent_with_2xx(f: Frame) -> np.ndarray:
    """Acknowledged jobs delivered with 2xx that have no final row (a mismatch when the
    snapshot is whole; else the history cannot say)."""
    absent: np.ndarray = f.jobs.is_missing & (f.h.job_ack == 1) & f.jobs.any_2xx
    return absent


def completed_late(f: Frame) -> np.ndarray:
    """COMPLETED jobs whose every 2xx came too late for a worker to see it."""
    jobs = f.jobs
    mask: np.ndarray = jobs.is_completed & jobs.any_2xx & ~jobs.visible_2xx
    return mask


def failed_after_2xx(f: Frame) -> np.ndarray:
    """FAILED jobs the target answered 2xx in time."""
    mask: np.ndarray = f.jobs.is_failed & f.jobs.in_time_2xx
    return mask


def find(f: Frame, e: Excuses) -> Iterator[Example]:
    jobs = f.jobs
    e.explainer.prefetch(np.flatnonzero(completed_late(f) | failed_after_2xx(f)
                                        | jobs.failed_vs_oracle | jobs.failed_early).tolist())
    for j in np.flatnonzero(jobs.is_completed & ~jobs.any_2xx).tolist():
        yield Example(f.job_id(j), "completed_without_2xx", {})
    yield from _completed_late(f, e)
    yield from _failed_with_2xx(f, e)
    for j in np.flatnonzero(jobs.failed_vs_oracle).tolist():
        if e.consumed(j) is None and j not in e.unreached:
            yield Example(f.job_id(j), "failed_but_completes", {
                "deliveries": int(jobs.delivered[j])})
    for j in np.flatnonzero(jobs.failed_early).tolist():
        if e.consumed(j) is None and j not in e.unreached:
            yield Example(f.job_id(j), "failed_early", {
                "deliveries": int(jobs.delivered[j]),
                "expected_deliveries": int(f.oracle.expected_deliveries[j]),
                "max_attempts": int(f.h.job_max_attempts[j])})
    if jobs.snapshot_complete:
        for j in np.flatnonzero(absent_with_2xx(f)).tolist():
            yield Example(f.job_id(j), "absent_from_whole_snapshot", {
                "final_jobs": f.cfg.final_jobs})


def _completed_late(f: Frame, e: Excuses) -> Iterator[Example]:
    rows = f.rows
    for j in np.flatnonzero(completed_late(f)).tolist():
        late_rows = [r for r in f.rows_of(j) if rows.success_2xx[r]]
        if any(e.explainer.late_success(f.record(r)) is not None for r in late_rows):
            continue
        first = late_rows[0]
        yield Example(f.job_id(j), "completed_too_late", {
            "timeout": f.cfg.http_timeout_seconds,
            "attempt": attempt_number(rows.attempt[first]),
            "duration": float(rows.duration[first])})


def _failed_with_2xx(f: Frame, e: Excuses) -> Iterator[Example]:
    rows = f.rows
    for j in np.flatnonzero(failed_after_2xx(f)).tolist():
        ok_rows = [r for r in f.rows_of(j) if rows.success_2xx[r] and rows.in_time[r]]
        if not any(e.explainer.explain(
                f.record(r),
                float(rows.next_received[r] if rows.same_next[r] else math.inf)) is not None
                for r in ok_rows):
            yield Example(f.job_id(j), "failed_after_2xx", {
                "attempt": attempt_number(rows.attempt[ok_rows[0]])})


def say(x: Example) -> str:
    v = x.evidence
    if x.case == "completed_without_2xx":
        return "COMPLETED but the target never answered 2xx"
    if x.case == "completed_too_late":
        return (f"COMPLETED but every 2xx came past the {v['timeout']:g}s HTTP timeout "
                f"(attempt {shown(v['attempt'])} after {v['duration']:.2f}s): no worker "
                "could have seen it")
    if x.case == "failed_after_2xx":
        return (f"FAILED although the target answered 2xx to attempt {shown(v['attempt'])} "
                "and nothing explains it")
    if x.case == "failed_but_completes":
        return ("FAILED but its script completes within max_attempts "
                f"({v['deliveries']} deliveries, no fault recorded)")
    if x.case == "failed_early":
        return (f"FAILED after {v['deliveries']} deliveries, but a correct queue delivers it "
                f"{v['expected_deliveries']} times before dead-lettering it (max_attempts "
                f"{v['max_attempts']}), and no fault used up attempts")
    return (f"delivered with 2xx but absent from the final snapshot, which run.json says is "
            f"whole ({v['final_jobs']} rows)")
