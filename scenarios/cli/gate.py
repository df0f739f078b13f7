"""`skiplock gate`: the CI correctness gate (see scenarios/run/gate.py for what it runs).

Exit codes: 0 every run valid, 1 a guarantee violated in some run, 3 only unknowns, 2 bad
input, 4 harness failure. One line per scenario x seed, then a summary; `OUT/junit.xml` and
`OUT/summary.json` are written even when the gate is interrupted.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

from rich.console import Console

from skiplock.plumbing.errors import UsageError
from skiplock.scenarios.cli.run import backend_options, check_dsn, check_redis_url
from skiplock.scenarios.run.gate import (
    DEFAULT_OUT,
    SUITE,
    line,
    resolve_scenarios,
    run_gate,
    serve_lane,
)
from skiplock.scenarios.run.gate_lanes import LaneCommand
from skiplock.scenarios.servers.postgres import DSN_ENV, check_reachable

# A lane is a server and a run's processes: past a few, they only contend for the cores.
MAX_LANES = 8
# Each seed is a whole pass over the suite (minutes): more than this is a typo, not a plan.
MAX_SEEDS = 1000


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="pg",
                        help="system under test: pg (default), pg-naive, pg-for-update,"
                        " pg-long-tx, bullmq, or package.module:factory")
    parser.add_argument("--backend-opt", dest="backend_opts", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="an option for a package.module:factory plug-in, passed to its "
                        "factory as KEY='VALUE' (repeatable)")
    parser.add_argument("--sql", dest="sql_path", default=None,
                        help="a .sql file whose named blocks replace the reference queue's")
    parser.add_argument("--dsn", default=None,
                        help="PostgreSQL to use (default: SKIPLOCK_PG_DSN, Docker, embedded);"
                        " faults that restart the server are skipped on an external one")
    parser.add_argument("--seed", type=int, default=None,
                        help="first seed (default: random, printed so the gate replays)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="how many seeds each scenario runs with (default 1: about"
                        " a minute and a half on two cores)")
    parser.add_argument("--only", action="append", default=[], metavar="SCENARIO[,...]",
                        help=f"run only these scenarios (the suite: {', '.join(SUITE)})")
    parser.add_argument("--no-recovery", action="store_true",
                        help="switch the workers' lease recovery off (a gate must then fail)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a key in every scenario")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="where report.html, junit.xml, summary.json and runs/ go "
                        "(default: ./gate)")
    parser.add_argument("--no-report", action="store_true",
                        help="skip each case's report.html (about 2 s a case); the gate's "
                        "own page still lists the cases")
    parser.add_argument("--lanes", type=int, default=None, metavar="N",
                        help="cases run at a time, each on a server of its own (default: one"
                        " per core, up to two)")
    # A lane of a gate: cases from standard input, results to standard output (gate_lanes).
    parser.add_argument("--lane", action="store_true", help=argparse.SUPPRESS)


def check_lanes(lanes: int | None) -> None:
    if lanes is not None and not 1 <= lanes <= MAX_LANES:
        raise UsageError(f"--lanes must be between 1 and {MAX_LANES} (got {lanes}); each"
                         " lane runs a server and a case of its own")


def run(args: argparse.Namespace) -> int:
    from skiplock.scenarios.cli.run import check_out, check_system_under_test

    check_system_under_test(args.backend, args.sql_path)
    check_redis_url(args.backend, None)
    check_dsn(args.dsn)
    if not 1 <= args.seeds <= MAX_SEEDS:
        raise UsageError(f"--seeds must be between 1 and {MAX_SEEDS} (got {args.seeds}); "
                         "each seed runs every scenario once, about a minute and a half")
    check_out(args.out)
    check_lanes(args.lanes)
    scenarios = resolve_scenarios(args.only)
    overrides = list(args.overrides) + (["recovery=false"] if args.no_recovery else [])
    # Every scenario must load with the overrides before anything runs.
    from skiplock.scenarios.run.spec import SpecError, load

    for scenario in scenarios:
        try:
            load(scenario, overrides)
        except SpecError as exc:
            raise UsageError(f"{scenario}: {exc}") from None
    # Whether a server given by DSN answers, before the header and before anything is
    # written: an unreachable one is bad input, exit 2 with one line, as for `skiplock run`.
    if args.dsn or os.environ.get(DSN_ENV):
        check_reachable(args.dsn or os.environ[DSN_ENV])
    if args.lane:
        return serve_lane(LaneCommand(
            backend=args.backend, sql_path=args.sql_path, dsn=args.dsn,
            backend_options=backend_options(args), overrides=overrides, out=args.out,
            html=not args.no_report))
    base = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    seeds = [base + i for i in range(args.seeds)]
    options = backend_options(args)
    console = Console(stderr=True, highlight=False)

    def header() -> None:
        console.print(f"skiplock gate: backend {args.backend}"
                      + (f", sql {args.sql_path}" if args.sql_path else "")
                      + f", {len(scenarios)} scenario(s) x {len(seeds)} seed(s), first seed"
                      f" {base} (replay: --seed {base})")

    out = Console(highlight=False)
    summary = run_gate(backend=args.backend, sql_path=args.sql_path, dsn=args.dsn,
                       backend_options=options,
                       out=args.out, seeds=seeds, scenarios=scenarios, overrides=overrides,
                       report=lambda result: out.print(line(result), soft_wrap=True),
                       accepted=header, html=not args.no_report, lanes=args.lanes)
    counts = summary.to_json()["counts"]
    verdict = {0: "[green]PASSED[/]", 1: "[bold red]FAILED: a guarantee was violated[/]",
               2: "[bold red]NOTHING JUDGED: no scenario applies to this backend[/]",
               3: "[yellow]UNDECIDED: some runs could not be judged[/]"}.get(
        summary.exit_code, "[bold red]HARNESS FAILURE[/]")
    not_applicable = (f", {counts['not_applicable']} not applicable"
                      if counts["not_applicable"] else "")
    out.print(f"gate {verdict}: {counts['pass']} passed, {counts['fail']} failed,"
              f" {counts['unknown']} unknown, {counts['error']} errors{not_applicable} in"
              f" {summary.seconds:.0f} s; {args.out / 'report.html'},"
              f" {args.out / 'junit.xml'},"
              f" {args.out / 'summary.json'}")
    return summary.exit_code
