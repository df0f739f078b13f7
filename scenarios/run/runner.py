"""The runner: one scenario, end to end, into a run directory, then judged.

    spec -> PostgreSQL (provisioned, durable) -> queue schema -> every statement prepared
         (bad --sql: exit 2, no run directory) -> accounts -> echo target
         -> worker pool -> producers (warm-up, load) -> nemesis hook -> drain (bounded)
         -> stop workers -> final-state snapshot -> run.json, spec.json, samples.csv
         -> checker -> verdict.json

Everything the run starts lives in one ExitStack, so the producers, workers, target and an
embedded server are gone when `run_scenario` returns, raises, or is interrupted (Ctrl-C).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
from psycopg import sql

from skiplock.plumbing.errors import HarnessError, Unhonoured, UsageError
from skiplock.plumbing.orphans import children_deaf_to_ctrl_c
from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.interface import (
    Account,
    ChecksStatements,
    JobState,
    JobStatus,
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
    FINAL_JOBS_LOG,
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
from skiplock.scenarios.run.honoured import fault_unhonoured, honoured_faults, unhonoured
from skiplock.scenarios.run.progress import Observer, Sample, Sampler, SampleWriter
from skiplock.scenarios.run.spec import FAILPOINT_NAMES, ScenarioSpec, replay_command
from skiplock.scenarios.servers.postgres import DSN_ENV, PgServer, postgres, redact_dsn

if TYPE_CHECKING:
    from skiplock.chaos.nemesis import HeldLease
    from skiplock.scenarios.run.workers import WorkerPool
    from skiplock.scenarios.servers.redis import RedisServer

DEFAULT_OUT = Path("runs")


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    backend: str = "pg"
    # `--backend-opt` pairs for a plug-in's factory.
    backend_options: tuple[tuple[str, str], ...] = ()
    seed: int = 0
    out: Path = DEFAULT_OUT
    dsn: str | None = None
    sql_path: str | None = None
    # None: a fresh schema for this run, dropped after the final snapshot.
    schema: str | None = None
    keep_schema: bool = False
    worker_grace_seconds: float = 10.0
    # A server provisioned by the caller and shared by several runs (the gate); the run
    # neither starts nor stops it. None: provision one for this run (dsn, Docker, embedded).
    server: PgServer | None = None
    # A Redis backend's server: this URL, else SKIPLOCK_REDIS_URL, Docker or the embedded one.
    redis_url: str | None = None
    # Workers' stderr (reconnects, failed claims under faults) to RUN_DIR/logs/ instead of
    # the terminal.
    worker_logs_to_files: bool = False
    # Write RUN_DIR/report.html once the run is judged (skiplock.reports.report).
    report: bool = True
    # The command that replays this run (spec.json and the report show it); None: `skiplock
    # run` of the shipped scenario, with --set for what differs.
    replay: str | None = None
    # Echo target processes (each its own port and delivery log; jobs routed by id). None:
    # sized to the offered rate (skiplock.chaos.target.processes_for_rate).
    target_processes: int | None = None


@dataclass(kw_only=True)
class RunResult:
    run_dir: Path
    verdict: Any  # skiplock.reports.checker.Verdict
    info: RunInfo
    samples: list[Sample] = field(default_factory=list)
    description: dict[str, Any] = field(default_factory=dict)
    # RUN_DIR/report.html, or None when not written (switched off, or why it failed below).
    report: Path | None = None
    report_error: str | None = None

    @property
    def exit_code(self) -> int:
        return int(self.verdict.exit_code)


class RunContext(Protocol):
    """What a nemesis may act on while the load runs."""

    run_dir: Path
    server: PgServer
    pool: Any  # skiplock.scenarios.run.workers.WorkerPool
    nemesis_log: JsonlWriter


class Nemesis(Protocol):
    """A fault schedule: started when the load starts, stopped (healed) before the drain.
    Each fault it applies is a skiplock.reports.history.FaultEvent in nemesis.jsonl."""

    def start(self, ctx: RunContext, seed: int) -> None: ...

    def stop(self) -> None: ...


class NoNemesis:
    def start(self, ctx: RunContext, seed: int) -> None:
        return None

    def stop(self) -> None:
        return None


@dataclass(kw_only=True)
class _Ctx:
    run_dir: Path
    server: PgServer
    pool: Any
    nemesis_log: JsonlWriter
    # What a scheduled nemesis needs besides (skiplock.chaos.nemesis.NemesisContext).
    schema: str = ""
    # The echo targets (skiplock.chaos.target.TargetProcess), one per target process.
    targets: list[Any] = field(default_factory=list)
    spec: ScenarioSpec | None = None
    load_start: float = 0.0


FAILPOINTS_FILE = "failpoints.json"


class _TargetHandle:
    """The run's echo target as a fault sees it (skiplock.chaos.nemesis.TargetHandle)."""

    def __init__(self, target: Any) -> None:
        self._target = target
        self.name = str(target.name)

    def hang(self, seconds: float) -> None:
        self._target.hang(seconds)

    def kill(self) -> None:
        self._target.kill()

    def restart(self) -> None:
        self._target.restart()


