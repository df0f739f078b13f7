"""`limit_exceeded`: more deliveries of one account in flight than its limit, from delivery
intervals as the queue sees them (`skiplock.reports.checker.slots`)."""

from __future__ import annotations

from collections.abc import Iterator

from skiplock.reports.checker.common import Example, fmt
from skiplock.reports.checker.excuses import Excuses
from skiplock.reports.checker.frame import Frame
from skiplock.reports.checker.slots import account_slots


def find(f: Frame, e: Excuses) -> Iterator[Example]:
    slots, rows = f.derived(account_slots), f.rows
    for row, count in zip(slots.over.tolist(), slots.in_flight.tolist(), strict=True):
        yield Example(f.job_id(int(rows.job[row])), "over_limit", {
            "account": slots.account[row], "in_flight": int(count),
            "received": float(rows.received[row]), "limit": int(slots.limit[row])})


def say(x: Example) -> str:
    v = x.evidence
    return (f"account {v['account']} had {v['in_flight']} deliveries in flight at "
            f"{fmt(v['received'])}, limit {v['limit']}")
