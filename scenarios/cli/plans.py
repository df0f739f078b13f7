"""`skiplock plans`: what the queue's claim costs as the jobs table grows and bloats.

A queue's claim is fast on an empty table; what matters is how it holds up after months of
history, behind a long backlog, and with dead rows a long transaction keeps. This grows one
jobs table to each of `--sizes` (10k, 100k, 1M and 10M jobs by default) with the same
realistic mix, and at each size measures the claim (wall time over several runs, and its
executed plans: milliseconds, buffers, rows filtered out), recovery and the result write,
with the queue's partial indexes, with plain indexes instead, under a snapshot held open
while jobs churn, and vacuumed again (`skiplock.scenarios.bench.plans` says how). The figures
per claimed job, against table size, show which of these a claim's cost follows.

It writes `plans.json` (every figure, each fill's time and counts, the machine, versions and
durability, and every executed plan in full), `plans.csv` (the table it prints) and
`plans.png` (ms and buffers per claimed job against table size, one line per variant).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd

from skiplock.plumbing.argtypes import positive_int
from skiplock.plumbing.errors import UsageError
from skiplock.queue_impl.sqlfile import statements_and_sources
from skiplock.reports.selfdescribe import describe
from skiplock.scenarios.bench.plans import (
    CHURN_CAP,
    CHURN_DIVISOR,
    CHURN_ROUNDS,
    CLAIM_BUDGET_SECONDS,
    MIN_SIZE,
    RECOVER_LIMIT,
    SEGMENTS,
    SESSION_SETTINGS,
    VARIANTS,
    Measurement,
    measure_sizes,
)
from skiplock.scenarios.servers.postgres import postgres

DEFAULT_SIZES = "10k,100k,1m,10m"
MAX_SIZE = 100_000_000
# Above this many jobs a run takes long enough and writes enough that it must be asked for.
CONFIRM_ABOVE = 10_000_000
# What one job costs a whole run, measured on a 2-core machine with local PostgreSQL 15
# (2026-12-03): the default sizes took 10 min (up to 10M jobs); 100k jobs took 51 MB.
SECONDS_PER_JOB = 60e-6
BYTES_PER_JOB = 450
_SIZE = re.compile(r"(?P<number>\d+(?:\.\d+)?)(?P<unit>[km]?)", re.IGNORECASE)
_UNITS = {"": 1, "k": 1_000, "m": 1_000_000}
# How each variant is drawn, the same in every plot.
_STYLE = {
    "partial": {"color": "tab:blue", "marker": "o", "linestyle": "-"},
    "plain": {"color": "tab:orange", "marker": "s", "linestyle": "-"},
    "bloated": {"color": "tab:red", "marker": "^", "linestyle": "-"},
    "vacuumed": {"color": "tab:green", "marker": "v", "linestyle": "--"},
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=DEFAULT_SIZES, metavar="N1,N2,...",
                        help="table sizes in jobs, increasing: 10k, 1m or 20000 (default "
                             f"{DEFAULT_SIZES})")
    parser.add_argument("--batch", type=positive_int, default=10,
                        help="jobs per claim (default 10)")
    parser.add_argument("--repeat", type=positive_int, default=20,
                        help="claims timed per size and variant, fewer if they take over "
                             f"{CLAIM_BUDGET_SECONDS:g} s (default 20)")
    parser.add_argument("--sql", default=None, metavar="FILE",
                        help="your own queue blocks (as `skiplock run --sql`), over the "
                             "reference's tables")
    parser.add_argument("--dsn", default=None,
                        help="PostgreSQL DSN (default: SKIPLOCK_PG_DSN, Docker, embedded)")
    parser.add_argument("--yes", action="store_true",
                        help=f"run sizes above {CONFIRM_ABOVE:,} jobs (hours and tens of GB;"
                             " the estimate is printed first)")
    parser.add_argument("--out", type=Path, default=Path("plans-results"),
                        help="directory for plans.json, plans.csv and plans.png "
                             "(default ./plans-results)")


def parse_sizes(text: str) -> tuple[int, ...]:
    sizes: list[int] = []
    for part in text.split(","):
        match = _SIZE.fullmatch(part.strip())
        value = (float(match["number"]) * _UNITS[match["unit"].lower()]) if match else None
        if value is None or not value.is_integer():
            raise UsageError(f"--sizes: {part.strip()!r} is not a number of jobs; write sizes "
                             f"like {DEFAULT_SIZES} or 20000")
        sizes.append(int(value))
    if any(not MIN_SIZE <= n <= MAX_SIZE for n in sizes):
        raise UsageError(f"--sizes must each be from {MIN_SIZE:,} to {MAX_SIZE:,} jobs, "
                         f"got {text!r}")
    if any(later <= earlier for earlier, later in itertools.pairwise(sizes)):
        raise UsageError(f"--sizes must increase (the table grows from one to the next), "
                         f"got {text!r}")
    return tuple(sizes)


def _check_sql(dsn: str, sql_path: str) -> None:
    """Have the server prepare every block of the user's SQL, on a schema of its own, before
    anything is filled: a syntax error there is bad input (exit 2, one line naming the file
    and block), not a harness failure minutes into a fill."""
    import secrets

    import psycopg
    from psycopg import sql

    from skiplock.queue_impl.interface import StatementError
    from skiplock.queue_impl.pg import PgQueue
    from skiplock.queue_impl.plugins import BackendSpec

    schema = f"skiplock_check_{secrets.token_hex(4)}"
    queue = BackendSpec(name="pg", dsn=dsn, schema=schema, sql_path=sql_path).create()
    assert isinstance(queue, PgQueue)
    try:
        queue.setup()
        queue.check_statements()
    except StatementError as exc:
        raise UsageError(str(exc)) from None
    finally:
        queue.close()
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                sql.Identifier(schema)))


def _check_out(out: Path) -> None:
    """Refuse an --out that is a file or lies under one, before anything starts."""
    for folder in (out, *out.parents):
        if folder.exists():
            if not folder.is_dir():
                raise UsageError(f"--out {out}: {folder} is a file; give a directory")
            return


def estimate(sizes: tuple[int, ...]) -> str:
    """Roughly how long and how much disk a run to these sizes takes (the table grows to
    the largest)."""
    largest = max(sizes)
    minutes = largest * SECONDS_PER_JOB / 60
    gigabytes = largest * BYTES_PER_JOB / 1e9
    took = f"{minutes:.0f} min" if minutes >= 1 else "under a minute"
    return (f"about {took} and {gigabytes:.1f} GB on the server's disk"
            " (measured on 2 cores: 10 min and 4.5 GB for 10M jobs)")


def run(args: argparse.Namespace) -> int:
    sizes = parse_sizes(args.sizes)
    if max(sizes) > CONFIRM_ABOVE and not args.yes:
        raise UsageError(f"--sizes up to {max(sizes):,} jobs: {estimate(sizes)}; "
                         "add --yes to run it")
    try:
        statements, _ = statements_and_sources(args.sql)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--sql {args.sql}: {exc}") from None
    out: Path = args.out
    _check_out(out)
    started = time.perf_counter()
    with postgres(args.dsn, durable=True) as server:
        if args.sql is not None:
            _check_sql(server.dsn, args.sql)
        settings = server.settings()
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--out {out}: cannot create it ({exc.strerror})") from None
        _say(f"estimate for {max(sizes):,} jobs: {estimate(sizes)}")
        _say(f"plans: sizes {', '.join(_short(n) for n in sizes)} jobs; batch {args.batch}, "
             f"up to {args.repeat} timed claims per variant; server {server.kind} "
             f"{server.display}, PostgreSQL {settings['server_version']}")
        _say(f"durability: logged tables, the server's own commit settings (fsync "
             f"{settings['fsync']}, synchronous_commit {settings['synchronous_commit']}, "
             f"full_page_writes {settings['full_page_writes']}): "
             f"{'durable' if settings['durable'] else 'NOT durable'}; autovacuum off on the "
             "measured table")
        result = measure_sizes(server.dsn, statements, sizes, batch=args.batch,
                               repeat=args.repeat, say=_say)
        wall_seconds = time.perf_counter() - started
        doc = {"benchmark": "plans", "finished_at": datetime.now(UTC).isoformat(),
               "wall_seconds": round(wall_seconds, 1), "params": _params(args, sizes),
               "mix": [asdict(s) for s in SEGMENTS], "durability": _durability(settings),
               "postgres": settings, "server": {"kind": server.kind, "dsn": server.display},
               **describe(server.dsn), "isolation": result.isolation,
               "database": result.database, "schema": result.schema,
               "fills": [asdict(f) for f in result.fills],
               "measurements": [_record(m) for m in result.measurements]}
    frame = table(result.measurements)
    (out / "plans.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    frame.to_csv(out / "plans.csv", index=False)
    plot(frame, out / "plans.png",
         subtitle=f"claims of {args.batch} jobs; PostgreSQL "
                  f"{str(settings['server_version']).split()[0]}, "
                  f"{'durable' if settings['durable'] else 'not durable'}")
    _say("")
    _say(_printable(frame))
    fills = ", ".join(f"{_short(f.size)} {f.seconds:.1f} s" for f in result.fills)
    _say(f"fill time per size (INSERTs; VACUUM apart): {fills}; whole run {wall_seconds:.0f} s")
    _say(f"written: {out / 'plans.json'}, {out / 'plans.csv'}, {out / 'plans.png'}")
    return 0


def _params(args: argparse.Namespace, sizes: tuple[int, ...]) -> dict[str, Any]:
    return {"sizes": sizes, "batch": args.batch, "repeat": args.repeat, "sql": args.sql,
            "claim_budget_seconds": CLAIM_BUDGET_SECONDS, "recover_limit": RECOVER_LIMIT,
            "churn": {"share_of_table": 1 / CHURN_DIVISOR, "cap": CHURN_CAP,
                      "rounds": CHURN_ROUNDS}}


def _durability(settings: dict[str, Any]) -> dict[str, Any]:
    return {
        "tables": "logged (no UNLOGGED table)",
        "synchronous_commit": settings["synchronous_commit"],
        "fsync": settings["fsync"],
        "full_page_writes": settings["full_page_writes"],
        "durable": settings["durable"],
        "session_settings": SESSION_SETTINGS,
        "autovacuum_on_jobs": "off (so the bloat measured is the bloat made)",
    }


def _record(m: Measurement) -> dict[str, Any]:
    return {**asdict(m), "ms_per_claimed_job": m.ms_per_claimed_job,
            "buffers_per_claimed_job": m.buffers_per_claimed_job}


def table(measurements: list[Measurement]) -> pd.DataFrame:
    """One row per size and variant: the claim's figures, then recovery's and the result
    write's."""
    rows = [{
        "size": m.size,
        "variant": m.variant,
        "claimed": m.claimed,
        "claim_p50_ms": m.claim_p50_ms,
        "ms_per_claimed_job": _rounded(m.ms_per_claimed_job, 4),
        "claim_execution_ms": m.claim.execution_ms,
        "claim_buffers": m.claim.buffers,
        "buffers_per_claimed_job": _rounded(m.buffers_per_claimed_job, 1),
        "lock_statement_buffers": m.lock.buffers,
        "claim_rows_removed": m.claim.rows_removed,
        "recovered": m.recover.jobs,
        "recover_ms": m.recover.execution_ms,
        "recover_buffers": m.recover.buffers,
        "finished": m.finish.jobs if m.finish else 0,
        "finish_ms_per_job": _rounded(m.finish.per_job(m.finish.execution_ms), 4)
        if m.finish else None,
        "finish_buffers_per_job": _rounded(m.finish.per_job(m.finish.buffers), 1)
        if m.finish else None,
        "dead_row_versions": m.dead_row_versions,
        "setup_seconds": m.setup_seconds,
    } for m in measurements]
    return pd.DataFrame(rows)


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _printable(frame: pd.DataFrame) -> str:
    shown = frame[["size", "variant", "claim_p50_ms", "ms_per_claimed_job",
                   "buffers_per_claimed_job", "lock_statement_buffers", "claim_rows_removed",
                   "recover_buffers", "finish_buffers_per_job", "dead_row_versions"]].copy()
    shown["size"] = shown["size"].map(_short)
    shown.columns = ["size", "variant", "claim p50 ms", "ms/job", "buffers/job",
                     "lock stmt buffers", "rows filtered", "recover buffers",
                     "finish buffers/job", "dead versions"]
    formats = {"claim p50 ms": "{:,.2f}", "ms/job": "{:,.3f}", "buffers/job": "{:,.1f}",
               "lock stmt buffers": "{:,}", "rows filtered": "{:,}", "recover buffers": "{:,}",
               "finish buffers/job": "{:,.1f}", "dead versions": "{:,}"}
    for column, spec in formats.items():
        shown[column] = shown[column].map(lambda v, spec=spec: "-" if pd.isna(v)
                                          else spec.format(v))
    return shown.to_string(index=False)


