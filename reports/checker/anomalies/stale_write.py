"""`stale_write`: a result applied for an attempt after another worker claimed a later
attempt of the job: each applied write against the claims of its job, the earliest later
attempt claimed before the write was sent (the event is logged after the commit, maybe much
later; `started` is when the statement went out)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from skiplock.reports.checker.common import Example, attempt_number, fmt, records, shown
from skiplock.reports.checker.explained import Explained
from skiplock.reports.checker.frame import Frame, write_sent


def find(f: Frame, e: Explained) -> Iterator[Example]:
    candidates, claims = f.stale_candidates, f.claims
    if not len(candidates):
        return
    cols = ["job", "attempt", "time", "worker"]
    writes = candidates[cols].reset_index(drop=True)
    writes["sent"] = write_sent(f.h, candidates)
    writes["write"] = np.arange(len(writes))
    matched = writes.merge(claims[claims["job"].isin(writes["job"])][cols], on="job",
                           suffixes=("", "_claim"))
    matched = matched[(matched["attempt_claim"] > matched["attempt"])
                      & (matched["time_claim"] < matched["sent"] - f.tolerance)]
    stale = (matched.sort_values("time_claim", kind="stable")
             .drop_duplicates("write").sort_values("write"))
    for rec in records(stale):
        yield Example(f.job_id(int(rec["job"])), "applied_after_later_claim", {
            "worker": rec["worker"], "attempt": attempt_number(rec["attempt"]),
            "sent": float(rec["sent"]), "claimed_by": rec["worker_claim"],
            "claimed_attempt": attempt_number(rec["attempt_claim"]),
            "claimed_at": float(rec["time_claim"])})


def say(x: Example) -> str:
    v = x.evidence
    return (f"{v['worker']} applied its result for attempt {shown(v['attempt'])} at "
            f"{fmt(v['sent'])}, after {v['claimed_by']} claimed attempt "
            f"{shown(v['claimed_attempt'])} at {fmt(v['claimed_at'])}")
