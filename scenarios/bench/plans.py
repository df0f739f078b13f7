"""The work behind `skiplock plans`: the claim's cost as the jobs table grows and bloats.

One schema's jobs table is grown in steps, each size reached by adding rows to the last (so
the whole fill is the largest size once), always with the same mix: mostly COMPLETED and
FAILED history, a due PENDING backlog, RETRYING jobs due now and due tomorrow, live leases,
and a few leases already expired (a crashed worker's) so that recovery has work. Five
accounts share it; one (`full`) is at its concurrency limit with the oldest and longest due
backlog, the seeds' noisy neighbour. Every fill is one set-based INSERT ... SELECT over
generate_series, into ordinary logged tables, under the server's own commit settings.

At each size the queue's claim (both statements: `claim_lock_accounts`, then `claim`), its
recovery (`recover`) and its result write (`finish`, on jobs just claimed) run under
`EXPLAIN (ANALYZE, BUFFERS)`, each rolled back so that every measurement sees the same table,
and the claim is also timed over several runs. Four variants of the same table:

- `partial`: the queue's indexes as its `schema` block made them (the reference's partial
  indexes: each scan reads only the rows of its status);
- `plain`: each partial index replaced by the same index without its WHERE clause, so every
  scan also passes the history of its account or time range;
- `bloated`: another session holds a REPEATABLE READ snapshot open (an idle transaction, a
  long report) while claims and result writes churn the oldest due jobs: every row version
  they leave behind must be kept for that snapshot, and the claim walks over them;
- `vacuumed`: the snapshot released and the table vacuumed: the garbage is gone.

Autovacuum is off on the table throughout, so the bloat measured is the bloat made here.
"""

from __future__ import annotations

import math
import os
import re
import socket
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import psycopg
from psycopg import IsolationLevel, sql

from skiplock.plumbing.errors import HarnessError
from skiplock.queue_impl.pg import apply_plan_settings
from skiplock.queue_impl.plugins import scrub
from skiplock.scenarios.bench.claim import (
    claim,
    claim_params,
    create_schema,
    explain_analyze,
    lock_accounts,
    plan_work,
)
from skiplock.scenarios.bench.queue import drop_schemas
from skiplock.scenarios.servers.postgres import fresh_database

SCHEMA_PREFIX = "skiplock_plans"
# Every session this command opens says so in pg_stat_activity.
APPLICATION_NAME = "skiplock-plans"

Variant = Literal["partial", "plain", "bloated", "vacuumed"]
VARIANTS: tuple[Variant, ...] = ("partial", "plain", "bloated", "vacuumed")

# The dispatcher's recovery batch (PgQueue.recover).
RECOVER_LIMIT = 100
# The timed claims of one variant stop after this long (having run at least MIN_CLAIM_RUNS):
# a claim over plain indexes at 10M jobs takes seconds.
CLAIM_BUDGET_SECONDS = 15.0
MIN_CLAIM_RUNS = 3
# Churn for the bloated variant: a tenth of the table, at most this many jobs, in rounds as
# claims and result writes would make it (the seeds measured 589k dead tuples).
CHURN_DIVISOR = 10
CHURN_CAP = 200_000
CHURN_ROUNDS = 4
# Each churned job leaves this many dead versions: as PENDING, as PROCESSING, as COMPLETED.
DEAD_VERSIONS_PER_CHURNED_JOB = 3
# Session settings only, for VACUUM and the plain variant's index builds; nothing durable.
SESSION_SETTINGS = {"maintenance_work_mem": "256MB"}
STATUSES = ("COMPLETED", "FAILED", "PENDING", "RETRYING", "PROCESSING")


@dataclass(frozen=True, kw_only=True)
class Account:
    id: str
    limit: int | None  # None: unlimited
    in_flight: int  # live leases it holds at every size


