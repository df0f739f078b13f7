"""`skiplock sweep [SCENARIO] --rates R1,R2,...`: capacity planning by stepped load.

Each step is a whole run of the scenario at one offered rate (the same seed, settings and
server for every step), long enough to be steady. From each run directory alone it measures
the offered rate (acknowledged enqueues per second of load), the delivered rate (jobs whose
first 2xx answered within the HTTP timeout arrived during the load, per second), the latency
from an acknowledged enqueue to that first timely 2xx (p50, p99; a job that never had one
counts as missing), and whether the backlog grew over the load (the sampler's queue depth at
the end of the load against its start). A step meets the objective when its p99 is within
`--p99`, it delivered at least 90 % of what was offered and the backlog did not grow by more
than half a second of load. The knee is the highest rate that meets it; the sweep stops at
the first step that does not (unless `--all-steps`).

While each step runs it samples, every 0.2 s, PostgreSQL's active sessions by wait event
(`pg_stat_activity`; a session with no wait event is on the CPU) and, from `/proc`, the CPU
the server, the workers and the rest of the harness (producers, target) used, and how busy
the machine was: where the time went at the knee. It writes `sweep.json` (self-describing),
`sweep.png` (offered against delivered rate, and p99 against the objective, the knee marked)
and each step's run directory under `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
import psycopg

from skiplock.chaos.target import RATE_PER_TARGET_PROCESS
from skiplock.plumbing.argtypes import positive_int
from skiplock.plumbing.errors import UsageError
from skiplock.reports.history import (
    ENQUEUES_FILE,
    LOCUST_DIR,
    LOG_SUFFIX,
    PRODUCER_CPU_SUFFIX,
    RUN_FILE,
    SPEC_FILE,
    WORKERS_DIR,
    read_json,
)
from skiplock.reports.objectives import Objectives
from skiplock.reports.selfdescribe import describe
from skiplock.scenarios.bench.cpu import cpu_by_process, machine_cpu
from skiplock.scenarios.run.spec import SpecError, from_mapping

DELIVERED_SHARE = 0.9  # of the offered rate, for a step to meet the objective
BACKLOG_GROWTH_SECONDS = 0.5  # of load: more growth than this is a backlog that grows
SAMPLE_SECONDS = 0.2


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", nargs="?", default="steady",
                        help="scenario name or file (default: steady)")
    parser.add_argument("--rates", required=True, metavar="R1,R2,...",
                        help="offered rates to step through, jobs/s, increasing")
    parser.add_argument("--step", type=float, default=10.0,
                        help="seconds of load per step (default 10)")
    parser.add_argument("--p99", type=float, default=1.0,
                        help="objective: p99 enqueue -> first timely 2xx, seconds (default 1)")
    parser.add_argument("--all-steps", action="store_true",
                        help="run every step, not only up to the first that misses")
    parser.add_argument("--bisect", type=int, default=2, metavar="N",
                        help="steps run between the last rate that met the objective and the"
                             " first that missed, halving the gap each time (default 2; 0: none)")
    parser.add_argument("--seed", type=int, default=1, help="seed for every step (default 1)")
    parser.add_argument("--target-processes", type=positive_int, default=None, metavar="N",
                        help="echo target processes for every step (default: one per "
                             f"{RATE_PER_TARGET_PROCESS:g} jobs/s asked, at most one per core)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a scenario key for every step")
    parser.add_argument("--dsn", default=None,
                        help="PostgreSQL to use (default: SKIPLOCK_PG_DSN, Docker, embedded)")
    parser.add_argument("--out", type=Path, default=Path("sweeps"),
                        help="parent directory of the sweep's directory (default ./sweeps)")


def parse_rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"--rates must be numbers separated by commas, got {text!r}") from None
    if not rates or any(not (math.isfinite(r) and r > 0) for r in rates):
        raise UsageError(f"--rates must each be a positive number of jobs/s, got {text!r}")
    if any(b <= a for a, b in itertools.pairwise(rates)):
        raise UsageError(f"--rates must increase, got {text!r}")
    return rates


def run(args: argparse.Namespace) -> int:
    from skiplock.scenarios.run import spec as spec_mod
    from skiplock.scenarios.servers.postgres import postgres

    rates = parse_rates(args.rates)
    for name in ("step", "p99"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"--{name.replace('_', '-')} must be a positive number of "
                             f"seconds, got {value}")
    try:
        base = spec_mod.load(args.scenario, args.overrides)
        for rate in rates:  # every step's scenario is valid before the first runs
            dataclasses.replace(base, rate=rate, duration=args.step).validate()
    except SpecError as exc:
        raise UsageError(str(exc)) from None
    if not 0 <= args.bisect <= MAX_BISECT:
        raise UsageError(f"--bisect must be from 0 to {MAX_BISECT}, got {args.bisect}")
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out} is a file; give a directory")
    folder = args.out / f"{datetime.now(UTC):%Y%m%d-%H%M%S}-sweep-{base.name}"
    try:
        (folder / "runs").mkdir(parents=True)
    except OSError as exc:
        raise UsageError(f"--out {args.out}: cannot create {folder} ({exc.strerror})") \
            from None
    results: list[dict[str, Any]] = []
    with postgres(args.dsn, durable=True) as server:
        settings = server.settings()
        _say(f"sweep of {base.name}: rates {', '.join(f'{r:g}' for r in rates)} jobs/s, "
             f"{args.step:g} s each, objective p99 <= {args.p99:g} s; server {server.kind}, "
             f"PostgreSQL {settings['server_version']}")
        stepper = _Stepper(base, args, server, folder, results)
        for rate in rates:
            step = stepper.step(rate)
            if step["producers_short"] or (not step["meets_objective"] and not args.all_steps):
                break
        stepper.bisect(args.bisect)
    knee = knee_of(results)
    # Every step met the objective: the knee lies above the rates tried.
    beyond = bool(results) and all(s["meets_objective"] and not s["producers_short"]
                                   for s in _judged(results))
    doc = {"benchmark": "sweep", "finished_at": datetime.now(UTC).isoformat(),
           "scenario": base.name, "objective_p99_seconds": args.p99, "seed": args.seed,
           "overrides": list(args.overrides), "durable": settings["durable"],
           "postgres": settings, "server": {"kind": server.kind, "dsn": server.display},
           **describe(), "steps": results, "knee_rate": knee, "knee_above_rates": beyond,
           "bottleneck": bottleneck(results, knee)}
    (folder / "sweep.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    plot(results, knee, args.p99, folder / "sweep.png", title=f"skiplock sweep: {base.name}")
    _say("knee: " + ("not found" if knee is None else
                     f"above {knee:g} jobs/s (every step met the objective: try higher rates)"
                     if beyond else f"{knee:g} jobs/s"))
    _say(f"where the time went: {doc['bottleneck']}")
    _say(f"written: {folder / 'sweep.json'}, {folder / 'sweep.png'}")
    return 0


MAX_BISECT = 8

# Sizing the producers to the rate asked (`size_producers`): enqueue transactions per second
# over all producers at most (the batch grows with the rate instead: on a busy machine a
# durable commit can take hundreds of milliseconds, and fewer, bigger ones keep up); the
# seconds a transaction of B jobs is allowed (about twice what one took here at 3,000
# jobs/s: p50 0.21 s for 100 jobs), and users for twice the transactions in flight that
# allows (a Locust user paced at a constant rate never catches up after a slow one); the
# jobs/s one producer process is given, the largest batch, and the most users in all (each
# holds a connection of its own; PostgreSQL's default max_connections is 100, shared with
# the workers).
TRANSACTIONS_PER_SECOND = 30.0
TRANSACTION_SECONDS = 0.1  # plus TRANSACTION_SECONDS_PER_JOB for each job in it
TRANSACTION_SECONDS_PER_JOB = 0.005
USERS_MARGIN = 2.0
RATE_PER_PRODUCER = 2000.0
MAX_ENQUEUE_BATCH = 400
MAX_USERS = 48


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProducerSizes:
    """The producers' side of one step: processes, users in each, jobs per transaction."""

    producers: int
    users: int
    enqueue_batch: int

    @property
    def distributed(self) -> bool:
        """More than one process: Locust's distributed mode (a master and its workers)."""
        return self.producers > 1


