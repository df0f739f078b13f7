"""`skiplock demo`: a short, friendly end-to-end run with live progress and a summary.

By default it runs the scenario `demo`: `steady`'s accounts and limits with faulty jobs mixed
in (5xx then success, a 400 that dead-letters at once, slow answers), for about 20 seconds,
on whatever PostgreSQL provisioning finds (an embedded server on a fresh machine). It says
what is mixed in, and so does the run's spec.json. It ends with a summary table whose
delivery counts are the live table's, under the same labels: throughput,
enqueue-to-delivery latency, counts, verdict, run directory.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from skiplock.scenarios.cli.run import (
    add_scenario_arguments,
    backend_options,
    checked_server,
    print_report,
    resolve,
    run_options,
    verdict_label,
)
from skiplock.scenarios.run.spec import ScenarioSpec, load, replay_command

# The demo's scenario: `steady` with this load and these faulty scripts mixed in, under its
# own name, so that nothing calls it fault-free.
DEMO_NAME = "demo"
DEMO_BASE = "steady"
DEMO_DEFAULTS = [
    "warmup=2",
    "duration=15",
    "rate=60",
    "workers=2",
    "mix.fail_then_succeed=0.1",
    "mix.always_400=0.03",
    "mix.slow=0.1",
]

# What each script does, in the words of a description (docs/reference/scenario-files.md).
_SCRIPT_TEXT: dict[str, Callable[[ScenarioSpec], str]] = {
    "succeed": lambda s: "",
    "fail_then_succeed": lambda s: f"{s.fail_status} x{s.fail_times}, then 200",
    "always_400": lambda s: "400: a dead letter at once",
    "always_fail": lambda s: f"{s.fail_status} until dead-lettered",
    "slow": lambda s: f"200 after {s.slow_seconds:g} s",
    "slow_then_slower": lambda s: (f"200 after {s.slow_seconds:g} s, "
                                   f"{2 * s.slow_seconds:g} s when delivered again"),
    "hang_then_late": lambda s: "a 200 past the HTTP timeout once",
    "hang_forever": lambda s: "no answer once",
    "reset": lambda s: "a connection reset once",
    "always_hang": lambda s: "no answer until dead-lettered",
}


def describe_mix(spec: ScenarioSpec) -> str:
    """Each script's share of the jobs and what it does, largest share first."""
    total = sum(spec.mix.values())
    shares = sorted(((w, name) for name, w in spec.mix.items() if w > 0), reverse=True)
    parts = []
    for weight, name in shares:
        what = _SCRIPT_TEXT[name](spec)
        parts.append(f"{weight / total:.0%} {name}" + (f" ({what})" if what else ""))
    return ", ".join(parts)


def demo_spec(spec: ScenarioSpec, overrides: Sequence[str]) -> ScenarioSpec:
    """`steady` plus the demo's mix, named and described as what it is (a name or
    description the user gave stays theirs)."""
    given = {item.partition("=")[0].strip() for item in overrides}
    changes: dict[str, Any] = {}
    if "name" not in given:
        changes["name"] = DEMO_NAME
    if "description" not in given:
        changes["description"] = (f"{DEMO_BASE} ({len(spec.accounts)} accounts with limits)"
                                  f" with faulty jobs mixed in: {describe_mix(spec)}")
    return dataclasses.replace(spec, **changes).validate()


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", nargs="?", default=DEMO_BASE, metavar="SCENARIO",
                        help=f"scenario to demonstrate (default: {DEMO_NAME}, that is"
                        f" {DEMO_BASE} with a few 5xx, 400 and slow jobs mixed in)")
    add_scenario_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from skiplock.scenarios.run.progress import LiveProgress
    from skiplock.scenarios.run.runner import run_scenario

    user_overrides = list(args.overrides)
    is_demo = args.scenario == DEMO_BASE
    if is_demo:
        args.overrides = [*DEMO_DEFAULTS, *user_overrides]
    spec, seed = resolve(args, args.scenario)
    replay = None
    if is_demo:
        spec = demo_spec(spec, user_overrides)
        replay = replay_command(spec, seed=seed, backend=args.backend, sql_path=args.sql_path,
                                command=["skiplock", "demo"],
                                base=demo_spec(load(DEMO_BASE, DEMO_DEFAULTS), []),
                                backend_options=backend_options(args))
    console = Console(highlight=False)
    with checked_server(args) as server:
        console.print(
            f"[bold]skiplock demo[/]: scenario [cyan]{spec.name}[/], backend {args.backend},"
            f" {spec.workers} workers, {spec.rate:g} jobs/s for"
            f" {spec.warmup + spec.duration:g} s, seed {seed}"
        )
        if spec.description:
            console.print(f"[dim]{spec.name}: {spec.description}[/]")
        with LiveProgress(f"{spec.name} on {args.backend}", console=console) as live:
            options = dataclasses.replace(run_options(args, seed, server), replay=replay)
            result = run_scenario(spec, options, observer=live,
                                  announce=lambda m: console.print(f"[dim]{m}[/]"))
    console.print()
    console.print(summary_table(result.run_dir, result.verdict, spec.duration + spec.warmup,
                                spec.http_timeout))
    console.print(f"run directory: [bold]{result.run_dir}[/]")
    console.print(f"re-check it any time: skiplock check {result.run_dir}")
    print_report(console, result)
    return result.exit_code


