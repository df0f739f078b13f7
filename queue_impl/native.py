"""One skiplock function per job, for a queue that brings its own consumer loop.

A native-worker backend (`skiplock.queue_impl.interface.RunsOwnWorker`) runs its library's consumer
(BullMQ's `Worker`, pgqueuer's `QueueManager`, ...) in each worker process, given a
`NativeConfig`: the dispatcher's settings plus the run's accounts with their limits and its
`max_attempts`, so the plug-in keeps no tables of its own for them. It enters a
`NativeDelivery` around the loop (which writes the worker's `start` and `stop` events, the
stop saying the error the loop ended on), and uses it for everything between the library
and the history:

- `encode_job` / `lease`: a job as the library stores it (JSON with the harness's id,
  account, target, payload and `max_attempts`) and back, as one pick's `Lease`;
- `claimed` / `run`: record the pick when the library's fetch returns it, pass the crash
  failpoints, make the HTTP call through the dispatcher's `Deliverer` (SSRF guard, timeout,
  identity headers, `http` event);
- `write`: await the library's result write and record it by its outcome: applied when it
  returns, fenced when it returns a refusal (`refused`) or raises `WriteRefused`, info
  (unknown: it may or may not have committed) when it raises anything else;
- `heartbeat`: await the library's lease renewal and record a renewal of every pick it kept
  (all of this worker's, or those `which` names), stamped with when it was sent.

A history then reads the same whichever loop ran. The lease token is the claim's identity in
the history: `lease` derives it from whatever names one pick of a job in the library
(BullMQ's lock token, pgqueuer's row and pick time), so two picks under one attempt number
are still told apart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import os
import random
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.deliver import Deliverer
from skiplock.queue_impl.events import Call, EventSink, claim_event, renew_event, write_event
from skiplock.queue_impl.failpoints import Failpoints
from skiplock.queue_impl.interface import (
    Account,
    AttemptResult,
    Lease,
    NewJob,
    Outcome,
    RunsOwnWorker,
    WriteResult,
)

# Library identities of a pick (lock tokens, row versions) become lease tokens in this
# namespace: the same in every process, different for every pick.
_TOKEN_NAMESPACE = uuid.UUID("5b0f5c1e-6a43-4a53-9a56-8f3d1a8e7c21")

WriteOutcome = str  # "applied" | "fenced" | "info"
T = TypeVar("T")


class NativeWorkerOnly(NotImplementedError):
    """A call of skiplock's own dispatcher loop, which a native-worker queue never gets."""

    def __init__(self, queue: str, call: str) -> None:
        super().__init__(f"{queue} runs its own worker loop; {call}() is never called")


class WriteRefused(Exception):
    """Raised by a plug-in's write (or by `NativeDelivery.write`'s `refused`) when the library
    refused a result write because the pick was no longer this worker's: recorded fenced."""


class CallFailed(Exception):
    """A failed call, raised from a job handler for a library that ends a job it should not
    retry (or retry by its own backoff) on an exception: the text is the call's error."""


@dataclass(frozen=True, kw_only=True)
class NativeConfig(DispatcherConfig):
    """A native worker's settings: the dispatcher's, plus what skiplock's own loop reads from
    the queue and a library's loop cannot: the run's accounts with their concurrency limits
    (None: unlimited) and the scenario's `max_attempts` (each job also carries its own)."""

    accounts: tuple[Account, ...] = ()
    max_attempts: int = 3

    @classmethod
    def native(cls, config: DispatcherConfig) -> NativeConfig:
        """`config` as a NativeConfig (no accounts when it is a plain DispatcherConfig)."""
        if isinstance(config, NativeConfig):
            return config
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})


@dataclass(frozen=True, kw_only=True)
class JobData:
    """What a library stores of one job (`encode_job`), read back by `NativeDelivery.lease`."""

    job_id: uuid.UUID
    account_id: str
    target_url: str
    payload: Mapping[str, Any]
    max_attempts: int


def encode_job(job: NewJob) -> bytes:
    """One job as a library's payload: JSON, decoded again by `decode_job`."""
    return json.dumps({"job_id": str(job.id), "account_id": job.account_id,
                       "target_url": job.target_url, "payload": dict(job.payload),
                       "max_attempts": job.max_attempts}).encode()


