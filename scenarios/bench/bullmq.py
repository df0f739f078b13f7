"""`skiplock bench queue --against bullmq`: the same measurement on BullMQ, the Redis queue,
through its Python package as its users deploy it (its own `Worker` loop: fetch under a lock,
run the processor, move the job to completed, fetch the next), beside the reference in the
same command.

W processes each run one `Worker` with a do-nothing processor and a concurrency of B (the
batch: jobs held at once, as the reference holds a claimed batch), on a backlog the size of
the reference's with the same job fields and `attempts` (max_attempts 3). They start
together, stop fetching after `duration` seconds and finish what they hold; the jobs
completed divided by the duration is the rate, as the PgQueue phase counts the jobs its
workers finished in the same time. BullMQ keeps completed jobs (its default), as the reference
keeps COMPLETED rows.

Redis comes from `skiplock.scenarios.servers.redis`, durable in the same class as the PostgreSQL
phases (an append-only file fsynced before each reply, against commits fsynced before they
return); the result records both servers' settings. The `bullmq` package is pinned to the last
release that does not pin `croniter` below what pgqueuer needs, so both comparisons install
together.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any, cast

from skiplock.scenarios.bench.common import processes_in_step, require_package, say_progress

QUEUE_NAME = "skiplock-bench"
ENQUEUE_CHUNK = 1_000
# BullMQ's own default; the reference's bench jobs allow 3 attempts too.
MAX_ATTEMPTS = 3


def require_bullmq() -> str:
    """bullmq's version; UsageError when it is not installed."""
    return require_package("bullmq", "--against bullmq", "pip install bullmq")


@contextlib.contextmanager
def redis_for(url: str | None, durability: str, say: Any) -> Iterator[Any]:
    """The Redis a comparison runs on, in the class matching `durability` (`fsync`: AOF
    fsynced per write; `relaxed`: once a second), said in one line, with a warning when a
    server given by URL runs otherwise."""
    from skiplock.scenarios.servers.redis import Durability, redis_server

    appendfsync: Durability = "always" if durability == "fsync" else "everysec"
    with redis_server(url, durability=appendfsync) as redis:
        found = redis.settings()
        matches = found["appendonly"] == "yes" and found["appendfsync"] == appendfsync
        say(f"redis: {redis.kind} {redis.display}, Redis {found['redis_version']}, "
            f"appendonly={found['appendonly']} appendfsync={found['appendfsync']}"
            + ("" if matches else f"  (NOT appendfsync {appendfsync}: figures are not "
                                  "comparable)"))
        yield redis


def redis_record(redis: Any) -> dict[str, Any]:
    """What a result file says of the Redis it ran on."""
    return {**redis.settings(), "kind": redis.kind, "url": redis.display}


def _job(n: int) -> dict[str, Any]:
    # The fields a reference job carries, so both queues move payloads of the same size.
    return {"name": "bench", "data": {"account_id": f"acct-{n % 8}",
                                      "target_url": "http://127.0.0.1:9/deliver",
                                      "payload": {"n": n}},
            "opts": {"attempts": MAX_ATTEMPTS}}


async def _prefill(url: str, count: int) -> float:
    from bullmq import Queue

    queue = Queue(QUEUE_NAME, {"connection": url})
    try:
        await queue.obliterate(force=True)
        started = time.perf_counter()
        for first in range(0, count, ENQUEUE_CHUNK):
            await queue.addBulk([_job(n) for n in range(first, min(count, first + ENQUEUE_CHUNK))])
        return time.perf_counter() - started
    finally:
        await queue.close()


async def _counts(url: str) -> dict[str, int]:
    from bullmq import Queue

    queue = Queue(QUEUE_NAME, {"connection": url})
    try:
        counts = await queue.getJobCounts("waiting", "active", "completed", "failed")
        return {k: int(v) for k, v in counts.items()}
    finally:
        await queue.close()


async def _work(url: str, batch: int, duration: float, ready: Any, go: Any) -> None:
    from bullmq import Worker

    from skiplock.queue_impl.bullmq_worker import run_until

    async def process(_job: Any, _token: str) -> None:
        return None

    worker = Worker(QUEUE_NAME, process, {"connection": url, "concurrency": batch,
                                          "autorun": False})
    ready.release()
    while not go.is_set():
        await asyncio.sleep(0.005)
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(duration, stop.set)
    # No event log in the queue-only phase: there is nothing of a run to judge.
    await run_until(worker, stop)


class _CompletedCounter:
    """BullMQ's completed count for the progress line: one ZCARD, O(1) in Redis."""

    def __init__(self, url: str) -> None:
        import redis

        self._client = redis.Redis.from_url(url, socket_timeout=1.0)
        self._key = f"bull:{QUEUE_NAME}:completed"

    def __call__(self) -> int | None:
        import redis

        try:
            return int(cast(int, self._client.zcard(self._key)))
        except redis.RedisError:
            return None

    def close(self) -> None:
        self._client.close()


def _worker(url: str, batch: int, duration: float, ready: Any, go: Any) -> None:
    from skiplock.queue_impl.bullmq_worker import run_in_own_loop

    run_in_own_loop(_work(url, batch, duration, ready, go))


