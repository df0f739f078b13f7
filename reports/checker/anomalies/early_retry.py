"""`early_retry`: a retry sent before the backoff allows.

The bound is the retry policy's least delay after the failed attempt, from when the worker
saw it fail (its answer, its timeout, or the end the worker recorded). A retry after a lease
that expired with no result written is recovery, due at once. Redeliveries a fault explains
may not have counted as attempts: after one, the attempt header (or, without one, the count
less them) numbers the failed attempt."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from skiplock.reports.checker.common import Example, attempt_number, fmt, shown
from skiplock.reports.checker.excuses import Excuses
from skiplock.reports.checker.faults_over_attempts import http_ends
from skiplock.reports.checker.frame import TRANSIENT, Frame


@dataclass(frozen=True)
class Backoff:
    """Per delivery: when the worker saw it fail, and the least delay its failure asks for;
    `early`: the transient failures followed by the job's next delivery sooner than that."""

    fail_seen: np.ndarray
    min_delay: np.ndarray
    early: np.ndarray


def candidates(f: Frame) -> Backoff:
    rows, cfg, tolerance = f.rows, f.cfg, f.tolerance
    timeout = cfg.http_timeout_seconds
    received, job = rows.received, rows.job
    # The failed attempt's number is the target's own count (the header is the queue's
    # word; it is used only where an explained redelivery precedes, see below).
    n_for_policy = rows.position.astype(np.int64)
    # The policy itself decides each bound (a few distinct attempt numbers, looked up).
    numbers = np.unique(n_for_policy)
    bounds = np.array([cfg.retry.min_delay(int(n)) for n in numbers], dtype=np.float64)
    min_delay = (bounds[np.searchsorted(numbers, n_for_policy)] if len(numbers)
                 else np.zeros(0))
    timed_out = ~rows.in_time & (rows.late | rows.hang_forever)
    fail_seen = np.where(rows.in_time, rows.answered,
                         np.where(timed_out, received + timeout - tolerance, received))
    # The worker's own end of a timed-out call, when it recorded one: its timer started
    # before the target saw the request, so the failure may predate received + timeout.
    ask = np.flatnonzero(timed_out & rows.same_next)
    if len(ask):
        ends = http_ends(f.h, job[ask], rows.attempt[ask])
        has = ~np.isnan(ends)
        fail_seen[ask[has]] = np.maximum(ends[has], received[ask[has]])
    gap_ok = rows.next_received >= fail_seen + min_delay - tolerance
    early = np.flatnonzero(rows.same_next & (rows.seen == TRANSIENT) & ~gap_ok)
    return Backoff(fail_seen=fail_seen, min_delay=min_delay, early=early)


def find(f: Frame, e: Excuses) -> Iterator[Example]:
    rows, tol = f.rows, f.tolerance
    backoff = candidates(f)
    e.explainer.prefetch(rows.job[backoff.early].tolist())
    for p in backoff.early.tolist():
        j = int(rows.job[p])
        i = p + 1
        if rows.received[i] >= e.explainer.lease_end(j, float(rows.attempt[p]),
                                                     float(rows.received[p])) - tol \
                and not e.explainer.has_applied_write(j, float(rows.attempt[p])):
            continue  # the lease expired: recovery makes the job due at once
        bound = float(backoff.min_delay[p])
        prior = sum(1 for r in f.rows_of(j)
                    if r <= p and not rows.first_of_job[r] and e.explains_redelivery(r))
        if prior:
            n = (int(rows.position[p]) - prior if math.isnan(rows.attempt[p])
                 else min(int(rows.position[p]), int(rows.attempt[p])))
            bound = f.cfg.retry.min_delay(max(n, 1))
            if rows.received[i] >= backoff.fail_seen[p] + bound - tol:
                continue
        # Nothing else excuses it: a timeout or a fault is still a transient failure whose
        # write sets the backoff, and without that write the lease holds the job.
        yield Example(f.job_id(j), "before_backoff", {
            "received": float(rows.received[i]),
            "failed_attempt": attempt_number(rows.attempt[p]),
            "failed_at": float(backoff.fail_seen[p]),
            "least_delay": bound,
        })


def say(x: Example) -> str:
    v = x.evidence
    gap = v["received"] - v["failed_at"]
    return (f"retry at {fmt(v['received'])} came {gap:.3f}s after attempt "
            f"{shown(v['failed_attempt'])} failed; the backoff allows no less than "
            f"{v['least_delay']:.3f}s")
