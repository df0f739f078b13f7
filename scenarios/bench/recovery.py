"""`skiplock bench recovery`: how long the reference queue takes to get back to its
pre-fault delivery rate after one fault of each kind.

For each fault kind, one run (`run_scenario`) of a steady workload: only `succeed` jobs, two
accounts with generous limits and one unlimited, a constant rate well under capacity, and
exactly ONE fault at a fixed time into the load. Every run uses one durable server
provisioned once for the whole benchmark, and its own schema.

Each run is then read back from its run directory alone (never from the live process):

- the delivery rate is what the echo target recorded (`deliveries/*.csv`): per job, the
  `received` time of its first 2xx answered within the HTTP timeout. A late 2xx reached
  nobody (the worker had given up), and a repeated 2xx is not new work, so neither counts;
- the rate is counted in 250 ms bins over the load phase; the rolling 1 s rate is the mean
  of the last four bins; the pre-fault level is the median rolling rate before the fault;
- recovery time is the seconds from the fault's start (`nemesis.jsonl`) until the rolling
  rate, having dropped below 90% of the pre-fault level, is back at or above it and stays
  there for 1 s (0 when it never dropped; "not recovered" when it is not back before the
  load ends); the dip is the lowest rolling rate until then over the pre-fault level.

The result file describes itself (machine, versions, PostgreSQL settings, git sha and dirty
flag, parameters) and keeps each run's directory, verdict and 250 ms series.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from skiplock.chaos.nemesis import (
    FAILPOINT_KINDS,
    NEMESIS_KINDS,
    OWNED_SERVER_KINDS,
    default_duration,
    spec_from_mapping,
)
from skiplock.plumbing.argtypes import positive_float, positive_int
from skiplock.plumbing.errors import HarnessError, UsageError
from skiplock.reports.history import (
    DELIVERIES_DIR,
    ENQUEUES_FILE,
    LOG_SUFFIX,
    NEMESIS_FILE,
    RUN_FILE,
    SPEC_FILE,
    HistoryError,
    read_json,
    read_jsonl,
    write_json,
)
from skiplock.reports.selfdescribe import describe
from skiplock.scenarios.bench.common import result_path
from skiplock.scenarios.run.spec import ScenarioSpec, SpecError, from_mapping

# The order the kinds run in by default: every kind a scenario may name.
DEFAULT_KINDS: tuple[str, ...] = NEMESIS_KINDS

BIN_SECONDS = 0.25
WINDOW_SECONDS = 1.0
THRESHOLD = 0.9
HOLD_SECONDS = 1.0

# A failpoint window: short, and a per-job chance that still crashes most batches in it.
FAILPOINT_WINDOW_SECONDS = 1.0
FAILPOINT_PROBABILITY = 0.2

# The steady workload every fault lands on. Timing as in the chaos scenarios: lease 4 s,
# HTTP timeout 1 s, so a killed or paused worker's jobs come back within about 4 s.
BASE: dict[str, Any] = {
    "name": "recovery",
    "description": "steady succeed-only load with one fault at a fixed time",
    "warmup": 1.0,
    "duration": 12.0,
    "drain_timeout": 60.0,
    "quiesce": 0.5,
    "rate": 60.0,
    "producers": 1,
    "users": 4,
    "enqueue_batch": 1,
    "workers": 3,
    "batch": 10,
    "lease": 4.0,
    "http_timeout": 1.0,
    "write_margin": 1.0,
    "poll": 0.5,
    "recovery": True,
    "recovery_interval": 0.5,
    "retry_base": 1.0,
    "retry_cap": 2.0,
    "retry_jitter": 0.2,
    "max_attempts": 3,
    # Generous limits (a succeed job holds its slot for milliseconds) beside an unlimited one.
    "accounts": {"alpha": 16, "beta": 16, "bulk": "unlimited"},
    "mix": {"succeed": 1},
}


# --------------------------------------------------------------------------------------------
# The measurement: a pure function of delivery times.
# --------------------------------------------------------------------------------------------


class RecoveryError(ValueError):
    """The delivery times cannot give a recovery time (no load before the fault, no rate)."""


@dataclass(frozen=True, kw_only=True)
class Recovery:
    """What the rate did around one fault. Rates are jobs/s; times are seconds from the
    fault's start. `recovery_seconds` is None when the rate was not back before the load
    ended."""

    pre_fault_rate: float
    recovery_seconds: float | None
    dip: float
    dip_at_seconds: float
    # 250 ms bin rates and rolling 1 s rates over the load, each bin at its end time.
    bin_ends: tuple[float, ...]
    rates: tuple[float, ...]
    rolling: tuple[float | None, ...]

    @property
    def recovered(self) -> bool:
        return self.recovery_seconds is not None


def recovery_time(
    times: npt.ArrayLike,
    *,
    load_start: float,
    load_end: float,
    fault_start: float,
    bin_seconds: float = BIN_SECONDS,
    window_seconds: float = WINDOW_SECONDS,
    threshold: float = THRESHOLD,
    hold_seconds: float = HOLD_SECONDS,
) -> Recovery:
    """The rate around a fault, from the times (seconds) at which work was delivered.

    Bins of `bin_seconds` from `load_start` (whole bins before `load_end` only); the rolling
    rate at a bin's end is the mean rate of the bins in the `window_seconds` up to it; the
    pre-fault level is the median rolling rate over the windows that end by `fault_start`.
    Recovery: from the first bin end at or after the fault where the rolling rate is below
    `threshold` x the level, the first later bin end from which it stays at or above that
    for `hold_seconds`; 0 when it never drops before the load ends, None when it does not
    come back for long enough before the load ends. The dip is the lowest rolling rate from
    the fault until recovery is confirmed (or the load ends), over the level. Raises
    RecoveryError when the times cannot say: no whole window before the fault, less than
    `hold_seconds` of load after it, or nothing delivered before it."""
    if not load_start <= fault_start < load_end:
        raise RecoveryError(f"the fault at {fault_start:.3f} is not inside the load "
                            f"[{load_start:.3f}, {load_end:.3f})")
    rates, ends, rolling = _binned_rates(times, load_start, load_end, bin_seconds,
                                         window_seconds)
    n_bins = len(ends)
    per_hold = round(hold_seconds / bin_seconds)
    level = _pre_fault_level(rolling, ends, fault_start, window_seconds)
    good = (rolling >= threshold * level).to_numpy()
    rolled = rolling.notna().to_numpy()
    after = [i for i in range(n_bins) if ends[i] >= fault_start and rolled[i]]

    if not after or ends[-1] - fault_start < hold_seconds - 1e-9:
        raise RecoveryError(f"less than {hold_seconds:g} s of load after the fault")
    drop = next((i for i in after if not good[i]), None)
    recovered_at = None if drop is None else next(
        (i for i in after if i > drop and _holds(good, i, per_hold)), None)
    if drop is None:
        recovery: float | None = 0.0
    elif recovered_at is None:
        recovery = None
    else:
        recovery = float(ends[recovered_at] - fault_start)
    last = n_bins - 1 if recovered_at is None else min(n_bins - 1, recovered_at + per_hold)
    span = [i for i in after if i <= last]
    lowest = min(span, key=lambda i: float(rolling.iloc[i]))
    return Recovery(
        pre_fault_rate=level,
        recovery_seconds=recovery,
        dip=float(rolling.iloc[lowest]) / level,
        dip_at_seconds=float(ends[lowest] - fault_start),
        bin_ends=tuple(float(e) for e in ends),
        rates=tuple(float(r) for r in rates),
        rolling=tuple(None if math.isnan(r) else float(r) for r in rolling),
    )


def _binned_rates(times: npt.ArrayLike, load_start: float, load_end: float, bin_seconds: float,
                  window_seconds: float) -> tuple[pd.Series[float], npt.NDArray[np.float64],
                                                  pd.Series[float]]:
    """The rate in each whole bin of the load, each bin's end, and the rolling rate over the
    `window_seconds` up to each end (NaN until a whole window has passed)."""
    n_bins = math.floor((load_end - load_start) / bin_seconds + 1e-9)
    per_window = max(1, round(window_seconds / bin_seconds))
    t = np.asarray(times, dtype=np.float64)
    index = np.floor((t - load_start) / bin_seconds).astype(np.int64)
    inside = index[(index >= 0) & (index < n_bins)]
    counts = pd.Series(inside).value_counts().reindex(range(n_bins), fill_value=0)
    rates = counts.sort_index().astype(np.float64) / bin_seconds
    ends = load_start + bin_seconds * (np.arange(n_bins, dtype=np.float64) + 1.0)
    return rates, ends, rates.rolling(per_window, min_periods=per_window).mean()


def _holds(good: npt.NDArray[np.bool_], i: int, per_hold: int) -> bool:
    """Whether the rate is good from bin `i` through the `per_hold` bins after it."""
    stop = i + per_hold
    return stop < len(good) and bool(good[i:stop + 1].all())


def _pre_fault_level(rolling: pd.Series[float], ends: npt.NDArray[np.float64],
                     fault_start: float, window_seconds: float) -> float:
    # The level is taken from the rolling rate, not the bins: a constant-rate producer's
    # pacing makes the bins uneven (at 60/s they read 64, 64, 64, 48 in turn), so their
    # median would overstate the level.
    before = rolling[(ends <= fault_start + 1e-9) & rolling.notna().to_numpy()]
    if before.empty:
        raise RecoveryError(f"no whole {window_seconds:g} s window of load before the fault")
    level = float(before.median())
    if level <= 0:
        raise RecoveryError("nothing was delivered before the fault: no pre-fault rate")
    return level


# --------------------------------------------------------------------------------------------
# Reading one run directory.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Deliveries:
    """What the echo target recorded, reduced to what the rate needs."""

    # job id -> `received` of its first 2xx answered within the HTTP timeout
    first_timely: pd.Series[float]
    deliveries: int
    jobs_2xx: int
    jobs_duplicated: int  # jobs answered 2xx more than once


def read_deliveries(run_dir: Path, http_timeout: float) -> Deliveries:
    """Every target's log in `run_dir/deliveries/`, read with pandas."""
    wanted = ("job_id", "received", "answered", "status")
    frames = []
    for path in sorted((run_dir / DELIVERIES_DIR).glob(f"*{LOG_SUFFIX}")):
        frame = pd.read_csv(path, usecols=lambda c: c in wanted, dtype={"job_id": str})
        frames.append(frame.reindex(columns=list(wanted)))
    if not frames:
        raise HistoryError(f"{run_dir / DELIVERIES_DIR} holds no delivery log")
    d = pd.concat(frames, ignore_index=True)
    status = pd.to_numeric(d["status"], errors="coerce")
    received = pd.to_numeric(d["received"], errors="coerce")
    answered = pd.to_numeric(d["answered"], errors="coerce")
    ok = (status >= 200) & (status < 300)
    timely = ok & ((answered - received) <= http_timeout)
    per_job_2xx = d.loc[ok, "job_id"].value_counts()
    first = (pd.DataFrame({"job_id": d["job_id"], "received": received})[timely]
             .groupby("job_id")["received"].min())
    return Deliveries(
        first_timely=first,
        deliveries=len(d),
        jobs_2xx=len(per_job_2xx),
        jobs_duplicated=int((per_job_2xx > 1).sum()),
    )


