"""`skiplock bench checker --deliveries N`: how long the checker takes on a large history.

It builds a synthetic run directory with N deliveries and the worker events that go with
them (a realistic mix: most jobs succeed at once, some retry with backoff after 503s, a few
are dead-lettered by a 400, a few succeed twice because a worker's result write was lost),
then checks it twice and prints the seconds spent loading and judging: a cold check, which
parses the CSV logs and writes the columnar cache (`skiplock.reports.columnar`), and a warm check of
the same history, which reads the cache. Each check is `skiplock check` in a process of its
own, as a person runs it, after the history is flushed to disk: a check run in the process
that built the history, or after another, starts from the memory they left behind, and
the writeback of a just-written gigabyte would be timed with it. The result JSON records
every round, the cache's size, and the machine, versions and git state it was measured on.

The history is written by `skiplock.reports.synthetic.RunBuilder`, through the same record builders
the producers, the echo target and the dispatcher use.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from skiplock.plumbing.errors import HarnessError
from skiplock.reports import columnar
from skiplock.reports.history import (
    VERDICT_FILE,
    write_json,
)
from skiplock.reports.selfdescribe import describe
from skiplock.reports.synthetic import RunBuilder, history_files
from skiplock.scenarios.bench.common import MAX_ROUNDS, bad_rounds

# --------------------------------------------------------------------------------------------
# The synthetic history.
# --------------------------------------------------------------------------------------------

_FAIL_TWICE = {
    "name": "fail-2x-503",
    "first": {"behaviour": "status", "status": 503},
    "times": 2,
    "then": {"behaviour": "ok"},
}
_ALWAYS_400 = {"name": "always-400", "first": {"behaviour": "status", "status": 400},
               "times": None, "then": {"behaviour": "ok"}}
_SUCCEED = {"name": "succeed", "first": {"behaviour": "ok"}, "times": None,
            "then": {"behaviour": "ok"}}


def _timestamp(seconds: float) -> str:
    """A time as the reference queue's snapshot writes one (`str` of an aware datetime)."""
    return str(datetime.fromtimestamp(seconds, UTC))


def _extra(created: float, finished: float, worker: str) -> dict[str, str]:
    """What the reference queue's snapshot keeps beside the judged columns: a quoted JSON
    field on every row, as in a real final_jobs.csv."""
    return {"created_at": _timestamp(created), "finished_at": _timestamp(finished),
            "locked_by": worker, "run_at": _timestamp(created)}


def _succeed(b: RunBuilder, job_id: str, account: str, worker: str, clock: float) -> int:
    """A job that succeeds at once: one delivery."""
    b.enqueue(job_id, script=_SUCCEED, account=account, time=clock)
    b.attempt(job_id, 1, claimed=clock + 0.01, worker=worker, account=account)
    b.final(job_id, "COMPLETED", account=account, extra=_extra(clock, clock + 0.03, worker))
    return 1


def _retry(b: RunBuilder, job_id: str, account: str, worker: str, clock: float) -> int:
    """A job that fails twice with 503, waits out its backoff, then succeeds."""
    b.enqueue(job_id, script=_FAIL_TWICE, max_attempts=5, account=account, time=clock)
    t = clock + 0.01
    for attempt in (1, 2):
        b.attempt(job_id, attempt, claimed=t, status=503, worker=worker, account=account,
                  behaviour="status")
        t += 0.5 * 2 ** (attempt - 1) + 0.05
    b.attempt(job_id, 3, claimed=t, worker=worker, account=account)
    b.final(job_id, "COMPLETED", attempts=3, max_attempts=5, account=account,
            extra=_extra(clock, t + 0.03, worker))
    return 3


def _dead(b: RunBuilder, job_id: str, account: str, worker: str, clock: float) -> int:
    """A job answered 400: dead-lettered after one delivery."""
    b.enqueue(job_id, script=_ALWAYS_400, account=account, time=clock)
    b.attempt(job_id, 1, claimed=clock + 0.01, status=400, worker=worker, account=account,
              behaviour="status")
    b.final(job_id, "FAILED", account=account, last_error="HTTP 400",
            extra=_extra(clock, clock + 0.03, worker))
    return 1


def _duplicate(b: RunBuilder, job_id: str, account: str, worker: str, clock: float) -> int:
    """A job whose first result write was lost with its connection: delivered twice, the
    second explained."""
    b.enqueue(job_id, script=_SUCCEED, account=account, time=clock)
    b.attempt(job_id, 1, claimed=clock + 0.01, worker=worker, account=account, write="info")
    b.attempt(job_id, 2, claimed=clock + 10.02, worker=worker, account=account)
    b.final(job_id, "COMPLETED", attempts=2, account=account,
            extra=_extra(clock, clock + 10.05, worker))
    return 2


