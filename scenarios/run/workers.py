"""The worker pool: N dispatcher processes, each writing its own event log.

Children are started with the `spawn` context, so none inherits a socket, a lock or an event
loop from the parent; each opens its backend (`spec.create()`) after it starts. They report
only through their event files (`events_dir/<worker_id>.csv`, `skiplock.reports.history.WorkerEvent`
records), never through a pipe or a shared lock, so a worker killed at any moment leaves the
others and the history intact. Leaving the context stops them: SIGTERM, a grace period to
drain, then SIGKILL for any that remain, so no process is left behind.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import multiprocess

from skiplock.chaos.nemesis import HeldLease
from skiplock.plumbing.errors import HarnessError, UsageError
from skiplock.plumbing.orphans import die_with_parent, name_this_process
from skiplock.queue_impl.config import DispatcherConfig, validate_worker_count
from skiplock.queue_impl.dispatcher import BackendFactory, run_worker
from skiplock.queue_impl.pg import APPLICATION_NAME_ENV
from skiplock.reports.history import (
    LOG_SUFFIX,
    WORKER_LOG,
    HistoryError,
    LogWriter,
    parse_header,
    parse_row,
    worker_event_line,
)


class LogSink:
    """The dispatcher's events as `WorkerEvent` records in `writer`'s log, one line each (a
    batch of them in one write); a replacement's `start` event names the worker it
    replaces."""

    def __init__(self, writer: LogWriter, worker_id: str, replaces: str | None = None) -> None:
        self._writer = writer
        self._worker_id = worker_id
        self._replaces = replaces

    def __call__(self, kind: str, fields: Mapping[str, Any]) -> None:
        if kind == "start" and self._replaces is not None:
            fields = {**fields, "replaces": self._replaces}
        self._writer.write_text(worker_event_line(kind, self._worker_id, time.time(), fields))

    def many(self, kind: str, events: Sequence[Mapping[str, Any]]) -> None:
        now = time.time()
        self._writer.write_text("".join(worker_event_line(kind, self._worker_id, now, fields)
                                        for fields in events))


def _worker_main(
    spec: BackendFactory,
    config: DispatcherConfig,
    worker_id: str,
    events_path: str,
    app_prefix: str | None = None,
    replaces: str | None = None,
    stderr_path: str | None = None,
) -> None:
    """Entry point of one worker process."""
    die_with_parent()
    name_this_process("skiplock-worker")
    if stderr_path is not None:
        # The worker's own complaints (a claim that failed under a fault, a reconnect) go to
        # a file of the run, not into the caller's terminal between its result lines.
        fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
        # A queue library's own logging (pgqueuer's, BullMQ's) goes there too, timed.
        logging.basicConfig(level=logging.INFO, force=True,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if app_prefix is not None:
        # Every session this worker opens carries its name, so a fault can cut exactly the
        # system under test's connections (PGAPPNAME for plug-ins that use libpq's default).
        name = f"{app_prefix}{worker_id}"
        os.environ[APPLICATION_NAME_ENV] = name
        os.environ["PGAPPNAME"] = name
    writer = LogWriter(Path(events_path), WORKER_LOG)
    try:
        # run_worker writes the `stop` event itself, on every way out but a crash.
        run_worker(spec, config, worker_id, LogSink(writer, worker_id, replaces))
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


class _LeaseTracker:
    """Which workers hold a lease now, read from their event logs as they grow: a `claim`
    opens an attempt, its `http` event marks its call answered, its `write` (any result) or
    `release` closes it. Reads only whole lines; a worker that died keeps its open attempts
    (it held them when it died)."""

    def __init__(self) -> None:
        self._offsets: dict[Path, int] = {}
        self._names: dict[Path, list[str]] = {}
        self._open: dict[str, dict[tuple[str, int], HeldLease]] = {}
        self._lock = threading.Lock()

    def holding(self, logs: Mapping[str, Path]) -> list[str]:
        with self._lock:
            for worker_id, path in logs.items():
                self._read(worker_id, path)
            return [w for w in logs if self._open.get(w)]

    def leases(self, logs: Mapping[str, Path]) -> list[HeldLease]:
        with self._lock:
            for worker_id, path in logs.items():
                self._read(worker_id, path)
            return [lease for w in logs for lease in self._open.get(w, {}).values()]

    def _read(self, worker_id: str, path: Path) -> None:
        try:
            with path.open("rb") as fh:
                if path not in self._names:
                    header = fh.readline()
                    if not header.endswith(b"\n"):
                        return
                    self._names[path] = parse_header(path, header.decode(), WORKER_LOG)
                    self._offsets[path] = len(header)
                fh.seek(self._offsets[path])
                data = fh.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self._offsets[path] += end
        held = self._open.setdefault(worker_id, {})
        for number, line in enumerate(data[:end].decode().splitlines(), start=2):
            try:
                row = parse_row(path, number, line, self._names[path], WORKER_LOG)
            except HistoryError:
                continue
            if row.get("job_id") is None or row.get("attempt") is None:
                continue
            key = (str(row["job_id"]), int(row["attempt"]))
            if row["kind"] == "claim":
                held[key] = HeldLease(worker=worker_id, job_id=key[0], attempt=key[1],
                                      claimed_at=float(row["time"]))
            elif row["kind"] == "http" and key in held:
                held[key] = dataclasses.replace(held[key], answered=True)
            elif row["kind"] in ("write", "release"):
                held.pop(key, None)


def unique_prefix(name: str = "worker") -> str:
    """A worker id prefix no other process on any host uses at the same time: `name`, this
    host's name and this process's id (`worker-db7-12345`), so that `skiplock worker` run on
    several machines, or twice on one, never writes two workers' events, leases and
    `job_attempts` rows under one id. The pool adds a counter per worker."""
    host = re.sub(r"[^A-Za-z0-9.-]+", "-", socket.gethostname().split(".")[0]).strip("-")
    return f"{name}-{host or 'host'}-{os.getpid()}"


@dataclass(frozen=True, kw_only=True)
class CrashLoop:
    """When a supervised pool gives up: `deaths` worker deaths within `seconds`."""

    deaths: int = 5
    seconds: float = 10.0

    def validate(self) -> CrashLoop:
        if isinstance(self.deaths, bool) or not isinstance(self.deaths, int) or self.deaths < 1:
            raise UsageError(f"crash loop: deaths must be a positive whole number "
                             f"(got {self.deaths!r})")
        if not self.seconds > 0:
            raise UsageError(f"crash loop: seconds must be positive (got {self.seconds!r})")
        return self


@dataclass(kw_only=True)
class _Worker:
    """One worker process, and the slot it fills."""

    worker_id: str
    slot: int
    process: Any
    replaces: str | None = None
    died_at: float | None = None


class WorkerPool:
    """`count` dispatcher processes sharing one backend spec and config.

    With `supervise`, a worker that dies (killed, crashed at a failpoint, an error) is
    replaced after `restart_delay` seconds by a new process with a new worker id
    (`worker-0` is followed by `worker-0.1`, `worker-0.2`, ...), whose `start` event names
    the worker it replaces, as a process supervisor would in production: a run with crash
    faults drains instead of stalling. Each id has its own event log, so the history tells
    the processes apart."""

    def __init__(
        self,
        spec: BackendFactory,
        config: DispatcherConfig,
        count: int,
        events_dir: Path,
        name_prefix: str = "worker",
        *,
        supervise: bool = False,
        restart_delay: float = 0.5,
        app_prefix: str | None = None,
        stderr_dir: Path | None = None,
        crash_loop: CrashLoop | None = None,
    ) -> None:
        validate_worker_count(count)
        config.validate()
        self.spec = spec
        self.config = config
        self.events_dir = Path(events_dir)
        self.worker_ids = [f"{name_prefix}-{i}" for i in range(count)]
        self.supervise = supervise
        self.restart_delay = restart_delay
        self.app_prefix = app_prefix
        self.stderr_dir = stderr_dir
        self._context = multiprocess.get_context("spawn")
        self._processes: list[Any] = []
        self._log_offsets: list[int] = []
        # Every process ever started, and the current one of each slot.
        self._workers: list[_Worker] = []
        self._current: list[_Worker] = []
        self._generation = [0] * count
        self._stopping = threading.Event()
        self._done = threading.Event()
        self._spawn_lock = threading.Lock()
        self._supervisor: threading.Thread | None = None
        self._leases = _LeaseTracker()
        self.replacements = 0
        # With `crash_loop`, a supervised pool stops replacing workers once that many have
        # died within that many seconds, and says why here (one line).
        self.crash_loop = None if crash_loop is None else crash_loop.validate()
        self._deaths: collections.deque[float] = collections.deque()
        self.gave_up: str | None = None

    def events_path(self, worker_id: str) -> Path:
        return self.events_dir / f"{worker_id}{LOG_SUFFIX}"

    def _spawn(self, worker_id: str, slot: int, replaces: str | None) -> _Worker:
        process = self._context.Process(
            target=_worker_main,
            args=(self.spec, self.config, worker_id, str(self.events_path(worker_id)),
                  self.app_prefix, replaces,
                  None if self.stderr_dir is None else str(self.stderr_dir / f"{worker_id}.log")),
            name=worker_id,
            daemon=False,
        )
        process.start()
        worker = _Worker(worker_id=worker_id, slot=slot, process=process, replaces=replaces)
        self._workers.append(worker)
        return worker

    def start(self, timeout: float = 60.0) -> None:
        """Start every worker and wait until each has written its `start` event, so a stop
        or a fault that follows finds them running. Calling it again does nothing."""
        if self._processes:
            return
        self.events_dir.mkdir(parents=True, exist_ok=True)
        if self.stderr_dir is not None:
            self.stderr_dir.mkdir(parents=True, exist_ok=True)
        # Each log is opened here first: a log that cannot be appended to is refused before
        # any process starts (existing logs are checked before new ones are created, so a
        # refusal leaves nothing behind), and a reused log's earlier `start` events are
        # skipped.
        paths = [self.events_path(worker_id) for worker_id in self.worker_ids]
        for path in sorted(paths, key=lambda p: not p.exists()):
            _check_log(path)
        self._log_offsets = [path.stat().st_size for path in paths]
        try:
            with self._spawn_lock:
                for slot, worker_id in enumerate(self.worker_ids):
                    worker = self._spawn(worker_id, slot, None)
                    self._current.append(worker)
                    self._processes.append(worker.process)
            self._wait_started(timeout)
        except BaseException:
            self.stop(grace_seconds=0.0)
            raise
        if self.supervise:
            self._supervisor = threading.Thread(target=self._supervise,
                                                name="skiplock-supervisor", daemon=True)
            self._supervisor.start()

    def _supervise(self) -> None:
        # This thread is the parent of every replacement, and a worker dies with the thread
        # that started it (die_with_parent), so it lives until the pool has stopped them all
        # (`_done`), not merely until replacing stops (`_stopping`).
        while not self._done.wait(0.05):
            if self._stopping.is_set():
                continue
            for slot, worker in enumerate(list(self._current)):
                if worker.process.is_alive():
                    continue
                now = time.monotonic()
                if worker.died_at is None:
                    worker.died_at = now
                    if self._crash_looping(worker, now):
                        break  # this thread lives on: the replacements die with it
                if now - worker.died_at < self.restart_delay:
                    continue
                with self._spawn_lock:
                    if self._stopping.is_set():
                        return
                    self._generation[slot] += 1
                    new_id = f"{self.worker_ids[slot]}.{self._generation[slot]}"
                    try:
                        _check_log(self.events_path(new_id))
                        replacement = self._spawn(new_id, slot, worker.worker_id)
                    except Exception as exc:
                        print(f"skiplock: cannot replace {worker.worker_id}: {exc}",
                              file=sys.stderr, flush=True)
                        worker.died_at = now  # try again after the delay
                        continue
                    self._current[slot] = replacement
                    self._processes[slot] = replacement.process
                    self.replacements += 1

    def _crash_looping(self, worker: _Worker, now: float) -> bool:
        """Count a death; past the crash-loop limit, stop replacing and say so."""
        if self.crash_loop is None:
            return False
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > self.crash_loop.seconds:
            self._deaths.popleft()
        if len(self._deaths) < self.crash_loop.deaths:
            return False
        self.gave_up = (
            f"crash loop: {len(self._deaths)} worker deaths within "
            f"{self.crash_loop.seconds:g} s (the last {worker.worker_id}, exit code "
            f"{worker.process.exitcode}); not replacing them, see their event logs"
        )
        with self._spawn_lock:
            self._stopping.set()
        return True

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
        """Per slot: whether its current process runs (a supervised pool counts a slot whose
        replacement is due as alive: the drain need not give up on it)."""
        if self.supervise and not self._stopping.is_set():
            return [True for _ in self._current]
        return [bool(p.is_alive()) for p in self._processes]

    def exitcodes(self) -> list[int | None]:
        """Exit codes so far (None: still running; negative: killed by that signal)."""
        return [p.exitcode for p in self._processes]

    def all_worker_ids(self) -> list[str]:
        """Every worker process this pool has started, replacements included."""
        with self._spawn_lock:
            return [w.worker_id for w in self._workers]

    def running(self) -> list[str]:
        with self._spawn_lock:
            return [w.worker_id for w in self._current if w.process.is_alive()]

    def holding_leases(self) -> list[str]:
        """Running workers that hold a lease now, by their event logs."""
        running = self.running()
        return self._leases.holding({w: self.events_path(w) for w in running})

    def leases_held(self) -> list[HeldLease]:
        """Every attempt running workers hold now, by their event logs."""
        running = self.running()
        return self._leases.leases({w: self.events_path(w) for w in running})

    def send_signal(self, worker_id: str, sig: int) -> None:
        """Send `sig` to the process of `worker_id`, if it still runs."""
        with self._spawn_lock:
            found = [w.process for w in self._workers if w.worker_id == worker_id]
        for process in found:
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(process.pid), sig)

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
        return not any(bool(p.is_alive()) for p in self._processes)

    def stop(self, grace_seconds: float | None = None) -> None:
        """SIGTERM every worker, wait up to `grace_seconds` for them to drain (default: the
        HTTP timeout + write margin + poll interval + 5 s), then SIGKILL the rest. No
        replacement starts once this is called."""
        with self._spawn_lock:
            self._stopping.set()
        if grace_seconds is None:
            grace_seconds = (
                self.config.http_timeout_seconds
                + self.config.write_margin_seconds
                + self.config.poll_seconds
                + 5.0
            )
        processes = [w.process for w in self._workers]
        for process in processes:
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    # A paused (SIGSTOPped) worker cannot drain until it is resumed.
                    os.kill(int(process.pid), signal.SIGCONT)
                    os.kill(int(process.pid), signal.SIGTERM)
        self.join(grace_seconds)
        for process in processes:
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(process.pid), signal.SIGKILL)
        for process in processes:
            process.join(5.0)
        self._done.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=10.0)

    def __enter__(self) -> WorkerPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _check_log(path: Path) -> None:
    """Open (and so create) a worker's event log, refusing one that cannot be appended to."""
    try:
        LogWriter(path, WORKER_LOG).close()
    except HistoryError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot write the event log {path}: {exc.strerror or exc}") from None
