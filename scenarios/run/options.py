"""What a run is asked to do (`RunOptions`) and what it hands back (`RunResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skiplock.reports.history import RunInfo
from skiplock.scenarios.run.progress import Sample
from skiplock.scenarios.servers.postgres import PgServer

if TYPE_CHECKING:
    from skiplock.reports.checker import Verdict

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
    verdict: Verdict
    info: RunInfo
    samples: list[Sample] = field(default_factory=list)
    description: dict[str, Any] = field(default_factory=dict)
    # RUN_DIR/report.html, or None when not written (switched off, or why it failed below).
    report: Path | None = None
    report_error: str | None = None

    @property
    def exit_code(self) -> int:
        return int(self.verdict.exit_code)