# Each kind of job with its share of jobs (cumulative), in the order a roll picks them.
_MIX = (("succeed", 0.90, _succeed), ("retry", 0.95, _retry), ("dead", 0.99, _dead),
        ("duplicate", 1.0, _duplicate))


def build_synthetic(run_dir: Path, deliveries: int, *, workers: int = 4, accounts: int = 8,
                    seed: int = 1) -> dict[str, int]:
    """A fault-free-looking history with about `deliveries` deliveries: 90% of jobs succeed
    at once, 5% fail twice with 503 and then succeed, 4% answer 400 (dead letter), 1% are
    delivered twice because the first result write was lost with its connection (explained
    duplicates). The checker must find it valid."""
    rng = random.Random(seed)
    builder = RunBuilder(http_timeout_seconds=2.0, lease_seconds=10.0, retry_base_seconds=0.5,
                         retry_cap_seconds=30.0, retry_jitter=0.5,
                         account_limits={f"acct-{a}": None for a in range(accounts)})
    made = 0
    job = 0
    clock = 1_000_000.0
    mix = {name: 0 for name, _, _ in _MIX}
    while made < deliveries:
        job_id = f"00000000-0000-4000-8000-{job:012d}"
        job += 1
        clock += 0.0005
        roll = rng.random()
        name, _, make = next(kind for kind in _MIX if roll < kind[1])
        made += make(builder, job_id, f"acct-{job % accounts}", f"worker-{job % workers}",
                     clock)
        mix[name] += 1
    builder.write(run_dir)
    return {"jobs": job, "deliveries": made, **{f"jobs_{k}": v for k, v in mix.items()}}


# --------------------------------------------------------------------------------------------
# The command.
# --------------------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--deliveries", type=int, default=1_000_000, metavar="N",
                        help="deliveries in the synthetic history (default %(default)s)")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="write the result as JSON here")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="build the run directory here and keep it")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1, metavar="R",
                        help=f"check the history cold then warm this many times, the cache "
                             f"removed before each (1 to {MAX_ROUNDS}; default 1): the spread "
                             "of the cold figure is the machine's, not the checker's")


def _wait_until_cacheable(run_dir: Path) -> float:
    """A file written less than `RACY_SECONDS` before it is read is not cached (it may
    still be changing); wait until the history just built is that old, as any history is
    when it is checked again later. Returns the seconds waited."""
    newest = max(p.stat().st_mtime for p in history_files(run_dir))
    wait = max(0.0, newest + columnar.RACY_SECONDS + 0.1 - time.time())
    time.sleep(wait)
    return wait


def _print_timings(label: str, timings: Mapping[str, float]) -> None:
    cpu_total = (timings["load_cpu_seconds"] + timings["judge_cpu_seconds"]
                 + timings["cache_cpu_seconds"])
    print(f"{label}")
    print("          wall s    cpu s")
    print(f"load    {timings['load_seconds']:8.2f} {timings['load_cpu_seconds']:8.2f}")
    print(f"judge   {timings['judge_seconds']:8.2f} {timings['judge_cpu_seconds']:8.2f}")
    # The cache is written beside the load and the judging: this is what it took after.
    print(f"cache   {timings['cache_seconds']:8.2f} {timings['cache_cpu_seconds']:8.2f}")
    print(f"total   {timings['total_seconds']:8.2f} {cpu_total:8.2f}")


def _bad_paths(args: argparse.Namespace) -> str | None:
    """What is wrong with --keep or --out, as one line, or None; checked (and their folders
    made) before the history is built, not after the benchmark's time is spent."""
    keep: Path | None = args.keep
    out: Path | None = args.out
    if keep is not None:
        if keep.exists() and not keep.is_dir():
            return f"--keep {keep} is not a directory: give a directory to build the run in"
        try:
            keep.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"--keep {keep}: cannot create it ({exc.strerror or exc})"
    if out is not None:
        if out.is_dir():
            return f"--out {out} is a directory: give a file name"
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"--out {out}: cannot create its folder ({exc.strerror or exc})"
    return None