ACCOUNTS = (
    Account(id="full", limit=8, in_flight=8),
    Account(id="limited-small", limit=4, in_flight=1),
    Account(id="limited-large", limit=32, in_flight=10),
    Account(id="unlimited-a", limit=None, in_flight=0),
    Account(id="unlimited-b", limit=None, in_flight=0),
)
FULL_ACCOUNTS = tuple(a.id for a in ACCOUNTS if a.limit is not None and a.in_flight >= a.limit)
UNLIMITED = tuple(a.id for a in ACCOUNTS if a.limit is None)
EVERYONE = tuple(a.id for a in ACCOUNTS)
NOT_FULL = tuple(a for a in EVERYONE if a not in FULL_ACCOUNTS)


@dataclass(frozen=True, kw_only=True)
class Segment:
    """Rows of one kind: how many (`per_10k` of the table, plus `fixed` rows at every size;
    `per_10k` None: whatever the other segments leave), the accounts they are dealt to in
    turn, and their times relative to the fill: run_at is `due` ago minus up to `spread`;
    next_attempt_at and locked_until are `retry_in` / `lease_in` from now plus up to an hour
    (None: NULL)."""

    name: str
    status: str
    per_10k: int | None
    fixed: int = 0
    accounts: tuple[str, ...]
    due: timedelta
    spread: timedelta
    retry_in: timedelta | None = None
    lease_in: timedelta | None = None
    attempts: int = 0
    error: str | None = None
    finished: bool = False


HOUR, DAY = timedelta(hours=1), timedelta(days=1)
SEGMENTS = (
    # The history: a month of finished jobs, older than every due job but the full account's.
    Segment(name="completed", status="COMPLETED", per_10k=None, accounts=EVERYONE,
            due=DAY, spread=29 * DAY, attempts=1, finished=True),
    Segment(name="failed", status="FAILED", per_10k=400, accounts=EVERYONE, due=DAY,
            spread=29 * DAY, attempts=3, error="HTTP 503", finished=True),
    # The full account's backlog is the oldest due work: a walk from the oldest due job
    # meets all of it first.
    Segment(name="pending_full", status="PENDING", per_10k=400, accounts=FULL_ACCOUNTS,
            due=2 * DAY, spread=DAY),
    Segment(name="pending", status="PENDING", per_10k=400, accounts=NOT_FULL,
            due=timedelta(minutes=1), spread=DAY),
    Segment(name="retrying_due", status="RETRYING", per_10k=50, accounts=EVERYONE, due=DAY,
            spread=DAY, retry_in=-2 * HOUR, attempts=1, error="HTTP 503"),
    Segment(name="retrying_later", status="RETRYING", per_10k=50, accounts=EVERYONE, due=DAY,
            spread=DAY, retry_in=DAY, attempts=1, error="HTTP 503"),
    # Live leases outlast any run of this command; expired ones are recovery's work.
    Segment(name="leased", status="PROCESSING", per_10k=18, accounts=UNLIMITED, due=HOUR,
            spread=HOUR, lease_in=6 * HOUR, attempts=1),
    Segment(name="expired", status="PROCESSING", per_10k=2, accounts=UNLIMITED, due=HOUR,
            spread=HOUR, lease_in=-2 * HOUR, attempts=1),
    Segment(name="limited_in_flight", status="PROCESSING", per_10k=0,
            fixed=sum(a.in_flight for a in ACCOUNTS),
            accounts=tuple(a.id for a in ACCOUNTS for _ in range(a.in_flight)), due=HOUR,
            spread=HOUR, lease_in=6 * HOUR, attempts=1),
)
# A smaller table is little more than the fixed leases, and the planner reads it whole.
MIN_SIZE = 1_000


def planned_rows(size: int) -> dict[str, int]:
    """Rows of each segment in a table of `size` jobs; they add up to `size` exactly."""
    if size == 0:
        return {s.name: 0 for s in SEGMENTS}
    rows = {s.name: size * s.per_10k // 10_000 + s.fixed
            for s in SEGMENTS if s.per_10k is not None}
    rest = size - sum(rows.values())
    return {s.name: rows.get(s.name, rest) for s in SEGMENTS}


def planned_statuses(size: int) -> dict[str, int]:
    rows = planned_rows(size)
    by_status = dict.fromkeys(STATUSES, 0)
    for segment in SEGMENTS:
        by_status[segment.status] += rows[segment.name]
    return by_status