def slowest_job(run_dir: Path, first_timely: pd.Series[float]) -> dict[str, Any]:
    """The longest wait from an acknowledged enqueue to the job's first timely 2xx, and how
    many acknowledged jobs never had one: what a rate hides (a killed or paused worker's
    few jobs wait for their lease while the others carry the rate)."""
    e = pd.read_csv(run_dir / ENQUEUES_FILE, usecols=["type", "job_id", "time"],
                    dtype={"job_id": str, "type": str})
    acked = e[e["type"] == "ok"].groupby("job_id")["time"].min()
    waits = (first_timely.reindex(acked.index) - acked).dropna()
    if waits.empty:
        return {"slowest_job_seconds": None, "jobs_without_timely_2xx": len(acked)}
    return {"slowest_job_seconds": round(float(waits.max()), 3),
            "slowest_job": str(waits.idxmax()),
            "jobs_without_timely_2xx": int(len(acked) - len(waits))}


def load_window(spec_json: dict[str, Any]) -> tuple[float, float]:
    """(start, end) of the load phase as planned: the runner's `load` phase start plus the
    scenario's duration (producers stop then; the phase's own end waits for them)."""
    for phase in spec_json.get("phases") or []:
        if phase.get("name") == "load" and phase.get("start") is not None:
            start = float(phase["start"])
            return start, start + float(spec_json["scenario"]["duration"])
    raise HistoryError("spec.json records no load phase: the run did not reach its load")