class _FaultContext:
    """skiplock.chaos.nemesis.NemesisContext over a running run."""

    def __init__(self, ctx: _Ctx) -> None:
        assert ctx.spec is not None
        self._ctx = ctx
        self.run_dir = ctx.run_dir
        self.dsn = ctx.server.dsn
        self.schema = ctx.schema
        self.app_prefix = app_prefix(ctx.schema)
        self.server_owned = ctx.server.owned
        self.lease_seconds = ctx.spec.lease
        self.http_timeout_seconds = ctx.spec.http_timeout
        self._failpoints: dict[str, float] = {}
        self._lock = threading.Lock()

    def restart_server(self) -> None:
        self._ctx.server.restart("immediate")

    def targets(self) -> list[_TargetHandle]:
        return [_TargetHandle(target) for target in self._ctx.targets]

    def workers_alive(self) -> list[str]:
        return list(self._ctx.pool.running())

    def workers_holding_leases(self) -> list[str]:
        return list(self._ctx.pool.holding_leases())

    def leases_held(self) -> list[HeldLease]:
        return list(self._ctx.pool.leases_held())

    def signal_worker(self, worker_id: str, signum: int) -> None:
        self._ctx.pool.send_signal(worker_id, signum)

    def set_failpoint(self, name: str, probability: float) -> None:
        with self._lock:
            self._failpoints[name] = probability
            path = self.run_dir / FAILPOINTS_FILE
            partial = path.with_name(path.name + ".partial")
            write_json(partial, dict(self._failpoints))
            # Replaced whole: a worker never reads a half-written file.
            os.replace(partial, path)


def app_prefix(schema: str) -> str:
    """application_name prefix of the system under test's sessions in this run."""
    return f"skiplock-sut-{schema}-"


class _ScheduleNemesis:
    """The scenario's `[[nemesis]]` schedule as the runner's Nemesis."""

    def __init__(self, planned: list[Any], say: Callable[[str], None]) -> None:
        self.planned = planned
        self._say = say
        self._running: Any = None

    def start(self, ctx: RunContext, seed: int) -> None:
        from skiplock.chaos.nemesis import ScheduledNemesis

        assert isinstance(ctx, _Ctx)
        lock = threading.Lock()

        def record(event: Any) -> None:
            with lock:
                ctx.nemesis_log.write(event)

        self._running = ScheduledNemesis(self.planned, record, self._say)
        self._running.start(_FaultContext(ctx), ctx.load_start)

    def stop(self) -> None:
        if self._running is not None:
            self._running.stop()


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


# --------------------------------------------------------------------------------------------
# Producers, each in its own spawned process.
# --------------------------------------------------------------------------------------------


GO_FILE = "go.json"


