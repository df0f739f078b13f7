"""`skiplock run SCENARIO`: run one scenario end to end and judge it.

Ends with the verdict and the judging exit code: 0 valid, 1 a guarantee violated, 3 unknown,
2 bad input, 4 harness failure. Every input is checked before anything starts: the scenario,
the flags, `--out`, the DSN's shape, then, on the server provisioning found, the backend (a
plug-in's factory is called once here), and, on the run's fresh schema, every SQL statement
the queue may run (the runner prepares each one, without running it, before any load); bad
input is exit 2 with one line, and no run directory is made.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from skiplock.chaos.nemesis import NemesisError, check_schedule, shortcut
from skiplock.plumbing.errors import Unhonoured, UsageError
from skiplock.reports.fault_kinds import NAMES as FAULT_KIND_NAMES
from skiplock.scenarios.run.spec import ScenarioSpec, SpecError, available, load
from skiplock.scenarios.servers.postgres import DSN_ENV, PgServer

if TYPE_CHECKING:
    from skiplock.scenarios.run.options import RunOptions


def add_scenario_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by `run` and `demo`."""
    parser.add_argument("--backend", default="pg",
                        help="system under test: pg (default), pg-naive, pg-for-update,"
                        " pg-long-tx, bullmq (Redis, BullMQ's own Worker), or"
                        " package.module:factory")
    parser.add_argument("--backend-opt", dest="backend_opts", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="an option for a package.module:factory plug-in, passed to its "
                        "factory as KEY='VALUE' (repeatable; recorded in spec.json)")
    parser.add_argument("--redis-url", default=None,
                        help="Redis for --backend bullmq (default: SKIPLOCK_REDIS_URL, Docker,"
                        " embedded)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed for job scripts and accounts (default: random, recorded)")
    parser.add_argument("--out", type=Path, default=Path("runs"),
                        help="parent directory of the run directory (default: ./runs)")
    parser.add_argument("--dsn", default=None,
                        help="PostgreSQL to use (default: SKIPLOCK_PG_DSN, Docker, embedded)")
    parser.add_argument("--sql", dest="sql_path", default=None,
                        help="a .sql file whose named blocks replace the reference queue's")
    parser.add_argument("--schema", default=None,
                        help="schema for the queue (default: a fresh one, dropped after)")
    parser.add_argument("--no-report", action="store_true",
                        help="skip report.html (`skiplock report RUN_DIR` writes it later)")
    parser.add_argument("--no-recovery", action="store_true",
                        help="switch the workers' lease recovery off")
    parser.add_argument("--duration", type=float, help="load phase, seconds")
    parser.add_argument("--warmup", type=float, help="warm-up (ramp) phase, seconds")
    parser.add_argument("--drain-timeout", type=float, help="longest wait for the drain, seconds")
    parser.add_argument("--workers", type=int, help="dispatcher worker processes")
    parser.add_argument("--rate", type=float, help="jobs per second over all producers; 0 is"
                        " closed loop")
    parser.add_argument("--producers", type=int, help="producer processes")
    parser.add_argument("--batch", type=int, help="claim batch size")
    parser.add_argument("--distributed", action="store_true",
                        help="run producers as a Locust master plus --producers workers")
    parser.add_argument("--nemesis", default=None, metavar="KIND[,KIND]",
                        help="add faults to the scenario's schedule, each about every few"
                        f" seconds of the load: {', '.join(FAULT_KIND_NAMES)}")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="override any scenario key, e.g. --set lease=5 --set mix.slow=2")


def check_system_under_test(backend: str, sql_path: str | None) -> None:
    """The backend name and the --sql file, checked before any server or process starts,
    so that either is exit 2 with one line."""
    from skiplock.queue_impl.plugins import REDIS_BACKENDS, validate_backend_name
    from skiplock.queue_impl.sqlfile import SqlFileError, statements_with_overrides

    try:
        validate_backend_name(backend)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if sql_path is not None and backend in REDIS_BACKENDS:
        raise UsageError(f"--sql replaces the reference queue's SQL; backend {backend!r} "
                         "runs none: leave --sql out")
    if sql_path is not None:
        try:
            statements_with_overrides(sql_path)
        except SqlFileError as exc:
            raise UsageError(str(exc)) from None