def _bad_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line, as one line, or None."""
    if args.deliveries < 1:
        return "--deliveries must be at least 1"
    return bad_rounds(args.rounds) or _bad_paths(args)


def _check(run_dir: Path) -> dict[str, Any]:
    """`skiplock check RUN_DIR` in a process of its own; its verdict.json (with `timings`)."""
    verdict = run_dir / VERDICT_FILE
    verdict.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-m", "skiplock", "check", str(run_dir)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          check=False)
    if done.returncode not in (0, 1, 3) or not verdict.is_file():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise HarnessError(f"skiplock check {run_dir} exited {done.returncode}: {last}")
    return cast(dict[str, Any], json.loads(verdict.read_text()))


def _check_rounds(run_dir: Path, count: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(cold, warm) verdicts of `run_dir`, `count` times; each round starts cold (the cache
    removed: a kept directory may also hold an earlier build's)."""
    rounds = []
    for number in range(count):
        if count > 1:
            print(f"round {number + 1} of {count}", flush=True)
        shutil.rmtree(run_dir / columnar.CACHE_DIR, ignore_errors=True)
        rounds.append((_check(run_dir), _check(run_dir)))
    return rounds


def _median_round(rounds: list[tuple[dict[str, Any], dict[str, Any]]]
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The round whose cold check took the median time (of two, the slower): what the
    summary shows; every round is printed and kept beside it."""
    ranked = sorted(rounds, key=lambda pair: pair[0]["timings"]["total_seconds"])
    return ranked[len(ranked) // 2]


def _print_rounds(rounds: list[tuple[dict[str, Any], dict[str, Any]]],
                  shown: tuple[dict[str, Any], dict[str, Any]], cache_files: int,
                  cache_size: int) -> None:
    """The `shown` round's timings (the median), then every round's totals."""
    cold, warm = shown
    which = "" if len(rounds) == 1 else f", the median of {len(rounds)} rounds"
    _print_timings(f"cold check (parses the CSV logs, writes the columnar cache{which}):",
                   cold["timings"])
    print(f"cache: {cache_files} files, {cache_size / 1e6:.0f} MB")
    _print_timings("warm check (the same history again, read from the cache):",
                   warm["timings"])
    if len(rounds) > 1:
        print("by round: cold s " + ", ".join(f"{c['timings']['total_seconds']:.2f}"
                                               for c, _ in rounds)
              + "; warm s " + ", ".join(f"{w['timings']['total_seconds']:.2f}"
                                        for _, w in rounds))


def run(args: argparse.Namespace) -> int:
    bad = _bad_arguments(args)
    if bad is not None:
        print(f"skiplock: bench checker: {' '.join(bad.split())}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="skiplock-bench-checker-") as tmp:
        run_dir = args.keep if args.keep is not None else Path(tmp) / "run"
        print(f"building a synthetic history with {args.deliveries} deliveries ...",
              flush=True)
        t0 = time.perf_counter()
        mix = build_synthetic(run_dir, args.deliveries, seed=args.seed)
        built = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in history_files(run_dir))
        os.sync()  # on disk, as a finished run's history is: no writeback timed with a check
        _wait_until_cacheable(run_dir)
        rounds = _check_rounds(run_dir, args.rounds)
        cold, warm = _median_round(rounds)
        cache_size = columnar.cache_bytes(run_dir)
        cache_files = sum(1 for p in (run_dir / columnar.CACHE_DIR).rglob("*" + columnar.SUFFIX))
    print(f"history: {mix['deliveries']} deliveries, {mix['jobs']} jobs, "
          f"{warm['details'].get('worker_events', 0)} worker events, {size / 1e6:.0f} MB of "
          f"logs (built in {built:.1f}s)")
    _print_rounds(rounds, (cold, warm), cache_files, cache_size)
    same = all(v["valid"] == cold["valid"] and v["counts"] == cold["counts"]
               for pair in rounds for v in pair)
    print(f"verdict: cold {cold['valid']}, warm {warm['valid']}"
          + ("" if same else "  (DIFFERENT: checker bug)"))
    result = {
        "benchmark": "checker",
        "parameters": {"deliveries": args.deliveries, "seed": args.seed,
                       "rounds": args.rounds},
        "history": {**mix, "bytes": size,
                    "worker_events": warm["details"].get("worker_events")},
        # cold: a check parsing the logs and writing the cache; warm: a check of the
        # already-read history, from the cache; each in a process of its own. The median
        # round's, then every round's.
        "seconds": {"cold": cold["timings"], "warm": warm["timings"]},
        "rounds": [{"cold": c["timings"], "warm": w["timings"]} for c, w in rounds],
        "cache": {"bytes": cache_size, "files": cache_files,
                  "format_version": columnar.FORMAT_VERSION},
        "valid": warm["valid"],
        "valid_cold": cold["valid"],
        "counts": warm["counts"],
        **describe(),
    }
    if args.out is not None:
        write_json(args.out, result)
        print(f"result: {args.out}")
    # The synthetic history is correct: anything but valid, or a verdict the cache changed,
    # is a checker bug.
    return 0 if warm["valid"] is True and same else 1
