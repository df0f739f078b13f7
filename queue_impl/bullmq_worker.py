"""BullMQ as its users deploy it: BullMQ's own `Worker` loop, with skiplock's delivery inside.

The consumer loop is the library's (fetch a job under a lock, extend locks while it runs, move
it to completed or failed, check for stalled jobs); skiplock only supplies the processor, which
turns the job into a `Lease` and hands it to the same `Deliverer` the dispatcher uses, so the
HTTP call goes through the same SSRF guard, timeout, identity headers and `http` event. The
worker events are the dispatcher's (`claim` when the processor starts, `http`, `write` when
BullMQ reports the job completed or failed), so a history reads the same whichever loop ran.

How BullMQ's notions map onto the reference's:
- lease: the job's lock (`lockDuration`, the config's lease), renewed by the worker every half
  lock as the dispatcher renews; recovery: BullMQ's stalled-job check (`stalledInterval`, the
  config's recovery interval), which moves a job whose lock expired back to wait;
- attempt: BullMQ's `attemptsMade` + 1 when the processor starts: its max attempts (the
  job's `attempts`) and its backoff count *finished* attempts, so a pick that stalled is not
  counted, and a second pick under the same number has its own lease token; after
  `maxStalledCount` stalls (1) BullMQ fails the job without running the processor, so no
  worker event records that end;
- outcome: success returns; a permanent failure raises `UnrecoverableError` (BullMQ's dead
  letter: the failed set, no retry); a transient one raises, and BullMQ retries with the
  backoff the job was added with (`backoff_option`: exponential from the retry base);
- lease token: the job id with BullMQ's lock token (`<worker id>:<n>`), as a UUID derived
  from them, so each pick of a job has its own identity in the history.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Coroutine, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.events import EventSink
from skiplock.queue_impl.interface import Lease, Outcome
from skiplock.queue_impl.native import (
    NativeDelivery,
    WriteRefused,
    cancel_leftovers,
    lease_token_of,
)

# BullMQ's answers to a result write when this worker's pick is no longer the job's (its lock
# expired and another pick, or the stall check, moved it): the script refused and changed
# nothing, as a fenced write does. (Job not there, lock not there, lock not this pick's.)
_REFUSED_CODES = frozenset({-1, -2, -6})
_WRITE_SCRIPTS = ("moveToFinished", "moveToDelayed", "retryJob")


class TransientFailure(Exception):
    """A failed call worth retrying: BullMQ retries the job with its backoff."""


def job_fields(job_id: uuid.UUID, account_id: str, target_url: str,
               payload: Mapping[str, Any], max_attempts: int,
               retry_base_seconds: float) -> dict[str, Any]:
    """One job as `Queue.add`/`addBulk` take it: the reference's fields as its data, its id
    as BullMQ's job id, its attempts and backoff as BullMQ's options; finished jobs are kept
    (the final snapshot reads them)."""
    return {"name": "deliver",
            "data": {"account_id": account_id, "target_url": target_url,
                     "payload": dict(payload)},
            "opts": {"jobId": str(job_id), "attempts": max_attempts,
                     "removeOnComplete": False, "removeOnFail": False,
                     **backoff_option(retry_base_seconds)}}


def backoff_option(retry_base_seconds: float) -> dict[str, Any]:
    """BullMQ's exponential backoff waits base * 2^(attempts made - 1), as the reference's
    does without its jitter and cap (BullMQ has neither)."""
    return {"backoff": {"type": "exponential", "delay": round(retry_base_seconds * 1000)}}


def lease_of(job: Any, token: str, config: DispatcherConfig, worker_id: str) -> Lease:
    data = job.data
    return Lease(
        job_id=uuid.UUID(str(job.id)),
        account_id=str(data.get("account_id", "")),
        target_url=str(data["target_url"]),
        payload=data.get("payload") or {},
        # BullMQ's own count: finished attempts + 1, the number its backoff is computed from
        # (a pick whose lock expired is not counted). Two picks under one number are told
        # apart by their lease tokens.
        attempt=int(job.attemptsMade) + 1,
        max_attempts=int(job.opts.get("attempts", 1)),
        # The job's lock is its own key, holding the token: the pair names one pick. (The
        # Python port's `Worker.run` hands jobs fetched in one pass the same token, a
        # late-bound closure variable, so the token alone does not.)
        lease_token=lease_token_of(f"{job.id}:{token}"),
        locked_until=datetime.now(UTC) + timedelta(seconds=config.lease_seconds),
        worker_id=worker_id,
    )


def refusals_raised(scripts: Any) -> None:
    """Make BullMQ's result-writing scripts raise `WriteRefused` when the script answers with
    a refusal code: a write is told fenced by what the script did, not by the text of the
    error BullMQ would make of it."""
    for name in _WRITE_SCRIPTS:
        command = scripts.commands[name]

        async def checked(*args: Any, _command: Any = command, _name: str = name,
                          **kwargs: Any) -> Any:
            answer = await _command(*args, **kwargs)
            if isinstance(answer, int) and answer in _REFUSED_CODES:
                raise WriteRefused(f"{_name} refused (code {answer}): the job's lock is no "
                                   "longer this pick's")
            return answer

        scripts.commands[name] = checked


async def run_bullmq_worker(url: str, queue_name: str, config: DispatcherConfig,
                            worker_id: str, sink: EventSink, stop: asyncio.Event,
                            prefix: str = "bull") -> None:
    """Run one BullMQ `Worker` (concurrency: the config's batch) until `stop` is set, then
    close it: it stops fetching, and the jobs it holds finish and are written first."""
    from bullmq import UnrecoverableError, Worker

    quiet_redis_finalizers()
    async with NativeDelivery(config, worker_id, sink) as delivery:
        # Keyed by the Job object: BullMQ reports a job's end with the very object its
        # processor got (its `token` and `attemptsMade` may have changed by then).
        async def process(job: Any, token: str) -> None:
            call = await delivery.run(id(job), lease_of(job, token, config, worker_id))
            if call.outcome is Outcome.SUCCESS:
                return None
            if call.outcome is Outcome.PERMANENT:
                raise UnrecoverableError(call.error or "permanent failure")
            raise TransientFailure(call.error or "transient failure")

        def completed(job: Any, *_: Any) -> None:
            delivery.written(id(job))

        def failed(job: Any, err: Any = None, *_: Any) -> None:
            # A failed job whose call succeeded: BullMQ could not record the completion
            # (its moveToCompleted raised) and failed the job instead; what became of the
            # success is not known from here.
            if delivery.outcome_of(id(job)) is Outcome.SUCCESS:
                text = " ".join(str(err).split()) or "completion not recorded"
                delivery.written(id(job), "info", text)
            else:
                delivery.written(id(job))

        def failed_to_write(err: Any, job: Any = None) -> None:
            # BullMQ could not move the job on: refused (its lock was gone) or unknown (Redis
            # failed; the write may or may not have happened). Without a job it is the
            # loop's own error (a fetch, a lock extension, the stall check).
            text = " ".join(str(err).split()) or type(err).__name__
            result = "fenced" if isinstance(err, WriteRefused) else "info"
            if job is None or not delivery.written(id(job), result, text):
                delivery.error("bullmq", f"{type(err).__name__}: {text}")

        worker = recording_worker(Worker, delivery, config, worker_id)(queue_name, process, {
            "connection": url, "prefix": prefix, "concurrency": config.batch,
            "autorun": False,
            "lockDuration": round(config.lease_seconds * 1000),
            "stalledInterval": round(config.recovery_interval_seconds * 1000),
            "name": worker_id})
        worker.on("completed", completed)
        worker.on("failed", failed)
        worker.on("error", failed_to_write)
        await run_until(worker, stop)


def recording_worker(worker_class: type[Any], delivery: NativeDelivery,
                     config: DispatcherConfig, worker_id: str) -> type[Any]:
    """BullMQ's `Worker` whose lock extensions are recorded as renewals of the picks they
    keep (held, or refused: the lock was no longer this pick's). BullMQ's own method sends
    the same scripts in one pipeline and ignores their answers."""

    class RecordingWorker(worker_class):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            refusals_raised(self.scripts)

        async def extendLocks(self) -> None:
            held = list(self.jobs)
            # The leases as they are now: a job's attemptsMade grows once it completes,
            # which may happen while the pipeline runs.
            leases = [lease_of(job, token, config, worker_id) for job, token in held]
            try:
                multi = self.client.pipeline()
                for job, token in held:
                    await self.scripts.extendLock(job.id, token, self.opts.get("lockDuration"),
                                                  multi)
                answers = await multi.execute()
            except Exception as exc:  # BullMQ's own method prints it and carries on
                delivery.error("renew", f"{type(exc).__name__}: {' '.join(str(exc).split())}")
                return
            for lease, answer in zip(leases, answers, strict=True):
                delivery.renewed(lease, held=int(answer) == 1)

    return RecordingWorker


async def run_until(worker: Any, stop: asyncio.Event) -> None:
    """Run `worker` until `stop`; then close it (it stops fetching, and the jobs it holds
    finish and are written). A loop that ends by itself first (BullMQ's loop returns on an
    error it only prints) is an error, raised once the worker is closed: the `stop` event
    (`NativeDelivery`'s) says so."""
    loop = asyncio.ensure_future(worker.run())
    stopping = asyncio.ensure_future(stop.wait())
    failure: BaseException | None = None
    try:
        await asyncio.wait({loop, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if loop.done():
            failure = loop.exception() or RuntimeError(
                "BullMQ's worker loop ended before it was stopped")
    finally:
        stopping.cancel()
        await worker.close()
        if not loop.done():
            await loop
    if failure is not None:
        raise failure


def quiet_redis_finalizers() -> None:
    """Some of BullMQ's Redis clients are still connected when `Worker.close` returns (a
    blocking fetch or a timer caught mid-command); finalized after the loop closed, each
    would print "Event loop is closed" from `Redis.__del__`, a traceback about a socket the
    process is done with anyway, or, while the loop runs, "Unclosed Redis client" through the
    loop's exception handler. Call inside the running loop: those two reports are not
    printed; every other unraisable error and loop exception still is."""
    default_hook = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if (isinstance(unraisable.exc_value, RuntimeError)
                and str(unraisable.exc_value) == "Event loop is closed"
                and "redis" in getattr(unraisable.object, "__module__", "")):
            return
        default_hook(unraisable)

    def quiet_unclosed(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != "Unclosed Redis client":
            loop.default_exception_handler(context)

    if sys.unraisablehook is not hook:
        sys.unraisablehook = hook
    asyncio.get_running_loop().set_exception_handler(quiet_unclosed)


def run_in_own_loop(main: Coroutine[Any, Any, None]) -> None:
    """`asyncio.run` for a process that runs BullMQ: its finalizer reports silenced
    (`quiet_redis_finalizers`), and leftover tasks cancelled and collected while the loop
    still runs."""

    async def then_collect() -> None:
        quiet_redis_finalizers()
        await main
        await cancel_leftovers()

    asyncio.run(then_collect())
