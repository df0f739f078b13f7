"""`skiplock bench e2e`: the queue alone, then the full path, side by side in one command.

Phase 1 is `skiplock bench queue`'s PgQueue phase: W processes claim a batch and finish it
in a loop, no HTTP. Phase 2 drains the same backlog through the real path: W dispatcher
worker processes (the same batch, as slots) claim, POST each job to an echo target in its own
process over loopback, and write the results, with their event logs on as in a run. Both
start from an identical freshly filled table (one schema each) on the same server, durable
settings. Phase 2 drains a prefilled backlog, so no producer can be the limit. The ratio
end-to-end / queue-only says what the dispatcher, HTTP and the target cost on top of the
queue; the CPU seconds of the workers and the target over the phase say where it went.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from skiplock.plumbing.errors import UsageError
from skiplock.reports.selfdescribe import describe
from skiplock.scenarios.bench import queue as bench_queue
from skiplock.scenarios.bench.common import (
    MAX_ROUNDS,
    NO_RATIO,
    Params,
    bad_rounds,
    ratio_of,
    result_path,
)
from skiplock.scenarios.bench.window import STAGES, E2eResult, judge_window, timed_window
from skiplock.scenarios.servers.postgres import postgres

DEFAULT_DURATION = 10.0
# Jobs per second of duration put in each phase's backlog: more than either phase can take
# (with batch 20 and a claim in one round trip, the queue alone drained 9,100 to 10,800
# jobs/s here, and emptied a backlog of 6,000 a second of duration before its time was up).
PREFILL_JOBS_PER_SECOND = 16_000


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--batch", type=int, default=20,
                        help="jobs per claim, and calls in flight per worker (default 20)")
    parser.add_argument("--duration", type=float, default=DEFAULT_DURATION,
                        help="seconds per phase (default 10)")
    parser.add_argument("--prefill", type=int, default=None,
                        help=f"jobs in each phase's backlog (default {PREFILL_JOBS_PER_SECOND}"
                             "/s of duration)")
    parser.add_argument("--barrier", action="store_true",
                        help="phase 2 with the batch barrier instead of slot refills")
    parser.add_argument("--against", choices=["bullmq", "pgqueuer"], default=None,
                        help="phase 3: the same path with BullMQ as the queue (its own Worker, "
                             "skiplock's delivery, the same target), or pgqueuer's own "
                             "QueueManager whose entrypoint POSTs each job with aiohttp")
    parser.add_argument("--durability", choices=list(bench_queue.DURABILITY), default="fsync",
                        help="fsync: every commit and Redis write waits for its fsync "
                             "(default); relaxed: synchronous_commit=off sessions and "
                             "appendfsync everysec")
    parser.add_argument("--redis-url", default=None,
                        help="Redis for --against bullmq (default: SKIPLOCK_REDIS_URL, else "
                             "Docker, else embedded)")
    parser.add_argument("--rounds", type=int, default=1,
                        help=f"measure every phase this many times, alternating (1 to "
                             f"{MAX_ROUNDS}; default 1): the result keeps each "
                             "round, so `skiplock compare` can tell noise from a change")
    parser.add_argument("--dsn", default=None,
                        help="PostgreSQL DSN (default: SKIPLOCK_PG_DSN, else embedded)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON result file (default ./bench-results/e2e-TIMESTAMP.json)")


def _validate(args: argparse.Namespace) -> tuple[Params, Path]:
    for name in ("workers", "batch"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name} must be a positive integer, got {getattr(args, name)}")
    if not (math.isfinite(args.duration) and args.duration > 0):
        raise UsageError(f"--duration must be a positive number of seconds, got {args.duration}")
    prefill = args.prefill or max(5_000, int(PREFILL_JOBS_PER_SECOND * args.duration))
    if prefill <= 0:
        raise UsageError(f"--prefill must be a positive integer, got {prefill}")
    if args.against == "bullmq":
        from skiplock.scenarios.bench.bullmq import require_bullmq

        require_bullmq()
    elif args.against == "pgqueuer":
        from skiplock.scenarios.bench.pgqueuer import require_pgqueuer

        require_pgqueuer()
    if args.against != "bullmq" and args.redis_url is not None:
        raise UsageError("--redis-url is only used with --against bullmq")
    if (bad := bad_rounds(args.rounds)) is not None:
        raise UsageError(bad)
    out = result_path(args.out, "e2e")
    return Params(workers=args.workers, batch=args.batch,
                              duration=float(args.duration), prefill=prefill), out


def run(args: argparse.Namespace) -> int:
    params, out = _validate(args)
    with postgres(args.dsn, durable=True) as server:
        settings = server.settings()
        _say(f"server: {server.kind} {server.display}, PostgreSQL {settings['server_version']}"
             + ("" if settings["durable"] else "  (NOT durable: figures are not comparable)"))
        _say(f"params: workers={params.workers} batch={params.batch} "
             f"duration={params.duration:g}s prefill={params.prefill}"
             + (" barrier" if args.barrier else "")
             + f" durability={args.durability} ({bench_queue.DURABILITY[args.durability]})")
        dsn = bench_queue.session_dsn(server.dsn, args.durability)
        with contextlib.ExitStack() as stack:
            redis = None
            if args.against == "bullmq":
                # Before the PostgreSQL phases: a bad Redis URL is said at once.
                from skiplock.scenarios.bench.bullmq import redis_for

                redis = stack.enter_context(redis_for(args.redis_url, args.durability, _say))
            rounds = []
            for number in range(args.rounds):
                if args.rounds > 1:
                    _say(f"round {number + 1} of {args.rounds}")
                rounds.append(_one_round(server.dsn, dsn, params, args, redis))
    # The round whose end-to-end rate is the median stands for the result; every round is
    # kept, so a comparison can tell a change from the spread of the rounds.
    result = sorted(rounds, key=lambda r: r["e2e"]["jobs_per_second"])[len(rounds) // 2]
    other = result.get(args.against) if args.against else None
    doc = {"benchmark": "e2e", "finished_at": datetime.now(UTC).isoformat(),
           "params": {**asdict(params), "refill": not args.barrier, "rounds": args.rounds},
           "durability": args.durability,
           "durable": (settings["durable"] and args.durability == "fsync"
                       and (other is None or "redis" not in other
                            or bool(other["redis"]["durable"]))),
           "postgres": {**settings, "session_synchronous_commit": (
               "off" if args.durability == "relaxed" else settings["synchronous_commit"])},
           "server": {"kind": server.kind, "dsn": server.display}, **describe(),
           **result, "rounds": rounds}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    _print_summary(doc)
    if len(rounds) > 1:
        _say_rounds(rounds, args.against)
    _say(f"written: {out}")
    return 0


def _one_round(admin_dsn: str, dsn: str, params: Params, args: argparse.Namespace,
               redis: Any) -> dict[str, Any]:
    """Every phase once, each on its own freshly prefilled schema: the queue alone, the
    dispatcher end to end, and the system compared against, if any."""
    run_id = uuid.uuid4().hex[:8]
    schemas = [f"bench_q_{run_id}", f"bench_e_{run_id}"]
    try:
        _say(f"phase 1, queue only: prefill {params.prefill} jobs")
        bench_queue.prefill(dsn, schemas[0], params.prefill)
        queue = bench_queue.queue_phase(dsn, schemas[0], params)
        _say(f"phase 2, end to end: prefill {params.prefill} jobs")
        e2e = e2e_phase(dsn, schemas[1], params, refill=not args.barrier)
    finally:
        bench_queue.drop_schemas(admin_dsn, schemas)
    other: dict[str, Any] | None = None
    if redis is not None:
        from skiplock.scenarios.bench.bullmq import bullmq_e2e_phase, redis_record

        _say("phase 3, BullMQ end to end")
        other = {"redis": redis_record(redis),
                 **asdict(bullmq_e2e_phase(redis.url, params, _say))}
    elif args.against == "pgqueuer":
        from skiplock.scenarios.bench.pgqueuer import pgqueuer_e2e_phase

        _say("phase 3, pgqueuer end to end")
        other = pgqueuer_e2e_phase(dsn, params, _say)
    found: dict[str, Any] = {
        "queue": asdict(queue), "e2e": asdict(e2e),
        "ratio": ratio_of(e2e, queue)}
    if other is not None and args.against is not None:
        found[args.against] = other
        found[f"ratio_to_{args.against}"] = ratio_of(e2e, other)
    return found


def _say_rounds(rounds: Sequence[Mapping[str, Any]], against: str | None) -> None:
    columns: list[tuple[str, Callable[[Mapping[str, Any]], float | None]]] = [
        ("end to end jobs/s", lambda r: r["e2e"]["jobs_per_second"]),
        ("queue only jobs/s", lambda r: r["queue"]["jobs_per_second"])]
    if against:
        columns.append((f"ratio PgQueue/{against}", lambda r: r[f"ratio_to_{against}"]))
    _say(bench_queue.by_round(rounds, columns))


def _e2e_line(label: str, e2e: Mapping[str, Any]) -> str:
    return (f"{label}: {e2e['jobs_per_second']:8,.0f} jobs/s  claim->written p50 "
            f"{_one_decimal(e2e['job_p50_ms'])} ms  p99 {_one_decimal(e2e['job_p99_ms'])} ms  "
            f"CPU s: workers {_one_decimal(e2e['worker_cpu_seconds'])}, "
            f"target {_one_decimal(e2e['target_cpu_seconds'])}"
            + ("  (RAN DRY: raise --prefill)" if e2e["ran_dry"] else ""))


def _stages_line(e2e: Mapping[str, Any]) -> str | None:
    """Where a job's time went, p50 ms per stage; None for a peer's loop, which logs less."""
    stages = e2e.get("stages_p50_ms")
    if not stages:
        return None
    return ("             p50 ms per stage: "
            + ", ".join(f"{name} {stages[name]:.1f}" for name in STAGES if name in stages))


def _cpu_per_job(e2e: Mapping[str, Any]) -> str:
    """Where each job's CPU went, in ms: what bounds the rate once the machine is busy."""
    jobs = e2e["jobs"]
    parts = [(name, e2e.get(key)) for name, key in (
        ("workers", "worker_cpu_seconds"), ("target", "target_cpu_seconds"),
        ("PostgreSQL", "server_cpu_seconds"), ("Redis", "redis_cpu_seconds"))]
    shown = [f"{name} {1000 * value / jobs:.2f}" for name, value in parts
             if value is not None and jobs]
    busy = e2e.get("machine_busy")
    return ("             CPU ms per job: " + (", ".join(shown) or "-")
            + ("" if busy is None else f"  (machine {100 * busy:.0f} % busy)"))