# One statement for every segment of a fill step: each segment's parameters as aligned
# arrays, its rows numbered 1..n by generate_series and dealt to its accounts in turn.
_FILL = """
INSERT INTO jobs (id, account_id, target_url, payload, status, run_at, next_attempt_at,
    attempts, locked_until, lease_token, locked_by, last_error, created_at, finished_at)
SELECT gen_random_uuid(), r.names[1 + mod(r.i, cardinality(r.names))],
    'http://127.0.0.1:9/deliver', jsonb_build_object('n', r.i), r.status, r.run_at,
    now() + r.retry_in + random() * interval '1 hour', r.attempts,
    now() + r.lease_in + random() * interval '1 hour',
    CASE WHEN r.lease_in IS NOT NULL THEN gen_random_uuid() END,
    CASE WHEN r.lease_in IS NOT NULL THEN 'worker-' || mod(r.i, 8) END,
    r.error, r.run_at, CASE WHEN r.finished THEN r.run_at + interval '2 seconds' END
FROM (
    SELECT g.i, a.names, s.status, s.retry_in, s.lease_in, s.attempts, s.error, s.finished,
        now() - s.due - random() * s.spread AS run_at
    FROM unnest(%(counts)s::integer[], %(accounts)s::text[], %(statuses)s::text[],
        %(dues)s::interval[], %(spreads)s::interval[], %(retry_ins)s::interval[],
        %(lease_ins)s::interval[], %(attempts)s::integer[], %(errors)s::text[],
        %(finished)s::boolean[])
        AS s (n, accounts, status, due, spread, retry_in, lease_in, attempts, error, finished)
    CROSS JOIN LATERAL (SELECT string_to_array(s.accounts, ',')) AS a (names)
    CROSS JOIN LATERAL generate_series(1, s.n) AS g (i)
) AS r
"""

# Every job in flight has its open attempt, as a claim leaves it (recovery closes it).
_OPEN_ATTEMPTS = """
INSERT INTO job_attempts (lease_token, job_id, attempt, worker, started_at)
SELECT lease_token, id, attempts, locked_by, now()
FROM jobs
WHERE status = 'PROCESSING'
ON CONFLICT (lease_token) DO NOTHING
"""


@dataclass(frozen=True, kw_only=True)
class Fill:
    size: int
    added: int
    seconds: float  # the INSERTs
    vacuum_seconds: float  # the VACUUM (ANALYZE) after them
    statuses: dict[str, int]  # counted in the table afterwards
    accounts: dict[str, dict[str, int]]  # account -> status -> jobs


@dataclass(frozen=True, kw_only=True)
class Cost:
    """One measured statement (or the claim's two, added up), from its executed plan."""

    jobs: int  # claimed, recovered or finished
    execution_ms: float
    buffers: int  # shared hit + read
    rows_removed: int  # by filters, over every node

    def per_job(self, figure: float) -> float | None:
        return figure / self.jobs if self.jobs else None


@dataclass(frozen=True, kw_only=True)
class Measurement:
    size: int
    variant: Variant
    setup: str  # how the variant was made
    setup_seconds: float  # making it: the index swap, the churn or the VACUUM
    claimed: int
    claim_p50_ms: float  # wall time of the claim's two statements, round trips included
    claim_runs: int
    claim: Cost  # its two statements' plans, added up
    lock: Cost  # of which the first, claim_lock_accounts
    recover: Cost
    finish: Cost | None  # None when the claim took nothing
    dead_row_versions: int  # made by the churn for the bloated variant, not yet vacuumed
    plans: dict[str, Any] = field(repr=False)  # block -> its EXPLAIN JSON, as PostgreSQL gave it

    @property
    def ms_per_claimed_job(self) -> float | None:
        return self.claim_p50_ms / self.claimed if self.claimed else None

    @property
    def buffers_per_claimed_job(self) -> float | None:
        return self.claim.per_job(self.claim.buffers)


