"""The database faults against a real server: terminate_backends hits only the system under
test's sessions, pin_xmin holds back vacuum until healed, exhaust_pool refuses new
connections until healed, and restart_postgres cuts sessions but keeps committed data.

Each fault gets a small fake `NemesisContext`; nothing else of a run is started. The
exhaust test fills the shared test server's connection slots, so it holds them only for
the moment it takes to see a connection refused.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from skiplock.chaos.faults import database as nemesis_db
from skiplock.chaos.faults.cancel_statements import CANCEL_APPLICATION_NAME, CancelStatements
from skiplock.chaos.faults.database import (
    EXHAUST_APPLICATION_NAME,
    PIN_APPLICATION_NAME,
    ExhaustPool,
    PinXmin,
    RestartPostgres,
    TerminateBackends,
    like_prefix,
)
from skiplock.chaos.nemesis import Fault, FaultSkipped, PlannedFault, TargetHandle
from skiplock.scenarios.servers.postgres import DSN_ENV, PgServer, fresh_database, postgres

pytestmark = pytest.mark.integration


@dataclass
class FakeContext:
    """Just what the database faults use of a run's NemesisContext."""

    dsn: str
    app_prefix: str = "skiplock-sut-s_test-"
    server_owned: bool = False
    restart: Callable[[], None] | None = None
    schema: str = "public"
    run_dir: Path = field(default_factory=Path)
    lease_seconds: float = 2.0
    http_timeout_seconds: float = 1.0
    account_limits: dict[str, int | None] = field(default_factory=dict)
    claim_transaction: bool = True

    def restart_server(self) -> None:
        assert self.restart is not None, "restart_server called on a server not owned"
        self.restart()

    def targets(self) -> Sequence[TargetHandle]:
        return []

    def workers_alive(self) -> list[str]:
        return []

    def workers_holding_leases(self) -> list[str]:
        return []

    def signal_worker(self, worker_id: str, signum: int) -> None:
        return None

    def set_failpoint(self, name: str, probability: float) -> None:
        return None


def make(cls: type[Fault], ctx: FakeContext, duration: float = 0.0) -> Any:
    planned = PlannedFault(kind=cls.kind, at=0.0, duration=duration, count=1, probability=1.0,
                           external="skip", seed=7)
    return cls(ctx, planned)


def connect(dsn: str, name: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=True, connect_timeout=2, application_name=name)


def alive(conn: psycopg.Connection[Any]) -> bool:
    try:
        conn.execute("SELECT 1")
    except psycopg.OperationalError:
        return False
    return True


def backends_named(dsn: str, name: str) -> int:
    with connect(dsn, "skiplock-test-observer") as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                           (name,)).fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def db_dsn(pg_dsn: str) -> Iterator[str]:
    """A database of its own: no other session's snapshot or application_name in it."""
    with fresh_database(pg_dsn, prefix="dbfaults") as dsn:
        yield dsn


# --- terminate_backends ----------------------------------------------------------------------


def test_like_prefix_matches_metacharacters_literally_and_cuts_at_63_bytes() -> None:
    assert like_prefix("skiplock-sut-s_a%b\\c-") == "skiplock-sut-s\\_a\\%b\\\\c-%"
    long = "p" * 70
    assert like_prefix(long) == "p" * 63 + "%"


def test_terminate_backends_hits_only_the_prefix_in_this_database(
        pg_dsn: str, db_dsn: str) -> None:
    prefix = f"skiplock-sut-s_{uuid.uuid4().hex[:8]}-"
    with ExitStack() as stack:
        victim = stack.enter_context(connect(db_dsn, prefix + "worker-1"))
        # `_` in the prefix must not match any character.
        lookalike = stack.enter_context(connect(db_dsn, prefix.replace("_", "X") + "worker-1"))
        harness = stack.enter_context(connect(db_dsn, "skiplock-harness-other"))
        elsewhere = stack.enter_context(connect(pg_dsn, prefix + "worker-2"))

        fault = make(TerminateBackends, FakeContext(dsn=db_dsn, app_prefix=prefix))
        assert fault.apply() == ["postgres"]
        fault.heal()

        assert fault.data["terminated"] == 1
        assert fault.data["still_alive"] == 0
        assert not alive(victim)
        assert alive(lookalike)
        assert alive(harness)
        assert alive(elsewhere)


def test_terminate_backends_is_skipped_when_no_session_matches(db_dsn: str) -> None:
    fault = make(TerminateBackends, FakeContext(dsn=db_dsn, app_prefix="skiplock-sut-none-"))
    with pytest.raises(FaultSkipped, match="no backend of the system under test"):
        fault.apply()


