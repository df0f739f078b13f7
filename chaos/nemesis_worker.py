"""Faults on the dispatcher's worker processes: real signals, and the crash failpoints.

A worker is chosen among those that hold a lease at that moment (by their event logs), so
a kill or a pause always lands mid-lease, where it can cost a job; a firing that finds no
worker holding a lease is recorded as skipped rather than spent on an idle process.
"""

from __future__ import annotations

import signal
import time

from skiplock.chaos.nemesis import Fault, FaultSkipped, register
from skiplock.queue_impl.dispatcher import (
    PAUSE_IN_CLAIM,
    PAUSE_IN_CLAIM_FIRING,
    PAUSE_IN_CLAIM_SECONDS,
)

# How long a firing waits for some worker to hold a lease (under light load a worker holds
# its leases for milliseconds at a time), and how often it looks.
HOLDER_WAIT_SECONDS = 2.0
HOLDER_POLL_SECONDS = 0.003
# How long a claim-phase pause waits for some worker to claim.
CLAIM_STALL_WAIT_SECONDS = 5.0


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
    """Freeze workers for `duration` (by default longer than the lease).

    phase "lease": SIGSTOP workers that hold leases, then SIGCONT. Their leases expire and
    pass to others meanwhile, so their late result writes must be fenced, and their late
    calls are explained by this event.

    phase "claim": the next worker to claim stalls inside its claim transaction, after the
    claim's UPDATE and before its COMMIT (the `pause_in_claim` failpoint: the worker sleeps
    there, its backend idle in transaction), so the leases it will get are already running
    out, and its account rows stay locked, when it wakes. It must not send on leases that
    expired meanwhile and were recovered. The worker is found by its session in
    pg_stat_activity; the event's window runs from the failpoint's opening to the wake-up."""

    kind = "pause_worker"

    def apply(self) -> list[str | None]:
        self.data["seconds"] = self.planned.duration
        if self.planned.phase == "claim":
            return self._stall_a_claim()
        self._paused = _choose_holders(self)
        for worker in self._paused:
            self.ctx.signal_worker(worker, signal.SIGSTOP)
        return list(self._paused)

    def _stall_a_claim(self) -> list[str | None]:
        self.data["phase"] = "claim"
        seconds = self.planned.duration
        # The failpoint file's keys, as the dispatcher reads them: how long the stalled worker
        # sleeps, and a number of this firing's own, so only the first claimer takes it.
        self.ctx.set_failpoint(PAUSE_IN_CLAIM_SECONDS, seconds)
        self.ctx.set_failpoint(PAUSE_IN_CLAIM_FIRING, float(time.time_ns() // 1_000_000))
        opened = time.time()
        self.ctx.set_failpoint(PAUSE_IN_CLAIM, 1.0)
        found: dict[str, float] = {}
        deadline = time.monotonic() + CLAIM_STALL_WAIT_SECONDS
        try:
            while not found and time.monotonic() < deadline:
                found.update(self._stalled_claims(opened))
                time.sleep(0.02)
        finally:
            self.ctx.set_failpoint(PAUSE_IN_CLAIM, 0.0)
        # A worker that decided to stall just before the window closed is asleep by now.
        time.sleep(0.1)
        found.update(self._stalled_claims(opened))
        if not found:
            raise FaultSkipped(f"no worker claimed within {CLAIM_STALL_WAIT_SECONDS:g} s")
        # The window starts when the first stall did, not when the failpoint opened: a batch
        # the worker finished in between was not touched, and must not be explained by it.
        self.started_at = min(found.values())
        # Each sleeper wakes by itself `seconds` after it stalled.
        self._awake_at = max(found.values()) + seconds
        return list[str | None](sorted(found))

    def _stalled_claims(self, opened: float) -> dict[str, float]:
        """Workers whose lease session went idle inside a transaction since the failpoint
        opened (only a stalled claim leaves it so: the reference queue commits every other
        transaction at once), each with when it stalled by this process's clock (the server
        says how long ago, so no clock is shared with it)."""
        import psycopg

        from skiplock.chaos.nemesis_db import like_prefix

        since = time.time() - opened + 0.05
        with psycopg.connect(self.ctx.dsn, autocommit=True, connect_timeout=2,
                             application_name="skiplock-harness-pause") as conn:
            rows = conn.execute(
                "SELECT application_name,"
                " extract(epoch FROM clock_timestamp() - state_change)::float8"
                " FROM pg_stat_activity"
                " WHERE application_name LIKE %s ESCAPE '\\'"
                " AND state = 'idle in transaction'"
                " AND state_change >= clock_timestamp() - make_interval(secs => %s)",
                [like_prefix(self.ctx.app_prefix), since],
            ).fetchall()
        now = time.time()
        return {str(name)[len(self.ctx.app_prefix):].removesuffix("-lease"): now - float(age)
                for name, age in rows if str(name).endswith("-lease")}

    def heal(self) -> None:
        for worker in getattr(self, "_paused", ()):
            self.ctx.signal_worker(worker, signal.SIGCONT)
        awake_at = getattr(self, "_awake_at", None)
        if awake_at is not None:
            # The window must cover the whole stall, even when the load ends first.
            time.sleep(max(0.0, awake_at - time.time()))


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
