"""`skiplock target`: run one duplicate-detecting echo target in the foreground.

It prints its URL once it listens and runs until Ctrl-C or SIGTERM; deliveries still open
then are recorded as unanswered. Jobs should target `URL/deliver`. Once it has stopped, it
exits as every command does: 130 for Ctrl-C, 143 for SIGTERM (it raises the interrupt for
the CLI to map).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from pathlib import Path

from skiplock.chaos.target import (
    DEFAULT_HANG_CAP_SECONDS,
    check_host,
    check_name,
    deliveries_path,
    serve,
    url_for,
)
from skiplock.plumbing.argtypes import port, positive_float
from skiplock.plumbing.errors import Terminated, UsageError
from skiplock.reports.history import DELIVERIES_DIR, LOG_SUFFIX, HistoryError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default="127.0.0.1", help="loopback address to listen on (default 127.0.0.1)"
    )
    parser.add_argument(
        "--port", type=port, default=0, help="port to listen on; 0 picks a free one (default)"
    )
    parser.add_argument(
        "--name", default="target-0", help="target name, and its log's file name (target-0)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("."),
        help=f"run directory; deliveries go to OUT/{DELIVERIES_DIR}/NAME{LOG_SUFFIX} "
        "(default: .)",
    )
    parser.add_argument(
        "--hang-cap",
        type=positive_float,
        default=DEFAULT_HANG_CAP_SECONDS,
        metavar="S",
        help="seconds a hang_forever delivery is held at most (default %(default)g)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        host = check_host(args.host)
        name = check_name(args.name)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    out: Path = args.out
    # What this command adds, so that a refusal leaves the folder as it found it.
    made = [d for d in (out, out / DELIVERIES_DIR) if not d.exists()]
    log_was_there = deliveries_path(out, name).exists()
    try:
        (out / DELIVERIES_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {out / DELIVERIES_DIR}: {exc.strerror}") from None

    def on_ready(port: int) -> None:
        print(f"skiplock target {name} listening on {url_for(host, port)}", flush=True)
        print(f"deliver to {url_for(host, port)}/deliver; log {deliveries_path(out, name)}")
        sys.stdout.flush()

    try:
        stopped_by = asyncio.run(
            serve(
                out_dir=out,
                name=name,
                host=host,
                port=args.port,
                hang_cap_seconds=args.hang_cap,
                on_ready=on_ready,
            )
        )
    except HistoryError as exc:
        # The log exists with another version's columns; appending would corrupt it.
        raise UsageError(str(exc)) from None
    except OSError as exc:
        if not log_was_there:
            _remove_unused(deliveries_path(out, name), made)
        raise UsageError(
            f"cannot listen on {url_for(host, args.port)}: {exc.strerror or exc}; "
            "pick another --port, or 0 for a free one"
        ) from None
    # The target has stopped cleanly; the CLI turns these into 130 and 143 like any
    # interrupted command's.
    if stopped_by == signal.SIGTERM:
        raise Terminated()
    if stopped_by == signal.SIGINT:
        raise KeyboardInterrupt
    return 0


def _remove_unused(log: Path, made: list[Path]) -> None:
    """The delivery log a refused target opened (its header only), and the folders it made
    for it, when they hold nothing else."""
    with contextlib.suppress(OSError):
        if log.exists() and len(log.read_bytes().splitlines()) <= 1:
            log.unlink()
    for folder in reversed(made):
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty
