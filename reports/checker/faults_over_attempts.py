"""Explanations: the recorded events that make a redelivery legitimate.

`Explainer` looks up, for one delivery, a recorded event (a worker's claim, renewal, call,
write, failpoint or death, a fault of the nemesis) that overlaps its attempt. Leases are the
configured `lease_seconds` from the worker's claim or renewal, never the lease end the queue
reported."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from skiplock.reports.checker.common import attempt_label, fmt, records
from skiplock.reports.checker.faults import (
    DATABASE_FAULTS,
    TARGET_FAULTS,
    WORKER_FAULTS,
    fault_end,
    fault_span,
)
from skiplock.reports.checker.join import History
from skiplock.reports.checker.read import Nested

# How long after it was due a retry's claim may come (a poll, a busy worker), for the window
# in which a kill may have hidden it (Explainer._unlogged_claim).
TRAILING_CLAIM_SLACK_SECONDS = 2.0

_DATA_FIELDS = ("name", "lost", "error", "reason", "outcome", "started", "end")


def _records_with_data(events: pd.DataFrame, data: Nested) -> list[dict[str, Any]]:
    """The records of `events` (rows of the history's events, in order), each with the fields
    of its `data` the explanations read."""
    fields = data.fields((*_DATA_FIELDS, "result"), events.index.to_numpy())
    out = records(events)
    for n, rec in enumerate(out):
        for key in _DATA_FIELDS:
            rec[key] = fields[key][n]
        if rec.get("result") is None:
            rec["result"] = fields["result"][n]
    return out


@dataclass(frozen=True)
class Why:
    """Why a redelivery is legitimate. `fault` is True for a recorded fault (a redelivery it
    causes may come on top of `max_attempts`), False for an HTTP timeout (the timed-out
    attempt used one of them)."""

    text: str
    fault: bool




class Explainer:
    """Looks up, for one delivery, a recorded event that overlaps its attempt.

    A fault explains a redelivery only inside the earlier attempt's window: from its claim
    (or delivery) to the first of the next delivery, its applied result write and the end
    of its lease (claim and renewal times plus the configured lease), give or take the
    tolerance. Once an attempt's success is applied, nothing explains running it again but
    a restart of a server that is not durable (a committed write may be lost)."""

    def __init__(self, history: History, tolerance: float) -> None:
        self.cfg = history.config
        self.tol = tolerance
        self.durable = history.config.durable is not False
        self.faults = [f for f in history.faults if not f.get("skipped")]
        ev = history.events
        self._history = history
        # The events of each job, found on demand: the events sorted by job (stably, so a
        # job's stay in log order), and where each job's stretch starts.
        job = ev["job"].to_numpy()
        self._order = np.argsort(job, kind="stable")
        self._sorted_jobs = job[self._order]
        self._of_job: dict[int, dict[float, list[dict[str, Any]]]] = {}
        # Worker-wide deaths: a failpoint or an error stop ends every lease the worker held.
        self.deaths: dict[str, list[dict[str, Any]]] = defaultdict(list)
        ends = ev[ev["kind"].isin(["failpoint", "stop"])]
        for rec in _records_with_data(ends, history.event_data):
            if rec["kind"] == "failpoint" or str(rec["reason"]).startswith("error"):
                self.deaths[str(rec["worker"])].append(rec)

    def prefetch(self, jobs: Iterable[int]) -> None:
        """Read the recorded events of `jobs` in one pass: a caller about to ask about many
        jobs says which first (one job at a time, each lookup would cost a pass over the
        events' nested data)."""
        wanted = np.array(sorted({int(j) for j in jobs} - self._of_job.keys()), dtype=np.int64)
        if not len(wanted):
            return
        lo = np.searchsorted(self._sorted_jobs, wanted, "left")
        hi = np.searchsorted(self._sorted_jobs, wanted, "right")
        idx = np.sort(np.concatenate([self._order[a:b] for a, b in
                                      zip(lo.tolist(), hi.tolist(), strict=True)]))
        found: dict[int, dict[float, list[dict[str, Any]]]] = {int(j): {} for j in wanted}
        for rec in _records_with_data(self._history.events.iloc[idx],
                                      self._history.event_data):
            if not math.isnan(rec["attempt"]):
                found[int(rec["job"])].setdefault(float(rec["attempt"]), []).append(rec)
        self._of_job.update(found)

    def attempts(self, job: int) -> dict[float, list[dict[str, Any]]]:
        """The job's recorded events by attempt, keyed by the attempt as read: a whole
        number, or a re-pick's key a fraction above it (load.key_picks_by_lease), each list
        in log order."""
        if job not in self._of_job:
            self.prefetch((job,))
        return self._of_job[job]

    def _events(self, job: int, attempt: float) -> list[dict[str, Any]]:
        if math.isnan(attempt):
            return []
        return self.attempts(job).get(float(attempt), [])

    def worker_of(self, job: int, attempt: float, header: Any) -> str | None:
        if isinstance(header, str) and header:
            return header
        for rec in self._events(job, attempt):
            if rec["kind"] == "claim":
                return str(rec["worker"])
        return None

    def claimed_at(self, job: int, attempt: float, received: float) -> float:
        """When the attempt was claimed (the delivery time when no claim was recorded)."""
        times = [float(r["time"]) for r in self._events(job, attempt) if r["kind"] == "claim"]
        return min([received, *times])

    def lease_end(self, job: int, attempt: float, received: float) -> float:
        """When the lease of this attempt ran out: the configured lease from its last claim
        or renewal the worker recorded (from the delivery when none was). The lease end the
        queue reported is not used: a queue that hands out short leases must not excuse
        itself with them."""
        times = [float(r["time"]) for r in self._events(job, attempt)
                 if r["kind"] == "claim" or (r["kind"] == "renew" and not r["lost"])]
        return (max(times) if times else received) + self.cfg.lease_seconds

    def gave_up(self, job: int, attempt: float, received: float) -> float:
        """When the worker gave up on a call that timed out: the end its http event
        recorded, else the delivery time plus the timeout."""
        ends = [float(r["end"]) for r in self._events(job, attempt)
                if r["kind"] == "http" and isinstance(r["end"], int | float)
                and not isinstance(r["end"], bool) and not math.isnan(r["end"])]
        fallback = received + self.cfg.http_timeout_seconds
        return max(received, min(ends)) if ends else fallback

    def applied_write(self, job: int, attempt: float) -> dict[str, Any] | None:
        """The attempt's first applied result write, if any."""
        applied = [r for r in self._events(job, attempt)
                   if r["kind"] == "write" and r["result"] == "applied"]
        return min(applied, key=lambda r: float(r["time"])) if applied else None

    def has_applied_write(self, job: int, attempt: float) -> bool:
        return self.applied_write(job, attempt) is not None

    def explain(self, d: dict[str, Any], until: float, *, timeouts: bool = True) -> Why | None:
        """Why the attempt that made delivery `d` may be executed again at `until` (the next
        delivery; inf when there is none), or None. `timeouts` False leaves out HTTP timeouts
        (the caller judges those by time)."""
        job = int(d["job"])
        attempt = float(d["attempt"])
        label = attempt_label(attempt)
        applied = self.applied_write(job, attempt)
        if (applied is not None and applied["outcome"] in (None, "success")
                and float(applied["time"]) <= until):
            # The success was committed before the redelivery.
            lost = self._lost_commit(float(applied["time"]), until)
            return None if lost is None else Why(
                f"{lost} after the result of attempt {label} was applied", True)
        fault = self._fault(d, until, applied)
        if fault is not None:
            return Why(fault, True)
        if timeouts:
            timeout = self._timeout(d, until)
            if timeout is not None:
                return Why(timeout, False)
        return None

    def _timeout(self, d: dict[str, Any], until: float) -> str | None:
        """The worker gave up on the call: the target answered past the timeout, or the
        worker recorded a timeout or a lost connection for the attempt."""
        timeout = self.cfg.http_timeout_seconds
        answered = d["answered"]
        label = attempt_label(d["attempt"])
        if (not math.isnan(answered)
                and answered - d["received"] >= timeout - self.tol
                and until >= d["received"] + timeout - self.tol):
            return (f"HTTP timeout: the target answered attempt {label} after "
                    f"{answered - d['received']:.2f}s, past the {timeout:g}s timeout")
        for rec in self._events(int(d["job"]), float(d["attempt"])):
            if (rec["kind"] == "http" and rec["result"] in ("timeout", "connection_error")
                    and until >= float(rec["time"]) - self.tol):
                return (f"worker {rec['worker']} recorded an HTTP {rec['result']} "
                        f"for attempt {label}")
        return None

    def _lost_commit(self, written: float, until: float) -> str | None:
        """A restart of a server that is not durable between a commit and `until`."""
        if self.durable:
            return None
        for fault in self.faults:
            if (fault["fault"] == "restart_postgres" and fault["start"] <= until + self.tol
                    and fault_end(fault) >= written - self.tol):
                return (f"restart_postgres of a server that is not durable at "
                        f"{fault_span(fault)}")
        return None

    def _fault(self, d: dict[str, Any], until: float,
               applied: dict[str, Any] | None) -> str | None:
        job = int(d["job"])
        attempt = float(d["attempt"])
        label = attempt_label(attempt)
        for rec in self._events(job, attempt):
            if rec["kind"] == "write" and rec["result"] == "info":
                error = f" ({rec['error']})" if rec["error"] else ""
                return (f"connection lost during the result write of attempt {label} "
                        f"by {rec['worker']}{error}")
            if rec["kind"] == "failpoint":
                return (f"failpoint {rec['name']} fired in {rec['worker']} at "
                        f"{fmt(rec['time'])} for attempt {label}")
        received = float(d["received"])
        lo = self.claimed_at(job, attempt, received) - self.tol
        close = min(until, self.lease_end(job, attempt, received))
        if applied is not None:
            close = min(close, float(applied["time"]))
        hi = close + self.tol
        worker = self.worker_of(job, attempt, d["worker"])
        if worker is not None:
            for rec in self.deaths.get(worker, ()):
                if lo <= rec["time"] <= hi:
                    what = (f"failpoint {rec['name']}" if rec["kind"] == "failpoint"
                            else f"error stop ({rec['reason']})")
                    return (f"{what} ended {worker} at {fmt(rec['time'])} while it held "
                            f"attempt {label}")
        for fault in self.faults:
            kind = fault["fault"]
            top = hi
            if kind == "restart_postgres" and not self.durable:
                top = until + self.tol  # it may lose what was committed before it
            if not (fault["start"] <= top and fault_end(fault) >= lo):
                continue
            hits = False
            if kind in WORKER_FAULTS:
                hits = (worker is not None and fault["target"] == worker) or (
                    fault["job_id"] == d["job_id"]
                    and (fault["attempt"] is None or str(fault["attempt"]) == label)
                )
            elif kind in DATABASE_FAULTS:
                hits = True
            elif kind in TARGET_FAULTS:
                hits = fault["target"] in (None, d["target"])
            if hits:
                target = fault["target"] or "the run"
                return f"{kind} on {target} at {fault_span(fault)} overlaps attempt {label}"
        return None

    def late_success(self, d: dict[str, Any]) -> str | None:
        """Why a worker may have taken a 2xx answered after its HTTP timeout: the worker was
        paused during the call, so its timer could not fire before the answer was read."""
        worker = self.worker_of(int(d["job"]), float(d["attempt"]), d["worker"])
        lo, hi = float(d["received"]) - self.tol, float(d["answered"]) + self.tol
        for fault in self.faults:
            if (fault["fault"] == "pause_worker" and worker is not None
                    and fault["target"] == worker
                    and fault["start"] <= hi and fault_end(fault) >= lo):
                return (f"pause_worker on {worker} at {fault_span(fault)} overlaps the call "
                        f"of attempt {attempt_label(d['attempt'])}")
        return None

    def unreached(self, job: int, delivered: np.ndarray, max_attempts: int) -> list[int] | None:
        """The attempts of a dead-lettered job that never reached the target: its worker
        recorded an HTTP timeout or connection error for the attempt, and no delivery
        (`delivered`: the attempt headers of the job's deliveries) is of that attempt.
        Returned only when, with the attempts the target did see, they are exactly the
        attempts 1 to `max_attempts`: a correct queue spends them all before it gives up on
        a transient failure, so a job short of more than these was still given up on early,
        and attempt numbers outside them are a queue that numbers wrongly. None as well when
        a delivery has no attempt header to match (it may be one of those attempts)."""
        if not (delivered == np.round(delivered)).all():  # NaN: no header
            return None
        reached = set(delivered.astype(np.int64).tolist())
        unreached = sorted(
            a for a, events in self.attempts(job).items() if a not in reached and any(
                r["kind"] == "http" and r["result"] in ("timeout", "connection_error")
                for r in events))
        if unreached and reached.union(unreached) == set(range(1, max_attempts + 1)):
            return [int(a) for a in unreached]
        return None

    def ran_normally(self, job: int, attempt: float) -> bool:
        """Whether the attempt was claimed once, answered by the target and its result
        written: it ran as its script says, whatever fault was about, so it is one of the
        deliveries the oracle counts, never one a fault took away."""
        if math.isnan(attempt):
            return False
        events = self._events(job, attempt)
        return (sum(r["kind"] == "claim" for r in events) == 1
                and any(r["kind"] == "http" and r["result"] in ("ok", "http_error")
                        for r in events)
                and any(r["kind"] == "write" and r["result"] == "applied" for r in events))

    def fault_touched(self, job: int, job_id: str, max_attempts: int) -> str | None:
        """A recorded fault that hit one of this job's attempts without a delivery to show
        for it (a crash after claim, a kill before the call), inside that attempt's lease
        and before its result was applied."""
        of_job = self.attempts(job)
        for attempt in sorted(of_job):
            events = of_job[attempt]
            for rec in events:
                if rec["kind"] == "failpoint":
                    return f"failpoint {rec['name']} fired for attempt {attempt_label(attempt)}"
                if rec["kind"] == "write" and rec["result"] == "info":
                    return (f"the result write of attempt {attempt_label(attempt)} was lost "
                            "with its connection")
            why = self._attempt_hit(job, attempt, events)
            if why is not None:
                return why
        unlogged = self._unlogged_claim(job, max_attempts)
        if unlogged is not None:
            return unlogged
        for fault in self.faults:
            if fault["job_id"] == job_id:
                return f"{fault['fault']} hit attempt {fault['attempt']}"
        return None

    def _attempt_hit(self, job: int, attempt: float, events: list[dict[str, Any]]) -> str | None:
        """A death or a fault inside a claimed attempt that did not run normally."""
        claims = [r for r in events if r["kind"] == "claim"]
        if not claims:
            return None
        if len(claims) == 1 and any(r["kind"] == "release" and r["result"] == "applied"
                                    for r in events):
            # Given back unexecuted: it used up no attempt, so no fault that hit it can
            # explain an attempt the job is missing.
            return None
        if self.ran_normally(job, attempt):
            return None
        worker = str(claims[0]["worker"])
        start = min(float(r["time"]) for r in claims)
        close = self.lease_end(job, float(attempt), start)
        applied = self.applied_write(job, float(attempt))
        if applied is not None:
            close = min(close, float(applied["time"]))
        lo, hi = start - self.tol, close + self.tol
        for death in self.deaths.get(worker, ()):
            if lo <= death["time"] <= hi:
                return f"{worker} died while it held attempt {attempt_label(attempt)}"
        for fault in self.faults:
            kind = fault["fault"]
            hits = (kind in WORKER_FAULTS and fault["target"] == worker) or (
                kind in DATABASE_FAULTS)
            if hits and fault["start"] <= hi and fault_end(fault) >= lo:
                return (f"{kind} at {fault_span(fault)} overlaps attempt "
                        f"{attempt_label(attempt)}")
        return self._target_down(attempt, events, lo)

    def _target_down(self, attempt: float, events: list[dict[str, Any]], lo: float) -> str | None:
        """A call that timed out or could not connect while the target was hung or down:
        the fault, not the queue, used up this attempt (the target may not have recorded it
        at all). The call lies between the claim (`lo`) and its end."""
        for rec in events:
            if rec["kind"] != "http" or rec["result"] not in ("timeout", "connection_error"):
                continue
            for fault in self.faults:
                if (fault["fault"] in TARGET_FAULTS
                        and fault["start"] <= float(rec["end"]) + self.tol
                        and fault_end(fault) >= lo):
                    return (f"{fault['fault']} on {fault['target'] or 'the target'} at "
                            f"{fault_span(fault)} overlaps the failed call of attempt "
                            f"{attempt_label(attempt)}")
        return None

    def _unlogged_claim(self, job: int, max_attempts: int) -> str | None:
        """An attempt that left no event at all, with a worker killed in the gap where it
        belongs: a claim commits before its worker logs it, so a SIGKILL in between leaves an
        attempt the history cannot see (recovered later, it still used up the attempt). The
        gap runs from the last event of the attempt before to the claim of the attempt
        after; for an attempt after the last one seen, to when it was due at the latest
        (the longest retry wait, plus slack for the claim to come round). Never for a queue
        that counts received claims: a worker logs a claim before it confirms receiving it,
        so a claim it never logged was never received, and gave its attempt back."""
        if self.cfg.guarantees.attempts_count == "received":
            return None
        of_job = self.attempts(job)
        seen = set(of_job)
        if not seen:
            return None
        first_claim: dict[float, float] = {}
        last_event: dict[float, float] = {}
        for number in seen:
            times = [float(r["time"]) for r in of_job[number]]
            claims = [float(r["time"]) for r in of_job[number]
                      if r["kind"] == "claim"]
            first_claim[number] = min(claims or times)
            last_event[number] = max(times)
        for missing in sorted(set(range(1, int(max(max(seen), max_attempts)) + 1)) - seen):
            before = [n for n in seen if n < missing]
            after = [n for n in seen if n > missing]
            lo = (last_event[max(before)] if before else -math.inf) - self.tol
            hi = (first_claim[min(after)] if after else
                  lo + self.cfg.retry.cap_seconds + TRAILING_CLAIM_SLACK_SECONDS) + self.tol
            for fault in self.faults:
                if fault["fault"] == "kill_worker" and lo <= fault["start"] <= hi:
                    return (f"attempt {missing} left no event, and kill_worker on "
                            f"{fault['target']} at {fmt(fault['start'])} may have ended the "
                            "worker between committing its claim and logging it")
            for worker, deaths in self.deaths.items():
                for death in deaths:
                    if lo <= float(death["time"]) <= hi:
                        return (f"attempt {missing} left no event, and {worker} died at "
                                f"{fmt(death['time'])}, where that claim belongs")
        return None




def http_ends(h: History, job: np.ndarray, attempt: np.ndarray) -> np.ndarray:
    """For each (job, attempt), the earliest `end` a worker recorded for that attempt's
    HTTP call; NaN where none was recorded."""
    out = np.full(len(job), np.nan)
    ev = h.events
    http = ev[(ev["kind"] == "http") & ev["job"].isin(np.unique(job))]
    if not len(http):
        return out
    table = pd.DataFrame({
        "job": http["job"].to_numpy(),
        "attempt": http["attempt"].to_numpy(),
        "end": h.event_data.numbers("end", http.index.to_numpy()),
    }).dropna().groupby(["job", "attempt"], sort=False)["end"].min().reset_index()
    want = pd.DataFrame({"job": job, "attempt": attempt, "row": np.arange(len(job))})
    merged = want.merge(table, on=["job", "attempt"], how="inner")
    out[merged["row"].to_numpy()] = merged["end"].to_numpy()
    return out


def lease_last(h: History, jobs: np.ndarray) -> pd.DataFrame:
    """Per (job, attempt) of `jobs`: the last time its lease was taken or renewed (`last`),
    from the workers' claim and renewal events. A lease runs `lease_seconds` from there."""
    ev = h.events
    kinds = ev[ev["job"].isin(jobs) & ev["kind"].isin(["claim", "renew"])]
    renews = np.flatnonzero((kinds["kind"] == "renew").to_numpy())
    held = np.ones(len(kinds), dtype=bool)
    if len(renews):
        lost = h.event_data.field("lost", kinds.index.to_numpy()[renews])
        held[renews] = [v is not True for v in lost.tolist()]
    kinds = kinds[held]
    return (kinds.groupby(["job", "attempt"], sort=False)["time"].max()
            .rename("last").reset_index())

