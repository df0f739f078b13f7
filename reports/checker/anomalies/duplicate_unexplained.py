"""`duplicate_unexplained`: a 2xx delivered again with nothing recorded to explain it."""

from __future__ import annotations

from collections.abc import Iterator

from skiplock.reports.checker.common import Example, attempt_number, fmt, shown
from skiplock.reports.checker.excuses import Excuses
from skiplock.reports.checker.frame import Frame


def find(f: Frame, e: Excuses) -> Iterator[Example]:
    rows = f.rows
    for i, (earlier, why) in e.duplicates.items():
        if why is not None:
            continue
        yield Example(f.job_id(int(rows.job[i])), "unexplained", {
            "received": float(rows.received[i]),
            "attempt": attempt_number(rows.attempt[i]),
            "worker": f.record(i)["worker"],
            "succeeded_attempt": attempt_number(rows.attempt[earlier]),
            "succeeded_worker": f.record(earlier)["worker"],
            "succeeded_received": float(rows.received[earlier]),
        })


def say(x: Example) -> str:
    v = x.evidence
    return (f"2xx delivered again at {fmt(v['received'])} (attempt {shown(v['attempt'])} by "
            f"{v['worker']}) after attempt {shown(v['succeeded_attempt'])} by "
            f"{v['succeeded_worker']} succeeded at {fmt(v['succeeded_received'])}; nothing "
            "recorded explains it")
