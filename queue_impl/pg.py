"""The reference PostgreSQL queue, and the seeds' anti-patterns as variants of it.

Every statement is a named block (`queue_impl/sql/reference.sql`, replaceable by name with
`sql=FILE`). Connections are opened lazily, one per role, in the process that uses the queue;
a queue object that crosses a fork forgets its parent's connections instead of sharing them.
A connection lost mid-call is dropped and reopened on the next call; the error itself
propagates unchanged (an error during COMMIT means "unknown", and the caller records it so).

Variants:
- `pg`: claim with `FOR UPDATE SKIP LOCKED` in a short transaction (the reference).
- `pg-for-update`: the same claim without SKIP LOCKED: correct, but claimers queue.
- `pg-naive`: select due ids with no row lock, then update them in a separate statement with
  no status re-check: two workers really can take the same job.
- `pg-long-tx`: the reference claim, but its transaction stays open until `finish` commits
  it, i.e. across the HTTP call; a crash rolls the claim back.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext, suppress
from datetime import datetime, timedelta
from enum import Enum
from pathlib import Path
from typing import Any, assert_never, cast, get_args

import psycopg
from psycopg import pq, sql
from psycopg.adapt import Transformer
from psycopg.pq import TransactionStatus
from psycopg.rows import DictRow, dict_row
from psycopg.types.json import Jsonb

from skiplock.queue_impl.interface import (
    REFERENCE_GUARANTEES,
    Account,
    AttemptResult,
    BackendName,
    Guarantees,
    JobState,
    JobStatus,
    Lease,
    NewJob,
    Outcome,
    StatementError,
    WriteResult,
)
from skiplock.queue_impl.sqlfile import (
    REFERENCE_PATH,
    as_sent,
    positional,
    statements_and_sources,
)
from skiplock.queue_impl.validate import check_jobs

Variant = BackendName
VARIANTS: tuple[Variant, ...] = get_args(BackendName)

Conn = psycopg.Connection[DictRow]

_SNAPSHOT_COLUMNS = frozenset(
    {
        "id",
        "account_id",
        "status",
        "attempts",
        "max_attempts",
        "last_error",
        "locked_until",
        "next_attempt_at",
    }
)


# See `PgQueue.enqueue`: at most one NOTIFY per this interval from one queue object.
NOTIFY_INTERVAL_SECONDS = 0.02


class Role(Enum):
    """One connection per role, so a transaction held by one (the long-tx variant's claim)
    never swallows another's statements."""

    LEASE = "lease"  # claim, receive, finish, renew, release (autocommit: see `_one`)
    RECOVER = "recover"
    ENQUEUE = "enqueue"
    ADMIN = "admin"  # setup, accounts, snapshot
    LISTEN = "listen"  # LISTEN, autocommit


class PgQueue:
    """A `QueueBackend` on PostgreSQL."""

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = "skiplock",
        sql: str | Path | None = None,
        variant: Variant = "pg",
    ) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; use one of {', '.join(VARIANTS)}")
        if not schema:
            raise ValueError("the schema name must not be empty")
        self.name: str = variant
        self.variant: Variant = variant
        self.schema = schema
        self._dsn = dsn
        self._statements, self._sources = statements_and_sources(sql)
        if self._sources["schema"] == REFERENCE_PATH:
            # The reference's own blocks on its own tables are sent lean, their values in
            # binary (`as_sent`); a block from a team's file, or one run on a team's schema,
            # is sent as written.
            self._statements.update(
                (block, as_sent(text)) for block, text in self._statements.items()
                if block != "schema" and self._sources[block] == REFERENCE_PATH)
        self._conns: dict[Role, Conn] = {}
        self._locks: dict[Role, threading.Lock] = {role: threading.Lock() for role in Role}
        self._pid = os.getpid()
        self._pinned: datetime | None = None
        # Only the long-tx variant leaves the lease connection inside a transaction.
        self._open_claim = False
        # Called between a claim's statements and its COMMIT when it took rows (fault
        # injection: a worker frozen inside its claim transaction). None: nothing.
        self.claim_commit_hook: Callable[[], None] | None = None
        # Called once a claim that took rows has committed, before its leases are returned
        # (fault injection: the connection lost between the COMMIT and the worker's read of
        # it; the hook raises as the lost connection would). None: nothing.
        self.claim_result_hook: Callable[[], None] | None = None
        self._last_notify = -math.inf

    def __repr__(self) -> str:
        return f"PgQueue(variant={self.variant!r}, schema={self.schema!r})"

    @property
    def receipts(self) -> bool:
        """Whether the worker's receipts count attempts (`receive`, `recover_unreceived`):
        not under pg-long-tx, whose claim commits only with its result (a claim whose
        connection dies is rolled back, never a ghost); nor for a SQL file that replaces
        `schema` but defines no `receive` (written before receipts: its tables have no
        `received_token`), which keeps counting every committed claim."""
        if self.variant == "pg-long-tx":
            return False
        return (self._sources["schema"] == REFERENCE_PATH
                or self._sources["receive"] != REFERENCE_PATH)

    @property
    def guarantees(self) -> Guarantees:
        """The reference's promises; with receipts, `max_attempts` counts received claims."""
        if self.receipts:
            return dataclasses.replace(REFERENCE_GUARANTEES, attempts_count="received")
        return REFERENCE_GUARANTEES

    @property
    def holds_claims(self) -> bool:
        """Whether a claim stays uncommitted until its results are written (pg-long-tx): the
        dispatcher then claims a batch only once the previous one is written, since a claim
        sent meanwhile would join the open transaction and be committed with those results."""
        return self.variant == "pg-long-tx"

    # -- connections ---------------------------------------------------------------------

    @property
    def channel(self) -> str:
        """The NOTIFY channel: one per schema, so queues side by side do not wake each other."""
        return f"skiplock_{self.schema}"

    def _connect(self, role: Role) -> Conn:
        conn: Conn = psycopg.connect(
            self._dsn,
            # The lease role's statements are mostly one a transaction (a receipt, a result
            # write): alone on an autocommit session, each is one round trip with no BEGIN,
            # COMMIT or pipeline to drive (`_one`); a claim opens its transaction (`_begin`).
            autocommit=role in (Role.LISTEN, Role.LEASE),
            row_factory=dict_row,
            application_name=f"{_application_name(self.variant)}-{role.value}",
        )
        try:
            # The claim's limit proof needs READ COMMITTED (its second statement must see what
            # committed while the first waited for the account locks); a DSN or server default
            # of REPEATABLE READ would also turn every lock wait into a serialization failure.
            conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
            if conn.autocommit:
                # psycopg names the level only in a BEGIN it sends itself: an autocommit
                # session's statements, and the BEGIN of `_begin`, take the session's.
                conn.execute("SET default_transaction_isolation TO 'read committed'")
            conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))
            apply_plan_settings(conn)
            if self._pinned is not None:
                conn.execute(
                    "SELECT set_config('skiplock.now', %s, false)", [self._pinned.isoformat()]
                )
            if role is Role.LISTEN:
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
            else:
                conn.commit()
        except BaseException:
            conn.close()
            raise
        return conn

    def _conn(self, role: Role) -> Conn:
        if os.getpid() != self._pid:
            # Inherited across fork: the sockets belong to the parent. Forget them without
            # closing (closing would end the parent's sessions too).
            self._conns.clear()
            self._open_claim = False
            self._pid = os.getpid()
        conn = self._conns.get(role)
        if conn is not None and (conn.closed or conn.broken):
            del self._conns[role]
            conn = None
            if role is Role.LEASE:
                self._open_claim = False
        if conn is None:
            conn = self._connect(role)
            self._conns[role] = conn
        return conn

    def _drop(self, role: Role) -> None:
        conn = self._conns.pop(role, None)
        if role is Role.LEASE:
            self._open_claim = False
        if conn is not None:
            with suppress(psycopg.Error):
                conn.close()

    def _rollback(self, role: Role, conn: Conn) -> None:
        if role is Role.LEASE:
            self._open_claim = False
        if conn.broken or conn.closed:
            self._drop(role)
            return
        try:
            conn.rollback()
        except psycopg.Error:
            self._drop(role)

    @contextmanager
    def _tx(self, role: Role, *, commit: bool = True, pipeline: bool = False) -> Iterator[Conn]:
        """A transaction on the role's connection; with commit=False it is left open. With
        pipeline=True it runs in pipeline mode: BEGIN goes with the first statement and
        COMMIT with the last, so a one-statement transaction is one round trip instead of
        three. Results are read when asked for (fetch after the block: a cursor in a pipeline
        has no description until its results are in)."""
        with self._locks[role]:
            conn = self._conn(role)
            try:
                with conn.pipeline() if pipeline else nullcontext():
                    _begin(conn)
                    yield conn
                    if commit:
                        # On failure the outcome is unknown; the caller sees the error as-is.
                        conn.commit()
            except BaseException:
                self._rollback(role, conn)
                raise
            if commit and role is Role.LEASE:
                self._open_claim = False

    def _one(self, block: str, params: Mapping[str, Any], *, commit: bool = True
             ) -> list[DictRow]:
        """One lease statement as its own transaction: on the autocommit session, one round
        trip. Inside the long-tx variant's open claim it joins that transaction, and commits
        it unless `commit` is False. On failure the outcome is unknown; the caller sees the
        error as-is."""
        with self._locks[Role.LEASE]:
            conn = self._conn(Role.LEASE)
            try:
                rows = self._run(conn, block, params)
                if commit and conn.info.transaction_status != TransactionStatus.IDLE:
                    conn.commit()
            except BaseException:
                self._rollback(Role.LEASE, conn)
                raise
            if commit:
                self._open_claim = False
        return rows

    def _run(self, conn: Conn, block: str, params: Mapping[str, Any]) -> list[DictRow]:
        cur = conn.execute(self._statements[block], params)
        return cur.fetchall() if cur.description is not None else []

    def pin_clock(self, when: datetime | None) -> None:
        """Pin the SQL clock (`skiplock_now()`) on this queue's connections; None unpins.
        For tests: time becomes a rule, never a sleep."""
        if when is not None and when.tzinfo is None:
            raise ValueError("pin_clock needs a timezone-aware datetime")
        self._pinned = when
        value = "" if when is None else when.isoformat()
        for role in list(self._conns):
            if role is Role.LISTEN:
                continue  # reads no clock, and may be blocked waiting for a notification
            with self._locks[role]:
                conn = self._conns.get(role)
                if conn is None or conn.closed:
                    continue
                # A session-level setting; committed at once so a rollback cannot undo it
                # (except inside the long-tx variant's open claim, which finish() commits).
                conn.execute("SELECT set_config('skiplock.now', %s, false)", [value])
                if not (role is Role.LEASE and self._open_claim):
                    conn.commit()

    def close(self) -> None:
        for role in list(self._conns):
            with self._locks[role]:
                self._drop(role)

    # -- QueueBackend ------------------------------------------------------------------

    def setup(self) -> None:
        """Raises `StatementError` when the database refuses the `setup_lock` or `schema`
        block itself (bad SQL, not a lost connection), naming the block and its file."""
        with self._tx(Role.ADMIN) as conn:
            with self._naming("setup_lock"):
                self._run(conn, "setup_lock", {"lock_key": f"skiplock-schema:{self.schema}"})
            conn.execute(
                sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.schema))
            )
            with self._naming("schema"):
                # A script with no parameters: psycopg sends it as one simple query (never
                # prepared: a prepared statement holds one command).
                conn.execute(self._statements["schema"], prepare=False)

    @contextmanager
    def _naming(self, block: str) -> Iterator[None]:
        """Turn the database refusing `block` into a `StatementError` naming it; a lost
        connection, a cancel or a lock timeout (OperationalError), and a missing privilege
        (the DSN's role, not the SQL), propagate unchanged."""
        try:
            yield
        except psycopg.Error as exc:
            if (isinstance(exc, psycopg.OperationalError | psycopg.errors.InsufficientPrivilege)
                    or exc.sqlstate is None):
                raise
            primary = exc.diag.message_primary or str(exc)
            raise self._statement_error(block, primary.splitlines()[0]) from exc

    def _statement_error(self, block: str, error: str) -> StatementError:
        source = self._sources[block]
        if source != REFERENCE_PATH:
            return StatementError(source=str(source), block=block, error=error)
        schema_source = self._sources["schema"]
        if block == "schema" or schema_source == REFERENCE_PATH:
            return StatementError(
                source=str(source), block=block, error=error, ours=True,
                note="the reference SQL's own block: a skiplock bug, please report it",
            )
        return StatementError(
            source=str(source), block=block, error=error,
            note=f"a reference block, run against the schema block of {schema_source}",
        )

    def check_statements(self) -> None:
        """Have the server prepare every block (but `schema`, which `setup()` ran) on this
        queue's schema without running it: a syntax error, an unknown table, column or
        function, or a type the server cannot resolve is found here, before any load,
        rather than in every worker's every call. Each block is parsed and analysed (a
        protocol-level Parse of the unnamed statement), never planned nor executed, with its
        parameters typed as the queue's own calls type them. A block with no placeholders
        that is a script of several statements (psycopg sends those as one simple query)
        cannot be prepared, and is left unchecked. Raises `StatementError` for the first
        block refused; call after `setup()`."""
        samples = _sample_params()
        with self._locks[Role.ADMIN]:
            conn = self._conn(Role.ADMIN)
            if conn.info.transaction_status != TransactionStatus.IDLE:
                conn.rollback()
            transformer = Transformer(conn)
            encoding = conn.info.encoding
            for block, text in self._statements.items():
                if block == "schema" or (block in _RECEIPT_BLOCKS and not self.receipts):
                    continue
                query, names, formats = positional(text)
                params = samples.get(block, {})
                transformer.dump_sequence([params[n] for n in names], list(formats))
                result = conn.pgconn.prepare(b"", query.encode(encoding), transformer.types)
                if result.status != pq.ExecStatus.FATAL_ERROR:
                    continue
                if conn.pgconn.status != pq.ConnStatus.OK:
                    self._drop(Role.ADMIN)
                    raise psycopg.OperationalError(
                        f"the connection was lost while checking block {block!r}"
                    )
                error = _field(result, pq.DiagnosticField.MESSAGE_PRIMARY, encoding)
                if not names and error == _SCRIPT_NOT_PREPARABLE:
                    continue  # a script, sent as a simple query: it cannot be prepared
                raise self._statement_error(block, error.splitlines()[0] if error else
                                            "the server refused the statement")

    def upsert_accounts(self, accounts: Sequence[Account]) -> None:
        if not accounts:
            return
        with self._tx(Role.ADMIN) as conn:
            self._run(conn, "upsert_accounts", _accounts_params(accounts))

    def enqueue(self, jobs: Sequence[NewJob]) -> None:
        if not jobs:
            return
        check_jobs(jobs)
        params = _enqueue_params(jobs)
        # At most one NOTIFY per `notify_interval` from this queue object: a transaction that
        # notifies takes a lock at commit that every notifying transaction shares (measured:
        # 8 clients inserting 10 rows each commit 1,430 times/s with a NOTIFY, 2,640 without),
        # and wakes every idle worker. A worker woken by a notification claims once more that
        # long after it (`Dispatcher._idle`), so the jobs of an enqueue that skipped its
        # NOTIFY wait at most the interval, not the poll.
        now = time.monotonic()
        notify = now - self._last_notify >= NOTIFY_INTERVAL_SECONDS
        with self._tx(Role.ENQUEUE) as conn:
            self._run(conn, "enqueue", params)
            if notify:
                self._run(conn, "notify", {"channel": self.channel})
        if notify:
            # From the commit, which is when listeners wake: an enqueue that skips its
            # NOTIFY starts within the interval after they woke.
            self._last_notify = time.monotonic()

    @property
    def notify_interval(self) -> float:
        """The longest an enqueue may go without a NOTIFY after the previous one (see
        `enqueue`): a woken worker claims again this long after its wake-up."""
        return NOTIFY_INTERVAL_SECONDS

    def claim(self, worker_id: str, batch: int, lease: timedelta) -> list[Lease]:
        if batch <= 0:
            raise ValueError("batch must be positive")
        if lease <= timedelta(0):
            raise ValueError("lease must be positive")
        match self.variant:
            case "pg":
                return self._claim_locked(worker_id, batch, lease, skip_locked=True, hold=False)
            case "pg-for-update":
                return self._claim_locked(worker_id, batch, lease, skip_locked=False, hold=False)
            case "pg-long-tx":
                return self._claim_locked(worker_id, batch, lease, skip_locked=True, hold=True)
            case "pg-naive":
                return self._claim_naive(worker_id, batch, lease)
            case _:
                assert_never(self.variant)

    def _claim_locked(
        self, worker_id: str, batch: int, lease: timedelta, *, skip_locked: bool, hold: bool
    ) -> list[Lease]:
        lock_block, claim_block = (
            ("claim_lock_accounts", "claim")
            if skip_locked
            else ("claim_lock_accounts_wait", "claim_wait")
        )
        if not hold and self.claim_commit_hook is None:
            if skip_locked and self._claim_hands_over:
                leases = self._claim_one_trip(worker_id, batch, lease)
            else:
                leases = self._claim_pipelined(lock_block, claim_block, worker_id, batch, lease)
            if leases:
                self._after_commit()
            return leases
        with self._locks[Role.LEASE]:
            conn = self._conn(Role.LEASE)
            try:
                _begin(conn)
                # Two statements on purpose (see the claim block): the second one's snapshot
                # is taken after the first one's account locks.
                locked = [row["id"] for row in self._run(conn, lock_block, {"batch": batch})]
                rows = self._run(
                    conn, claim_block, _claim_params(locked, batch, lease, worker_id)
                )
            except BaseException:
                self._rollback(Role.LEASE, conn)
                raise
            if hold and rows:
                # The anti-pattern: the claim stays uncommitted until finish().
                self._open_claim = True
            else:
                if rows and self.claim_commit_hook is not None:
                    # Inside the claim's transaction, its rows updated and locked: where a
                    # stalled worker (or a stalled COMMIT) holds leases whose clock runs.
                    self.claim_commit_hook()
                try:
                    conn.commit()
                except BaseException:
                    self._rollback(Role.LEASE, conn)
                    raise
                self._open_claim = False
        if rows and not hold:
            self._after_commit()
        return [_lease(row) for row in rows]

    def _after_commit(self) -> None:
        """Run `claim_result_hook` after a claim that took rows committed; an error it
        raises drops the lease connection, as a connection lost there would."""
        if self.claim_result_hook is None:
            return
        try:
            self.claim_result_hook()
        except BaseException:
            with self._locks[Role.LEASE]:
                self._drop(Role.LEASE)
            raise

    @property
    def one_transaction(self) -> bool:
        """Whether `finish_and_claim` is one transaction (see `FinishesWhileClaiming`): the
        `pg` variant's one-trip claim (the reference's two claim blocks), no hook inside the
        claim's transaction."""
        return (self.variant == "pg" and self.claim_commit_hook is None
                and self._claim_hands_over)

    @property
    def _claim_hands_over(self) -> bool:
        """Whether the claim's first statement leaves the ids it locked in the transaction's
        settings for the second to read (the reference's two blocks do; a SQL file that
        replaces either is sent the ids, as the contract says)."""
        return (self._sources["claim_lock_accounts"] == REFERENCE_PATH
                and self._sources["claim"] == REFERENCE_PATH)

    def _claim_one_trip(self, worker_id: str, batch: int, lease: timedelta) -> list[Lease]:
        """The claim's two statements and COMMIT in one round trip: the second reads the
        account locks' ids from the first through the transaction's settings (see the
        blocks), and still runs after it, on a snapshot taken once those locks are held."""
        with self._tx(Role.LEASE, pipeline=True) as conn:
            conn.execute(self._statements["claim_lock_accounts"], {"batch": batch})
            claim = conn.execute(self._statements["claim"],
                                 _claim_params(None, batch, lease, worker_id))
        return [_lease(row) for row in claim.fetchall()]

    def _claim_pipelined(self, lock_block: str, claim_block: str, worker_id: str, batch: int,
                         lease: timedelta) -> list[Lease]:
        """The claim's two statements and COMMIT in two round trips instead of four: BEGIN
        goes with the account locks, COMMIT with the claim. The claim needs the locks'
        answer (and its snapshot must come after them), so that round trip stays."""
        with self._tx(Role.LEASE, pipeline=True) as conn:
            lock = conn.execute(self._statements[lock_block], {"batch": batch})
            locked = [row["id"] for row in lock.fetchall()]
            claim = conn.execute(self._statements[claim_block],
                                 _claim_params(locked, batch, lease, worker_id))
        return [_lease(row) for row in claim.fetchall()]

    def _claim_naive(self, worker_id: str, batch: int, lease: timedelta) -> list[Lease]:
        with self._tx(Role.LEASE) as conn:
            ids = [row["id"] for row in self._run(conn, "naive_select_due", {"batch": batch})]
        if not ids:
            return []
        with self._tx(Role.LEASE) as conn:
            rows = self._run(
                conn, "naive_take", {"job_ids": ids, "lease": lease, "worker_id": worker_id}
            )
        if rows:
            self._after_commit()
        return [_lease(row) for row in rows]

    def receive(self, leases: Sequence[Lease]) -> list[WriteResult]:
        """Mark leases received (see `ConfirmsReceipt`): one round trip. Without receipts
        (`receipts`), every lease is taken as received and nothing is sent."""
        if not leases:
            return []
        if not self.receipts:
            return [WriteResult.APPLIED] * len(leases)
        applied = {row["ord"] for row in self._one("receive", _items(leases))}
        return _write_results(len(leases), applied)

    def finish(self, results: Sequence[AttemptResult]) -> list[WriteResult]:
        if not results:
            return []
        applied = {row["ord"] for row in self._one("finish", _finish_params(results))}
        return _write_results(len(results), applied)

    def finish_and_claim(
        self, results: Sequence[AttemptResult], worker_id: str, batch: int, lease: timedelta
    ) -> tuple[list[WriteResult], list[Lease]]:
        """The results and the next claim in one transaction and one round trip (see
        `FinishesWhileClaiming`): the finish first, so its rows' locks are taken before the
        claim's and the slots it frees are counted by the claim's fresh snapshot. Where a
        claim is not the reference's one-trip claim (another variant, a hook inside it, a SQL
        file that replaces a step), the two go one after the other, as `finish` and
        `claim`."""
        if batch <= 0:
            raise ValueError("batch must be positive")
        if lease <= timedelta(0):
            raise ValueError("lease must be positive")
        if not results or not self.one_transaction:
            return self.finish(results), self.claim(worker_id, batch, lease)
        with self._tx(Role.LEASE, pipeline=True) as conn:
            written = conn.execute(self._statements["finish"], _finish_params(results))
            conn.execute(self._statements["claim_lock_accounts"], {"batch": batch})
            claim = conn.execute(self._statements["claim"],
                                 _claim_params(None, batch, lease, worker_id))
        applied = {row["ord"] for row in written.fetchall()}
        leases = [_lease(row) for row in claim.fetchall()]
        if leases:
            self._after_commit()
        return _write_results(len(results), applied), leases

    def renew(self, leases: Sequence[Lease], extend: timedelta) -> list[Lease | None]:
        if not leases:
            return []
        if extend <= timedelta(0):
            raise ValueError("extend must be positive")
        rows = self._one("renew", {**_items(leases), "extend": extend},
                         commit=not self._open_claim)
        until = {row["ord"]: row["locked_until"] for row in rows}
        return [
            _replace_until(lease, until[i]) if i in until else None
            for i, lease in enumerate(leases)
        ]

    def release(self, leases: Sequence[Lease]) -> list[WriteResult]:
        if not leases:
            return []
        applied = {row["ord"] for row in self._one("release", _items(leases))}
        return _write_results(len(leases), applied)

    def recover(self, limit: int = 100) -> int:
        if limit <= 0:
            raise ValueError("limit must be positive")
        with self._tx(Role.RECOVER) as conn:
            given_back = 0
            if self.receipts:
                # Both statements read one instant (skiplock_now(), for this transaction
                # only): a never-received lease expiring between them would be counted.
                conn.execute("SELECT set_config('skiplock.now', skiplock_now()::text, true)")
                given_back = _count(self._run(conn, "recover_unreceived", {"limit": limit}))
            moved = 0
            if given_back < limit:
                moved = _count(self._run(conn, "recover", {"limit": limit - given_back}))
        return given_back + moved

    def wait_for_work(self, timeout: float) -> bool:
        with self._locks[Role.LISTEN]:
            conn = self._conn(Role.LISTEN)
            try:
                for _ in conn.notifies(timeout=max(timeout, 0.0), stop_after=1):
                    return True
            except psycopg.OperationalError:
                self._drop(Role.LISTEN)
                raise
        return False

    def snapshot(self) -> list[JobState]:
        with self._tx(Role.ADMIN) as conn:
            rows = self._run(conn, "snapshot", {})
        return [_job_state(row) for row in rows]

    # -- observability (tests, reports, chaos) -----------------------------------------

    def backend_pids(self) -> dict[str, int]:
        """The server process id of each open connection, by role: what a fault injector
        passes to pg_terminate_backend to cut exactly this queue's sessions."""
        return {
            role.value: conn.info.backend_pid
            for role, conn in list(self._conns.items())
            if not conn.closed
        }

    def attempts_log(self) -> list[dict[str, Any]]:
        """Every `job_attempts` row: one per execution."""
        with self._tx(Role.ADMIN) as conn:
            return [dict(row) for row in self._run(conn, "list_attempts", {})]

    def fenced_log(self) -> list[dict[str, Any]]:
        """Every `fenced_writes` row: one per refused write."""
        with self._tx(Role.ADMIN) as conn:
            return [dict(row) for row in self._run(conn, "list_fenced", {})]

    def explain(self, block: str, params: Mapping[str, Any]) -> list[str]:
        """The plan of a named block (EXPLAIN, no ANALYZE), as the queue runs it (see
        `explain_as_run`): nothing is executed."""
        with self._tx(Role.ADMIN, commit=False) as conn:
            try:
                rows = explain_as_run(conn, self._statements[block], params, "")
                return [str(next(iter(row.values()))) for row in rows]
            finally:
                conn.rollback()

    def explain_analyze(self, block: str, params: Mapping[str, Any]) -> dict[str, Any]:
        """The executed plan of a named block (EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)), as
        the queue runs it: the top object, with "Plan" and "Execution Time". The statement
        runs, and is rolled back."""
        with self._tx(Role.ADMIN, commit=False) as conn:
            try:
                rows = explain_as_run(conn, self._statements[block], params,
                                      "ANALYZE, BUFFERS, FORMAT JSON")
                plan = next(iter(rows[0].values()))
                return cast(dict[str, Any], plan[0])
            finally:
                conn.rollback()


