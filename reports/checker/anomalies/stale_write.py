"""`stale_write`: a result applied for an attempt after another worker claimed a later
attempt of the job: each applied write against the claims of its job, the earliest later
attempt claimed before the write was sent (the event is logged after the commit, maybe much
later; `started` is when the statement went out)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pandas as pd

from skiplock.reports.checker.common import Example, attempt_number, fmt, records, shown
from skiplock.reports.checker.excuses import Excuses
from skiplock.reports.checker.frame import Frame


def candidates(f: Frame) -> pd.DataFrame:
    """The applied writes for an attempt older than the job's latest claim (each is stale if
    that claim came before the write was sent)."""
    ev, claims = f.h.events, f.claims
    applied = ev[(ev["job"] >= 0) & (ev["kind"] == "write") & (ev["result"] == "applied")]
    max_claim = np.full(len(f.h.job_ids), -np.inf)
    if len(claims):
        per_job = claims.groupby("job")["attempt"].max()
        max_claim[per_job.index.to_numpy()] = per_job.to_numpy()
    older: pd.DataFrame = applied[applied["attempt"].to_numpy()
                                  < max_claim[applied["job"].to_numpy()]]
    return older


def write_sent(f: Frame, writes: pd.DataFrame) -> np.ndarray:
    """When each write event's statement went out: its `started`, or the time it was logged
    (after the commit, maybe much later) where that is earlier or `started` is missing."""
    started = f.h.event_data.numbers("started", writes.index.to_numpy())
    logged = writes["time"].to_numpy()
    return np.where(np.isnan(started), logged, np.minimum(started, logged))


def find(f: Frame, e: Excuses) -> Iterator[Example]:
    older, claims = candidates(f), f.claims
    if not len(older):
        return
    cols = ["job", "attempt", "time", "worker"]
    writes = older[cols].reset_index(drop=True)
    writes["sent"] = write_sent(f, older)
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