def latencies(run_dir: Path, http_timeout: float) -> dict[str, float | None]:
    """Per job: from the enqueue's acknowledgement (`ok`) to the target receiving the first
    delivery it answered 2xx within the HTTP timeout (a later 2xx reached nobody). Also the
    number of 2xx answers of any time (`answered_2xx`), as the live table counts them."""
    import pandas as pd

    from skiplock.reports.history import (
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
    two_xx = dels[(dels["status"] >= 200) & (dels["status"] < 300)]
    ok = two_xx[two_xx["answered"] - two_xx["received"] <= http_timeout]
    first = ok.groupby("job_id")["received"].min()
    joined = enq.set_index("job_id").join(first, how="inner")
    lat = joined["received"] - joined["time"]
    if lat.empty:
        return {"p50": None, "p99": None, "jobs": 0, "span": None,
                "answered_2xx": float(len(two_xx))}
    span = float(joined["received"].max() - joined["time"].min())
    return {"p50": float(lat.quantile(0.5)), "p99": float(lat.quantile(0.99)),
            "jobs": float(len(lat)), "span": span, "answered_2xx": float(len(two_xx))}


# The checker's counts that describe the run rather than report an anomaly.
_DESCRIPTIVE = ("enqueued", "delivered", "completed", "failed", "duplicate_explained")


def summary_table(run_dir: Path, verdict: Any, load_seconds: float,
                  http_timeout: float) -> Table:
    from skiplock.scenarios.run.progress import LABELS

    counts: dict[str, int] = dict(verdict.counts)
    lat = latencies(run_dir, http_timeout)
    table = Table(title="skiplock demo: summary", show_header=True, header_style="bold")
    table.add_column("measure")
    table.add_column("value", justify="right")
    span = lat.get("span") or 0.0
    delivered_jobs = lat.get("jobs") or 0.0
    table.add_row("jobs/s delivered (first timely 2xx)",
                  f"{delivered_jobs / span:.1f}" if span else "-")
    for key in ("p50", "p99"):
        value = lat.get(key)
        table.add_row(f"{key} enqueue ok -> first timely 2xx",
                      "-" if value is None else f"{value * 1000:.0f} ms")
    for key in _DESCRIPTIVE[:4]:
        table.add_row(LABELS[key], str(counts.get(key, 0)))
        if key == "delivered":
            # The live table's count: every 2xx answer, on time or late.
            table.add_row(LABELS["delivered_ok"], f"{lat.get('answered_2xx') or 0:.0f}")
    table.add_row("repeat 2xx a fault or timeout explains",
                  str(counts.get("duplicate_explained", 0)))
    table.add_row("anomalies the checker found", "", style="bold")
    for key, value in counts.items():
        if key not in _DESCRIPTIVE:
            table.add_row(f"  {key}", f"[red]{value}[/]" if value else str(value))
    valid = verdict.valid
    table.add_row("verdict", verdict_label(valid))
    table.caption = (
        f"warm-up and load {load_seconds:g} s. Latency: from the enqueue's acknowledgement (ok)"
        f" to the target receiving the first delivery it answered 2xx within the"
        f" {http_timeout:g} s HTTP timeout. Deliveries count every request, retries"
        " included; completed and failed count jobs."
    )
    return table
