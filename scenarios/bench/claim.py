"""`skiplock bench claim`: what one claim costs when a full account has a long backlog (the
seeds' noisy neighbour), at several backlog sizes side by side in one run.

For each size N, a fresh schema holds one account at its limit (2 of 2 jobs in flight) with N
due jobs older than everyone else's, one limited account with free slots and one unlimited
account, each with 20 due jobs. A claim (both statements of the queue's claim, in one
transaction) of a batch is run `--repeat` times and rolled back each time, so every claim
sees the same table. It prints, per size, the claim's p50 and p99 wall time (round trips
included), and from one executed plan (EXPLAIN ANALYZE, BUFFERS) of the claim statement the
rows its scans filtered out and the buffers it touched: a claim whose cost does not grow with
a full account's backlog keeps all three flat. `--accounts 1,1000` repeats each size with
that many unlimited accounts sharing the unlimited due work (20 due jobs each): a claim whose
cost does not grow with the number of accounts keeps them flat too. `--sql FILE` measures
your claim instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from skiplock.plumbing.errors import UsageError
from skiplock.queue_impl.pg import apply_plan_settings, explain_as_run
from skiplock.queue_impl.sqlfile import statements_and_sources
from skiplock.reports.selfdescribe import describe
from skiplock.scenarios.bench.common import MAX_ROUNDS, bad_rounds, result_path
from skiplock.scenarios.bench.queue import by_round
from skiplock.scenarios.servers.postgres import postgres

SCHEMA_PREFIX = "skiplock_bench_claim"
OTHER_DUE = 20
DEFAULT_BACKLOGS = (1_000, 100_000)
DEFAULT_ACCOUNTS = (1,)


@dataclass(frozen=True, kw_only=True)
class SizeResult:
    backlog: int
    unlimited_accounts: int
    claimed: int
    p50_ms: float
    p99_ms: float
    execution_ms: float  # the claim statement's, from EXPLAIN ANALYZE
    rows_filtered: int
    buffers: int
    fill_seconds: float
    # Each round's p50 and p99 (ms): `repeat` claims timed again, the median round above.
    rounds: tuple[tuple[float, float], ...] = ()


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backlogs", default=",".join(map(str, DEFAULT_BACKLOGS)),
                        help="due jobs of the full account, comma-separated (default "
                             "1000,100000)")
    parser.add_argument("--accounts", default="1",
                        help="unlimited accounts with due work, comma-separated: each size is "
                             "measured with each count (default 1)")
    parser.add_argument("--batch", type=int, default=10, help="jobs per claim (default 10)")
    parser.add_argument("--repeat", type=int, default=200,
                        help="claims timed per size (default 200)")
    parser.add_argument("--rounds", type=int, default=1,
                        help=f"time each size's claims this many times over (1 to "
                             f"{MAX_ROUNDS}; default 1): the result keeps each round, so "
                             "`skiplock compare` can tell noise from a change")
    parser.add_argument("--sql", default=None, metavar="FILE",
                        help="your own claim blocks (as `skiplock run --sql`)")
    parser.add_argument("--dsn", default=None,
                        help="PostgreSQL DSN (default: SKIPLOCK_PG_DSN, else embedded)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON result file (default ./bench-results/claim-TIMESTAMP.json)")


def _counts(flag: str, text: str, most: int) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"{flag} must be whole numbers separated by commas, got {text!r}") \
            from None
    if not counts or any(n < 1 or n > most for n in counts):
        raise UsageError(f"{flag} must each be between 1 and {most}, got {text!r}")
    return counts


def run(args: argparse.Namespace) -> int:
    backlogs = _counts("--backlogs", args.backlogs, 50_000_000)
    accounts = _counts("--accounts", args.accounts, 100_000)
    for name in ("batch", "repeat"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name} must be a positive integer, got {getattr(args, name)}")
    if (bad := bad_rounds(args.rounds)) is not None:
        raise UsageError(bad)
    try:
        statements, _ = statements_and_sources(args.sql)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--sql {args.sql}: {exc}") from None
    out = result_path(args.out, "claim")
    with postgres(args.dsn, durable=True) as server:
        settings = server.settings()
        print(f"server: {server.kind} {server.display}, PostgreSQL "
              f"{settings['server_version']}; batch {args.batch}, {args.repeat} claims per size",
              flush=True)
        results = [measure(server.dsn, statements, n, args.batch, args.repeat, accounts=a,
                           rounds=args.rounds)
                   for n in backlogs for a in accounts]
    base = results[0]
    print(f"{'backlog':>10} {'accounts':>9} {'p50 ms':>8} {'p99 ms':>8} {'exec ms':>8} "
          f"{'filtered':>9} {'buffers':>8} {'claimed':>8} {'p50 x':>6}")
    for r in results:
        print(f"{r.backlog:>10,} {r.unlimited_accounts:>9,} {r.p50_ms:>8.2f} {r.p99_ms:>8.2f} "
              f"{r.execution_ms:>8.2f} "
              f"{r.rows_filtered:>9,} {r.buffers:>8,} {r.claimed:>8} "
              f"{r.p50_ms / base.p50_ms:>6.2f}")
    if args.rounds > 1:
        print(by_round([{"sizes": [{"p50_ms": r.rounds[i][0]} for r in results]}
                        for i in range(args.rounds)],
                       [(f"p50 ms at {r.backlog:,}/{r.unlimited_accounts}", _size_p50(k))
                        for k, r in enumerate(results)]), flush=True)
    doc = {"benchmark": "claim", "finished_at": datetime.now(UTC).isoformat(),
           "params": {"backlogs": backlogs, "accounts": accounts, "batch": args.batch,
                      "repeat": args.repeat, "sql": args.sql, "rounds": args.rounds},
           "postgres": settings, "durable": settings["durable"],
           "server": {"kind": server.kind, "dsn": server.display}, **describe(),
           "sizes": [asdict(r) for r in results],
           # Each round as a result of its own (what `skiplock compare` reads the spread from).
           "rounds": [{"sizes": [{"backlog": r.backlog,
                                  "unlimited_accounts": r.unlimited_accounts,
                                  "p50_ms": r.rounds[i][0], "p99_ms": r.rounds[i][1]}
                                 for r in results]} for i in range(args.rounds)]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"written: {out}")
    return 0


def _size_p50(k: int) -> Callable[[Mapping[str, Any]], float | None]:
    """A round's p50 of the k-th size."""
    return lambda one: float(one["sizes"][k]["p50_ms"])


