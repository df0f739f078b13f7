"""The reference queue on a real PostgreSQL, under real concurrency: several processes (via
`multiprocess`), each opening its own connections after it starts."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import multiprocess
import psycopg
import pytest
from psycopg import sql

from skiplock.queue_impl.interface import (
    Account,
    AttemptResult,
    JobStatus,
    NewJob,
    Outcome,
    QueueBackend,
    WriteResult,
)
from skiplock.queue_impl.pg import PgQueue
from skiplock.queue_impl.plugins import BackendSpec
from skiplock.queue_impl.sqlfile import SqlFileError
from skiplock.scenarios.bench.claim import plan_work

pytestmark = pytest.mark.integration

LEASE = timedelta(seconds=60)
PROCESSES = 4


def jobs_for(account: str, n: int, **kw: Any) -> list[NewJob]:
    return [
        NewJob(id=uuid.uuid4(), account_id=account, target_url="http://t/", payload={}, **kw)
        for _ in range(n)
    ]


@pytest.fixture
def queue(pg_dsn: str, fresh_schema: str) -> Iterator[PgQueue]:
    q = PgQueue(pg_dsn, schema=fresh_schema)
    q.setup()
    try:
        yield q
    finally:
        q.close()


def in_processes(target: Any, args: list[tuple[Any, ...]]) -> list[Any]:
    """Run `target` once per argument tuple, each call in its own process, all at once: each
    gets a barrier as its first argument, to pass once its connections are open, so that a
    slow process start cannot turn the race into a queue. Fork is fine here: each child
    builds its own queue from the spec and never touches the parent's connections."""
    ctx = multiprocess.get_context("fork")
    with ctx.Manager() as manager, ctx.Pool(len(args), initializer=_plain_child) as pool:
        barrier = manager.Barrier(len(args), timeout=60)
        result = pool.starmap_async(target, [(barrier, *a) for a in args])
        out: list[Any] = result.get(timeout=120)
        pool.close()
        pool.join()
    return out


def _plain_child() -> None:
    # A forked child must die on the pool's SIGTERM, whatever handler the parent installed.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def ready(queue: QueueBackend, barrier: Any) -> None:
    """Open the queue's connections (a cheap call), then wait for every other process."""
    queue.snapshot()
    barrier.wait()


# -- process bodies (each builds its queue from a picklable spec, inside the process) -------


def claim_until_empty(
    barrier: Any, spec: BackendSpec, worker: str, batch: int
) -> list[tuple[str, str]]:
    queue = spec.create()
    ready(queue, barrier)
    taken: list[tuple[str, str]] = []
    try:
        empty_rounds = 0
        # A few empty rounds in a row: with SKIP LOCKED an empty answer can mean "all locked".
        while empty_rounds < 3:
            leases = queue.claim(worker, batch, LEASE)
            empty_rounds = 0 if leases else empty_rounds + 1
            taken.extend((str(lease.job_id), str(lease.lease_token)) for lease in leases)
    finally:
        queue.close()
    return taken


def naive_claims(barrier: Any, spec: BackendSpec, worker: str, rounds: int) -> int:
    queue = spec.create()
    ready(queue, barrier)
    taken = 0
    try:
        for _ in range(rounds):
            try:
                taken += len(queue.claim(worker, 10, LEASE))
            except psycopg.errors.DeadlockDetected:
                # Also part of the anti-pattern: unordered updates of overlapping id sets.
                continue
    finally:
        queue.close()
    return taken


def recover_until_empty(barrier: Any, spec: BackendSpec) -> int:
    queue = spec.create()
    ready(queue, barrier)
    moved = 0
    try:
        assert isinstance(queue, PgQueue)
        queue.pin_clock(datetime.now(UTC) + 2 * LEASE)
        while (n := queue.recover(limit=7)) > 0:
            moved += n
    finally:
        queue.close()
    return moved


def claim_and_hold(
    barrier: Any, spec: BackendSpec, worker: str, hold_seconds: float
) -> list[tuple[str, float, float]]:
    """Claim, 'execute' for a moment, complete; record each job's held interval as seen by
    this process (inside the queue's own [claim commit, finish commit] window)."""
    queue = spec.create()
    ready(queue, barrier)
    intervals: list[tuple[str, float, float]] = []
    try:
        idle = 0
        while idle < 20:
            leases = queue.claim(worker, 4, LEASE)
            if not leases:
                idle += 1
                queue.wait_for_work(0.01)
                continue
            idle = 0
            start = time.monotonic()
            time.sleep(hold_seconds)  # stands in for the HTTP call
            end = time.monotonic()
            intervals.extend((lease.account_id, start, end) for lease in leases)
            written = queue.finish(
                [AttemptResult(lease=lease, outcome=Outcome.SUCCESS) for lease in leases]
            )
            assert all(w is WriteResult.APPLIED for w in written)
    finally:
        queue.close()
    return intervals


def setup_schema(barrier: Any, spec: BackendSpec) -> bool:
    queue = spec.create()
    barrier.wait()
    try:
        queue.setup()
    finally:
        queue.close()
    return True


# -- tests -----------------------------------------------------------------------------------


