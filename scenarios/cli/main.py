"""`skiplock` command line: one module per command, registered below.

Each command module exposes `configure(parser)` and `run(args) -> int`. `main` is the one
place where every command's errors become exit codes: `UsageError` (bad input) 2 with one
line; `HarnessError` 4 with one line; any other exception 4 with one line naming it, never a
traceback unless `--debug`; Ctrl-C 130 and SIGTERM (a CI job cancelled, `kill`) 143, each
after the command's own cleanup has run: SIGTERM is turned into `Terminated`, a
KeyboardInterrupt. Exit code 1 comes only from a verdict a command returns.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import sys
import textwrap
import traceback
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from skiplock import __version__
from skiplock.plumbing.errors import HarnessError, Terminated, UsageError, sigterm_as_interrupt

__all__ = ["COMMANDS", "EPILOGS", "Terminated", "build_parser", "main", "sigterm_as_interrupt"]

# command name -> (module under `skiplock`, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("scenarios.cli.demo", "short friendly end-to-end run on embedded servers"),
    "run": ("scenarios.cli.run", "run one scenario and judge it"),
    "gate": ("scenarios.cli.gate", "CI correctness gate: chaos scenarios over seeds, JUnit XML"),
    "check": ("scenarios.cli.check", "judge one or more run directories from their history"),
    "report": ("scenarios.cli.report", "an HTML report of one run, or several side by side"),
    "worker": ("scenarios.cli.worker", "start dispatcher worker processes against a DSN"),
    "target": ("scenarios.cli.target", "run the duplicate-detecting echo target"),
    "bench": ("scenarios.cli.bench", "benchmarks: queue throughput, checker speed, target"),
    "sweep": ("scenarios.cli.sweep", "capacity: step the offered rate, find the knee"),
    "plans": ("scenarios.cli.plans", "the claim's cost as the jobs table grows and bloats"),
    "compare": ("scenarios.cli.compare", "compare two result files; exit 1 on a regression"),
}

EXIT_HARNESS = HarnessError.exit_code
EXIT_INTERRUPTED = 130
WIDTH = 88

DESCRIPTION = """\
skiplock: load and correctness harness for PostgreSQL SKIP LOCKED job queues.

It runs a queue (the reference one, a variant, or your own SQL) under load and faults:
producers enqueue, dispatcher workers claim and call a duplicate-detecting echo target,
workers crash, targets hang, PostgreSQL restarts. It records everything that happened in a
run directory, then proves from that history alone whether every job was delivered, and
explains every duplicate. PostgreSQL comes from --dsn or SKIPLOCK_PG_DSN, else Docker,
else an embedded server it starts and removes itself."""

EXIT_CODES = """\
exit codes (every command):
  0    success: valid
  1    a guarantee was violated (only ever a verdict)
  2    bad input or usage; one line says what to fix
  3    unknown: the history cannot decide (a drain that timed out, an interrupted run)
  4    harness failure; one line says what failed and where the details are
       (skiplock --debug COMMAND ... prints the traceback)
  130  Ctrl-C, after cleanup: processes stopped, an embedded server removed
  143  SIGTERM (kill, a cancelled CI job), after the same cleanup"""

TOP_EPILOG = f"""\
{EXIT_CODES}

examples:
  skiplock demo                       # ~25 s end to end on an embedded PostgreSQL
  skiplock run kill-workers --seed 7  # SIGKILL lease holders; judge the history
  skiplock gate --sql my-queue.sql    # the CI gate against your own queue SQL

Each command's --help lists its options, examples and exit codes."""

_INTERRUPTS = """\
  130  Ctrl-C, after the command's cleanup
  143  SIGTERM, after the same cleanup"""