def size_producers(rate: float, base: ProducerSizes, cores: int) -> ProducerSizes:
    """Producers that offer `rate` with room to spare: transactions of
    rate / TRANSACTIONS_PER_SECOND jobs (so commits stay few), USERS_MARGIN times the users
    that many transactions in flight need if each takes its allowed time, and one process
    per RATE_PER_PRODUCER jobs/s, at most one per core. Never below the scenario's own
    settings."""
    batch = min(MAX_ENQUEUE_BATCH, max(base.enqueue_batch,
                                       math.ceil(rate / TRANSACTIONS_PER_SECOND)))
    processes = max(base.producers, min(max(cores, 1), math.ceil(rate / RATE_PER_PRODUCER)))
    allowed = TRANSACTION_SECONDS + TRANSACTION_SECONDS_PER_JOB * batch
    users_in_all = math.ceil(USERS_MARGIN * rate / batch * allowed)
    users = max(base.users, min(MAX_USERS // processes, math.ceil(users_in_all / processes)))
    return ProducerSizes(producers=processes, users=users, enqueue_batch=batch)


def raise_producers(sizes: ProducerSizes, cores: int, *,
                    users_only: bool = False) -> ProducerSizes | None:
    """One rung up the ladder after a step whose producers fell short: twice the users
    (up to MAX_USERS in all), then twice the processes (up to one per core: more only queue
    for the same CPUs), then twice the batch; None at the top (with `users_only`, once the
    users are at their cap)."""
    cap = MAX_USERS // sizes.producers
    if sizes.users < cap:
        return dataclasses.replace(sizes, users=min(cap, 2 * sizes.users))
    if users_only:
        return None
    if sizes.producers < cores:
        producers = min(cores, 2 * sizes.producers)
        return dataclasses.replace(sizes, producers=producers,
                                   users=max(1, sizes.users * sizes.producers // producers))
    if sizes.enqueue_batch < MAX_ENQUEUE_BATCH:
        return dataclasses.replace(sizes,
                                   enqueue_batch=min(MAX_ENQUEUE_BATCH, 2 * sizes.enqueue_batch))
    return None


class _Stepper:
    """Runs steps of a sweep with producers sized to each rate, raising them when they
    still fall short of it (the harness must not be what a capacity sweep measures), and
    bisects."""

    def __init__(self, base: Any, args: argparse.Namespace, server: Any, folder: Path,
                 results: list[dict[str, Any]]) -> None:
        self.base, self.args, self.server, self.folder = base, args, server, folder
        self.results = results
        self.cores = os.cpu_count() or 1
        self.floor = ProducerSizes(producers=base.producers, users=base.users,
                                   enqueue_batch=base.enqueue_batch)
        # Raised by a step that fell short; later steps start from at least this.
        self.raised = self.floor

    def _sizes(self, rate: float) -> ProducerSizes:
        sized = size_producers(rate, self.floor, self.cores)
        return ProducerSizes(producers=max(sized.producers, self.raised.producers),
                             users=max(sized.users, self.raised.users),
                             enqueue_batch=max(sized.enqueue_batch, self.raised.enqueue_batch))

    def step(self, rate: float) -> dict[str, Any]:
        sizes = self._sizes(rate)
        while True:
            step = self._run(rate, sizes)
            if not step["producers_short"]:
                return step
            # Producers waiting on the queue's commits gain from more of them in flight,
            # never from more processes (idle already) or bigger transactions (slower yet).
            raised = raise_producers(sizes, self.cores, users_only=waited_on_enqueue(step))
            if raised is None:
                if waited_on_enqueue(step):
                    enqueue_bound(step)
                    _say(f"  the producers offered {step['offered_per_second']:g} of {rate:g}"
                         f" jobs/s with {_shown(sizes)}, waiting on the queue: "
                         + enqueue_sentence(step))
                    return step
                _say(f"  the producers offered {step['offered_per_second']:g} of "
                     f"{rate:g} jobs/s with {_shown(sizes)}: the harness is the limit here,"
                     " not the queue; stopping")
                return step
            _say(f"  the producers offered {step['offered_per_second']:g} of {rate:g}"
                 f" jobs/s: raising them to {_shown(raised)}, and running the step again")
            step["superseded"] = True
            sizes = self.raised = raised

    def _run(self, rate: float, sizes: ProducerSizes) -> dict[str, Any]:
        from skiplock.chaos.target import processes_for_rate
        from skiplock.scenarios.run.options import RunOptions
        from skiplock.scenarios.run.runner import run_scenario

        # A sweep looks for where the queue stops keeping up: its own objective (`--p99`)
        # judges each step, not the scenario's, which the steps past the knee would miss.
        spec = dataclasses.replace(self.base, rate=rate, duration=self.args.step,
                                   producers=sizes.producers, users=sizes.users,
                                   enqueue_batch=sizes.enqueue_batch,
                                   distributed=self.base.distributed or sizes.distributed,
                                   objectives=Objectives()).validate()
        targets = self.args.target_processes or processes_for_rate(rate)
        _say(f"step {rate:g} jobs/s ({_shown(sizes)}; {targets} target process"
             f"{'es' if targets > 1 else ''}) ...")
        options = RunOptions(seed=self.args.seed, out=self.folder / "runs", server=self.server,
                             worker_logs_to_files=True, target_processes=targets)
        with _watch(self.server.dsn) as watched:
            result = run_scenario(spec, options)
        step = measure_step(result.run_dir, objective=self.args.p99)
        step |= {"rate": rate, "producers": spec.producers, "users": spec.users,
                 "enqueue_batch": spec.enqueue_batch, "distributed": spec.distributed,
                 "target_processes": targets, "run_dir": str(result.run_dir),
                 "verdict": str(result.verdict.valid), **watched.summary()}
        self.results.append(step)
        _say("  " + step_line(step))
        return step

    def bisect(self, rounds: int) -> None:
        """Halve the gap between the highest rate that met the objective and the lowest
        that missed it (a queue's limit, not the producers'), `rounds` times."""
        for _ in range(rounds):
            met, missed = bracket(self.results)
            if met is None or missed is None:
                return
            middle = float(f"{(met + missed) / 2:.3g}")
            if not met < middle < missed:
                return
            step = self.step(middle)
            if step["producers_short"]:
                return


def _shown(sizes: ProducerSizes) -> str:
    return (f"{sizes.producers} producer process{'es' if sizes.producers > 1 else ''}"
            f"{' (distributed)' if sizes.distributed else ''} x {sizes.users} users,"
            f" {sizes.enqueue_batch} jobs per transaction")


def bracket(steps: Sequence[dict[str, Any]]) -> tuple[float | None, float | None]:
    """(highest rate that met the objective, lowest that missed it above it), over the steps
    that judged the queue (not superseded, not limited by the producers)."""
    judged = sorted((s for s in _judged(steps) if not s.get("producers_short")),
                    key=lambda s: s["rate"])
    missed = next((s["rate"] for s in judged if not s["meets_objective"]), None)
    met = [s["rate"] for s in judged if s["meets_objective"]
           and (missed is None or s["rate"] < missed)]
    return (max(met) if met else None), missed


def _judged(steps: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Steps that count: not those run again with more producers."""
    return [s for s in steps if not s.get("superseded")]


# --------------------------------------------------------------------------------------------
# One step, from its run directory.
# --------------------------------------------------------------------------------------------


def measure_step(run_dir: Path, *, objective: float) -> dict[str, Any]:
    from skiplock.scenarios.bench.recovery import load_window, read_deliveries

    spec_json = read_json(run_dir / SPEC_FILE)
    run_json = read_json(run_dir / RUN_FILE)
    timeout = float(run_json["http_timeout_seconds"])
    start, end = load_window(spec_json)
    seconds = end - start
    enq = pd.read_csv(run_dir / ENQUEUES_FILE, usecols=["type", "job_id", "time"],
                      dtype={"job_id": str, "type": str})
    enqueue_p50 = enqueue_seconds(enq)
    acked = enq[enq["type"] == "ok"].groupby("job_id")["time"].min()
    in_load = acked[(acked >= start) & (acked < end)]
    first = read_deliveries(run_dir, timeout).first_timely
    delivered = int(((first >= start) & (first < end)).sum())
    waits = (first.reindex(in_load.index) - in_load).sort_values()
    missing = int(waits.isna().sum())
    waits = waits.dropna()
    p50 = float(waits.quantile(0.5)) if len(waits) else None
    # A job never delivered is slower than any delivered one: it counts at the top.
    p99 = (math.inf if missing > 0.01 * max(len(in_load), 1) else
           float(waits.quantile(0.99)) if len(waits) else None)
    growth = backlog_growth(run_dir, start, end)
    offered = len(in_load) / seconds
    rate_ok = delivered / seconds >= DELIVERED_SHARE * offered
    meets = (p99 is not None and p99 <= objective and rate_ok
             and growth <= max(10.0, BACKLOG_GROWTH_SECONDS * offered))
    requested = float(spec_json["scenario"]["rate"])
    hold, slot_hold = mean_holds(run_dir, start, end)
    return {"requested_per_second": requested, **producer_cpu(run_dir),
            "enqueue_p50_seconds": enqueue_p50,
            "lease_hold_seconds": None if hold is None else round(hold, 4),
            "slot_hold_seconds": None if slot_hold is None else round(slot_hold, 4),
            "capacities": capacities(spec_json["scenario"], hold, slot_hold),
            # Whether the workers' slots are counted to the call's end (`workers_hold`).
            "refill": from_mapping(spec_json["scenario"]).refill,
            # The producers could not offer the rate asked for: the harness, not the queue,
            # is the limit at this step, and it measures nothing about the queue's capacity.
            "producers_short": bool(requested > 0 and offered < DELIVERED_SHARE * requested),
            "offered_per_second": round(offered, 1),
            "delivered_per_second": round(delivered / seconds, 1),
            "p50_seconds": None if p50 is None else round(p50, 4),
            "p99_seconds": None if p99 is None else (p99 if math.isinf(p99) else round(p99, 4)),
            "jobs_never_delivered": missing, "backlog_growth": growth,
            "meets_objective": bool(meets)}


def producer_cpu(run_dir: Path) -> dict[str, float | None]:
    """From every producer process's own report (a Locust master's included): milliseconds
    of the producers' CPU per acknowledged enqueue over the load, and the busiest process's
    share of one core; None without reports."""
    cpu, jobs, busiest = 0.0, 0, None
    for path in (run_dir / LOCUST_DIR).glob(f"*{PRODUCER_CPU_SUFFIX}"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            report = json.loads(path.read_text())
            cpu += float(report["cpu_seconds"])
            jobs += int(report["acknowledged"])
            busy = float(report["cpu_seconds"]) / float(report["seconds"])
            busiest = busy if busiest is None else max(busiest, busy)
    return {"producer_cpu_ms_per_job": round(1000 * cpu / jobs, 4) if jobs else None,
            "producer_busiest_core_share": None if busiest is None else round(busiest, 3)}


def enqueue_seconds(enq: pd.DataFrame) -> float | None:
    """p50 of the time from a job's invoke to its ok: how long its enqueue transaction
    took (the producers wait on that, not on their own CPU, when the queue is slow to take
    jobs)."""
    invoked = enq[enq["type"] == "invoke"].groupby("job_id")["time"].min()
    acked = enq[enq["type"] == "ok"].groupby("job_id")["time"].min()
    took = (acked - invoked.reindex(acked.index)).dropna()
    return round(float(took.quantile(0.5)), 4) if len(took) else None


# A producer process busier than this share of a core was limited by its own CPU.
PRODUCER_BUSY_SHARE = 0.5


def waited_on_enqueue(step: dict[str, Any]) -> bool:
    """The producers fell short while every process had CPU to spare: they were waiting on
    the queue's enqueue transactions, and more producers would wait the same."""
    busiest = step.get("producer_busiest_core_share")
    return (bool(step.get("producers_short")) and busiest is not None
            and busiest < PRODUCER_BUSY_SHARE and step.get("enqueue_p50_seconds") is not None)


def enqueue_bound(step: dict[str, Any]) -> None:
    """Judge a step whose producers waited on the queue as the queue's: it did not take the
    rate asked, so it misses the objective (the knee lies below), and the harness is not
    blamed."""
    step["producers_short"] = False
    step["enqueue_bound"] = True
    step["meets_objective"] = False


def enqueue_sentence(step: dict[str, Any]) -> str:
    return (f"its enqueue took p50 {step['enqueue_p50_seconds'] * 1000:.0f} ms a transaction"
            f" of {step.get('enqueue_batch', '?')} jobs while the busiest producer process used"
            f" {step['producer_busiest_core_share']:.0%} of a core: the queue's enqueue is the"
            " limit, not the harness")


def mean_holds(run_dir: Path, start: float, end: float) -> tuple[float | None, float | None]:
    """How long a job held its lease and its worker's slot on average during the load, from
    the worker logs: from its claim to its result written (the span an account's limit
    counts), and from its claim to its call's end (a refilling worker frees the slot then,
    before the result is written)."""
    frames = []
    for path in sorted((run_dir / WORKERS_DIR).glob(f"*{LOG_SUFFIX}")):
        with contextlib.suppress(ValueError, KeyError, pd.errors.EmptyDataError):
            frame = pd.read_csv(path, usecols=["kind", "job_id", "attempt", "time"],
                                dtype={"job_id": str, "kind": str})
            frames.append(frame[frame["kind"].isin(["claim", "http", "write"])])
    if not frames:
        return None, None
    events = pd.concat(frames, ignore_index=True)
    claims = events[events["kind"] == "claim"].groupby(["job_id", "attempt"])["time"].min()
    in_load = claims[(claims >= start) & (claims < end)]

    def mean_until(kind: str) -> float | None:
        ends = events[events["kind"] == kind].groupby(["job_id", "attempt"])["time"].max()
        held = (ends.reindex(in_load.index) - in_load).dropna()
        return float(held.mean()) if len(held) else None

    return mean_until("write"), mean_until("http")


def workers_hold(refill: bool, hold: float | None,
                 slot_hold: float | None) -> tuple[float | None, str]:
    """How long a job holds one of its worker's slots, and until when: to its call's end
    (`slot_hold`) when the workers refill their slots as calls end, else until its result
    is written (`hold`), which a barrier worker waits for before it claims again."""
    if refill and slot_hold:
        return slot_hold, "its call's end"
    return hold, "result written"


def capacities(scenario: dict[str, Any], hold: float | None,
               slot_hold: float | None = None) -> dict[str, float]:
    """The rates a step's slots allow, by Little's law (slots / seconds a job holds one),
    as total offered rates: the limited account that fills first, counted over `hold` (claim
    to result written; an account with limit L and a share s of the jobs fills at
    L / (hold * s)), and the workers' batches, over `slot_hold` (claim to call's end) when
    the workers refill their slots as calls end, else over `hold`."""
    spec = from_mapping(scenario)
    found: dict[str, float] = {}
    shares = spec.account_shares()
    limited = {a: limit for a, limit in spec.accounts.items()
               if limit is not None and shares[a] > 0}
    if hold and hold > 0 and limited:
        first = min(limited, key=lambda a: limited[a] / shares[a])
        found[f"account {first}'s slots ({limited[first]}, {shares[first]:.0%} of the jobs)"] = (
            round(limited[first] / (hold * shares[first]), 1))
    worker_hold, _ = workers_hold(spec.refill, hold, slot_hold)
    if worker_hold and worker_hold > 0:
        found[f"workers' slots ({spec.workers} x {spec.batch})"] = round(
            spec.workers * spec.batch / worker_hold, 1)
    return found


def backlog_growth(run_dir: Path, start: float, end: float) -> float:
    """Queue depth at the end of the load minus at its start (samples.csv)."""
    path = run_dir / "samples.csv"
    if not path.exists():
        return 0.0
    samples = pd.read_csv(path, usecols=["time", "queue_depth"])
    load = samples[(samples["time"] >= start) & (samples["time"] <= end + 0.5)]
    if len(load) < 2:
        return 0.0
    return float(load["queue_depth"].iloc[-1] - load["queue_depth"].iloc[0])


def knee_of(steps: Sequence[dict[str, Any]]) -> float | None:
    """The highest rate that met the objective, below the first that did not; None when
    none did, or when no step missed it before the producers fell short (the queue's limit
    was never reached, so there is no knee to report)."""
    knee = None
    for step in sorted(_judged(steps), key=lambda s: s["rate"]):
        if step.get("producers_short"):
            return None
        if not step["meets_objective"]:
            return knee
        knee = step["rate"]
    return knee


def step_line(step: dict[str, Any]) -> str:
    p99 = step["p99_seconds"]
    shown = "-" if p99 is None else ("never" if math.isinf(p99) else f"{p99 * 1000:.0f} ms")
    waits = ", ".join(f"{k} {v:.0%}" for k, v in list(step["waits"].items())[:3]) or "-"
    cpu = step["cpu"]
    per_job = step.get("producer_cpu_ms_per_job")
    producers = "" if per_job is None else f"producers {per_job * 1000:.0f} µs CPU per job, "
    return (f"offered {step['offered_per_second']:g}/s, delivered "
            f"{step['delivered_per_second']:g}/s, p99 {shown}, backlog "
            f"{step['backlog_growth']:+.0f}, {producers}machine "
            f"{cpu.get('machine_busy', 0):.0%} busy "
            f"(server {cpu.get('server', 0):.0%}, workers {cpu.get('workers', 0):.0%}, "
            f"harness {cpu.get('harness', 0):.0%} of one core); waits: {waits}; "
            f"{'meets' if step['meets_objective'] else 'MISSES'} the objective")


# A slot bound binds when the rate delivered comes this close to what the slots allow.
BINDING_SHARE = 0.8


def _slot_bound(step: dict[str, Any]) -> str | None:
    """The slots that capped the step, if the rate it delivered came close to what they
    allow (Little's law); None when no slot bound was near."""
    caps = step.get("capacities") or {}
    if not caps:
        return None
    name = min(caps, key=lambda k: caps[k])
    if step["delivered_per_second"] < BINDING_SHARE * caps[name]:
        return None
    delivered = f" (delivered {step['delivered_per_second']:g}/s)"
    if name.startswith("account "):
        held = step["lease_hold_seconds"]
        return (f"{name}: each job held its slot {held * 1000:.0f} ms from claim to result "
                f"written, so the account is full from about {caps[name]:g} jobs/s offered"
                + delivered)
    held, until = workers_hold(step.get("refill", True), step["lease_hold_seconds"],
                               step.get("slot_hold_seconds"))
    if held is None:
        return None
    return (f"{name}: each job held its slot {held * 1000:.0f} ms from claim to {until},"
            f" so they allow about {caps[name]:g} jobs/s" + delivered)


def bottleneck(steps: Sequence[dict[str, Any]], knee: float | None) -> str:
    """A sentence on where the time went at the first step past the knee (or the last)."""
    if not steps:
        return "no step ran"
    short = next((s for s in _judged(steps) if s.get("producers_short")), None)
    if short is not None:
        return (f"at {short['rate']:g} jobs/s the producers offered only "
                f"{short['offered_per_second']:g}/s: the harness, not the queue")
    judged = sorted(_judged(steps), key=lambda s: s["rate"])
    past = next((s for s in judged if not s["meets_objective"]), judged[-1])
    if past.get("enqueue_bound"):
        return (f"at {past['rate']:g} jobs/s the queue took only "
                f"{past['offered_per_second']:g} jobs/s: " + enqueue_sentence(past))
    bound = _slot_bound(past)
    if bound is not None:
        return f"at {past['rate']:g} jobs/s: {bound}"
    cpu = past["cpu"]
    groups = {k: cpu.get(k, 0.0) for k in ("server", "workers", "harness")}
    top = max(groups, key=lambda k: groups[k])
    waits = past["waits"]
    on_cpu = waits.get("CPU", 0.0)
    busy = cpu.get("machine_busy", 0.0)
    if busy >= 0.85:
        why = (f"the machine's CPUs ({busy:.0%} busy; most of it {top}, "
               f"{groups[top]:.0%} of one core)")
    elif waits and max(waits.values()) > on_cpu:
        event = max(waits, key=lambda k: waits[k])
        why = f"PostgreSQL waiting on {event} ({waits[event]:.0%} of active session samples)"
    else:
        why = f"{top} ({groups[top]:.0%} of one core), machine {busy:.0%} busy"
    return f"at {past['rate']:g} jobs/s: {why}"


# --------------------------------------------------------------------------------------------
# Watching the server and the processes while a step runs.
# --------------------------------------------------------------------------------------------


class _Watched:
    def __init__(self) -> None:
        self.waits: Counter[str] = Counter()
        self.samples = 0
        # pid -> (group, CPU seconds when first seen, when last seen); a process started after
        # the watch began counts from zero.
        self.cpu: dict[int, tuple[str, float, float]] = {}
        self.machine: tuple[float, float] = (0.0, 0.0)
        self.seconds = 0.0

    def note_cpu(self, *, first: bool = False) -> None:
        for pid, (group, used) in cpu_by_process().items():
            seen = self.cpu.get(pid)
            if seen is None:
                self.cpu[pid] = (group, used if first else 0.0, used)
            else:
                self.cpu[pid] = (group, seen[1], used)

    def summary(self) -> dict[str, Any]:
        total = sum(self.waits.values())
        waits = {k: round(v / total, 3) for k, v in self.waits.most_common()} if total else {}
        groups = {"server": 0.0, "workers": 0.0, "harness": 0.0}
        for group, start, end in self.cpu.values():
            if group in groups:  # a sweep runs no Redis of its own
                groups[group] += end - start
        cpu = {k: round(v / self.seconds, 3) for k, v in groups.items()} if self.seconds else {}
        busy, all_ = self.machine
        cpu["machine_busy"] = round(busy / all_, 3) if all_ else 0.0
        return {"waits": waits, "cpu": cpu, "wait_samples": self.samples}


@contextlib.contextmanager
def _watch(dsn: str) -> Iterator[_Watched]:
    watched = _Watched()
    stop = threading.Event()

    def sample() -> None:
        conn = None
        while not stop.wait(SAMPLE_SECONDS):
            watched.note_cpu()
            try:
                if conn is None:
                    conn = psycopg.connect(dsn, autocommit=True, connect_timeout=5)
                rows = conn.execute(
                    "SELECT COALESCE(wait_event_type || ':' || wait_event, 'CPU'),"
                    " count(*) FROM pg_stat_activity WHERE state = 'active'"
                    " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
                    " GROUP BY 1").fetchall()
            except psycopg.Error:
                # A restart or a cut connection: try again at the next sample.
                if conn is not None:
                    conn.close()
                conn = None
                continue
            watched.samples += 1
            for event, count in rows:
                watched.waits[str(event)] += int(count)
        if conn is not None:
            conn.close()

    thread = threading.Thread(target=sample, name="skiplock-sweep-watch", daemon=True)
    started = time.monotonic()
    watched.note_cpu(first=True)
    machine_before = machine_cpu()
    thread.start()
    try:
        yield watched
    finally:
        stop.set()
        thread.join(timeout=5)
        watched.note_cpu()
        machine_after = machine_cpu()
        watched.seconds = time.monotonic() - started
        watched.machine = (machine_after[0] - machine_before[0],
                           machine_after[1] - machine_before[1])


# --------------------------------------------------------------------------------------------
# The plot.
# --------------------------------------------------------------------------------------------


def plot(steps: Sequence[dict[str, Any]], knee: float | None, objective: float, path: Path,
         *, title: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(_judged(steps), key=lambda s: s["rate"])
    rates = [s["rate"] for s in steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    if rates:
        # Where a queue that keeps up lies: delivered = asked.
        top.plot([0, max(rates)], [0, max(rates)], color="lightgrey", linewidth=1,
                 label="delivered = asked", zorder=0)
    top.plot(rates, [s["offered_per_second"] for s in steps], "o--", color="grey",
             label="offered")
    top.plot(rates, [s["delivered_per_second"] for s in steps], "o-", color="tab:blue",
             label="delivered (first timely 2xx)")
    short = [s for s in steps if s.get("producers_short")]
    if short:
        top.plot([s["rate"] for s in short], [s["offered_per_second"] for s in short], "x",
                 color="tab:red", markersize=10, mew=2,
                 label="producers short: the harness, not the queue")
    top.set_ylabel("jobs/s")
    top.legend(loc="upper left", framealpha=0.9)
    top.grid(alpha=0.3)
    p99 = [None if s["p99_seconds"] is None else min(float(s["p99_seconds"]), 1e3)
           for s in steps]
    bottom.plot(rates, [v if v is not None else float("nan") for v in p99], "o-",
                color="tab:red", label="p99 enqueue -> first timely 2xx")
    bottom.axhline(objective, color="tab:red", linestyle=":", label=f"objective {objective:g} s")
    bottom.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda value, _pos: f"{value:g}")
    bottom.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    bottom.yaxis.set_major_formatter(plain)
    bottom.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    bottom.set_ylabel("seconds (log)")
    bottom.set_xlabel("asked rate, jobs/s")
    bottom.legend(loc="upper left")
    bottom.grid(alpha=0.3, which="both")
    for axis in (top, bottom):
        if knee is not None:
            axis.axvline(knee, color="tab:green", linestyle="--")
    if knee is not None:
        low, high = top.get_ylim()
        top.annotate(f" knee {knee:g}/s", (knee, low + 0.15 * (high - low)), color="tab:green",
                     ha="left")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _say(line: str) -> None:
    print(line, flush=True)


__all__ = ["configure", "knee_of", "measure_step", "parse_rates", "run"]

