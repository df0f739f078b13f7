"""Faults on the dispatcher's worker processes: real signals, and the crash failpoints.

A worker is chosen among those that hold a lease at that moment (by their event logs), so
a kill or a pause always lands mid-lease, where it can cost a job; a firing that finds no
worker holding a lease is recorded as skipped rather than spent on an idle process.

A kill with `aim = "last_attempt"` waits instead for a worker that holds the last allowed
attempt of a job whose script fails every attempt (by the claims in the workers' logs and
the oracles in enqueues.csv): the expired lease of such an attempt must be dead-lettered by
recovery, never retried, and the kill makes sure recovery meets one in every run.
"""

from __future__ import annotations

import signal
import threading
import time
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from skiplock.chaos.nemesis import Fault, FaultSkipped, HeldLease, NemesisContext, register
from skiplock.queue_impl.failpoints import (
    PAUSE_IN_CLAIM,
    PAUSE_IN_CLAIM_FIRING,
    PAUSE_IN_CLAIM_SECONDS,
)
from skiplock.reports.history import (
    ENQUEUE_LOG,
    ENQUEUES_FILE,
    Behaviour,
    HistoryError,
    JobScript,
    Step,
    parse_header,
    parse_row,
)
from skiplock.reports.oracle import Expected, build_oracle, script_from_payload

# How long a firing waits for some worker to hold a lease (under light load a worker holds
# its leases for milliseconds at a time), and how often it looks.
HOLDER_WAIT_SECONDS = 2.0
HOLDER_POLL_SECONDS = 0.003
# How long an aimed pause waits for a worker holding a job whose next delivery runs long
# before it takes any holder.
PREFER_WAIT_SECONDS = 1.0
# How long a claim-phase pause waits for some worker to claim.
CLAIM_STALL_WAIT_SECONDS = 5.0
# How long an aimed kill waits for some worker to hold the last attempt of a failing job:
# such an attempt comes round only after the job's retry waits, and under light load its
# lease is held only while its call runs.
AIM_WAIT_SECONDS = 3.0
# How long a last attempt must have been held before an aimed kill takes it: by then its
# worker has confirmed receiving it (one statement after the claim is logged; a kill before
# that gives the attempt back) and its call is under way. A failure answered at once is
# written before this, so the kill finds the attempts held for a whole call (a hang).
AIM_SETTLE_SECONDS = 0.2


def _choose_holders(fault: Fault, exclude: Collection[str] = (),
                    prefer: Callable[[Sequence[HeldLease]], set[str]] | None = None
                    ) -> list[str]:
    """Workers holding a lease (not in `exclude`), waiting up to HOLDER_WAIT_SECONDS for one.
    With `prefer`, those it picks out of the leases held, for up to PREFER_WAIT_SECONDS; then
    any holder. Once it has waited, the firing's window starts at its choice."""
    started = time.monotonic()
    while True:
        waited = time.monotonic() - started
        if prefer is not None and waited < PREFER_WAIT_SECONDS:
            holders = sorted(prefer(fault.ctx.leases_held()) - set(exclude))
        else:
            holders = sorted(set(fault.ctx.workers_holding_leases()) - set(exclude))
        if holders:
            break
        if waited >= HOLDER_WAIT_SECONDS:
            raise FaultSkipped(f"no worker {'not paused already ' if exclude else ''}held a "
                               f"lease within {HOLDER_WAIT_SECONDS:g} s")
        time.sleep(HOLDER_POLL_SECONDS)
    if waited > HOLDER_POLL_SECONDS:
        fault.started_at = time.time()
    return fault.rng.sample(holders, min(fault.planned.count, len(holders)))


def last_attempts(held: Mapping[str, Mapping[tuple[str, int], float]],
                  exhausting: Mapping[str, int], *, now: float,
                  settle: float = 0.0) -> dict[str, list[tuple[str, int]]]:
    """The workers that hold a last attempt in flight, each with those it holds: open
    attempts (job id, attempt -> when claimed) of jobs in `exhausting` (job id ->
    max_attempts: jobs whose every attempt fails) whose attempt is the job's max_attempts,
    claimed at least `settle` seconds before `now`. A job not (yet) in `exhausting` is never
    aimed at, nor an attempt past max_attempts (a broken queue's; it has nothing to show)."""
    found: dict[str, list[tuple[str, int]]] = {}
    for worker, leases in held.items():
        aimed = sorted(key for key, claimed in leases.items()
                       if key[0] in exhausting and key[1] == exhausting[key[0]]
                       and now - claimed >= settle)
        if aimed:
            found[worker] = aimed
    return found