def test_concurrent_claimers_never_take_one_job_twice(
    queue: PgQueue, pg_dsn: str, fresh_schema: str
) -> None:
    jobs = jobs_for("a", 300) + jobs_for("b", 300)
    queue.enqueue(jobs)
    spec = BackendSpec(name="pg", dsn=pg_dsn, schema=fresh_schema)
    results = in_processes(claim_until_empty, [(spec, f"w{i}", 5) for i in range(PROCESSES)])
    claimed = [job_id for per_worker in results for job_id, _ in per_worker]
    assert len(claimed) == len(set(claimed)) == len(jobs)
    assert all(per_worker for per_worker in results), "every process should have claimed"
    assert {s.attempts for s in queue.snapshot()} == {1}
    assert len(queue.attempts_log()) == len(jobs)


def test_naive_variant_really_double_claims(queue: PgQueue, pg_dsn: str, fresh_schema: str) -> None:
    spec = BackendSpec(name="pg-naive", dsn=pg_dsn, schema=fresh_schema)
    doubled = 0
    for _ in range(5):  # bounded: a race, so give it a few rounds to show itself
        queue.enqueue(jobs_for("a", 400))
        in_processes(naive_claims, [(spec, f"w{i}", 15) for i in range(PROCESSES)])
        doubled = sum(1 for s in queue.snapshot() if s.attempts > 1)
        if doubled:
            break
    assert doubled > 0, "pg-naive should hand one job to two workers under concurrency"
    per_job: dict[uuid.UUID, set[str]] = defaultdict(set)
    for row in queue.attempts_log():
        per_job[row["job_id"]].add(row["worker"])
    assert any(len(workers) > 1 for workers in per_job.values())


def test_a_claim_never_received_is_given_back_and_its_attempts_row_says_so(
    queue: PgQueue,
) -> None:
    now = datetime.now(UTC)
    queue.pin_clock(now)
    [job] = jobs_for("a", 1, max_attempts=1)
    queue.enqueue([job])
    [ghost] = queue.claim("w", 1, LEASE)
    assert queue.guarantees.attempts_count == "received"
    queue.pin_clock(now + LEASE + timedelta(seconds=1))
    assert queue.recover() == 1
    [state] = queue.snapshot()
    assert (state.status, state.attempts) == (JobStatus.PENDING, 0)
    [row] = queue.attempts_log()
    assert (row["lease_token"], row["attempt"], row["outcome"]) == (
        ghost.lease_token, 1, "unreceived")
    [again] = queue.claim("w", 1, LEASE)
    assert again.attempt == 1 and queue.receive([again]) == [WriteResult.APPLIED]


def test_a_sql_file_with_its_own_schema_and_no_receive_keeps_counting_claims(
    pg_dsn: str, fresh_schema: str, tmp_path: Path
) -> None:
    """A file written before receipts (it replaces `schema`, defines no `receive`): no
    receipt is sent, every committed claim counts, and the queue says so."""
    from skiplock.queue_impl.sqlfile import reference_statements

    own = tmp_path / "own.sql"
    own.write_text("-- name: schema\n" + reference_statements()["schema"] + "\n")
    queue = PgQueue(pg_dsn, schema=fresh_schema, sql=own)
    try:
        queue.setup()
        queue.check_statements()
        assert not queue.receipts and queue.guarantees.attempts_count == "claims"
        now = datetime.now(UTC)
        queue.pin_clock(now)
        [job] = jobs_for("a", 1, max_attempts=1)
        queue.enqueue([job])
        [lease] = queue.claim("w", 1, LEASE)
        assert queue.receive([lease]) == [WriteResult.APPLIED]
        queue.pin_clock(now + LEASE + timedelta(seconds=1))
        assert queue.recover() == 1
        [state] = queue.snapshot()
        assert state.status is JobStatus.FAILED
    finally:
        queue.close()


def test_stale_completion_is_fenced_and_recorded(queue: PgQueue) -> None:
    now = datetime.now(UTC)
    queue.pin_clock(now)
    [job] = jobs_for("a", 1)
    queue.enqueue([job])
    [stale] = queue.claim("slow-worker", 1, LEASE)
    assert queue.receive([stale]) == [WriteResult.APPLIED]
    queue.pin_clock(now + LEASE + timedelta(seconds=1))
    assert queue.recover() == 1
    [fresh] = queue.claim("other-worker", 1, LEASE)
    assert fresh.attempt == 2
    assert queue.finish([AttemptResult(lease=stale, outcome=Outcome.SUCCESS)]) == [
        WriteResult.FENCED
    ]
    [fenced] = queue.fenced_log()
    assert fenced["job_id"] == job.id and fenced["worker"] == "slow-worker"
    assert fenced["attempt"] == 1 and fenced["operation"] == "finish"
    assert fenced["lease_token"] == stale.lease_token
    assert queue.finish([AttemptResult(lease=fresh, outcome=Outcome.SUCCESS, http_status=200)]) == [
        WriteResult.APPLIED
    ]
    attempts = queue.attempts_log()
    assert [(a["attempt"], a["worker"], a["outcome"]) for a in attempts] == [
        (1, "slow-worker", "lease_expired"),
        (2, "other-worker", "success"),
    ]
    assert attempts[1]["http_status"] == 200