def analyse_run(run_dir: Path) -> dict[str, Any]:
    """One run's figures, from its directory alone."""
    spec_json = read_json(run_dir / SPEC_FILE)
    run_json = read_json(run_dir / RUN_FILE)
    http_timeout = float(run_json["http_timeout_seconds"])
    faults = list(read_jsonl(run_dir / NEMESIS_FILE))
    out: dict[str, Any] = {
        "lease_seconds": float(run_json["lease_seconds"]),
        "http_timeout_seconds": http_timeout,
    }
    applied = [f for f in faults if not f.get("skipped")]
    if not applied:
        reasons = "; ".join(str(f["skipped"]) for f in faults) or "no fault recorded"
        out["skipped"] = reasons
        return out
    load_start, load_end = load_window(spec_json)
    fault_start = min(float(f["start"]) for f in applied)
    fault_end = max(float(f["end"] if f.get("end") is not None else f["start"])
                    for f in applied)
    deliveries = read_deliveries(run_dir, http_timeout)
    out["fault"] = {
        "at_seconds": round(fault_start - load_start, 3),
        "window_seconds": round(fault_end - fault_start, 3),
        "hit": sorted({str(f.get("target")) for f in applied}),
        "data": applied[0].get("data") or {},
    }
    out["deliveries"] = deliveries.deliveries
    out["jobs_2xx"] = deliveries.jobs_2xx
    out["jobs_duplicated"] = deliveries.jobs_duplicated
    out |= slowest_job(run_dir, deliveries.first_timely)
    try:
        measured = recovery_time(deliveries.first_timely.to_numpy(), load_start=load_start,
                                 load_end=load_end, fault_start=fault_start)
    except RecoveryError as exc:
        out["not_measured"] = str(exc)
        return out
    out.update({
        "pre_fault_rate": round(measured.pre_fault_rate, 2),
        "recovered": measured.recovered,
        "recovery_seconds": None if measured.recovery_seconds is None
        else round(measured.recovery_seconds, 3),
        "dip": round(measured.dip, 3),
        "dip_at_seconds": round(measured.dip_at_seconds, 3),
        "series": {
            "bin_end_seconds_after_fault": [round(e - fault_start, 3)
                                            for e in measured.bin_ends],
            "rate": [round(r, 1) for r in measured.rates],
            "rolling_rate": [None if r is None else round(r, 1) for r in measured.rolling],
        },
    })
    return out