def _print_summary(doc: Mapping[str, Any]) -> None:
    queue, ratio = doc["queue"], doc["ratio"]
    _say(f"queue only : {queue['jobs_per_second']:8,.0f} jobs/s  cycle p50 "
         f"{_one_decimal(queue['cycle_p50_ms'])} ms  p99 "
         f"{_one_decimal(queue['cycle_p99_ms'])} ms"
         + ("  (RAN DRY: raise --prefill)" if queue["ran_dry"] else ""))
    _say(_e2e_line("end to end ", doc["e2e"]))
    _say(_cpu_per_job(doc["e2e"]))
    if (stages := _stages_line(doc["e2e"])) is not None:
        _say(stages)
    _say(f"ratio end to end / queue only: {NO_RATIO if ratio is None else f'{ratio:.2f}'}")
    for system, label in (("bullmq", "BullMQ"), ("pgqueuer", "pgqueuer")):
        if system in doc:
            _say(_e2e_line(f"{label} e2e".ljust(11), doc[system]))
            _say(_cpu_per_job(doc[system]))
            if (stages := _stages_line(doc[system])) is not None:
                _say(stages)
            other = doc[f"ratio_to_{system}"]
            _say(f"ratio PgQueue end to end / {label} end to end: "
                 f"{NO_RATIO if other is None else f'{other:.2f}'}")


