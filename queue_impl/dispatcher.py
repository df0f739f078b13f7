"""The HTTP dispatcher: the loop each worker process runs.

Each worker keeps up to `batch` calls in flight (its slots). Whenever slots are free it claims
that many jobs in one short transaction and commits; each call runs over HTTP with no
transaction open, and its result joins a small write buffer flushed in one call as soon as
the previous flush is done (so results are written in batches under load, one by one when
idle), while the freed slot is claimed again. A slow or hanging call holds only its own slot:
its batch-mates' results are written, and their slots refilled, without waiting for it.
Leases bound how long a job may be held: the HTTP timeout (which covers name resolution and
the call together) plus a margin for the result write must fit inside the lease, or another
worker may take the job while this one is still running it (`validate`). With renewal on,
each lease is extended once half of it has passed and until its result is written. A result
write that fails is sent again, backing off, for as long as the lease may still be held (it
is fenced, so resending it is safe; a server restart is outlasted), then given up as unknown.

Only a claim its worker has received counts as an attempt: before its first call, the
worker confirms a claim's leases (`ConfirmsReceipt.receive`), so a claim that committed as
its connection died (the worker never saw it) is given back when its lease expires.

The lease's clock starts at the claim's UPDATE, not at its COMMIT, so a commit that stalls (a
stalled synchronous standby, a backend frozen in the transaction) can hand the worker leases
that have already run out and been recovered by another worker. Before its calls, the
dispatcher therefore bounds the lease left from below with its own monotonic clock
(`lease_left`; the lease was granted no earlier than the claim was sent), and gives the batch
back unsent when the HTTP timeout and the write margin no longer fit (unless `unsafe_timing`).

A job is never allowed to take its batch down: whatever goes wrong while vetting or calling
one target (a host name the IDNA codec rejects, a header HTTP cannot carry, a bug) becomes
that job's permanent outcome, and its batch-mates are written as usual.

Failpoint decisions and retry jitter draw from generators seeded with (config seed, worker
id), so a run with a seed replays the same fault schedule.

The dispatcher reports what it does through an `EventSink` (kinds as in
`skiplock.reports.history.WorkerEventKind`), so that this package imports nothing from the harness:
the worker pool wires the sink to the run directory.

Signals: SIGTERM (and SIGINT) stop claiming, let in-flight calls finish (bounded by the HTTP
timeout), write their results, release leases never started, and return. SIGKILL leaves the
leases to expire and be recovered, as in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol, cast

import aiohttp

from skiplock.queue_impl.interface import (
    ACCOUNT_HEADER,
    ATTEMPT_HEADER,
    JOB_ID_HEADER,
    LEASE_HEADER,
    WORKER_HEADER,
    AttemptResult,
    ClaimCommitHook,
    ConfirmsReceipt,
    HoldsClaims,
    Lease,
    Outcome,
    QueueBackend,
    RunsOwnWorker,
    ThrottledNotify,
    WriteResult,
)
from skiplock.queue_impl.retry import RetryPolicy, classify_status
from skiplock.queue_impl.ssrf import (
    AllowedTarget,
    PinnedResolver,
    ResolutionFailed,
    TargetRefused,
    UrlGuard,
)

# (kind, fields): kinds and fields as `skiplock.reports.history.WorkerEventKind` documents them.
# `job_id` and `attempt` are lifted into the record; every other field is its data. The
# worker log is CSV with a column per field (`skiplock.reports.history.WORKER_LOG`), and it
# refuses a field it has no column for: a new field needs its column there first.
EventSink = Callable[[str, Mapping[str, Any]], None]

FailpointName = Literal["crash_after_claim", "crash_after_http"]
FAILPOINT_NAMES: tuple[FailpointName, ...] = ("crash_after_claim", "crash_after_http")
# Only through the failpoint file (a fault schedule opens it and a nemesis watches for the
# stalled session): stall inside the claim transaction, before its COMMIT, this many seconds.
PAUSE_IN_CLAIM = "pause_in_claim"
PAUSE_IN_CLAIM_SECONDS = "pause_in_claim_seconds"
# One stall per firing: the firing's number, and the first worker to create the marker file
# named after it is the one that stalls (two workers claiming at once must not both freeze).
PAUSE_IN_CLAIM_FIRING = "pause_in_claim_firing"
_FILE_KEYS = frozenset({*FAILPOINT_NAMES, PAUSE_IN_CLAIM, PAUSE_IN_CLAIM_SECONDS,
                        PAUSE_IN_CLAIM_FIRING})
# The exit status of a process killed by a failpoint, so the pool can tell it from a bug.
FAILPOINT_EXIT_CODE = 77

# The backend call an `error` event names (see `Dispatcher._call_failed`).
FailedOp = Literal["recover", "claim", "receive", "finish", "renew", "release", "wait"]

HttpResultName = Literal["ok", "http_error", "timeout", "connection_error", "refused"]

# The `reason` of a `release` event for leases given back because too little of them was left.
LEASE_TOO_SHORT = "lease too short to send"

# A failed result write is sent again (it is fenced, so a resend of a write that did commit
# changes nothing): at least these pauses, then on, each pause doubling up to the last, for as
# long as the lease may still be held (`_finish`): a write past that can no longer matter
# (recovery takes the job), and is given up as unknown. A server restart takes 0.4-0.8 s, or
# longer with crash recovery; a fixed 0.3 s of resends gave such writes up.
WRITE_RETRY_PAUSES = (0.05, 0.25)
WRITE_RETRY_LAST = 0.5
# A receipt that failed is sent again after pauses growing from the first by this factor up to
# the last, for as long as the claim's calls would still fit in its leases (`_receive`).
RECEIPT_RETRY_FIRST = 0.05
RECEIPT_RETRY_FACTOR = 2.0
RECEIPT_RETRY_LAST = 1.0
# The `reason` of a `release` event for leases given back because their receipt never landed.
NOT_RECEIVED = "receipt not confirmed"
# With fewer than half its slots free and calls in flight, a worker waits this long for more
# slots to free before claiming, so that a busy worker claims in batches, not one by one.
REFILL_GATHER_SECONDS = 0.01
# Past a backend's notify interval, before the claim that picks up un-notified enqueues: their
# commits may land a little after the interval they started in.
_RECHECK_SLACK = 0.01


class ConfigError(ValueError):
    """A dispatcher setting that cannot work; the message is one line saying what to fix."""


class BackendFactory(Protocol):
    """What the dispatcher needs from `skiplock.queue_impl.plugins.BackendSpec`: a picklable recipe
    that opens a backend inside the process that calls it."""

    def create(self) -> QueueBackend: ...


@dataclass(frozen=True, kw_only=True)
class DispatcherConfig:
    batch: int = 10
    lease_seconds: float = 30.0
    http_timeout_seconds: float = 10.0
    # Time reserved, inside the lease, for writing the result after the HTTP call ends.
    write_margin_seconds: float = 5.0
    # Slow poll when no notification arrives (LISTEN/NOTIFY is the fast path).
    poll_seconds: float = 1.0
    recovery_enabled: bool = True
    recovery_interval_seconds: float = 1.0
    renew_leases: bool = True
    # Refill freed slots while other calls run (True), or the batch barrier: claim a batch,
    # wait for its slowest call, write all its results, claim again (False; also used for a
    # backend whose claim stays open until its results are written, as pg-long-tx's does).
    refill: bool = True
    retry_base_seconds: float = 1.0
    retry_cap_seconds: float = 60.0
    retry_jitter: float = 0.5
    allow_targets: tuple[str, ...] = ()  # "HOST:PORT"
    # Skip the lease/timeout rule, for experiments that want to show what breaking it does.
    unsafe_timing: bool = False
    failpoints: tuple[tuple[str, float], ...] = ()  # (name, probability per job)
    # A JSON file {name: probability} that a fault schedule rewrites while the worker runs
    # (a failpoint window); read again whenever it changes, and added to `failpoints`.
    failpoint_file: str | None = None
    # Seeds failpoint decisions and retry jitter (with the worker id); None: unseeded.
    seed: int | None = None

    def validate(self) -> None:
        """Raise ConfigError for a setting that cannot work."""
        _positive_int("batch", self.batch)
        _positive("lease", self.lease_seconds)
        _positive("HTTP timeout", self.http_timeout_seconds)
        _positive("poll interval", self.poll_seconds)
        _positive("recovery interval", self.recovery_interval_seconds)
        if not math.isfinite(self.write_margin_seconds) or self.write_margin_seconds < 0:
            raise ConfigError(
                f"write margin must be 0 or more seconds (got {self.write_margin_seconds})"
            )
        try:
            self.retry_policy()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for text in self.allow_targets:
            try:
                AllowedTarget.parse(text)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        for name, probability in self.failpoints:
            if name not in FAILPOINT_NAMES:
                raise ConfigError(
                    f"unknown failpoint {name!r} (known: {', '.join(FAILPOINT_NAMES)})"
                )
            if not 0.0 <= probability <= 1.0:
                raise ConfigError(
                    f"failpoint {name} probability must be between 0 and 1 (got {probability})"
                )
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ConfigError(f"seed must be a whole number (got {self.seed!r})")
        needed = self.http_timeout_seconds + self.write_margin_seconds
        if not self.unsafe_timing and needed >= self.lease_seconds:
            raise ConfigError(
                f"HTTP timeout {self.http_timeout_seconds:g}s + write margin "
                f"{self.write_margin_seconds:g}s must be shorter than the lease "
                f"{self.lease_seconds:g}s: the call and the result write must finish inside "
                "the lease, or another worker may take the job while this one still runs it "
                "(raise the lease, lower the timeout, or pass --unsafe-timing for experiments)"
            )

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(
            base_seconds=self.retry_base_seconds,
            cap_seconds=self.retry_cap_seconds,
            jitter=self.retry_jitter,
        )

    def failpoint_probability(self, name: FailpointName) -> float:
        return max((p for n, p in self.failpoints if n == name), default=0.0)


def validate_worker_count(count: int) -> None:
    """Worker counts live outside the config (one config is shared by all processes)."""
    _positive_int("worker count", count)


def _positive_int(what: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what} must be a positive whole number (got {value!r})")


def _positive(what: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{what} must be a positive number of seconds (got {value!r})")


def lease_left(lease_seconds: float, *, granted_after: float, now: float) -> float:
    """A lower bound on what is left at `now` of a lease of `lease_seconds` granted by a call
    (a claim, or a renewal extending by `lease_seconds`) sent at `granted_after`, both read
    from one monotonic clock. The database cannot have started the lease before the call was
    sent, however long its commit and answer took, so no clock is shared with the database.
    Negative once the lease may have run out."""
    return lease_seconds - (now - granted_after)


def _iso(when: datetime) -> str:
    return when.isoformat()


@dataclass(kw_only=True)
class _Held:
    """A lease this worker holds until its result is written: the lease as last granted
    (renewals replace it) and when that grant was sent, on the monotonic clock."""

    lease: Lease
    granted_after: float
    lost: bool = False  # a renewal found it gone: never renewed again


@dataclass(frozen=True, kw_only=True)
class Call:
    """One HTTP call as it ended."""

    result: HttpResultName
    outcome: Outcome
    status: int | None
    error: str | None
    start: float
    end: float


def call_for_status(status: int, start: float, end: float) -> Call:
    """An answered call, judged by its status: a redirect is not followed (it would connect
    somewhere the guard never vetted) and is permanent; the rest as `classify_status` says."""
    if 300 <= status < 400:
        return Call(result="http_error", outcome=Outcome.PERMANENT, status=status,
                    error=f"redirect not followed (HTTP {status})", start=start, end=end)
    outcome = classify_status(status)
    return Call(
        result="ok" if outcome is Outcome.SUCCESS else "http_error",
        outcome=outcome,
        status=status,
        error=None if outcome is Outcome.SUCCESS else f"HTTP {status}",
        start=start,
        end=end,
    )


def timed_out_call(start: float, end: float, timeout_seconds: float) -> Call:
    """A call the target did not answer within the HTTP timeout."""
    return Call(result="timeout", outcome=Outcome.TRANSIENT, status=None,
                error=f"no answer within {timeout_seconds:g}s", start=start, end=end)


# The fields of each event about one lease, as `emit` takes them. Module functions, so that
# whatever writes a worker's history by hand (a synthetic history, a test's) writes exactly
# what the dispatcher does.
def claim_event(lease: Lease, started: float | None = None) -> dict[str, Any]:
    """A lease taken; `started`: when the claim that took it was sent (epoch seconds), the
    earliest the row can have been taken (the checker orders claims by it)."""
    event = {"job_id": str(lease.job_id), "attempt": lease.attempt,
             "lease_token": str(lease.lease_token), "locked_until": _iso(lease.locked_until)}
    if started is not None:
        event["started"] = started
    return event


def renew_event(lease: Lease, locked_until: datetime | None) -> dict[str, Any]:
    """A lease renewed until `locked_until`, or found gone (None: the renewal was refused)."""
    held: dict[str, Any] = ({"lost": True} if locked_until is None
                            else {"locked_until": _iso(locked_until)})
    return {"job_id": str(lease.job_id), "attempt": lease.attempt,
            "lease_token": str(lease.lease_token), **held}


def http_event(lease: Lease, call: Call) -> dict[str, Any]:
    return {"job_id": str(lease.job_id), "attempt": lease.attempt, "start": call.start,
            "end": call.end, "result": call.result, "status": call.status, "error": call.error,
            "lease_token": str(lease.lease_token)}


def write_event(lease: Lease, outcome: Outcome, result: str, error: str | None,
                started: float) -> dict[str, Any]:
    """A result write: `result` applied | fenced | info (unknown: the write may or may not
    have committed); `started` when its statement was first sent."""
    return {"job_id": str(lease.job_id), "attempt": lease.attempt, "outcome": outcome.value,
            "result": result, "error": error, "started": started,
            "lease_token": str(lease.lease_token)}


class Deliverer:
    """One worker's HTTP side: vet a lease's target through the SSRF guard, POST the job with
    its identity headers under one deadline (the HTTP timeout), judge the answer, and record
    the `http` event. The dispatcher's loop uses it, and so does a native-worker plug-in whose
    own consumer loop calls `deliver` once per job: every backend's calls go through the same
    guard, timeout, headers, events and failpoint (`after_success`, called with the lease of
    each successful call, is where the dispatcher crashes on purpose)."""

    def __init__(
        self,
        config: DispatcherConfig,
        worker_id: str,
        sink: EventSink,
        *,
        guard: UrlGuard | None = None,
        after_success: Callable[[Lease], None] | None = None,
    ) -> None:
        self.config = config
        self.worker_id = worker_id
        self._sink = sink
        self._guard = guard or UrlGuard(config.allow_targets)
        self._after_success = after_success
        self._session: aiohttp.ClientSession | None = None
        self._resolver: PinnedResolver | None = None

    async def __aenter__(self) -> Deliverer:
        if self._session is not None:
            raise RuntimeError("a Deliverer is entered once at a time")
        self._resolver = PinnedResolver()
        # No DNS cache: every connection asks the pinned resolver, which knows only the
        # address the guard vetted. One connection pool per worker, sized to its slots.
        connector = aiohttp.TCPConnector(
            resolver=self._resolver, use_dns_cache=False, limit=max(self.config.batch, 1)
        )
        self._session = aiohttp.ClientSession(
            connector=connector, raise_for_status=False, auto_decompress=True
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def deliver(self, lease: Lease) -> Call:
        """Vet and call one job's target under one deadline, the HTTP timeout, and record
        the `http` event. Never raises (but for cancellation): anything unexpected becomes
        this job's permanent outcome, so one bad job cannot take its batch down with it."""
        if self._session is None or self._resolver is None:
            raise RuntimeError("Deliverer.deliver outside `async with deliverer`")
        session, resolver = self._session, self._resolver
        start = time.time()
        timeout = self.config.http_timeout_seconds
        phase = "resolving the host name"
        try:
            async with asyncio.timeout(timeout) as deadline:
                try:
                    target = await self._guard.vet(lease.target_url)
                except TargetRefused as exc:
                    call = self._failed(start, "refused", Outcome.PERMANENT, str(exc))
                except ResolutionFailed as exc:
                    outcome = Outcome.TRANSIENT if exc.temporary else Outcome.PERMANENT
                    call = self._failed(start, "connection_error", outcome, str(exc))
                else:
                    phase = "waiting for the answer"
                    resolver.pin(target)
                    when = deadline.when()
                    left = timeout if when is None else when - asyncio.get_running_loop().time()
                    call = await self._post(session, lease, start, max(left, 0.001))
        except TimeoutError:
            call = self._failed(
                start,
                "timeout",
                Outcome.TRANSIENT,
                f"no answer within {timeout:g}s (still {phase})",
            )
        except Exception as exc:
            # Not the target's doing, and retrying would fail the same way. The known causes
            # (a host name the IDNA codec rejects, a header carrying CR/LF) fail before
            # anything is sent, so this is recorded as a refusal, with the error.
            call = self._failed(
                start,
                "refused",
                Outcome.PERMANENT,
                f"cannot dispatch this job: {type(exc).__name__}: {_one_line(exc)}",
            )
        self._sink("http", http_event(lease, call))
        if call.outcome is Outcome.SUCCESS and self._after_success is not None:
            self._after_success(lease)
        return call

    @staticmethod
    def _failed(start: float, result: HttpResultName, outcome: Outcome, error: str) -> Call:
        """An attempt that ended without an HTTP status."""
        return Call(
            result=result, outcome=outcome, status=None, error=error, start=start, end=time.time()
        )

    async def _post(
        self, session: aiohttp.ClientSession, lease: Lease, start: float, timeout_seconds: float
    ) -> Call:
        headers = {
            JOB_ID_HEADER: str(lease.job_id),
            ATTEMPT_HEADER: str(lease.attempt),
            ACCOUNT_HEADER: lease.account_id,
            WORKER_HEADER: self.worker_id,
            LEASE_HEADER: str(lease.lease_token),
        }
        timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        status: int | None = None
        try:
            async with session.post(
                lease.target_url,
                json=dict(lease.payload),
                headers=headers,
                timeout=timeout,
                allow_redirects=False,
            ) as response:
                status = response.status
                await response.read()
        except TimeoutError:
            return timed_out_call(start, time.time(), self.config.http_timeout_seconds)
        except (aiohttp.ClientError, OSError) as exc:
            if status is None:
                return Call(
                    result="connection_error",
                    outcome=Outcome.TRANSIENT,
                    status=None,
                    error=_one_line(exc) or type(exc).__name__,
                    start=start,
                    end=time.time(),
                )
            # The status line arrived but the body did not: judge by the status.
        assert status is not None
        return call_for_status(status, start, time.time())


