"""`skiplock bench queue --against pgqueuer`: the same measurement on pgqueuer, the PostgreSQL
queue from PyPI, as its users deploy it (its own `QueueManager` loop, buffered completions,
heartbeats), beside the reference in the same command.

W processes each run one `QueueManager` with a do-nothing entrypoint and `batch_size` B, on
a backlog the size of the reference's, in a database of its own on the same server (durable
settings, as the other phases). They start together, stop dequeuing after `duration`
seconds, finish what they hold and flush their completions; the jobs gone from pgqueuer's
queue table divided by the duration is the rate, as the PgQueue phase counts the jobs its
workers finished in the same time. pgqueuer keeps no claim/finish cycle of its own to time,
so this phase has no cycle latency.

pgqueuer is optional (`pip install 'skiplock[pgqueuer]'`); without it `--against pgqueuer`
is bad input, said before anything runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from datetime import timedelta
from typing import Any

import psycopg

from skiplock.scenarios.bench.common import processes_in_step, require_package, say_progress
from skiplock.scenarios.servers.postgres import fresh_database

ENTRYPOINT = "skiplock_bench"
ENQUEUE_CHUNK = 5_000


def require_pgqueuer() -> str:
    """pgqueuer's version; UsageError when it is not installed."""
    return require_package("pgqueuer", "--against pgqueuer",
                           "pip install 'skiplock[pgqueuer]'")


async def _prefill(dsn: str, count: int, vacuum: bool = True) -> float:
    from pgqueuer.db import PsycopgDriver
    from pgqueuer.queries import Queries

    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    try:
        queries = Queries(PsycopgDriver(conn))
        await queries.install()
        started = time.perf_counter()
        for first in range(0, count, ENQUEUE_CHUNK):
            n = min(ENQUEUE_CHUNK, count - first)
            await queries.enqueue([ENTRYPOINT] * n, [None] * n, [0] * n)
        seconds = time.perf_counter() - started
        # The reference's prefill ends the same way: fresh statistics, nothing to flush.
        # (Without them, right after the bulk insert, pgqueuer's dequeue ran at 435 jobs/s
        # against 3,900 once analyzed, at 80k jobs.)
        await conn.execute("VACUUM ANALYZE" if vacuum else "ANALYZE")
        await conn.execute("CHECKPOINT")
        return seconds
    finally:
        await conn.close()


async def _work(dsn: str, batch: int, duration: float, ready: Any, go: Any) -> None:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.domain.types import QueueExecutionMode
    from pgqueuer.qm import QueueManager
    from pgqueuer.queries import Queries

    from skiplock.queue_impl.plugins import asyncpg_params

    # asyncpg, as pgqueuer's own quick start runs it: its psycopg driver's listener holds
    # the connection up to a second at a time waiting for notifications.
    conn = await asyncpg.connect(**asyncpg_params(dsn))
    try:
        manager = QueueManager(Queries(AsyncpgDriver(conn)))

        @manager.entrypoint(ENTRYPOINT)
        async def handle(_job: Any) -> None:
            return None

        ready.release()
        while not go.is_set():
            await asyncio.sleep(0.005)
        asyncio.get_running_loop().call_later(duration, manager.shutdown.set)
        # No statistics folding during the phase: it is work the reference does not do.
        await manager.run(batch_size=batch, mode=QueueExecutionMode.continuous,
                          dequeue_timeout=timedelta(seconds=1),
                          log_aggregation_interval=timedelta(0))
    finally:
        await conn.close()


def _worker(dsn: str, batch: int, duration: float, ready: Any, go: Any) -> None:
    asyncio.run(_work(dsn, batch, duration, ready, go))


class _DoneCounter:
    """Jobs gone from pgqueuer's table so far, for the progress line, from the statistics
    counters (flushed about once a second) on one connection: never a count(*) of the
    table being measured."""

    def __init__(self, dsn: str) -> None:
        self._conn = psycopg.connect(dsn, autocommit=True, connect_timeout=5)

    def __call__(self) -> int | None:
        try:
            row = self._conn.execute("SELECT n_tup_del FROM pg_stat_user_tables "
                                     "WHERE relname = 'pgqueuer'").fetchone()
        except psycopg.Error:
            return None
        return int(row[0]) if row else None

    def close(self) -> None:
        self._conn.close()