def resolve(args: argparse.Namespace, scenario: str) -> tuple[ScenarioSpec, int]:
    """The scenario with every command-line override applied, and the seed."""
    check_system_under_test(args.backend, args.sql_path)
    check_redis_url(args.backend, getattr(args, "redis_url", None))
    check_dsn(args.dsn)
    check_out(args.out)
    overrides = list(args.overrides)
    flags = {
        "duration": args.duration,
        "warmup": args.warmup,
        "drain_timeout": args.drain_timeout,
        "workers": args.workers,
        "rate": args.rate,
        "producers": args.producers,
        "batch": args.batch,
    }
    # Flags come after --set, so an explicit flag wins.
    overrides += [f"{key}={value}" for key, value in flags.items() if value is not None]
    if args.no_recovery:
        overrides.append("recovery=false")
    if args.distributed:
        overrides.append("distributed=true")
    try:
        spec = load(scenario, overrides)
        if args.nemesis is not None:  # an empty one is refused, not read as none
            spec = dataclasses.replace(
                spec, nemesis=(*spec.nemesis, *shortcut(args.nemesis))).validate()
    except (SpecError, NemesisError) as exc:
        raise UsageError(str(exc)) from None
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    check_honoured(spec, args.backend)
    # A fault that needs a server the harness starts, against a DSN it was given: refused
    # before anything is announced or started.
    external = bool(args.dsn or os.environ.get(DSN_ENV))
    try:
        check_schedule(spec.nemesis, load_seconds=spec.duration, server_owned=not external)
    except NemesisError as exc:
        raise UsageError(str(exc)) from None
    return spec, seed


def check_honoured(spec: ScenarioSpec, backend: str) -> None:
    """A built-in queue's promises are known before anything starts: a setting it cannot
    honour is refused here (a plug-in's, once its factory has built it, by the run)."""
    from skiplock.queue_impl.bullmq_queue import GUARANTEES as BULLMQ
    from skiplock.queue_impl.interface import REFERENCE_GUARANTEES
    from skiplock.queue_impl.plugins import BACKEND_NAMES, REDIS_BACKENDS
    from skiplock.scenarios.run.honoured import unhonoured

    known = (REFERENCE_GUARANTEES if backend in BACKEND_NAMES
             else BULLMQ if backend in REDIS_BACKENDS else None)
    refusal = unhonoured(spec, backend, known) if known is not None else None
    if refusal is not None:
        raise Unhonoured(refusal)


def check_redis_url(backend: str, url: str | None) -> None:
    """--redis-url only with a Redis backend (it would be ignored otherwise), and not empty;
    whether it answers is checked when the run provisions it."""
    from skiplock.queue_impl.plugins import REDIS_BACKENDS

    if url is not None and backend not in REDIS_BACKENDS:
        raise UsageError(f"--redis-url is for a Redis backend ({', '.join(REDIS_BACKENDS)}); "
                         f"backend {backend!r} does not use Redis: leave it out")
    if backend in REDIS_BACKENDS:
        from skiplock.scenarios.servers.redis import REDIS_URL_ENV, check_reachable

        if url is not None and not url.strip():
            raise UsageError("--redis-url is empty: give a URL such as redis://127.0.0.1:6379/0,"
                             f" or leave it out to use {REDIS_URL_ENV}, Docker or the embedded "
                             "server")
        given = url or os.environ.get(REDIS_URL_ENV)
        if given:
            # Before anything is created: an unreachable server leaves nothing behind.
            check_reachable(given)


def check_dsn(dsn: str | None) -> None:
    """An empty --dsn, or a DSN libpq would read otherwise than written (a password with an
    unescaped `@` or `/` becomes a host or a database), is refused without printing any part
    of its password."""
    from skiplock.queue_impl.plugins import dsn_problem, redact

    if dsn is not None and not dsn.strip():
        raise UsageError("--dsn is empty: give a PostgreSQL URI such as"
                         " postgresql://USER@HOST:PORT/DB, or leave --dsn out to use"
                         f" {DSN_ENV}, Docker or the embedded server")
    given, where = (dsn, "--dsn") if dsn else (os.environ.get(DSN_ENV), DSN_ENV)
    if given:
        problem = dsn_problem(given)
        if problem is not None:
            raise UsageError(f"{where} {redact(given)}: {problem}")


def check_out(out: Path) -> None:
    """--out must be (or be creatable as) a directory this process can write to. Nothing is
    created here: a run refused later leaves nothing behind."""
    if out.exists():
        if not out.is_dir():
            raise UsageError(f"--out {out} is a file: give a directory (each run gets its own"
                             " directory inside it)")
        existing = out
    else:
        existing = next(p for p in out.absolute().parents if p.exists())
        if not existing.is_dir():
            raise UsageError(f"--out {out}: {existing} is a file, not a directory: give a"
                             " directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: {existing} is not writable: give a directory you can"
                         " write to")


