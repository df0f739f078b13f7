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
psycopg; skiplock supplies only the entrypoint, which hands
each job to `NativeDelivery` (the dispatcher's SSRF guard, timeout, headers, failpoints and
events), and a thin layer over pgqueuer's `Queries` that records each result write when its
statement returns. Everything lives in the run's schema (pgqueuer's tables, types and
trigger, found through `search_path`), so the run drops it with the schema.

How the reference's notions map onto pgqueuer's:
- account: an entrypoint per account, registered in every worker with the account's limit
  as its `concurrency_limit` (pgqueuer enforces it in its dequeue query, across workers);
- lease and recovery: the heartbeat (`heartbeat_timeout` = the scenario's lease): a job whose
  heartbeat stopped (its worker died) is picked again by any worker;
- attempt: pgqueuer's `attempts` + 1. pgqueuer counts a retry it was asked for, not a pick:
  a job picked again after its worker died keeps its number, so picks are told apart by
  their lease token (the job's row id, the picking manager and the pick's `updated` time);
- retry: a transient failure raises `RetryRequested` with the reference's backoff (jitter and
  cap included) while attempts remain; a permanent failure, or the last attempt, fails the
  job, held in pgqueuer's table (`on_failure="hold"`) as the dead letter;
- ids: pgqueuer numbers its jobs; `skiplock_jobs` maps each to the harness's UUID, written in
  the same transaction as the enqueue.

What pgqueuer promises (`GUARANTEES`): per-account limits (as entrypoint limits); no fencing
(its completion deletes the row by id, whoever holds it now); `attempts` counts retries
only; the retry wait is the caller's (capped here); no claim transaction to stall; its
heartbeat re-pick always runs (recovery cannot be switched off).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import re
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import psycopg
from pgqueuer.db import AsyncpgDriver, PsycopgDriver, SyncPsycopgDriver
from pgqueuer.errors import RetryRequested
from pgqueuer.qm import QueueManager
from pgqueuer.queries import Queries, SyncQueries
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.events import EventSink
from skiplock.queue_impl.interface import (
    Account,
    Guarantees,
    JobState,
    JobStatus,
    Lease,
    NewJob,
    Outcome,
)
from skiplock.queue_impl.native import DispatcherCallsRefused, NativeDelivery, lease_token_of

GUARANTEES = Guarantees(account_limits=True, fencing=False, attempts_count="finished",
                        retry_cap=True, claim_transaction=False, recovery_switch=False)

_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
# pgqueuer's statuses in its queue table, and the final one its log records.
_LIVE = {"queued": JobStatus.PENDING, "picked": JobStatus.PROCESSING,
         "failed": JobStatus.FAILED}
_LOGGED = {"successful": JobStatus.COMPLETED, "exception": JobStatus.FAILED,
           "failed": JobStatus.FAILED, "canceled": JobStatus.FAILED,
           "deleted": JobStatus.FAILED}

_OWN_TABLES = """
CREATE TABLE IF NOT EXISTS skiplock_jobs (
    pgq_id bigint PRIMARY KEY, job_id uuid NOT NULL, account text NOT NULL,
    max_attempts int NOT NULL);
CREATE TABLE IF NOT EXISTS skiplock_accounts (id text PRIMARY KEY, concurrency_limit int);
"""


def factory(*, dsn: str | None, schema: str, sql_path: str | None = None) -> PgqueuerQueue:
    """`--backend skiplock.queue_impl.pgqueuer_backend:factory`."""
    if sql_path is not None:
        raise ValueError("pgqueuer runs its own SQL; --sql does not apply to it")
    if not dsn:
        raise ValueError("pgqueuer needs a PostgreSQL DSN")
    if not _SCHEMA_NAME.match(schema):
        raise ValueError(f"schema {schema!r}: use lower-case letters, digits and '_'")
    return PgqueuerQueue(dsn, schema)


class PermanentFailure(Exception):
    """A call not worth retrying: pgqueuer fails the job (held as the dead letter)."""