@dataclass(frozen=True, kw_only=True)
class Result:
    database: str
    schema: str
    isolation: str  # where it measured, and what that means for VACUUM
    fills: list[Fill]
    measurements: list[Measurement]


Say = Callable[[str], None]


def _owner_note() -> str:
    """Who made a plans database: kept as its comment, so a later run can tell one whose
    plans was killed (its process gone) from one still being set up."""
    return f"skiplock plans: host={socket.gethostname()} pid={os.getpid()}"


def _abandoned(comment: str | None) -> bool:
    match = re.fullmatch(r"skiplock plans: host=(?P<host>\S+) pid=(?P<pid>\d+)", comment or "")
    if match is None or match["host"] != socket.gethostname():
        return False  # made elsewhere, or not yet marked: not ours to judge
    try:
        os.kill(int(match["pid"]), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def drop_abandoned_databases(dsn: str) -> int:
    """Drop the databases of earlier plans runs on this host whose process is gone and
    nobody is connected to (a plans killed with SIGKILL could not drop its own). Returns
    how many were dropped; 0 where this role may not look or drop."""
    dropped = 0
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            rows = conn.execute(
                "SELECT datname, shobj_description(oid, 'pg_database') FROM pg_database d"
                " WHERE datname LIKE %s AND NOT EXISTS"
                " (SELECT FROM pg_stat_activity a WHERE a.datname = d.datname)",
                [SCHEMA_PREFIX + "\\_%"]).fetchall()
            names = [str(name) for name, comment in rows if _abandoned(comment)]
            for name in names:
                # Without FORCE: a plans that connected since the query above keeps its own.
                with suppress(psycopg.Error):
                    conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(
                        sql.Identifier(name)))
                    dropped += 1
    except psycopg.Error:
        return dropped
    return dropped


def _prepare(conn: psycopg.Connection[Any], schema: str, statements: dict[str, str]) -> None:
    """The session as the queue's own, the schema with the queue's tables, the accounts."""
    # The queue runs its statements in READ COMMITTED (sqlfile's contract).
    conn.isolation_level = IsolationLevel.READ_COMMITTED
    for name, value in SESSION_SETTINGS.items():
        conn.execute("SELECT set_config(%s, %s, false)", (name, value))
    if conn.info.server_version >= 140000:
        # A plans killed with SIGKILL cannot cancel its INSERT of millions of rows; the
        # server then notices the closed socket within a second and stops the statement,
        # instead of writing gigabytes for nobody.
        conn.execute("SELECT set_config('client_connection_check_interval', '1s', false)")
    create_schema(conn, schema, statements)
    # Planned as the queue's own connections plan it: once, generically.
    apply_plan_settings(conn)
    # The bloated variant measures the garbage made here, not what autovacuum left.
    conn.execute("ALTER TABLE jobs SET (autovacuum_enabled = off)")
    conn.execute("INSERT INTO accounts (id, concurrency_limit) "
                 "SELECT * FROM unnest(%s::text[], %s::integer[])",
                 ([a.id for a in ACCOUNTS], [a.limit for a in ACCOUNTS]))