# --------------------------------------------------------------------------------------------
# The runs.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Params:
    kinds: tuple[str, ...]
    rate: float
    workers: int
    duration: float
    fault_at: float
    seed: int


def fault_entry(kind: str, fault_at: float) -> dict[str, Any]:
    """The single `[[nemesis]]` entry of a kind's run: its own default window, except the
    failpoints (a short window with a per-job chance)."""
    entry: dict[str, Any] = {"kind": kind, "at": fault_at}
    if kind in FAILPOINT_KINDS:
        entry |= {"duration": FAILPOINT_WINDOW_SECONDS, "probability": FAILPOINT_PROBABILITY}
    return entry


def spec_for(kind: str, params: Params) -> ScenarioSpec:
    base = from_mapping(BASE)
    try:
        return dataclasses.replace(
            base, name=f"recovery-{kind}", rate=params.rate, workers=params.workers,
            duration=params.duration,
            nemesis=(spec_from_mapping(fault_entry(kind, params.fault_at)),),
        ).validate()
    except (SpecError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def window_of(kind: str, spec: ScenarioSpec) -> float:
    entry = spec.nemesis[0]
    return entry.duration or default_duration(kind, lease_seconds=spec.lease,
                                              http_timeout_seconds=spec.http_timeout)


def verdict_summary(verdict: Any) -> dict[str, Any]:
    from skiplock.reports.checker import VIOLATION_KEYS

    counts = dict(verdict.counts)
    violations = {k: v for k, v in counts.items() if k in VIOLATION_KEYS and v}
    return {
        "valid": verdict.valid,
        "exit_code": int(verdict.exit_code),
        "violations": violations,
        "examples": {k: list(verdict.examples.get(k, []))[:3] for k in violations},
        "unknown_reasons": list(verdict.unknown_reasons)[:5],
        "duplicate_explained": int(counts.get("duplicate_explained", 0)),
        "duplicate_unexplained": int(counts.get("duplicate_unexplained", 0)),
        "enqueued": int(counts.get("enqueued", 0)),
    }


def run_kind(kind: str, params: Params, *, server: Any, runs: Path) -> dict[str, Any]:
    """One kind's run, analysed from its directory. A harness failure is this kind's
    result (`error`), not the benchmark's end."""
    from skiplock.scenarios.run.options import RunOptions
    from skiplock.scenarios.run.runner import run_scenario

    spec = spec_for(kind, params)
    row: dict[str, Any] = {"kind": kind, "planned_window_seconds": window_of(kind, spec),
                           "lease_seconds": spec.lease,
                           "http_timeout_seconds": spec.http_timeout}
    if kind in OWNED_SERVER_KINDS and not server.owned:
        row["skipped"] = ("server is external: a restart needs a PostgreSQL the harness "
                          "starts (unset SKIPLOCK_PG_DSN, drop --dsn)")
        return row
    options = RunOptions(seed=params.seed, out=runs, server=server,
                         worker_logs_to_files=True)
    started = time.monotonic()
    try:
        result = run_scenario(spec, options)
    except HarnessError as exc:
        row["error"] = f"harness failure: {exc}"
        row["seconds"] = round(time.monotonic() - started, 1)
        return row
    row["seconds"] = round(time.monotonic() - started, 1)
    row["run_dir"] = str(result.run_dir)
    row["verdict"] = verdict_summary(result.verdict)
    try:
        row.update(analyse_run(result.run_dir))
    except (HistoryError, OSError, KeyError, ValueError) as exc:
        row["error"] = f"cannot read the run directory: {type(exc).__name__}: {exc}"
    return row


# --------------------------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kinds", default=",".join(DEFAULT_KINDS), metavar="KIND[,KIND...]",
        help="fault kinds, one run each (default: all ten)",
    )  # fmt: skip
    parser.add_argument("--rate", type=positive_float, default=60.0, metavar="R",
                        help="jobs/s enqueued, constant (default %(default)g)")
    parser.add_argument("--workers", type=positive_int, default=3, metavar="N",
                        help="dispatcher worker processes (default %(default)d)")
    parser.add_argument("--duration", type=positive_float, default=12.0, metavar="S",
                        help="seconds of load per run (default %(default)g)")
    parser.add_argument("--fault-at", type=positive_float, default=4.0, metavar="S",
                        help="seconds into the load at which the fault starts "
                             "(default %(default)g)")
    parser.add_argument("--seed", type=int, default=1, help="run seed (default 1)")
    parser.add_argument(
        "--dsn", default=None, help="PostgreSQL DSN (default: SKIPLOCK_PG_DSN, else embedded;"
        " restart_postgres is skipped on a DSN)",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=None, metavar="FILE",
        help="JSON result file (default ./bench-results/recovery-TIMESTAMP.json)",
    )  # fmt: skip
    parser.add_argument(
        "--runs", type=Path, default=None, metavar="DIR",
        help="parent of the run directories (default: FILE's name with -runs)",
    )  # fmt: skip