def _queued(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pgqueuer").fetchone()
    return int(row[0]) if row else 0


def pgqueuer_phase(dsn: str, *, workers: int, batch: int, duration: float,
                   prefill: int, say: Any, vacuum: bool = True) -> dict[str, Any]:
    """jobs, seconds, jobs_per_second, ran_dry and pgqueuer's version."""
    import multiprocess

    version = require_pgqueuer()
    with fresh_database(dsn, prefix="skiplock_pgqueuer") as own:
        say(f"prefill: {prefill} jobs for the pgqueuer phase (pgqueuer {version})")
        asyncio.run(_prefill(own, prefill, vacuum))
        ctx = multiprocess.get_context("fork")
        ready = ctx.Semaphore(0)
        go = ctx.Event()
        procs = [ctx.Process(target=_worker, args=(own, batch, duration, ready, go),
                             name=f"pgqueuer-{i}", daemon=True) for i in range(workers)]
        with processes_in_step(procs, ready, what="pgqueuer", join_seconds=duration + 60):
            say(f"pgqueuer: {workers} QueueManager processes, {duration:g} s")
            before = _queued(own)
            go.set()
            done = _DoneCounter(own)
            try:
                say_progress(procs, duration, done, say)
            finally:
                done.close()
        left = _queued(own)
    jobs = before - left
    return {"jobs": jobs, "seconds": duration, "jobs_per_second": jobs / duration,
            "ran_dry": left == 0, "version": version,
            "driver": "pgqueuer QueueManager (asyncpg), multiprocess fork"}


# --- end to end: pgqueuer's QueueManager posting each job to the same echo target ----------

E2E_HEADERS = ("kind", "time", "job_id")
# The workers run this much past the window, so that its last CPU reading still finds them
# and their server sessions (one round read 0.02 s of server CPU: the sessions had ended
# just before it). Only the writes inside the window are counted.
OUTLIVE_WINDOW_SECONDS = 1.0


async def _prefill_deliveries(dsn: str, count: int) -> None:
    """`count` jobs whose payload is what the reference's prefill gives each job."""
    import json

    from pgqueuer.db import PsycopgDriver
    from pgqueuer.queries import Queries

    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    try:
        queries = Queries(PsycopgDriver(conn))
        await queries.install()
        for first in range(0, count, ENQUEUE_CHUNK):
            numbers = range(first, min(count, first + ENQUEUE_CHUNK))
            await queries.enqueue([ENTRYPOINT] * len(numbers),
                                  [json.dumps({"n": n}).encode() for n in numbers],
                                  [0] * len(numbers))
        await conn.execute("VACUUM ANALYZE")
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()


async def _deliver(dsn: str, target_url: str, batch: int, duration: float, events_path: str,
                   ready: Any, go: Any) -> None:
    """pgqueuer as its users deploy it, doing the dispatcher's work: its own QueueManager
    (asyncpg), an entrypoint making one plain aiohttp POST per job, `batch` at a time. Each
    job's entry and return are logged as `claim` and `write` rows, the columns the
    dispatcher's window is judged on."""
    import csv

    import aiohttp
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.domain.types import QueueExecutionMode
    from pgqueuer.qm import QueueManager
    from pgqueuer.queries import Queries

    from skiplock.queue_impl.interface import ATTEMPT_HEADER, JOB_ID_HEADER
    from skiplock.queue_impl.plugins import asyncpg_params

    conn = await asyncpg.connect(**asyncpg_params(dsn))
    with open(events_path, "w", newline="") as log:
        rows = csv.writer(log)
        rows.writerow(E2E_HEADERS)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as session:
            manager = QueueManager(Queries(AsyncpgDriver(conn)))

            @manager.entrypoint(ENTRYPOINT)
            async def handle(job: Any) -> None:
                job_id = str(job.id)
                rows.writerow(("claim", time.time(), job_id))
                async with session.post(target_url, data=job.payload, headers={
                        JOB_ID_HEADER: job_id, ATTEMPT_HEADER: "1",
                        "Content-Type": "application/json"}) as answer:
                    await answer.read()
                    answer.raise_for_status()
                rows.writerow(("write", time.time(), job_id))

            ready.release()
            while not go.is_set():
                await asyncio.sleep(0.005)
            asyncio.get_running_loop().call_later(duration, manager.shutdown.set)
            try:
                per_dequeue, in_flight = _in_flight_per_process(batch)
                await manager.run(batch_size=per_dequeue, max_concurrent_tasks=in_flight,
                                  mode=QueueExecutionMode.continuous,
                                  dequeue_timeout=timedelta(seconds=1),
                                  log_aggregation_interval=timedelta(0))
            finally:
                await conn.close()


def _in_flight_per_process(batch: int) -> tuple[int, int]:
    """(batch_size, max_concurrent_tasks): `batch` jobs in flight in each process, as the
    dispatcher's slots. pgqueuer's cap of its own per worker (`max_concurrent_tasks`, at
    least twice its dequeue batch), not an entrypoint's `concurrency_limit`, which is one
    limit shared by every worker (20 in all for two processes, and a count of the whole
    table's picked rows on every dequeue: 81 jobs/s end to end at 20 ms of server CPU per
    job, measured so)."""
    per_dequeue = max(1, batch // 2)
    return per_dequeue, max(batch, 2 * per_dequeue)


def _deliver_worker(dsn: str, target_url: str, batch: int, duration: float, events_path: str,
                    ready: Any, go: Any) -> None:
    from skiplock.plumbing.orphans import name_this_process

    name_this_process("skiplock-worker")
    asyncio.run(_deliver(dsn, target_url, batch, duration, events_path, ready, go))


def pgqueuer_e2e_phase(dsn: str, params: Any, say: Any) -> Any:
    """`bench e2e`'s full path with pgqueuer as the queue and its own loop: W processes each
    run a QueueManager whose entrypoint posts the job to the same echo target (in its own
    process) with a plain aiohttp session, `batch` in flight; judged by the same window as
    the dispatcher's phase (jobs whose call returned in it, entry to return, CPU)."""
    import tempfile
    from pathlib import Path

    import multiprocess

    from skiplock.chaos.target import TargetProcess
    from skiplock.scenarios.bench.window import judge_window, timed_window

    version = require_pgqueuer()
    with tempfile.TemporaryDirectory(prefix="skiplock-bench-pgqueuer-") as tmp:
        events = Path(tmp) / "workers"
        events.mkdir()
        with fresh_database(dsn, prefix="skiplock_pgqueuer") as own, \
                TargetProcess(Path(tmp), name="target-0") as target:
            say(f"prefill: {params.prefill} jobs for the pgqueuer phase (pgqueuer {version})")
            asyncio.run(_prefill_deliveries(own, params.prefill))
            ctx = multiprocess.get_context("spawn")
            ready = ctx.Semaphore(0)
            go = ctx.Event()
            procs = [ctx.Process(target=_deliver_worker,
                                 args=(own, target.deliver_url, params.batch,
                                       params.duration + OUTLIVE_WINDOW_SECONDS,
                                       str(events / f"worker-{i}.csv"), ready, go),
                                 name=f"pgqueuer-{i}", daemon=True)
                     for i in range(params.workers)]
            with processes_in_step(procs, ready, what="pgqueuer",
                                   join_seconds=params.duration + 60):
                say(f"pgqueuer end to end: {params.workers} QueueManager processes, "
                    f"{params.batch} in flight each, {params.duration:g} s")
                go.set()
                window = timed_window([p.pid for p in procs], target, params.duration)
        result = judge_window(events, window, params)
    return {**dataclasses.asdict(result), "version": version,
            "driver": "pgqueuer QueueManager (asyncpg), entrypoint POSTing with aiohttp"}
