"""`starvation`: a due job waited longer than the bound (`[objectives] starvation_wait`, else
two leases) while the queue claimed jobs of other accounts that became due after it, at
moments its own account had a free slot, in that claim's view and for a second before (or
has no limit). A queue that
serves jobs in the order they became due, within each account's limit, never does this; one
that serves one account first, or cannot see past a flooding account's backlog, does.

The time a fault that stops every worker covers (a server restart, every session cut, the
pool exhausted, a worker paused inside its claim) is not counted as waiting. A claim is the
workers' `claim` event (or the job's first delivery, where none was recorded): the waiting
job counts as served from when its claim was sent, the other job as taken when its claim
returned. Slots are counted as the queue counts them, from each claim to its result write
(`skiplock.reports.checker.waits`)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from skiplock.reports.checker.common import Example, fmt
from skiplock.reports.checker.excuses import Excuses
from skiplock.reports.checker.frame import Frame
from skiplock.reports.checker.waits import Held, covered_seconds, slots_held, waits

# Overtaking claims of one starved job searched at most (its example names the first).
_SEARCH = 100_000
# How long the account must have had a free slot before a claim of another account's later
# job counts against it: a slot freed by one worker's write is taken by the next claim that
# sees it, and a claim already under way elsewhere may take another account's job first.
FREE_FOR = 1.0


def find(f: Frame, e: Excuses) -> Iterator[Example]:
    w = f.derived(waits)
    bound = f.cfg.objectives.starvation_bound(f.cfg.lease_seconds)
    tol = f.tolerance
    # A job is served from when the claim that took it was sent (a slow claim took its rows
    # somewhere before it returned); another job was surely taken before it only if that
    # job's claim returned before then.
    served = w.claim_sent
    long_waits = np.flatnonzero(served - w.due > bound)
    if not len(long_waits):
        return
    order = np.argsort(w.claimed, kind="stable")
    c_time, c_due, c_account = w.claimed[order], w.due[order], w.account[order]
    c_job, c_sent = w.job[order], w.claim_sent[order]
    limits = f.cfg.account_limits
    held: dict[str, Held] = {}
    for i in long_waits.tolist():
        due, claimed, account = float(w.due[i]), float(served[i]), w.account[i]
        lo = np.searchsorted(c_time, due + bound, side="right")
        hi = min(np.searchsorted(c_time, claimed, side="left"), lo + _SEARCH)
        at = np.arange(lo, hi)
        at = at[(c_account[at] != account) & (c_due[at] > due + tol)]
        if not len(at):
            continue
        limit = limits.get(str(account))
        if limit is not None:
            if account not in held:
                held[account] = slots_held(f, str(account))
            # Free in the claim's own view, and for a second before it: fewer leases held
            # at any moment from a second before it was sent (its snapshot may predate
            # writes that freed slots since) to just after it returned (jobs of this
            # account it took beside the other one fill slots as it returns).
            slots = held[account]
            at = at[[slots.overlapping(sent - FREE_FOR, took + tol) < limit
                     for sent, took in zip(c_sent[at].tolist(), c_time[at].tolist(),
                                           strict=True)]]
        if len(w.stop_windows):
            waited = np.array([t - due - covered_seconds(w.stop_windows, due, t)
                               for t in c_time[at].tolist()])
            at = at[waited > bound]
        if not len(at):
            continue
        k = int(at[0])
        yield Example(f.job_id(int(w.job[i])), "overtaken", {
            "account": account, "limit": limit, "due": due,
            "claimed": claimed if w.delivered[i] or claimed < w.end else None,
            "waited": claimed - due, "bound": bound, "overtaken_by": len(at),
            "first_overtaker": {"job_id": f.job_id(int(c_job[k])), "account": c_account[k],
                                "due": float(c_due[k]), "claimed": float(c_time[k])},
        })


def say(x: Example) -> str:
    v = x.evidence
    who = v["first_overtaker"]
    free = ("no limit" if v["limit"] is None else f"a free slot of {v['limit']}")
    claimed = ("never claimed" if v["claimed"] is None
               else f"its claim sent at {fmt(v['claimed'])}")
    return (f"due at {fmt(v['due'])} ({v['account']}, {free}), {claimed}: waited "
            f"{v['waited']:.2f} s, bound {v['bound']:.2f} s, while {v['overtaken_by']} jobs of "
            f"other accounts due later were claimed, first {who['job_id']} ({who['account']}, "
            f"due {fmt(who['due'])}) at {fmt(who['claimed'])}")