class _EnqueuedJobs:
    """Jobs of a run read from enqueues.csv as it grows: only whole lines, each `invoke`
    once, each kept or not by `_take_invoke`."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / ENQUEUES_FILE
        self._offset = 0
        self._partial = b""
        self._names: list[str] | None = None
        self._line = 0
        self._lock = threading.Lock()

    def _read(self) -> None:
        with self._lock:
            try:
                with self.path.open("rb") as fh:
                    fh.seek(self._offset)
                    data = fh.read()
            except FileNotFoundError:
                return
            self._offset += len(data)
            *whole, self._partial = (self._partial + data).split(b"\n")
            for raw in whole:
                self._line += 1
                try:
                    self._take(raw.decode())
                except (HistoryError, UnicodeDecodeError, ValueError, KeyError, TypeError):
                    continue  # the checker names a malformed line; aiming only skips it

    def _take(self, line: str) -> None:
        if self._names is None:
            self._names = parse_header(self.path, line, ENQUEUE_LOG)
            return
        if not line.strip():
            return
        row = parse_row(self.path, self._line, line, self._names, ENQUEUE_LOG)
        if row["type"] != "invoke" or row["max_attempts"] is None:
            return
        self._take_invoke(row, script_from_payload(row["script"]))

    def _take_invoke(self, row: Mapping[str, Any], script: JobScript) -> None:
        raise NotImplementedError


class ExhaustingJobs(_EnqueuedJobs):
    """The jobs of a run whose script fails every allowed attempt (their oracle: FAILED after
    max_attempts deliveries), with their max_attempts. A job that ends sooner (a 4xx, a
    success) is left out: killing its last attempt would take away a delivery its oracle
    counts on."""

    def __init__(self, run_dir: Path, http_timeout_seconds: float) -> None:
        super().__init__(run_dir)
        self.http_timeout_seconds = http_timeout_seconds
        self.jobs: dict[str, int] = {}

    def read(self) -> dict[str, int]:
        """Every exhausting job enqueued so far (job id -> max_attempts)."""
        self._read()
        return self.jobs

    def _take_invoke(self, row: Mapping[str, Any], script: JobScript) -> None:
        max_attempts = int(row["max_attempts"])
        oracle = build_oracle(script, max_attempts, self.http_timeout_seconds)
        if oracle.expected is Expected.FAILED and oracle.deliveries == max_attempts:
            self.jobs[str(row["job_id"])] = max_attempts


class LongRedeliveries(_EnqueuedJobs):
    """The scripts and accounts of a run's jobs, read to tell which held attempt would be
    followed by a long call, re-claimed at once: the delivery after it answers no sooner
    than `seconds` (a slow answer, a hang), and its account has no concurrency limit (a
    limited account's re-claim may queue behind its backlog). An aimed pause wants its
    worker to hold such a job: once its lease passes on, the new holder's call is still
    running when the paused worker is woken."""

    def __init__(self, run_dir: Path, seconds: float,
                 account_limits: Mapping[str, int | None]) -> None:
        super().__init__(run_dir)
        self.seconds = seconds
        self.limited = {account for account, limit in account_limits.items()
                        if limit is not None}
        self.scripts: dict[str, JobScript] = {}  # job id -> script, unlimited accounts' only

    def holders(self, held: Sequence[HeldLease]) -> set[str]:
        """The workers in `held` that hold an attempt whose next delivery runs long."""
        self._read()
        return {lease.worker for lease in held
                if (script := self.scripts.get(lease.job_id)) is not None
                and self._runs_long(script.step_for(lease.attempt + 1))}

    def _runs_long(self, step: Step) -> bool:
        if step.behaviour is Behaviour.HANG_FOREVER:
            return True
        return step.behaviour in (Behaviour.SLOW, Behaviour.HANG) and step.seconds >= self.seconds

    def _take_invoke(self, row: Mapping[str, Any], script: JobScript) -> None:
        if row["account"] not in self.limited:
            self.scripts[str(row["job_id"])] = script


class _Aiming:
    """What aimed faults share over one run: its exhausting jobs and the workers already
    killed (a process stays visible for a moment after its SIGKILL; firings whose waits
    overlap must not both spend themselves on it), for aimed kills; its long redeliveries,
    for aimed pauses."""

    def __init__(self, ctx: NemesisContext) -> None:
        self.jobs = ExhaustingJobs(ctx.run_dir, ctx.http_timeout_seconds)
        self.killed: set[str] = set()
        self.lock = threading.Lock()
        # Long enough that the call still runs when a re-claim is old enough to wake for.
        self.long = LongRedeliveries(ctx.run_dir, seconds=2 * RECLAIM_MIN_AGE_SECONDS,
                                     account_limits=ctx.account_limits)


# One per run (a fault lives for one firing; the run's context outlives them all).
_AIMING: weakref.WeakKeyDictionary[Any, _Aiming] = weakref.WeakKeyDictionary()
_AIMING_LOCK = threading.Lock()


def _aiming(ctx: NemesisContext) -> _Aiming:
    with _AIMING_LOCK:
        try:
            found = _AIMING.get(ctx)
            if found is None:
                found = _AIMING[ctx] = _Aiming(ctx)
        except TypeError:  # a context that cannot be weakly keyed: nothing shared
            found = _Aiming(ctx)
        return found


def _kill_last_attempts(fault: Fault) -> list[str]:
    """SIGKILL workers holding the last attempt of an exhausting job, waiting for one up to
    AIM_WAIT_SECONDS. The event's window starts at the kill, not at the firing (the wait
    touched nothing), and its data names what each worker was aimed at."""
    state = _aiming(fault.ctx)
    deadline = time.monotonic() + AIM_WAIT_SECONDS
    while True:
        with state.lock:
            held: dict[str, dict[tuple[str, int], float]] = {}
            for lease in fault.ctx.leases_held():
                # Mid-call only: a call that has ended (its result still to be written, which
                # a busy writer gathers) would show the kill nothing a hang does not.
                if lease.worker not in state.killed and not lease.answered:
                    held.setdefault(lease.worker, {})[(lease.job_id, lease.attempt)] = (
                        lease.claimed_at)
            aimed = last_attempts(held, state.jobs.read(), now=time.time(),
                                  settle=AIM_SETTLE_SECONDS)
            if aimed:
                chosen = fault.rng.sample(sorted(aimed), min(fault.planned.count, len(aimed)))
                fault.started_at = time.time()
                for worker in chosen:
                    fault.ctx.signal_worker(worker, signal.SIGKILL)
                state.killed.update(chosen)
                fault.data["aimed"] = [
                    {"worker": worker, "job_id": job, "attempt": attempt}
                    for worker in sorted(chosen) for job, attempt in aimed[worker]]
                return chosen
        if time.monotonic() >= deadline:
            raise FaultSkipped(f"no worker held the last attempt of a job that fails every "
                               f"attempt within {AIM_WAIT_SECONDS:g} s")
        time.sleep(HOLDER_POLL_SECONDS)


@register
class KillWorker(Fault):
    """SIGKILL workers that hold leases: their leases must expire and be recovered, and
    a call they had sent may be delivered again (explained by this event).

    With `aim = "last_attempt"`, only a worker holding the last allowed attempt of a job
    that fails every attempt: recovery must dead-letter that job (FAILED), not retry it."""

    kind = "kill_worker"

    def apply(self) -> list[str | None]:
        if self.planned.aim == "last_attempt":
            self.data["aim"] = "last_attempt"
            return list(_kill_last_attempts(self))
        chosen = _choose_holders(self)
        for worker in chosen:
            self.ctx.signal_worker(worker, signal.SIGKILL)
        return list(chosen)


@register
class PauseWorker(Fault):
    """Freeze workers for `duration` (by default longer than the lease).

    phase "lease": SIGSTOP workers that hold leases, then SIGCONT. Their leases expire and
    pass to others meanwhile, so their late result writes must be fenced, and their late
    calls are explained by this event. A worker another pause holds stopped is not chosen
    (two pauses at once freeze two workers). With until "reclaimed" the SIGCONT is aimed: it comes
    as soon as another worker holds one of their jobs again with its call still running
    (`reclaim_in_flight`), so their stale results reach the queue while the job is PROCESSING
    under the new lease: only the lease token, not the status, can refuse them then.

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
        run = str(self.ctx.run_dir)
        prefer = None
        if self.planned.until == "reclaimed":
            # A worker holding a job whose next delivery runs long, of an unlimited account:
            # once another worker has that job again (at once), its call is still running
            # when this one is woken.
            prefer = _aiming(self.ctx).long.holders
        with _STOPPED_LOCK:
            self._paused = _choose_holders(self, exclude={w for r, w in _STOPPED if r == run},
                                           prefer=prefer)
            for worker in self._paused:
                self.ctx.signal_worker(worker, signal.SIGSTOP)
            _STOPPED.update((run, worker) for worker in self._paused)
        if self.planned.until == "reclaimed":
            # How it ended: replaced by `hold` unless the end of the load heals it first.
            self.data.update(until="reclaimed", resumed="load end")
            # Read once they are stopped: their logs no longer change.
            self._watched = {lease.job_id: lease.attempt for lease in self.ctx.leases_held()
                             if lease.worker in self._paused}
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

        from skiplock.chaos.faults.database import like_prefix

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

    def hold(self, stop: threading.Event, seconds: float) -> None:
        watched: dict[str, int] = getattr(self, "_watched", {})
        if not watched:
            super().hold(stop, seconds)
            return
        deadline = time.monotonic() + seconds
        while not stop.wait(RECLAIM_POLL_SECONDS):
            found = reclaim_in_flight(self.ctx.leases_held(), watched, self._paused,
                                      now=time.time(), min_age=RECLAIM_MIN_AGE_SECONDS)
            if found is not None:
                self.data.update(resumed="reclaimed", reclaimed_job=found.job_id,
                                 reclaimed_by=found.worker, reclaimed_attempt=found.attempt,
                                 reclaimed_at=found.claimed_at)
                return
            if time.monotonic() >= deadline:
                self.data["resumed"] = "duration"
                return

    def heal(self) -> None:
        paused = getattr(self, "_paused", ())
        for worker in paused:
            self.ctx.signal_worker(worker, signal.SIGCONT)
        with _STOPPED_LOCK:
            _STOPPED.difference_update((str(self.ctx.run_dir), worker) for worker in paused)
        awake_at = getattr(self, "_awake_at", None)
        if awake_at is not None:
            # The window must cover the whole stall, even when the load ends first.
            time.sleep(max(0.0, awake_at - time.time()))


