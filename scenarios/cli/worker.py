"""`skiplock worker`: run dispatcher worker processes against a queue until Ctrl-C / SIGTERM.

Workers are plain processes, so any machine that reaches the database can run more of them
against the same DSN; their ids name the host, the command's pid and a counter, so no two
invocations anywhere share one. A worker that dies is replaced by a new one whose id names
it (its `start` event too), as `skiplock run` does; the command gives up with exit 4, in
one line, only on a crash loop (`--crash-loop N/SECONDS`).

On Ctrl-C or SIGTERM every worker stops claiming, finishes or releases what it holds, and
exits; none is left behind. Then the command exits as every command does:
130 for Ctrl-C, 143 for SIGTERM (it re-raises the interrupt for the CLI to map).

Every check of the command line (values, files, the events directory) comes before the
database is touched, so bad input leaves neither a schema nor an empty directory behind.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import psycopg

from skiplock.plumbing.errors import HarnessError, UsageError, sigterm_as_interrupt
from skiplock.queue_impl.config import ConfigError, DispatcherConfig, validate_worker_count
from skiplock.queue_impl.failpoints import FAILPOINT_EXIT_CODE, FAILPOINT_NAMES
from skiplock.queue_impl.interface import Account, RunsOwnWorker
from skiplock.queue_impl.native import NativeConfig
from skiplock.queue_impl.plugins import (
    BACKEND_NAMES,
    REDIS_BACKENDS,
    BackendSpec,
    validate_backend_name,
)
from skiplock.reports.history import LOG_SUFFIX
from skiplock.scenarios.cli.run import backend_options
from skiplock.scenarios.run.workers import CrashLoop, WorkerPool, unique_prefix
from skiplock.scenarios.servers.postgres import DSN_ENV, postgres


def _failpoint(text: str) -> tuple[str, float]:
    name, sep, probability = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PROBABILITY")
    try:
        return name, float(probability)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{probability!r} is not a probability") from None


def _account(text: str) -> Account:
    name, sep, limit = text.partition("=")
    if not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME or NAME=LIMIT")
    if not sep:
        return Account(id=name, concurrency_limit=None)
    try:
        value = int(limit)
        if value < 1:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the limit must be a whole number of at least 1") from None
    return Account(id=name, concurrency_limit=value)


def _crash_loop(text: str) -> CrashLoop:
    deaths, sep, seconds = text.partition("/")
    try:
        if not sep:
            raise ValueError
        return CrashLoop(deaths=int(deaths), seconds=float(seconds)).validate()
    except (ValueError, UsageError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not N/SECONDS (N deaths within SECONDS, both positive)") from None


def configure(parser: argparse.ArgumentParser) -> None:
    _worker_arguments(parser)
    _queue_arguments(parser)
    _run_arguments(parser)
    _fault_arguments(parser)


def _worker_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DispatcherConfig()
    parser.add_argument("--dsn", help="PostgreSQL DSN (default: $SKIPLOCK_PG_DSN)")
    parser.add_argument(
        "--workers", type=int, default=2, metavar="N", help="worker processes (default 2)"
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=defaults.batch,
        metavar="B",
        help="jobs claimed per transaction (default %(default)s)",
    )
    parser.add_argument(
        "--lease",
        type=float,
        default=defaults.lease_seconds,
        metavar="SECONDS",
        help="how long a claimed job is held (default %(default)s)",
    )
    parser.add_argument(
        "--http-timeout",
        type=float,
        default=defaults.http_timeout_seconds,
        metavar="SECONDS",
        help="total seconds allowed for one HTTP call (default %(default)s)",
    )
    parser.add_argument(
        "--write-margin",
        type=float,
        default=defaults.write_margin_seconds,
        metavar="SECONDS",
        help="seconds reserved inside the lease for the result write (default %(default)s)",
    )
    parser.add_argument(
        "--poll",
        type=float,
        default=defaults.poll_seconds,
        metavar="SECONDS",
        help="idle poll interval (default %(default)s)",
    )
    parser.add_argument(
        "--claim-ahead",
        type=int,
        default=defaults.claim_ahead,
        metavar="JOBS",
        help="leases a worker may hold beyond its batch of calls in flight, claimed before "
        "slots free so that a freed slot starts its next call at once; 0 claims only for free "
        "slots (default %(default)s)",
    )
    parser.add_argument(
        "--write-gather",
        type=float,
        default=defaults.write_gather_seconds,
        metavar="SECONDS",
        help="how long a busy worker lets results gather before writing them, holding each "
        "lease that much longer; 0 writes each at once (default %(default)s)",
    )


def _queue_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        default="pg",
        metavar="NAME",
        help="pg (default), pg-naive, pg-for-update, pg-long-tx, or package.module:factory",
    )
    parser.add_argument("--backend-opt", dest="backend_opts", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="an option for a package.module:factory plug-in, passed to its "
                        "factory as KEY='VALUE' (repeatable)")
    parser.add_argument("--schema", default="skiplock", help="schema holding the queue tables")
    parser.add_argument(
        "--sql", metavar="FILE", help="SQL file whose named blocks replace the reference ones"
    )
    parser.add_argument(
        "--account",
        dest="accounts",
        action="append",
        default=[],
        type=_account,
        metavar="NAME[=LIMIT]",
        help="an account a plug-in that runs its own worker loop (e.g. pgqueuer) serves, with "
        "its concurrency limit (none: unlimited); repeatable. The reference queue reads its "
        "accounts from the database and needs none",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=NativeConfig().max_attempts,
        metavar="N",
        help="attempts per job for such a plug-in (default %(default)s)",
    )


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-target",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help=(
            "admit this host and port past the SSRF guard (repeatable); prefer a literal IP: "
            "a host name admits whatever it resolves to when each job is vetted"
        ),
    )
    parser.add_argument(
        "--events-dir",
        type=Path,
        metavar="DIR",
        default=Path("worker-events"),
        help=f"directory for one event log per worker, WORKER_ID{LOG_SUFFIX} "
        "(default ./worker-events)",
    )


def _fault_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seed",
        type=int,
        metavar="N",
        help="seed failpoint decisions and retry jitter, so a fault schedule replays",
    )
    loop = CrashLoop()
    parser.add_argument(
        "--crash-loop",
        type=_crash_loop,
        default=loop,
        metavar="N/SECONDS",
        help="a dead worker is replaced by a new one; give up (exit 4) once N workers died "
        f"within SECONDS (default {loop.deaths}/{loop.seconds:g})",
    )
    parser.add_argument("--no-recovery", action="store_true", help="do not recover leases")
    parser.add_argument("--no-renew", action="store_true", help="do not renew long leases")
    parser.add_argument("--barrier", action="store_true",
                        help="claim a batch only once the previous one is written (the former "
                             "loop), instead of refilling slots as calls end")
    parser.add_argument(
        "--unsafe-timing",
        action="store_true",
        help="allow timeout + margin >= lease (experiments only: duplicates become possible)",
    )
    parser.add_argument(
        "--failpoint",
        action="append",
        default=[],
        type=_failpoint,
        metavar="NAME=P",
        help=f"crash with probability P per job at a failpoint ({', '.join(FAILPOINT_NAMES)})",
    )


def build_config(args: argparse.Namespace) -> NativeConfig:
    """The dispatcher config from the command line; UsageError for any bad value."""
    config = NativeConfig(
        accounts=tuple(args.accounts),
        max_attempts=args.max_attempts,
        batch=args.batch,
        lease_seconds=args.lease,
        http_timeout_seconds=args.http_timeout,
        write_margin_seconds=args.write_margin,
        poll_seconds=args.poll,
        write_gather_seconds=args.write_gather,
        claim_ahead=args.claim_ahead,
        recovery_enabled=not args.no_recovery,
        renew_leases=not args.no_renew,
        refill=not args.barrier,
        allow_targets=tuple(args.allow_target),
        unsafe_timing=args.unsafe_timing,
        failpoints=tuple(args.failpoint),
        seed=args.seed,
    )
    try:
        validate_worker_count(args.workers)
        if args.max_attempts < 1:
            raise ConfigError(f"--max-attempts must be at least 1, got {args.max_attempts}")
        config.validate()
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    return config


def run(args: argparse.Namespace) -> int:
    config = build_config(args)
    options = _backend_options(args)
    if not (args.dsn or os.environ.get(DSN_ENV)):
        # Workers serve a queue that producers also reach: a private embedded server would
        # hold no jobs.
        raise UsageError(f"worker needs the queue's database: pass --dsn or set {DSN_ENV}")
    if args.sql is not None and not Path(args.sql).is_file():
        raise UsageError(f"--sql {args.sql}: no such file")
    created = _make_events_dir(args.events_dir)

    interrupted: KeyboardInterrupt | None = None
    pool: WorkerPool | None = None
    # SIGTERM raises `Terminated` (a KeyboardInterrupt) here as under the CLI, so both
    # signals drain the same way; nested under the CLI's handler, this changes nothing.
    with sigterm_as_interrupt():
        previous_sigterm = signal.getsignal(signal.SIGTERM)
        try:
            with postgres(args.dsn) as server:
                spec = BackendSpec(
                    name=args.backend, dsn=server.dsn, schema=args.schema, sql_path=args.sql,
                    options=options,
                )
                _setup(spec, config)
                # Ids unique across hosts and invocations (host, pid, counter); a dead
                # worker is replaced, as `skiplock run` does, until a crash loop.
                pool = WorkerPool(spec, config, args.workers, args.events_dir,
                                  name_prefix=unique_prefix(), supervise=True,
                                  crash_loop=args.crash_loop)
                _serve(pool, spec, config, args)
        except KeyboardInterrupt as exc:
            interrupted = exc
        finally:
            if previous_sigterm is not None:
                signal.signal(signal.SIGTERM, previous_sigterm)
            if pool is None:
                # Stopped before any worker could write there: leave no empty directory.
                _remove_if_empty(created)
    if pool is not None:
        _say_how_they_stopped(pool)
    if interrupted is not None:
        # Everything is cleaned up: the CLI maps Ctrl-C to 130 and SIGTERM to 143.
        raise interrupted
    return 0


def _serve(pool: WorkerPool, spec: BackendSpec, config: NativeConfig,
           args: argparse.Namespace) -> None:
    """Run the pool until it gives up or the command is interrupted, then drain it."""
    try:
        pool.start()
        print(
            f"skiplock worker: {args.workers} worker(s) ({pool.worker_ids[0]}"
            f"{', ...' if args.workers > 1 else ''}), backend {spec.display()}, "
            f"batch {config.batch}, lease {config.lease_seconds:g}s, "
            f"events in {args.events_dir}; Ctrl-C to stop",
            file=sys.stderr,
            flush=True,
        )
        _watch(pool)
    except KeyboardInterrupt:
        print("skiplock worker: stopping, draining in-flight jobs", file=sys.stderr)
        raise
    finally:
        # Ignore a second Ctrl-C / SIGTERM while draining: the pool's own deadline
        # SIGKILLs stragglers, so nothing is left behind either way.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            pool.stop()
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _backend_options(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The plug-in's options, once the backend is known to be one this command can run."""
    options = backend_options(args)
    try:
        validate_backend_name(args.backend)
        if options and args.backend in BACKEND_NAMES:
            raise ValueError(f"backend {args.backend!r} takes no --backend-opt (options are "
                             "passed to a package.module:factory plug-in's factory)")
        if args.backend in REDIS_BACKENDS:
            raise ValueError(f"worker serves a queue on PostgreSQL; backend "
                             f"{args.backend!r} keeps its queue in Redis: run it with "
                             "`skiplock run SCENARIO --backend bullmq`")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return options


