"""`lost`: an acknowledged enqueue never delivered with 2xx and not legitimately
dead-lettered: absent from the final states (judged only when the snapshot is known to be
whole or no fault touched the job), marked COMPLETED, or FAILED though its script completes
and no fault used up its attempts."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from skiplock.reports.checker.common import Example
from skiplock.reports.checker.excuses import Excuses
from skiplock.reports.checker.frame import Frame


def candidates(f: Frame) -> np.ndarray:
    """Acknowledged jobs never delivered with 2xx and not live, less those their oracle
    dead-letters and the queue dead-lettered (a mask over jobs)."""
    jobs = f.jobs
    mask: np.ndarray = ((f.h.job_ack == 1) & ~jobs.any_2xx & ~jobs.is_live
                        & ~(jobs.is_failed & ~f.oracle.expected_completed))
    return mask


def find(f: Frame, e: Excuses) -> Iterator[Example]:
    jobs = f.jobs
    lost = np.flatnonzero(candidates(f))
    e.explainer.prefetch(lost.tolist())
    for j in lost.tolist():
        if jobs.is_missing[j]:
            if not e.absence_unjudged(j):
                yield Example(f.job_id(j), "absent", {})
        elif jobs.is_completed[j]:
            yield Example(f.job_id(j), "completed", {})
        elif jobs.is_failed[j] and (not f.oracle.expected_completed[j]
                                    or e.consumed(j) is not None):
            continue  # legitimately dead-lettered
        elif jobs.is_failed[j] and j in e.unreached:
            continue  # unknown: attempts that never reached the target
        else:
            yield Example(f.job_id(j), "failed", {"deliveries": int(jobs.delivered[j])})


def say(x: Example) -> str:
    if x.case == "absent":
        return ("enqueue acknowledged, never delivered with 2xx, absent from the final "
                "states")
    if x.case == "completed":
        return "enqueue acknowledged, marked COMPLETED but never delivered with 2xx"
    return (f"enqueue acknowledged, FAILED after {x.evidence['deliveries']} deliveries "
            "without 2xx, though its script completes and no fault consumed its attempts")
