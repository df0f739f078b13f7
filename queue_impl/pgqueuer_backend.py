"""pgqueuer, a PostgreSQL queue from PyPI, as a plug-in with its own worker loop: the worked
example of a third-party queue under test as its users deploy it.

    pip install 'skiplock[pgqueuer]'
    skiplock run steady --backend skiplock.queue_impl.pgqueuer_backend:factory

Importing this module needs pgqueuer (an optional extra): without it, naming the backend is
refused with one line.

Each worker process runs pgqueuer's own `QueueManager` (its dequeue query, heartbeats,
buffered completions, database retries) on asyncpg, as pgqueuer's quick start does (its
psycopg driver waits up to a second for notifications holding the connection, which every
completion and retry then queues behind); producers enqueue through its `SyncQueries` on
psycopg. skiplock supplies the entrypoint, which hands each job to `NativeDelivery`, and a
thin layer over pgqueuer's `Queries` that hands it each pick, heartbeat and result write as
its statement runs. Everything lives in the run's schema (pgqueuer's tables, types and
trigger, found through `search_path`), so the run drops it with the schema.

How the reference's notions map onto pgqueuer's:
- account: an entrypoint per account of the worker's config, with the account's limit as
  its `concurrency_limit` (pgqueuer enforces it in its dequeue query, across workers);
- lease and recovery: the heartbeat (`heartbeat_timeout` = the scenario's lease), declared
  as a heartbeat lease: a job whose heartbeat stopped (its worker died) is picked again;
- attempt: pgqueuer's `attempts` + 1. pgqueuer counts a retry it was asked for, not a pick:
  a job picked again after its worker died keeps its number, so picks are told apart by
  their lease token (the job's row id, the picking manager and the pick's `updated` time);
- retry: a transient failure raises `RetryRequested` with the run's backoff while attempts
  remain; otherwise the job fails, held in pgqueuer's table (`on_failure="hold"`);
- ids: pgqueuer numbers its jobs; `skiplock_jobs` maps each to the harness's job, written in
  the same transaction as the enqueue (pgqueuer's log keeps no payload).

A manager that fails once it has started (its connection cut by the database, a server
restarting) is started again on a new connection after `RESTART_DELAY_SECONDS`, as `pgq run
--restart-on-failure` does; each failure is recorded as an `error` event (op `pgqueuer`),
and the picks the failed manager still held are dropped: it will neither write nor renew
them, so each runs out at its last heartbeat and is picked again. A manager that cannot
start at all stops its worker with the error, as before.

What pgqueuer promises (`GUARANTEES`): per-account limits (as entrypoint limits); no fencing
(its completion deletes the row by id, whoever holds it now); `attempts` counts retries
only; the retry wait is the caller's (capped here); no claim transaction to stall; its
heartbeat re-pick always runs (recovery cannot be switched off).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import asyncpg
from pgqueuer.adapters.persistence.qb import QueryBuilderEnvironment
from pgqueuer.db import AsyncpgDriver, SyncPsycopgDriver
from pgqueuer.errors import RetryRequested
from pgqueuer.qm import QueueManager
from pgqueuer.queries import Queries, SyncQueries
from psycopg import sql

from skiplock.queue_impl import native
from skiplock.queue_impl.interface import Guarantees, JobState, JobStatus, NewJob, Outcome
from skiplock.queue_impl.plugins import SchemaConnection, asyncpg_params

# pgqueuer's `pgq run --restart-on-failure` waits `--restart-delay` (5 s by default) before it
# starts a failed manager again; a shorter wait keeps a run's workers busy through a fault.
RESTART_DELAY_SECONDS = 1.0

GUARANTEES = Guarantees(account_limits=True, fencing=False, attempts_count="finished",
                        retry_cap=True, claim_transaction=False, recovery_switch=False)
# pgqueuer's statuses in its queue table (queued, picked, failed) and the final one its log
# records (the others).
_STATUS = {"queued": JobStatus.PENDING, "picked": JobStatus.PROCESSING, "failed": JobStatus.FAILED,
           "successful": JobStatus.COMPLETED, **dict.fromkeys(
               ("exception", "canceled", "deleted"), JobStatus.FAILED)}


def factory(*, dsn: str | None, schema: str, sql_path: str | None = None) -> PgqueuerQueue:
    """`--backend skiplock.queue_impl.pgqueuer_backend:factory`."""
    if sql_path is not None:
        raise ValueError("pgqueuer runs its own SQL; --sql does not apply to it")
    return PgqueuerQueue(dsn or "", schema)


class PgqueuerQueue(SchemaConnection, native.DispatcherCallsRefused):
    name = "pgqueuer"
    guarantees = GUARANTEES
    heartbeat_lease = True

    def setup(self) -> None:
        conn = self.connection()
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.schema)))
        if conn.execute("SELECT to_regclass('pgqueuer')").fetchone() == (None,):
            conn.execute(QueryBuilderEnvironment().build_install_query(create_schema=False))
        conn.execute("CREATE TABLE IF NOT EXISTS skiplock_jobs (pgq_id bigint PRIMARY KEY, "
                     "job_id uuid NOT NULL, account text NOT NULL, max_attempts int NOT NULL)")

    def enqueue(self, jobs: Sequence[NewJob]) -> None:
        conn = self.connection()
        with conn.transaction():
            ids = SyncQueries(SyncPsycopgDriver(conn)).enqueue(
                [j.account_id for j in jobs], [native.encode_job(j) for j in jobs],
                [0] * len(jobs), [native.delay_of(j) for j in jobs])
            conn.cursor().executemany("INSERT INTO skiplock_jobs VALUES (%s, %s, %s, %s)", [
                (i, j.id, j.account_id, j.max_attempts) for i, j in zip(ids, jobs, strict=True)])

    def snapshot(self) -> list[JobState]:
        rows = self.connection().execute("""
            SELECT m.job_id, m.account, m.max_attempts, q.status::text, q.attempts,
                   (SELECT l.status::text FROM pgqueuer_log l WHERE l.job_id = m.pgq_id
                     AND l.status NOT IN ('queued', 'picked') ORDER BY l.id DESC LIMIT 1)
            FROM skiplock_jobs m LEFT JOIN pgqueuer q ON q.id = m.pgq_id""").fetchall()
        states = []
        for job_id, account, max_attempts, live, attempts, logged in rows:
            # No row and no final log entry: nothing says it finished (the delete and its log
            # entry are one statement), so it is not called finished.
            status = _STATUS.get(live or logged or "", JobStatus.PENDING)
            if live is not None and status is JobStatus.PENDING and attempts:
                status = JobStatus.RETRYING
            states.append(JobState(job_id=job_id, account_id=account, status=status,
                                   attempts=int(attempts or 0), max_attempts=max_attempts,
                                   extra={"pgqueuer_status": live or logged}))
        return states

    async def run_worker(self, config: native.NativeConfig, worker_id: str, sink: Any,
                         stop: asyncio.Event) -> None:
        async with native.NativeDelivery(config, worker_id, sink) as delivery:
            connected = False
            while not stop.is_set():
                try:
                    conn = await self._connect()
                except Exception as exc:
                    if not connected:
                        raise  # never started: the worker stops with the error
                    delivery.error("pgqueuer", native.one_line(exc))
                else:
                    connected = True
                    try:
                        await self._run_manager(conn, config, delivery, stop)
                        return
                    except Exception as exc:
                        # As `pgq run --restart-on-failure`: logged, and started again.
                        delivery.error("pgqueuer", native.one_line(exc))
                        delivery.forget_picks()
                    finally:
                        with contextlib.suppress(Exception):  # a cut one cannot close cleanly
                            await conn.close()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), RESTART_DELAY_SECONDS)

    async def _connect(self) -> Any:
        # asyncpg does not read PGAPPNAME: the worker's name is passed on, so that a fault
        # that cuts the system under test's sessions finds them.
        return await asyncpg.connect(**asyncpg_params(self.dsn), server_settings={
            "search_path": self.schema, "application_name": os.environ.get("PGAPPNAME", "")})

    async def _run_manager(self, conn: Any, config: native.NativeConfig,
                           delivery: native.NativeDelivery, stop: asyncio.Event) -> None:
        """One `QueueManager` on `conn`, until `stop` or its failure."""
        queries = _RecordingQueries(AsyncpgDriver(conn), delivery)
        manager = queries.manager = QueueManager(queries)
        manager.shutdown = stop  # SIGTERM stops it as pgqueuer's own shutdown does

        async def handle(job: Any) -> None:
            call = await delivery.run((job.id, id(job)))
            delay = delivery.retry_delay((job.id, id(job)))
            if delay is not None:
                raise RetryRequested(delay=delay, reason=call.error or "transient")
            if call.outcome is not Outcome.SUCCESS:
                raise native.CallFailed(call.error or "failed")

        for account in config.accounts:
            manager.entrypoint(account.id, concurrency_limit=account.concurrency_limit
                               or 0, on_failure="hold")(handle)
        await manager.run(batch_size=config.batch,
                          dequeue_timeout=timedelta(seconds=config.poll_seconds),
                          heartbeat_timeout=timedelta(seconds=config.lease_seconds),
                          log_aggregation_interval=timedelta(0))


class _RecordingQueries(Queries):
    """pgqueuer's own queries, handing `NativeDelivery` each pick when the dequeue returns it
    (a job may wait in the manager long after), each heartbeat, and each result write (which
    pgqueuer buffers, so it comes some time after its call). A pick is keyed by pgqueuer's
    job id and the Job object, the one pgqueuer hands back at the write."""

    def __init__(self, driver: AsyncpgDriver, delivery: native.NativeDelivery) -> None:
        super().__init__(driver)
        self.delivery = delivery
        self.manager: Any = None

    async def dequeue(self, batch_size: int, entrypoints: Any, queue_manager_id: Any,
                      global_concurrency_limit: int | None,
                      heartbeat_timeout: timedelta) -> list[Any]:
        sent = time.time()
        jobs = await super().dequeue(batch_size, entrypoints, queue_manager_id,
                                     global_concurrency_limit, heartbeat_timeout)
        # A stale job this manager still runs can come back from its own dequeue; pgqueuer
        # drops it (it is in job_context), so it is no new claim.
        for job in (j for j in jobs if j.id not in self.manager.job_context):
            self.delivery.claimed((job.id, id(job)), self.delivery.lease(
                bytes(job.payload or b""), pick=f"{job.id}:{queue_manager_id}:{job.updated}",
                attempt=job.attempts + 1, held_from=job.updated), sent)
        return jobs

    async def update_heartbeat(self, job_ids: list[Any]) -> None:
        await self.delivery.heartbeat(super().update_heartbeat(job_ids),
                                      lambda key: key[0] in job_ids)  # type: ignore[index]

    async def log_jobs(self, job_status: Any) -> None:
        await self.delivery.write([(job.id, id(job)) for job, _, _ in job_status],
                                  super().log_jobs(job_status))

    async def retry_job(self, job: Any, delay: Any, traceback_record: Any) -> None:
        await self.delivery.write([(job.id, id(job))],
                                  super().retry_job(job, delay, traceback_record))
