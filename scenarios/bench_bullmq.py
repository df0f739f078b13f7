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

Redis comes from `scenarios.provision_redis`, durable in the same class as the PostgreSQL
phases (an append-only file fsynced before each reply, against commits fsynced before they
return); the result records both servers' settings. The `bullmq` package is pinned to the last
release that does not pin `croniter` below what pgqueuer needs, so both comparisons install
together.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from plumbing.errors import HarnessError, UsageError

QUEUE_NAME = "skiplock-bench"
ENQUEUE_CHUNK = 1_000
READY_TIMEOUT_SECONDS = 60.0
# BullMQ's own default; the reference's bench jobs allow 3 attempts too.
MAX_ATTEMPTS = 3


def require_bullmq() -> str:
    """bullmq's version; UsageError when it is not installed."""
    try:
        from importlib.metadata import version

        import bullmq  # noqa: F401
    except ImportError:
        raise UsageError("--against bullmq needs the bullmq package: pip install bullmq"
                         ) from None
    return version("bullmq")


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

    async def process(_job: Any, _token: str) -> None:
        return None

    worker = Worker(QUEUE_NAME, process, {"connection": url, "concurrency": batch,
                                          "autorun": False})
    ready.release()
    while not go.is_set():
        await asyncio.sleep(0.005)
    running = asyncio.ensure_future(worker.run())
    await asyncio.sleep(duration)
    # Stops fetching, waits for the jobs it holds to be completed.
    await worker.close()
    await running


def _worker(url: str, batch: int, duration: float, ready: Any, go: Any) -> None:
    asyncio.run(_work(url, batch, duration, ready, go))


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
    try:
        for proc in procs:
            proc.start()
        for _ in procs:
            if not ready.acquire(timeout=READY_TIMEOUT_SECONDS):
                raise HarnessError("a BullMQ worker did not get ready in time")
        say(f"BullMQ: {workers} Worker processes, concurrency {batch}, {duration:g} s")
        go.set()
        for proc in procs:
            proc.join(timeout=duration + 60)
        failed = [p.name for p in procs if p.exitcode != 0]
        if failed:
            raise HarnessError(f"BullMQ worker(s) failed: {', '.join(failed)}")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    counts = asyncio.run(_counts(url))
    jobs = counts.get("completed", 0)
    return {"jobs": jobs, "seconds": duration, "jobs_per_second": jobs / duration,
            "ran_dry": counts.get("waiting", 0) == 0, "failed": counts.get("failed", 0),
            "version": version, "driver": "bullmq Worker (redis-py asyncio), multiprocess fork"}
