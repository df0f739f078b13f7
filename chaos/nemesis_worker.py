"""Faults on the dispatcher's worker processes: real signals, and the crash failpoints.

A worker is chosen among those that hold a lease at that moment (by their event logs), so
a kill or a pause always lands mid-lease, where it can cost a job; a firing that finds no
worker holding a lease is recorded as skipped rather than spent on an idle process.
"""

from __future__ import annotations

import signal
import time

from chaos.nemesis import Fault, FaultSkipped, register

# How long a firing waits for some worker to hold a lease (under light load a worker holds
# its leases for milliseconds at a time), and how often it looks.
HOLDER_WAIT_SECONDS = 2.0
HOLDER_POLL_SECONDS = 0.003


def _choose_holders(fault: Fault) -> list[str]:
    deadline = time.monotonic() + HOLDER_WAIT_SECONDS
    while not (holders := sorted(fault.ctx.workers_holding_leases())):
        if time.monotonic() >= deadline:
            raise FaultSkipped(f"no worker held a lease within {HOLDER_WAIT_SECONDS:g} s")
        time.sleep(HOLDER_POLL_SECONDS)
    return fault.rng.sample(holders, min(fault.planned.count, len(holders)))


@register
class KillWorker(Fault):
    """SIGKILL workers that hold leases: their leases must expire and be recovered, and
    a call they had sent may be delivered again (explained by this event)."""

    kind = "kill_worker"

    def apply(self) -> list[str | None]:
        chosen = _choose_holders(self)
        for worker in chosen:
            self.ctx.signal_worker(worker, signal.SIGKILL)
        return list(chosen)


@register
class PauseWorker(Fault):
    """SIGSTOP workers that hold leases for `duration` (by default longer than the lease),
    then SIGCONT: their leases expire and pass to others meanwhile, so their late result
    writes must be fenced, and their late calls are explained by this event."""

    kind = "pause_worker"

    def apply(self) -> list[str | None]:
        self._paused = _choose_holders(self)
        for worker in self._paused:
            self.ctx.signal_worker(worker, signal.SIGSTOP)
        self.data["seconds"] = self.planned.duration
        return list(self._paused)

    def heal(self) -> None:
        for worker in getattr(self, "_paused", ()):
            self.ctx.signal_worker(worker, signal.SIGCONT)


class _FailpointWindow(Fault):
    """Open a crash failpoint in every worker for `duration`: each job then kills its
    worker with `probability` at that point. The crash itself is the worker's own
    `failpoint` event (which names the job and attempt); this event is the window."""

    def apply(self) -> list[str | None]:
        self.data["probability"] = self.planned.probability
        self.ctx.set_failpoint(self.kind, self.planned.probability)
        return [None]

    def heal(self) -> None:
        self.ctx.set_failpoint(self.kind, 0.0)


@register
class CrashAfterClaim(_FailpointWindow):
    """Die after the claim committed, before any HTTP call: the lease must be recovered and
    the job delivered once, later."""

    kind = "crash_after_claim"


@register
class CrashAfterHttp(_FailpointWindow):
    """Die after a successful HTTP call, before the result write: the job is delivered again
    (an explained duplicate), and must still end COMPLETED exactly as its script says."""

    kind = "crash_after_http"
