"""`attempts_exceeded`: more deliveries than max_attempts (redeliveries a recorded fault
explains aside), a delivery after a permanent failure, or more committed claims than
max_attempts (a fault may explain a repeated delivery, never an extra claim the queue
committed). A claim given back by an applied release used no attempt; under pg-long-tx a
claim commits only with its result, so a claim whose worker died is rolled back and the
claim rule is not applied there; nor for a queue that declares it counts finished attempts
only (a pick whose worker died is not counted: BullMQ, pgqueuer), whose deliveries and
permanent failures are still held to it. A queue that counts received claims (the reference)
gives back a claim nobody received, and picks the job again under the same attempt number:
there the claims counted are the distinct attempt numbers its claims carried."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pandas as pd

from skiplock.reports.checker.common import Example, attempt_number, fmt, shown
from skiplock.reports.checker.excuses import Excuses
from skiplock.reports.checker.frame import PERMANENT, Frame


def find(f: Frame, e: Excuses) -> Iterator[Example]:
    exceeded: dict[int, Example] = {}
    for j, x in _too_many_deliveries(f, e):
        exceeded[j] = x
    for j, x in _after_permanent(f, e, exceeded):
        exceeded[j] = x
    if f.cfg.guarantees.attempts_count in ("claims", "received"):
        for j, x in _too_many_claims(f):
            exceeded.setdefault(j, x)
    yield from exceeded.values()


def _too_many_deliveries(f: Frame, e: Excuses) -> Iterator[tuple[int, Example]]:
    delivered = f.jobs.delivered
    for j in np.flatnonzero(delivered > f.h.job_max_attempts).tolist():
        extra = e.extra.get(j, 0)
        count = int(delivered[j])
        if count - extra > f.h.job_max_attempts[j]:
            yield j, Example(f.job_id(j), "deliveries", {
                "deliveries": count, "explained_by_faults": extra,
                "max_attempts": int(f.h.job_max_attempts[j])})


def after_permanent(f: Frame) -> np.ndarray:
    """Deliveries after one the worker saw fail permanently."""
    rows = f.rows
    permanent = (rows.seen == PERMANENT).astype(np.int64)
    rank = pd.Series(permanent).groupby(rows.job, sort=False).cumsum().to_numpy()
    return np.flatnonzero((rank - permanent) >= 1)


def _after_permanent(f: Frame, e: Excuses,
                     exceeded: dict[int, Example]) -> Iterator[tuple[int, Example]]:
    rows = f.rows
    found: set[int] = set()
    after = after_permanent(f)
    e.explainer.prefetch(rows.job[after].tolist())
    for i in after.tolist():
        j = int(rows.job[i])
        if j in exceeded or j in found:
            continue
        perm = [r for r in f.rows_of(j) if r < i and rows.seen[r] == PERMANENT][-1]
        if e.explainer.explain(f.record(perm), float(rows.received[i])) is None:
            found.add(j)
            yield j, Example(f.job_id(j), "after_permanent", {
                "received": float(rows.received[i]),
                "failed_attempt": attempt_number(rows.attempt[perm]),
                "status": int(rows.status[perm])})


def _too_many_claims(f: Frame) -> Iterator[tuple[int, Example]]:
    events = f.h.events
    if f.cfg.backend == "pg-long-tx" or not len(events) or "job" not in events:
        return
    of_job = events["job"] >= 0
    claims = events[of_job & (events["kind"] == "claim")]
    if f.cfg.guarantees.attempts_count == "received":
        # A re-pick under an earlier pick's number is keyed a fraction above it (by lease).
        numbers = np.floor(claims["attempt"].to_numpy())
        claimed = pd.Series(numbers, index=claims.index).groupby(claims["job"]).nunique()
        given_back = pd.Series(dtype=np.int64)
    else:
        claimed = claims.groupby("job").size()
        given_back = events[of_job & (events["kind"] == "release")
                            & (events["result"] == "applied")].groupby("job").size()
    committed = claimed.sub(given_back, fill_value=0)
    if not len(committed):
        return
    limits = f.h.job_max_attempts[committed.index.to_numpy()]
    for j, count in committed[committed.to_numpy() > limits].items():
        yield int(j), Example(f.job_id(int(j)), "claims", {
            "claims": int(count), "max_attempts": int(f.h.job_max_attempts[int(j)]),
            "released": int(given_back.get(j, 0))})


def say(x: Example) -> str:
    v = x.evidence
    if x.case == "deliveries":
        return (f"{v['deliveries']} deliveries ({v['explained_by_faults']} explained by "
                f"faults) for max_attempts {v['max_attempts']}")
    if x.case == "after_permanent":
        return (f"delivered again at {fmt(v['received'])} after attempt "
                f"{shown(v['failed_attempt'])} failed permanently (status {v['status']})")
    return (f"{v['claims']} committed claims for max_attempts {v['max_attempts']} "
            f"({v['released']} given back by release)")
