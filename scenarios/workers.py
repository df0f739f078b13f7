"""The worker pool: N dispatcher processes, each writing its own event log.

Children are started with the `spawn` context, so none inherits a socket, a lock or an event
loop from the parent; each opens its backend (`spec.create()`) after it starts. They report
only through their event files (`events_dir/<worker_id>.csv`, `reports.history.WorkerEvent`
records), never through a pipe or a shared lock, so a worker killed at any moment leaves the
others and the history intact. Leaving the context stops them: SIGTERM, a grace period to
drain, then SIGKILL for any that remain, so no process is left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import multiprocess

from queue_impl.dispatcher import (
    BackendFactory,
    DispatcherConfig,
    EventSink,
    run_worker,
    validate_worker_count,
)
from reports.history import (
    LOG_SUFFIX,
    WORKER_LOG,
    HistoryError,
    LogWriter,
    WorkerEvent,
    parse_header,
    parse_row,
)
from scenarios.errors import HarnessError, UsageError
from scenarios.orphans import die_with_parent

_RECORD_FIELDS = ("job_id", "attempt")


def log_sink(writer: LogWriter, worker_id: str) -> EventSink:
    """The dispatcher's events as `WorkerEvent` records in `writer`'s log, one line each."""

    def sink(kind: str, fields: Mapping[str, Any]) -> None:
        data = {k: v for k, v in fields.items() if k not in _RECORD_FIELDS}
        attempt = fields.get("attempt")
        writer.write(
            WorkerEvent(
                kind=kind,  # type: ignore[arg-type]  # kinds are the dispatcher's contract
                worker=worker_id,
                time=time.time(),
                job_id=fields.get("job_id"),
                attempt=None if attempt is None else int(attempt),
                data=data,
            )
        )

    return sink


def _worker_main(
    spec: BackendFactory, config: DispatcherConfig, worker_id: str, events_path: str
) -> None:
    """Entry point of one worker process."""
    die_with_parent()
    writer = LogWriter(Path(events_path), WORKER_LOG)
    try:
        # run_worker writes the `stop` event itself, on every way out but a crash.
        run_worker(spec, config, worker_id, log_sink(writer, worker_id))
    finally:
        writer.close()


def _has_start_event(path: Path, offset: int) -> bool:
    """Whether the worker's log holds its `start` event: the first line written after
    `offset` (where the log ended before the worker started), read only once it is whole
    (the worker may be writing it right now)."""
    try:
        with path.open("rb") as fh:
            header = fh.readline()
            fh.seek(max(offset, len(header)))
            first = fh.readline()
    except FileNotFoundError:
        return False
    if not first.endswith(b"\n"):
        return False
    names = parse_header(path, header.decode(), WORKER_LOG)
    return bool(parse_row(path, 2, first.decode(), names, WORKER_LOG)["kind"] == "start")


class WorkerPool:
    """`count` dispatcher processes sharing one backend spec and config."""

    def __init__(
        self,
        spec: BackendFactory,
        config: DispatcherConfig,
        count: int,
        events_dir: Path,
        name_prefix: str = "worker",
    ) -> None:
        validate_worker_count(count)
        config.validate()
        self.spec = spec
        self.config = config
        self.events_dir = Path(events_dir)
        self.worker_ids = [f"{name_prefix}-{i}" for i in range(count)]
        self._context = multiprocess.get_context("spawn")
        self._processes: list[Any] = []
        self._log_offsets: list[int] = []

    def events_path(self, worker_id: str) -> Path:
        return self.events_dir / f"{worker_id}{LOG_SUFFIX}"

    def start(self, timeout: float = 60.0) -> None:
        """Start every worker and wait until each has written its `start` event, so a stop
        or a fault that follows finds them running. Calling it again does nothing."""
        if self._processes:
            return
        self.events_dir.mkdir(parents=True, exist_ok=True)
        # Each log is opened here first: a log that cannot be appended to is refused before
        # any process starts (existing logs are checked before new ones are created, so a
        # refusal leaves nothing behind), and a reused log's earlier `start` events are
        # skipped.
        paths = [self.events_path(worker_id) for worker_id in self.worker_ids]
        for path in sorted(paths, key=lambda p: not p.exists()):
            try:
                LogWriter(path, WORKER_LOG).close()
            except HistoryError as exc:
                raise UsageError(str(exc)) from None
            except OSError as exc:
                raise UsageError(f"cannot write the event log {path}: "
                                 f"{exc.strerror or exc}") from None
        self._log_offsets = [path.stat().st_size for path in paths]
        try:
            for worker_id in self.worker_ids:
                process = self._context.Process(
                    target=_worker_main,
                    args=(self.spec, self.config, worker_id, str(self.events_path(worker_id))),
                    name=worker_id,
                    daemon=False,
                )
                process.start()
                self._processes.append(process)
            self._wait_started(timeout)
        except BaseException:
            self.stop(grace_seconds=0.0)
            raise

    def _wait_started(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        waiting = set(range(len(self._processes)))
        while waiting:
            for index in sorted(waiting):
                path = self.events_path(self.worker_ids[index])
                if _has_start_event(path, self._log_offsets[index]):
                    waiting.discard(index)
                elif not self._processes[index].is_alive():
                    raise HarnessError(
                        f"worker {self.worker_ids[index]} exited while starting "
                        f"(exit code {self._processes[index].exitcode})"
                    )
            if waiting and time.monotonic() > deadline:
                names = ", ".join(self.worker_ids[i] for i in sorted(waiting))
                raise HarnessError(f"worker(s) {names} did not start within {timeout:g} s")
            if waiting:
                time.sleep(0.02)

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self._processes]

    def alive(self) -> list[bool]:
        return [bool(p.is_alive()) for p in self._processes]

    def exitcodes(self) -> list[int | None]:
        """Exit codes so far (None: still running; negative: killed by that signal)."""
        return [p.exitcode for p in self._processes]

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to worker `index` (SIGKILL mid-lease, SIGSTOP / SIGCONT to pause)."""
        process = self._processes[index]
        if process.is_alive():
            os.kill(int(process.pid), sig)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for every worker to exit; True when all have."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for process in self._processes:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            process.join(left)
        return not any(self.alive())

    def stop(self, grace_seconds: float | None = None) -> None:
        """SIGTERM every worker, wait up to `grace_seconds` for them to drain (default: the
        HTTP timeout + write margin + poll interval + 5 s), then SIGKILL the rest."""
        if grace_seconds is None:
            grace_seconds = (
                self.config.http_timeout_seconds
                + self.config.write_margin_seconds
                + self.config.poll_seconds
                + 5.0
            )
        for process in self._processes:
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    # A paused (SIGSTOPped) worker cannot drain until it is resumed.
                    os.kill(int(process.pid), signal.SIGCONT)
                    os.kill(int(process.pid), signal.SIGTERM)
        self.join(grace_seconds)
        for process in self._processes:
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(process.pid), signal.SIGKILL)
        for process in self._processes:
            process.join(5.0)

    def __enter__(self) -> WorkerPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
