"""`early_retry`: a retry sent before the backoff allows.

The bound is the retry policy's least delay after the failed attempt, from when the worker
saw it fail (its answer, its timeout, or the end the worker recorded). A retry after a lease
that expired with no result written is recovery, due at once. Redeliveries a fault explains
may not have counted as attempts: after one, the attempt header (or, without one, the count
less them) numbers the failed attempt."""

from __future__ import annotations

import math
from collections.abc import Iterator

from skiplock.reports.checker.common import Example, attempt_number, fmt, shown
from skiplock.reports.checker.explained import Explained
from skiplock.reports.checker.frame import Frame


def find(f: Frame, e: Explained) -> Iterator[Example]:
    rows, tol = f.rows, f.tolerance
    for p in rows.early_failures.tolist():
        j = int(rows.job[p])
        i = p + 1
        if rows.received[i] >= e.explainer.lease_end(j, float(rows.attempt[p]),
                                                     float(rows.received[p])) - tol \
                and not e.explainer.has_applied_write(j, float(rows.attempt[p])):
            continue  # the lease expired: recovery makes the job due at once
        bound = float(rows.min_delay[p])
        prior = sum(1 for r in f.job_rows[j]
                    if r <= p and not rows.first_of_job[r] and e.explains_redelivery(r))
        if prior:
            n = (int(rows.position[p]) - prior if math.isnan(rows.attempt[p])
                 else min(int(rows.position[p]), int(rows.attempt[p])))
            bound = f.cfg.retry.min_delay(max(n, 1))
            if rows.received[i] >= rows.fail_seen[p] + bound - tol:
                continue
        # Nothing else excuses it: a timeout or a fault is still a transient failure whose
        # write sets the backoff, and without that write the lease holds the job.
        yield Example(f.job_id(j), "before_backoff", {
            "received": float(rows.received[i]),
            "failed_attempt": attempt_number(rows.attempt[p]),
            "failed_at": float(rows.fail_seen[p]),
            "least_delay": bound,
        })


def say(x: Example) -> str:
    v = x.evidence
    gap = v["received"] - v["failed_at"]
    return (f"retry at {fmt(v['received'])} came {gap:.3f}s after attempt "
            f"{shown(v['failed_attempt'])} failed; the backoff allows no less than "
            f"{v['least_delay']:.3f}s")
