"""The runner: one scenario, end to end, into a run directory, then judged.

    spec -> PostgreSQL (provisioned, durable) -> queue schema -> every statement prepared
         (bad --sql: exit 2, no run directory) -> accounts -> echo target
         -> worker pool -> producers (warm-up, load) -> nemesis hook -> drain (bounded)
         -> stop workers -> final-state snapshot -> run.json, spec.json, samples.csv
         -> checker -> verdict.json

Everything the run starts lives in one ExitStack, so the producers, workers, target and an
embedded server are gone when `run_scenario` returns, raises, or is interrupted (Ctrl-C).

This module holds the run itself and its run directory; its parts live beside it, by concern:
`options` (what a run is asked and returns), `fault_context` (what a nemesis acts on),
`load` (the producer processes), `sampling` (samples and the drain) and `snapshot` (the
final state, taken after the drain or an interrupt).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from skiplock.plumbing.errors import HarnessError, Unhonoured, UsageError
from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.interface import (
    REFERENCE_GUARANTEES,
    Account,
    ChecksStatements,
    Guarantees,
    QueueBackend,
    RunsOwnWorker,
    StatementError,
    TearsDown,
    guarantees_of,
    lease_kind,
)
from skiplock.queue_impl.native import NativeConfig
from skiplock.queue_impl.plugins import BACKEND_NAMES, REDIS_BACKENDS, BackendSpec, shown_options
from skiplock.reports import columnar
from skiplock.reports.history import (
    ENQUEUE_LOG,
    ENQUEUES_FILE,
    FINAL_JOBS_FILE,
    LOCUST_DIR,
    NEMESIS_FILE,
    RUN_FILE,
    SAMPLES_FILE,
    SPEC_FILE,
    WORKERS_DIR,
    HistoryError,
    JsonlWriter,
    LogWriter,
    RunInfo,
    to_record,
    write_json,
)
from skiplock.reports.selfdescribe import describe
from skiplock.scenarios.run.fault_context import (
    FAILPOINTS_FILE,
    LiveRun,
    Nemesis,
    app_prefix,
    choose_nemesis,
    read_faults,
)
from skiplock.scenarios.run.honoured import fault_unhonoured, honoured_faults, unhonoured
from skiplock.scenarios.run.load import (
    check_producers,
    go,
    producer_configs,
    producer_processes,
    wait_phases,
)
from skiplock.scenarios.run.options import RunOptions, RunResult
from skiplock.scenarios.run.progress import Observer, Sampler, SampleWriter
from skiplock.scenarios.run.sampling import SampleLoop, drain
from skiplock.scenarios.run.snapshot import (
    check_disk,
    drop_schema,
    interrupted_snapshot,
    write_final_jobs,
)
from skiplock.scenarios.run.spec import FAILPOINT_NAMES, ScenarioSpec, replay_command
from skiplock.scenarios.servers.postgres import PgServer, postgres, redact_dsn

if TYPE_CHECKING:
    from skiplock.chaos.nemesis import PlannedFault
    from skiplock.chaos.target import TargetGroup
    from skiplock.scenarios.run.workers import WorkerPool
    from skiplock.scenarios.servers.redis import RedisServer


def missing_folders(path: Path) -> list[Path]:
    """The folders of `path` that do not exist yet, deepest first: what creating it makes."""
    missing = []
    for folder in [path, *path.parents]:
        if folder.exists():
            break
        missing.append(folder)
    return missing


def remove_if_empty(folders: list[Path]) -> None:
    """Remove `folders` (deepest first) while they are empty: a refused run leaves no
    `--out` folder it made behind, and never one that holds anything."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def new_run_dir(out: Path, spec: ScenarioSpec, seed: int) -> Path:
    """A fresh directory for one run, directly inside `out`. The scenario's name is part of
    its name: the spec admits only plain file-name parts, and this checks the result again,
    so that no name (`../x`, `/etc`) can put a run anywhere else."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    leaf = f"{stamp}-{spec.name}-s{seed}-{secrets.token_hex(2)}"
    run_dir = out / leaf
    if (Path(leaf).name != leaf or os.sep in leaf or (os.altsep and os.altsep in leaf)
            or run_dir.resolve().parent != out.resolve()):
        raise UsageError(f"scenario name {spec.name!r} would put the run directory outside"
                         f" --out {out}: use letters, digits, '-', '_' and '.'")
    try:
        run_dir.mkdir(parents=True, exist_ok=False)
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot create the run directory there"
                         f" ({exc.strerror or exc}): give a directory you can write to") from None
    return run_dir


def dispatcher_config(spec: ScenarioSpec, allow: tuple[str, ...]) -> DispatcherConfig:
    config = DispatcherConfig.of(spec.worker_settings(), allow_targets=allow,
                                 failpoints=tuple(sorted(spec.failpoints.items())))
    config.validate()
    return config


@dataclass(kw_only=True)
class _RunState:
    """What one run has learnt so far. It lives outside the steps that run the scenario so
    that however the run ends (completed, refused, failed, interrupted), the cleanup in
    `run_scenario` can still write run.json and spec.json from it."""

    spec: ScenarioSpec
    options: RunOptions
    run_dir: Path
    planned: list[PlannedFault]
    say: Callable[[str], None]
    started: float
    schema: str
    drained: bool = False
    drain_seconds: float = 0.0
    exit_reason: str = "error: setup did not finish"
    description: dict[str, Any] = field(default_factory=dict)
    loop: SampleLoop | None = None
    backend_spec: BackendSpec | None = None
    # Set once PostgreSQL is up: a UsageError before that leaves no run directory behind.
    server_up: PgServer | None = None
    run_dir_removed: bool = False
    # Bad input found once the server was up (SQL the database refuses): the run never
    # started, so it leaves no run directory behind either.
    refused: bool = False
    final_jobs: int | None = None
    snapshot_note: str | None = None
    phases: list[dict[str, Any]] = field(default_factory=list)
    # What the queue promises, once it is created.
    promised: Guarantees = REFERENCE_GUARANTEES

    def write_run_info(self) -> RunInfo:
        """run.json: how the run went, as far as it got."""
        spec = self.spec
        info = RunInfo(
            started=self.started,
            finished=time.time(),
            drained=self.drained,
            drain_seconds=self.drain_seconds,
            exit_reason=self.exit_reason,
            backend=self.options.backend,
            retry_base_seconds=spec.retry_base,
            retry_cap_seconds=spec.retry_cap,
            retry_jitter=spec.retry_jitter,
            http_timeout_seconds=spec.http_timeout,
            lease_seconds=spec.lease,
            account_limits=dict(spec.account_limits()),
            final_jobs=self.final_jobs,
        )
        record = to_record(info)
        if self.snapshot_note is not None:
            record["final_snapshot"] = self.snapshot_note
        write_json(self.run_dir / RUN_FILE, record)
        return info

    def write_spec_json(self, extra: dict[str, Any]) -> None:
        """spec.json: what was run, where, and how to replay it (plus `extra`)."""
        spec, options = self.spec, self.options
        write_json(
            self.run_dir / SPEC_FILE,
            {
                "scenario": spec.to_json(),
                "seed": options.seed,
                "backend": self.backend_spec.display() if self.backend_spec else options.backend,
                "schema": self.schema,
                "sql_path": options.sql_path,
                "backend_options": shown_options(options.backend_options),
                "nemesis_schedule": [p.to_json() for p in self.planned],
                "replay": options.replay or replay_command(
                    spec, seed=options.seed, backend=options.backend,
                    sql_path=options.sql_path, backend_options=options.backend_options,
                    dsn=options.dsn),
                **self.description,
                **extra,
            },
        )

    def phase(self, name: str) -> None:
        """End the current phase and start `name` ("" ends the last one)."""
        now = time.time()
        if self.phases:
            self.phases[-1]["end"] = now
        if name:
            self.phases.append({"name": name, "start": now, "end": None})
        if self.loop is not None:
            self.loop.phase = name or "done"



def run_scenario(
    spec: ScenarioSpec,
    options: RunOptions,
    *,
    observer: Observer | None = None,
    nemesis: Nemesis | None = None,
    announce: Callable[[str], None] | None = None,
) -> RunResult:
    """Run `spec` and judge it. Raises HarnessError when the harness itself fails."""
    # Imported when a run starts, not with this module, but before anything is started: a
    # checker or worker module that fails to import leaves no server and no run directory.
    from skiplock.reports.checker import check_run, write_verdict
    from skiplock.scenarios.run.workers import WorkerPool

    say = announce or (lambda _message: None)
    planned, nemesis = choose_nemesis(spec, options, nemesis, say)
    made_for_run = missing_folders(options.out)
    run_dir = new_run_dir(options.out, spec, options.seed)
    _lay_out_run_dir(run_dir)
    run = _RunState(
        spec=spec,
        options=options,
        run_dir=run_dir,
        planned=planned,
        say=say,
        started=time.time(),
        schema=options.schema or f"skiplock_{secrets.token_hex(4)}",
    )
    info = _run_recorded(run, made_for_run, nemesis, observer, WorkerPool)

    try:
        # Every writer of the run has stopped: let this first check keep a columnar copy of
        # what it parses, so `skiplock check RUN_DIR` later reads that instead of the JSON.
        columnar.mark_settled(run_dir)
        verdict = check_run([run_dir])
    except HistoryError as exc:
        raise HarnessError(f"the run's own history cannot be read: {exc}") from exc
    write_verdict(run_dir, verdict)
    result = RunResult(run_dir=run_dir, verdict=verdict, info=info,
                       samples=list(run.loop.samples) if run.loop else [],
                       description=run.description)
    if options.report:
        result.report, result.report_error = _write_report(run_dir)
    return result


def _run_recorded(
    run: _RunState,
    made_for_run: list[Path],
    nemesis: Nemesis,
    observer: Observer | None,
    worker_pool: type[WorkerPool],
) -> RunInfo:
    """Run to the final snapshot, and write run.json and spec.json however that ends; a
    run refused for bad input removes its run directory (and the `--out` folders made for
    it) instead. Returns what run.json says."""
    try:
        _run_to_final_snapshot(run, nemesis, observer, worker_pool)
    except KeyboardInterrupt:
        run.exit_reason = "interrupted"
        if run.snapshot_note is None:
            run.snapshot_note = "not taken: interrupted before the queue was set up"
        raise
    except UsageError as exc:
        run.exit_reason = f"error: {exc}"
        if run.server_up is None or run.refused:
            # Bad input found before anything ran (e.g. an unreachable DSN): leave no
            # half-made run directory behind.
            shutil.rmtree(run.run_dir, ignore_errors=True)
            remove_if_empty(made_for_run)
            run.run_dir_removed = True
        raise
    except HarnessError as exc:
        run.exit_reason = f"error: {exc}"
        raise
    except Exception as exc:
        run.exit_reason = f"error: {type(exc).__name__}: {exc}"
        raise HarnessError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        if not run.run_dir_removed:
            if run.phases and run.phases[-1]["end"] is None:
                run.phases[-1]["end"] = time.time()
            info = run.write_run_info()
            with contextlib.suppress(Exception):
                run.write_spec_json({"phases": run.phases})
    return info



def _lay_out_run_dir(run_dir: Path) -> None:
    """The directories and empty logs every run directory has, whatever the run writes."""
    (run_dir / LOCUST_DIR).mkdir()
    (run_dir / WORKERS_DIR).mkdir()
    (run_dir / NEMESIS_FILE).touch()
    # With its header: a run in which no producer wrote still leaves a well-formed log.
    LogWriter(run_dir / ENQUEUES_FILE, ENQUEUE_LOG).close()


def _run_to_final_snapshot(
    run: _RunState,
    nemesis: Nemesis,
    observer: Observer | None,
    worker_pool: type[WorkerPool],
) -> None:
    """Everything from starting PostgreSQL to the final snapshot, recorded in `run`.

    Everything started here is entered on one ExitStack, so it is stopped in reverse order
    of starting when this returns, raises or is interrupted. Each step below registers its
    cleanups in turn; the order of the steps is the order of those registrations, which
    is why the schema's drop runs after the interrupted snapshot (LIFO).

    `worker_pool` is skiplock.scenarios.run.workers.WorkerPool, imported by `run_scenario`
    before the run started."""
    with contextlib.ExitStack() as stack:
        run.phase("setup")
        redis = _start_redis(run, stack) if run.options.backend in REDIS_BACKENDS else None
        server = _start_server(run, stack)
        _describe_servers(run, server, redis)
        queue = _set_up_queue(run, stack, server)
        stack.push(_snapshot_on_interrupt(run))
        target = stack.enter_context(_target(run.run_dir, _target_processes(run)))
        config = _run_dispatcher_config(run, target)
        loop = _start_sampling(run, stack, server, queue, observer)
        pool = _start_workers(run, stack, worker_pool, queue, config)
        run.say(f"{run.spec.workers} workers, target{'s' if len(target.members) > 1 else ''}"
                f" {target.url}")

        _run_load(run, stack, nemesis, server=server, pool=pool, target=target)
        _drain(run, loop, pool)
        pool.stop(grace_seconds=run.options.worker_grace_seconds)
        run.phase("")
        # A fresh session: a fault (backends terminated, the server restarted) may have
        # cut the one this queue object opened earlier.
        queue.close()
        run.final_jobs = write_final_jobs(run.run_dir / FINAL_JOBS_FILE, queue.snapshot())
        run.snapshot_note = "taken after the drain"
        run.exit_reason = "completed"


def _backend(run: _RunState) -> BackendSpec:
    """The run's backend, once `_describe_servers` has described it."""
    assert run.backend_spec is not None
    return run.backend_spec