class PgqueuerQueue(DispatcherCallsRefused):
    name = "pgqueuer"
    guarantees = GUARANTEES

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn = dsn
        self.schema = schema
        self._conn: psycopg.Connection[Any] | None = None

    def _connect_kwargs(self) -> dict[str, Any]:
        # Every pgqueuer object is created and found through search_path: the run's schema.
        return {"autocommit": True, "options": f"-c search_path={self.schema}"}

    def _sync(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.dsn, **self._connect_kwargs())
        return self._conn

    # -- lifecycle ------------------------------------------------------------------------

    def setup(self) -> None:
        conn = self._sync()
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
            sql.Identifier(self.schema)))
        asyncio.run(self._install())
        conn.execute(_OWN_TABLES)

    async def _install(self) -> None:
        conn = await psycopg.AsyncConnection.connect(self.dsn, **self._connect_kwargs())
        try:
            queries = Queries(PsycopgDriver(conn))
            if not await queries.schema_is_installed():
                await queries.install(create_schema=False)
        finally:
            await conn.close()

    def upsert_accounts(self, accounts: Sequence[Account]) -> None:
        with self._sync().transaction():
            self._sync().cursor().executemany(
                "INSERT INTO skiplock_accounts (id, concurrency_limit) VALUES (%s, %s) "
                "ON CONFLICT (id) DO UPDATE SET concurrency_limit = EXCLUDED.concurrency_limit",
                [(a.id, a.concurrency_limit) for a in accounts])

    def enqueue(self, jobs: Sequence[NewJob]) -> None:
        conn = self._sync()
        payloads: list[bytes | None] = [json.dumps({"job_id": str(j.id), "target_url": j.target_url,
                                "payload": dict(j.payload), "max_attempts": j.max_attempts}
                               ).encode() for j in jobs]
        delays = [None if j.run_at is None else max(j.run_at - datetime.now(UTC), timedelta(0))
                  for j in jobs]
        with conn.transaction():
            ids = SyncQueries(SyncPsycopgDriver(conn)).enqueue(
                [j.account_id for j in jobs], payloads, [0] * len(jobs), delays)
            conn.cursor().executemany(
                "INSERT INTO skiplock_jobs (pgq_id, job_id, account, max_attempts) "
                "VALUES (%s, %s, %s, %s)",
                [(pgq_id, j.id, j.account_id, j.max_attempts)
                 for pgq_id, j in zip(ids, jobs, strict=True)])

    def snapshot(self) -> list[JobState]:
        rows = self._sync().execute("""
            SELECT m.job_id, m.account, m.max_attempts, q.status::text, q.attempts,
                   (SELECT l.status::text FROM pgqueuer_log l WHERE l.job_id = m.pgq_id
                     AND l.status NOT IN ('queued', 'picked')
                     ORDER BY l.id DESC LIMIT 1)
            FROM skiplock_jobs m LEFT JOIN pgqueuer q ON q.id = m.pgq_id""").fetchall()
        states = []
        for job_id, account, max_attempts, live, attempts, logged in rows:
            if live is not None:
                status = _LIVE.get(live, JobStatus.PENDING)
                if status is JobStatus.PENDING and attempts:
                    status = JobStatus.RETRYING
            else:
                # No row and no final log entry: nothing says it finished (the delete and
                # its log entry are one statement), so it is not called finished.
                status = _LOGGED.get(logged or "", JobStatus.PENDING)
            states.append(JobState(
                job_id=job_id, account_id=account, status=status,
                attempts=int(attempts or 0), max_attempts=max_attempts,
                extra={"pgqueuer_status": live or logged}))
        return states

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    # -- the worker loop ------------------------------------------------------------------

    async def run_worker(self, config: DispatcherConfig, worker_id: str, sink: EventSink,
                         stop: asyncio.Event) -> None:
        policy = dataclasses.replace(config.retry_policy(), rng=random.Random(
            f"retry:{config.seed}:{worker_id}" if config.seed is not None else None))
        # asyncpg does not read PGAPPNAME: the worker's name is passed on, so that a fault
        # that cuts the system under test's sessions finds them.
        conn = await asyncpg.connect(**asyncpg_params(self.dsn), server_settings={
            "search_path": self.schema,
            "application_name": os.environ.get("PGAPPNAME", "")})
        reason = "stopped"
        try:
            accounts = await conn.fetch("SELECT id, concurrency_limit FROM skiplock_accounts")
            async with NativeDelivery(config, worker_id, sink) as delivery:
                queries = _RecordingQueries(
                    AsyncpgDriver(conn), delivery=delivery,
                    lease=lambda job, manager_id: _lease(job, manager_id, config, worker_id))
                manager = QueueManager(queries)
                # A stale job this manager still runs can come back from its own dequeue;
                # pgqueuer drops it (it is in job_context), so it is no new claim.
                queries.running = lambda job: job.id in manager.job_context

                async def handle(job: Any) -> None:
                    lease = _lease(job, manager.queue_manager_id, config, worker_id)
                    call = await delivery.run(id(job), lease)
                    if call.outcome is Outcome.SUCCESS:
                        return
                    if call.outcome is Outcome.TRANSIENT and lease.attempt < lease.max_attempts:
                        raise RetryRequested(delay=policy.delay(lease.attempt),
                                             reason=call.error or "transient failure")
                    raise PermanentFailure(call.error or "failed")

                for account, limit in accounts:
                    manager.entrypoint(account, concurrency_limit=limit or 0,
                                       on_failure="hold")(handle)
                stopper = asyncio.ensure_future(_stop_when(stop, manager))
                sink("start", {"pid": os.getpid()})
                try:
                    await manager.run(
                        batch_size=config.batch,
                        dequeue_timeout=timedelta(seconds=config.poll_seconds),
                        heartbeat_timeout=timedelta(seconds=config.lease_seconds),
                        log_aggregation_interval=timedelta(0))
                finally:
                    stopper.cancel()
        except BaseException as exc:
            reason = f"error: {type(exc).__name__}: {' '.join(str(exc).split())}"
            raise
        finally:
            sink("stop", {"reason": reason})
            await conn.close()


