"""Settings a queue cannot honour, refused before a run starts anything.

A backend declares what it promises (`skiplock.queue_impl.interface.Guarantees`). A scenario setting
that needs a promise the queue does not make is refused (exit 2, one line saying what to
change) rather than run and judged against a promise nobody made. Settings whose checks only
become not applicable (per-account limits on a queue without them) are run: the verdict lists
those checks as not applicable, and why.
"""

from __future__ import annotations

from skiplock.queue_impl.interface import Guarantees
from skiplock.queue_impl.plugins import REDIS_BACKENDS
from skiplock.reports.fault_kinds import names_where
from skiplock.scenarios.run.spec import ScenarioSpec

# Faults that act on PostgreSQL: a queue kept elsewhere never feels them.
POSTGRES_FAULTS = names_where(lambda k: k.postgres)


def longest_retry_wait(spec: ScenarioSpec) -> float:
    """The uncapped exponential wait before a job's last attempt: base * 2^(max_attempts-2)."""
    return float(spec.retry_base * 2 ** max(spec.max_attempts - 2, 0))


def unhonoured(spec: ScenarioSpec, backend: str, promised: Guarantees) -> str | None:
    """Why `backend` cannot run `spec` as written (one line, with what to change), or None."""
    if not promised.retry_cap and spec.max_attempts > 1:
        longest = longest_retry_wait(spec)
        if longest > spec.retry_cap:
            return (f"backend {backend!r} cannot honour retry_cap = {spec.retry_cap:g}: its "
                    f"backoff has no cap and waits {longest:g} s before attempt "
                    f"{spec.max_attempts}; use --set retry_cap={longest:g} or a lower "
                    "max_attempts")
    if not promised.recovery_switch and not spec.recovery:
        return (f"backend {backend!r} runs its own recovery of expired leases, which cannot "
                "be switched off: leave out recovery = false (--no-recovery)")
    for entry in spec.nemesis:
        if backend in REDIS_BACKENDS and entry.kind in POSTGRES_FAULTS:
            return (f"backend {backend!r} keeps its queue in Redis: the {entry.kind} fault acts "
                    "on PostgreSQL and would not reach it; leave that fault out")
        if (not promised.claim_transaction and entry.kind == "pause_worker"
                and entry.phase == "claim"):
            return (f"backend {backend!r} has no claim transaction to pause in: give the "
                    "pause_worker fault phase = \"lease\"")
    return None