def measure_sizes(dsn: str, statements: dict[str, str], sizes: tuple[int, ...], *, batch: int,
                  repeat: int, say: Say) -> Result:
    """Grow one table through `sizes` (increasing) and measure the four variants at each.

    It all happens in a database of its own when the role may create one: VACUUM can remove
    only what no snapshot in the same database may still see, so a transaction another
    client holds open there would leave garbage in the `vacuumed` table. Without CREATEDB it
    uses the given database, in a schema of its own, and says so. The database (or schema)
    is dropped afterwards, however this ends, Ctrl-C included."""
    schema = f"{SCHEMA_PREFIX}_{uuid.uuid4().hex[:8]}"
    fills: list[Fill] = []
    measurements: list[Measurement] = []
    try:
        with ExitStack() as cleanup:
            left = drop_abandoned_databases(dsn)
            if left:
                say(f"removed {left} database(s) an earlier plans left when it was killed")
            try:
                run_dsn = cleanup.enter_context(fresh_database(dsn, prefix=SCHEMA_PREFIX))
                with psycopg.connect(run_dsn, autocommit=True) as conn:
                    conn.execute(sql.SQL("COMMENT ON DATABASE {} IS {}").format(
                        sql.Identifier(str(conn.info.dbname)), sql.Literal(_owner_note())))
                isolation = ("a database of its own (no other client's snapshot can hold back "
                             "its VACUUM), dropped at the end")
            except psycopg.errors.InsufficientPrivilege:
                run_dsn = dsn
                isolation = ("schema " + schema + " of the given database, dropped at the end "
                             "(no CREATEDB privilege: a transaction another client holds open "
                             "in this database can keep garbage VACUUM would remove)")
                cleanup.callback(drop_schemas, dsn, [schema])
            say(f"measuring in {isolation}")
            with psycopg.connect(run_dsn, autocommit=True,
                                 application_name=APPLICATION_NAME) as conn:
                database = str(conn.info.dbname)
                _prepare(conn, schema, statements)
                current = 0
                for size in sizes:
                    say(f"size {size:,}: adding {size - current:,} jobs")
                    fill = fill_to(conn, current, size)
                    current = size
                    fills.append(fill)
                    say(fill_line(fill))
                    measurements.extend(measure_variants(
                        conn, run_dsn, statements, size, batch=batch, repeat=repeat, say=say))
    except psycopg.Error as exc:
        raise HarnessError(f"PostgreSQL failed while measuring plans: {scrub(str(exc), dsn)}") \
            from exc
    return Result(database=database, schema=schema, isolation=isolation, fills=fills,
                  measurements=measurements)


def fill_to(conn: psycopg.Connection[Any], current: int, size: int) -> Fill:
    """Add the rows that take the table from `current` jobs to `size`, segment by segment in
    one statement, then VACUUM (ANALYZE) it: fresh statistics and a visibility map, as a
    table that has been in service for a while has."""
    before, after = planned_rows(current), planned_rows(size)
    counts = [after[s.name] - before[s.name] for s in SEGMENTS]
    started = time.perf_counter()
    conn.execute(_FILL, {
        "counts": counts,
        "accounts": [",".join(s.accounts) for s in SEGMENTS],
        "statuses": [s.status for s in SEGMENTS],
        "dues": [s.due for s in SEGMENTS],
        "spreads": [s.spread for s in SEGMENTS],
        "retry_ins": [s.retry_in for s in SEGMENTS],
        "lease_ins": [s.lease_in for s in SEGMENTS],
        "attempts": [s.attempts for s in SEGMENTS],
        "errors": [s.error for s in SEGMENTS],
        "finished": [s.finished for s in SEGMENTS],
    })
    conn.execute(_OPEN_ATTEMPTS)
    seconds = time.perf_counter() - started
    conn.execute("ANALYZE job_attempts, accounts")
    vacuum_seconds = vacuum(conn)
    accounts: dict[str, dict[str, int]] = {}
    for account, status, jobs in conn.execute(
            "SELECT account_id, status, count(*) FROM jobs GROUP BY 1, 2 ORDER BY 1, 2"):
        accounts.setdefault(account, {})[status] = jobs
    statuses = {s: sum(by.get(s, 0) for by in accounts.values()) for s in STATUSES}
    return Fill(size=size, added=sum(counts), seconds=round(seconds, 2),
                vacuum_seconds=round(vacuum_seconds, 2), statuses=statuses,
                accounts=accounts)


def vacuum(conn: psycopg.Connection[Any]) -> float:
    """VACUUM (ANALYZE) jobs; the seconds it took."""
    started = time.perf_counter()
    conn.execute("VACUUM (ANALYZE) jobs")
    return time.perf_counter() - started


