"""`duplicate_explained`: a 2xx delivered again, explained by a recorded fault or timeout.
At-least-once delivery promises these may happen: counted, never a violation."""

from __future__ import annotations

from collections.abc import Iterator

from skiplock.reports.checker.common import Example, attempt_number
from skiplock.reports.checker.excuses import Excuses
from skiplock.reports.checker.frame import Frame


def find(f: Frame, e: Excuses) -> Iterator[Example]:
    rows = f.rows
    for i, (_, why) in e.duplicates.items():
        if why is not None:
            yield Example(f.job_id(int(rows.job[i])), "fault" if why.fault else "timeout", {
                "received": float(rows.received[i]),
                "attempt": attempt_number(rows.attempt[i]),
                "explained_by": why.text,
            })


def say(x: Example) -> str:
    return str(x.evidence["explained_by"])