def validate(args: argparse.Namespace) -> Params:
    """One line per mistake, raised as UsageError (exit 2)."""
    kinds = tuple(k.strip() for k in str(args.kinds).split(",") if k.strip())
    if not kinds:
        raise UsageError("--kinds expects KIND[,KIND...], e.g. kill_worker,pause_worker")
    for kind in kinds:
        if kind not in NEMESIS_KINDS:
            raise UsageError(f"unknown fault kind {kind!r} in --kinds; valid: "
                             f"{', '.join(NEMESIS_KINDS)}")
    if len(set(kinds)) != len(kinds):
        raise UsageError("--kinds names a kind twice")
    if args.fault_at < WINDOW_SECONDS:
        raise UsageError(f"--fault-at {args.fault_at:g} leaves less than {WINDOW_SECONDS:g} s "
                         "of load before the fault to measure the pre-fault rate")
    if args.duration - args.fault_at < 2 * HOLD_SECONDS:
        raise UsageError(f"--duration {args.duration:g} ends less than {2 * HOLD_SECONDS:g} s "
                         f"after --fault-at {args.fault_at:g}: raise --duration")
    params = Params(kinds=kinds, rate=float(args.rate), workers=int(args.workers),
                    duration=float(args.duration), fault_at=float(args.fault_at),
                    seed=int(args.seed))
    for kind in kinds:
        spec_for(kind, params)  # refused here, before a server is started
    return params


