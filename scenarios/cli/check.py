"""`skiplock check RUN_DIR [RUN_DIR...]`: judge recorded runs from their history alone.

Exit codes: 0 valid, 1 a guarantee violated, 2 bad input (one line naming the file or flag
and what is wrong), 3 unknown (the history cannot decide: a log cut off mid-line, a drain
that timed out), 4 harness failure. `run` is the one place that maps what went wrong to an
exit code, and it prints one line to stderr, never a traceback: CI reads the exit code, and
1 must mean a guarantee violated in a complete history and nothing else. This module prints
its own one-line errors so that `reports` needs nothing from the runner's packages.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

from rich.console import Console
from rich.table import Table

from skiplock.reports.checker import (
    COUNT_KEYS,
    DEFAULT_TOLERANCE_SECONDS,
    VIOLATION_KEYS,
    Verdict,
    check_run,
    write_verdict,
)
from skiplock.reports.history import VERDICT_FILE, HistoryError
from skiplock.reports.objectives import ObjectiveError, Objectives, split_overrides

EXIT_BAD_INPUT = 2
EXIT_HARNESS = 4


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dirs",
        nargs="+",
        type=Path,
        metavar="RUN_DIR",
        help="run directory; further directories add their delivery, worker and fault logs",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE_SECONDS,
        metavar="SECONDS",
        help="slack allowed when comparing event times (default %(default)s)",
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="objectives.KEY=VALUE",
        help="judge with this objective instead of the run's (repeatable), e.g. "
             "objectives.first_delivery_p99=0.5 or objectives.account.acme.oldest_due_age=2",
    )
    parser.add_argument(
        "--examples", type=int, default=3, metavar="N",
        help="examples to print per anomaly (all of them are in verdict.json)",
    )


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def render(verdict: Verdict, path: Path, console: Console, examples: int = 3) -> None:
    """A compact table of the counts, the first examples, and where the verdict is."""
    table = Table(title="skiplock check", show_header=True, header_style="bold")
    table.add_column("count")
    table.add_column("value", justify="right")
    # Counts the history cannot decide (a log cut off) are shown, but not as violations.
    not_judged = verdict.details.get("not_judged") or {}
    not_applicable: dict[str, str] = verdict.details.get("not_applicable") or {}
    for key in COUNT_KEYS:
        value = verdict.counts.get(key, 0)
        bad = key in VIOLATION_KEYS and value > 0
        style = ("yellow" if key in not_judged else "bold red") if bad else (
            "dim" if value == 0 else "")
        table.add_row(key, "n/a" if key in not_applicable else str(value), style=style)
    console.print(table)
    for kind, reason in not_applicable.items():
        console.print(f"  {kind} not applicable: {reason}", markup=False, highlight=False,
                      soft_wrap=True)
    for kind, items in verdict.examples.items():
        label = f"{kind} (not judged)" if kind in not_judged else kind
        for item in items[: max(examples, 0)]:
            console.print(f"  {label}: {item['job_id']}: {item['why']}", markup=False,
                          highlight=False, soft_wrap=True)
    for reason in verdict.unknown_reasons:
        console.print(f"  unknown: {reason}", markup=False, highlight=False, soft_wrap=True)
    if verdict.valid is True:
        label = "[bold green]VALID[/]"
    elif verdict.valid is False:
        label = "[bold red]VIOLATED[/]"
    else:
        label = "[bold yellow]UNKNOWN[/]"
    timings = verdict.timings
    console.print(
        f"{label}  (checked in {timings.get('total_seconds', 0.0):.2f}s)  verdict: {path}",
        highlight=False,
        soft_wrap=True,
    )


def _bad_flag(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, as one line, or None."""
    tolerance = args.tolerance
    if not (math.isfinite(tolerance) and tolerance >= 0):
        return (f"--tolerance must be a finite number of seconds >= 0, not {tolerance:g} "
                f"(default {DEFAULT_TOLERANCE_SECONDS:g})")
    if args.examples < 1:
        return f"--examples must be a whole number >= 1, not {args.examples}"
    objectives, other = split_overrides(args.overrides)
    if other:
        return (f"--set {other[0]}: check changes only objectives (objectives.KEY=VALUE); "
                "the run's other settings are what it ran with")
    try:
        Objectives().with_overrides(objectives)
    except ObjectiveError as exc:
        return f"--set: {exc}"
    return None


def _fail(message: str, code: int) -> int:
    prefix = "skiplock: harness failure: check: " if code == EXIT_HARNESS else "skiplock: check: "
    print(prefix + _one_line(message), file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    run_dirs: list[Path] = list(args.run_dirs)
    bad = _bad_flag(args)
    if bad is not None:
        return _fail(bad, EXIT_BAD_INPUT)
    try:
        # Arithmetic on odd but well-formed values (an attempt header past 2**63) may warn;
        # stderr carries one line or nothing.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            verdict = check_run(run_dirs, tolerance_seconds=args.tolerance,
                                objectives=split_overrides(args.overrides)[0])
    except HistoryError as exc:
        return _fail(str(exc), EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        raise
    except OSError as exc:
        # The reader names the files it cannot read; this is what it did not foresee.
        if exc.filename is not None:
            return _fail(f"{exc.filename} cannot be read ({exc.strerror or exc})",
                         EXIT_BAD_INPUT)
        return _fail(f"{type(exc).__name__}: {exc}", EXIT_HARNESS)
    except Exception as exc:
        return _fail(f"{type(exc).__name__}: {exc}", EXIT_HARNESS)
    try:
        path = write_verdict(run_dirs[0], verdict)
    except OSError as exc:
        return _fail(f"cannot write {run_dirs[0] / VERDICT_FILE} ({exc.strerror or exc}): "
                     "make the run directory writable, or check a copy of it",
                     EXIT_BAD_INPUT)
    render(verdict, path, Console(), examples=args.examples)
    return verdict.exit_code