def test_recovery_from_every_process_moves_each_lease_once(
    queue: PgQueue, pg_dsn: str, fresh_schema: str
) -> None:
    retry = jobs_for("a", 40, max_attempts=3)
    dead = jobs_for("a", 20, max_attempts=1)
    queue.enqueue(retry + dead)
    while leases := queue.claim("crashed", 25, LEASE):
        queue.receive(leases)
    spec = BackendSpec(name="pg", dsn=pg_dsn, schema=fresh_schema)
    moved = in_processes(recover_until_empty, [(spec,)] * PROCESSES)
    assert sum(moved) == 60
    states = {s.job_id: s for s in queue.snapshot()}
    assert all(states[j.id].status is JobStatus.RETRYING for j in retry)
    assert all(states[j.id].status is JobStatus.FAILED for j in dead)
    assert all("lease expired" in (states[j.id].last_error or "") for j in dead)
    outcomes = {a["outcome"] for a in queue.attempts_log()}
    assert outcomes == {"lease_expired"}


def test_account_limits_hold_across_processes(
    queue: PgQueue, pg_dsn: str, fresh_schema: str
) -> None:
    limits = {"two": 2, "three": 3}
    queue.upsert_accounts([Account(id=a, concurrency_limit=n) for a, n in limits.items()])
    queue.enqueue(jobs_for("two", 30) + jobs_for("three", 30) + jobs_for("free", 30))
    spec = BackendSpec(name="pg", dsn=pg_dsn, schema=fresh_schema)
    results = in_processes(claim_and_hold, [(spec, f"w{i}", 0.01) for i in range(PROCESSES)])
    intervals = [iv for per_worker in results for iv in per_worker]
    assert len(intervals) == 90
    for account, limit in limits.items():
        assert max_overlap([(s, e) for a, s, e in intervals if a == account]) <= limit
    assert {s.status for s in queue.snapshot()} == {JobStatus.COMPLETED}


def test_limits_changed_while_jobs_arrive_leave_every_job_on_its_accounts_side(
    queue: PgQueue, pg_dsn: str, fresh_schema: str
) -> None:
    """The claim reaches unlimited accounts' jobs through their own indexes, so each job's
    `limited` flag must follow its account whatever the interleaving: enqueues naming brand
    new accounts while the same accounts are created limited, and limits set and removed on
    accounts whose jobs keep arriving. Without the limits lock, a job of an account created
    limited while its enqueue ran was flagged unlimited, out of reach of the account's limit."""
    rounds = 60
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def enqueue() -> None:
        producer = PgQueue(pg_dsn, schema=fresh_schema)
        try:
            start.wait()
            for n in range(rounds):
                producer.enqueue(jobs_for(f"new-{n}", 3) + jobs_for(f"toggle-{n % 4}", 3))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)
        finally:
            producer.close()

    def change_limits() -> None:
        admin = PgQueue(pg_dsn, schema=fresh_schema)
        try:
            start.wait()
            for n in range(rounds):
                admin.upsert_accounts([
                    Account(id=f"new-{n}", concurrency_limit=1),
                    Account(id=f"toggle-{n % 4}", concurrency_limit=None if n % 2 else 2),
                ])
        except BaseException as exc:
            errors.append(exc)
        finally:
            admin.close()

    threads = [threading.Thread(target=enqueue), threading.Thread(target=change_limits)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        search_path(conn, fresh_schema)
        wrong = conn.execute(
            "SELECT j.account_id, j.limited, a.concurrency_limit FROM jobs AS j "
            "JOIN accounts AS a ON a.id = j.account_id "
            "WHERE j.limited <> (a.concurrency_limit IS NOT NULL)"
        ).fetchall()
        jobs = conn.execute("SELECT count(*) FROM jobs").fetchone()
    assert jobs == (rounds * 6,)
    assert wrong == []


def _run_aside(conn: psycopg.Connection[Any], statement: str,
               watch: psycopg.Connection[Any]) -> threading.Thread:
    """Run `statement` on `conn` (autocommit) in a thread, and return once it has finished
    or is waiting on a lock: whichever it does, it has done what it does before the wait."""
    pid = conn.info.backend_pid
    worker = threading.Thread(target=conn.execute, args=(statement,))
    worker.start()
    deadline = time.monotonic() + 30
    while (worker.is_alive() and time.monotonic() < deadline
           and not _waits_on_a_lock(watch, pid)):
        time.sleep(0.02)
    return worker


_INSERT_JOB = ("INSERT INTO jobs (id, account_id, target_url, payload) "
               "VALUES (gen_random_uuid(), %s, 'http://t/', '{}')")
_FLAGS = "SELECT DISTINCT limited FROM jobs WHERE account_id = %s"


def test_a_job_enqueued_as_its_account_is_created_limited_is_limited(
    queue: PgQueue, pg_dsn: str, fresh_schema: str
) -> None:
    """The account is created limited by a transaction still open when a job for it arrives:
    the job's insert waits for it and reads the limit (a plain read would not see the
    uncommitted account, take the job for an unlimited one's, and nothing would correct it)."""
    with (psycopg.connect(pg_dsn) as admin, psycopg.connect(pg_dsn, autocommit=True) as other,
          psycopg.connect(pg_dsn, autocommit=True) as watch):
        search_path(admin, fresh_schema)
        search_path(other, fresh_schema)
        admin.execute("INSERT INTO accounts (id, concurrency_limit) VALUES ('late', 2)")
        insert = _run_aside(other, _INSERT_JOB.replace("%s", "'late'"), watch)
        admin.commit()
        insert.join(timeout=30)
        assert not insert.is_alive()
        assert other.execute(_FLAGS, ["late"]).fetchall() == [(True,)]


def test_a_limit_set_while_an_enqueue_is_open_reaches_its_jobs(
    queue: PgQueue, pg_dsn: str, fresh_schema: str
) -> None:
    """An enqueue still open when the account's limit is set: the change waits for it, then
    marks its jobs (on a snapshot that did not see them, they would stay unlimited)."""
    queue.upsert_accounts([Account(id="shifting")])
    with (psycopg.connect(pg_dsn) as producer, psycopg.connect(pg_dsn, autocommit=True) as admin,
          psycopg.connect(pg_dsn, autocommit=True) as watch):
        search_path(producer, fresh_schema)
        search_path(admin, fresh_schema)
        producer.execute(_INSERT_JOB, ["shifting"])
        change = _run_aside(
            admin, "UPDATE accounts SET concurrency_limit = 3 WHERE id = 'shifting'", watch)
        producer.commit()
        change.join(timeout=30)
        assert not change.is_alive()
        assert admin.execute(_FLAGS, ["shifting"]).fetchall() == [(True,)]


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    # Ends sort before starts at the same instant: touching intervals do not overlap.
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    best = current = 0
    for _, step in events:
        current += step
        best = max(best, current)
    return best


def test_setup_from_many_processes_at_once(pg_dsn: str, fresh_schema: str) -> None:
    spec = BackendSpec(name="pg", dsn=pg_dsn, schema=fresh_schema)
    assert in_processes(setup_schema, [(spec,)] * PROCESSES) == [True] * PROCESSES


def test_notify_wakes_a_waiting_worker(queue: PgQueue, pg_dsn: str, fresh_schema: str) -> None:
    assert queue.wait_for_work(0.05) is False
    producer = PgQueue(pg_dsn, schema=fresh_schema)
    try:
        producer.enqueue(jobs_for("a", 2))
    finally:
        producer.close()
    assert queue.wait_for_work(30) is True


def test_enqueues_closer_than_the_notify_interval_send_one_notify(
    queue: PgQueue, pg_dsn: str, fresh_schema: str
) -> None:
    producer = PgQueue(pg_dsn, schema=fresh_schema)
    try:
        assert queue.wait_for_work(0.05) is False  # listening from here on
        for _ in range(5):
            producer.enqueue(jobs_for("a", 1))
        assert queue.wait_for_work(5) is True
        # The other four were within the interval of the first: no NOTIFY of their own.
        assert queue.wait_for_work(0.3) is False
        time.sleep(producer.notify_interval * 2)
        producer.enqueue(jobs_for("a", 1))
        assert queue.wait_for_work(5) is True
    finally:
        producer.close()


def test_lost_connection_is_reopened_on_the_next_call(queue: PgQueue, pg_dsn: str) -> None:
    queue.enqueue(jobs_for("a", 2))
    assert len(queue.claim("w", 1, LEASE)) == 1
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [queue.backend_pids()["lease"]])
    with pytest.raises(psycopg.OperationalError):
        queue.claim("w", 1, LEASE)
    assert len(queue.claim("w", 1, LEASE)) == 1


