"""`skiplock check RUN_DIR [RUN_DIR...]`: judge recorded runs from their history alone.

Exit codes: 0 valid, 1 a guarantee violated, 2 bad input (one line naming the file and what is
wrong), 3 unknown (the history cannot decide: a log cut off mid-line, a drain that timed
out), 4 harness failure. This module prints its own one-line errors so that `reports` needs
nothing from the runner's packages.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from reports.checker import (
    COUNT_KEYS,
    DEFAULT_TOLERANCE_SECONDS,
    VIOLATION_KEYS,
    Verdict,
    check_run,
    write_verdict,
)
from reports.history import HistoryError

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
    for key in COUNT_KEYS:
        value = verdict.counts.get(key, 0)
        bad = key in VIOLATION_KEYS and value > 0
        style = "bold red" if bad else ("dim" if value == 0 else "")
        table.add_row(key, str(value), style=style)
    console.print(table)
    for kind, items in verdict.examples.items():
        for item in items[: max(examples, 0)]:
            console.print(f"  {kind}: {item['job_id']}: {item['why']}", markup=False,
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


def run(args: argparse.Namespace) -> int:
    run_dirs: list[Path] = list(args.run_dirs)
    if args.tolerance < 0:
        print("skiplock: check: --tolerance must be >= 0", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        verdict = check_run(run_dirs, tolerance_seconds=args.tolerance)
        path = write_verdict(run_dirs[0], verdict)
    except HistoryError as exc:
        print(f"skiplock: check: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        print(f"skiplock: harness failure: check: {type(exc).__name__}: {_one_line(str(exc))}",
              file=sys.stderr)
        return EXIT_HARNESS
    render(verdict, path, Console(), examples=args.examples)
    return verdict.exit_code