def test_terminate_backends_aimed_at_commits_ends_claims_as_they_commit(
        db_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Phase "commit": only sessions caught inside a COMMIT are ended, up to `count`, and a
    claim ended there may have committed unseen (its lease then never received)."""
    from datetime import timedelta

    from skiplock.queue_impl.interface import NewJob
    from skiplock.queue_impl.pg import APPLICATION_NAME_ENV, PgQueue

    prefix = f"skiplock-sut-s_{uuid.uuid4().hex[:8]}-"
    monkeypatch.setenv(APPLICATION_NAME_ENV, prefix + "worker-1")
    queue = PgQueue(db_dsn, schema="commits")
    queue.setup()
    queue.enqueue([NewJob(id=uuid.uuid4(), account_id="a", target_url="http://127.0.0.1:9/",
                          payload={}, max_attempts=100) for _ in range(3000)])
    planned = PlannedFault(kind="terminate_backends", at=0.0, duration=5.0, count=3,
                           probability=1.0, external="skip", seed=7, phase="commit")
    errors = 0
    with connect(db_dsn, prefix + "idle") as idle:
        fault = TerminateBackends(FakeContext(dsn=db_dsn, app_prefix=prefix), planned)
        assert fault.apply() == ["postgres"]
        try:
            # Each ended COMMIT is usually one error here; one ended after its answer
            # was sent shows as an error on the next call, or none if it was the last.
            deadline = time.monotonic() + 4.0
            while errors < 3 and time.monotonic() < deadline:
                try:
                    queue.receive(queue.claim("w", 5, timedelta(seconds=60)))
                except psycopg.OperationalError:
                    errors += 1
        finally:
            fault.heal()
            queue.close()
        assert alive(idle)
    assert fault.data["terminated"] == 3 and errors >= 1
    assert fault.data["phase"] == "commit" and fault.data["polls"] > 0
    assert fault.data["aim"] == "COMMIT statements"


@dataclass
class Hunted:
    """What a commit-phase terminate_backends did to one session writing in a loop."""

    aim: str
    terminated: int
    cut: bool  # the session saw its connection end
    written: int  # writes that returned
    kept: int  # rows the table holds afterwards


Write = Callable[[psycopg.Connection[Any], sql.Composed, int], None]


def hunt_a_writer(dsn: str, write: Write, *, claim_transaction: bool,
                  seconds: float) -> Hunted:
    """Run a commit hunt (`count` 1) while one session of the system under test writes row
    after row with `write` (given the INSERT of one), until it is cut or `seconds` pass."""
    prefix = f"skiplock-sut-s_{uuid.uuid4().hex[:8]}-"
    table = f"written_{uuid.uuid4().hex[:8]}"
    with connect(dsn, "skiplock-test-setup") as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (id bigint PRIMARY KEY)").format(
            sql.Identifier(table)))
    planned = PlannedFault(kind="terminate_backends", at=0.0, duration=seconds, count=1,
                           probability=1.0, external="skip", seed=7, phase="commit")
    fault = TerminateBackends(FakeContext(dsn=dsn, app_prefix=prefix,
                                          claim_transaction=claim_transaction), planned)
    insert = sql.SQL("INSERT INTO {} VALUES (%s)").format(sql.Identifier(table))
    writer = connect(dsn, prefix + "worker-1")
    written, cut = 0, False
    try:
        assert fault.apply() == ["postgres"]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            write(writer, insert, written)
            written += 1
    except psycopg.OperationalError:
        cut = True
    finally:
        fault.heal()
        writer.close()
    with connect(dsn, "skiplock-test-after") as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(
            sql.Identifier(table))).fetchone()
    assert row is not None
    return Hunted(aim=fault.data["aim"], terminated=fault.data["terminated"], cut=cut,
                  written=written, kept=row[0])


def autocommit_insert(conn: psycopg.Connection[Any], insert: sql.Composed, n: int) -> None:
    conn.execute(insert, [n])


@pytest.mark.chaos
def test_terminate_backends_aimed_at_commits_finds_claims_that_commit_alone(
        owned_pg_server: PgServer) -> None:
    """A queue whose claim is no transaction of its own (`claim_transaction` false, as
    pgqueuer's autocommit dequeue) never sends a COMMIT statement: on a server that waits
    for the WAL flush the hunt finds its sessions committing, and ends them there. A queue
    whose claims do send one is hunted in those alone: its other statements, committing
    alone, are left."""
    dsn = owned_pg_server.dsn
    with connect(dsn, "skiplock-test-setup") as conn:
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
    alone = hunt_a_writer(dsn, autocommit_insert, claim_transaction=False, seconds=10.0)
    assert alone.aim == "commit flushes"
    assert alone.cut and alone.terminated == 1
    # Cut inside its commit's flush: the write committed, whether or not it had returned.
    assert alone.kept in (alone.written, alone.written + 1)
    left = hunt_a_writer(dsn, autocommit_insert, claim_transaction=True, seconds=1.5)
    assert left.aim == "COMMIT statements"
    assert not left.cut and left.terminated == 0 and left.kept == left.written > 0


@pytest.mark.chaos
@pytest.mark.parametrize("commit", ["COMMIT", "commit;"])
def test_terminate_backends_aimed_at_commits_knows_a_commit_statement_as_clients_send_it(
        owned_pg_server: PgServer, commit: str) -> None:
    """asyncpg sends "COMMIT;": a COMMIT statement all the same."""
    def in_a_transaction(conn: psycopg.Connection[Any], insert: sql.Composed, n: int) -> None:
        conn.execute("BEGIN")
        conn.execute(insert, [n])
        conn.execute(commit)

    hunted = hunt_a_writer(owned_pg_server.dsn, in_a_transaction, claim_transaction=True,
                           seconds=10.0)
    assert hunted.cut and hunted.terminated == 1


# --- cancel_statements -----------------------------------------------------------------------


def test_cancel_statements_cancels_running_statements_and_leaves_the_session(
        db_dsn: str) -> None:
    prefix = f"skiplock-sut-s_{uuid.uuid4().hex[:8]}-"
    with connect(db_dsn, prefix + "worker-1") as victim, \
            connect(db_dsn, "skiplock-harness-other") as harness:
        fault = make(CancelStatements, FakeContext(dsn=db_dsn, app_prefix=prefix))
        assert fault.apply() == ["postgres"]
        try:
            with pytest.raises(psycopg.errors.QueryCanceled):
                victim.execute("SELECT pg_sleep(5)")
            harness.execute("SELECT pg_sleep(0.2)")  # the harness's own are never hit
        finally:
            fault.heal()
        assert fault.data["cancelled"] >= 1
        assert alive(victim)  # cancelled, not terminated: the session goes on
    assert backends_named(db_dsn, CANCEL_APPLICATION_NAME) == 0  # healed: its session closed


# --- pin_xmin --------------------------------------------------------------------------------


def dead_not_removable(conn: psycopg.Connection[Any], table: str) -> int:
    """Row versions VACUUM found dead but could not remove yet (from VACUUM VERBOSE)."""
    messages: list[str] = []

    def keep(diag: psycopg.errors.Diagnostic) -> None:
        messages.append(diag.message_primary or "")

    conn.add_notice_handler(keep)
    try:
        conn.execute(sql.SQL("VACUUM (VERBOSE) {}").format(sql.Identifier(table)))
    finally:
        conn.remove_notice_handler(keep)
    found = re.findall(r"(\d+) are dead but not yet removable", "\n".join(messages))
    assert found, f"no tuple counts in the VACUUM VERBOSE output: {messages}"
    return int(found[-1])


def backend_xmin(conn: psycopg.Connection[Any], pid: int) -> int | None:
    row = conn.execute("SELECT backend_xmin::text FROM pg_stat_activity WHERE pid = %s",
                       (pid,)).fetchone()
    return int(row[0]) if row and row[0] is not None else None


def test_pin_xmin_holds_back_vacuum_until_healed(db_dsn: str) -> None:
    rows = 100
    with connect(db_dsn, "skiplock-test-observer") as conn:
        conn.execute("CREATE TABLE pinned (id int PRIMARY KEY, v int) "
                     "WITH (autovacuum_enabled = off)")
        conn.execute("INSERT INTO pinned SELECT g, 0 FROM generate_series(1, %s) g", (rows,))

        fault = make(PinXmin, FakeContext(dsn=db_dsn), duration=3.0)
        fault.heal()  # healing before applying is harmless
        try:
            assert fault.apply() == ["postgres"]
            pid = fault.data["pid"]
            assert fault.data["backend_xmin"] is not None
            assert backend_xmin(conn, pid) == fault.data["backend_xmin"]
            assert fault.data["xmin"] <= fault.data["xid"]

            conn.execute("UPDATE pinned SET v = v + 1")
            assert dead_not_removable(conn, "pinned") == rows
            # Still held a moment later: nothing timed it out.
            assert backend_xmin(conn, pid) == fault.data["backend_xmin"]
        finally:
            fault.heal()
        fault.heal()  # and healing twice too

        assert backend_xmin(conn, pid) is None
        assert backends_named(db_dsn, PIN_APPLICATION_NAME) == 0
        # Some other short snapshot in this database (autovacuum's analyze) may hold back
        # the horizon for a moment; the pin's own is gone.
        deadline = time.monotonic() + 3.0
        while (left := dead_not_removable(conn, "pinned")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert left == 0


# --- exhaust_pool ----------------------------------------------------------------------------


@pytest.fixture
def lone_dsn(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A server of this test's own, even when SKIPLOCK_PG_DSN is set: exhaust_pool takes every
    connection slot, which would refuse the tests running beside it on a shared server. Few
    slots, so that taking them all is quick on a machine busy with those tests."""
    monkeypatch.delenv(DSN_ENV, raising=False)
    with postgres(durable=False, settings={"max_connections": "40"}) as server:
        yield server.dsn


def test_exhaust_pool_refuses_new_connections_until_healed(lone_dsn: str) -> None:
    fault = make(ExhaustPool, FakeContext(dsn=lone_dsn), duration=3.0)
    started = time.monotonic()
    try:
        assert fault.apply() == ["postgres"]
        applied = time.monotonic() - started
        with pytest.raises(psycopg.OperationalError, match=r"too many clients|slots are reserved"):
            connect(lone_dsn, "skiplock-test-refused").close()
    finally:
        fault.heal()
    healed = time.monotonic() - started
    print(f"exhaust_pool: held {fault.data['held']} of max_connections "
          f"{fault.data['max_connections']} in {applied:.3f} s; healed after {healed:.3f} s")

    assert fault.data["refused"] is True
    assert 0 < fault.data["held"] <= fault.data["max_connections"]
    assert "too many clients" in fault.data["refusal"] or "reserved" in fault.data["refusal"]
    assert applied < 2.0
    # heal() returns once the slots are free again: a new connection works at once.
    with connect(lone_dsn, "skiplock-test-after") as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    assert backends_named(lone_dsn, EXHAUST_APPLICATION_NAME) == 0
    fault.heal()


def test_exhaust_pool_closes_what_it_opened_when_it_fails_midway(
        pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[psycopg.Connection[Any]] = []
    real = nemesis_db._connect

    def flaky(dsn: str, application_name: str) -> psycopg.Connection[Any]:
        if len(opened) == 3:
            raise psycopg.OperationalError("connection failed: timeout expired")
        conn = real(dsn, application_name)
        opened.append(conn)
        return conn

    monkeypatch.setattr(nemesis_db, "_connect", flaky)
    fault = make(ExhaustPool, FakeContext(dsn=pg_dsn), duration=3.0)
    with pytest.raises(psycopg.OperationalError, match="timeout expired"):
        fault.apply()
    assert len(opened) == 3
    assert all(conn.closed for conn in opened)


def test_exhaust_pool_is_skipped_when_the_server_is_already_full(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def full(dsn: str, application_name: str) -> psycopg.Connection[Any]:
        raise psycopg.OperationalError('connection to server at "127.0.0.1", port 1 failed: '
                                       "FATAL:  sorry, too many clients already")

    monkeypatch.setattr(nemesis_db, "_connect", full)
    fault = make(ExhaustPool, FakeContext(dsn="postgresql://127.0.0.1:1/x"), duration=3.0)
    with pytest.raises(FaultSkipped, match="already refused"):
        fault.apply()


# --- restart_postgres ------------------------------------------------------------------------


@pytest.mark.chaos
def test_restart_postgres_cuts_sessions_and_keeps_committed_data(
        owned_pg_server: PgServer) -> None:
    server = owned_pg_server
    with connect(server.dsn, "skiplock-test-setup") as conn:
        conn.execute("CREATE TABLE kept (id int PRIMARY KEY)")
        conn.execute("INSERT INTO kept VALUES (1), (2), (3)")
    before = connect(server.dsn, "skiplock-sut-s_restart-worker")
    try:
        ctx = FakeContext(dsn=server.dsn, server_owned=True,
                          restart=lambda: server.restart("immediate"))
        fault = make(RestartPostgres, ctx)
        assert fault.apply() == ["postgres"]
        fault.heal()
        print(f"restart_postgres: {fault.data['seconds']:.3f} s")
        assert not alive(before)
    finally:
        before.close()
    with connect(server.dsn, "skiplock-test-after") as conn:
        assert conn.execute("SELECT count(*) FROM kept").fetchone() == (3,)


def test_restart_postgres_is_skipped_on_a_server_not_owned() -> None:
    fault = make(RestartPostgres, FakeContext(dsn="postgresql://127.0.0.1:1/x"))
    with pytest.raises(FaultSkipped, match="server is external"):
        fault.apply()