def plot(frame: pd.DataFrame, path: Path, *, subtitle: str) -> None:
    """Two panels against table size (log scales): ms and buffers per claimed job, one line
    per variant."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(frame["size"].unique())
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5))
    panels = ((left, "ms_per_claimed_job", "milliseconds per claimed job (log)",
               "Time: claim p50 wall time / jobs claimed"),
              (right, "buffers_per_claimed_job", "shared buffers per claimed job (log)",
               "Work: buffers hit + read / jobs claimed"))
    plain_numbers = matplotlib.ticker.FuncFormatter(lambda value, _pos: f"{value:,.10g}")
    for axis, column, label, title in panels:
        for variant in VARIANTS:
            rows = frame[(frame["variant"] == variant) & frame[column].notna()]
            axis.plot(rows["size"], rows[column], label=variant, linewidth=2, markersize=7,
                      **_STYLE[variant])
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xticks(sizes)
        axis.set_xticklabels([_short(n) for n in sizes])
        axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        axis.yaxis.set_major_formatter(plain_numbers)
        axis.set_xlabel("jobs in the table (log)")
        axis.set_ylabel(label)
        axis.set_title(title)
        axis.grid(alpha=0.3, which="both")
        axis.legend(title="indexes / table state", loc="upper left")
    fig.suptitle("skiplock plans: the claim's cost as the jobs table grows and bloats\n"
                 + subtitle)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _short(n: int) -> str:
    """10k, 1M, 2.5M, 12345: a size as people say it."""
    for unit, factor in (("M", 1_000_000), ("k", 1_000)):
        if n >= factor and (n * 10) % factor == 0:
            return f"{n / factor:g}{unit}"
    return f"{n:,}"


def _say(line: str) -> None:
    print(line, flush=True)