class Dispatcher:
    """One worker's loop. Create it inside the worker process; `run()` returns after a
    graceful stop."""

    def __init__(
        self,
        backend: QueueBackend,
        config: DispatcherConfig,
        worker_id: str,
        sink: EventSink,
        *,
        guard: UrlGuard | None = None,
        rng: random.Random | None = None,
    ) -> None:
        config.validate()
        self.backend = backend
        self.config = config
        self.worker_id = worker_id
        self._sink = sink
        self._deliverer = Deliverer(
            config, worker_id, sink, guard=guard,
            after_success=lambda lease: self._failpoint("crash_after_http", lease))
        self.failpoints = Failpoints(config, worker_id, rng)
        self._policy = dataclasses.replace(
            config.retry_policy(), rng=_seeded("retry", config.seed, worker_id)
        )
        self._lease = timedelta(seconds=config.lease_seconds)
        self._stopping = asyncio.Event()
        self._stop_reason = "stopped"
        self._next_recovery = 0.0
        # Refill mode's state (all touched on the event loop only): leases held by token,
        # calls in flight, results waiting for the writer.
        self._held: dict[Any, _Held] = {}
        self._calls: set[asyncio.Task[None]] = set()
        self._results: list[tuple[Any, Call]] = []
        self._slot_freed = asyncio.Event()
        self._results_ready = asyncio.Event()
        self._draining = False
        # When the last notification woke this worker while idle (see `_idle`).
        self._woken_at: float | None = None
        # The first exception of a call, the writer or the renewer in refill mode: the worker
        # stops and `run` raises it, as the barrier loop would (never a silent, stalled slot).
        self._failure: BaseException | None = None
        # Held around each renewal and each result write: a renewal never runs alongside the
        # write of a lease it renews (it would find the lease gone and call it lost).
        self._lease_io = asyncio.Lock()
        if config.failpoint_file is not None and isinstance(backend, ClaimCommitHook):
            backend.claim_commit_hook = self._stall_in_claim

    # -- events ----------------------------------------------------------------------------

    def emit(self, kind: str, **fields: Any) -> None:
        self._sink(kind, fields)

    def _call_failed(self, op: FailedOp, what: str, exc: Exception) -> None:
        """A call to the backend that raised: one line on stderr, and an `error` event, so
        the history shows an operation that kept failing (and the checker can say that
        recovery or claims never ran) rather than only a terminal that scrolled by."""
        error = f"{type(exc).__name__}: {_one_line(exc)}"
        _log(f"{self.worker_id}: {what}: {error}")
        self.emit("error", op=op, error=error)

    def request_stop(self, reason: str = "stopped") -> None:
        """Stop claiming; in-flight work is finished or released before `run()` returns."""
        if not self._stopping.is_set():
            self._stop_reason = reason
            self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    # -- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        self.emit("start", pid=os.getpid())
        try:
            async with self._deliverer:
                holds = isinstance(self.backend, HoldsClaims) and self.backend.holds_claims
                if self.config.refill and not holds:
                    await self._refill_loop()
                else:
                    await self._barrier_loop()
        except BaseException as exc:
            self._stop_reason = f"error: {type(exc).__name__}: {_one_line(exc)}"
            raise
        finally:
            self.emit("stop", reason=self._stop_reason)
            await self._reconnect()

    async def _barrier_loop(self) -> None:
        """Claim a batch, run it, write all its results, claim again."""
        while not self.stopping:
            await self._maybe_recover()
            if self.stopping:
                break
            claim_sent = time.monotonic()
            leases = await self._claim(self.config.batch)
            if leases is None:
                continue
            if not leases:
                await self._idle()
                continue
            await self._run_batch(leases, claim_sent)

    async def _refill_loop(self) -> None:
        """Keep up to `batch` calls in flight: claim whatever slots are free, start each
        call at once, hand each result to the writer as it ends. On stop, in-flight calls
        finish (bounded by the HTTP timeout) and every result is written before returning."""
        writer = asyncio.create_task(self._write_loop())
        writer.add_done_callback(self._note_failure)
        renewer = asyncio.create_task(self._renew_loop()) if self.config.renew_leases else None
        if renewer is not None:
            renewer.add_done_callback(self._note_failure)
        try:
            while not self.stopping:
                await self._maybe_recover()
                if self.stopping:
                    break
                self._slot_freed.clear()
                free = self.config.batch - len(self._calls)
                if free <= 0:
                    await self._wait_or_stop(self._slot_freed, self.config.poll_seconds)
                    continue
                if self._calls and free < (self.config.batch + 1) // 2:
                    # Busy: let a few more slots free up, and claim them together.
                    await self._wait_or_stop(self._slot_freed, REFILL_GATHER_SECONDS)
                    free = self.config.batch - len(self._calls)
                    self._slot_freed.clear()
                claim_sent = time.monotonic()
                leases = await self._claim(free)
                if leases is None:
                    continue
                if leases:
                    await self._start_calls(leases, claim_sent)
                    if self.stopping or len(leases) == free:
                        continue
                # Nothing (more) is due. Idle, wait for a notification; busy, for a slot to
                # free (new work is then claimed with it) or the poll interval.
                if self._calls:
                    await self._wait_or_stop(self._slot_freed, self.config.poll_seconds)
                else:
                    await self._idle()
        finally:
            if self._calls:
                await asyncio.gather(*list(self._calls), return_exceptions=True)
            self._draining = True
            self._results_ready.set()
            await asyncio.gather(writer, return_exceptions=True)
            if renewer is not None:
                renewer.cancel()
                await asyncio.gather(renewer, return_exceptions=True)
        if self._failure is not None:
            raise self._failure

    async def _wait_or_stop(self, event: asyncio.Event, seconds: float) -> None:
        """Wait for `event`, a stop request, or `seconds`, whichever comes first."""
        waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(self._stopping.wait())]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def _start_calls(self, leases: list[Lease], claim_sent: float) -> None:
        """Log the claim, confirm its receipt, then start each call (unless a stop came, or
        the claim took so long that too little of its leases is surely left: those are given
        back unsent)."""
        send, reason = self._log_claim(leases, claim_sent)
        if not send:
            self._spawn(self._release(leases, reason=reason))
            return
        leases = await self._receive(leases, claim_sent)
        for lease in leases:
            self._failpoint("crash_after_claim", lease)
        for lease in leases:
            self._held[lease.lease_token] = _Held(lease=lease, granted_after=claim_sent)
            self._spawn(self._call_and_queue(lease.lease_token))

    def _spawn(self, work: Any) -> None:
        """A task that holds a slot until it ends (a call, or a release)."""
        task: asyncio.Task[None] = asyncio.create_task(work)
        self._calls.add(task)
        task.add_done_callback(self._slot_done)

    def _slot_done(self, task: asyncio.Task[None]) -> None:
        self._calls.discard(task)
        self._slot_freed.set()
        self._note_failure(task)

    def _note_failure(self, task: asyncio.Task[None]) -> None:
        """A background task that raised (a full disk under the event log, a plug-in that
        answers a write with the wrong number of results): stop, and raise it from `run`
        once the rest is drained. Its lease, if any, is left to expire and be recovered."""
        if task.cancelled() or task.exception() is None:
            return
        if self._failure is None:
            self._failure = task.exception()
            self.request_stop(f"error: {type(self._failure).__name__}")

    async def _call_and_queue(self, token: Any) -> None:
        call = await self._deliverer.deliver(self._held[token].lease)
        self._results.append((token, call))
        self._results_ready.set()

    async def _write_loop(self) -> None:
        """Write results as they come: whatever gathered while the previous write ran goes
        in the next one. Returns once draining and nothing is left."""
        while True:
            if not self._results:
                if self._draining:
                    return
                self._results_ready.clear()
                await self._results_ready.wait()
                continue
            batch, self._results = self._results, []
            async with self._lease_io:
                results = [self._result(self._held[token].lease, call) for token, call in batch]
                # Renewals wait for this write: no lease of the batch outlives its grant.
                held_until = max(self._held[token].granted_after for token, _ in batch)
                await self._finish(results, held_until + self.config.lease_seconds)
                for token, _ in batch:
                    self._held.pop(token, None)

    async def _renew_loop(self) -> None:
        """Extend each held lease once half of it has passed since it was granted, until its
        result is written. A lease a renewal finds gone stays lost: its result will be
        fenced."""
        half = self.config.lease_seconds / 2
        while True:
            now = time.monotonic()
            due_at = min(
                (h.granted_after + half for h in self._held.values() if not h.lost),
                default=now + half,
            )
            # Wake at least every quarter lease: a lease claimed meanwhile is due no sooner.
            await asyncio.sleep(max(0.0, min(due_at - now, half / 2)))
            async with self._lease_io:
                now = time.monotonic()
                due = [t for t, h in self._held.items()
                       if not h.lost and h.granted_after + half <= now]
                if due:
                    await self._renew(due)

    async def _renew(self, tokens: list[Any]) -> None:
        renewed_at = time.monotonic()
        leases = [self._held[t].lease for t in tokens]
        try:
            answers = await asyncio.to_thread(self.backend.renew, leases, self._lease)
        except Exception as exc:
            self._call_failed("renew", "lease renewal failed", exc)
            await self._reconnect()
            await asyncio.sleep(min(self.config.lease_seconds / 2, self.config.poll_seconds))
            return
        for token, lease, answer in zip(tokens, leases, answers, strict=True):
            held = self._held[token]
            if answer is None:
                held.lost = True
                self.emit("renew", **renew_event(lease, None))
            else:
                held.lease, held.granted_after = answer, renewed_at
                self.emit("renew", **renew_event(lease, answer.locked_until))

    def _log_claim(self, leases: Sequence[Lease], claim_sent: float) -> tuple[bool, str | None]:
        """Log a claim's events; then (send, release reason): send unless a stop came (give
        the leases back, no reason) or too little of them is surely left (give them back with
        LEASE_TOO_SHORT; the release is fenced where a lease passed on). The leases to send
        are then received (`_receive`) and pass the crash_after_claim failpoint."""
        claimed_at = time.monotonic()
        sent = time.time() - (claimed_at - claim_sent)
        for lease in leases:
            self.emit("claim", **claim_event(lease, started=sent))
        if self.stopping:
            return False, None
        if not self._lease_fits(leases, claim_sent, claimed_at):
            return False, LEASE_TOO_SHORT
        return True, None

    def _lease_fits(self, leases: Sequence[Lease], claim_sent: float, claimed_at: float) -> bool:
        """Whether the call (its timeout covers the vetting) and the result write fit in what
        is surely left of the leases. Their clock started at the claim's UPDATE, not its
        COMMIT, so a commit that stalled can hand back leases that already ran out and that
        another worker has recovered and is delivering: calling now would deliver those jobs
        twice at once and over their accounts' limits. Every call of the claim starts right
        after this check, before any renewal, so one check covers each of them.
        `unsafe_timing` waives this rule as it waives the same rule in `validate`."""
        left = lease_left(self.config.lease_seconds, granted_after=claim_sent,
                          now=time.monotonic())
        needed = self.config.http_timeout_seconds + self.config.write_margin_seconds
        if left >= needed or self.config.unsafe_timing:
            return True
        _log(
            f"{self.worker_id}: the claim took {claimed_at - claim_sent:.1f}s, so only "
            f"{max(left, 0.0):.1f}s of its leases is sure to be left, less than the HTTP "
            f"timeout + write margin ({needed:g}s): giving {len(leases)} job(s) back unsent"
        )
        return False

    async def _idle(self) -> None:
        """Nothing due: wait for a notification, or the poll interval. A backend that skips
        the NOTIFY of enqueues closer together than its `notify_interval` gets one more claim
        that long after each wake-up, so those jobs wait at most the interval."""
        timeout = self.config.poll_seconds
        interval = (float(self.backend.notify_interval)
                    if isinstance(self.backend, ThrottledNotify) else 0.0)
        if self._woken_at is not None:
            timeout = min(timeout, max(0.0, self._woken_at + interval + _RECHECK_SLACK
                                       - time.monotonic()))
            self._woken_at = None
            if timeout <= 0:
                return
        try:
            woken = await asyncio.to_thread(self.backend.wait_for_work, timeout)
            if woken and interval > 0:
                self._woken_at = time.monotonic()
        except Exception as exc:
            self._call_failed("wait", "waiting for work failed", exc)
            await self._reconnect()
            await self._sleep_unless_stopping(self.config.poll_seconds)

    async def _maybe_recover(self) -> None:
        if not self.config.recovery_enabled or time.monotonic() < self._next_recovery:
            return
        self._next_recovery = time.monotonic() + self.config.recovery_interval_seconds
        try:
            moved = await asyncio.to_thread(self.backend.recover)
        except Exception as exc:
            self._call_failed("recover", "recovery failed", exc)
            await self._reconnect()
            return
        # Every call that succeeded, even one that moved nothing: that recovery ran is
        # what a checker needs to know when other calls failed.
        self.emit("recover", count=moved)

    async def _claim(self, count: int) -> list[Lease] | None:
        """Up to `count` leases; [] when nothing is due; None after a database error (the
        claim may or may not have committed: its leases, if any, will expire)."""
        try:
            return await asyncio.to_thread(
                self.backend.claim, self.worker_id, count, self._lease
            )
        except Exception as exc:
            self._call_failed("claim", "claim failed", exc)
            await self._reconnect()
            await self._sleep_unless_stopping(self.config.poll_seconds)
            return None

    async def _receive(self, leases: list[Lease], claim_sent: float) -> list[Lease]:
        """The leases to call: those the queue confirms received (`ConfirmsReceipt`; a
        queue without receipts: all). Only a received lease counts as an attempt, so nothing
        is called before its receipt has committed. A receipt that fails may have committed or
        not: it is sent again (marking twice changes nothing) while the calls would still fit
        in what is surely left of the leases; given up, the leases are released (the attempt
        given back, whether or not a receipt landed) or, failing that, left to expire. A lease
        the receipt finds gone once it may have expired (recovery took it back) is not called;
        one found gone while it must still run can only be the queue's bug, and is called."""
        if not isinstance(self.backend, ConfirmsReceipt):
            return leases
        pause = RECEIPT_RETRY_FIRST
        while True:
            try:
                answers = await asyncio.to_thread(self.backend.receive, leases)
                break
            except Exception as exc:
                self._call_failed("receive", "confirming a claim's receipt failed", exc)
                await self._reconnect()
                left = lease_left(self.config.lease_seconds, granted_after=claim_sent,
                                  now=time.monotonic() + pause)
                if left < self.config.http_timeout_seconds + self.config.write_margin_seconds:
                    await self._release(leases, reason=NOT_RECEIVED)
                    return []
                await asyncio.sleep(pause)
                pause = min(pause * RECEIPT_RETRY_FACTOR, RECEIPT_RETRY_LAST)
        received = [lease for lease, answer in zip(leases, answers, strict=True)
                    if answer is WriteResult.APPLIED]
        if len(received) < len(leases):
            taken = len(leases) - len(received)
            if lease_left(self.config.lease_seconds, granted_after=claim_sent,
                          now=time.monotonic()) > 0:
                # A correct queue cannot take a lease back before it expires: another claim
                # took these while they must still run (two claimers on one row). Called as
                # claimed, as before receipts, so the history shows that bug instead of a
                # receipt hiding it.
                _log(f"{self.worker_id}: {taken} claimed job(s) passed to another holder "
                     "while their leases must still run (a queue bug); calling them as claimed")
                received = list(leases)
            else:
                _log(f"{self.worker_id}: {taken} claimed job(s) were taken back before their "
                     "receipt landed; not calling them")
        if received and not self._lease_fits(received, claim_sent, time.monotonic()):
            await self._release(received, reason=LEASE_TOO_SHORT)
            return []
        return received

    async def _reconnect(self) -> None:
        """Close the backend; it reconnects lazily on its next call."""
        try:
            await asyncio.to_thread(self.backend.close)
        except Exception as exc:
            _log(f"{self.worker_id}: closing the backend failed: {_one_line(exc)}")

    async def _sleep_unless_stopping(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)

    async def _run_batch(self, leases: list[Lease], claim_sent: float) -> None:
        claimed_at = time.monotonic()
        send, reason = self._log_claim(leases, claim_sent)
        if not send:
            await self._release(leases, reason=reason)
            return
        leases = await self._receive(leases, claim_sent)
        if not leases:
            return
        for lease in leases:
            self._failpoint("crash_after_claim", lease)
        current: dict[int, Lease] = dict(enumerate(leases))
        tasks = [asyncio.create_task(self._deliverer.deliver(lease)) for lease in leases]
        written = asyncio.Event()
        renewer = None
        granted = [claim_sent]  # when the batch's latest lease grant was sent
        if self.config.renew_leases:
            renewer = asyncio.create_task(
                self._renew_until_written(claimed_at, current, written, granted))
        try:
            calls = await asyncio.gather(*tasks)
        finally:
            written.set()
            if renewer is not None:
                # Let a renewal already sent land, so the results carry the leases it returned
                # and no renewal runs alongside the write.
                await asyncio.gather(renewer, return_exceptions=True)
        results = [self._result(current[i], call) for i, call in enumerate(calls)]
        await self._finish(results, granted[-1] + self.config.lease_seconds)

    def retry_delay(self, attempt: int) -> timedelta:
        """The backoff after failed attempt `attempt`, jittered by this worker's seeded draw."""
        return self._policy.delay(attempt)

    def _result(self, lease: Lease, call: Call) -> AttemptResult:
        delay = timedelta(0)
        if call.outcome is Outcome.TRANSIENT:
            delay = self.retry_delay(lease.attempt)
        return AttemptResult(
            lease=lease,
            outcome=call.outcome,
            http_status=call.status,
            error=call.error,
            retry_delay=delay,
            started_at=datetime.fromtimestamp(call.start).astimezone(),
            finished_at=datetime.fromtimestamp(call.end).astimezone(),
        )

    async def _finish(self, results: list[AttemptResult], held_until: float) -> None:
        """Write the results; a send that fails is sent again while the leases may still be
        held (`held_until`, on the monotonic clock: the latest grant's send plus the lease),
        and at least after each of WRITE_RETRY_PAUSES."""
        # The event is logged after the commit, maybe much later if this process stalls; the
        # time the statement was sent is what a checker can compare with other workers' claims.
        started = time.time()
        failed: str | None = None
        sends = 0
        while True:
            try:
                written = await asyncio.to_thread(self.backend.finish, results)
                break
            except Exception as exc:
                # The write may or may not have committed: unknown, not failed. It is fenced,
                # so it is sent again: a resend of a write that committed changes nothing.
                failed = _one_line(exc)
                pause = _write_pause(sends)
                sends += 1
                again = (sends <= len(WRITE_RETRY_PAUSES)
                         or time.monotonic() + pause < held_until)
                self._call_failed(
                    "finish", f"writing results failed{', sending it again' if again else ''}",
                    exc)
                await self._reconnect()
                if not again:
                    for result in results:
                        self.emit("write", **write_event(result.lease, result.outcome, "info",
                                                         failed, started))
                    return
                await asyncio.sleep(pause)
        for result, write in zip(results, written, strict=True):
            # After a failed send, "fenced" may be the first send having committed: unknown.
            # "applied" is certain (had the first committed, the resend would be fenced).
            value = write.value
            if failed is not None and write is WriteResult.FENCED:
                value = "info"
            error = result.error if failed is None or value == "applied" else failed
            self.emit("write", **write_event(result.lease, result.outcome, value, error,
                                             started))

    async def _release(self, leases: Sequence[Lease], *, reason: str | None = None) -> None:
        try:
            written = await asyncio.to_thread(self.backend.release, leases)
        except Exception as exc:
            self._call_failed("release", "releasing leases failed, they will expire", exc)
            return
        because = {} if reason is None else {"reason": reason}
        for lease, write in zip(leases, written, strict=True):
            self.emit(
                "release",
                job_id=str(lease.job_id),
                attempt=lease.attempt,
                result=write.value,
                **because,
            )

    async def _renew_until_written(
        self, claimed_at: float, current: dict[int, Lease], written: asyncio.Event,
        granted: list[float],
    ) -> None:
        """Extend every lease of the batch once half the lease has passed, and again each half
        lease after, until the results are about to be written (`written`). Finished calls
        are renewed too: their results wait for the batch's write, and a lease that expired
        meanwhile would be recovered, redelivered and its write fenced. Lost leases stay lost:
        their results will be fenced."""
        half = self.config.lease_seconds / 2
        due = claimed_at + half
        lost: set[int] = set()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(written.wait(), timeout=max(0.0, due - time.monotonic()))
            if written.is_set():
                return
            held = [i for i in current if i not in lost]
            if not held:
                return
            renewed_at = time.monotonic()
            leases = [current[i] for i in held]
            try:
                answers = await asyncio.to_thread(self.backend.renew, leases, self._lease)
            except Exception as exc:
                self._call_failed("renew", "lease renewal failed", exc)
                await self._reconnect()
                due = time.monotonic() + min(half, self.config.poll_seconds)
                continue
            for i, lease, answer in zip(held, leases, answers, strict=True):
                if answer is None:
                    lost.add(i)
                    self.emit("renew", **renew_event(lease, None))
                else:
                    current[i] = answer
                    self.emit("renew", **renew_event(lease, answer.locked_until))
            if len(lost) < len(held):
                granted.append(renewed_at)
            due = renewed_at + half

    def _stall_in_claim(self) -> None:
        self.failpoints.stall_in_claim()

    def failpoint_fires(self, name: FailpointName) -> bool:
        """This worker's next decision for failpoint `name` (seeded: see the module doc)."""
        return self.failpoints.fires(name)

    def _failpoint(self, name: FailpointName, lease: Lease) -> None:
        self.failpoints.crash_if_fires(name, lease, self._sink)