COLUMNS = (("kind", 19), ("window s", 8), ("pre-fault/s", 11), ("dip", 5),
           ("recovery s", 13), ("slowest job s", 13), ("dup jobs", 8), ("verdict", 0))


def _cells(row: dict[str, Any]) -> list[str]:
    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    dashes = ["-"] * 5
    window = num(row.get("planned_window_seconds"), ".1f")
    if "skipped" in row:
        return [row["kind"], window, *dashes, f"skipped: {row['skipped']}"]
    if "error" in row:
        return [row["kind"], window, *dashes, f"ERROR: {row['error']}"]
    if "not_measured" in row:
        return [row["kind"], window, *dashes, f"{_valid(row['verdict']['valid'])} "
                f"(not measured: {row['not_measured']})"]
    verdict = row["verdict"]
    recovery = ("not recovered" if not row["recovered"]
                else f"{row['recovery_seconds']:.2f}")
    label = _valid(verdict["valid"])
    if verdict["violations"]:
        label += " " + ", ".join(f"{k}={v}" for k, v in verdict["violations"].items())
    return [row["kind"], num(row["fault"]["window_seconds"], ".1f"),
            num(row["pre_fault_rate"], ".1f"), num(row["dip"], ".2f"), recovery,
            num(row.get("slowest_job_seconds"), ".2f"), str(row["jobs_duplicated"]), label]


def _valid(valid: Any) -> str:
    return {True: "valid", False: "INVALID"}.get(valid, str(valid))


def _line(cells: Sequence[str]) -> str:
    return "  ".join(c.ljust(w) if w else c
                     for c, (_, w) in zip(cells, COLUMNS, strict=True)).rstrip()


# What each figure of the result means, written into the result itself.
DEFINITIONS = {
    "rate": "jobs per second whose first 2xx answered within the HTTP timeout "
            "was received by the echo target (deliveries/*.csv, `received`)",
    "pre_fault_rate": "median rolling 1 s rate (mean of four 250 ms bins) over "
                      "the load before the fault",
    "recovery_seconds": "from the fault's start (nemesis.jsonl) until the "
                        "rolling 1 s rate, after first falling below 90% of the "
                        "pre-fault rate, is back at or above it for 1 s; 0 when "
                        "it never fell below; null when not back before the load "
                        "ended",
    "dip": "lowest rolling 1 s rate from the fault until recovery is confirmed, "
           "over the pre-fault rate",
    "jobs_duplicated": "jobs the target answered 2xx more than once",
    "slowest_job_seconds": "longest wait from an acknowledged enqueue to the "
                           "job's first timely 2xx (enqueues.csv, deliveries)",
}