def decode_job(raw: bytes | str | Mapping[str, Any]) -> JobData:
    """A job from `encode_job`'s bytes (or the mapping they decode to)."""
    data = raw if isinstance(raw, Mapping) else json.loads(raw)
    return JobData(job_id=uuid.UUID(str(data["job_id"])), account_id=str(data["account_id"]),
                   target_url=str(data["target_url"]), payload=data.get("payload") or {},
                   max_attempts=int(data["max_attempts"]))


def delay_of(job: NewJob) -> timedelta | None:
    """How long from now until `job` is due (None: due now), for a library's enqueue."""
    return None if job.run_at is None else max(job.run_at - datetime.now(UTC), timedelta(0))


def lease_token_of(identity: str) -> uuid.UUID:
    """A lease token for one pick, from the library's own name for it."""
    return uuid.uuid5(_TOKEN_NAMESPACE, identity)


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and its text."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


@dataclass(frozen=True)
class _Running:
    lease: Lease
    outcome: Outcome
    error: str | None
    started: float


class NativeDelivery:
    """One worker's per-job functions for a native consumer loop. Enter it (`async with`)
    around the loop: it writes the `start` event, and the `stop` event when the loop ends
    (with the error it raised, if any). Keys name one pick wherever the loop finds it again
    (the library's job object, a row id with the pick's time): `claimed`, `run`, `write` and
    `heartbeat` take the same key for the same pick."""

    def __init__(self, config: DispatcherConfig, worker_id: str, sink: EventSink) -> None:
        config.validate()
        self.config = NativeConfig.native(config)
        self.worker_id = worker_id
        self._sink = sink
        self.failpoints = Failpoints(config, worker_id)
        self._deliverer = Deliverer(
            config, worker_id, sink,
            after_success=lambda lease: self.failpoints.crash_if_fires(
                "crash_after_http", lease, sink))
        # Every pick this worker holds, from its claim to its result write.
        self.picks: dict[Hashable, Lease] = {}
        self._announced: set[Hashable] = set()
        self._running: dict[Hashable, _Running] = {}
        self._policy = dataclasses.replace(config.retry_policy(), rng=random.Random(
            f"retry:{config.seed}:{worker_id}" if config.seed is not None else None))

    async def __aenter__(self) -> NativeDelivery:
        await self._deliverer.__aenter__()
        self._sink("start", {"pid": os.getpid()})
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: object) -> None:
        reason = "stopped"
        if exc is not None and not isinstance(exc, asyncio.CancelledError | KeyboardInterrupt):
            reason = f"error: {one_line(exc)}"
        try:
            await self._deliverer.__aexit__(exc_type, exc, tb)
        finally:
            self._sink("stop", {"reason": reason})

    def lease(self, data: bytes | str | Mapping[str, Any] | JobData, *, pick: str,
              attempt: int, held_from: datetime | None = None) -> Lease:
        """One pick of a job as a lease: `data` is what `encode_job` wrote, `pick` the
        library's name for this pick (its lock token, its row version), `attempt` the
        library's own count (+ 1 when it counts finished attempts), `held_from` when the
        library took it (now when not given)."""
        job = data if isinstance(data, JobData) else decode_job(data)
        start = held_from if held_from is not None else datetime.now(UTC)
        return Lease(job_id=job.job_id, account_id=job.account_id,
                     target_url=job.target_url, payload=job.payload, attempt=attempt,
                     max_attempts=job.max_attempts, lease_token=lease_token_of(pick),
                     locked_until=start + timedelta(seconds=self.config.lease_seconds),
                     worker_id=self.worker_id)

    def claimed(self, key: Hashable, lease: Lease, sent: float | None = None) -> None:
        """Record a claim when the library makes it (its fetch returned the job, `sent` when
        that fetch was sent), which may be well before the job's handler runs; then pass its
        failpoint."""
        self.picks[key] = lease
        self._announced.add(key)
        self._sink("claim", claim_event(lease, sent))
        self.failpoints.crash_if_fires("crash_after_claim", lease, self._sink)

    async def run(self, key: Hashable, lease: Lease | None = None) -> Call:
        """Deliver the pick under `key` (its lease as `claimed` recorded it, else `lease`,
        recording the claim now); the call's outcome is remembered for `write`."""
        if key in self._announced:
            self._announced.discard(key)
            lease = self.picks[key]
        elif lease is not None:
            self.claimed(key, lease)
            self._announced.discard(key)
        else:
            raise KeyError(f"no claim recorded under {key!r} and no lease given")
        call = await self._deliverer.deliver(lease)
        self._running[key] = _Running(lease, call.outcome, call.error, time.time())
        return call

    def retry_delay(self, key: Hashable) -> timedelta | None:
        """How long to wait before the next attempt of the call run under `key`, by the run's
        backoff (jitter and cap included, seeded per worker); None when the job should fail
        instead (or has succeeded): a permanent failure, or a transient one on its last
        attempt."""
        found = self._running.get(key)
        if (found is None or found.outcome is not Outcome.TRANSIENT
                or found.lease.attempt >= found.lease.max_attempts):
            return None
        return self._policy.delay(found.lease.attempt)

    def outcome_of(self, key: Hashable) -> Outcome | None:
        """What the call run under `key` came to, while its write is still to come."""
        found = self._running.get(key)
        return found.outcome if found is not None else None

    def written(self, key: Hashable, result: WriteOutcome = "applied",
                error: str | None = None) -> bool:
        """Record the write of the job run under `key`; False when no call is known there
        (the library reported a job this worker did not deliver)."""
        self.picks.pop(key, None)
        self._announced.discard(key)
        found = self._running.pop(key, None)
        if found is None:
            return False
        self._sink("write", write_event(found.lease, found.outcome, result,
                                        error if error is not None else found.error,
                                        found.started))
        return True

    async def write(self, keys: Sequence[Hashable], statement: Awaitable[T],
                    refused: Callable[[T], bool] | None = None) -> T:
        """Await the library's write of the results of `keys` and record each by its outcome:
        fenced when `refused` says its answer is a refusal or it raises `WriteRefused`,
        applied when it returns, info (unknown) when it raises anything else. The picks are
        no longer renewed from the moment it is sent."""
        for key in keys:
            self.picks.pop(key, None)
        try:
            answer = await statement
        except WriteRefused as exc:
            for key in keys:
                self.written(key, "fenced", " ".join(str(exc).split()) or "refused")
            raise
        except BaseException as exc:
            for key in keys:
                self.written(key, "info", one_line(exc))
            raise
        result = "fenced" if refused is not None and refused(answer) else "applied"
        for key in keys:
            self.written(key, result, "refused by the queue" if result == "fenced" else None)
        return answer

    async def heartbeat(self, statement: Awaitable[T],
                        which: Callable[[Hashable], bool] | None = None,
                        held: Callable[[T], Sequence[bool]] | None = None) -> T:
        """Await the library's lease renewal and record a renewal of every pick it kept alive
        (this worker's picks, or those `which` accepts), stamped with when it was sent (a
        heartbeat lease runs from there). `held` maps its answer to one flag per renewed pick
        when the library says which renewals it refused."""
        sent = time.time()
        kept = [(k, lease) for k, lease in self.picks.items() if which is None or which(k)]
        try:
            answer = await statement
        except Exception as exc:
            self.error("renew", one_line(exc))
            raise
        flags = list(held(answer)) if held is not None else [True] * len(kept)
        for (_, lease), ok in zip(kept, flags, strict=True):
            self.renewed(lease, held=ok, sent=sent)
        return answer

    def renewed(self, lease: Lease, held: bool = True, sent: float | None = None) -> None:
        """Record a renewal of `lease` the library made, once it returned: held for another
        `lease_seconds` from now, or refused (`held` False: the pick was no longer this
        worker's). `sent`: when the renewal was sent. Without these, a pick kept alive past
        its first lease would look expired to the checker from claim + lease on."""
        until = (datetime.now(UTC) + timedelta(seconds=self.config.lease_seconds)
                 if held else None)
        event = renew_event(lease, until)
        if sent is not None:
            event["started"] = sent
        self._sink("renew", event)

    def forget_picks(self) -> None:
        """Drop every pick held: the library's loop that held them failed and is started
        again, so it will neither run, write nor renew them (a renewal of the same job by the
        new loop is not theirs); each lease runs out as it stands, and the job is picked
        again."""
        self.picks.clear()
        self._announced.clear()
        self._running.clear()

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
        await backend.run_worker(NativeConfig.native(config), worker_id, sink, stop)
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
    queue (its `name` set) never gets: each raises `NativeWorkerOnly`. `upsert_accounts`
    does nothing: the accounts reach the workers in their `NativeConfig`."""

    name: str

    def upsert_accounts(self, accounts: Sequence[Account]) -> None:
        return None

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


__all__ = ["CallFailed", "DispatcherCallsRefused", "JobData", "NativeConfig", "NativeDelivery",
           "NativeWorkerOnly", "WriteRefused", "cancel_leftovers", "decode_job", "delay_of",
           "encode_job", "lease_token_of", "one_line", "run_native_worker"]
