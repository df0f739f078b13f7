"""The per-delivery and per-job frame: every fact the anomalies are decided from that the
whole history gives at once, vectorised with pandas and numpy.

Deliveries are the target's records of jobs that were enqueued (the others are kept apart,
as `unexpected`), sorted by job and time. Per delivery: how the worker saw it (success,
transient, permanent; late answers and hangs are transient), when it ended at the target,
its position among the job's deliveries, the next delivery of the job, and the backoff
its failure asks for. Per job: its oracle's expectations, what the target saw, and its
final state. The few rows and jobs that need a closer look (`candidates`) are then
explained or not, one by one, against the recorded events (`skiplock.reports.checker.explained`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

import numpy as np
import pandas as pd

from skiplock.queue_impl.interface import JobStatus
from skiplock.reports.checker.common import floats, records
from skiplock.reports.checker.explain import http_ends
from skiplock.reports.checker.load import History, RunConfig
from skiplock.reports.checker.slots import Slots, account_slots
from skiplock.reports.checker.waits import Waits, waits
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
    rows each check starts from."""

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
        self._failures(h, tolerance)

    def _failures(self, h: History, tolerance: float) -> None:
        """When the worker saw each delivery fail, and the backoff that failure asks for."""
        cfg = h.config
        timeout = cfg.http_timeout_seconds
        received, job = self.received, self.job
        # The failed attempt's number is the target's own count (the header is the queue's
        # word; it is used only where an explained redelivery precedes, see early_retry).
        n_for_policy = self.position.astype(np.int64)
        # The policy itself decides each bound (a few distinct attempt numbers, looked up).
        numbers = np.unique(n_for_policy)
        bounds = np.array([cfg.retry.min_delay(int(n)) for n in numbers], dtype=np.float64)
        self.min_delay = (bounds[np.searchsorted(numbers, n_for_policy)] if len(numbers)
                          else np.zeros(0))
        timed_out = ~self.in_time & (self.late | self.hang_forever)
        fail_seen = np.where(self.in_time, self.answered,
                             np.where(timed_out, received + timeout - tolerance, received))
        # The worker's own end of a timed-out call, when it recorded one: its timer started
        # before the target saw the request, so the failure may predate received + timeout.
        ask = np.flatnonzero(timed_out & self.same_next)
        if len(ask):
            ends = http_ends(h, job[ask], self.attempt[ask])
            has = ~np.isnan(ends)
            fail_seen[ask[has]] = np.maximum(ends[has], received[ask[has]])
        self.fail_seen = fail_seen
        self.gap_ok = self.next_received >= fail_seen + self.min_delay - tolerance

    # -- the rows each check starts from ---------------------------------------------------

    @cached_property
    def duplicates(self) -> np.ndarray:
        """Every 2xx of a job after its first."""
        rank = pd.Series(self.success_2xx.astype(np.int64)).groupby(
            self.job, sort=False).cumsum().to_numpy()
        return np.flatnonzero(self.success_2xx & (rank >= 2))

    @cached_property
    def overlapping(self) -> np.ndarray:
        """Deliveries made while an earlier one of the job was in flight at the target."""
        prev_max_end = pd.Series(self.target_end).groupby(
            self.job, sort=False).cummax().to_numpy()
        prev_max_end = np.where(self.first_of_job, -np.inf, np.roll(prev_max_end, 1))
        return np.flatnonzero(self.received < prev_max_end)

    @cached_property
    def early_failures(self) -> np.ndarray:
        """Transient failures followed by the job's next delivery sooner than the backoff
        (the rows of the failures)."""
        return np.flatnonzero(self.same_next & (self.seen == TRANSIENT) & ~self.gap_ok)

    @cached_property
    def after_permanent(self) -> np.ndarray:
        """Deliveries after one the worker saw fail permanently."""
        permanent = (self.seen == PERMANENT).astype(np.int64)
        rank = pd.Series(permanent).groupby(self.job, sort=False).cumsum().to_numpy()
        return np.flatnonzero((rank - permanent) >= 1)