def _begin(conn: Conn) -> None:
    """Open a transaction on an autocommit session that has none open (on any other, the
    first statement opens it). Sent as it is, never prepared."""
    if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        conn.execute("BEGIN", prepare=False)


def apply_plan_settings(conn: psycopg.Connection[Any]) -> None:
    """How the queue's statements are planned, on each of its connections.

    Once per connection, not on every call (`force_generic_plan`, prepared on first use): the
    claim and the result write are CTE-heavy, planning them cost more than running them (a
    claim of 10 on a local server: 3.7 ms to plan, 4.6 ms to run), and the server kept
    choosing a fresh plan per call. Their generic plans are the plans the tests and
    `skiplock plans` examine (`explain_as_run`); none depends on a parameter's value to stay
    on the partial indexes.

    No JIT: compiling a short statement costs far more than it saves, on every execution (a
    claim whose estimate crossed `jit_above_cost`, at 100k due jobs and 1,000 accounts,
    spent 135 of its 208 ms compiling)."""
    conn.prepare_threshold = 0
    conn.execute("SET plan_cache_mode = force_generic_plan")
    conn.execute("SET jit = off")


def explain_as_run(conn: psycopg.Connection[Any], statement: str, params: Mapping[str, Any],
                   options: str) -> list[Any]:
    """`EXPLAIN (options)` of `statement` as the queue's connections run it: prepared with
    its parameters typed as psycopg types them, executed with its generic plan. (An EXPLAIN
    of the statement with its values would show the plan made for those values instead.)
    The caller's transaction is left for it to end; ANALYZE really runs the statement."""
    query, names, formats = positional(statement)
    values = [params[name] for name in names]
    transformer = Transformer(conn)
    transformer.dump_sequence(values, list(formats))
    apply_plan_settings(conn)
    # A name of its own per call: one left behind by a failed transaction (where DEALLOCATE
    # is refused) cannot collide with the next.
    name = f"skiplock_explain_{uuid.uuid4().hex}"
    result = conn.pgconn.prepare(name.encode(), query.encode(conn.info.encoding),
                                 transformer.types)
    if result.status == pq.ExecStatus.FATAL_ERROR:
        message = _field(result, pq.DiagnosticField.MESSAGE_PRIMARY, conn.info.encoding)
        raise psycopg.ProgrammingError(f"could not prepare the statement to explain: {message}")
    arguments = (sql.SQL(" ({})").format(sql.SQL(", ").join([sql.Placeholder()] * len(values)))
                 if values else sql.SQL(""))
    explain = sql.SQL("EXPLAIN {}EXECUTE {}{}").format(
        sql.SQL(f"({options}) " if options else ""), sql.Identifier(name), arguments)
    try:
        # The values as literals (EXECUTE types them by the prepared parameters; sent as
        # parameters of their own, an empty list's type could not be told).
        cursor = psycopg.ClientCursor(conn)
        cursor.row_factory = conn.row_factory
        return cursor.execute(explain, values).fetchall()
    finally:
        conn.pgconn.exec_(f"DEALLOCATE {name}".encode())