def test_long_tx_crash_rolls_the_claim_back(queue: PgQueue, pg_dsn: str, fresh_schema: str) -> None:
    queue.enqueue(jobs_for("a", 3))
    holder = PgQueue(pg_dsn, schema=fresh_schema, variant="pg-long-tx")
    assert len(holder.claim("w", 3, LEASE)) == 3
    # While the transaction is open, the claim is invisible and its rows are skipped.
    assert {s.status for s in queue.snapshot()} == {JobStatus.PENDING}
    assert queue.claim("other", 3, LEASE) == []
    session = holder.backend_pids()["lease"]
    holder.close()  # the process dies: its open transaction rolls back
    # The server ends that session (and releases its row locks) a moment after the socket
    # closes; until then a claim skips the rows it still locks.
    with psycopg.connect(pg_dsn, autocommit=True) as watch:
        deadline = time.monotonic() + 10
        while watch.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s",
                            [session]).fetchone() is not None:
            assert time.monotonic() < deadline, "the closed session never ended"
            time.sleep(0.01)
    assert {(s.status, s.attempts) for s in queue.snapshot()} == {(JobStatus.PENDING, 0)}
    assert len(queue.claim("other", 3, LEASE)) == 3


def test_team_sql_file_replaces_blocks(pg_dsn: str, fresh_schema: str, tmp_path: Path) -> None:
    path = tmp_path / "team.sql"
    path.write_text("-- name: recover\nSELECT 42 WHERE %(limit)s > 0;\n", encoding="utf-8")
    q = PgQueue(pg_dsn, schema=fresh_schema, sql=path)
    try:
        q.setup()
        assert q.recover() == 42
    finally:
        q.close()
    path.write_text("-- name: recover\nSELECT 1;\n", encoding="utf-8")
    with pytest.raises(SqlFileError, match="missing placeholder"):
        PgQueue(pg_dsn, schema=fresh_schema, sql=path)