def _producer_configs(spec: ScenarioSpec, backend: BackendSpec, run_dir: Path,
                      target_urls: list[str], seed: int) -> list[dict[str, Any]]:
    base = {
        "spec": spec.to_json(),
        "backend": dataclasses.asdict(backend),
        "run_dir": str(run_dir),
        # One per target process; each job goes to one of them, by its id.
        "target_urls": target_urls,
        "seed": seed,
        "go_file": str(run_dir / LOCUST_DIR / GO_FILE),
    }
    if not spec.distributed:
        return [{**base, "role": "local", "index": i} for i in range(spec.producers)]
    with contextlib.closing(__import__("socket").socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    master = {**base, "role": "master", "index": 0, "master_port": port}
    workers = [
        {**base, "role": "worker", "index": i, "master_port": port}
        for i in range(spec.producers)
    ]
    return [master, *workers]


@contextlib.contextmanager
def producer_processes(configs: list[dict[str, Any]]) -> Iterator[list[Any]]:
    """Start producer processes; on leaving, any still running are terminated, then killed."""
    import multiprocess  # heavy import, only where processes start

    ctx = multiprocess.get_context("spawn")
    processes: list[Any] = []
    try:
        for config in configs:
            # runpy, not a function of skiplock.scenarios.run.producers: that module imports
            # locust (and so gevent's patches) first, which must not happen in this process, and its
            # configuration is plain data so that unpickling it imports nothing (psycopg
            # must be imported after the patches in the child).
            process = ctx.Process(
                target=__import__("runpy").run_module,
                args=("skiplock.scenarios.run.producers",),
                kwargs={"init_globals": {"PRODUCER_CONFIG": config}, "run_name": "__main__"},
                name=f"skiplock-producer-{config['role']}-{config['index']}",
                daemon=True,
            )
            # The runner stops producers itself (SIGTERM below), after a Ctrl-C too: they
            # start with SIGINT blocked, so it cannot land in their start-up imports.
            with children_deaf_to_ctrl_c():
                process.start()
            processes.append(process)
        yield processes
    finally:
        for process in processes:
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
                process.join()


# --------------------------------------------------------------------------------------------
# Sampling in the background, one sample a second.
# --------------------------------------------------------------------------------------------


class _SampleLoop:
    def __init__(self, sampler: Sampler, writer: SampleWriter,
                 observer: Observer | None) -> None:
        self.sampler = sampler
        self.writer = writer
        self.observer = observer
        self.phase = "setup"
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="skiplock-sampler",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def take(self, *, final: bool = False) -> Sample:
        with self._lock:
            sample = self.sampler.sample(self.phase, final=final)
            self.samples.append(sample)
            self.writer.write(sample)
        if self.observer is not None:
            self.observer(sample)
        return sample

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            with contextlib.suppress(Exception):
                self.take()

    def drain_state(self) -> tuple[dict[str, int] | None, int | None]:
        """(jobs per status, jobs stranded in an expired lease); None where unknown."""
        with self._lock:
            return self.sampler.status_counts(), self.sampler.stranded_jobs()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)
        with contextlib.suppress(Exception):
            self.take(final=True)
        self.writer.close()
        self.sampler.close()


# --------------------------------------------------------------------------------------------