class Jobs:
    """Per job: what the target saw, its final state, and the masks of jobs whose final
    state needs a closer look."""

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
        acked = h.job_ack == 1
        self.completed_no_2xx = self.is_completed & ~self.any_2xx
        self.completed_late = self.is_completed & self.any_2xx & ~self.visible_2xx
        self.failed_with_2xx = self.is_failed & self.in_time_2xx
        self.failed_vs_oracle = self.is_failed & expected_completed & ~self.in_time_2xx
        # Dead-lettered as its oracle says, but before the deliveries the oracle requires.
        self.failed_early = (self.is_failed & ~expected_completed
                             & (self.delivered < oracle.expected_deliveries))
        # A job its oracle dead-letters and the queue dead-lettered is not lost.
        self.lost_candidate = (acked & ~self.any_2xx & ~self.is_live
                               & ~(self.is_failed & ~expected_completed))
        self.absent_2xx = self.is_missing & acked & self.any_2xx


@dataclass
class Frame:
    h: History
    tolerance: float
    oracle: Oracles
    rows: Rows
    jobs: Jobs
    claims: pd.DataFrame  # the workers' claim events of enqueued jobs
    stale_candidates: pd.DataFrame  # applied writes of an attempt older than a later claim
    candidates: np.ndarray  # the jobs the explanations are looked up for
    records: dict[int, dict[str, Any]]  # delivery row -> its record, for the candidates
    job_rows: dict[int, list[int]]  # candidate job -> its delivery rows

    @property
    def cfg(self) -> RunConfig:
        return self.h.config

    def job_id(self, job: int) -> str:
        return str(self.h.job_ids[job])

    @cached_property
    def account_slots(self) -> Slots:
        """Account slots over time (computed once: the limit check and the verdict's
        details both read them)."""
        return account_slots(self)

    @cached_property
    def waits(self) -> Waits:
        """Each job's wait for its first claim and delivery (starvation and the objectives
        read them)."""
        return waits(self)


def build(h: History, tolerance: float) -> Frame:
    oracle = oracles(h, h.config.http_timeout_seconds)
    rows = Rows(h, tolerance)
    jobs = Jobs(h, rows, oracle, tolerance)
    candidates: set[int] = set()
    for found in (rows.duplicates, rows.overlapping, rows.early_failures, rows.after_permanent):
        candidates.update(rows.job[found].tolist())
    for mask in (jobs.completed_no_2xx, jobs.completed_late, jobs.failed_with_2xx,
                 jobs.failed_vs_oracle, jobs.failed_early, jobs.lost_candidate,
                 jobs.delivered > h.job_max_attempts):
        candidates.update(np.flatnonzero(mask).tolist())
    claims, stale_candidates = _stale_candidates(h)
    chosen = np.array(sorted(candidates), dtype=np.int64)
    rows_of = rows.d[np.isin(rows.job, chosen)]
    recs = {int(i): r for i, r in zip(rows_of.index, records(rows_of), strict=True)}
    job_rows: dict[int, list[int]] = defaultdict(list)
    for i in recs:
        job_rows[int(rows.job[i])].append(i)
    return Frame(h=h, tolerance=tolerance, oracle=oracle, rows=rows, jobs=jobs, claims=claims,
                 stale_candidates=stale_candidates, candidates=chosen, records=recs,
                 job_rows=job_rows)


def _stale_candidates(h: History) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The claim events, and the applied writes for an attempt older than the job's latest
    claim (each is stale if that claim came before the write was sent)."""
    ev = h.events
    ev_known = ev[ev["job"] >= 0]
    claims = ev_known[ev_known["kind"] == "claim"]
    applied = ev_known[(ev_known["kind"] == "write") & (ev_known["result"] == "applied")]
    max_claim = np.full(len(h.job_ids), -np.inf)
    if len(claims):
        per_job = claims.groupby("job")["attempt"].max()
        max_claim[per_job.index.to_numpy()] = per_job.to_numpy()
    stale = applied[applied["attempt"].to_numpy() < max_claim[applied["job"].to_numpy()]]
    return claims, stale


def write_sent(h: History, writes: pd.DataFrame) -> np.ndarray:
    """When each write event's statement went out: its `started`, or the time it was logged
    (after the commit, maybe much later) where that is earlier or `started` is missing."""
    started = floats(h.event_data.field("started", writes.index.to_numpy()))
    logged = writes["time"].to_numpy()
    return np.where(np.isnan(started), logged, np.minimum(started, logged))