def test_partial_indexes_serve_the_claim_and_recovery(queue: PgQueue, pg_dsn: str) -> None:
    """A realistic table: mostly finished jobs, a backlog of pending, some retrying and in
    flight. The planner picks each partial index on its own (no enable_seqscan=off)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(queue.schema)))
        conn.execute("INSERT INTO accounts (id, concurrency_limit) VALUES ('a', NULL), ('l', 5)")
        conn.execute(
            """
            INSERT INTO jobs (id, account_id, target_url, payload, status, run_at,
                next_attempt_at, attempts, locked_until, lease_token)
            SELECT gen_random_uuid(), CASE WHEN i % 10 = 0 THEN 'l' ELSE 'a' END, 'http://t/',
                '{}', s.status, now() - interval '1 minute' + (i % 600) * interval '1 second',
                CASE WHEN s.status = 'RETRYING' THEN now() + (i % 120) * interval '1 second' END,
                CASE WHEN s.status = 'PENDING' THEN 0 ELSE 1 END,
                CASE WHEN s.status = 'PROCESSING' THEN now() + (i % 60) * interval '1 second' END,
                CASE WHEN s.status = 'PROCESSING' THEN gen_random_uuid() END
            FROM generate_series(1, 40000) AS i
            CROSS JOIN LATERAL (SELECT CASE
                WHEN i % 100 < 80 THEN 'COMPLETED' WHEN i % 100 < 85 THEN 'FAILED'
                WHEN i % 100 < 93 THEN 'PENDING' WHEN i % 100 < 97 THEN 'RETRYING'
                ELSE 'PROCESSING' END AS status) AS s
            """
        )
        conn.execute("ANALYZE jobs")
        conn.execute("ANALYZE accounts")
    params = {"locked_accounts": ["l"], "batch": 10, "lease": LEASE, "worker_id": "w"}
    claim_plan = "\n".join(queue.explain("claim", params))
    for index in ("jobs_pending_by_account", "jobs_retrying_by_account",
                  "jobs_processing_account"):
        assert index in claim_plan, claim_plan
    assert "Seq Scan on jobs" not in claim_plan, claim_plan
    lock_plan = "\n".join(queue.explain("claim_lock_accounts", {"batch": 10}))
    assert "jobs_pending_by_account" in lock_plan, lock_plan
    assert "Seq Scan on jobs" not in lock_plan, lock_plan
    recover_plan = "\n".join(queue.explain("recover", {"limit": 100}))
    assert "jobs_processing_lease" in recover_plan, recover_plan
    assert "Seq Scan on jobs" not in recover_plan, recover_plan


def test_a_full_accounts_backlog_costs_the_claim_nothing(queue: PgQueue, pg_dsn: str) -> None:
    """The seeds' noisy neighbour: one account at its limit with 100k due jobs, older than
    everyone else's. A claim must take the other accounts' work without walking that
    backlog: the rows it filters out and the buffers it touches stay small, not ~100k rows
    and ~2k buffers as a walk of the global due index costs."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(queue.schema)))
        conn.execute("INSERT INTO accounts (id, concurrency_limit) "
                     "VALUES ('full', 2), ('open', 5), ('free', NULL)")
        conn.execute(
            """
            INSERT INTO jobs (id, account_id, target_url, payload, status, run_at, attempts,
                locked_until, lease_token)
            SELECT gen_random_uuid(), 'full', 'http://t/', '{}', 'PROCESSING',
                now() - interval '2 hours', 1, now() + interval '1 hour', gen_random_uuid()
            FROM generate_series(1, 2)
            """
        )
        conn.execute(
            """
            INSERT INTO jobs (id, account_id, target_url, payload, run_at)
            SELECT gen_random_uuid(), 'full', 'http://t/', '{}'::jsonb,
                now() - interval '1 hour' + i * interval '1 ms'
            FROM generate_series(1, 100000) AS i
            UNION ALL
            SELECT gen_random_uuid(), a, 'http://t/', '{}', now() - interval '1 minute'
            FROM unnest(ARRAY['open', 'free']) AS a, generate_series(1, 20)
            """
        )
        conn.execute("VACUUM ANALYZE jobs")
        conn.execute("ANALYZE accounts")
    locked = ["open"]
    params = {"locked_accounts": locked, "batch": 10, "lease": LEASE, "worker_id": "w"}
    plan = queue.explain_analyze("claim", params)
    removed, buffers = plan_work(plan["Plan"])
    assert plan["Plan"]["Actual Rows"] == 10, plan  # it did claim
    assert removed < 100, f"{removed} rows filtered out"
    # About 250 here: the claim's index probes and the UPDATE's index entries, a few levels
    # deep at 100k rows (a walk of the global due index touched over 2,000).
    assert buffers < 400, f"{buffers} buffers touched"
    lock_plan = queue.explain_analyze("claim_lock_accounts", {"batch": 10})
    removed, buffers = plan_work(lock_plan["Plan"])
    assert removed < 100, f"claim_lock_accounts filtered out {removed} rows"
    assert buffers < 200, f"claim_lock_accounts touched {buffers} buffers"