def _drop_schema(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


# Longest the final snapshot of an interrupted run may take (connect plus query).
INTERRUPTED_SNAPSHOT_SECONDS = 15.0


def _write_final_jobs(path: Path, states: list[JobState],
                      abandoned: threading.Event | None = None) -> int:
    """Write the snapshot whole or not at all (a partial file would be judged as if it were
    the queue's final state); returns the number of rows."""
    partial = path.with_name(path.name + ".partial")
    with LogWriter(partial, FINAL_JOBS_LOG) as writer:
        for state in states:
            record = to_record(state)
            record["job_id"] = str(state.job_id)
            record["status"] = state.status.value
            for key in ("locked_until", "next_attempt_at"):
                value = getattr(state, key)
                record[key] = None if value is None else value.timestamp()
            record["extra"] = dict(state.extra)
            writer.write(record)
    if abandoned is not None and abandoned.is_set():
        partial.unlink(missing_ok=True)
        raise TimeoutError("the snapshot came too late")
    os.replace(partial, path)
    return len(states)


def _bounded_dsn(dsn: str, seconds: float) -> str:
    """`dsn` with a connect timeout and a statement timeout, so that a snapshot taken on the
    way out cannot hang on a server that has stopped answering."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(dsn)
    options = str(params.get("options") or "")
    params["options"] = f"{options} -c statement_timeout={int(seconds * 1000)}".strip()
    params["connect_timeout"] = str(max(1, int(seconds / 2)))
    return make_conninfo("", **params)


def _interrupted_snapshot(backend: BackendSpec, path: Path,
                          seconds: float = INTERRUPTED_SNAPSHOT_SECONDS) -> tuple[int | None, str]:
    """Take the final snapshot after an interrupt, bounded in time, on a fresh connection
    (the run's own may have been cut mid-call). Returns (rows or None, a note for run.json);
    on failure nothing is written."""
    outcome: dict[str, Any] = {}
    abandoned = threading.Event()

    def take() -> None:
        try:
            bounded = dataclasses.replace(
                backend, dsn=None if backend.dsn is None else _bounded_dsn(backend.dsn, seconds)
            )
            queue = bounded.create()
            try:
                states = queue.snapshot()
            finally:
                queue.close()
            outcome["rows"] = _write_final_jobs(path, states, abandoned)
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            outcome["error"] = f"{type(exc).__name__}: {first}"

    thread = threading.Thread(target=take, name="skiplock-final-snapshot", daemon=True)
    thread.start()
    thread.join(seconds + 5.0)
    if thread.is_alive():
        abandoned.set()
        return None, f"not taken: no answer within {seconds + 5.0:g} s"
    if "rows" in outcome:
        return int(outcome["rows"]), "taken after the interrupt"
    return None, f"not taken: {outcome.get('error', 'unknown error')}"


# Below this much free space where the run writes its history, the run stops: a history
# cut short by a full disk judges nothing, and every process would fail on every write.
MIN_FREE_BYTES = 16 * 1024 * 1024


def check_disk(run_dir: Path) -> None:
    """HarnessError (one line) when the file system holding `run_dir` is (nearly) full."""
    try:
        stat = os.statvfs(run_dir)
    except OSError:
        return  # cannot tell: the writes themselves will say
    free = stat.f_bavail * stat.f_frsize
    if free < MIN_FREE_BYTES:
        raise HarnessError(f"the disk holding {run_dir} is full ({free // 1024} KiB free): the"
                           " run stopped rather than write a history cut short; free space"
                           " and run again")


def _wait_drained(loop: _SampleLoop, spec: ScenarioSpec, pool: Any,
                  watch: Callable[[], None] = lambda: None) -> bool:
    """True when the queue is quiescent, False when the drain timeout came first.

    Quiescent means every job is terminal, or, with recovery off, some jobs are stranded in
    expired leases and nothing has changed for longer than any legitimate pause (a lease, a
    retry backoff, a poll): nothing will ever move those jobs, nor the jobs queued behind
    them on a full account, and the checker reports them as stuck."""
    deadline = time.monotonic() + spec.drain_timeout
    settle = spec.lease + spec.retry_cap + spec.poll + 1.0
    last: tuple[tuple[str, int], ...] | None = None
    unchanged_since = time.monotonic()
    while True:
        watch()
        counts, stranded = loop.drain_state()
        if counts is not None:
            live = sum(n for status, n in counts.items() if not JobStatus(status).terminal)
            if live == 0:
                return True
            signature = tuple(sorted(counts.items()))
            if signature != last:
                last, unchanged_since = signature, time.monotonic()
            elif (not spec.recovery and stranded
                  and time.monotonic() - unchanged_since >= settle):
                return True
        if time.monotonic() >= deadline or not any(pool.alive()):
            # No worker left (failpoints, kills) means nothing more can drain either.
            return False
        time.sleep(0.2)


@dataclass(kw_only=True)
class _RunState:
    """What one run has learnt so far. It lives outside the steps that run the scenario so
    that however the run ends (completed, refused, failed, interrupted), the cleanup in
    `run_scenario` can still write run.json and spec.json from it."""

    spec: ScenarioSpec
    options: RunOptions
    run_dir: Path
    planned: list[Any]
    say: Callable[[str], None]
    started: float
    schema: str
    drained: bool = False
    drain_seconds: float = 0.0
    exit_reason: str = "error: setup did not finish"
    description: dict[str, Any] = field(default_factory=dict)
    loop: _SampleLoop | None = None
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
    planned, nemesis = _choose_nemesis(spec, options, nemesis, say)
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

    try:
        _run_to_final_snapshot(run, nemesis, observer, WorkerPool)
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
            shutil.rmtree(run_dir, ignore_errors=True)
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


def _choose_nemesis(
    spec: ScenarioSpec, options: RunOptions, nemesis: Nemesis | None, say: Callable[[str], None]
) -> tuple[list[Any], Nemesis]:
    """The run's nemesis and the faults it plans: the caller's nemesis (nothing planned), else
    the spec's `[[nemesis]]` schedule, else none. Raises UsageError for a schedule that
    cannot run against this server, before anything starts."""
    from skiplock.chaos.nemesis import NemesisError, check_schedule, plan

    if nemesis is not None or not spec.nemesis:
        return [], nemesis or NoNemesis()
    # Refused before anything starts: a fault that needs a server the harness owns,
    # against a DSN it was given.
    external = (not options.server.owned if options.server is not None
                else bool(options.dsn or os.environ.get(DSN_ENV)))
    try:
        check_schedule(spec.nemesis, load_seconds=spec.duration,
                       server_owned=not external)
    except NemesisError as exc:
        raise UsageError(str(exc)) from None
    planned = plan(spec.nemesis, seed=options.seed, load_seconds=spec.duration,
                   lease_seconds=spec.lease, http_timeout_seconds=spec.http_timeout)
    return planned, _ScheduleNemesis(planned, say)


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
    spec, options = run.spec, run.options
    with contextlib.ExitStack() as stack:
        run.phase("setup")
        server = _start_server(run, stack)
        queue = _set_up_queue(run, stack, server)
        stack.push(_snapshot_on_interrupt(run))
        target = stack.enter_context(_target(run.run_dir, _target_processes(run)))
        config = _run_dispatcher_config(run, target)

        loop = _SampleLoop(Sampler(run.run_dir, server.dsn, run.schema, queue,
                                   limits=dict(spec.accounts),
                                   reads_tables=options.backend in BACKEND_NAMES),
                           SampleWriter(run.run_dir / SAMPLES_FILE), observer)
        run.loop = loop
        loop.start()
        stack.callback(loop.stop)

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
        run.say(f"{spec.workers} workers, target{'s' if len(target.members) > 1 else ''}"
                f" {target.url}")

        _run_load(run, stack, nemesis, server=server, pool=pool, target=target)
        _drain(run, loop, pool)
        pool.stop(grace_seconds=options.worker_grace_seconds)
        run.phase("")
        # A fresh session: a fault (backends terminated, the server restarted) may have
        # cut the one this queue object opened earlier.
        queue.close()
        run.final_jobs = _write_final_jobs(run.run_dir / FINAL_JOBS_FILE, queue.snapshot())
        run.snapshot_note = "taken after the drain"
        run.exit_reason = "completed"


def _backend(run: _RunState) -> BackendSpec:
    """The run's backend, once `_start_server` has described it."""
    assert run.backend_spec is not None
    return run.backend_spec


def _start_server(run: _RunState, stack: contextlib.ExitStack) -> PgServer:
    """The PostgreSQL server of the run (the caller's, or one provisioned for it), described
    in spec.json before anything else touches it."""
    options = run.options
    redis = _start_redis(run, stack) if options.backend in REDIS_BACKENDS else None
    server = (options.server if options.server is not None
              else stack.enter_context(postgres(options.dsn, durable=True)))
    run.server_up = server
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
    return server


def _start_redis(run: _RunState, stack: contextlib.ExitStack) -> RedisServer:
    """A Redis backend's server (the URL given, Docker, or the embedded one), durable: an
    AOF fsynced before each reply, as PostgreSQL commits are."""
    from skiplock.scenarios.servers.redis import redis_server

    return stack.enter_context(redis_server(run.options.redis_url, durability="always"))


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
            stack.callback(_drop_schema, server.dsn, run.schema)
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
) -> Callable[[type[BaseException] | None, BaseException | None, Any], bool]:
    """An exit callback that takes the final snapshot when the run is interrupted (Ctrl-C),
    so that an interrupted run is still judgeable. It never swallows the exception."""
    snapshot_spec = _backend(run)

    def snapshot_on_interrupt(exc_type: type[BaseException] | None, *_: object) -> bool:
        # Pushed after the schema's drop, so it runs before it and after every
        # process of the run has stopped: an interrupted run is still judgeable.
        if (exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
                and run.snapshot_note is None):
            run.say("interrupted: taking the final snapshot")
            run.final_jobs, run.snapshot_note = _interrupted_snapshot(
                snapshot_spec, run.run_dir / FINAL_JOBS_FILE
            )
            run.say(f"final snapshot {run.snapshot_note}")
        return False

    return snapshot_on_interrupt


def _run_dispatcher_config(run: _RunState, target: Any) -> DispatcherConfig:
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
    pool: Any, target: Any,
) -> None:
    """Start the producers and the fault schedule, run warm-up and load (then the quiet
    period, if any), and refuse a run whose producers failed."""
    spec, say = run.spec, run.say
    nemesis_log = stack.enter_context(JsonlWriter(run.run_dir / NEMESIS_FILE))
    configs = _producer_configs(spec, _backend(run), run.run_dir, target.deliver_urls,
                                run.options.seed)
    producers = stack.enter_context(producer_processes(configs))
    start_at = _go(run.run_dir, producers)
    run.phase("warmup")
    nemesis.start(_Ctx(run_dir=run.run_dir, server=server, pool=pool,
                       nemesis_log=nemesis_log, schema=run.schema, targets=target.members,
                       spec=spec, load_start=start_at + spec.warmup), run.options.seed)
    try:
        stopped = _wait_phases(spec, producers, start_at, run.phase,
                               watch=lambda: check_disk(run.run_dir))
    finally:
        nemesis.stop()
    if run.planned:
        applied = sum(1 for _ in _read_faults(run.run_dir) if not _.get("skipped"))
        say(f"faults healed: {applied} applied of {len(run.planned)} planned"
            + (f", {pool.replacements} worker(s) replaced" if pool.replacements else ""))
    if spec.quiesce > 0:
        run.phase("quiesce")
        time.sleep(spec.quiesce)
    if stopped:
        say(f"stopped producer(s) that overran the load phase: {', '.join(stopped)}")
        run.phases[-1]["producers_stopped"] = stopped
    _check_producers(producers, stopped)


