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
import time
from datetime import timedelta
from typing import Any

import psycopg

from skiplock.scenarios.bench_queue import processes_in_step, require_package, say_progress
from skiplock.scenarios.provision import fresh_database

ENTRYPOINT = "skiplock_bench"
ENQUEUE_CHUNK = 5_000


def require_pgqueuer() -> str:
    """pgqueuer's version; UsageError when it is not installed."""
    return require_package("pgqueuer", "--against pgqueuer",
                           "pip install 'skiplock[pgqueuer]'")


async def _prefill(dsn: str, count: int) -> float:
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
        await conn.execute("VACUUM ANALYZE")
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

    from skiplock.queue_impl.pgqueuer_backend import asyncpg_params

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
                   prefill: int, say: Any) -> dict[str, Any]:
    """jobs, seconds, jobs_per_second, ran_dry and pgqueuer's version."""
    import multiprocess

    version = require_pgqueuer()
    with fresh_database(dsn, prefix="skiplock_pgqueuer") as own:
        say(f"prefill: {prefill} jobs for the pgqueuer phase (pgqueuer {version})")
        asyncio.run(_prefill(own, prefill))
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
