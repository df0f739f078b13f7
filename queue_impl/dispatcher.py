"""The HTTP dispatcher: the loop each worker process runs.

Each worker has `batch` slots, each holding one call in flight (or one release of leases given
back). One loop fills them: it claims as many jobs as its gather policy says in one short
transaction and commits; each call runs over HTTP with no transaction open, and its result
joins a write buffer that one writer flushes in one call. The gather policy (`refill`) says
when to claim and when to write:

- refill (the default): claim whatever slots are free, and write results as they come, each
  flush taking whatever gathered while the previous one ran (in batches under load, one by one
  when idle); a busy worker lets a few more gather first (`write_gather_seconds`). A slow or
  hanging call holds only its own slot: its batch-mates' results are written, and their
  slots refilled, without waiting for it. A worker also claims up to `claim_ahead` jobs
  beyond its slots: they wait, received and renewed like any lease held, for a slot to free,
  so that a freed slot starts its next call at once rather than after a claim and its
  receipt, each a commit slower than a loopback call.
- whole batches (`refill = false`, and always for a backend whose claim stays open until its
  results are written, as pg-long-tx's does): claim a full batch, wait for its slowest call,
  write all its results in one call, then claim again.

Leases bound how long a job may be held: the HTTP timeout (which covers name resolution and
the call together) plus a margin for the result write must fit inside the lease, or another
worker may take the job while this one is still running it (`validate`). With renewal on, one
renewer extends each held lease once half of it has passed and until its result is written,
in both policies. A result write that fails is sent again, backing off, for as long as the
lease may still be held (it is fenced, so resending it is safe; a server restart is
outlasted), then given up as unknown.

One lease clock: a lease's clock starts at the claim's UPDATE, not at its COMMIT, so the
dispatcher counts it from when the claim was *sent* (no later than the UPDATE), on its own
monotonic clock (`lease_left`), and a renewal's from when the renewal was sent. A commit that
stalls (a stalled synchronous standby, a backend frozen in the transaction) can hand the worker
leases that have already run out and been recovered by another worker: before its calls, the
dispatcher bounds the lease left from below and gives the batch back unsent when the HTTP
timeout and the write margin no longer fit (unless `unsafe_timing`); the first renewal is due
half a lease after the claim's send, however long the claim took to come back.

Only a claim its worker has received counts as an attempt: before its first call, the
worker confirms a claim's leases (`ConfirmsReceipt.receive`), so a claim that committed as
its connection died (the worker never saw it) is given back when its lease expires.

A job is never allowed to take its batch down: whatever goes wrong while vetting or calling
one target becomes that job's permanent outcome (`skiplock.queue_impl.deliver`), and its
batch-mates are written as usual.

Failpoint decisions and retry jitter draw from generators seeded with (config seed, worker
id), so a run with a seed replays the same fault schedule (`skiplock.queue_impl.failpoints`).

The dispatcher reports what it does through an `EventSink` (`skiplock.queue_impl.events`), so
that this package imports nothing from the harness: the worker pool wires the sink to the run
directory.

Signals: SIGTERM (and SIGINT) stop claiming, let in-flight calls finish (bounded by the HTTP
timeout), write their results, release leases never started, and return. SIGKILL leaves the
leases to expire and be recovered, as in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import random
import signal
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.deliver import Deliverer
from skiplock.queue_impl.events import (
    LEASE_TOO_SHORT,
    NOT_RECEIVED,
    Call,
    EventSink,
    FailedOp,
    claim_event,
    emitter_of_many,
    log,
    one_line,
    release_event,
    renew_event,
    write_event,
)
from skiplock.queue_impl.failpoints import FailpointName, Failpoints, seeded
from skiplock.queue_impl.interface import (
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
from skiplock.queue_impl.native import run_native_worker
from skiplock.queue_impl.ssrf import UrlGuard

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
# With fewer than half its slots free and calls in flight, a refilling worker waits this long
# for more slots to free before claiming, so that a busy worker claims in batches, not one by
# one.
REFILL_GATHER_SECONDS = 0.01
# Past a backend's notify interval, before the claim that picks up un-notified enqueues: their
# commits may land a little after the interval they started in.
_RECHECK_SLACK = 0.01


class BackendFactory(Protocol):
    """What the dispatcher needs from `skiplock.queue_impl.plugins.BackendSpec`: a picklable recipe
    that opens a backend inside the process that calls it."""

    def create(self) -> QueueBackend: ...


def lease_left(lease_seconds: float, *, granted_after: float, now: float) -> float:
    """A lower bound on what is left at `now` of a lease of `lease_seconds` granted by a call
    (a claim, or a renewal extending by `lease_seconds`) sent at `granted_after`, both read
    from one monotonic clock. The database cannot have started the lease before the call was
    sent, however long its commit and answer took, so no clock is shared with the database.
    Negative once the lease may have run out."""
    return lease_seconds - (now - granted_after)


@dataclass(kw_only=True)
class _Held:
    """A lease this worker holds until its result is written: the lease as last granted
    (renewals replace it) and when that grant was sent, on the monotonic clock: the claim's
    send, then each renewal's. The one lease clock both policies renew and write by."""

    lease: Lease
    granted_after: float
    lost: bool = False  # a renewal found it gone: never renewed again


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
        self._emit_many = emitter_of_many(sink)
        self._deliverer = Deliverer(
            config, worker_id, sink, guard=guard,
            after_success=lambda lease: self._failpoint("crash_after_http", lease))
        self.failpoints = Failpoints(config, worker_id, rng)
        self._policy = dataclasses.replace(
            config.retry_policy(), rng=seeded("retry", config.seed, worker_id)
        )
        self._lease = timedelta(seconds=config.lease_seconds)
        self._gather = config.gather_seconds()
        # The gather policy (see the module doc): a backend whose claim stays open until its
        # results are written gets whole batches whatever the config says.
        self.whole_batches = not config.refill or (
            isinstance(backend, HoldsClaims) and backend.holds_claims)
        self._stopping = asyncio.Event()
        self._stop_reason = "stopped"
        self._next_recovery = 0.0
        # The slots' state (all touched on the event loop only): leases held by token until
        # their results are written, tasks holding a lease (at most `batch` of them calling,
        # refill's claimed-ahead ones waiting for a call slot), results waiting for the writer.
        self._held: dict[Any, _Held] = {}
        self._calls: set[asyncio.Task[None]] = set()
        self._call_slots = asyncio.Semaphore(config.batch)
        self._holds_at_most = self._leases_at_most()
        self._results: list[tuple[Any, Call]] = []
        self._slot_freed = asyncio.Event()
        # Set whenever a slot frees or a write lands: a whole batch may then be done.
        self._settled = asyncio.Event()
        self._results_ready = asyncio.Event()
        # Set when a result write lands: it frees its account's slot, so a claim that came
        # back short of a limited account's jobs may take more now.
        self._written = asyncio.Event()
        # Set when leases join `_held`: the renewer's next due time may be sooner.
        self._held_added = asyncio.Event()
        self._draining = False
        # When the last notification woke this worker while idle (see `_idle`).
        self._woken_at: float | None = None
        # The first exception of a call, the writer or the renewer: the worker stops and
        # `run` raises it (never a silent, stalled slot).
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
        error = f"{type(exc).__name__}: {one_line(exc)}"
        log(f"{self.worker_id}: {what}: {error}")
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
                await self._loop()
        except BaseException as exc:
            self._stop_reason = f"error: {type(exc).__name__}: {one_line(exc)}"
            raise
        finally:
            self.emit("stop", reason=self._stop_reason)
            await self._reconnect()

    async def _loop(self) -> None:
        """Fill the slots by the gather policy: claim, start each call at once, hand each
        result to the writer as it ends. On stop, in-flight calls finish (bounded by the HTTP
        timeout) and every result is written before returning."""
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
                free = await self._free_slots()
                if free <= 0:
                    continue
                self._written.clear()
                claim_sent = time.monotonic()
                leases = await self._claim(free)
                if leases is None:
                    continue
                if leases:
                    await self._start_calls(leases, claim_sent)
                    if self.whole_batches:
                        await self._until_settled()
                    if self.stopping or self.whole_batches or len(leases) == free:
                        continue
                # Nothing (more) is due, or only jobs of accounts at their limits. Holding
                # leases, wait for a result write to land (or the poll interval): it frees its
                # account's slot, which a call's end does not, and follows that end within the
                # gather, so claiming at the call's end would find the account still full.
                # Only giving leases back, wait for a slot to free; idle, for a notification.
                if self._held:
                    await self._wait_or_stop(self.config.poll_seconds, self._written)
                elif self._calls:
                    await self._wait_or_stop(self.config.poll_seconds, self._slot_freed)
                else:
                    await self._idle()
        finally:
            await self._drain(writer, renewer)
        if self._failure is not None:
            raise self._failure

    async def _drain(self, writer: asyncio.Task[None], renewer: asyncio.Task[None] | None) -> None:
        """Let the calls in flight end, write every result, then stop renewing."""
        if self._calls:
            await asyncio.gather(*list(self._calls), return_exceptions=True)
        self._draining = True
        self._results_ready.set()
        await asyncio.gather(writer, return_exceptions=True)
        if renewer is not None:
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)

    def _leases_at_most(self) -> int:
        """How many leases this worker may hold: its `batch` slots, and in refill with
        renewal `claim_ahead` more (unrenewed, a lease waiting for a slot would run out, and
        its job be given back)."""
        ahead = self.config.claim_ahead if self.config.renew_leases else 0
        return self.config.batch + (0 if self.whole_batches else ahead)

    async def _free_slots(self) -> int:
        """How many jobs to claim now (0: none yet, ask again). Whole batches: every slot
        (the last batch is written by now). Refill: what the slots and the claim-ahead leave
        room for, at most a batch, once a busy worker has let half a batch free up, so that
        it claims in batches, not one by one."""
        if self.whole_batches:
            return self.config.batch
        self._slot_freed.clear()
        free = self._holds_at_most - len(self._calls)
        if free <= 0:
            await self._wait_or_stop(self.config.poll_seconds, self._slot_freed)
            return 0
        if self._calls and free < (self.config.batch + 1) // 2:
            await self._wait_or_stop(REFILL_GATHER_SECONDS, self._slot_freed)
            free = self._holds_at_most - len(self._calls)
            self._slot_freed.clear()
        return min(free, self.config.batch)

    async def _until_settled(self) -> None:
        """Whole batches: wait until every slot is free and every result written (or a stop,
        whose drain finishes the batch)."""
        while (self._calls or self._held) and not self.stopping:
            self._settled.clear()
            await self._wait_or_stop(self.config.poll_seconds, self._settled)

    async def _wait_or_stop(self, seconds: float, *events: asyncio.Event) -> None:
        """Wait for any of `events`, a stop request, or `seconds`, whichever comes first."""
        waits = [asyncio.ensure_future(event.wait()) for event in (*events, self._stopping)]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def _start_calls(self, leases: list[Lease], claim_sent: float) -> None:
        """Log the claim, confirm its receipt, then start each call (unless a stop came, or
        the claim took so long that too little of its leases is surely left: those are given
        back unsent). Each lease's clock starts at `claim_sent`."""
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
        if leases:
            self._held_added.set()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """A task that holds a lease (or gives leases back) until it ends: a call, waiting
        for its slot when claimed ahead, or a release."""
        task: asyncio.Task[None] = asyncio.create_task(work)
        self._calls.add(task)
        task.add_done_callback(self._slot_done)

    def _slot_done(self, task: asyncio.Task[None]) -> None:
        self._calls.discard(task)
        self._slot_freed.set()
        self._settled.set()
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
        if not await self._call_slot():
            # A stop came while this job, claimed ahead, waited for a slot: given back
            # unsent, as the leases of a claim that comes back after a stop are.
            await self._release([self._held.pop(token).lease])
            return
        try:
            await self._call_when_slotted(token)
        finally:
            self._call_slots.release()

    async def _call_slot(self) -> bool:
        """Wait for one of the `batch` call slots; False (holding none) if a stop came
        while waiting: a job claimed ahead, not yet called, is then given back unsent."""
        if not self._call_slots.locked():
            # Free: taken at once, and the call goes ahead as every call started before a
            # stop does.
            await self._call_slots.acquire()
            return True
        acquire = asyncio.ensure_future(self._call_slots.acquire())
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((acquire, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            # A slot granted as it is cancelled goes to the next waiter (asyncio's semaphore
            # hands it on), so no slot is lost however the two race.
            acquire.cancel()
            await asyncio.wait((acquire,))
        if acquire.cancelled():
            return False
        if self.stopping:
            self._call_slots.release()
            return False
        return True

    async def _call_when_slotted(self, token: Any) -> None:
        held = self._held[token]
        if not self._still_fits(held):
            # The process stood still between the claim's lease check and this call's start
            # (SIGSTOP, a stalled loop): what is surely left of the lease no longer covers the
            # call and its write, and the job may already be with its next holder. Given back
            # unsent (fenced where it passed on), as a claim that took too long is.
            del self._held[token]
            await self._release([held.lease], reason=LEASE_TOO_SHORT)
            return
        call = await self._deliverer.deliver(held.lease)
        self._results.append((token, call))
        self._results_ready.set()

    def _results_due(self) -> bool:
        """Whether to write the results gathered now: refill, as they come; whole batches,
        once every lease held has its result; either, when draining."""
        if not self._results:
            return False
        return (not self.whole_batches or self._draining
                or len(self._results) >= len(self._held))

    def _worth_gathering(self) -> bool:
        """Refill, busy: whether to let more results gather before writing (more calls in
        flight than results waiting, and fewer than half a batch of those). Idle or draining,
        a result is written at once."""
        waiting = len(self._results)
        return (self._gather > 0
                and not self.whole_batches and not self._draining and not self.stopping
                and waiting < self.config.batch // 2 and len(self._calls) > waiting)

    async def _write_loop(self) -> None:
        """Write results by the gather policy: whatever gathered while the previous write
        ran goes in the next one. Returns once draining and nothing is left."""
        while True:
            if not self._results_due():
                if self._draining:
                    return
                self._results_ready.clear()
                await self._results_ready.wait()
                continue
            if self._worth_gathering():
                await asyncio.sleep(self._gather)
            batch, self._results = self._results, []
            async with self._lease_io:
                results = [self._result(self._held[token].lease, call) for token, call in batch]
                # Renewals wait for this write: no lease of the batch outlives its grant.
                held_until = max(self._held[token].granted_after for token, _ in batch)
                await self._finish(results, held_until + self.config.lease_seconds)
                for token, _ in batch:
                    self._held.pop(token, None)
            self._written.set()
            self._settled.set()

    async def _renew_loop(self) -> None:
        """The one renewal routine: extend each held lease once half of it has passed since
        it was granted (the claim's send, then each renewal's), until its result is written.
        A lease a renewal finds gone stays lost: its result will be fenced."""
        half = self.config.lease_seconds / 2
        while True:
            self._held_added.clear()
            due_at = min((h.granted_after + half for h in self._held.values() if not h.lost),
                         default=math.inf)
            wait = None if due_at == math.inf else max(0.0, due_at - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._held_added.wait(), timeout=wait)
            async with self._lease_io:
                now = time.monotonic()
                due = [t for t, h in self._held.items()
                       if not h.lost and h.granted_after + half <= now]
                renewed = await self._renew(due) if due else True
            if not renewed:
                await asyncio.sleep(min(half, self.config.poll_seconds))

    async def _renew(self, tokens: list[Any]) -> bool:
        """Renew these held leases in one call; False when the call failed."""
        renewed_at = time.monotonic()
        leases = [self._held[t].lease for t in tokens]
        try:
            answers = await asyncio.to_thread(self.backend.renew, leases, self._lease)
        except Exception as exc:
            self._call_failed("renew", "lease renewal failed", exc)
            await self._reconnect()
            return False
        for token, lease, answer in zip(tokens, leases, answers, strict=True):
            self.emit("renew", **renew_event(lease, None if answer is None
                                             else answer.locked_until))
            # Gone from the held leases while the renewal ran: given back unsent (a stop,
            # or too little left as its call came to start), so nothing is left to update.
            held = self._held.get(token)
            if held is None:
                continue
            if answer is None:
                held.lost = True
            else:
                held.lease, held.granted_after = answer, renewed_at
        return True


    def _log_claim(self, leases: Sequence[Lease], claim_sent: float) -> tuple[bool, str | None]:
        """Log a claim's events; then (send, release reason): send unless a stop came (give
        the leases back, no reason) or too little of them is surely left (give them back with
        LEASE_TOO_SHORT; the release is fenced where a lease passed on). The leases to send
        are then received (`_receive`) and pass the crash_after_claim failpoint."""
        claimed_at = time.monotonic()
        sent = time.time() - (claimed_at - claim_sent)
        self._emit_many("claim", [claim_event(lease, started=sent) for lease in leases])
        if self.stopping:
            return False, None
        if not self._lease_fits(leases, claim_sent, claimed_at):
            return False, LEASE_TOO_SHORT
        return True, None

    def _still_fits(self, held: _Held) -> bool:
        """Whether the call and the result write still fit in what is surely left of a held
        lease (its last grant counts), checked again as each call starts: the claim's check
        covers every call only if nothing stalls the process between them."""
        if held.lost:
            return False  # a renewal found it gone: the job may be with its next holder
        return self.config.unsafe_timing or self._call_fits(held.granted_after,
                                                            now=time.monotonic())

    def _call_fits(self, granted_after: float, *, now: float) -> bool:
        """The lease rule every check applies: the HTTP call (its timeout covers the vetting)
        and the result write fit in what is surely left at `now` of a lease granted by a
        call sent at `granted_after`."""
        left = lease_left(self.config.lease_seconds, granted_after=granted_after, now=now)
        return left >= self._call_needs

    @property
    def _call_needs(self) -> float:
        """What of a lease a call needs: its HTTP timeout (which covers the vetting) and the
        result write's margin."""
        return self.config.http_timeout_seconds + self.config.write_margin_seconds

    def _lease_fits(self, leases: Sequence[Lease], claim_sent: float, claimed_at: float) -> bool:
        """Whether the call (its timeout covers the vetting) and the result write fit in what
        is surely left of the leases. Their clock started at the claim's UPDATE, not its
        COMMIT, so a commit that stalled can hand back leases that already ran out and that
        another worker has recovered and is delivering: calling now would deliver those jobs
        twice at once and over their accounts' limits. Each call checks again as it starts
        (`_still_fits`), for a process that stood still after this check.
        `unsafe_timing` waives this rule as it waives the same rule in `validate`."""
        now = time.monotonic()
        if self.config.unsafe_timing or self._call_fits(claim_sent, now=now):
            return True
        left = lease_left(self.config.lease_seconds, granted_after=claim_sent, now=now)
        log(
            f"{self.worker_id}: the claim took {claimed_at - claim_sent:.1f}s, so only "
            f"{max(left, 0.0):.1f}s of its leases is sure to be left, less than the HTTP "
            f"timeout + write margin ({self._call_needs:g}s): "
            f"giving {len(leases)} job(s) back unsent"
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
                if not self._call_fits(claim_sent, now=time.monotonic() + pause):
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
                log(f"{self.worker_id}: {taken} claimed job(s) passed to another holder "
                     "while their leases must still run (a queue bug); calling them as claimed")
                received = list(leases)
            else:
                log(f"{self.worker_id}: {taken} claimed job(s) were taken back before their "
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
            log(f"{self.worker_id}: closing the backend failed: {one_line(exc)}")

    async def _sleep_unless_stopping(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)

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
            started_at=datetime.fromtimestamp(call.start, UTC),
            finished_at=datetime.fromtimestamp(call.end, UTC),
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
                failed = one_line(exc)
                pause = _write_pause(sends)
                sends += 1
                again = (sends <= len(WRITE_RETRY_PAUSES)
                         or time.monotonic() + pause < held_until)
                self._call_failed(
                    "finish", f"writing results failed{', sending it again' if again else ''}",
                    exc)
                await self._reconnect()
                if not again:
                    self._emit_many("write", [
                        write_event(result.lease, result.outcome, "info", failed, started)
                        for result in results])
                    return
                await asyncio.sleep(pause)
        events = []
        for result, write in zip(results, written, strict=True):
            # After a failed send, "fenced" may be the first send having committed: unknown.
            # "applied" is certain (had the first committed, the resend would be fenced).
            value = write.value
            if failed is not None and write is WriteResult.FENCED:
                value = "info"
            error = result.error if failed is None or value == "applied" else failed
            events.append(write_event(result.lease, result.outcome, value, error, started))
        self._emit_many("write", events)
    def _stall_in_claim(self) -> None:
        self.failpoints.stall_in_claim()

    def failpoint_fires(self, name: FailpointName) -> bool:
        """This worker's next decision for failpoint `name` (seeded: see the module doc)."""
        return self.failpoints.fires(name)

    def _failpoint(self, name: FailpointName, lease: Lease) -> None:
        self.failpoints.crash_if_fires(name, lease, self._sink)

    async def _release(self, leases: Sequence[Lease], *, reason: str | None = None) -> None:
        try:
            written = await asyncio.to_thread(self.backend.release, leases)
        except Exception as exc:
            self._call_failed("release", "releasing leases failed, they will expire", exc)
            return
        for lease, write in zip(leases, written, strict=True):
            self.emit("release", **release_event(lease, write.value, reason))


def _write_pause(sends: int) -> float:
    """The pause before resend `sends + 1` of a result write."""
    if sends < len(WRITE_RETRY_PAUSES):
        return WRITE_RETRY_PAUSES[sends]
    return min(math.ldexp(WRITE_RETRY_PAUSES[-1], sends - len(WRITE_RETRY_PAUSES) + 1),
               WRITE_RETRY_LAST)


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
        dispatcher = (None if isinstance(backend, RunsOwnWorker)
                      else Dispatcher(backend, config, worker_id, sink))
    except Exception as exc:
        sink("stop", {"reason": f"error: {type(exc).__name__}: {one_line(exc)}"})
        raise
    if dispatcher is None:
        assert isinstance(backend, RunsOwnWorker)
        # The queue's own consumer loop, which writes its own start and stop events.
        run_native_worker(backend, config, worker_id, sink, early)
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
    "BackendFactory",
    "Dispatcher",
    "lease_left",
    "run_worker",
]