def _drain(run: _RunState, loop: _SampleLoop, pool: Any) -> None:
    """Wait, bounded by the drain timeout, for the queue to settle, and say how it ended."""
    run.phase("drain")
    drain_started = time.monotonic()
    run.drained = _wait_drained(loop, run.spec, pool, lambda: check_disk(run.run_dir))
    run.drain_seconds = time.monotonic() - drain_started
    if run.drained:
        run.say("drained")
    elif not any(pool.alive()):
        run.say("drain stopped: every worker process has died")
    else:
        run.say(f"drain timed out after {run.spec.drain_timeout:g} s")


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
def _target(run_dir: Path, processes: int) -> Iterator[Any]:
    """The run's echo targets: one process, or several (each its own port and log) when
    the rate asks for more than one can answer with room to spare."""
    from skiplock.chaos.target import TargetGroup

    with TargetGroup(run_dir, processes) as group:
        yield group


def _wait_phases(spec: ScenarioSpec, producers: list[Any], start_at: float,
                 phase: Callable[[str], None], overrun_seconds: float = 15.0,
                 watch: Callable[[], None] = lambda: None) -> list[str]:
    """Warm-up then load, by the clock; returns early if every producer has exited.

    Returns the names of the producers this function had to stop because they overran the
    load phase (plus `overrun_seconds` and a join grace): their history is whole (an enqueue
    cut short has an invoke and no outcome, which the checker treats as unknown), so the
    run is still judged."""
    load_at = start_at + spec.warmup
    end_at = load_at + spec.duration
    in_load = False
    stopped: list[str] = []
    while time.time() < end_at + overrun_seconds:
        watch()
        if not in_load and time.time() >= load_at:
            phase("load")
            in_load = True
        if not any(p.is_alive() for p in producers):
            break
        time.sleep(0.1)
    for process in producers:
        process.join(timeout=5.0)
        if process.is_alive():
            # Past its stop time and grace: stop it so that no job is enqueued in the drain.
            stopped.append(process.name)
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
            process.join(timeout=5.0)
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
                process.join()
    return stopped


