"""Account slots over time: deliveries of limited accounts as intervals, as the queue sees
them. A delivery the worker abandoned on its timeout (when the worker recorded it gave up, or
else the target's receipt plus the timeout) no longer holds a slot, nor does one
made after its own lease had run out (recovery had freed that slot for the job's next
attempt)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from skiplock.reports.checker.common import objects
from skiplock.reports.checker.faults_over_attempts import http_ends, lease_last
from skiplock.reports.checker.frame import Frame

_NONE = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Slots:
    """`over`: the delivery rows that found their account full, with `in_flight` (how many
    were in flight then); `excused`: rows of accounts that looked full, left out because
    their own lease had run out when they were made. `account` and `limit` per row."""

    over: np.ndarray
    in_flight: np.ndarray
    excused: np.ndarray
    account: np.ndarray
    limit: np.ndarray


def account_slots(f: Frame) -> Slots:
    rows, h, tol = f.rows, f.h, f.tolerance
    empty = Slots(_NONE, _NONE, _NONE, np.zeros(0, dtype=object), np.zeros(0))
    limits = {k: v for k, v in h.config.account_limits.items() if v is not None}
    if not limits or not len(rows.d):
        return empty
    # The account comes from the enqueue (configuration), not from a header the queue sent.
    account = h.job_account[rows.job]
    account = np.where(pd.isna(account), objects(rows.d["account"]), account)
    limit = pd.Series(account).map(limits).to_numpy(dtype="float64")
    limited = np.flatnonzero(~np.isnan(limit))
    if not len(limited):
        return empty
    abandoned = rows.received + h.config.http_timeout_seconds - tol
    queue_end = np.where(rows.late | (~rows.is_answered & rows.hang_forever),
                         np.minimum(rows.target_end, abandoned), rows.target_end)
    over, counts = _over_limit(limited, account, limit, rows.received, queue_end)
    if len(over):
        # A request the worker gave up on is given up when its timeout fired, which the
        # worker recorded (its http end): that may be before received + timeout, since the
        # timer starts before the request reaches the target. Looked up only when some
        # account looked full, for that account's late or hanging deliveries.
        suspects = limited[np.isin(account[limited], np.unique(account[over]))]
        late = suspects[(rows.late | (~rows.is_answered & rows.hang_forever))[suspects]]
        ends = http_ends(h, rows.job[late], rows.attempt[late]) if len(late) else late
        known = ~np.isnan(ends)
        if known.any():
            queue_end = queue_end.copy()
            at = late[known]
            queue_end[at] = np.minimum(queue_end[at], np.maximum(ends[known], rows.received[at]))
            over, counts = _over_limit(limited, account, limit, rows.received, queue_end)
    stale = _NONE
    if len(over):
        # A worker that resumes past its lease (paused, stalled) and makes its call anyway
        # holds no slot. The lease is the configured one from the attempt's last claim or
        # renewal. Looked up only when some account looked full, for that account's
        # deliveries.
        suspects = limited[np.isin(account[limited], np.unique(account[over]))]
        last = lease_last(h, np.unique(rows.job[suspects]))
        want = pd.DataFrame({"job": rows.job[suspects], "attempt": rows.attempt[suspects],
                             "row": suspects})
        merged = want.merge(last, on=["job", "attempt"], how="inner")
        at = merged["row"].to_numpy()
        expired = (rows.received[at]
                   >= merged["last"].to_numpy() + h.config.lease_seconds - tol)
        stale = np.sort(at[expired])
        if len(stale):
            over, counts = _over_limit(np.setdiff1d(limited, stale), account, limit,
                                       rows.received, queue_end)
    return Slots(over, counts, stale, account, limit)


def _over_limit(rows: np.ndarray, account: np.ndarray, limit: np.ndarray,
                start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows (of `rows`) that found their account full, and how many were in flight."""
    n = len(rows)
    events = pd.DataFrame({
        "account": np.concatenate([account[rows], account[rows]]),
        "time": np.concatenate([start[rows], end[rows]]),
        # Ends sort before starts at the same instant: a slot freed then taken is not two.
        "delta": np.concatenate([np.ones(n, dtype=np.int64), -np.ones(n, dtype=np.int64)]),
        "row": np.concatenate([rows, rows]),
    })
    events = events.sort_values(["account", "time", "delta"], kind="stable")
    running = events.groupby("account", sort=False)["delta"].cumsum().to_numpy()
    starts = events["delta"].to_numpy() == 1
    over = starts & (running > limit[events["row"].to_numpy()])
    return events["row"].to_numpy()[over], running[over]
