"""`skiplock bench queue`: queue-only throughput (enqueue, claim, complete; no HTTP) through
`PgQueue` with W worker processes, against the raw-SQL ceiling on the same server in the same
run: the very claim and finish statements of `queue_impl/sql/reference.sql`, driven by
`pgbench` with W clients and no Python in the loop. The ratio says what the Python layer costs.

Both phases start from an identical freshly prefilled table in their own schema, with durable
server settings (fsync, synchronous_commit and full_page_writes on), and one "cycle" means the
same thing in both: claim a batch in one transaction, then finish it in another.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from skiplock.plumbing.errors import HarnessError, UsageError
from skiplock.reports.selfdescribe import describe
from skiplock.scenarios.bench.common import (
    MAX_ROUNDS,
    NO_RATIO,
    Params,
    bad_rounds,
    percentile,
    processes_in_step,
    ratio_of,
    result_path,
    say_progress,
)
from skiplock.scenarios.servers.postgres import pg_binary, postgres

LEASE = timedelta(seconds=300)
ENQUEUE_CHUNK = 5_000
# Generous on purpose: a phase that runs out of due jobs measures an empty queue, not the
# queue. Running dry is detected, and no ratio is given with a phase that did. (8,000 a
# second ran dry on 2026-12-05: both the reference and pgqueuer drained 9,500 a second on
# two cores, and both emptied their backlog before the time was up.)
PREFILL_JOBS_PER_SECOND = 20_000
PREFILL_MIN = 20_000


@dataclass(frozen=True, kw_only=True)
class PhaseResult:
    """One phase's figures. Latencies are per cycle (claim + finish of one batch), in ms."""

    jobs: int
    cycles: int
    seconds: float
    jobs_per_second: float
    cycle_p50_ms: float | None
    cycle_p99_ms: float | None
    ran_dry: bool
    extra: Mapping[str, Any]


# --- command line ------------------------------------------------------------------------


FILLS = ("vacuumed", "fresh")
# The two durability classes a comparison runs in, and what each means for each store.
DURABILITY: Mapping[str, str] = {
    "fsync": "each commit and each Redis write waits for its fsync",
    "relaxed": "PostgreSQL sessions synchronous_commit=off, Redis appendfsync everysec",
}


def session_dsn(dsn: str, durability: str) -> str:
    """The DSN the phases connect with: for `relaxed`, each session commits without waiting
    for its WAL flush (the server keeps fsync on, so nothing but the last moments is lost)."""
    if durability == "fsync":
        return dsn
    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items() if v is not None}
    params["options"] = " ".join(filter(None, [params.get("options"),
                                               "-c synchronous_commit=off"]))
    return make_conninfo(**params)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--batch", type=int, default=10, help="jobs per claim (default 10)")
    parser.add_argument(
        "--duration", type=float, default=10.0, help="seconds per phase (default 10)"
    )
    parser.add_argument(
        "--prefill",
        type=int,
        default=None,
        help=f"jobs enqueued before each phase (default: {PREFILL_JOBS_PER_SECOND}/s of "
        f"duration, at least {PREFILL_MIN})",
    )
    parser.add_argument(
        "--against", choices=["pgqueuer", "bullmq"], default=None,
        help="also measure pgqueuer (its own QueueManager; pip install 'skiplock[pgqueuer]') "
        "on the same server, or BullMQ (its own Worker) on a Redis fsynced per write, with "
        "the same workers, batch and backlog",
    )
    parser.add_argument(
        "--durability", choices=list(DURABILITY), default="fsync",
        help="fsync: every commit (and, for BullMQ, every Redis write) waits for its fsync "
        "(default); relaxed: PostgreSQL sessions with synchronous_commit=off and Redis with "
        "appendfsync everysec, both losing up to about a second of acknowledged work in an "
        "OS crash",
    )
    parser.add_argument(
        "--redis-url", default=None,
        help="Redis for --against bullmq (default: SKIPLOCK_REDIS_URL, else Docker, else "
        "embedded)",
    )
    parser.add_argument(
        "--fill", choices=FILLS, default="vacuumed",
        help="the backlog each phase drains: vacuumed (VACUUM ANALYZE after the fill; "
        "default) or fresh (just inserted and only ANALYZEd, as a busy queue's rows are)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1,
        help=f"measure every phase this many times, alternating (1 to {MAX_ROUNDS}; default"
        " 1): the result keeps each round, so `skiplock compare` can tell noise from a change",
    )
    parser.add_argument(
        "--dsn", default=None, help="PostgreSQL DSN (default: SKIPLOCK_PG_DSN, else embedded)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON result file (default ./bench-results/queue-TIMESTAMP.json)",
    )