def test_many_unlimited_accounts_cost_the_claim_nothing(queue: PgQueue, pg_dsn: str) -> None:
    """1,000 unlimited accounts with due work: the claim reads the head of the global due
    index, not every account's own stretch of it (reading four batches of each account, a
    claim of 10 touched 4,251 buffers here and took 36 ms)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(queue.schema)))
        conn.execute("INSERT INTO accounts (id) SELECT 'a' || g FROM generate_series(1, 1000) g")
        conn.execute(
            """
            INSERT INTO jobs (id, account_id, target_url, payload, run_at)
            SELECT gen_random_uuid(), 'a' || (1 + g % 1000), 'http://t/', '{}',
                now() - interval '1 hour' + g * interval '1 ms'
            FROM generate_series(1, 20000) AS g
            """
        )
        conn.execute("VACUUM ANALYZE jobs")
        conn.execute("ANALYZE accounts")
    params = {"locked_accounts": [], "batch": 10, "lease": LEASE, "worker_id": "w"}
    plan = queue.explain_analyze("claim", params)
    _, buffers = plan_work(plan["Plan"])
    assert plan["Plan"]["Actual Rows"] == 10, plan
    assert buffers < 400, f"{buffers} buffers touched"
    # And they are the oldest ten due jobs, as the per-account reading would have taken.
    claimed = queue.claim("w", 10, LEASE)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(queue.schema)))
        oldest = {row[0] for row in conn.execute(
            "SELECT id FROM jobs WHERE status = 'PENDING' OR lease_token IS NOT NULL "
            "ORDER BY run_at, id LIMIT 10")}
    assert {lease.job_id for lease in claimed} == oldest


def test_a_long_due_retry_backlog_costs_the_account_lock_step_nothing(
        queue: PgQueue, pg_dsn: str) -> None:
    """20k due RETRYING jobs of one limited account (a target that was down): choosing the
    accounts to lock probes each account's retrying index once, instead of reading every due
    retry to find each account's oldest (found by `skiplock plans`: 50k buffers a claim at
    50k due retries)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(queue.schema)))
        conn.execute("INSERT INTO accounts (id, concurrency_limit) "
                     "VALUES ('down', 4), ('open', 5)")
        conn.execute(
            """
            INSERT INTO jobs (id, account_id, target_url, payload, status, run_at, attempts,
                next_attempt_at)
            SELECT gen_random_uuid(), 'down', 'http://t/', '{}'::jsonb, 'RETRYING',
                now() - interval '1 hour', 1, now() - interval '1 minute' + i * interval '1 ms'
            FROM generate_series(1, 20000) AS i
            """
        )
        conn.execute("INSERT INTO jobs (id, account_id, target_url, payload, run_at) "
                     "SELECT gen_random_uuid(), 'open', 'http://t/', '{}', now() "
                     "FROM generate_series(1, 20)")
        conn.execute("ANALYZE jobs")
        conn.execute("ANALYZE accounts")
    lock_plan = queue.explain_analyze("claim_lock_accounts", {"batch": 10})
    assert lock_plan["Plan"]["Actual Rows"] == 2, lock_plan  # both accounts have due work
    removed, buffers = plan_work(lock_plan["Plan"])
    assert removed < 100, f"claim_lock_accounts filtered out {removed} rows"
    # About 15 here; reading every due retry touched about 300 at this size.
    assert buffers < 60, f"claim_lock_accounts touched {buffers} buffers"


def test_a_claim_leaves_unlimited_accounts_work_for_a_concurrent_claimer(
    queue: PgQueue, pg_dsn: str, fresh_schema: str
) -> None:
    """50 unlimited accounts with 5 due jobs each, and a claim of 10 held open: a second
    claim at the same time still gets 10. (A claim that locked every account's share
    would hold 250 rows until its COMMIT, and the second would find nothing.)"""
    queue.upsert_accounts([Account(id=f"u{i:02}") for i in range(50)])
    queue.enqueue([job for i in range(50) for job in jobs_for(f"u{i:02}", 5)])
    with psycopg.connect(pg_dsn) as holder:
        holder.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(fresh_schema)))
        statements = queue._statements
        params = {"batch": 10, "lease": LEASE, "worker_id": "holder"}
        locked = [r[0] for r in holder.execute(statements["claim_lock_accounts"], params)]
        held = holder.execute(statements["claim"], {**params, "locked_accounts": locked})
        assert len(held.fetchall()) == 10
        other = PgQueue(pg_dsn, schema=fresh_schema)
        try:
            assert len(other.claim("second", 10, LEASE)) == 10
        finally:
            other.close()
        holder.rollback()


def test_for_update_variant_waits_where_the_reference_skips(
    queue: PgQueue, pg_dsn: str, fresh_schema: str
) -> None:
    now = datetime.now(UTC)
    first, second = (
        NewJob(id=uuid.uuid4(), account_id="a", target_url="http://t/", payload={}, run_at=at)
        for at in (now - timedelta(seconds=2), now - timedelta(seconds=1))
    )
    queue.enqueue([first, second])
    waiting = PgQueue(pg_dsn, schema=fresh_schema, variant="pg-for-update")
    got: list[uuid.UUID] = []
    claimer = threading.Thread(
        target=lambda: got.extend(lease.job_id for lease in waiting.claim("w2", 1, LEASE))
    )
    with psycopg.connect(pg_dsn) as holder, psycopg.connect(pg_dsn, autocommit=True) as watch:
        holder.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(fresh_schema)))
        holder.execute("SELECT id FROM jobs WHERE id = %s FOR UPDATE", [first.id])
        # The reference skips the locked row and takes the next one at once.
        assert [lease.job_id for lease in queue.claim("w1", 1, LEASE)] == [second.id]
        claimer.start()
        try:
            deadline = time.monotonic() + 30
            blocked = False
            while not blocked and time.monotonic() < deadline:
                pid = waiting.backend_pids().get("lease")
                row = watch.execute(
                    "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid]
                ).fetchone()
                blocked = row is not None and row[0] == "Lock"
                if not blocked:
                    time.sleep(0.02)
            assert blocked, "the FOR UPDATE claim should wait for the locked row"
            assert got == []
        finally:
            holder.commit()
            claimer.join(timeout=30)
            waiting.close()
    assert got == [first.id]


