"""`skiplock bench dispatcher`: the dispatcher's own CPU per job, without a database.

The end-to-end rate on a two-core machine moves by a third between runs of the same code
(the server, the workers and the target share the cores), so a change to the dispatcher is
hard to see in it; this figure's rounds agree within about a tenth (runs minutes apart can
differ more: alternate the versions compared). Here one `Dispatcher` runs in this process,
on a queue that does next to nothing (`HandOverQueue`: ready leases in a deque), and
delivers `--jobs` jobs to one echo target in its own process, with its events written to a
worker log as a worker writes them (`LogSink`). The figure is the CPU of the thread that
runs the event loop per job delivered: the claim bookkeeping, the SSRF vetting, the HTTP
call, the result and the event lines. The queue's calls run in `asyncio.to_thread` helpers,
as against PostgreSQL; their CPU (the thread hand-offs, mostly) is shown apart: the
process's CPU minus the loop's. Each round has a fresh queue; a warm-up round runs first and
is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from skiplock.chaos.target import TargetProcess
from skiplock.plumbing.argtypes import positive_int
from skiplock.plumbing.errors import HarnessError
from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.dispatcher import Dispatcher
from skiplock.queue_impl.interface import (
    Account,
    AttemptResult,
    JobState,
    Lease,
    NewJob,
    Outcome,
    WriteResult,
)
from skiplock.reports.history import SUCCEED, WORKER_LOG, LogWriter, write_json
from skiplock.reports.selfdescribe import describe
from skiplock.scenarios.bench.common import add_out, result_path
from skiplock.scenarios.run.workers import LogSink

WARMUP_JOBS = 500
# Whole-run bound per round: a dispatcher that stops delivering must not hang the command.
ROUND_TIMEOUT_SECONDS = 300.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--jobs", type=positive_int, default=5000, metavar="N",
        help="jobs delivered in each timed round (default %(default)d)",
    )  # fmt: skip
    parser.add_argument(
        "--batch", type=positive_int, default=20, metavar="B",
        help="the worker's slots: jobs claimed at once and in flight (default %(default)d)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=positive_int, default=3, metavar="R",
        help="timed rounds, each with a fresh queue (default %(default)d)",
    )  # fmt: skip
    add_out(parser)


class HandOverQueue:
    """A queue that does next to nothing, so that the CPU measured is the dispatcher's: its
    jobs wait as ready leases in a deque, a claim pops up to a batch of them, a receipt and
    a result write are applied at once (each result counted; `done` is called once
    `expected` have been written), a renewal extends its leases. No account limits, no
    retries, no expiry. It confirms receipts, as the reference queue does, so the dispatcher
    takes the same steps per claim as against PostgreSQL."""

    name = "hand-over"

    def __init__(self, expected: int, done: Callable[[], None]) -> None:
        self._ready: deque[Lease] = deque()
        self._expected, self._done = expected, done
        self._lock = threading.Lock()
        self._written = 0
        self.succeeded = 0

    def setup(self) -> None:
        pass

    def upsert_accounts(self, accounts: Sequence[Account]) -> None:
        pass

    def enqueue(self, jobs: Sequence[NewJob]) -> None:
        far = datetime.now(UTC) + timedelta(days=1)
        with self._lock:
            self._ready.extend(
                Lease(job_id=job.id, account_id=job.account_id, target_url=job.target_url,
                      payload=job.payload, attempt=1, max_attempts=job.max_attempts,
                      lease_token=uuid.uuid4(), locked_until=far, worker_id="")
                for job in jobs)

    def claim(self, worker_id: str, batch: int, lease: timedelta) -> list[Lease]:
        with self._lock:
            count = min(batch, len(self._ready))
            return [self._ready.popleft() for _ in range(count)]

    def receive(self, leases: Sequence[Lease]) -> list[WriteResult]:
        return [WriteResult.APPLIED] * len(leases)

    def finish(self, results: Sequence[AttemptResult]) -> list[WriteResult]:
        with self._lock:
            before = self._written
            self._written += len(results)
            self.succeeded += sum(1 for r in results if r.outcome is Outcome.SUCCESS)
            # Only the write that reaches `expected` asks for the stop.
            reached = before < self._expected <= self._written
        if reached:
            self._done()
        return [WriteResult.APPLIED] * len(results)

    def renew(self, leases: Sequence[Lease], extend: timedelta) -> list[Lease | None]:
        until = datetime.now(UTC) + extend
        return [dataclasses.replace(lease, locked_until=until) for lease in leases]

    def release(self, leases: Sequence[Lease]) -> list[WriteResult]:
        with self._lock:
            self._ready.extendleft(reversed(leases))
        return [WriteResult.APPLIED] * len(leases)

    def recover(self, limit: int = 100) -> int:
        return 0

    def wait_for_work(self, timeout: float) -> bool:
        time.sleep(timeout)
        return False

    def snapshot(self) -> list[JobState]:
        return []

    def close(self) -> None:
        pass


async def _round(url: str, allow: str, jobs: int, batch: int, log_path: Path) -> dict[str, Any]:
    """Deliver `jobs` jobs with one dispatcher; its loop thread's and the process's CPU."""
    loop = asyncio.get_running_loop()
    dispatcher: Dispatcher | None = None

    def all_written() -> None:
        if dispatcher is not None:
            loop.call_soon_threadsafe(dispatcher.request_stop, "all jobs written")

    queue = HandOverQueue(jobs, all_written)
    queue.enqueue([NewJob(id=uuid.uuid4(), account_id="bench", target_url=url,
                          payload={"script": SUCCEED.to_json(), "account": "bench"})
                   for _ in range(jobs)])
    config = DispatcherConfig(batch=batch, allow_targets=(allow,), recovery_enabled=False)
    writer = LogWriter(log_path, WORKER_LOG)
    try:
        dispatcher = Dispatcher(queue, config, "bench-dispatcher", LogSink(writer, "bench"))
        wall, loop_cpu, cpu = time.perf_counter(), time.thread_time(), time.process_time()
        await asyncio.wait_for(dispatcher.run(), ROUND_TIMEOUT_SECONDS)
        wall = time.perf_counter() - wall
        loop_cpu, cpu = time.thread_time() - loop_cpu, time.process_time() - cpu
    finally:
        writer.close()
    delivered = queue.succeeded
    return {"jobs": jobs, "delivered": delivered, "wall_seconds": round(wall, 4),
            "jobs_per_second": round(delivered / wall, 1) if wall > 0 else None,
            "loop_cpu_us_per_job": round(loop_cpu * 1e6 / max(delivered, 1), 1),
            "queue_cpu_us_per_job": round((cpu - loop_cpu) * 1e6 / max(delivered, 1), 1)}


def bench(*, jobs: int, batch: int, rounds: int) -> dict[str, Any]:
    """Run the benchmark and return its self-describing result."""
    description = describe()
    started = time.time()
    measured: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="skiplock-bench-dispatcher-") as tmp,
        TargetProcess(Path(tmp), name="bench") as target,
    ):
        allow = f"{target.host}:{target.port}"
        for index in range(rounds + 1):
            count = WARMUP_JOBS if index == 0 else jobs
            log_path = Path(tmp) / f"worker-{index}.csv"
            result = asyncio.run(_round(target.deliver_url, allow, count, batch, log_path))
            if result["delivered"] < count:
                raise HarnessError(f"round {index}: {result['delivered']} of {count} jobs "
                                   "delivered; the figures would not be per job")
            if index:
                measured.append(result)
                print(f"round {index}: {result['jobs_per_second']:,.0f} jobs/s, event loop "
                      f"{result['loop_cpu_us_per_job']:.0f} us CPU per job, queue threads "
                      f"{result['queue_cpu_us_per_job']:.0f} us", flush=True)
    loop_figures = [r["loop_cpu_us_per_job"] for r in measured]
    return {
        "benchmark": "dispatcher",
        "started": started,
        "finished": time.time(),
        "parameters": {"jobs": jobs, "batch": batch, "rounds": rounds,
                       "warmup_jobs": WARMUP_JOBS, "job_script": SUCCEED.to_json()},
        "results": {"rounds": measured,
                    "loop_cpu_us_per_job_median": statistics.median(loop_figures)},
        **description,
        "notes": "One Dispatcher in the benchmark process on a queue that does next to "
        "nothing (ready leases in a deque, every write applied); the echo "
        "target in its own process. Loop CPU is the event-loop thread's CPU time over the "
        "round; queue CPU is the rest of the process's (the to_thread helpers).",
    }


def run(args: argparse.Namespace) -> int:
    if args.out is not None:
        result_path(args.out, "dispatcher")  # refused now, not after the benchmark ran
    result = bench(jobs=args.jobs, batch=args.batch, rounds=args.rounds)
    median = result["results"]["loop_cpu_us_per_job_median"]
    print(f"event loop CPU per job: median {median:.0f} us over {args.rounds} round(s) of "
          f"{args.jobs} jobs, {args.batch} slots")
    if args.out is not None:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    return 0