def _parameters(params: Params, runs: Path) -> dict[str, Any]:
    return {
        **dataclasses.asdict(params),
        "kinds": list(params.kinds),
        "workload": {k: v for k, v in BASE.items() if k not in ("name", "description")}
        | {"rate": params.rate, "workers": params.workers, "duration": params.duration},
        "fault_entries": {k: fault_entry(k, params.fault_at) for k in params.kinds},
        "bin_seconds": BIN_SECONDS,
        "rolling_window_seconds": WINDOW_SECONDS,
        "threshold": THRESHOLD,
        "hold_seconds": HOLD_SECONDS,
        "runs": str(runs),
    }


def bench(params: Params, *, dsn: str | None, runs: Path, out: Path | None = None,
          say: Callable[[str], None] = print) -> dict[str, Any]:
    """Every kind's run on one server; the self-describing result, also written to `out`
    (when given) if the benchmark is interrupted or the server fails."""
    from skiplock.scenarios.run.gate import gate_server

    started = time.time()
    rows: list[dict[str, Any]] = []
    doc: dict[str, Any] = {"benchmark": "recovery", "started": started}
    interrupted = False
    try:
        with gate_server(dsn) as server:
            settings = server.settings()
            say(f"server: {server.kind} {server.display}, PostgreSQL "
                f"{settings['server_version']}, fsync={settings['fsync']} "
                f"synchronous_commit={settings['synchronous_commit']} "
                f"full_page_writes={settings['full_page_writes']}"
                + ("" if settings["durable"] else "  (NOT durable)"))
            base = spec_for(params.kinds[0], params)
            say(f"{params.rate:g} jobs/s of succeed jobs, {params.workers} workers, one fault "
                f"at {params.fault_at:g} s of {params.duration:g} s of load; lease "
                f"{base.lease:g} s, HTTP timeout {base.http_timeout:g} s; runs in {runs}")
            say("rate: first timely 2xx per job at the target, 250 ms bins, rolling 1 s; "
                f"recovered: back to >= {THRESHOLD:.0%} of the pre-fault median for "
                f"{HOLD_SECONDS:g} s")
            say(_line([name for name, _ in COLUMNS]))
            doc |= {"server": {"kind": server.kind, "dsn": server.display,
                               "owned": server.owned},
                    "durable": settings["durable"], **describe(server.dsn)}
            for kind in params.kinds:
                row = run_kind(kind, params, server=server, runs=runs)
                rows.append(row)
                say(_line(_cells(row)))
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        doc |= {"finished": time.time(),
                # Beside machine.load_average at the start: the cores may be shared.
                "load_average_at_finish": [round(x, 2) for x in os.getloadavg()],
                "interrupted": interrupted, "parameters": _parameters(params, runs),
                "definitions": DEFINITIONS, "results": rows}
        if out is not None:
            write_json(out, doc)
            say(f"written: {out}")
    return doc


def run(args: argparse.Namespace) -> int:
    params = validate(args)
    out = result_path(args.out, "recovery")
    runs: Path = args.runs or out.with_name(f"{out.stem}-runs")
    try:
        runs.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--runs {runs}: cannot create it ({exc.strerror})") from None
    doc = bench(params, dsn=args.dsn, runs=runs, out=out,
                say=lambda line: print(line, flush=True))
    rows = doc["results"]
    invalid = [r for r in rows if r.get("verdict", {}).get("valid") not in (True, None)]
    for row in invalid:
        print(f"warning: {row['kind']} run was {_valid(row['verdict']['valid'])}: "
              f"{row['run_dir']}", flush=True)
    failed = [r["kind"] for r in rows if "error" in r]
    if failed:
        raise HarnessError(f"run(s) did not complete: {', '.join(failed)} (see {out})")
    return 0