def measure_variants(conn: psycopg.Connection[Any], dsn: str, statements: dict[str, str],
                     size: int, *, batch: int, repeat: int, say: Say) -> list[Measurement]:
    """The four variants at one size, in order, from a table just vacuumed; the table is
    left vacuumed again."""
    def measured(variant: Variant, setup: str, setup_seconds: float, *, dead: int = 0,
                 swap_indexes: bool = False) -> Measurement:
        started = time.perf_counter()
        found = measure(conn, statements, size, variant, batch=batch, repeat=repeat,
                        setup=setup, setup_seconds=setup_seconds, dead=dead,
                        swap_indexes=swap_indexes)
        say(variant_line(found, time.perf_counter() - started))
        return found

    done = [measured("partial", "the indexes as the queue's schema block made them", 0.0)]
    say("  plain: rebuilding each partial index without its WHERE clause, in a transaction "
        "rolled back after")
    # The swap must happen inside measure()'s transaction: it times it and says what it did.
    done.append(measured("plain", "", 0.0, swap_indexes=True))
    churning = min(size // CHURN_DIVISOR, CHURN_CAP)
    say(f"  bloated: pinning a snapshot in another session, then churning {churning:,} due "
        "jobs")
    with pinned_snapshot(dsn):
        started = time.perf_counter()
        churn(conn, churning)
        seconds = time.perf_counter() - started
        made = churning * DEAD_VERSIONS_PER_CHURNED_JOB
        done.append(measured(
            "bloated", f"a REPEATABLE READ snapshot held open while {churning:,} due jobs were "
            f"claimed, completed and queued again ({CHURN_ROUNDS} rounds): {made:,} dead row "
            "versions it keeps", seconds, dead=made))
    say("  vacuumed: snapshot released; VACUUM (ANALYZE)")
    done.append(measured("vacuumed", "the snapshot released and the table vacuumed",
                         vacuum(conn)))
    return done


def measure(conn: psycopg.Connection[Any], statements: dict[str, str], size: int,
            variant: Variant, *, batch: int, repeat: int, setup: str, setup_seconds: float,
            dead: int, swap_indexes: bool) -> Measurement:
    """Everything measured on one variant, in one transaction rolled back at the end, and
    each measurement in a savepoint rolled back after it: every one sees the same table."""
    params = claim_params(batch)
    with conn.transaction(force_rollback=True):
        if swap_indexes:
            started = time.perf_counter()
            swapped = swap_partial_indexes(conn)
            setup_seconds = time.perf_counter() - started
            setup = (f"{swapped} partial indexes rebuilt without their WHERE clause, in a "
                     "transaction rolled back after")
        with conn.transaction(force_rollback=True):
            lock_plan = explain_analyze(conn, statements["claim_lock_accounts"], params)
            # EXPLAIN returns the plan, not the rows: run it again for the accounts (the
            # locks it takes are ours already).
            locked = lock_accounts(conn, statements, params)
            claim_plan = explain_analyze(conn, statements["claim"],
                                         {**params, "locked_accounts": locked})
        with conn.transaction(force_rollback=True):
            recover_plan = explain_analyze(conn, statements["recover"],
                                           {"limit": RECOVER_LIMIT})
        with conn.transaction(force_rollback=True):
            # What the EXPLAIN recovered: the block returns one row whose first column is it.
            row = conn.execute(statements["recover"], {"limit": RECOVER_LIMIT}).fetchone()
            recovered = int(row[0]) if row else 0
        with conn.transaction(force_rollback=True):
            claimed_rows = claim(conn, statements, params)
            finish_plan = (explain_analyze(conn, statements["finish"],
                                           finish_params(claimed_rows))
                           if claimed_rows else None)
        times, claimed = time_claims(conn, statements, params, repeat)
    lock_cost, claim_cost = cost(lock_plan, claimed), cost(claim_plan, claimed)
    return Measurement(
        size=size, variant=variant, setup=setup, setup_seconds=round(setup_seconds, 2),
        claimed=claimed, claim_p50_ms=round(statistics.median(times), 3),
        claim_runs=len(times),
        claim=Cost(jobs=claimed,
                   execution_ms=round(lock_cost.execution_ms + claim_cost.execution_ms, 3),
                   buffers=lock_cost.buffers + claim_cost.buffers,
                   rows_removed=lock_cost.rows_removed + claim_cost.rows_removed),
        lock=lock_cost,
        recover=cost(recover_plan, recovered),
        # The block returns the ords it applied: one row per job written.
        finish=None if finish_plan is None else cost(finish_plan,
                                                     int(finish_plan["Plan"]["Actual Rows"])),
        dead_row_versions=dead,
        plans={"claim_lock_accounts": lock_plan, "claim": claim_plan,
               "recover": recover_plan, "finish": finish_plan})


def time_claims(conn: psycopg.Connection[Any], statements: dict[str, str],
                params: dict[str, Any], repeat: int) -> tuple[list[float], int]:
    """Wall milliseconds of up to `repeat` claims (its two statements, each claim rolled
    back to a savepoint outside the timing), fewer once CLAIM_BUDGET_SECONDS have passed;
    and the jobs a claim took."""
    times: list[float] = []
    claimed = 0
    deadline = time.monotonic() + CLAIM_BUDGET_SECONDS
    while len(times) < repeat and (len(times) < MIN_CLAIM_RUNS or time.monotonic() < deadline):
        with conn.transaction(force_rollback=True):
            started = time.perf_counter()
            claimed = len(claim(conn, statements, params))
            times.append((time.perf_counter() - started) * 1000)
    return times, claimed


def finish_params(claimed: list[dict[str, Any]]) -> dict[str, Any]:
    """A successful result for each claimed job, as the dispatcher writes it."""
    now = datetime.now(UTC)
    return {"ords": list(range(len(claimed))),
            "job_ids": [row["id"] for row in claimed],
            "lease_tokens": [row["lease_token"] for row in claimed],
            "attempts": [row["attempts"] for row in claimed],
            "workers": [row["locked_by"] for row in claimed],
            "outcomes": ["success"] * len(claimed),
            "http_statuses": [200] * len(claimed),
            "errors": [None] * len(claimed),
            "retry_delays": [None] * len(claimed),
            "finished_ats": [now] * len(claimed)}


def cost(explained: dict[str, Any], jobs: int) -> Cost:
    removed, _ = plan_work(explained["Plan"])
    return Cost(jobs=jobs, execution_ms=float(explained["Execution Time"]),
                buffers=statement_buffers(explained["Plan"]), rows_removed=removed)


def statement_buffers(plan: dict[str, Any]) -> int:
    """Shared buffers hit and read by the whole statement. The top node counts everything
    run inside it, but a data-modifying CTE that nothing reads (the claim's insert into
    job_attempts, the result write's fenced log) runs after it: its own count is added."""
    def scanned(node: dict[str, Any]) -> Iterator[str]:
        if node.get("Node Type") == "CTE Scan":
            yield str(node.get("CTE Name"))
        for child in node.get("Plans", []):
            yield from scanned(child)

    read = set(scanned(plan))
    _, buffers = plan_work(plan)
    for child in plan.get("Plans", []):
        name = str(child.get("Subplan Name", ""))
        if name.startswith("CTE ") and name.removeprefix("CTE ") not in read:
            buffers += plan_work(child)[1]
    return buffers


def swap_partial_indexes(conn: psycopg.Connection[Any]) -> int:
    """In the caller's transaction, replace each partial index on jobs by the same index
    without its WHERE clause, under the same name (and not unique: without its predicate a
    unique index could refuse the rows). DDL is transactional in PostgreSQL: rolling back
    brings the partial indexes back as they were, with no rebuild. Returns how many."""
    found = conn.execute(
        "SELECT n.nspname, c.relname, pg_get_indexdef(x.indexrelid),"
        " pg_get_expr(x.indpred, x.indrelid)"
        " FROM pg_index AS x JOIN pg_class AS c ON c.oid = x.indexrelid"
        " JOIN pg_namespace AS n ON n.oid = c.relnamespace"
        " WHERE x.indrelid = 'jobs'::regclass AND x.indpred IS NOT NULL"
        " ORDER BY c.relname").fetchall()
    for schema, name, definition, predicate in found:
        where = " WHERE " + predicate
        if not definition.endswith(where):
            raise HarnessError(f"cannot read the partial index {name}'s definition "
                               f"({definition!r}) to rebuild it without its WHERE clause")
        plain = definition.removesuffix(where).replace("CREATE UNIQUE INDEX", "CREATE INDEX", 1)
        conn.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(schema, name)))
        # The server's own rendering of the index, less its predicate.
        conn.execute(sql.SQL(plain))
    return len(found)