# The workers lease-phase pauses hold stopped now, as (run directory, worker id).
_STOPPED: set[tuple[str, str]] = set()
_STOPPED_LOCK = threading.Lock()

# How often an aimed pause reads the event logs, and how long after a re-claim was logged the
# paused worker is woken if that call is still running. Later than the checker's timing
# tolerance (0.25 s, `skiplock.reports.checker.common.DEFAULT_TOLERANCE_SECONDS`), or a stale
# write sent right after the claim could not be told from one sent just before it; a call
# still running then is a slow one, so the woken worker writes before its new holder does.
RECLAIM_POLL_SECONDS = 0.005
RECLAIM_MIN_AGE_SECONDS = 0.3


def reclaim_in_flight(held: Sequence[HeldLease], watched: Mapping[str, int],
                      paused: Collection[str], *, now: float,
                      min_age: float) -> HeldLease | None:
    """The delivery an aimed pause wakes its workers for: a later attempt of a job they held
    (`watched`: job id to the attempt they hold), claimed by another worker at least `min_age`
    ago, its call not ended. The earliest claimed, or None."""
    found = [lease for lease in held
             if lease.worker not in paused and not lease.answered
             and lease.job_id in watched and lease.attempt > watched[lease.job_id]
             and lease.claimed_at <= now - min_age]
    return min(found, key=lambda lease: lease.claimed_at, default=None)


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