# Set by the harness in each worker process it starts, so that a fault can find exactly the
# system under test's sessions in pg_stat_activity (and never the harness's own).
APPLICATION_NAME_ENV = "SKIPLOCK_APPLICATION_NAME"


def _application_name(variant: str) -> str:
    return os.environ.get(APPLICATION_NAME_ENV) or f"skiplock-{variant}"


def _accounts_params(accounts: Sequence[Account]) -> dict[str, Any]:
    return {
        "account_ids": [a.id for a in accounts],
        "limits": [a.concurrency_limit for a in accounts],
    }


def _enqueue_params(jobs: Sequence[NewJob]) -> dict[str, Any]:
    return {
        "job_ids": [j.id for j in jobs],
        "account_ids": [j.account_id for j in jobs],
        "target_urls": [j.target_url for j in jobs],
        "payloads": [Jsonb(dict(j.payload)) for j in jobs],
        "run_ats": [j.run_at for j in jobs],
        "max_attempts": [j.max_attempts for j in jobs],
    }


def _claim_params(
    locked: Sequence[Any] | None, batch: int, lease: timedelta, worker_id: str
) -> dict[str, Any]:
    """None for `locked`: step 1 hands its ids over in the transaction (`_claim_one_trip`)."""
    return {"locked_accounts": None if locked is None else list(locked), "batch": batch,
            "lease": lease, "worker_id": worker_id}