def measure(dsn: str, statements: dict[str, str], backlog: int, batch: int,
            repeat: int, *, accounts: int = 1, rounds: int = 1) -> SizeResult:
    schema = f"{SCHEMA_PREFIX}_{backlog}_{accounts}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_schema(conn, schema, statements)
        started = time.perf_counter()
        _fill(conn, backlog, accounts)
        fill_seconds = time.perf_counter() - started
    try:
        with psycopg.connect(dsn) as conn:
            use_schema(conn, schema)
            # Planned as the queue's own connections plan it: once, generically.
            apply_plan_settings(conn)
            conn.commit()
            params = claim_params(batch)
            timed: list[list[float]] = []
            claimed = 0
            for _ in range(rounds):
                times: list[float] = []
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    claimed = len(claim(conn, statements, params))
                    conn.rollback()
                    times.append((time.perf_counter() - t0) * 1000)
                timed.append(sorted(times))
            locked = lock_accounts(conn, statements, params)
            plan = explain_analyze(conn, statements["claim"], {**params, "locked_accounts": locked})
            conn.rollback()
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE")
                         .format(sql.Identifier(schema)))
    filtered, buffers = plan_work(plan["Plan"])
    each = tuple((statistics.median(t), t[min(len(t) - 1, int(len(t) * 0.99))]) for t in timed)
    p50, p99 = sorted(each)[len(each) // 2]  # the median round stands for the size
    return SizeResult(backlog=backlog, unlimited_accounts=accounts, claimed=claimed,
                      p50_ms=p50, p99_ms=p99,
                      execution_ms=float(plan["Execution Time"]), rows_filtered=filtered,
                      buffers=buffers, fill_seconds=round(fill_seconds, 2), rounds=each)


def create_schema(conn: psycopg.Connection[Any], schema: str, statements: dict[str, str]) -> None:
    """A fresh schema holding the queue's tables and indexes (its `schema` block), left as the
    connection's search_path."""
    conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    use_schema(conn, schema)
    conn.execute(statements["schema"])


def use_schema(conn: psycopg.Connection[Any], schema: str) -> None:
    conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))


