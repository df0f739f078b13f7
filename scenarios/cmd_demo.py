"""`skiplock demo`: a short, friendly end-to-end run with live progress and a summary.

By default it runs `steady` with a few faulty scripts mixed in, for about 20 seconds, on
whatever PostgreSQL provisioning finds (an embedded server on a fresh machine), and ends with
a summary table: throughput, enqueue-to-delivery latency, counts, verdict, run directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from scenarios.cmd_run import add_scenario_arguments, resolve, verdict_label

DEMO_DEFAULTS = [
    "warmup=2",
    "duration=15",
    "rate=60",
    "workers=2",
    "mix.fail_then_succeed=0.1",
    "mix.always_400=0.03",
    "mix.slow=0.1",
]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", nargs="?", default="steady", metavar="SCENARIO",
                        help="scenario to demonstrate (default: steady, with a few 5xx, 4xx"
                        " and slow jobs mixed in)")
    add_scenario_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from scenarios.progress import LiveProgress
    from scenarios.runner import RunOptions, run_scenario

    args.overrides = [*DEMO_DEFAULTS, *args.overrides] if args.scenario == "steady" else list(
        args.overrides
    )
    spec, seed = resolve(args, args.scenario)
    console = Console(highlight=False)
    console.print(
        f"[bold]skiplock demo[/]: scenario [cyan]{spec.name}[/], backend {args.backend},"
        f" {spec.workers} workers, {spec.rate:g} jobs/s for {spec.warmup + spec.duration:g} s,"
        f" seed {seed}"
    )
    options = RunOptions(backend=args.backend, seed=seed, out=args.out, dsn=args.dsn,
                         sql_path=args.sql_path, schema=args.schema)
    with LiveProgress(f"{spec.name} on {args.backend}", console=console) as live:
        result = run_scenario(spec, options, observer=live,
                              announce=lambda m: console.print(f"[dim]{m}[/]"))
    console.print()
    console.print(summary_table(result.run_dir, result.verdict, spec.duration + spec.warmup,
                                spec.http_timeout))
    console.print(f"run directory: [bold]{result.run_dir}[/]")
    console.print(f"re-check it any time: skiplock check {result.run_dir}")
    return result.exit_code


def latencies(run_dir: Path, http_timeout: float) -> dict[str, float | None]:
    """Per job: from the enqueue's acknowledgement (`ok`) to the target receiving the first
    delivery it answered 2xx within the HTTP timeout (a later 2xx reached nobody)."""
    import pandas as pd

    from reports.history import (
        DELIVERIES_DIR,
        DELIVERY_LOG,
        ENQUEUE_LOG,
        ENQUEUES_FILE,
        LOG_SUFFIX,
        read_log,
    )

    enq = pd.DataFrame(
        [r for r in read_log(run_dir / ENQUEUES_FILE, ENQUEUE_LOG) if r.get("type") == "ok"],
        columns=["job_id", "time"],
    ).drop_duplicates("job_id")
    rows: list[dict[str, Any]] = []
    for path in sorted((run_dir / DELIVERIES_DIR).glob(f"*{LOG_SUFFIX}")):
        rows.extend(read_log(path, DELIVERY_LOG))
    dels = pd.DataFrame(rows, columns=["job_id", "received", "answered", "status"])
    dels = dels.dropna(subset=["answered", "status"])
    ok = dels[(dels["status"] >= 200) & (dels["status"] < 300)
              & (dels["answered"] - dels["received"] <= http_timeout)]
    first = ok.groupby("job_id")["received"].min()
    joined = enq.set_index("job_id").join(first, how="inner")
    lat = joined["received"] - joined["time"]
    if lat.empty:
        return {"p50": None, "p99": None, "jobs": 0, "span": None}
    span = float(joined["received"].max() - joined["time"].min())
    return {"p50": float(lat.quantile(0.5)), "p99": float(lat.quantile(0.99)),
            "jobs": float(len(lat)), "span": span}


def summary_table(run_dir: Path, verdict: Any, load_seconds: float,
                  http_timeout: float) -> Table:
    counts: dict[str, int] = dict(verdict.counts)
    lat = latencies(run_dir, http_timeout)
    table = Table(title="skiplock demo: summary", show_header=True, header_style="bold")
    table.add_column("measure")
    table.add_column("value", justify="right")
    span = lat.get("span") or 0.0
    delivered_jobs = lat.get("jobs") or 0.0
    table.add_row("jobs/s delivered (first success)",
                  f"{delivered_jobs / span:.1f}" if span else "-")
    for key in ("p50", "p99"):
        value = lat.get(key)
        table.add_row(f"{key} enqueue ok -> first timely 2xx",
                      "-" if value is None else f"{value * 1000:.0f} ms")
    for key, value in counts.items():
        style = "red" if value and key not in (
            "enqueued", "delivered", "completed", "failed", "duplicate_explained") else ""
        table.add_row(key, f"[{style}]{value}[/]" if style else str(value))
    valid = verdict.valid
    table.add_row("verdict", verdict_label(valid))
    table.caption = (
        f"load phase {load_seconds:g} s; latency: from the enqueue's acknowledgement (ok) to"
        f" the target receiving the first delivery it answered 2xx within the"
        f" {http_timeout:g} s HTTP timeout"
    )
    return table