def _go(run_dir: Path, producers: list[Any], timeout: float = 120.0) -> float:
    """Wait until every producer process is ready, then give them one start time."""
    deadline = time.monotonic() + timeout
    while len(list((run_dir / LOCUST_DIR).glob("*.ready"))) < len(producers):
        dead = [p.name for p in producers if not p.is_alive()]
        if dead:
            raise HarnessError(f"producer process(es) exited during start: {', '.join(dead)}")
        if time.monotonic() > deadline:
            raise HarnessError(f"producers not ready after {timeout:g} s")
        time.sleep(0.05)
    start_at = time.time() + 0.2
    write_json(run_dir / LOCUST_DIR / GO_FILE, {"start_at": start_at})
    return start_at


def _check_producers(producers: list[Any], stopped: Collection[str] = ()) -> None:
    """A producer that exited non-zero on its own is a harness failure; one the runner
    stopped for overrunning is not (its exit code is the runner's own signal)."""
    failed = [p.name for p in producers if p.exitcode != 0 and p.name not in stopped]
    if failed:
        raise HarnessError(f"producer process(es) failed: {', '.join(failed)}"
                           " (see stderr above)")


def _read_faults(run_dir: Path) -> Iterator[dict[str, Any]]:
    from skiplock.reports.history import read_jsonl

    with contextlib.suppress(HistoryError, OSError):
        yield from read_jsonl(run_dir / NEMESIS_FILE)