def _say_how_they_stopped(pool: WorkerPool) -> None:
    crashed = [
        f"{worker_id} ({code})"
        for worker_id, code in zip(pool.worker_ids, pool.exitcodes(), strict=True)
        if code not in (0, None, -signal.SIGTERM, -signal.SIGKILL, FAILPOINT_EXIT_CODE)
    ]
    if crashed:
        raise HarnessError(f"worker(s) exited with an error: {', '.join(crashed)}")
    print("skiplock worker: stopped", file=sys.stderr)


def _make_events_dir(path: Path) -> list[Path]:
    """Create the events directory (and missing parents) first, so a path that cannot hold
    the event logs is a usage error before the database is touched. Returns the directories
    it created, deepest first, for `_remove_if_empty`."""
    created: list[Path] = []
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        created.append(probe)
        probe = probe.parent
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"--events-dir {path}: exists and is not a directory") from None
    except OSError as exc:
        _remove_if_empty(created)
        raise UsageError(f"--events-dir {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        _remove_if_empty(created)
        raise UsageError(f"--events-dir {path}: not writable")
    return created


def _remove_if_empty(created: list[Path]) -> None:
    """Take back directories this command created, deepest first, if nothing was put in them."""
    for directory in created:
        with contextlib.suppress(OSError):
            directory.rmdir()


def _setup(spec: BackendSpec, config: NativeConfig) -> None:
    """Create the schema once, before the workers start, so bad SQL or an unreachable
    server is one clear line rather than N crashing children. A plug-in that runs its own
    worker loop serves only the accounts it is told: without any it would serve nothing."""
    try:
        backend = spec.create()
        try:
            if isinstance(backend, RunsOwnWorker) and not config.accounts:
                raise ValueError(
                    f"backend {spec.display()} runs its own worker loop, which serves only the "
                    "accounts it is given: add --account NAME[=LIMIT] for each account its "
                    "jobs use")
            backend.setup()
        finally:
            backend.close()
    except (ValueError, OSError, psycopg.Error) as exc:
        raise UsageError(f"cannot set up the queue: {' '.join(str(exc).split())}") from None


def _watch(pool: WorkerPool) -> None:
    """Return never: a supervised pool replaces dead workers until it gives up on a crash
    loop, which ends the command (exit 4) with the pool's one line."""
    while pool.gave_up is None and any(pool.alive()):
        time.sleep(0.2)
    raise HarnessError(pool.gave_up or "every worker exited; see their event logs")
