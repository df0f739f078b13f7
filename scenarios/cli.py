"""`skiplock` command line: one module per command, registered below.

Each command module exposes `configure(parser)` and `run(args) -> int`. Errors that are the
user's to fix raise `UsageError` (exit 2, one line); harness failures raise `HarnessError`
(exit 4). Ctrl-C exits 130 after the command's own cleanup has run.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from scenarios.errors import HarnessError, UsageError

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("scenarios.cmd_demo", "short friendly end-to-end run on embedded servers"),
    "run": ("scenarios.cmd_run", "run one scenario and judge it"),
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    only = argv[0] if argv and argv[0] in COMMANDS else None
    try:
        args = build_parser(only).parse_args(argv)
        return int(_load(args._module).run(args))
    except UsageError as exc:
        print(f"skiplock: {exc}", file=sys.stderr)
        return exc.exit_code
    except HarnessError as exc:
        print(f"skiplock: harness failure: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("skiplock: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
