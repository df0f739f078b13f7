"""One skiplock function per job, for a queue that brings its own consumer loop.

A native-worker backend (`skiplock.queue_impl.interface.RunsOwnWorker`) runs its library's consumer
(BullMQ's `Worker`, pgqueuer's `QueueManager`, ...) in each worker process. Its job handler
turns the library's job into a `Lease` and calls `NativeDelivery.run`, which records the
`claim` event, passes the crash failpoints and makes the HTTP call through the dispatcher's
`Deliverer` (SSRF guard, timeout, identity headers, `http` event). When the library reports
the job's end, the handler calls `written` with what it knows of the write: applied, fenced
(the library refused it because the job's lock or lease was gone) or info (it may or may not
have happened). When the library renews a pick's hold (a heartbeat, a lock extension), the
loop calls `renewed`, so the checker's lease end follows it as it follows the dispatcher's
renewals. A history then reads the same whichever loop ran.

The lease token is the claim's identity in the history: a native backend derives it from
whatever names one pick of a job in its library (BullMQ's lock token, pgqueuer's row
version), so two picks under one attempt number are still told apart.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import time
import uuid
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.deliver import Deliverer
from skiplock.queue_impl.events import Call, EventSink, claim_event, renew_event, write_event
from skiplock.queue_impl.failpoints import Failpoints
from skiplock.queue_impl.interface import AttemptResult, Lease, Outcome, RunsOwnWorker, WriteResult

# Library identities of a pick (lock tokens, row versions) become lease tokens in this
# namespace: the same in every process, different for every pick.
_TOKEN_NAMESPACE = uuid.UUID("5b0f5c1e-6a43-4a53-9a56-8f3d1a8e7c21")

WriteOutcome = str  # "applied" | "fenced" | "info"


class NativeWorkerOnly(NotImplementedError):
    """A call of skiplock's own dispatcher loop, which a native-worker queue never gets."""

    def __init__(self, queue: str, call: str) -> None:
        super().__init__(f"{queue} runs its own worker loop; {call}() is never called")


def lease_token_of(identity: str) -> uuid.UUID:
    """A lease token for one pick, from the library's own name for it."""
    return uuid.uuid5(_TOKEN_NAMESPACE, identity)


@dataclass(frozen=True)
class _Running:
    lease: Lease
    outcome: Outcome
    error: str | None
    started: float


class NativeDelivery:
    """One worker's per-job function for a native consumer loop. Enter it (`async with`)
    around the loop; call `run` once per job and `written` once the library reports that
    job's end. Keys are whatever the loop can find again at the end (the job object's id)."""

    def __init__(self, config: DispatcherConfig, worker_id: str, sink: EventSink) -> None:
        config.validate()
        self.config = config
        self.worker_id = worker_id
        self._sink = sink
        self.failpoints = Failpoints(config, worker_id)
        self._deliverer = Deliverer(
            config, worker_id, sink,
            after_success=lambda lease: self.failpoints.crash_if_fires(
                "crash_after_http", lease, sink))
        self._running: dict[Hashable, _Running] = {}
        self._claimed: set[uuid.UUID] = set()

    async def __aenter__(self) -> NativeDelivery:
        await self._deliverer.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._deliverer.__aexit__(*exc_info)

    def claimed(self, lease: Lease) -> None:
        """Record a claim when the library makes it (its dequeue returned the job), which
        may be well before the job's handler runs; then pass its failpoint."""
        self._claimed.add(lease.lease_token)
        self._log_claim(lease)

    def _log_claim(self, lease: Lease) -> None:
        self._sink("claim", claim_event(lease))
        self.failpoints.crash_if_fires("crash_after_claim", lease, self._sink)

    async def run(self, key: Hashable, lease: Lease) -> Call:
        """Record the claim (unless `claimed` did), deliver; the call's outcome is
        remembered under `key` for `written`."""
        if lease.lease_token in self._claimed:
            self._claimed.discard(lease.lease_token)
        else:
            self._log_claim(lease)
        call = await self._deliverer.deliver(lease)
        self._running[key] = _Running(lease, call.outcome, call.error, time.time())
        return call

    def outcome_of(self, key: Hashable) -> Outcome | None:
        """What the call run under `key` came to, while its write is still to come."""
        found = self._running.get(key)
        return found.outcome if found is not None else None

    def written(self, key: Hashable, result: WriteOutcome = "applied",
                error: str | None = None) -> bool:
        """Record the write of the job run under `key`; False when no call is known there
        (the library reported a job this worker did not deliver)."""
        found = self._running.pop(key, None)
        if found is None:
            return False
        self._sink("write", write_event(found.lease, found.outcome, result,
                                        error if error is not None else found.error,
                                        found.started))
        return True

    def renewed(self, lease: Lease, held: bool = True) -> None:
        """Record a renewal of `lease` the library made (a heartbeat, a lock extension), once
        it returned: held for another `lease_seconds` from now, or refused (`held` False: the
        pick was no longer this worker's). Without these, a pick kept alive past its first
        lease would look expired to the checker from claim + lease on."""
        until = (datetime.now(UTC) + timedelta(seconds=self.config.lease_seconds)
                 if held else None)
        self._sink("renew", renew_event(lease, until))

    def error(self, op: str, text: str) -> None:
        """The loop's own failure (a fetch, a lock extension, a stall check)."""
        self._sink("error", {"op": op, "error": text})


def run_native_worker(backend: RunsOwnWorker, config: DispatcherConfig, worker_id: str,
                      sink: EventSink, early_stop: list[str]) -> None:
    """The body of a worker process whose queue brings its own loop: run it until SIGTERM or
    SIGINT (or at once when one came during setup), then let it finish what it holds.
    Leftover tasks of the library are cancelled and collected while the loop still runs, so
    none is finalized after it closed."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        if early_stop:
            stop.set()
        await backend.run_worker(config, worker_id, sink, stop)
        await cancel_leftovers()

    asyncio.run(main())


async def cancel_leftovers() -> None:
    """Cancel and collect the tasks a library left running, while the loop still runs, so
    none is finalized after it closed."""
    left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)
    gc.collect()


class DispatcherCallsRefused:
    """The `QueueBackend` calls of skiplock's own dispatcher loop, which a native-worker
    queue (its `name` set) never gets: each raises `NativeWorkerOnly`."""

    name: str

    def claim(self, worker_id: str, batch: int, lease: timedelta) -> list[Lease]:
        raise NativeWorkerOnly(self.name, "claim")

    def finish(self, results: Sequence[AttemptResult]) -> list[WriteResult]:
        raise NativeWorkerOnly(self.name, "finish")

    def renew(self, leases: Sequence[Lease], extend: timedelta) -> list[Lease | None]:
        raise NativeWorkerOnly(self.name, "renew")

    def release(self, leases: Sequence[Lease]) -> list[WriteResult]:
        raise NativeWorkerOnly(self.name, "release")

    def recover(self, limit: int = 100) -> int:
        raise NativeWorkerOnly(self.name, "recover")

    def wait_for_work(self, timeout: float) -> bool:
        return False


__all__ = ["DispatcherCallsRefused", "NativeDelivery", "NativeWorkerOnly", "cancel_leftovers",
           "lease_token_of", "run_native_worker"]