@contextmanager
def pinned_snapshot(dsn: str) -> Iterator[None]:
    """Another session holding a REPEATABLE READ snapshot open, as an idle transaction or a
    long report does: its xmin keeps every row version deleted after it from being vacuumed
    or passed over by index scans. Released (rolled back, closed) on the way out, however."""
    with psycopg.connect(dsn, application_name=APPLICATION_NAME) as pin:
        pin.isolation_level = IsolationLevel.REPEATABLE_READ
        pin.execute("SELECT 1")  # the snapshot is taken by the transaction's first statement
        try:
            yield
        finally:
            pin.rollback()


def churn(conn: psycopg.Connection[Any], jobs: int) -> None:
    """Take `jobs` due PENDING jobs, oldest first, of the accounts a claim serves (not the
    full ones), in CHURN_ROUNDS rounds, through what claims and result writes do to them:
    PENDING -> PROCESSING -> COMPLETED, each step its own transaction; then queue each again
    as a new due job (PENDING, at the tail), so the table keeps its size and mix. Set-based;
    the jobs rows only."""
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS churned (id uuid PRIMARY KEY)")
    per_round = math.ceil(jobs / CHURN_ROUNDS)
    for first in range(0, jobs, per_round):
        conn.execute("TRUNCATE churned")
        conn.execute("INSERT INTO churned (id) SELECT id FROM jobs"
                     " WHERE status = 'PENDING' AND run_at <= now()"
                     " AND account_id <> ALL(%s::text[]) ORDER BY run_at, id LIMIT %s",
                     (list(FULL_ACCOUNTS), min(per_round, jobs - first)))
        conn.execute("UPDATE jobs AS j SET status = 'PROCESSING', attempts = j.attempts + 1,"
                     " locked_until = now() + interval '5 minutes',"
                     " lease_token = gen_random_uuid(), locked_by = 'churn'"
                     " FROM churned AS c WHERE j.id = c.id")
        conn.execute("UPDATE jobs AS j SET status = 'COMPLETED', finished_at = now(),"
                     " locked_until = NULL, lease_token = NULL"
                     " FROM churned AS c WHERE j.id = c.id")
        conn.execute("UPDATE jobs AS j SET status = 'PENDING', attempts = 0,"
                     " run_at = now() - interval '1 second', finished_at = NULL,"
                     " locked_by = NULL FROM churned AS c WHERE j.id = c.id")


