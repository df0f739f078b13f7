"""Which redeliveries a recorded fault or timeout explains, and by what: computed once, from
the frame, before any anomaly is decided, and passed to each of them.

- each repeated 2xx, with the explanation of the success before it (or none);
- each delivery that overlaps an earlier one of its job at the target, with the earlier
  delivery nothing excuses (or none), and the fault that excused it;
- the redeliveries a recorded fault explains: each may come on top of `max_attempts` (an
  HTTP timeout explains a repeated 2xx, but the timed-out attempt still used an attempt);
  for a queue that counts finished attempts only, that includes a re-pick under a number
  already delivered when a fault explains running the earlier pick again (its result never
  reached the queue, so the queue rightly runs the attempt once more);
- for a job, the fault that used up one of its attempts (`consumed`), and the attempts of a
  dead-lettered job that never reached the target (`unreached`)."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from skiplock.reports.checker.faults_over_attempts import Explainer, Why
from skiplock.reports.checker.frame import Frame


@dataclass(frozen=True)
class Overlap:
    """A delivery made while earlier ones of its job were in flight: `unexcused` is the
    first earlier delivery whose lease was still held with nothing to explain the overlap
    (None: all were excused), `fault` the first fault that explained one."""

    unexcused: int | None
    fault: Why | None


class Excuses:
    def __init__(self, frame: Frame) -> None:
        self.frame = frame
        self.explainer = Explainer(frame.h, frame.tolerance)
        self.extra_rows: set[int] = set()  # redeliveries a recorded fault explains
        self.extra: dict[int, int] = defaultdict(int)  # job -> how many of them
        self.fault_reason: dict[int, str] = {}  # job -> the first fault that explained one
        self.duplicates = self._duplicates()
        self.overlaps = self._overlaps()
        self._repicks()
        self._consumed: dict[int, str | None] = {}
        self.unreached = self._unreached_dead_letters()

    def _allow(self, j: int, i: int, why: Why) -> None:
        if i not in self.extra_rows:
            self.extra[j] += 1
            self.extra_rows.add(i)
        self.fault_reason.setdefault(j, why.text)

    def _duplicates(self) -> dict[int, tuple[int, Why | None]]:
        """Each repeated 2xx -> (the success before it, what explains running it again)."""
        f, rows = self.frame, self.frame.rows
        out: dict[int, tuple[int, Why | None]] = {}
        self.explainer.prefetch(rows.job[rows.duplicates].tolist())
        for i in rows.duplicates.tolist():
            j = int(rows.job[i])
            earlier = [r for r in f.rows_of(j) if r < i and rows.success_2xx[r]][-1]
            why = self.explainer.explain(f.record(earlier), float(rows.received[i]))
            if why is not None and why.fault:
                self._allow(j, int(i), why)
            out[int(i)] = (earlier, why)
        return out

    def _overlaps(self) -> dict[int, Overlap]:
        f, rows, tol = self.frame, self.frame.rows, self.frame.tolerance
        out: dict[int, Overlap] = {}
        self.explainer.prefetch(rows.job[rows.overlapping].tolist())
        for i in rows.overlapping.tolist():
            j = int(rows.job[i])
            overlapping = [r for r in f.rows_of(j)
                           if r < i and rows.target_end[r] > rows.received[i]]
            faults: list[Why] = []
            unexcused: int | None = None
            for r in overlapping:
                fault = self.explainer.explain(f.record(r), float(rows.received[i]),
                                               timeouts=False)
                if fault is not None:
                    faults.append(fault)
                    continue
                if self._abandoned(j, r, float(rows.received[i])):
                    continue
                if rows.received[i] >= self.explainer.lease_end(
                        j, float(rows.attempt[r]), float(rows.received[r])) - tol:
                    continue  # its lease had expired
                unexcused = r
                break
            if unexcused is None and faults:
                self._allow(j, int(i), faults[0])
            out[int(i)] = Overlap(unexcused, faults[0] if faults else None)
        return out

    def _repicks(self) -> None:
        """For a queue whose attempt number counts finished attempts: each delivery of a
        re-pick (keyed apart by its lease, so its number has a fraction) that follows a
        delivery under the same whole number, when a fault explains running that earlier
        pick again. An HTTP timeout does not: the worker that gave up still reports it."""
        f, rows = self.frame, self.frame.rows
        if f.cfg.guarantees.attempts_count != "finished":
            return
        number = np.floor(rows.attempt)
        repick = ~rows.first_of_job & (rows.attempt != number)
        repick[1:] &= number[:-1] == number[1:]
        self.explainer.prefetch(rows.job[repick].tolist())
        for r in np.flatnonzero(repick).tolist():
            why = self.explainer.explain(f.record(r - 1), float(rows.received[r]),
                                         timeouts=False)
            if why is not None:
                self._allow(int(rows.job[r]), r, why)

    def _abandoned(self, j: int, r: int, at: float) -> bool:
        """Whether delivery `r` was abandoned at its HTTP timeout by `at`."""
        rows = self.frame.rows
        timed_out = rows.late[r] or (rows.hang_forever[r] and not rows.is_answered[r])
        return bool(timed_out) and at >= self.explainer.gave_up(
            j, float(rows.attempt[r]), float(rows.received[r])) - self.frame.tolerance

    def explains_redelivery(self, r: int) -> bool:
        """Whether a fault explains delivery `r` coming after the one before it."""
        f = self.frame
        return r in self.extra_rows or self.explainer.explain(
            f.record(r - 1), float(f.rows.received[r]), timeouts=False) is not None

    def consumed(self, j: int) -> str | None:
        """A recorded fault that used up one of the job's attempts (an HTTP timeout does
        not count: the oracle already expects it)."""
        if j not in self._consumed:
            reason = self.fault_reason.get(j)
            if reason is None:
                reason = self._fault_on_a_delivery(j)
            if reason is None:
                reason = self.explainer.fault_touched(j, self.frame.job_id(j),
                                                      int(self.frame.h.job_max_attempts[j]))
            self._consumed[j] = reason
        return self._consumed[j]

    def _fault_on_a_delivery(self, j: int) -> str | None:
        f, rows = self.frame, self.frame.rows
        for r in f.rows_of(j):
            if self.explainer.ran_normally(j, float(f.record(r)["attempt"])):
                continue
            nxt_time = rows.next_received[r] if rows.same_next[r] else math.inf
            why = self.explainer.explain(f.record(r), float(nxt_time), timeouts=False)
            if why is not None:
                return why.text
        return None

    def _unreached_dead_letters(self) -> dict[int, list[int]]:
        """Dead-lettered jobs no fault explains, short of attempts that never reached the
        target (the worker is part of the system under test, so its word that the call
        failed to connect can be neither trusted nor refuted): job -> those attempts."""
        f, jobs = self.frame, self.frame.jobs
        out: dict[int, list[int]] = {}
        asked = np.flatnonzero(jobs.failed_vs_oracle).tolist() + [
            j for j in np.flatnonzero(jobs.failed_early).tolist() if not jobs.failed_vs_oracle[j]]
        self.explainer.prefetch(asked)
        for j in asked:
            if self.consumed(j) is not None:
                continue
            attempts = self.explainer.unreached(j, f.rows.attempt[f.rows_of(j)],
                                                int(f.h.job_max_attempts[j]))
            if attempts is not None:
                out[j] = attempts
        return out

    def absence_unjudged(self, j: int) -> bool:
        """Whether an acknowledged job without a final row, never delivered with 2xx, cannot
        be called lost: the snapshot is not whole, or (when run.json does not say) a fault
        used up its attempts."""
        complete = self.frame.jobs.snapshot_complete
        return complete is False or (complete is None and self.consumed(j) is not None)