def bullmq_phase(url: str, *, workers: int, batch: int, duration: float,
                 prefill: int, say: Any) -> dict[str, Any]:
    """jobs, seconds, jobs_per_second, ran_dry, failed and bullmq's version."""
    import multiprocess

    version = require_bullmq()
    say(f"prefill: {prefill} jobs for the BullMQ phase (bullmq {version})")
    asyncio.run(_prefill(url, prefill))
    ctx = multiprocess.get_context("fork")
    ready = ctx.Semaphore(0)
    go = ctx.Event()
    procs = [ctx.Process(target=_worker, args=(url, batch, duration, ready, go),
                         name=f"bullmq-{i}", daemon=True) for i in range(workers)]
    with processes_in_step(procs, ready, what="BullMQ", join_seconds=duration + 60):
        say(f"BullMQ: {workers} Worker processes, concurrency {batch}, {duration:g} s")
        go.set()
        completed = _CompletedCounter(url)
        try:
            say_progress(procs, duration, completed, say)
        finally:
            completed.close()
    counts = asyncio.run(_counts(url))
    jobs = counts.get("completed", 0)
    return {"jobs": jobs, "seconds": duration, "jobs_per_second": jobs / duration,
            "ran_dry": counts.get("waiting", 0) == 0, "failed": counts.get("failed", 0),
            "version": version, "driver": "bullmq Worker (redis-py asyncio), multiprocess fork"}


# --- end to end: BullMQ's Worker, skiplock's delivery, the same echo target ----------------


def _e2e_worker(url: str, config: Any, worker_id: str, events_path: str, ready: Any,
                go: Any, duration: float) -> None:
    from pathlib import Path

    from skiplock.plumbing.orphans import name_this_process
    from skiplock.queue_impl.bullmq_worker import run_bullmq_worker, run_in_own_loop
    from skiplock.reports.history import WORKER_LOG, LogWriter
    from skiplock.scenarios.run.workers import LogSink

    name_this_process("skiplock-worker")
    writer = LogWriter(Path(events_path), WORKER_LOG)

    async def main() -> None:
        stop = asyncio.Event()
        ready.release()
        while not go.is_set():
            await asyncio.sleep(0.005)
        asyncio.get_running_loop().call_later(duration, stop.set)
        await run_bullmq_worker(url, QUEUE_NAME, config, worker_id,
                                LogSink(writer, worker_id), stop)

    try:
        run_in_own_loop(main())
    finally:
        writer.close()


async def _prefill_deliveries(url: str, count: int, target_url: str,
                              retry_base_seconds: float) -> None:
    import uuid

    from bullmq import Queue

    from skiplock.queue_impl.bullmq_worker import job_fields

    queue = Queue(QUEUE_NAME, {"connection": url})
    try:
        await queue.obliterate(force=True)
        for first in range(0, count, ENQUEUE_CHUNK):
            await queue.addBulk([
                job_fields(uuid.uuid4(), f"acct-{n % 8}", target_url, {"n": n}, MAX_ATTEMPTS,
                           retry_base_seconds)
                for n in range(first, min(count, first + ENQUEUE_CHUNK))])
    finally:
        await queue.close()


def bullmq_e2e_phase(url: str, params: Any, say: Any) -> Any:
    """`bench e2e`'s full path with BullMQ as the queue: W processes each run BullMQ's own
    Worker (concurrency: the batch) whose processor delivers through skiplock's `Deliverer`
    to an echo target in its own process, with the worker event logs of a run; judged by
    the same window as the PostgreSQL phase."""
    import tempfile
    from pathlib import Path

    import multiprocess

    from skiplock.chaos.target import TargetProcess
    from skiplock.queue_impl.config import DispatcherConfig
    from skiplock.scenarios.bench.window import judge_window, timed_window

    version = require_bullmq()
    with tempfile.TemporaryDirectory(prefix="skiplock-bench-bullmq-") as tmp:
        events = Path(tmp) / "workers"
        events.mkdir()
        with TargetProcess(Path(tmp), name="target-0") as target:
            config = DispatcherConfig(
                batch=params.batch, lease_seconds=30.0, http_timeout_seconds=5.0,
                write_margin_seconds=5.0, allow_targets=(f"127.0.0.1:{target.port}",),
                seed=1)
            say(f"prefill: {params.prefill} jobs for the BullMQ phase (bullmq {version})")
            asyncio.run(_prefill_deliveries(url, params.prefill, target.deliver_url,
                                            config.retry_base_seconds))
            ctx = multiprocess.get_context("spawn")
            ready = ctx.Semaphore(0)
            go = ctx.Event()
            procs = [ctx.Process(target=_e2e_worker,
                                 args=(url, config, f"worker-{i}",
                                       str(events / f"worker-{i}.csv"), ready, go,
                                       params.duration),
                                 name=f"bullmq-{i}", daemon=True)
                     for i in range(params.workers)]
            with processes_in_step(procs, ready, what="BullMQ", join_seconds=60):
                say(f"BullMQ end to end: {params.workers} Worker processes, concurrency "
                    f"{params.batch}, {params.duration:g} s")
                go.set()
                window = timed_window([p.pid for p in procs], target, params.duration)
        return judge_window(events, window, params)