def _start_server(run: _RunState, stack: contextlib.ExitStack) -> PgServer:
    """The PostgreSQL server of the run: the caller's, or one provisioned for it."""
    options = run.options
    server = (options.server if options.server is not None
              else stack.enter_context(postgres(options.dsn, durable=True)))
    run.server_up = server
    return server


def _start_redis(run: _RunState, stack: contextlib.ExitStack) -> RedisServer:
    """A Redis backend's server (the URL given, Docker, or the embedded one), durable: an
    AOF fsynced before each reply, as PostgreSQL commits are."""
    from skiplock.scenarios.servers.redis import redis_server

    return stack.enter_context(redis_server(run.options.redis_url, durability="always"))


def _describe_servers(run: _RunState, server: PgServer, redis: RedisServer | None) -> None:
    """The run's backend on its servers, described in spec.json before anything else
    touches them."""
    options = run.options
    run.backend_spec = BackendSpec(name=options.backend, dsn=server.dsn, schema=run.schema,
                                   sql_path=options.sql_path, options=options.backend_options,
                                   redis_url=redis.url if redis else None,
                                   retry_base_seconds=run.spec.retry_base)
    run.description = describe(server.dsn)
    if redis is not None:
        run.description["redis"] = {"kind": redis.kind, "url": redis.display,
                                    "harness": redis.settings()}
    with contextlib.suppress(Exception):
        run.description["postgres"]["harness"] = server.settings()
    run.description["postgres"]["dsn"] = redact_dsn(server.dsn)
    run.description["postgres"]["owned"] = server.owned
    run.write_spec_json({"phases": run.phases})