def claim_params(batch: int) -> dict[str, Any]:
    """The claim's parameters but the locked accounts, as a worker passes them."""
    return {"batch": batch, "lease": timedelta(seconds=60), "worker_id": "bench"}


def lock_accounts(conn: psycopg.Connection[Any], statements: dict[str, str],
                  params: dict[str, Any]) -> list[str]:
    """The claim's first statement: the limited accounts it locked."""
    return [row[0] for row in conn.execute(statements["claim_lock_accounts"], params)]


def claim(conn: psycopg.Connection[Any], statements: dict[str, str],
          params: dict[str, Any]) -> list[dict[str, Any]]:
    """Both statements of a claim, in the caller's transaction: the rows claimed, by column."""
    locked = lock_accounts(conn, statements, params)
    return conn.cursor(row_factory=dict_row).execute(
        statements["claim"], {**params, "locked_accounts": locked}).fetchall()


def explain_analyze(conn: psycopg.Connection[Any], statement: str,
                    params: dict[str, Any]) -> dict[str, Any]:
    """The executed plan (EXPLAIN ANALYZE, BUFFERS) as the queue runs it (its generic plan),
    its top object: "Plan", "Execution Time" and the rest. The statement really runs: roll
    back if it writes."""
    rows = explain_as_run(conn, statement, params, "ANALYZE, BUFFERS, FORMAT JSON")
    return cast(dict[str, Any], rows[0][0][0])


def _fill(conn: psycopg.Connection[Any], backlog: int, accounts: int = 1) -> None:
    """Set-based: the full account's in-flight pair and backlog, the others' due jobs (the
    unlimited ones `free` or, with several, `free-1` ... `free-N`)."""
    conn.execute("INSERT INTO accounts (id, concurrency_limit) VALUES ('full', 2), ('open', 5)")
    conn.execute("INSERT INTO accounts (id) SELECT CASE WHEN %s = 1 THEN 'free' "
                 "ELSE 'free-' || g END FROM generate_series(1, %s) AS g", (accounts, accounts))
    conn.execute(
        "INSERT INTO jobs (id, account_id, target_url, payload, status, run_at, attempts, "
        "locked_until, lease_token) "
        "SELECT gen_random_uuid(), 'full', 'http://t/', '{}'::jsonb, 'PROCESSING', "
        "now() - interval '2 hours', 1, now() + interval '1 hour', gen_random_uuid() "
        "FROM generate_series(1, 2)")
    conn.execute(
        "INSERT INTO jobs (id, account_id, target_url, payload, run_at) "
        "SELECT gen_random_uuid(), 'full', 'http://t/', '{}'::jsonb, "
        "now() - interval '1 hour' + i * interval '1 us' FROM generate_series(1, %s) AS i "
        "UNION ALL "
        "SELECT gen_random_uuid(), a.id, 'http://t/', '{}'::jsonb, "
        "now() - interval '1 minute' + i * interval '1 ms' "
        "FROM accounts AS a, generate_series(1, %s) AS i WHERE a.id <> 'full'",
        (backlog, OTHER_DUE))
    conn.execute("VACUUM ANALYZE jobs")
    conn.execute("ANALYZE accounts")


def plan_work(node: dict[str, Any]) -> tuple[int, int]:
    """(rows removed by filters over every node, buffers the top node touched: each node's
    count includes its children's)."""
    removed = int(node.get("Rows Removed by Filter", 0)) + int(
        node.get("Rows Removed by Join Filter", 0))
    for child in node.get("Plans", []):
        removed += plan_work(child)[0]
    return removed, int(node.get("Shared Hit Blocks", 0)) + int(node.get("Shared Read Blocks", 0))


__all__: Sequence[str] = ("claim", "claim_params", "configure", "create_schema", "explain_analyze",
                          "lock_accounts", "measure", "plan_work", "run", "use_schema")