def _finish_params(results: Sequence[AttemptResult]) -> dict[str, Any]:
    return {
        **_items([r.lease for r in results]),
        "outcomes": [r.outcome.value for r in results],
        "http_statuses": [r.http_status for r in results],
        "errors": [r.error for r in results],
        "retry_delays": [r.retry_delay for r in results],
        "finished_ats": [r.finished_at for r in results],
    }


def _sample_params() -> dict[str, dict[str, Any]]:
    """Each block's parameters as the queue's own calls pass them (built by the same
    functions, from values shaped like a run's), so a statement is prepared with the types
    the server will really be sent."""
    now = datetime.now().astimezone()
    lease = timedelta(seconds=30)
    held = Lease(
        job_id=uuid.uuid4(), account_id="acct-0", target_url="http://127.0.0.1:1/deliver",
        payload={}, attempt=1, max_attempts=3, lease_token=uuid.uuid4(),
        locked_until=now + lease, worker_id="worker-0",
    )
    result = AttemptResult(
        lease=held, outcome=Outcome.TRANSIENT, http_status=503, error="HTTP 503",
        retry_delay=timedelta(seconds=1), started_at=now, finished_at=now,
    )
    job = NewJob(id=uuid.uuid4(), account_id="acct-0", target_url=held.target_url, payload={})
    claim = _claim_params(["acct-0"], 10, lease, "worker-0")
    return {
        "setup_lock": {"lock_key": "skiplock-schema:check"},
        "upsert_accounts": _accounts_params([Account(id="acct-0", concurrency_limit=2)]),
        "enqueue": _enqueue_params([job]),
        "notify": {"channel": "skiplock_check"},
        "claim_lock_accounts": {"batch": 10},
        "claim": claim,
        "claim_lock_accounts_wait": {"batch": 10},
        "claim_wait": claim,
        "naive_select_due": {"batch": 10},
        "naive_take": {"job_ids": [held.job_id], "lease": lease, "worker_id": "worker-0"},
        "finish": _finish_params([result]),
        "renew": {**_items([held]), "extend": lease},
        "receive": _items([held]),
        "release": _items([held]),
        "recover_unreceived": {"limit": 100},
        "recover": {"limit": 100},
    }