def _start_sampling(run: _RunState, stack: contextlib.ExitStack, server: PgServer,
                    queue: QueueBackend, observer: Observer | None) -> SampleLoop:
    """One sample a second into samples.csv (and to `observer`), until the stack closes."""
    loop = SampleLoop(Sampler(run.run_dir, server.dsn, run.schema, queue,
                              limits=dict(run.spec.accounts),
                              reads_tables=run.options.backend in BACKEND_NAMES),
                      SampleWriter(run.run_dir / SAMPLES_FILE), observer)
    run.loop = loop
    loop.start()
    stack.callback(loop.stop)
    return loop


def _start_workers(run: _RunState, stack: contextlib.ExitStack, worker_pool: type[WorkerPool],
                   queue: QueueBackend, config: DispatcherConfig) -> WorkerPool:
    """The run's worker processes, started; stopped when the stack closes if not before."""
    spec, options = run.spec, run.options
    pool = stack.enter_context(
        worker_pool(_backend(run), config, spec.workers, run.run_dir / WORKERS_DIR,
                    supervise=spec.supervise, restart_delay=spec.restart_delay,
                    app_prefix=app_prefix(run.schema),
                    stderr_dir=(run.run_dir / "logs") if options.worker_logs_to_files
                    or isinstance(queue, RunsOwnWorker) else None)
    )
    pool.start()
    if isinstance(queue, RunsOwnWorker):
        # A library's own logging and tracebacks, kept with the run, not in the terminal.
        run.say(f"worker logs: {run.run_dir / 'logs'}")
    return pool


