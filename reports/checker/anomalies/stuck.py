"""`stuck`: a job not finished after a completed drain. (When the drain timed out, live jobs
make the answer unknown instead: `skiplock.reports.checker.judge`.)"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from skiplock.reports.checker.common import Example
from skiplock.reports.checker.excuses import Excuses
from skiplock.reports.checker.frame import Frame


def find(f: Frame, e: Excuses) -> Iterator[Example]:
    if not f.cfg.drained:
        return
    jobs = f.jobs
    for j in np.flatnonzero(jobs.is_live & jobs.exists).tolist():
        yield Example(f.job_id(j), "live_after_drain", {
            "status": str(jobs.status[j]), "deliveries": int(jobs.delivered[j])})


def say(x: Example) -> str:
    return f"{x.evidence['status']} after the drain, {x.evidence['deliveries']} deliveries"