@contextlib.contextmanager
def checked_server(args: argparse.Namespace) -> Iterator[PgServer]:
    """PostgreSQL as provisioning finds it (--dsn, SKIPLOCK_PG_DSN, Docker, embedded), with
    the backend checked against it before the run starts anything: a plug-in's factory is
    called once here with the run's DSN and SQL file, and what it returns is closed.

    Its schema is `--schema` if given; otherwise a fresh name no run uses, since the run
    names its own fresh schema when it starts (a factory opens nothing until `setup()`, as
    `QueueBackend` says, so the name only has to be valid)."""
    from skiplock.queue_impl.plugins import check_backend
    from skiplock.scenarios.servers.postgres import postgres

    options = backend_options(args)
    with postgres(args.dsn, durable=True) as server:
        try:
            check_backend(args.backend, dsn=server.dsn,
                          schema=args.schema or f"skiplock_{secrets.token_hex(4)}",
                          sql_path=args.sql_path, options=options)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        yield server


def backend_options(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """`--backend-opt` as pairs; a malformed one is bad input (exit 2), said before a server
    is provisioned."""
    from skiplock.queue_impl.plugins import parse_backend_options

    try:
        return parse_backend_options(getattr(args, "backend_opts", None))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def run_options(args: argparse.Namespace, seed: int, server: PgServer) -> RunOptions:
    from skiplock.scenarios.run.options import RunOptions

    return RunOptions(backend=args.backend, backend_options=backend_options(args),
                      seed=seed, out=args.out, dsn=args.dsn,
                      sql_path=args.sql_path, schema=args.schema, server=server,
                      redis_url=args.redis_url, report=not args.no_report)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", metavar="SCENARIO",
                        help=f"a scenario name ({', '.join(available())}) or a .toml path")
    add_scenario_arguments(parser)
    parser.add_argument("--quiet", action="store_true", help="no per-second progress lines")
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON")


def run(args: argparse.Namespace) -> int:
    from skiplock.scenarios.run.progress import print_line
    from skiplock.scenarios.run.runner import run_scenario

    spec, seed = resolve(args, args.scenario)
    console = Console(stderr=True, highlight=False)
    header = [f"skiplock run {spec.name}: backend {args.backend}, seed {seed},"
              f" {spec.workers} workers, {spec.rate:g} jobs/s for {spec.duration:g} s"]

    def announce(message: str) -> None:
        # The header waits for the run's first announcement, which comes once the run's SQL
        # has been checked on its schema: a run refused for bad SQL prints only the reason.
        while header:
            console.print(header.pop())
        console.print(message)

    with checked_server(args) as server:
        result = run_scenario(spec, run_options(args, seed, server),
                              observer=None if args.quiet else print_line(console),
                              announce=announce)
    verdict = result.verdict
    if args.json:
        print(json.dumps(verdict.to_json(), indent=2, default=str))
    else:
        print_verdict(Console(highlight=False), verdict, result.run_dir)
    print_report(console, result)
    return result.exit_code


def print_report(console: Console, result: Any) -> None:
    """Where report.html is, or why it was not written (the verdict stands either way)."""
    if result.report is not None:
        console.print(f"report: {result.report}  (open it in a browser)", markup=False,
                      soft_wrap=True)
    elif result.report_error is not None:
        console.print(f"report not written ({result.report_error}); try: skiplock report "
                      f"{result.run_dir}", markup=False, soft_wrap=True)


def verdict_label(valid: object) -> str:
    """Rich markup for a verdict's `valid` (True, False or "unknown")."""
    if valid is True:
        return "[green]VALID[/]"
    if valid is False:
        return "[bold red]INVALID: a guarantee was violated[/]"
    return "[yellow]UNKNOWN: the history cannot decide[/]"


def print_verdict(console: Console, verdict: object, run_dir: Path) -> None:
    valid = getattr(verdict, "valid", "unknown")
    counts: dict[str, int] = dict(getattr(verdict, "counts", {}))
    examples: dict[str, list[dict[str, object]]] = dict(getattr(verdict, "examples", {}))
    console.print(f"verdict: {verdict_label(valid)}   run directory: {run_dir}")
    details: dict[str, object] = dict(getattr(verdict, "details", {}) or {})
    not_applicable = details.get("not_applicable") or {}
    assert isinstance(not_applicable, dict)
    console.print("  " + "  ".join(f"{k}={'n/a' if k in not_applicable else v}"
                                   for k, v in counts.items()), soft_wrap=True)
    for kind, reason in not_applicable.items():
        console.print(f"  {kind} not applicable: {reason}", markup=False, highlight=False,
                      soft_wrap=True)
    for kind, items in examples.items():
        for item in items[:3]:
            # As `skiplock check` says it: the job and the sentence (its evidence, with raw
            # epoch times, stays in verdict.json).
            console.print(f"  {kind}: {item.get('job_id')}: {item.get('why')}", markup=False,
                          highlight=False, soft_wrap=True)
    # Why the answer is unknown, as `skiplock check` prints it: exit 3 says so, not why.
    for reason in getattr(verdict, "unknown_reasons", ()):
        console.print(f"  unknown: {reason}", markup=False, highlight=False, soft_wrap=True)