def _set_up_queue(run: _RunState, stack: contextlib.ExitStack, server: PgServer) -> QueueBackend:
    """Create the queue's schema, check every statement on it, and add the accounts.

    SQL the database refuses is the user's input (UsageError, and `run.refused` so that no
    run directory is left); SQL of our own that fails is a HarnessError."""
    options = run.options
    queue: QueueBackend = _backend(run).create()
    stack.callback(queue.close)
    promised = guarantees_of(queue)
    refusal = unhonoured(run.spec, options.backend, promised)
    if refusal is not None:
        run.refused = True
        raise Unhonoured(refusal)
    run.description["guarantees"] = promised.to_json()
    run.promised = promised
    run.description["lease"] = lease_kind(queue)
    _, dropped = honoured_faults(run.spec, options.backend, promised)
    if dropped:
        # Firings of a fault the queue cannot feel are dropped alone; the others still run.
        run.planned[:] = [p for p in run.planned
                          if fault_unhonoured(p, options.backend, promised) is None]
        run.description["faults_dropped"] = dropped
    try:
        queue.setup()
        if options.schema is None and not options.keep_schema:
            # Registered before the snapshot runs, so it runs after it (LIFO). A queue that
            # tears itself down owns what it made; the others live in the run's schema.
            # (The schema is dropped after a teardown too: a plug-in may keep tables there.)
            stack.callback(drop_schema, server.dsn, run.schema)
            if isinstance(queue, TearsDown):
                stack.callback(queue.teardown)
        # Every statement checked on the fresh schema before any load starts, so
        # bad SQL is one line naming its file and block, not every call failing.
        if isinstance(queue, ChecksStatements):
            queue.check_statements()
    except StatementError as exc:
        if exc.ours:
            raise HarnessError(str(exc)) from exc
        run.refused = True
        raise UsageError(str(exc)) from None
    # Announced once the input is known to be good: a refused run says only why.
    run.say(f"run directory: {run.run_dir}")
    for line in dropped:
        run.say(line)
    run.say(f"PostgreSQL: {server.kind} {server.display}")
    if "redis" in run.description:
        redis = run.description["redis"]
        run.say(f"Redis: {redis['kind']} {redis['url']}")
    queue.upsert_accounts(
        [Account(id=a, concurrency_limit=limit)
         for a, limit in run.spec.account_limits().items()]
    )
    return queue


