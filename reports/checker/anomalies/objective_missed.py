"""`objective_missed`: a measured latency or throughput beyond a bound the scenario declares
(`[objectives]`, `skiplock.reports.objectives`), over every account or one.

Latency is the wait from when a job was due (its enqueue acknowledged, or its `run_at`) to its
first delivery at the target; a job never delivered counts as waiting to the history's end.
Jobs whose wait a fault's window covers are judged apart, against `[objectives.during_faults]`
when it is given (and not at all otherwise, which the verdict's details say), so a gate can
demand a fast recovery without failing on the fault itself. `delivered_ratio` compares first
deliveries with jobs that became due over the load's stretches no fault covers (over the
stretches faults cover, for `during_faults`), when they last 2 s and hold 20 jobs at least."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from skiplock.reports.checker.common import Example, fmt
from skiplock.reports.checker.excuses import Excuses
from skiplock.reports.checker.frame import Frame
from skiplock.reports.checker.waits import Waits, waits
from skiplock.reports.objectives import BY_KEY, METRICS

ALL = "all accounts"
RATIO_SECONDS = 2.0
_PERCENTILE = {"first_delivery_p50": 50, "first_delivery_p99": 99, "oldest_due_age": 100}
RATIO_JOBS = 20


def find(f: Frame, e: Excuses) -> Iterator[Example]:
    objectives = f.cfg.objectives
    w = f.derived(waits)
    scopes: list[tuple[str, Mapping[str, float], bool]] = [(ALL, objectives.overall, False)]
    scopes += [(name, bounds, False) for name, bounds in objectives.accounts.items()]
    scopes += [(ALL, objectives.during_faults, True)]
    for scope, bounds, during in scopes:
        if not bounds:
            continue
        of_scope = (np.ones(len(w.job), dtype=bool) if scope == ALL
                    else w.account == scope)
        for metric in METRICS:
            if metric.key not in bounds:
                continue
            bound = bounds[metric.key]
            measured = (_ratio(f, w, of_scope, during) if metric.key == "delivered_ratio"
                        else _latency(metric.key, f, w,
                                      of_scope & (w.covered if during else ~w.covered)))
            if measured is None:
                continue
            value, jobs, window, worst = measured
            missed = value > bound if metric.sense == "max" else value < bound
            if missed:
                yield Example(worst, metric.key, {
                    "objective": metric.key, "account": scope, "measured": value,
                    "bound": bound, "jobs": jobs, "window": window,
                    "during_faults": during, "unit": metric.unit})


def _latency(key: str, f: Frame, w: Waits, mask: np.ndarray
             ) -> tuple[float, int, list[float], str] | None:
    """The measured value, how many jobs it is over, the window (first due, last due) and the
    job that shows it best (the longest wait); None when no job falls in the scope."""
    idx = np.flatnonzero(mask)
    if not len(idx):
        return None
    waited = w.wait[idx]
    worst = int(idx[np.argmax(waited)])
    # oldest_due_age is the longest wait: the 100th percentile.
    value = float(np.percentile(waited, _PERCENTILE[key]))
    window = [float(w.due[idx].min()), float(w.due[idx].max())]
    return value, len(idx), window, f.job_id(int(w.job[worst]))


def _ratio(f: Frame, w: Waits, scope: np.ndarray, during: bool
           ) -> tuple[float, int, list[float], str] | None:
    load = f.cfg.load_window
    if load is None:
        return None
    start, stop = load
    spans = _stretches(w.fault_windows, start, stop, during)
    if not spans:
        return None
    # Whether or not a fault covers a job's wait, the stretches decide which count.
    # A ratio over a moment is its edges: jobs due just before its end are delivered after
    # it. Judged over at least RATIO_SECONDS of stretches and RATIO_JOBS jobs.
    if sum(hi - lo for lo, hi in spans) < RATIO_SECONDS:
        return None
    offered = delivered = 0
    for lo, hi in spans:
        offered += int((scope & (w.due >= lo) & (w.due < hi)).sum())
        delivered += int((scope & w.delivered & (w.first >= lo) & (w.first < hi)).sum())
    if offered < RATIO_JOBS:
        return None
    idx = np.flatnonzero(scope)
    worst = f.job_id(int(w.job[idx[np.argmax(w.wait[idx])]])) if len(idx) else ""
    return delivered / offered, offered, [spans[0][0], spans[-1][1]], worst


def _stretches(windows: np.ndarray, start: float, stop: float, during: bool
               ) -> list[tuple[float, float]]:
    """The parts of [start, stop] the fault windows cover (`during`), or leave free."""
    covered = [(max(a, start), min(b, stop)) for a, b in windows.tolist()
               if b > start and a < stop]
    if during:
        return covered
    free, at = [], start
    for a, b in covered:
        if a > at:
            free.append((at, a))
        at = max(at, b)
    if at < stop:
        free.append((at, stop))
    return free


def say(x: Example) -> str:
    v: dict[str, Any] = x.evidence
    seconds = v["unit"] == "s"

    def number(n: float) -> str:
        return f"{n:.3f} s" if seconds else f"{n:.3f}"

    sense = "at most" if BY_KEY[v["objective"]].sense == "max" else "at least"
    where = "during faults" if v["during_faults"] else "outside faults"
    return (f"{v['objective']} of {v['account']} was {number(v['measured'])}, objective "
            f"{sense} {number(v['bound'])}, over {v['jobs']} jobs due {fmt(v['window'][0])} "
            f"to {fmt(v['window'][1])} ({where})")