def _waits_on_a_lock(watch: psycopg.Connection[Any], pid: int | None) -> bool:
    row = watch.execute(
        "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid]
    ).fetchone()
    return row is not None and row[0] == "Lock"


def wait_until_blocked(queue: PgQueue, watch: psycopg.Connection[Any]) -> None:
    """Bounded poll until the queue's lease connection waits on a lock."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if _waits_on_a_lock(watch, queue.backend_pids().get("lease")):
            return
        time.sleep(0.02)
    raise AssertionError("the queue's statement never waited on the lock")


def search_path(conn: psycopg.Connection[Any], schema: str) -> None:
    conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))


def test_schema_refuses_a_non_http_url_even_on_an_old_schema(
    queue: PgQueue, pg_dsn: str, fresh_schema: str
) -> None:
    insert = (
        "INSERT INTO jobs (id, account_id, target_url, payload) "
        "VALUES (gen_random_uuid(), 'a', %s, '{}')"
    )
    queue.upsert_accounts([Account(id="a")])
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        search_path(conn, fresh_schema)
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(insert, ["ftp://t/"])
        # A schema from before the check: setup() adds it, and again is a no-op.
        conn.execute("ALTER TABLE jobs DROP CONSTRAINT jobs_target_url_http")
        conn.execute(insert, ["javascript:alert(1)"])
    queue.setup()
    queue.setup()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        search_path(conn, fresh_schema)
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(insert, ["ftp://t/"])
        conn.execute(insert, ["HTTPS://t/"])


def test_the_autocommit_lease_session_reads_committed_whatever_the_default(
        pg_dsn: str, fresh_schema: str) -> None:
    """The lease session is autocommit (a receipt or a result write is one statement, one
    round trip): its lone statements and the claim's own BEGIN run READ COMMITTED, not the
    DSN's default, so a write racing recovery re-checks the row instead of failing."""
    from skiplock.queue_impl.pg import Role, _begin

    rr_dsn = psycopg.conninfo.make_conninfo(
        pg_dsn, options=r"-c default_transaction_isolation=repeatable\ read")
    queue = PgQueue(rr_dsn, schema=fresh_schema)
    try:
        queue.setup()
        conn = queue._conn(Role.LEASE)
        assert conn.autocommit
        assert conn.execute("SHOW transaction_isolation").fetchone() == {
            "transaction_isolation": "read committed"}
        _begin(conn)
        assert conn.execute("SHOW transaction_isolation").fetchone() == {
            "transaction_isolation": "read committed"}
        conn.rollback()
    finally:
        queue.close()


@pytest.mark.parametrize("variant", ["pg", "pg-for-update", "pg-long-tx", "pg-naive"])
def test_claims_work_when_the_server_defaults_to_repeatable_read(
    pg_dsn: str, fresh_schema: str, variant: str
) -> None:
    """The claim's limit proof needs READ COMMITTED (step 2's fresh snapshot); the queue sets
    it on its own connections, whatever the DSN or server default says."""
    rr_dsn = psycopg.conninfo.make_conninfo(
        pg_dsn, options=r"-c default_transaction_isolation=repeatable\ read"
    )
    queue = PgQueue(rr_dsn, schema=fresh_schema, variant=variant)  # type: ignore[arg-type]
    queue.setup()
    queue.upsert_accounts([Account(id="one", concurrency_limit=1)])
    now = datetime.now(UTC)
    first, second = (
        NewJob(id=uuid.uuid4(), account_id="one", target_url="http://t/", payload={}, run_at=at)
        for at in (now - timedelta(seconds=2), now - timedelta(seconds=1))
    )
    queue.enqueue([first, second])
    got: list[uuid.UUID] = []
    errors: list[BaseException] = []

    def claim() -> None:
        try:
            got.extend(lease.job_id for lease in queue.claim("w", 2, LEASE))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    try:
        with psycopg.connect(pg_dsn) as holder, psycopg.connect(pg_dsn, autocommit=True) as watch:
            search_path(holder, fresh_schema)
            # Another claimer's transaction: it holds the account and has just taken `first`.
            holder.execute("SELECT id FROM accounts WHERE id = 'one' FOR NO KEY UPDATE")
            holder.execute(
                "UPDATE jobs SET status = 'PROCESSING', attempts = 1, lease_token = "
                "gen_random_uuid(), locked_until = now() + interval '1 hour' WHERE id = %s",
                [first.id],
            )
            if variant == "pg-for-update":
                claimer = threading.Thread(target=claim)
                claimer.start()
                try:
                    wait_until_blocked(queue, watch)
                finally:
                    holder.commit()
                    claimer.join(timeout=30)
            else:
                holder.commit()
                claim()
        assert errors == []
        if variant == "pg-naive":
            assert got == [second.id]  # no limits, no locks: only that it runs at all
        else:
            # The account's one slot is taken: nothing more may be claimed for it.
            assert got == []
        assert {s.job_id: s.status for s in queue.snapshot()}[first.id] is JobStatus.PROCESSING
    finally:
        queue.close()