def _snapshot_on_interrupt(
    run: _RunState,
) -> Callable[[type[BaseException] | None, BaseException | None, TracebackType | None], bool]:
    """An exit callback that takes the final snapshot when the run is interrupted (Ctrl-C),
    so that an interrupted run is still judgeable. It never swallows the exception."""
    snapshot_spec = _backend(run)

    def snapshot_on_interrupt(exc_type: type[BaseException] | None, *_: object) -> bool:
        # Pushed after the schema's drop, so it runs before it and after every
        # process of the run has stopped: an interrupted run is still judgeable.
        if (exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
                and run.snapshot_note is None):
            run.say("interrupted: taking the final snapshot")
            run.final_jobs, run.snapshot_note = interrupted_snapshot(
                snapshot_spec, run.run_dir / FINAL_JOBS_FILE
            )
            run.say(f"final snapshot {run.snapshot_note}")
        return False

    return snapshot_on_interrupt


def _run_dispatcher_config(run: _RunState, target: TargetGroup) -> DispatcherConfig:
    """The workers' configuration: the spec's, admitting the run's echo target, seeded, and
    reading failpoints from the run directory when the fault schedule sets any."""
    allow = target.addresses
    # The accounts and max_attempts too, which a native worker's loop cannot read from the
    # queue as skiplock's own loop does.
    config = dataclasses.replace(
        NativeConfig.native(dispatcher_config(run.spec, allow)), seed=run.options.seed,
        accounts=tuple(Account(id=a, concurrency_limit=limit)
                       for a, limit in run.spec.account_limits().items()),
        max_attempts=run.spec.max_attempts)
    if any(p.kind in FAILPOINT_NAMES or p.phase == "claim" for p in run.planned):
        config = dataclasses.replace(
            config, failpoint_file=str(run.run_dir / FAILPOINTS_FILE))
    return config


