"""`concurrent_delivery`: two deliveries of one job in flight at once, the first one's lease
still held (and nothing recorded, no timeout and no fault, to excuse the overlap)."""

from __future__ import annotations

from collections.abc import Iterator

from skiplock.reports.checker.common import Example, attempt_number, fmt, shown
from skiplock.reports.checker.excuses import Excuses
from skiplock.reports.checker.frame import Frame


def find(f: Frame, e: Excuses) -> Iterator[Example]:
    rows = f.rows
    for i, overlap in e.overlaps.items():
        r = overlap.unexcused
        if r is None:
            continue
        yield Example(f.job_id(int(rows.job[i])), "lease_held", {
            "received": float(rows.received[i]),
            "attempt": attempt_number(rows.attempt[i]),
            "in_flight_attempt": attempt_number(rows.attempt[r]),
            "in_flight_received": float(rows.received[r]),
        })


def say(x: Example) -> str:
    v = x.evidence
    return (f"delivery at {fmt(v['received'])} (attempt {shown(v['attempt'])}) while attempt "
            f"{shown(v['in_flight_attempt'])} from {fmt(v['in_flight_received'])} was still "
            "in flight with its lease held")
