"""`skiplock` command line: one module per command, registered below.

Each command module exposes `configure(parser)` and `run(args) -> int`. Errors that are the
user's to fix raise `UsageError` (exit 2, one line); harness failures raise `HarnessError`
(exit 4). Ctrl-C exits 130 and SIGTERM (a CI job cancelled, `kill`) exits 143, each after
the command's own cleanup has run: SIGTERM is turned into the same KeyboardInterrupt.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType, ModuleType

from scenarios.errors import HarnessError, UsageError

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("scenarios.cmd_demo", "short friendly end-to-end run on embedded servers"),
    "run": ("scenarios.cmd_run", "run one scenario and judge it"),
    "gate": ("scenarios.cmd_gate", "CI correctness gate: chaos scenarios over seeds, JUnit XML"),
    "check": ("reports.cmd_check", "judge one or more run directories from their history"),
    "worker": ("scenarios.cmd_worker", "start dispatcher worker processes against a DSN"),
    "target": ("chaos.cmd_target", "run the duplicate-detecting echo target"),
    "bench": ("scenarios.cmd_bench", "benchmarks: queue throughput, checker speed, target"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse prints usage plus the message and exits 2; keep it to one line.
        raise UsageError(f"{self.prog}: {message}")


def _load(module_name: str) -> ModuleType:
    return importlib.import_module(module_name)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="skiplock", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        # Import only the command being run, so `skiplock check` works without gevent etc.
        if only is None or only == name:
            _load(module_name).configure(command_parser)
        command_parser.set_defaults(_module=module_name)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be, so every command's cleanup runs for both."""


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM raises `Terminated` in the main thread of this process.

    Only the first SIGTERM raises: later ones (a supervisor repeating itself) are ignored so
    that they cannot cut the cleanup short; SIGKILL remains for an impatient caller, and the
    child processes die with this one (they ask Linux for a parent-death signal). A process
    forked from this one resets the handler to the default rather than raising in a copy of
    this program."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()
    seen = False

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        nonlocal seen
        if os.getpid() != owner:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if seen:
            return
        seen = True
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    only = argv[0] if argv and argv[0] in COMMANDS else None
    try:
        with sigterm_as_interrupt():
            args = build_parser(only).parse_args(argv)
            return int(_load(args._module).run(args))
    except UsageError as exc:
        print(f"skiplock: {exc}", file=sys.stderr)
        return exc.exit_code
    except HarnessError as exc:
        print(f"skiplock: harness failure: {exc}", file=sys.stderr)
        return exc.exit_code
    except Terminated:
        print("skiplock: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("skiplock: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