# command name -> its --help epilog (examples and exit codes). {scenarios}, {keys} and {suite}
# are filled in from the scenario files when the command's parser is built.
EPILOGS: dict[str, str] = {
    "run": f"""\
scenarios:
{{scenarios}}
  or a path to a .toml scenario file.

--set KEY=VALUE keys (meanings: docs/reference/scenario-files.md):
{{keys}}

examples:
  skiplock run steady
  skiplock run faulty-targets --seed 42 --workers 4
  skiplock run steady --nemesis pause_worker,terminate_backends --set lease=5
  skiplock run my-scenario.toml --backend pg-naive --set mix.slow=2 --json

exit codes:
  0    valid          1  a guarantee was violated   3  unknown (the history cannot decide)
  2    bad input (an unknown scenario or key, an impossible value, an unreachable --dsn)
  4    harness failure (a server or process of the run failed)
{_INTERRUPTS}
       (an interrupted run keeps its final snapshot: `skiplock check RUN_DIR` answers 3)""",
    "demo": f"""\
scenarios: the same as `skiplock run` (default steady, with a few 5xx, 4xx and slow
jobs mixed in); --set KEY=VALUE takes the same keys (skiplock run --help).

examples:
  skiplock demo
  skiplock demo faulty-targets --seed 42

exit codes:
  0    valid          1  a guarantee was violated   3  unknown (the history cannot decide)
  2    bad input      4  harness failure
{_INTERRUPTS}""",
    "gate": f"""\
the suite (--only picks some; scenario names as in `skiplock run --help`):
{{suite}}

examples:
  skiplock gate                                 # every scenario, one random seed
  skiplock gate --sql my-queue.sql --seeds 3    # your queue's SQL, three seeds each
  skiplock gate --only kill-workers,db-faults --seed 7 --out gate-results

exit codes:
  0    every run valid                1  a guarantee was violated in some run
  3    no violation, but some runs could not be judged
  2    bad input      4  harness failure (a run that could not be carried out)
{_INTERRUPTS}
       (junit.xml and summary.json are written even then)""",
    "check": f"""\
examples:
  skiplock check runs/20250101-120000-steady-s7-ab12
  skiplock check RUN_DIR OTHER_TARGET_LOGS_DIR    # merge delivery logs from other hosts

exit codes:
  0    valid          1  a guarantee was violated
  3    unknown: the history cannot decide (a log cut off, a drain that timed out, an
       interrupted run)
  2    bad input: a missing or malformed history file (one line names it)
  4    harness failure
{_INTERRUPTS}""",
    "worker": f"""\
examples:
  skiplock worker --dsn postgresql://user@db/queue --workers 4 --allow-target 127.0.0.1:8080
  SKIPLOCK_PG_DSN=postgresql://user@db/queue skiplock worker --batch 10 --lease 30 \\
      --failpoint crash_after_http=0.05 --seed 7 --events-dir worker-events

It runs until stopped. On Ctrl-C or SIGTERM the workers stop claiming, let in-flight calls
finish (bounded by --http-timeout), write their results and give back leases they never
started.

exit codes:
  2    bad input, found before anything is created (a value, --events-dir, --sql, the DSN)
  4    harness failure: a worker exited with an error, or every worker died
{_INTERRUPTS}
       (the drain above: in-flight calls finish, results are written)""",
    "report": f"""\
examples:
  skiplock report runs/20260101-120000-steady-s1-ab12
  skiplock report runs/A runs/B --out compare.html

One run: RUN_DIR/report.html, written by `run`, `demo` and `gate` too. Several: one page
with their headline figures side by side and the same plots overlaid. A run cut short still
gets a report, which says what it could not read.

exit codes:
  0    written       2  bad input: not a run directory, --out unwritable       4  harness failure
{_INTERRUPTS}""",
    "target": f"""\
examples:
  skiplock target --port 8080 --out runs/manual
  skiplock target --host ::1 --port 0 --name target-1 --out RUN_DIR --hang-cap 60

It prints its URL and runs until stopped; jobs target URL/deliver. On Ctrl-C or SIGTERM
deliveries still open are recorded as unanswered.

exit codes:
  2    bad input: a non-loopback host, a bad name, a port in use, a log with other columns
  4    harness failure
{_INTERRUPTS}""",
    "sweep": f"""\
examples:
  skiplock sweep steady --rates 100,200,400,800 --step 10 --p99 1
  skiplock sweep noisy-neighbour --rates 50,100,200 --set workers=4 --all-steps

Each step is a whole run at one offered rate (same seed and server); the knee is the highest
rate whose p99 enqueue -> first timely 2xx is within --p99, with at least 90% of the offered
rate delivered and no growing backlog. Writes sweep.json, sweep.png and every step's run
directory under --out.

exit codes:
  0    swept (whatever the knee)       2  bad input       4  harness failure
{_INTERRUPTS}""",
    "plans": f"""\
examples:
  skiplock plans                                  # 10k, 100k, 1M and 10M jobs
  skiplock plans --sizes 10k,100k --out plans-small
  skiplock plans --sql my-queue.sql --dsn postgresql://user@db/scratch

At each size (the table grown from the last, never refilled) the claim, recovery and the
result write run under EXPLAIN (ANALYZE, BUFFERS), rolled back, with the queue's partial
indexes, with plain ones instead, under a snapshot held open while jobs churn, and vacuumed.
Writes plans.json, plans.csv and plans.png under --out; what it fills is dropped after.

exit codes:
  0    measured       2  bad input (--sizes, --sql, --out, an unreachable --dsn)
  4    harness failure
{_INTERRUPTS}""",
    "compare": f"""\
examples:
  skiplock compare base/sweep.json new/sweep.json --threshold 10%
  skiplock compare bench-results/e2e-A.json bench-results/e2e-B.json

Compares the headline figures of two results of the same benchmark (sweep, bench e2e,
queue, claim, target, checker), each in its own direction (a rate that fell, a latency that
rose).

exit codes:
  0    no figure worse by more than the threshold
  1    a performance regression beyond the threshold (the only 1 that is not a verdict)
  2    bad input: unreadable file, different benchmarks, no common figure
  4    harness failure
{_INTERRUPTS}""",
    "bench": f"""\
examples:
  skiplock bench queue --workers 2 --batch 10 --duration 10 --out queue.json
  skiplock bench checker --deliveries 1000000
  skiplock bench target --duration 10 --concurrency 32

Speed is measured here, never asserted: each benchmark prints its figures and writes a
result file that describes itself (--out).

exit codes:
  0    measured       2  bad input       4  harness failure
{_INTERRUPTS}""",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse prints usage plus the message and exits 2; keep it to one line, which
        # `main` prefixes with "skiplock: " (so "skiplock: run: argument --workers: ...").
        command = self.prog.removeprefix("skiplock").strip()
        raise UsageError(f"{command}: {message}" if command else message)

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        # Python 3.11's argparse drops an option's explicit value "--" (`--tolerance=--`)
        # and hands the command an empty list instead of a string; keep it as the text given,
        # so the option's type and checks refuse it like any other value.
        if action.option_strings and arg_strings == ["--"] and action.nargs in (None, "?"):
            value = self._get_value(action, "--")
            self._check_value(action, value)
            return value
        return super()._get_values(action, arg_strings)


def _load(module_name: str) -> ModuleType:
    return importlib.import_module(f"skiplock.{module_name}")


def _wrapped(words: Sequence[str]) -> str:
    return textwrap.fill(", ".join(words), width=WIDTH, initial_indent="  ",
                         subsequent_indent="  ", break_on_hyphens=False)


def epilog(name: str) -> str:
    """The command's --help epilog, with the scenario names and keys it mentions."""
    text = EPILOGS.get(name, "")
    if "{scenarios}" in text or "{keys}" in text:
        from skiplock.scenarios.run.spec import SCALAR_KEYS, available

        keys = [*SCALAR_KEYS, "accounts.ID (a limit or unlimited)", "account_mix.ID",
                "mix.SCRIPT", "failpoints.NAME"]
        text = text.replace("{scenarios}", _wrapped(available())).replace("{keys}",
                                                                          _wrapped(keys))
    if "{suite}" in text:
        from skiplock.scenarios.run.gate import SUITE

        text = text.replace("{suite}", _wrapped(SUITE))
    return text


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="skiplock", description=DESCRIPTION, epilog=TOP_EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true",
                        help="on any error, print the traceback as well as the one line")
    parser.add_argument("--version", action="version", version=f"skiplock {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (module_name, help_text) in COMMANDS.items():
        # Import only the command being run, so `skiplock check` works without gevent etc.
        loaded = only is None or only == name
        command_parser = sub.add_parser(
            name, help=help_text, description=help_text,
            epilog=epilog(name) if loaded else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if loaded:
            _load(module_name).configure(command_parser)
        command_parser.set_defaults(_module=module_name)
    return parser


def _global_options(argv: Sequence[str]) -> tuple[bool, str | None]:
    """(--debug given, the command named) from the words before the command's own, read
    before parsing so that an error while parsing obeys --debug too."""
    debug = False
    for word in argv:
        if word == "--debug":
            debug = True
        elif word.startswith("-"):
            break
        else:
            return debug, word if word in COMMANDS else None
    return debug, None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _has_hidden_cause(exc: BaseException) -> bool:
    """True when `exc` was raised while handling another exception that its message only
    summarises: its traceback is the detail --debug shows."""
    return exc.__cause__ is not None or (
        exc.__context__ is not None and not exc.__suppress_context__
    )


def _shown_path(exc: OSError) -> str:
    name = " ".join(str(exc.filename if exc.filename is not None else "").split())
    return name if len(name) <= 120 else f"{name[:100]}... ({len(name)} characters)"


def _fail(message: str, debug: bool) -> None:
    """Print the error's one line; with --debug, the traceback of what is handled first."""
    if debug:
        traceback.print_exc(file=sys.stderr)
    print(f"skiplock: {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug, only = _global_options(argv)
    hint = "traceback above" if debug else "run with --debug for the traceback"
    try:
        with sigterm_as_interrupt():
            args = build_parser(only).parse_args(argv)
            return int(_load(args._module).run(args))
    except Terminated as exc:
        _fail("terminated (SIGTERM)", debug)
        return exc.exit_code
    except KeyboardInterrupt:
        _fail("interrupted", debug)
        return EXIT_INTERRUPTED
    except UsageError as exc:
        _fail(_one_line(exc), debug)
        return exc.exit_code
    except HarnessError as exc:
        more = f" ({hint})" if _has_hidden_cause(exc) else ""
        _fail(f"harness failure: {_one_line(exc)}{more}", debug)
        return exc.exit_code
    except SystemExit as exc:
        if exc.code in (0, None):
            raise  # --help, and the like
        # Exit code 1 means a violated guarantee to CI: an exit from deep inside a library
        # must not pass for one.
        _fail(f"harness failure: exit({exc.code!r}) called inside the command ({hint})", debug)
        return EXIT_HARNESS
    except Exception as exc:
        if isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG:
            # Only a path the user gave is that long (a run directory's own name is at most
            # 64 characters of the scenario's name): bad input, wherever it was looked up.
            _fail(f"{_shown_path(exc)}: file name too long for this system: give a shorter"
                  " path", debug)
            return UsageError.exit_code
        message = _one_line(exc)
        what = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
        _fail(f"harness failure: {what} ({hint})", debug)
        return EXIT_HARNESS


if __name__ == "__main__":
    sys.exit(main())
