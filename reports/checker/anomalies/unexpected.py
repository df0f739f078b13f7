"""`unexpected`: a delivery of a job never enqueued, or whose enqueue failed."""

from __future__ import annotations

from collections.abc import Iterator

from skiplock.reports.checker.common import Example, fmt, records
from skiplock.reports.checker.excuses import Excuses
from skiplock.reports.checker.frame import Frame


def find(f: Frame, e: Excuses) -> Iterator[Example]:
    for rec in records(f.rows.unexpected):
        evidence = {"received": rec["received"], "target": rec["target"]}
        if not rec["job_id"]:
            yield Example("", "no_job_id", evidence)
        elif rec["job"] < 0:
            yield Example(rec["job_id"], "never_enqueued", evidence)
        else:
            yield Example(rec["job_id"], "enqueue_failed", evidence)


def say(x: Example) -> str:
    target = x.evidence["target"]
    if x.case == "no_job_id":
        return (f"a request without a job id header at {fmt(x.evidence['received'])} "
                f"(target {target})")
    what = ("delivered but never enqueued" if x.case == "never_enqueued"
            else "delivered although its enqueue failed")
    return f"{what} (target {target})"