class Failpoints:
    """One worker's failpoints: the configured probabilities and the failpoint file's (a
    fault schedule opens and closes them while the run goes on), decided by one generator,
    seeded per worker. The dispatcher and a native worker loop use the same ones."""

    def __init__(self, config: DispatcherConfig, worker_id: str,
                 rng: random.Random | None = None) -> None:
        self.config = config
        self.worker_id = worker_id
        self._rng = rng or _seeded("failpoints", config.seed, worker_id)
        self._cache: tuple[object, dict[str, float]] = (None, {})

    def _file_failpoints(self) -> dict[str, float]:
        """The failpoint file's probabilities, re-read only when the file was replaced."""
        path = self.config.failpoint_file
        if path is None:
            return {}
        try:
            stat = os.stat(path)
        except OSError:
            self._cache = (None, {})
            return {}
        key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if self._cache[0] != key:
            try:
                with open(path, encoding="utf-8") as fh:
                    raw = json.load(fh)
                loaded = {str(k): float(v) for k, v in raw.items() if k in _FILE_KEYS}
            except (OSError, ValueError, TypeError, AttributeError) as exc:
                _log(f"{self.worker_id}: ignoring the failpoint file: {_one_line(exc)}")
                loaded = {}
            self._cache = (key, loaded)
        return self._cache[1]

    def stall_in_claim(self) -> None:
        """The `pause_in_claim` failpoint, run by the backend between a claim's statements
        and its COMMIT (on the claim's thread): sleep there, as a worker frozen inside its
        claim transaction would, while the leases' clock runs."""
        found = self._file_failpoints()
        probability = found.get(PAUSE_IN_CLAIM, 0.0)
        if probability > 0 and self._rng.random() < probability and self._first_to_stall(
                found.get(PAUSE_IN_CLAIM_FIRING)):
            time.sleep(max(0.0, found.get(PAUSE_IN_CLAIM_SECONDS, 0.0)))

    def _first_to_stall(self, firing: float | None) -> bool:
        """Whether this worker takes the firing's one stall (an exclusive create of its
        marker beside the failpoint file); every claimer stalls when no firing is named."""
        path = self.config.failpoint_file
        if firing is None or path is None:
            return True
        try:
            os.close(os.open(f"{path}.stall-{int(firing)}",
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        except OSError:
            return True
        return True

    def fires(self, name: FailpointName) -> bool:
        """This worker's next decision for failpoint `name`."""
        probability = max(self.config.failpoint_probability(name),
                          self._file_failpoints().get(name, 0.0))
        return probability > 0 and self._rng.random() < probability

    def crash_if_fires(self, name: FailpointName, lease: Lease, sink: EventSink) -> None:
        """Record the failpoint and exit at once, with no cleanup, when it fires: this is
        the crash being simulated."""
        if self.fires(name):
            sink("failpoint", {"name": name, "job_id": str(lease.job_id),
                               "attempt": lease.attempt,
                               "lease_token": str(lease.lease_token)})
            os._exit(FAILPOINT_EXIT_CODE)


def _write_pause(sends: int) -> float:
    """The pause before resend `sends + 1` of a result write."""
    if sends < len(WRITE_RETRY_PAUSES):
        return WRITE_RETRY_PAUSES[sends]
    return min(math.ldexp(WRITE_RETRY_PAUSES[-1], sends - len(WRITE_RETRY_PAUSES) + 1),
               WRITE_RETRY_LAST)


def _seeded(stream: str, seed: int | None, worker_id: str) -> random.Random:
    """A generator for one purpose of one worker: replayable when `seed` is given (a string
    seed hashes the same in every process), fresh entropy otherwise."""
    if seed is None:
        return random.Random()
    return random.Random(f"{stream}:{seed}:{worker_id}")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _log(message: str) -> None:
    print(f"skiplock worker: {message}", file=sys.stderr, flush=True)


def run_worker(
    spec: BackendFactory, config: DispatcherConfig, worker_id: str, sink: EventSink
) -> None:
    """The body of one worker process: open the backend here (after the process started),
    run until SIGTERM or SIGINT, drain, and return."""
    # A stop requested while the process is still setting up is remembered, not fatal: the
    # worker then starts, holds nothing, and stops cleanly.
    early: list[str] = []

    def remember(signum: int, frame: object) -> None:
        early.append(signal.Signals(signum).name)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, remember)
    try:
        backend = spec.create()
        native = isinstance(backend, RunsOwnWorker)
        dispatcher = None if native else Dispatcher(backend, config, worker_id, sink)
    except Exception as exc:
        sink("stop", {"reason": f"error: {type(exc).__name__}: {_one_line(exc)}"})
        raise
    if dispatcher is None:
        from skiplock.queue_impl.native import run_native_worker

        # The queue's own consumer loop, which writes its own start and stop events.
        run_native_worker(cast(RunsOwnWorker, backend), config, worker_id, sink, early)
        return

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, dispatcher.request_stop, signal.Signals(signum).name)
        if early:
            dispatcher.request_stop(early[0])
        await dispatcher.run()

    asyncio.run(main())


__all__ = [
    "FAILPOINT_EXIT_CODE",
    "FAILPOINT_NAMES",
    "LEASE_TOO_SHORT",
    "BackendFactory",
    "ConfigError",
    "Deliverer",
    "Dispatcher",
    "DispatcherConfig",
    "EventSink",
    "FailedOp",
    "Failpoints",
    "lease_left",
    "run_worker",
    "validate_worker_count",
]