def asyncpg_params(dsn: str) -> dict[str, Any]:
    """libpq's reading of the DSN (a URI or key=value pairs) as asyncpg's keywords."""
    params = conninfo_to_dict(dsn)
    names = {"host": "host", "port": "port", "user": "user", "password": "password",
             "dbname": "database"}
    found: dict[str, Any] = {names[k]: v for k, v in params.items() if k in names and v}
    if "port" in found:
        found["port"] = int(found["port"])
    return found


async def _stop_when(stop: asyncio.Event, manager: Any) -> None:
    await stop.wait()
    manager.shutdown.set()


def _lease(job: Any, manager_id: Any, config: DispatcherConfig, worker_id: str) -> Lease:
    """One pick of a pgqueuer job as a lease. The pick is named by the row, the manager that
    picked it and when (`updated`, set by the dequeue), since its attempt number is not."""
    data = json.loads(job.payload)
    return Lease(
        job_id=uuid.UUID(data["job_id"]), account_id=str(job.entrypoint),
        target_url=data["target_url"], payload=data.get("payload") or {},
        attempt=int(job.attempts) + 1, max_attempts=int(data["max_attempts"]),
        lease_token=lease_token_of(f"{job.id}:{manager_id}:{job.updated.isoformat()}"),
        locked_until=job.updated + timedelta(seconds=config.lease_seconds),
        worker_id=worker_id)


class _RecordingQueries(Queries):
    """pgqueuer's own queries, recording what the history needs when it happens: each pick
    when the dequeue returns it (a job may wait in the manager long after that), each
    heartbeat as a renewal of the pick it keeps alive once its statement returned, and each
    result write once its statement returned (applied) or raised (info: it may or may not
    have committed). pgqueuer buffers completions, so a write comes some time after its
    call."""

    def __init__(self, driver: AsyncpgDriver, *, delivery: NativeDelivery,
                 lease: Callable[[Any, Any], Lease]) -> None:
        super().__init__(driver)
        self._delivery = delivery
        self._lease = lease
        self.running: Callable[[Any], bool] = lambda _job: False
        # pgqueuer's job id -> this manager's current pick of it (the Job object's id and the
        # lease), from its dequeue until its result write.
        self._picks: dict[int, tuple[int, Lease]] = {}

    async def dequeue(self, batch_size: int, entrypoints: Any, queue_manager_id: Any,
                      global_concurrency_limit: int | None,
                      heartbeat_timeout: timedelta) -> list[Any]:
        jobs = await super().dequeue(batch_size, entrypoints, queue_manager_id,
                                     global_concurrency_limit, heartbeat_timeout)
        for job in jobs:
            if not self.running(job):
                lease = self._lease(job, queue_manager_id)
                self._picks[int(job.id)] = (id(job), lease)
                self._delivery.claimed(lease)
        return jobs

    async def update_heartbeat(self, job_ids: list[Any]) -> None:
        # The statement sets the heartbeat of every listed row, whoever picked it since; what
        # is recorded is that this manager kept its own pick alive.
        await super().update_heartbeat(job_ids)
        for job_id in set(job_ids):
            pick = self._picks.get(int(job_id))
            if pick is not None:
                self._delivery.renewed(pick[1])

    async def log_jobs(self, job_status: Any) -> None:
        await self._written([job for job, _, _ in job_status], super().log_jobs(job_status))

    async def retry_job(self, job: Any, delay: Any, traceback_record: Any) -> None:
        await self._written([job], super().retry_job(job, delay, traceback_record))

    async def _written(self, jobs: list[Any], statement: Awaitable[None]) -> None:
        for job in jobs:
            pick = self._picks.get(int(job.id))
            if pick is not None and pick[0] == id(job):  # this pick, not a later one
                del self._picks[int(job.id)]
        try:
            await statement
        except BaseException as exc:
            text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            for job in jobs:
                self._delivery.written(id(job), "info", text)
            raise
        for job in jobs:
            self._delivery.written(id(job))