def validate(args: argparse.Namespace) -> Params:
    """One line per mistake, raised as UsageError (exit 2)."""
    for name in ("workers", "batch"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name} must be a positive integer, got {getattr(args, name)}")
    if not (math.isfinite(args.duration) and args.duration > 0):
        raise UsageError(f"--duration must be a positive number of seconds, got {args.duration}")
    prefill = args.prefill
    if prefill is None:
        prefill = max(PREFILL_MIN, int(PREFILL_JOBS_PER_SECOND * args.duration))
    if prefill <= 0:
        raise UsageError(f"--prefill must be a positive integer, got {prefill}")
    if (bad := bad_rounds(getattr(args, "rounds", 1))) is not None:
        raise UsageError(bad)
    return Params(
        workers=args.workers, batch=args.batch, duration=float(args.duration), prefill=prefill,
        fill=getattr(args, "fill", "vacuumed"),
    )


def run(args: argparse.Namespace) -> int:
    params = validate(args)
    against = getattr(args, "against", None)
    out = _checked_inputs(args, against)
    with postgres(args.dsn, durable=True) as server:
        settings = server.settings()
        _say_setup(server, settings, params, args.durability)
        dsn = session_dsn(server.dsn, args.durability)
        with contextlib.ExitStack() as stack:
            redis = None
            if against == "bullmq":
                # Reached before the PostgreSQL phases: a bad Redis URL is said at once.
                from skiplock.scenarios.bench.bullmq import redis_for

                redis = stack.enter_context(redis_for(args.redis_url, args.durability, _say))
            rounds = []
            for number in range(args.rounds):
                if args.rounds > 1:
                    _say(f"round {number + 1} of {args.rounds}")
                rounds.append(_one_round(dsn, params, against, redis))
    # The round whose PgQueue rate is the median stands for the result; every round is kept.
    result, other = sorted(rounds, key=lambda r: r[0]["queue"].jobs_per_second)[
        len(rounds) // 2]
    ratio = ratio_of(result["queue"], result["ceiling"])
    doc = _result_doc(args, params, server, settings, rounds, (result, other), ratio)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    _print_summary(result["queue"], result["ceiling"], ratio)
    if len(rounds) > 1:
        _say_rounds(doc["rounds"], against)
    if other is not None and against is not None:
        how = "its QueueManager" if against == "pgqueuer" else "its Worker"
        _say(f"{against} {other['version']} ({how}): "
             f"{other['jobs_per_second']:,.0f} jobs/s, {other['jobs']} jobs"
             + (" (ran dry: raise --prefill)" if other["ran_dry"] else ""))
        versus = doc[f"ratio_to_{against}"]
        _say(f"ratio PgQueue/{against}: "
             + (f"{versus:.2f}" if versus is not None else NO_RATIO))
    _say(f"written: {out}")
    return 0


def _checked_inputs(args: argparse.Namespace, against: str | None) -> Path:
    """Everything the command line must get right, said before anything runs; the result
    file's path."""
    if against == "pgqueuer":
        from skiplock.scenarios.bench.pgqueuer import require_pgqueuer

        require_pgqueuer()
    elif against == "bullmq":
        from skiplock.scenarios.bench.bullmq import require_bullmq

        require_bullmq()
    if getattr(args, "redis_url", None) is not None and against != "bullmq":
        raise UsageError("--redis-url is only used with --against bullmq")
    return result_path(args.out, "queue")


def _say_setup(server: Any, settings: Mapping[str, Any], params: Params,
               durability: str) -> None:
    _say(
        f"server: {server.kind} {server.display}, PostgreSQL {settings['server_version']}, "
        f"fsync={settings['fsync']} synchronous_commit={settings['synchronous_commit']} "
        f"full_page_writes={settings['full_page_writes']}"
        + ("" if settings["durable"] else "  (NOT durable: figures are not comparable)")
    )
    _say(
        f"params: workers={params.workers} batch={params.batch} "
        f"duration={params.duration:g}s prefill={params.prefill} "
        f"fill={params.fill} durability={durability} ({DURABILITY[durability]})"
    )


def _result_doc(args: argparse.Namespace, params: Params, server: Any,
                settings: Mapping[str, Any], rounds: list[Any], chosen: tuple[Any, Any],
                ratio: float | None) -> dict[str, Any]:
    """The self-describing result: the median round's figures, and every round's."""
    (result, other), against = chosen, getattr(args, "against", None)
    return {
        "benchmark": "queue",
        "finished_at": datetime.now(UTC).isoformat(),
        "params": {**asdict(params), "rounds": args.rounds},
        "durability": args.durability,
        # Durable only if every store measured was: a Redis given by URL may run relaxed.
        "durable": (settings["durable"] and args.durability == "fsync"
                    and (against != "bullmq" or bool(other and other["redis"]["durable"]))),
        "postgres": {**settings, "session_synchronous_commit": (
            "off" if args.durability == "relaxed" else settings["synchronous_commit"])},
        "server": {"kind": server.kind, "dsn": server.display},
        **describe(),
        "enqueue": result["enqueue"],
        "queue": asdict(result["queue"]),
        "ceiling": asdict(result["ceiling"]),
        "ratio": ratio,
        **(_versus(result, other, against) if other and against else {}),
        "rounds": [_round_figures(r, o, against) for r, o in rounds],
    }


def _say(line: str) -> None:
    print(line, flush=True)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# Why the queue can beat its "ceiling": the two run the same statements, not the same way.
CEILING_BEATEN = (
    "above 1: the ceiling is pgbench sending the same statements one round trip each, while"
    " PgQueue pipelines its claim and result write and plans each statement once, generically;"
    " read it as 'the Python layer costs nothing measurable here', not as faster SQL")


def _print_summary(queue: PhaseResult, ceiling: PhaseResult, ratio: float | None) -> None:
    rows = [
        ("phase", "jobs/s", "p50 ms", "p99 ms", "jobs", "ran dry"),
        (
            "PgQueue (Python)",
            f"{queue.jobs_per_second:,.0f}",
            _ms(queue.cycle_p50_ms),
            _ms(queue.cycle_p99_ms),
            str(queue.jobs),
            "yes" if queue.ran_dry else "no",
        ),
        (
            "raw SQL (pgbench)",
            f"{ceiling.jobs_per_second:,.0f}",
            _ms(ceiling.cycle_p50_ms),
            _ms(ceiling.cycle_p99_ms),
            str(ceiling.jobs),
            "yes" if ceiling.ran_dry else "no",
        ),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        _say("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    _say("latency: one cycle = finish the batch in hand and claim the next (one transaction)")
    _say(f"ratio queue/ceiling: {NO_RATIO if ratio is None else f'{ratio:.2f}'}")
    if ratio is not None and ratio > 1:
        _say(CEILING_BEATEN)
    if queue.ran_dry or ceiling.ran_dry:
        _say("warning: a phase ran out of due jobs; raise --prefill and run again")


def _one_round(dsn: str, params: Params, against: str | None,
               redis: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The other queue's phase, if any, then the reference's two. The two queues compared
    run back to back, the reference's prefill between them: with the raw-SQL ceiling
    between them instead, they were half a minute apart, and this machine's speed can
    change several times within that (a round measured PgQueue at 2,900 jobs/s for four
    seconds, then at 10,000)."""
    other: dict[str, Any] | None = None
    if against == "bullmq":
        from skiplock.scenarios.bench.bullmq import bullmq_phase, redis_record

        other = {**bullmq_phase(redis.url, workers=params.workers, batch=params.batch,
                                duration=params.duration, prefill=params.prefill, say=_say),
                 "redis": redis_record(redis)}
    elif against == "pgqueuer":
        from skiplock.scenarios.bench.pgqueuer import pgqueuer_phase

        other = pgqueuer_phase(dsn, workers=params.workers, batch=params.batch,
                               duration=params.duration, prefill=params.prefill, say=_say,
                               vacuum=params.fill == "vacuumed")
    return measure(dsn, params), other


def _versus(result: dict[str, Any], other: dict[str, Any], against: str) -> dict[str, Any]:
    return {against: other, f"ratio_to_{against}": ratio_of(result["queue"], other)}


def _round_figures(result: dict[str, Any], other: dict[str, Any] | None,
                   against: str | None) -> dict[str, Any]:
    """One round's figures, shaped as the result's own (so a reader takes them alike)."""
    queue, ceiling = result["queue"].jobs_per_second, result["ceiling"].jobs_per_second
    figures: dict[str, Any] = {"queue": {"jobs_per_second": queue},
                               "ceiling": {"jobs_per_second": ceiling},
                               "ratio": ratio_of(result["queue"], result["ceiling"])}
    if other is not None and against is not None:
        versus = _versus(result, other, against)
        figures |= {against: {"jobs_per_second": other["jobs_per_second"]},
                    f"ratio_to_{against}": versus[f"ratio_to_{against}"]}
    return figures


def by_round(rounds: Sequence[Mapping[str, Any]],
             columns: Sequence[tuple[str, Callable[[Mapping[str, Any]], float | None]]]) -> str:
    """One line of each figure's value in every round: `by round: NAME a, b, c; ...`."""
    def each(value: Callable[[Mapping[str, Any]], float | None]) -> str:
        return ", ".join("-" if (v := value(r)) is None else f"{v:,.2f}" if v < 10
                         else f"{v:,.0f}" for r in rounds)

    return "by round: " + "; ".join(f"{name} {each(value)}" for name, value in columns)


def _say_rounds(rounds: Sequence[dict[str, Any]], against: str | None) -> None:
    columns: list[tuple[str, Callable[[Mapping[str, Any]], float | None]]] = [
        ("PgQueue jobs/s", lambda r: r["queue"]["jobs_per_second"]),
        ("ratio queue/ceiling", lambda r: r["ratio"])]
    if against:
        columns.append((f"ratio PgQueue/{against}", lambda r: r[f"ratio_to_{against}"]))
    _say(by_round(rounds, columns))


# --- the measurement ---------------------------------------------------------------------


def measure(dsn: str, params: Params) -> dict[str, Any]:
    """Both phases on one server, each on its own freshly prefilled schema."""
    run_id = uuid.uuid4().hex[:8]
    queue_schema = f"bench_q_{run_id}"
    ceiling_schema = f"bench_c_{run_id}"
    try:
        _say(f"prefill: {params.prefill} jobs for the PgQueue phase")
        enqueue = prefill(dsn, queue_schema, params.prefill,
                          vacuum=params.fill == "vacuumed")
        _say(f"prefill: {enqueue['jobs_per_second']:,.0f} jobs/s enqueued")
        queue = queue_phase(dsn, queue_schema, params)
        _say(f"prefill: {params.prefill} jobs for the pgbench phase")
        prefill(dsn, ceiling_schema, params.prefill, vacuum=params.fill == "vacuumed")
        ceiling = _pgbench_phase(dsn, ceiling_schema, params)
    finally:
        drop_schemas(dsn, [queue_schema, ceiling_schema])
    return {"enqueue": enqueue, "queue": queue, "ceiling": ceiling}


def prefill(dsn: str, schema: str, count: int, *,
             target_url: str = "http://127.0.0.1:9/deliver",
             vacuum: bool = True) -> dict[str, Any]:
    from skiplock.queue_impl.interface import NewJob
    from skiplock.queue_impl.pg import PgQueue

    queue = PgQueue(dsn, schema=schema)
    try:
        queue.setup()
        started = time.perf_counter()
        done = 0
        while done < count:
            size = min(ENQUEUE_CHUNK, count - done)
            queue.enqueue(
                [
                    NewJob(
                        id=uuid.uuid4(),
                        account_id=f"acct-{(done + i) % 8}",
                        # Never called by the queue-only phase (it has no HTTP).
                        target_url=target_url,
                        payload={"n": done + i},
                        max_attempts=3,
                    )
                    for i in range(size)
                ]
            )
            done += size
        seconds = time.perf_counter() - started
    finally:
        queue.close()
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Same starting point for both phases: fresh statistics, nothing to flush; and the
        # visibility map set by VACUUM, unless the backlog is to be met as it arrived.
        command = "VACUUM ANALYZE {}.jobs" if vacuum else "ANALYZE {}.jobs"
        conn.execute(sql.SQL(command).format(sql.Identifier(schema)))
        conn.execute("CHECKPOINT")
    return {"jobs": count, "seconds": seconds, "jobs_per_second": count / seconds}


def drop_schemas(dsn: str, schemas: Sequence[str]) -> None:
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            for schema in schemas:
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                )
    except psycopg.Error as exc:
        print(f"warning: could not drop bench schemas: {exc}", file=sys.stderr)


def _pending(dsn: str, schema: str) -> int:
    return _with_status(dsn, schema, "PENDING")


def _with_status(dsn: str, schema: str, status: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        query = sql.SQL("SELECT count(*) FROM {}.jobs WHERE status = %s").format(
            sql.Identifier(schema)
        )
        row = conn.execute(query, (status,)).fetchone()
    return int(row[0]) if row else 0


# --- phase 1: PgQueue in W processes ------------------------------------------------------


def _queue_worker(
    dsn: str,
    schema: str,
    batch: int,
    index: int,
    out_path: str,
    ready: Any,
    go: Any,
    start_at: Any,
    progress: Any,
) -> None:
    """One benchmark worker process: its own queue and connection, opened here, after the
    fork. Until the shared deadline, each cycle writes the batch in hand and claims the next
    in one transaction (`finish_and_claim`), as a worker that finishes a batch and takes the
    next does; then it finishes what it holds and writes its figures to a file. A job counts
    once its result is written inside the window."""
    from skiplock.queue_impl.interface import AttemptResult, Outcome, WriteResult
    from skiplock.queue_impl.pg import PgQueue

    # Ctrl-C is the parent's to handle: it stops every worker and the server in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    queue = PgQueue(dsn, schema=schema)
    worker_id = f"bench-{index}"

    def succeeded(leases: list[Any]) -> list[AttemptResult]:
        return [AttemptResult(lease=lease, outcome=Outcome.SUCCESS, http_status=200)
                for lease in leases]

    try:
        # Connect and run each statement once before the clock starts (not counted).
        _, warm = queue.finish_and_claim([], worker_id, 1, LEASE)
        queue.finish_and_claim(succeeded(warm), worker_id, 1, LEASE)
        ready.release()
        go.wait()
        deadline = start_at.value
        cycles: list[float] = []
        jobs = 0
        held: list[Any] = []
        ran_dry = False
        now = time.monotonic()
        while now < deadline:
            t0 = time.perf_counter()
            written, held = queue.finish_and_claim(succeeded(held), worker_id, batch, LEASE)
            cycles.append((time.perf_counter() - t0) * 1000)
            jobs += written.count(WriteResult.APPLIED)
            progress[index] = jobs
            if not held:
                ran_dry = True
                break
            now = time.monotonic()
        # Past the deadline: what is still held is written, not counted.
        queue.finish(succeeded(held))
        Path(out_path).write_text(json.dumps({"jobs": jobs, "cycles": cycles,
                                              "ran_dry": ran_dry}))
    finally:
        queue.close()


def queue_phase(dsn: str, schema: str, params: Params) -> PhaseResult:
    import multiprocess

    ctx = multiprocess.get_context("fork")
    ready = ctx.Semaphore(0)
    go = ctx.Event()
    start_at = ctx.Value("d", 0.0, lock=False)
    # One slot per worker, each written by its own worker only: no lock needed.
    progress = ctx.Array("q", params.workers, lock=False)
    with tempfile.TemporaryDirectory(prefix="skiplock-bench-") as tmp:
        outs = [str(Path(tmp) / f"worker-{i}.json") for i in range(params.workers)]
        procs = [
            ctx.Process(
                target=_queue_worker,
                args=(dsn, schema, params.batch, i, outs[i], ready, go, start_at, progress),
                name=f"bench-{i}",
                daemon=True,
            )
            for i in range(params.workers)
        ]
        with processes_in_step(procs, ready, what="PgQueue",
                               join_seconds=params.duration + 60):
            _say(f"PgQueue: {params.workers} worker processes, {params.duration:g} s")
            start_at.value = time.monotonic() + params.duration
            go.set()
            say_progress(procs, params.duration, lambda: sum(progress), _say)
        figures = [json.loads(Path(path).read_text()) for path in outs]
    jobs = sum(f["jobs"] for f in figures)
    cycles = sorted(c for f in figures for c in f["cycles"])
    seconds = params.duration
    return PhaseResult(
        jobs=jobs,
        cycles=len(cycles),
        seconds=seconds,
        jobs_per_second=jobs / seconds,
        cycle_p50_ms=percentile(cycles, 0.50),
        cycle_p99_ms=percentile(cycles, 0.99),
        ran_dry=any(f["ran_dry"] for f in figures),
        extra={
            "driver": "skiplock.queue_impl.pg.PgQueue (variant pg), finish_and_claim, "
                      "multiprocess fork",
        },
    )


# --- phase 2: the same SQL through pgbench -------------------------------------------------

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


def _block_sql(text: str) -> str:
    """A named block without its comment lines and trailing semicolon."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("--")]
    return "\n".join(lines).strip().rstrip(";").strip()


def pgbench_script(statements: Mapping[str, str]) -> str:
    """The reference claim and finish as a pgbench script, one transaction a cycle as
    PgQueue's `finish_and_claim`: the finish of the rows the client's previous cycle claimed,
    then the claim. The statements are unchanged except that placeholders become pgbench
    variables and the claim's final SELECT hands the claimed rows to the next cycle's finish
    as arrays (`\\gset`: a client's variables outlive its transaction; `PGBENCH_FIRST`
    gives the first cycle nothing to finish)."""
    lock = _block_sql(statements["claim_lock_accounts"])
    claim = _block_sql(statements["claim"])
    finish = _block_sql(statements["finish"])
    # The claim's last line returns the claimed rows (in some order); the finish needs them,
    # in any order.
    tail = re.search(r"\nSELECT [^\n]*\bFROM claimed\b[^\n]*\s*$", claim)
    if tail is None:
        raise HarnessError(
            "the claim block no longer ends with a one-line SELECT ... FROM claimed ..."
        )
    # Every benchmark account is unlimited, so step 1 locks none and step 2 gets '{}', as
    # PgQueue passes the (empty) list of locked accounts.
    handover = (
        "\nSELECT"
        " COALESCE(array_agg(ord)::text, '{}') AS ords,"
        " COALESCE(array_agg(id)::text, '{}') AS job_ids,"
        " COALESCE(array_agg(lease_token)::text, '{}') AS lease_tokens,"
        " COALESCE(array_agg(attempts)::text, '{}') AS attempts,"
        " COALESCE(array_agg(locked_by)::text, '{}') AS workers,"
        " COALESCE(array_agg('success'::text)::text, '{}') AS outcomes,"
        " COALESCE(array_agg(200)::text, '{}') AS http_statuses,"
        " COALESCE(array_agg(NULL::text)::text, '{}') AS errors,"
        " COALESCE(array_agg('0'::interval)::text, '{}') AS retry_delays,"
        " COALESCE(array_agg(NULL::timestamptz)::text, '{}') AS finished_ats,"
        " count(*) AS claimed_n"
        " FROM (SELECT (row_number() OVER () - 1)::integer AS ord, * FROM claimed) AS c"
    )
    claim = claim[: tail.start()] + handover
    lock = _PLACEHOLDER.sub(lambda m: ":" + m.group(1), lock)
    claim = _PLACEHOLDER.sub(lambda m: ":" + m.group(1), claim)
    finish = _PLACEHOLDER.sub(lambda m: ":" + m.group(1), finish)
    return "\n".join(
        [
            "BEGIN;",
            finish + ";",
            lock + ";",
            claim.replace(":locked_accounts", "'{}'") + " \\gset",
            "COMMIT;",
            "",
        ]
    )


# The variables the claim's hand-over sets, empty for a client's first finish.
PGBENCH_FIRST = ("ords", "job_ids", "lease_tokens", "attempts", "workers", "outcomes",
                 "http_statuses", "errors", "retry_delays", "finished_ats")


def _pg_env(dsn: str, schema: str) -> dict[str, str]:
    """libpq environment for pgbench: the DSN's parts (password included, never printed)."""
    names = {
        "host": "PGHOST",
        "hostaddr": "PGHOSTADDR",
        "port": "PGPORT",
        "user": "PGUSER",
        "password": "PGPASSWORD",
        "dbname": "PGDATABASE",
        "sslmode": "PGSSLMODE",
        "passfile": "PGPASSFILE",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    for key, value in conninfo_to_dict(dsn).items():
        if key in names and value is not None:
            env[names[key]] = str(value)
    # pgbench sessions see the schema as PgQueue's connections do (and the DSN's options,
    # such as a relaxed synchronous_commit, as theirs do).
    options = conninfo_to_dict(dsn).get("options")
    env["PGOPTIONS"] = " ".join(filter(None, [str(options or ""), f"-c search_path={schema}"]))
    env["PGAPPNAME"] = "skiplock-bench-pgbench"
    return env


def _pgbench_argv(pgbench: Path, params: Params, duration: int, folder: Path,
                  script: Path) -> list[str]:
    """pgbench's command line: W clients, prepared statements, per-transaction logs."""
    return [
        str(pgbench),
        "--no-vacuum",
        "--protocol=prepared",
        f"--client={params.workers}",
        f"--jobs={params.workers}",
        f"--time={duration}",
        "--progress=1",
        "--log",
        f"--log-prefix={folder / 'tx'}",
        f"--file={script}",
        f"--define=batch={params.batch}",
        f"--define=lease={int(LEASE.total_seconds())} seconds",
        "--define=worker_id=pgbench",
        *(f"--define={name}={{}}" for name in PGBENCH_FIRST),
    ]


def _pgbench_phase(dsn: str, schema: str, params: Params) -> PhaseResult:
    from skiplock.queue_impl.sqlfile import reference_statements

    pgbench = pg_binary("pgbench")
    before = _pending(dsn, schema)
    completed_before = _with_status(dsn, schema, "COMPLETED")
    duration = max(1, round(params.duration))
    with tempfile.TemporaryDirectory(prefix="skiplock-pgbench-") as tmp:
        script = Path(tmp) / "claim_finish.sql"
        script.write_text(pgbench_script(reference_statements()))
        argv = _pgbench_argv(pgbench, params, duration, Path(tmp), script)
        _say(f"pgbench: {params.workers} clients, {duration} s, the reference claim + finish")
        proc = subprocess.Popen(
            argv,
            env=_pg_env(dsn, schema),
            cwd=tmp,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        output: list[str] = []
        assert proc.stdout is not None
        with proc:
            for line in proc.stdout:
                output.append(line.rstrip("\n"))
                if line.startswith("progress:"):
                    _say("  " + line.strip())
        if proc.returncode != 0:
            tail = " / ".join(ln for ln in output[-3:] if ln.strip())
            raise HarnessError(f"pgbench failed (exit {proc.returncode}): {tail}")
        latencies = sorted(_read_pgbench_logs(Path(tmp)))
    after = _pending(dsn, schema)
    jobs = before - after
    # Jobs the ceiling claimed, of which all but each client's last batch were finished.
    finished = _with_status(dsn, schema, "COMPLETED") - completed_before
    return PhaseResult(
        jobs=jobs,
        cycles=len(latencies),
        seconds=float(duration),
        jobs_per_second=jobs / duration,
        cycle_p50_ms=percentile(latencies, 0.50),
        cycle_p99_ms=percentile(latencies, 0.99),
        ran_dry=after == 0,
        extra={
            "driver": "pgbench --protocol=prepared, statements from queue_impl/sql/reference.sql",
            "pgbench_summary": [ln for ln in output if not ln.startswith("progress:")][-12:],
            "finished": finished,
        },
    )


def _read_pgbench_logs(folder: Path) -> list[float]:
    """Per-transaction latencies (ms) from pgbench's --log files: the 3rd field is in µs."""
    out: list[float] = []
    for path in folder.glob("tx*"):
        for line in path.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3 and fields[2].isdigit():
                out.append(int(fields[2]) / 1000.0)
    return out


