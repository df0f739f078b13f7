"""How long each job waited for the queue: from when it was due (its enqueue acknowledged, or
its `run_at` if later) to its first claim and its first delivery at the target, and which of
those waits a fault's window covers. `starvation` and `objective_missed` are judged from
these; nothing here decides an anomaly.

A fault's window runs from its start to its end plus one lease: a job held by a worker that
was killed, or whose claim was lost with its connection, is handed on only when that lease
has run out, so the wait it causes ends up to a lease after the fault. A worker's crash
failpoint (`[failpoints]`, recorded in its event log) opens such a window too."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from skiplock.reports.checker.faults import STOP_EVERY_WORKER, fault_end
from skiplock.reports.checker.frame import Frame


def stops_every_worker(fault: dict[str, object]) -> bool:
    """Whether a fault stops every worker: the database gone or refusing every session
    (only such windows excuse a job's wait for fairness; a fault that stops one worker leaves
    the others to serve the job), or a worker paused inside its claim, which holds the locks
    of the accounts it chose, so that no worker can serve those accounts until it goes on."""
    return fault["fault"] in STOP_EVERY_WORKER or (
        fault["fault"] == "pause_worker" and fault.get("phase") == "claim")


@dataclass(frozen=True)
class Waits:
    """Per acknowledged job (`job` holds its code): its account, when it was due, its first
    claim (its first delivery where no claim was recorded) twice: `claimed` when the claim
    returned (the row was taken by then) and `claim_sent` when it was sent (not taken
    before: a slow claim's rows were taken somewhere in between), its first delivery at the target
    (the history's end where there was none: a wait cut short, never shorter than it was),
    and whether a fault's window overlaps its wait. `end` is the history's last moment."""

    job: np.ndarray
    account: np.ndarray
    due: np.ndarray
    claimed: np.ndarray
    claim_sent: np.ndarray
    first: np.ndarray
    delivered: np.ndarray  # bool: it had a first delivery
    covered: np.ndarray  # bool
    fault_windows: np.ndarray  # (n, 2), merged, sorted
    stop_windows: np.ndarray  # (n, 2): the windows of faults that stop every worker
    end: float

    @property
    def wait(self) -> np.ndarray:
        waited: np.ndarray = self.first - self.due
        return waited


def waits(f: Frame) -> Waits:
    h, rows = f.h, f.rows
    due = h.job_due
    job = np.flatnonzero(~np.isnan(due))
    first = np.full(len(h.job_ids), np.inf)
    heads = rows.first_of_job
    first[rows.job[heads]] = rows.received[heads]
    claimed = first.copy()
    sent = first.copy()
    if len(f.claims):
        c = f.claims
        started = h.event_data.numbers("started", c.index.to_numpy())
        table = pd.DataFrame({"job": c["job"].to_numpy(), "time": c["time"].to_numpy(),
                              "sent": np.fmin(started, c["time"].to_numpy())})
        by_job = table.groupby("job")[["time", "sent"]].min()
        at = by_job.index.to_numpy()
        claimed[at] = np.minimum(claimed[at], by_job["time"].to_numpy())
        sent[at] = np.minimum(sent[at], by_job["sent"].to_numpy())
    times = [rows.received.max(initial=-np.inf), np.nanmax(due, initial=-np.inf)]
    end = float(max(times))
    delivered = np.isfinite(first[job])
    first_or_end = np.where(delivered, first[job], end)
    claimed_or_end = np.minimum(np.where(np.isfinite(claimed[job]), claimed[job], end),
                                first_or_end)
    sent_or_end = np.minimum(np.where(np.isfinite(sent[job]), sent[job], end), first_or_end)
    lease = h.config.lease_seconds
    # A worker's own failpoint (a crash scheduled by [failpoints]) is a fault too: what it
    # held waits out its lease.
    ev = h.events
    crashes = ev[ev["kind"] == "failpoint"]["time"].to_numpy()
    windows = _merged([(float(x["start"]), fault_end(x) + lease) for x in h.faults
                       if not x.get("skipped")]
                      + [(float(t), float(t) + lease) for t in crashes.tolist()])
    stops = _merged([(float(x["start"]), fault_end(x) + lease) for x in h.faults
                     if not x.get("skipped") and stops_every_worker(x)])
    return Waits(job=job, account=h.job_account[job], due=due[job], claimed=claimed_or_end,
                 claim_sent=sent_or_end, first=first_or_end, delivered=delivered,
                 covered=overlaps(windows, due[job], first_or_end), fault_windows=windows,
                 stop_windows=stops, end=end)


def _merged(spans: list[tuple[float, float]]) -> np.ndarray:
    out: list[list[float]] = []
    for start, stop in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], stop)
        else:
            out.append([start, stop])
    return np.array(out, dtype=np.float64).reshape(-1, 2)


def overlaps(windows: np.ndarray, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """Whether [start, stop] meets any of the merged, sorted `windows`."""
    if not len(windows):
        return np.zeros(len(start), dtype=bool)
    # The last window that starts at or before `stop` is the only one that can meet it.
    i = np.searchsorted(windows[:, 0], stop, side="right") - 1
    ok = i >= 0
    out = np.zeros(len(start), dtype=bool)
    out[ok] = windows[i[ok], 1] >= start[ok]
    return out


def covered_seconds(windows: np.ndarray, start: float, stop: float) -> float:
    """How much of [start, stop] the merged `windows` cover."""
    if not len(windows) or stop <= start:
        return 0.0
    lo, hi = np.maximum(windows[:, 0], start), np.minimum(windows[:, 1], stop)
    return float(np.clip(hi - lo, 0, None).sum())


@dataclass(frozen=True)
class Held:
    """One account's leases as the queue counts them: each from `starts[i]` to `ends[i]`
    (both sorted on their own)."""

    starts: np.ndarray
    ends: np.ndarray

    def overlapping(self, start: float, stop: float) -> int:
        """How many were held at some moment of [start, stop]: a claim's view of its
        account's slots is a snapshot taken somewhere in between, so a lease written back
        after the claim was sent may still fill a slot for it."""
        return int(np.searchsorted(self.starts, stop, side="right")
                   - np.searchsorted(self.ends, start, side="right"))


def slots_held(f: Frame, account: str) -> Held:
    """The account's leases as the queue counts them: from each claim to its attempt's first
    applied result write or release, else to the end of its last lease."""
    h = f.h
    ev = h.events
    mine = np.flatnonzero(h.job_account == account)
    ev = ev[ev["job"].isin(mine)]
    claims = ev[ev["kind"] == "claim"]
    if not len(claims):
        return Held(np.zeros(0), np.zeros(0))
    key = ["job", "attempt"]
    start = claims.groupby(key, sort=False)["time"].min().rename("start")
    # A write whose outcome is unknown may not have freed the slot: its lease then holds it.
    freed = (ev["kind"] == "release") | ((ev["kind"] == "write") & (ev["result"] == "applied"))
    done = ev[freed].groupby(key, sort=False)["time"].min()
    last = ev[ev["kind"].isin(["claim", "renew"])].groupby(key, sort=False)["time"].max()
    table = pd.concat([start, done.rename("done"), last.rename("last")], axis=1)
    table = table[table["start"].notna()]
    ends = np.fmin(table["done"].to_numpy(), table["last"].to_numpy() + h.config.lease_seconds)
    return Held(np.sort(table["start"].to_numpy()), np.sort(ends))