# What the server answers when asked to prepare a script of several statements.
_SCRIPT_NOT_PREPARABLE = "cannot insert multiple commands into a prepared statement"


def _field(result: pq.abc.PGresult, field: pq.DiagnosticField, encoding: str) -> str:
    raw = result.error_field(field)
    return raw.decode(encoding, errors="replace") if raw else ""


def _count(rows: Sequence[Mapping[str, Any]]) -> int:
    """The count a recovery block returns in its first column."""
    return int(next(iter(rows[0].values()))) if rows else 0


# The blocks receipts add; not run (nor checked) for a queue without receipts.
_RECEIPT_BLOCKS = frozenset({"receive", "recover_unreceived"})


def _items(leases: Sequence[Lease]) -> dict[str, list[Any]]:
    return {
        "ords": list(range(len(leases))),
        "job_ids": [lease.job_id for lease in leases],
        "lease_tokens": [lease.lease_token for lease in leases],
        "attempts": [lease.attempt for lease in leases],
        "workers": [lease.worker_id for lease in leases],
    }


def _write_results(count: int, applied: set[int]) -> list[WriteResult]:
    return [WriteResult.APPLIED if i in applied else WriteResult.FENCED for i in range(count)]


def _lease(row: Mapping[str, Any]) -> Lease:
    return Lease(
        job_id=_uuid(row["id"]),
        account_id=str(row["account_id"]),
        target_url=str(row["target_url"]),
        payload=row["payload"],
        attempt=int(row["attempts"]),
        max_attempts=int(row["max_attempts"]),
        lease_token=_uuid(row["lease_token"]),
        locked_until=row["locked_until"],
        worker_id=str(row["locked_by"]),
    )


def _replace_until(lease: Lease, locked_until: datetime) -> Lease:
    return dataclasses.replace(lease, locked_until=locked_until)


def _job_state(row: Mapping[str, Any]) -> JobState:
    extra = {k: v for k, v in row.items() if k not in _SNAPSHOT_COLUMNS}
    return JobState(
        job_id=_uuid(row["id"]),
        account_id=str(row["account_id"]),
        status=JobStatus(row["status"]),
        attempts=int(row["attempts"]),
        max_attempts=int(row["max_attempts"]),
        last_error=row["last_error"],
        locked_until=row["locked_until"],
        next_attempt_at=row["next_attempt_at"],
        extra=extra,
    )


def _uuid(value: Any) -> uuid.UUID:
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))