def e2e_phase(dsn: str, schema: str, params: Params, *,
              refill: bool = True) -> E2eResult:
    from skiplock.chaos.target import TargetProcess
    from skiplock.queue_impl.config import DispatcherConfig
    from skiplock.queue_impl.plugins import BackendSpec
    from skiplock.scenarios.run.workers import WorkerPool

    with tempfile.TemporaryDirectory(prefix="skiplock-bench-e2e-") as tmp:
        events = Path(tmp) / "workers"
        events.mkdir()
        with TargetProcess(Path(tmp), name="target-0") as target:
            bench_queue.prefill(dsn, schema, params.prefill, target_url=target.deliver_url)
            config = DispatcherConfig(
                batch=params.batch, lease_seconds=30.0, http_timeout_seconds=5.0,
                write_margin_seconds=5.0, poll_seconds=0.5, refill=refill,
                claim_ahead=params.batch,
                allow_targets=(f"127.0.0.1:{target.port}",), seed=1)
            pool = WorkerPool(BackendSpec(name="pg", dsn=dsn, schema=schema), config,
                              params.workers, events)
            try:
                pool.start()
                window = timed_window(list(pool.pids), target, params.duration)
            finally:
                pool.stop()
        return judge_window(events, window, params)




def _one_decimal(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _say(line: str) -> None:
    print(line, flush=True)