def _run_load(
    run: _RunState, stack: contextlib.ExitStack, nemesis: Nemesis, *, server: PgServer,
    pool: WorkerPool, target: TargetGroup,
) -> None:
    """Start the producers and the fault schedule, run warm-up and load (then the quiet
    period, if any), and refuse a run whose producers failed."""
    spec, say = run.spec, run.say
    nemesis_log = stack.enter_context(JsonlWriter(run.run_dir / NEMESIS_FILE))
    configs = producer_configs(spec, _backend(run), run.run_dir, target.deliver_urls,
                               run.options.seed)
    producers = stack.enter_context(producer_processes(configs))
    start_at = go(run.run_dir, producers)
    run.phase("warmup")
    nemesis.start(LiveRun(run_dir=run.run_dir, server=server, pool=pool,
                           nemesis_log=nemesis_log, schema=run.schema, targets=target.members,
                           spec=spec, load_start=start_at + spec.warmup,
                           claim_transaction=run.promised.claim_transaction),
                   run.options.seed)
    try:
        stopped = wait_phases(spec, producers, start_at, run.phase,
                              watch=lambda: check_disk(run.run_dir))
    finally:
        nemesis.stop()
    if run.planned:
        applied = sum(1 for _ in read_faults(run.run_dir) if not _.get("skipped"))
        say(f"faults healed: {applied} applied of {len(run.planned)} planned"
            + (f", {pool.replacements} worker(s) replaced" if pool.replacements else ""))
    if spec.quiesce > 0:
        run.phase("quiesce")
        time.sleep(spec.quiesce)
    if stopped:
        say(f"stopped producer(s) that overran the load phase: {', '.join(stopped)}")
        run.phases[-1]["producers_stopped"] = stopped
    check_producers(producers, stopped)


def _drain(run: _RunState, loop: SampleLoop, pool: WorkerPool) -> None:
    """Wait, bounded by the drain timeout, for the queue to settle, and say how it ended."""
    run.phase("drain")
    run.drained, run.drain_seconds = drain(loop, run.spec, pool, run.say,
                                           lambda: check_disk(run.run_dir))


def _write_report(run_dir: Path) -> tuple[Path | None, str | None]:
    """report.html next to the verdict. The report is derived from the history, so failing
    to draw it costs the run nothing: the verdict stands and `skiplock report` can retry."""
    from skiplock.reports.report import write_report

    try:
        return write_report([run_dir]), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def _target_processes(run: _RunState) -> int:
    from skiplock.chaos.target import processes_for_rate

    chosen = run.options.target_processes
    return chosen if chosen is not None else processes_for_rate(run.spec.rate)


@contextlib.contextmanager
def _target(run_dir: Path, processes: int) -> Iterator[TargetGroup]:
    """The run's echo targets: one process, or several (each its own port and log) when
    the rate asks for more than one can answer with room to spare."""
    from skiplock.chaos.target import TargetGroup

    with TargetGroup(run_dir, processes) as group:
        yield group
