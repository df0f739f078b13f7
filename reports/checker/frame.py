"""The per-delivery and per-job frame: the facts, vectorised with pandas and numpy, that
several anomalies are decided from. What only one anomaly needs (its candidate rows, the
questions it asks the fault explainer) is computed in that anomaly's module.

Deliveries are the target's records of jobs that were enqueued (the others are kept apart,
as `unexpected`), sorted by job and time. Per delivery: how the worker saw it (success,
transient, permanent; late answers and hangs are transient), when it ended at the target,
its position among the job's deliveries, the next delivery of the job, each repeated 2xx and
each delivery made while an earlier one was in flight. Per job: its oracle's expectations,
what the target saw, its final state, and whether it was dead-lettered against its oracle.
A row's record (`Frame.record`) and a job's rows (`Frame.rows_of`) are looked up on demand,
for the few rows an anomaly looks at closely; so is anything derived once and read by several
(`Frame.derived`: account slots, waits)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar, cast

import numpy as np
import pandas as pd

from skiplock.queue_impl.interface import JobStatus
from skiplock.reports.checker.common import objects
from skiplock.reports.checker.join import History
from skiplock.reports.checker.run_config import RunConfig
from skiplock.reports.history import HistoryError
from skiplock.reports.oracle import Expected, OracleCache, script_from_payload

# How the worker saw a delivery.
SUCCESS = 0
TRANSIENT = 1
PERMANENT = 2


@dataclass(frozen=True)
class Oracles:
    """Per job: whether a correct queue completes it, and the deliveries a fault-free
    correct run makes (a job dead-lettered with fewer was given up on early, unless a fault
    used up its attempts). `count`: the distinct oracles, one per (script, max_attempts)."""

    expected_completed: np.ndarray
    expected_deliveries: np.ndarray
    count: int


def oracles(h: History, timeout: float) -> Oracles:
    n_jobs = len(h.job_ids)
    cache = OracleCache(timeout)
    expected_completed = np.zeros(n_jobs, dtype=bool)
    expected_deliveries = np.zeros(n_jobs, dtype=np.int64)
    pairs = pd.DataFrame({"s": h.job_script, "m": h.job_max_attempts})
    for group, idx in pairs.groupby(["s", "m"], sort=False).indices.items():
        s, m = cast(tuple[int, int], group)
        key, raw = h.scripts[int(s)]
        try:
            script = script_from_payload(raw)
        except (KeyError, ValueError, TypeError, OverflowError) as exc:
            job_id = h.job_ids[int(idx[0])]
            raise HistoryError(f"enqueue of job {job_id}: unreadable script ({exc})") from None
        oracle = cache.get(repr(key), script, int(m))
        expected_completed[idx] = oracle.expected is Expected.COMPLETED
        expected_deliveries[idx] = oracle.deliveries
    return Oracles(expected_completed, expected_deliveries, len(cache._cache))


class Rows:
    """The deliveries of enqueued jobs, as arrays (row i of each is `d`'s row i), and the
    rows that several checks start from."""

    def __init__(self, h: History, tolerance: float) -> None:
        cfg = h.config
        timeout = cfg.http_timeout_seconds
        d = h.deliveries
        unknown_job = d["job"].to_numpy() < 0
        known = ~unknown_job
        failed_enqueue = np.zeros(len(d), dtype=bool)
        failed_enqueue[known] = h.job_ack[d["job"].to_numpy()[known]] == -1
        # Deliveries of jobs never enqueued, or whose enqueue failed.
        self.unexpected = d[unknown_job | failed_enqueue]
        d = d[~unknown_job & ~failed_enqueue]
        self.d = d = d.sort_values(["job", "received"], kind="stable").reset_index(drop=True)
        self.job = job = d["job"].to_numpy()
        self.received = received = d["received"].to_numpy()
        self.answered = answered = d["answered"].to_numpy()
        self.status = status = d["status"].to_numpy()
        self.attempt = d["attempt"].to_numpy()
        self.duration = answered - received
        self.is_answered = ~np.isnan(answered)
        self.late = self.is_answered & (self.duration >= timeout - tolerance)
        self.in_time = self.is_answered & ~self.late
        self.success_2xx = (status >= 200) & (status < 300)
        transient_status = (status >= 500) | (status == 408) | (status == 429)
        self.seen = np.where(~self.in_time, TRANSIENT,
                             np.where(self.success_2xx, SUCCESS,
                                      np.where(transient_status, TRANSIENT, PERMANENT)))
        self.hang_forever = d["behaviour"].to_numpy() == "hang_forever"
        # In flight at the target: until answered; a request never answered was held until
        # the client left (a hang) or not at all (a reset).
        self.target_end = np.where(self.is_answered, answered,
                                   np.where(self.hang_forever, received + timeout, received))
        self.position = pd.Series(job).groupby(job, sort=False).cumcount().to_numpy() + 1
        self.first_of_job = self.position == 1
        self.same_next = np.zeros(len(d), dtype=bool)
        if len(d) > 1:
            self.same_next[:-1] = job[1:] == job[:-1]
        self.next_received = np.full(len(d), np.inf)
        nxt = np.arange(len(d)) + 1
        self.next_received[self.same_next] = received[nxt[self.same_next]]

    # -- rows that several checks start from ----------------------------------------------

    @cached_property
    def duplicates(self) -> np.ndarray:
        """Every 2xx of a job after its first (both duplicate kinds, and the redeliveries a
        fault explains on top of max_attempts)."""
        rank = pd.Series(self.success_2xx.astype(np.int64)).groupby(
            self.job, sort=False).cumsum().to_numpy()
        return np.flatnonzero(self.success_2xx & (rank >= 2))

    @cached_property
    def overlapping(self) -> np.ndarray:
        """Deliveries made while an earlier one of the job was in flight at the target
        (concurrent deliveries, and the redeliveries a fault explains)."""
        prev_max_end = pd.Series(self.target_end).groupby(
            self.job, sort=False).cummax().to_numpy()
        prev_max_end = np.where(self.first_of_job, -np.inf, np.roll(prev_max_end, 1))
        return np.flatnonzero(self.received < prev_max_end)


class Jobs:
    """Per job: what the target saw, its final state, and whether it was dead-lettered
    against its oracle (state_mismatch judges it; lost and the unknown dead letters ask
    the same)."""

    def __init__(self, h: History, rows: Rows, oracle: Oracles, tolerance: float) -> None:
        n_jobs = len(h.job_ids)
        timeout = h.config.http_timeout_seconds
        job = rows.job
        self.delivered = np.bincount(job, minlength=n_jobs)
        self.any_2xx = np.zeros(n_jobs, dtype=bool)
        self.any_2xx[job[rows.success_2xx]] = True
        self.in_time_2xx = np.zeros(n_jobs, dtype=bool)
        self.in_time_2xx[job[rows.success_2xx & rows.in_time]] = True
        # A 2xx a worker could have seen: answered before its timeout, give or take the
        # tolerance. A COMPLETED job needs one.
        self.visible_2xx = np.zeros(n_jobs, dtype=bool)
        self.visible_2xx[job[rows.success_2xx & rows.is_answered
                             & (rows.duration < timeout + tolerance)]] = True
        self._finals(h)
        self._suspects(h, oracle)

    def _finals(self, h: History) -> None:
        f = h.final
        # Whether the snapshot holds every row the runner took (None: run.json does not say).
        self.snapshot_complete = (None if h.config.final_jobs is None
                                  else h.config.final_jobs == len(f))
        unknown_final = f["job"].to_numpy() < 0
        self.never_enqueued = f[unknown_final]  # final states of jobs never enqueued
        self.status = np.full(len(h.job_ids), "", dtype=object)
        known = f[~unknown_final]
        self.status[known["job"].to_numpy()] = known["status"].to_numpy()
        self.completed_rows = int((f["status"] == JobStatus.COMPLETED.value).sum())
        self.failed_rows = int((f["status"] == JobStatus.FAILED.value).sum())
        self.is_completed = self.status == JobStatus.COMPLETED.value
        self.is_failed = self.status == JobStatus.FAILED.value
        self.is_missing = self.status == ""
        self.is_live = ~(self.is_completed | self.is_failed | self.is_missing)
        # Acknowledged, or the queue shows the row.
        self.exists = (h.job_ack == 1) | ~self.is_missing

    def _suspects(self, h: History, oracle: Oracles) -> None:
        expected_completed = oracle.expected_completed
        self.failed_vs_oracle = self.is_failed & expected_completed & ~self.in_time_2xx
        # Dead-lettered as its oracle says, but before the deliveries the oracle requires.
        self.failed_early = (self.is_failed & ~expected_completed
                             & (self.delivered < oracle.expected_deliveries))


_T = TypeVar("_T")


@dataclass
class Frame:
    h: History
    tolerance: float
    oracle: Oracles
    rows: Rows
    jobs: Jobs
    claims: pd.DataFrame  # the workers' claim events of enqueued jobs
    _records: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)
    _derived: dict[Callable[[Frame], Any], Any] = field(default_factory=dict, repr=False)

    @property
    def cfg(self) -> RunConfig:
        return self.h.config

    def job_id(self, job: int) -> str:
        return str(self.h.job_ids[job])

    @cached_property
    def _columns(self) -> dict[str, np.ndarray]:
        return {str(c): objects(self.rows.d[c]) for c in self.rows.d.columns}

    def record(self, row: int) -> dict[str, Any]:
        """Delivery `row` as a dict of plain Python values (looked up once)."""
        rec = self._records.get(row)
        if rec is None:
            rec = {name: _plain(values[row]) for name, values in self._columns.items()}
            self._records[row] = rec
        return rec

    def rows_of(self, job: int) -> list[int]:
        """The delivery rows of `job`, in order (the rows are sorted by job)."""
        job_col = self.rows.job
        lo, hi = np.searchsorted(job_col, job, "left"), np.searchsorted(job_col, job, "right")
        return list(range(int(lo), int(hi)))

    def derived(self, compute: Callable[[Frame], _T]) -> _T:
        """`compute(self)`, computed once: what several parts read (account slots, waits)
        without the frame importing the modules that compute them."""
        if compute not in self._derived:
            self._derived[compute] = compute(self)
        return cast(_T, self._derived[compute])


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def build(h: History, tolerance: float) -> Frame:
    oracle = oracles(h, h.config.http_timeout_seconds)
    rows = Rows(h, tolerance)
    jobs = Jobs(h, rows, oracle, tolerance)
    ev = h.events
    claims = ev[(ev["job"] >= 0) & (ev["kind"] == "claim")]
    return Frame(h=h, tolerance=tolerance, oracle=oracle, rows=rows, jobs=jobs, claims=claims)
