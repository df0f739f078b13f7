"""What a nemesis may act on while the load runs, and which nemesis a run gets.

`RunContext` is what any nemesis is handed (the caller's own, in tests); `LiveRun` is the
runner's. A scenario's `[[nemesis]]` schedule runs as `ScheduleNemesis`, which hands each
fault a `FaultContext` (skiplock.chaos.nemesis.NemesisContext) over the live run."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from skiplock.plumbing.errors import UsageError
from skiplock.reports.history import NEMESIS_FILE, HistoryError, JsonlWriter, write_json
from skiplock.scenarios.run.options import RunOptions
from skiplock.scenarios.run.spec import ScenarioSpec
from skiplock.scenarios.servers.postgres import DSN_ENV, PgServer

if TYPE_CHECKING:
    from skiplock.chaos.nemesis import HeldLease, PlannedFault, ScheduledNemesis
    from skiplock.chaos.target import TargetProcess
    from skiplock.scenarios.run.workers import WorkerPool

# Where the workers read the failpoints a fault sets (RUN_DIR/failpoints.json).
FAILPOINTS_FILE = "failpoints.json"


class RunContext(Protocol):
    """What a nemesis may act on while the load runs."""

    run_dir: Path
    server: PgServer
    pool: WorkerPool
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
class LiveRun:
    """The runner's RunContext."""

    run_dir: Path
    server: PgServer
    pool: WorkerPool
    nemesis_log: JsonlWriter
    # What a scheduled nemesis needs besides (skiplock.chaos.nemesis.NemesisContext).
    schema: str = ""
    # The echo targets, one per target process.
    targets: list[TargetProcess] = field(default_factory=list)
    spec: ScenarioSpec | None = None
    load_start: float = 0.0
    # The queue's `Guarantees.claim_transaction`.
    claim_transaction: bool = True


class TargetHandle:
    """The run's echo target as a fault sees it (skiplock.chaos.nemesis.TargetHandle)."""

    def __init__(self, target: TargetProcess) -> None:
        self._target = target
        self.name = str(target.name)

    def hang(self, seconds: float) -> None:
        self._target.hang(seconds)

    def kill(self) -> None:
        self._target.kill()

    def restart(self) -> None:
        self._target.restart()


class FaultContext:
    """skiplock.chaos.nemesis.NemesisContext over a running run."""

    def __init__(self, ctx: LiveRun) -> None:
        assert ctx.spec is not None
        self._ctx = ctx
        self.run_dir = ctx.run_dir
        self.dsn = ctx.server.dsn
        self.schema = ctx.schema
        self.app_prefix = app_prefix(ctx.schema)
        self.server_owned = ctx.server.owned
        self.lease_seconds = ctx.spec.lease
        self.http_timeout_seconds = ctx.spec.http_timeout
        self.account_limits = dict(ctx.spec.accounts)
        self.claim_transaction = ctx.claim_transaction
        self._failpoints: dict[str, float] = {}
        self._lock = threading.Lock()

    def restart_server(self) -> None:
        self._ctx.server.restart("immediate")

    def targets(self) -> list[TargetHandle]:
        return [TargetHandle(target) for target in self._ctx.targets]

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


class ScheduleNemesis:
    """The scenario's `[[nemesis]]` schedule as the runner's Nemesis."""

    def __init__(self, planned: list[PlannedFault], say: Callable[[str], None]) -> None:
        self.planned = planned
        self._say = say
        self._running: ScheduledNemesis | None = None

    def start(self, ctx: RunContext, seed: int) -> None:
        from skiplock.chaos.nemesis import ScheduledNemesis

        assert isinstance(ctx, LiveRun)
        lock = threading.Lock()

        def record(event: Any) -> None:
            with lock:
                ctx.nemesis_log.write(event)

        self._running = ScheduledNemesis(self.planned, record, self._say)
        self._running.start(FaultContext(ctx), ctx.load_start)

    def stop(self) -> None:
        if self._running is not None:
            self._running.stop()


def choose_nemesis(
    spec: ScenarioSpec, options: RunOptions, nemesis: Nemesis | None, say: Callable[[str], None]
) -> tuple[list[PlannedFault], Nemesis]:
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
    return planned, ScheduleNemesis(planned, say)


def read_faults(run_dir: Path) -> Iterator[dict[str, Any]]:
    """The fault events recorded so far in RUN_DIR/nemesis.jsonl (none if unreadable)."""
    from skiplock.reports.history import read_jsonl

    with contextlib.suppress(HistoryError, OSError):
        yield from read_jsonl(run_dir / NEMESIS_FILE)