def test_a_lease_starts_when_the_row_is_taken_not_when_the_claim_began(
    queue: PgQueue, pg_dsn: str, fresh_schema: str
) -> None:
    [job] = jobs_for("a", 1)
    queue.enqueue([job])
    waiting = PgQueue(pg_dsn, schema=fresh_schema, variant="pg-for-update")
    got: list[datetime] = []
    claimer = threading.Thread(
        target=lambda: got.extend(lease.locked_until for lease in waiting.claim("w", 1, LEASE))
    )
    try:
        with psycopg.connect(pg_dsn) as holder, psycopg.connect(pg_dsn, autocommit=True) as watch:
            search_path(holder, fresh_schema)
            holder.execute("SELECT id FROM jobs WHERE id = %s FOR UPDATE", [job.id])
            claimer.start()
            try:
                wait_until_blocked(waiting, watch)
                row = holder.execute("SELECT clock_timestamp()").fetchone()
                assert row is not None
                released_at: datetime = row[0]
            finally:
                holder.commit()
                claimer.join(timeout=30)
    finally:
        waiting.close()
    # The claim statement began before the wait; the lease is counted from after it.
    assert got and got[0] >= released_at + LEASE


def test_finish_locks_its_rows_in_id_order_whatever_the_batch_order(
    queue: PgQueue, pg_dsn: str, fresh_schema: str
) -> None:
    """Two overlapping batches written in opposite orders cannot deadlock when every writer
    takes its row locks in id order: shown by the lower id being locked while the statement
    waits on the higher one, although the batch names the higher one first."""
    low_job, high_job = sorted(jobs_for("a", 2), key=lambda j: j.id)
    # The higher id first on disk too, so neither a scan of the table nor of the batch would
    # reach the lower one first by accident.
    queue.enqueue([high_job])
    queue.enqueue([low_job])
    low, high = sorted(queue.claim("w", 2, LEASE), key=lambda lease: lease.job_id)
    results: list[WriteResult] = []
    writer = PgQueue(pg_dsn, schema=fresh_schema)
    finisher = threading.Thread(
        target=lambda: results.extend(
            writer.finish(
                [AttemptResult(lease=lease, outcome=Outcome.SUCCESS) for lease in (high, low)]
            )
        )
    )
    try:
        with (
            psycopg.connect(pg_dsn) as holder,
            psycopg.connect(pg_dsn) as probe,
            psycopg.connect(pg_dsn, autocommit=True) as watch,
        ):
            search_path(holder, fresh_schema)
            search_path(probe, fresh_schema)
            holder.execute("SELECT id FROM jobs WHERE id = %s FOR UPDATE", [high.job_id])
            writer.snapshot()  # opens its connections before the race
            finisher.start()
            try:
                wait_until_blocked(writer, watch)
                with pytest.raises(psycopg.errors.LockNotAvailable):
                    probe.execute(
                        "SELECT id FROM jobs WHERE id = %s FOR UPDATE NOWAIT", [low.job_id]
                    )
                probe.rollback()
            finally:
                holder.commit()
                finisher.join(timeout=30)
    finally:
        writer.close()
    assert results == [WriteResult.APPLIED, WriteResult.APPLIED]


def test_a_claim_locks_no_more_accounts_than_it_can_use(
    queue: PgQueue, pg_dsn: str, fresh_schema: str
) -> None:
    """While one claimer's transaction holds the accounts it locked, another claimer still
    finds a limited account to serve: the first locked one account for its batch of one, not
    every account with due work."""
    now = datetime.now(UTC)
    queue.upsert_accounts([Account(id=a, concurrency_limit=3) for a in ("x", "y")])
    queue.enqueue(
        [
            NewJob(id=uuid.uuid4(), account_id=a, target_url="http://t/", payload={}, run_at=at)
            for a, at in (("x", now - timedelta(seconds=2)), ("y", now - timedelta(seconds=1)))
        ]
    )
    holder = PgQueue(pg_dsn, schema=fresh_schema, variant="pg-long-tx")
    try:
        # The long-transaction variant keeps its claim, account locks included, open.
        assert [lease.account_id for lease in holder.claim("w1", 1, LEASE)] == ["x"]
        assert [lease.account_id for lease in queue.claim("w2", 1, LEASE)] == ["y"]
    finally:
        holder.close()


def _row_xmins(pg_dsn: str, schema: str) -> dict[uuid.UUID, int]:
    """Each job row's creating transaction (xmin) as it stands."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        rows = conn.execute(
            sql.SQL("SELECT id, xmin::text::bigint FROM {}.jobs").format(sql.Identifier(schema))
        ).fetchall()
    return {row[0]: row[1] for row in rows}


@pytest.mark.parametrize("hooked", [False, True], ids=["one-trip", "hook-in-claim"])
def test_finish_and_claim_commits_once_where_the_claim_is_one_trip(
    queue: PgQueue, pg_dsn: str, fresh_schema: str, hooked: bool
) -> None:
    """The finished row and the newly claimed one are written by one transaction (one
    xmin); with a hook inside the claim's transaction, finish and claim go one after the
    other, two transactions, with the same answers."""
    if hooked:
        queue.claim_commit_hook = lambda: None
    assert queue.one_transaction is not hooked
    done, nxt = jobs_for("a", 1), jobs_for("a", 1)
    queue.enqueue(done)
    [held] = queue.claim("w", 1, LEASE)
    queue.receive([held])
    queue.enqueue(nxt)
    written, leases = queue.finish_and_claim(
        [AttemptResult(lease=held, outcome=Outcome.SUCCESS, http_status=200)], "w", 1, LEASE)
    assert written == [WriteResult.APPLIED]
    assert [lease.job_id for lease in leases] == [nxt[0].id]
    xmins = _row_xmins(pg_dsn, fresh_schema)
    same = xmins[done[0].id] == xmins[nxt[0].id]
    assert same is not hooked
