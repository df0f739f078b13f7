"""`skiplock report RUN_DIR [RUN_DIR...] [--out FILE]`: the HTML report of recorded runs.

One directory: RUN_DIR/report.html (what `run`, `demo` and `gate` write by themselves).
Several: one page comparing them, ./report.html unless --out says where. A damaged or
unfinished run still gets a report, which says at the top what it could not read; a path
that holds no run is bad input (exit 2, one line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from skiplock.reports.history import HistoryError
from skiplock.reports.report import write_report

EXIT_BAD_INPUT = 2
EXIT_HARNESS = 4


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="run directory; several give one page comparing them")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="where to write the page (default: RUN_DIR/report.html for one "
                             "run, ./report.html for several)")


def _fail(message: str, code: int) -> int:
    prefix = "skiplock: harness failure: report: " if code == EXIT_HARNESS else (
        "skiplock: report: ")
    print(prefix + " ".join(str(message).split()), file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    out: Path | None = args.out
    if out is not None and (out.is_dir() or str(out).endswith("/")):
        return _fail(f"--out {out} is a directory: give a file name such as "
                     f"{out / 'report.html'}", EXIT_BAD_INPUT)
    try:
        path = write_report(list(args.run_dirs), out)
    except HistoryError as exc:
        return _fail(str(exc), EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        raise
    except OSError as exc:
        where = exc.filename or out
        return _fail(f"cannot write {where} ({exc.strerror or exc})", EXIT_BAD_INPUT)
    except Exception as exc:
        return _fail(f"{type(exc).__name__}: {exc}", EXIT_HARNESS)
    print(f"report: {path.resolve()}  (open it in a browser: file://{path.resolve()})")
    return 0