def fill_line(fill: Fill) -> str:
    mix = ", ".join(f"{status} {n:,}" for status, n in fill.statuses.items())
    return (f"  filled: +{fill.added:,} jobs in {fill.seconds:.1f} s, VACUUM (ANALYZE) "
            f"{fill.vacuum_seconds:.1f} s; {mix}")


def variant_line(m: Measurement, seconds: float) -> str:
    def shown(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    finish = ("nothing claimed" if m.finish is None else
              f"{shown(m.finish.per_job(m.finish.execution_ms), 3)} ms and "
              f"{shown(m.finish.per_job(m.finish.buffers), 1)} buffers per job")
    return (f"  {m.variant:<9} claim of {m.claimed}: p50 {m.claim_p50_ms:.2f} ms "
            f"({shown(m.ms_per_claimed_job, 3)} ms/job, {m.claim_runs} runs), "
            f"{m.claim.buffers:,} buffers ({shown(m.buffers_per_claimed_job, 1)}/job), "
            f"{m.claim.rows_removed:,} rows filtered out; recover of {m.recover.jobs}: "
            f"{m.recover.execution_ms:.2f} ms, {m.recover.buffers:,} buffers; finish: "
            f"{finish}  [{seconds:.1f} s; setup {m.setup_seconds:.1f} s]")
