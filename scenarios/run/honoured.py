"""Settings a queue cannot honour: refused before a run starts, or dropped one fault at a time.

A backend declares what it promises (`skiplock.queue_impl.interface.Guarantees`). A scenario setting
that needs a promise the queue does not make is refused (exit 2, one line saying what to
change) rather than run and judged against a promise nobody made. A fault entry the queue
cannot feel (a claim-phase pause without a claim transaction, a PostgreSQL fault against a
queue kept in Redis) is dropped alone, said in one line of the run's output and recorded in
spec.json, so the scenario's other faults still run; only a scenario left with none of its
faults is refused. Settings whose checks only become not applicable (per-account limits on a
queue without them) are run: the verdict lists those checks as not applicable, and why.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from skiplock.queue_impl.interface import Guarantees
from skiplock.queue_impl.plugins import REDIS_BACKENDS
from skiplock.reports.fault_kinds import names_where
from skiplock.scenarios.run.spec import ScenarioSpec

# Faults that act on PostgreSQL: a queue kept elsewhere never feels them.
POSTGRES_FAULTS = names_where(lambda k: k.postgres)


def longest_retry_wait(spec: ScenarioSpec) -> float:
    """The uncapped exponential wait before a job's last attempt: base * 2^(max_attempts-2)."""
    return float(spec.retry_base * 2 ** max(spec.max_attempts - 2, 0))


def fault_unhonoured(entry: Any, backend: str, promised: Guarantees) -> str | None:
    """Why `backend` cannot feel the fault `entry` (a `[[nemesis]]` entry or a planned
    firing: anything with `kind` and `phase`), or None."""
    if backend in REDIS_BACKENDS and entry.kind in POSTGRES_FAULTS:
        return (f"backend {backend!r} keeps its queue in Redis: the {entry.kind} fault acts "
                "on PostgreSQL and would not reach it")
    if not promised.claim_transaction and entry.kind == "pause_worker" and entry.phase == "claim":
        return f"backend {backend!r} has no claim transaction to pause in"
    return None


def unhonoured(spec: ScenarioSpec, backend: str, promised: Guarantees) -> str | None:
    """Why `backend` cannot run `spec` at all (one line, with what to change), or None."""
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
    reasons = [fault_unhonoured(entry, backend, promised) for entry in spec.nemesis]
    if spec.nemesis and all(reasons):
        return (f"{reasons[0]}; none of the scenario's faults can act on it: run another "
                "scenario")
    return None


def honoured_faults(spec: ScenarioSpec, backend: str,
                    promised: Guarantees) -> tuple[ScenarioSpec, list[str]]:
    """`spec` without the fault entries `backend` cannot feel, and one line for each dropped
    (for the run's output and spec.json)."""
    kept, dropped = [], []
    for entry in spec.nemesis:
        why = fault_unhonoured(entry, backend, promised)
        if why is None:
            kept.append(entry)
        else:
            phase = f" (phase {entry.phase})" if entry.kind == "pause_worker" else ""
            dropped.append(f"fault dropped: {entry.kind}{phase} at {entry.at:g} s; {why}")
    if not dropped:
        return spec, []
    return dataclasses.replace(spec, nemesis=tuple(kept)), dropped
