"""The run directory: the one schema that writers (runner, target, workers, nemeses) and
readers (checker, reports) share.

A run directory is the contract between running and judging, as a Jepsen history is. The
four logs that grow with the run are CSV with a header line: one record per line, appended
with a single write() and flushed as it happens, so a crash loses at most the line being
written. CSV rather than JSON Lines because a checker parses it about five times faster (a
history of a million deliveries is six million records), and any tool reads it.

    RUN_DIR/
      spec.json            resolved spec + self-description (seed, versions, machine, git sha)
      enqueues.csv         producer operations: invoke / ok / fail / info, with the job oracle
      deliveries/*.csv     one file per echo target: every request it received
      workers/*.csv        one file per dispatcher process: claims, HTTP calls, result writes
      nemesis.jsonl        fault events, each with a start and an end (few, so JSON Lines)
      final_jobs.csv       the queue's job states after the drain
      run.json             how the run ended (drain completed or timed out, exit reason)
      samples.csv          per-second samples; locust/ holds Locust's CSV statistics
      waits.csv            per-second PostgreSQL sessions by wait event (pg_stat_activity)
      verdict.json         written by the checker

In the CSV logs an empty field is null (so an empty string reads back as null), booleans are
`true` / `false`, a backslash or a line break inside a text field is escaped (`\\\\`,
`\\n`, `\\r`), and nested values are flattened into columns: an enqueue's script into `script_*`,
`first_*` and `then_*`, a worker event's fields next to its kind. Readers go by the header's
column names: a column the reader does not know is ignored, one it lacks reads as null.

Times are wall-clock seconds since the epoch (`time.time()`), comparable across processes on
one machine. Writers use `LogWriter` (and `JsonlWriter` for nemesis.jsonl); readers call
`read_log` / `read_jsonl`, which refuse a truncated file rather than judge half a history.
"""

from __future__ import annotations

import csv
import fcntl
import json
import numbers
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, Self, cast

# The wire protocol belongs to the dispatcher; re-exported so readers import one module.
from skiplock.queue_impl.interface import (  # noqa: F401
    ACCOUNT_HEADER,
    ATTEMPT_HEADER,
    JOB_ID_HEADER,
    WORKER_HEADER,
)
from skiplock.queue_impl.retry import status_is_transient  # noqa: F401

SPEC_FILE = "spec.json"
ENQUEUES_FILE = "enqueues.csv"
DELIVERIES_DIR = "deliveries"
WORKERS_DIR = "workers"
NEMESIS_FILE = "nemesis.jsonl"
FINAL_JOBS_FILE = "final_jobs.csv"
LOG_SUFFIX = ".csv"  # deliveries/<target>.csv, workers/<worker>.csv
RUN_FILE = "run.json"
SAMPLES_FILE = "samples.csv"
WAITS_FILE = "waits.csv"
LOCUST_DIR = "locust"
# LOCUST_DIR/<process>.cpu.json: a producer process's CPU seconds and acknowledged jobs over
# the load.
PRODUCER_CPU_SUFFIX = ".cpu.json"
VERDICT_FILE = "verdict.json"



class HistoryError(Exception):
    """The run directory cannot be read as a history (missing or truncated file)."""


# --------------------------------------------------------------------------------------------
# Job scripts: what the echo target does with each delivery of a job. The script travels in
# the job's payload under "script", so the target needs no side channel, and the checker
# derives each job's oracle from it (never from what the queue wrote about itself).
# --------------------------------------------------------------------------------------------


class Behaviour(str, Enum):
    OK = "ok"  # answer 200 at once
    STATUS = "status"  # answer `status` at once
    SLOW = "slow"  # answer 200 after `seconds` (meant to be inside the HTTP timeout)
    HANG = "hang"  # answer 200 after `seconds` (meant to be past the HTTP timeout): late
    HANG_FOREVER = "hang_forever"  # never answer; the target drops it when the client leaves
    RESET = "reset"  # reset the TCP connection without an answer


@dataclass(frozen=True, kw_only=True)
class Step:
    behaviour: Behaviour
    status: int = 200
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"behaviour": self.behaviour.value}
        if self.behaviour is Behaviour.STATUS:
            out["status"] = self.status
        if self.behaviour in (Behaviour.SLOW, Behaviour.HANG):
            out["seconds"] = self.seconds
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Step:
        behaviour = Behaviour(raw["behaviour"])
        return cls(
            behaviour=behaviour,
            status=int(raw.get("status", 200)),
            seconds=float(raw.get("seconds", 0.0)),
        )


@dataclass(frozen=True, kw_only=True)
class JobScript:
    """`first` for the first `times` deliveries the target sees of this job (None: all of
    them), then `then`. The target counts deliveries itself, by job id, so a queue that sends
    a wrong attempt header cannot change what the job does."""

    name: str
    first: Step
    times: int | None = None
    then: Step = field(default_factory=lambda: Step(behaviour=Behaviour.OK))

    def step_for(self, delivery_number: int) -> Step:
        """The step for the n-th delivery (1-based) the target has seen of this job."""
        if self.times is None or delivery_number <= self.times:
            return self.first
        return self.then

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "first": self.first.to_json(),
            "times": self.times,
            "then": self.then.to_json(),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> JobScript:
        return cls(
            name=str(raw.get("name", "custom")),
            first=Step.from_json(raw["first"]),
            times=None if raw.get("times") is None else int(raw["times"]),
            then=Step.from_json(raw.get("then", {"behaviour": "ok"})),
        )


SUCCEED = JobScript(name="succeed", first=Step(behaviour=Behaviour.OK))


# --------------------------------------------------------------------------------------------
# Records. Each file's lines are one of these, as JSON; `kind` names the record type.
# --------------------------------------------------------------------------------------------

EnqueueType = Literal["invoke", "ok", "fail", "info"]


@dataclass(frozen=True, kw_only=True)
class EnqueueOp:
    """One producer operation. `invoke` carries the oracle (script, max_attempts, account);
    `ok` / `fail` / `info` carry only the job id and, for fail / info, the error. An error
    during COMMIT is `info`: the insert may or may not have happened."""

    type: EnqueueType
    job_id: str
    time: float
    process: str
    account: str | None = None
    target_url: str | None = None
    script: dict[str, Any] | None = None
    max_attempts: int | None = None
    run_at: float | None = None
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class Delivery:
    """One request the echo target received. Written (and flushed) before the response is
    sent; for requests never answered, when the target gives up on them."""

    job_id: str
    attempt: int | None  # from the header, as the queue claimed it; may be missing or wrong
    account: str | None
    worker: str | None
    target: str
    received: float
    answered: float | None  # None: never answered (reset, hang forever, client went away)
    status: int | None  # None when not answered
    behaviour: str
    # The target's own 1-based count of deliveries of this job (it decides the script step).
    seen: int
    # Deliveries of this account in flight at the target when this one arrived (this one
    # included).
    account_in_flight: int
    # The claim's lease token from its header: which pick of the job this is, whatever the
    # attempt number says. None when the worker sent none.
    lease: str | None = None


WorkerEventKind = Literal[
    "start",  # worker process started (fields: pid; replaces: the dead worker it replaces)
    "stop",  # worker process leaving cleanly (fields: reason)
    "claim",  # got a lease (job_id, attempt, lease_token, locked_until; started: claim sent)
    "http",  # an HTTP call ended (job_id, attempt, start, end, result, status, error)
    "write",  # a result write (job_id, attempt, outcome, result: applied|fenced|info, error)
    "renew",  # a lease renewed or lost (job_id, attempt, locked_until or lost=True)
    "release",  # a lease given back on graceful shutdown (job_id, attempt)
    # a recovery call succeeded and moved `count` expired leases (0 included; logs written
    # before that rule hold only calls that moved some)
    "recover",
    "failpoint",  # a failpoint fired (name, job_id, attempt): the process is about to die
    # a call to the queue raised (op: recover|claim|finish|renew|release|wait, error);
    # the worker goes on (a finish that raised is also a `write` with result info per job)
    "error",
]

HttpResult = Literal["ok", "http_error", "timeout", "connection_error", "refused"]


@dataclass(frozen=True, kw_only=True)
class WorkerEvent:
    kind: WorkerEventKind
    worker: str
    time: float
    job_id: str | None = None
    attempt: int | None = None
    data: dict[str, Any] = field(default_factory=dict)


_EVENT_RECORD_FIELDS = ("job_id", "attempt")


def worker_event_record(kind: str, worker: str, time: float, fields: Mapping[str, Any]
                        ) -> dict[str, Any]:
    """A dispatcher event (`kind` and the `fields` it emits) as the `WorkerEvent` record
    the worker log holds: `job_id` and `attempt` lifted out, every other field its data. As
    a mapping, not the dataclass: the log writes it as it would the record, without building
    the dataclass and converting it back, for every event a worker logs while measured."""
    attempt = fields.get("attempt")
    return {
        "kind": kind,
        "worker": worker,
        "time": time,
        "job_id": fields.get("job_id"),
        "attempt": None if attempt is None else int(attempt),
        "data": {k: v for k, v in fields.items() if k not in _EVENT_RECORD_FIELDS},
    }


# The name of a row of `skiplock.reports.fault_kinds`, which the checker holds every recorded
# fault to when it reads a history: the table is the one list of them.
FaultKind = str


@dataclass(frozen=True, kw_only=True)
class FaultEvent:
    """A fault with its window. `target` names what it hit (a worker id, "postgres", ...);
    `job_id` / `attempt` are set when the fault hit one known attempt (failpoints)."""

    fault: FaultKind
    start: float
    end: float | None
    target: str | None = None
    job_id: str | None = None
    attempt: int | None = None
    skipped: str | None = None  # why the fault was not applied (e.g. server is external)
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """How the run ended. `drained` False means jobs were still live when the drain's time
    ran out: the checker then answers "unknown" for them rather than calling them stuck."""

    started: float
    finished: float
    drained: bool
    drain_seconds: float
    exit_reason: str  # "completed", "interrupted", "error: ..."
    backend: str
    retry_base_seconds: float
    retry_cap_seconds: float
    retry_jitter: float
    http_timeout_seconds: float
    lease_seconds: float
    account_limits: dict[str, int | None]
    # Rows in final_jobs.csv; None when no final snapshot was taken.
    final_jobs: int | None = None


# --------------------------------------------------------------------------------------------
# Writing and reading.
# --------------------------------------------------------------------------------------------


def to_record(obj: Any) -> dict[str, Any]:
    """A dataclass record as a JSON-ready dict (enums as their values). Shallow: nested
    values are serialised as they are, never changed, so `asdict`'s deep copy (most of a
    worker's cost of logging an event) is not needed."""
    return {name: (v.value if isinstance(v := getattr(obj, name), Enum) else v)
            for name in _field_names(type(obj))}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


class _AppendOnlyFile:
    """A file opened for appending, written one whole line per write() call: a line is
    either whole or absent if the process dies, and lines from several processes never
    interleave."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)

    def _append(self, line: str) -> None:
        data = line.encode()
        written = os.write(self._fd, data)
        if written != len(data):
            # Only a full disk or a crash cuts a write to a regular file short.
            raise OSError(f"{self.path}: only {written} of {len(data)} bytes written")

    def fsync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class JsonlWriter(_AppendOnlyFile):
    """Appends one JSON object per line (nemesis.jsonl)."""

    def write(self, record: Mapping[str, Any] | Any) -> None:
        data = record if isinstance(record, Mapping) else to_record(record)
        self._append(json.dumps(data, separators=(",", ":"), default=str) + "\n")


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Yield the records of a JSON Lines file. A last line without its newline, or a line
    that is not JSON, means the file was cut off mid-write: that is a HistoryError, because
    a history is never judged with parts of it missing."""
    if not path.exists():
        raise HistoryError(f"{path} is missing")
    with path.open("rb") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.endswith(b"\n"):
                raise HistoryError(f"{path}:{number} is truncated mid-line")
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise HistoryError(f"{path}:{number} is not valid JSON ({exc.msg})") from None
            except UnicodeDecodeError:
                raise HistoryError(f"{path}:{number} is not UTF-8") from None
            except RecursionError:
                raise HistoryError(f"{path}:{number} is nested too deeply to be JSON a run "
                                   "wrote") from None
            if not isinstance(value, dict):
                raise HistoryError(f"{path}:{number} is not a JSON object")
            yield value


# --------------------------------------------------------------------------------------------
# The CSV logs: each file's columns, how a record becomes a line and a line a record.
# --------------------------------------------------------------------------------------------

ColumnKind = Literal["str", "num", "bool", "json"]

_STEP_KEYS = ("behaviour", "status", "seconds")
_SCRIPT_COLUMNS: tuple[tuple[str, ColumnKind], ...] = (
    ("script_name", "str"), ("script_times", "num"),
    *((f"first_{k}", "str" if k == "behaviour" else "num") for k in _STEP_KEYS),
    *((f"then_{k}", "str" if k == "behaviour" else "num") for k in _STEP_KEYS),
)


_SCRIPT_NAMES = frozenset(name for name, _ in _SCRIPT_COLUMNS)


def _flatten_script(record: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in record.items() if k != "script"}
    script = record.get("script")
    if script is None:
        return out
    if not isinstance(script, Mapping):
        raise ValueError(f"script must be an object, not {script!r}")
    unknown = set(script) - {"name", "times", "first", "then"}
    if unknown:
        raise ValueError(f"script has fields the log has no column for: {sorted(unknown)}")
    out["script_name"] = script.get("name")
    out["script_times"] = script.get("times")
    for part in ("first", "then"):
        step = script.get(part)
        if step is None:
            continue
        if not isinstance(step, Mapping) or set(step) - set(_STEP_KEYS):
            raise ValueError(f"script {part} must be an object of {', '.join(_STEP_KEYS)}")
        for key in _STEP_KEYS:
            out[f"{part}_{key}"] = step.get(key)
    return out


def _unflatten_script(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in row.items() if k not in _SCRIPT_NAMES}
    if row.get("first_behaviour") is None:
        out["script"] = None
        return out
    script: dict[str, Any] = {"name": row.get("script_name"), "times": row.get("script_times")}
    for part in ("first", "then"):
        if row.get(f"{part}_behaviour") is not None:
            script[part] = {k: row[f"{part}_{k}"] for k in _STEP_KEYS
                            if row.get(f"{part}_{k}") is not None}
    if script["times"] is not None and float(script["times"]).is_integer():
        script["times"] = int(script["times"])
    out["script"] = script
    return out


_EVENT_BASE = ("kind", "worker", "time", "job_id", "attempt")


def _flatten_event(record: Mapping[str, Any]) -> dict[str, Any]:
    data = record.get("data") or {}
    clash = set(data) & set(_EVENT_BASE)
    if clash:
        raise ValueError(f"worker event data may not name {sorted(clash)}")
    return {**{k: v for k, v in record.items() if k != "data"}, **data}


def _unflatten_event(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: row.get(k) for k in _EVENT_BASE}
    out["data"] = {k: v for k, v in row.items() if k not in _EVENT_BASE and v is not None}
    return out


@dataclass(frozen=True)
class LogFormat:
    """One kind of CSV log: its columns, in order, each with the kind of value it holds, and
    how a record (a dataclass or a dict shaped like one) is flattened into them."""

    what: str  # names the record in messages: "enqueue", "delivery", ...
    columns: tuple[tuple[str, ColumnKind], ...]
    flatten: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    unflatten: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.columns)

    @cached_property
    def _kinds(self) -> dict[str, ColumnKind]:
        return dict(self.columns)

    def kind(self, name: str) -> ColumnKind | None:
        return self._kinds.get(name)

    def header(self) -> str:
        return ",".join(self.names) + "\n"

    def line(self, record: Mapping[str, Any] | Any) -> str:
        """The record as one CSV line. A field with no column is a programming error."""
        data = record if isinstance(record, Mapping) else to_record(record)
        flat = self.flatten(data) if self.flatten else dict(data)
        unknown = flat.keys() - self._kinds.keys()
        if unknown:
            raise ValueError(f"{self.what} has fields with no column: {sorted(unknown)}")
        get = flat.get
        # Most of a wide log's fields are empty in any one record: skip `_cell` for those.
        return ",".join(["" if (value := get(name)) is None else _cell(value, kind)
                         for name, kind in self.columns]) + "\n"


def escape_text(text: str) -> str:
    """Text with its backslashes and line breaks escaped (`\\`, `\n`, `\r`), so that a
    line break only ever ends a record."""
    if "\\" in text or "\n" in text or "\r" in text:
        text = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    return text


_ESCAPE = re.compile(r"\\([\\nr])")
_UNESCAPED = {"\\": "\\", "n": "\n", "r": "\r"}


def unescape_text(text: str) -> str:
    """The inverse of `escape_text`; another backslash sequence is left as it is."""
    if "\\" not in text:
        return text
    return _ESCAPE.sub(lambda m: _UNESCAPED[m.group(1)], text)


def _cell(value: Any, kind: ColumnKind) -> str:
    if value is None:
        return ""
    # The common exact types first: the abstract-class checks below cost more than the rest
    # of a worker's logging.
    kind_of = type(value)
    if kind == "num" and kind_of is int:
        return str(value)
    if kind == "num" and kind_of is float:
        return repr(value)
    if kind == "str" and kind_of is str and (
            "," not in value and '"' not in value and "\\" not in value
            and "\n" not in value and "\r" not in value):
        return cast(str, value)
    if kind == "json":
        text = json.dumps(value, separators=(",", ":"), sort_keys=True, default=str)
    elif kind == "num":
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{value!r} is not a number")
        text = str(int(value)) if isinstance(value, numbers.Integral) else repr(float(value))
    elif kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{value!r} is not true or false")
        text = "true" if value else "false"
    else:
        text = escape_text(str(value.value if isinstance(value, Enum) else value))
    if "," in text or '"' in text:
        text = '"' + text.replace('"', '""') + '"'
    return text


ENQUEUE_LOG = LogFormat(
    what="enqueue",
    columns=(("type", "str"), ("job_id", "str"), ("time", "num"), ("process", "str"),
             ("account", "str"), ("target_url", "str"), ("max_attempts", "num"),
             ("run_at", "num"), ("error", "str"), *_SCRIPT_COLUMNS),
    flatten=_flatten_script,
    unflatten=_unflatten_script,
)
DELIVERY_LOG = LogFormat(
    what="delivery",
    columns=(("job_id", "str"), ("attempt", "num"), ("account", "str"), ("worker", "str"),
             ("target", "str"), ("received", "num"), ("answered", "num"), ("status", "num"),
             ("behaviour", "str"), ("seen", "num"), ("account_in_flight", "num"),
             ("lease", "str")),
)
# Every field any WorkerEventKind carries (see WorkerEventKind), flattened next to `kind`.
WORKER_LOG = LogFormat(
    what="worker event",
    columns=(("kind", "str"), ("worker", "str"), ("time", "num"), ("job_id", "str"),
             ("attempt", "num"), ("result", "str"), ("status", "num"), ("start", "num"),
             ("end", "num"), ("started", "num"), ("outcome", "str"), ("error", "str"),
             ("lease_token", "str"), ("locked_until", "str"), ("lost", "bool"),
             ("name", "str"), ("count", "num"), ("pid", "num"), ("reason", "str"),
             ("replaces", "str"), ("op", "str")),
    flatten=_flatten_event,
    unflatten=_unflatten_event,
)
_WORKER_NAMES = frozenset(WORKER_LOG.names)
_WORKER_OWN = frozenset(("kind", "worker", "time"))


def worker_event_line(kind: str, worker: str, time: float, fields: Mapping[str, Any]) -> str:
    """`WORKER_LOG.line(worker_event_record(kind, worker, time, fields))`, made without
    building the record and flattening it back: a busy worker logs three events a job, and
    that round trip was most of their cost. Fields the log cannot hold go the long way,
    which refuses them alike (a test holds the two equal)."""
    keys = fields.keys()
    if not keys <= _WORKER_NAMES or keys & _WORKER_OWN:
        return WORKER_LOG.line(worker_event_record(kind, worker, time, fields))
    row = {**fields, "kind": kind, "worker": worker, "time": time}
    attempt = row.get("attempt")
    if attempt is not None:
        row["attempt"] = int(attempt)
    get = row.get
    return ",".join(["" if (value := get(name)) is None else _cell(value, column)
                     for name, column in WORKER_LOG.columns]) + "\n"


# PostgreSQL's sessions of the run's database, sampled once a second from pg_stat_activity.
# Each sample writes one `connected` row (client sessions, in any state) and one row per wait
# of the active or idle-in-transaction sessions: `wait` is `type:event`, `CPU` for an active
# session waiting on nothing, or `idle in transaction` (what pins xmin).
WAITS_LOG = LogFormat(
    what="wait sample",
    columns=(("time", "num"), ("row", "str"), ("wait", "str"), ("sessions", "num")),
)
FINAL_JOBS_LOG = LogFormat(
    what="final job state",
    columns=(("job_id", "str"), ("account_id", "str"), ("status", "str"), ("attempts", "num"),
             ("max_attempts", "num"), ("last_error", "str"), ("locked_until", "num"),
             ("next_attempt_at", "num"), ("extra", "json")),
)


def _cut_off(fd: int, size: int) -> bool:
    """Whether the log ends inside a line and stays that way. Another process's append may
    be caught halfway (the size grows before the last byte lands), so a log that grows or
    gets its line break within a moment is being written, not cut off."""
    for _ in range(5):
        if os.pread(fd, 1, size - 1) == b"\n" or os.fstat(fd).st_size != size:
            return False
        time.sleep(0.02)
    return True


class LogWriter(_AppendOnlyFile):
    """Appends records to a CSV log, one line each. Opening writes the header if the file is
    new; several processes may open one file at once (the header is written under a lock,
    before any of them appends). A file whose header is not this format's is refused rather
    than appended to."""

    def __init__(self, path: Path, log: LogFormat) -> None:
        super().__init__(path)
        self.log = log
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                header = log.header().encode()
                size = os.fstat(self._fd).st_size
                if size == 0:
                    self._append(header.decode())
                elif os.pread(self._fd, len(header), 0) != header:
                    raise HistoryError(f"{path} was written with other columns than this "
                                       f"version writes: use a new run directory")
                elif _cut_off(self._fd, size):
                    # Appending would glue the next record onto the cut one.
                    raise HistoryError(f"{path} was cut off mid-line: use a new run "
                                       f"directory")
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        except BaseException:
            self.close()
            raise

    def write(self, record: Mapping[str, Any] | Any) -> None:
        self._append(self.log.line(record))

    def write_many(self, records: Iterable[Mapping[str, Any] | Any]) -> None:
        """Several records in one write: the same lines as `write` for each, one system
        call (a producer's whole enqueue batch), never interleaved with another writer's."""
        data = "".join(self.log.line(record) for record in records)
        if data:
            self._append(data)

    def write_text(self, lines: str) -> None:
        """Whole lines already in this log's format (each as `self.log.line` makes it), in
        one write. For a writer that builds its lines faster than `line` (the producers);
        a test holds them equal."""
        if lines:
            self._append(lines)


def parse_header(path: Path, line: str, log: LogFormat) -> list[str]:
    """The column names of a log's header line; a HistoryError when it is not one."""
    if line.startswith("\ufeff"):
        raise HistoryError(f"{path}:1 starts with a byte-order mark: save it as UTF-8 "
                           "without one")
    try:
        names = next(csv.reader([line]), [])
    except csv.Error:  # a carriage return or other line break inside the line
        names = []
    if not names or not set(names) & set(log.names):
        raise HistoryError(f"{path}:1 is not a header of {log.what} columns")
    if len(set(names)) != len(names):
        raise HistoryError(f"{path}:1 names a column twice")
    return names


_INTEGER = re.compile(r"[-+]?[0-9]+")
_REAL = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?|[-+]?(inf|infinity|nan)",
                   re.IGNORECASE)


def parse_cell(text: str, kind: ColumnKind | None) -> Any:
    """One field's value; ValueError when it is not of its column's kind. Numbers are read
    as Arrow reads them (ASCII decimals, `inf`, `nan`, spaces around them ignored), so the
    checker's two ways of reading a log agree; whole numbers of up to 299 digits stay
    exact."""
    if text == "":
        return None
    if kind == "num":
        number = text.strip(" \t")
        if _INTEGER.fullmatch(number) and len(number) < 300:
            return int(number)
        if not _REAL.fullmatch(number):
            raise ValueError(text)
        return float(number)
    if kind == "bool":
        if text not in ("true", "false"):
            raise ValueError(text)
        return text == "true"
    if kind == "json":
        return json.loads(text)
    return unescape_text(text)


def arrow_convert_options(column_types: Mapping[str, Any]) -> Any:
    """pyarrow.csv options that read the named columns of a log as `parse_cell` does: only
    an empty field is null, only `true` / `false` are booleans; a column the file lacks
    reads as null. `column_types` maps each column to read to its Arrow type."""
    import pyarrow.csv as pacsv  # type: ignore[import-untyped]  # only readers need Arrow

    return pacsv.ConvertOptions(
        column_types=dict(column_types), include_columns=list(column_types),
        include_missing_columns=True, null_values=[""], strings_can_be_null=True,
        true_values=["true"], false_values=["false"])


def read_log(path: Path, log: LogFormat) -> Iterator[dict[str, Any]]:
    """Yield the records of a CSV log, unflattened to the shape they were written in. A last
    line without its newline means the file was cut off mid-write: that is a HistoryError,
    as is a malformed line, because a history is never judged with parts of it missing.
    Blank lines are skipped."""
    if not path.exists():
        raise HistoryError(f"{path} is missing")
    names: list[str] | None = None
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.endswith(b"\n"):
                raise HistoryError(f"{path}:{number} is truncated mid-line")
            try:
                line = raw.decode()
            except UnicodeDecodeError:
                raise HistoryError(f"{path}:{number} is not UTF-8") from None
            if names is None:
                names = parse_header(path, line, log)
                continue
            if not line.strip():
                continue
            yield parse_row(path, number, line, names, log)


def parse_row(path: Path, number: int, line: str, names: Sequence[str],
              log: LogFormat) -> dict[str, Any]:
    """One data line of a log as a record (unflattened); a HistoryError naming the line when
    it is malformed."""
    try:
        # Quoting is read as Arrow reads it, leniently: `"a"b` is `ab` on both paths.
        fields = next(csv.reader([line]), [])
    except csv.Error as exc:
        raise HistoryError(f"{path}:{number} is not a CSV line ({exc})") from None
    if len(fields) != len(names):
        raise HistoryError(f"{path}:{number} has {len(fields)} fields, the header "
                           f"{len(names)}")
    row: dict[str, Any] = {}
    for name, text in zip(names, fields, strict=True):
        kind = log.kind(name)
        if kind is None:
            continue  # a column this version does not know
        try:
            row[name] = parse_cell(text, kind)
        except ValueError:
            what = {"num": "a number", "bool": "true or false", "json": "JSON"}.get(kind, "")
            raise HistoryError(f"{path}:{number}: {log.what} field {name} is not "
                               f"{what}") from None
    for name in log.names:
        row.setdefault(name, None)
    return log.unflatten(row) if log.unflatten else row


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file (spec.json, run.json); a HistoryError naming the file when it is
    missing, unreadable, not UTF-8, not JSON, nested past what a parser can follow, or not
    an object."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise HistoryError(f"{path} is missing") from None
    except OSError as exc:
        raise HistoryError(f"{path} cannot be read ({exc.strerror or exc})") from None
    try:
        value = json.loads(data.decode())
    except UnicodeDecodeError:
        raise HistoryError(f"{path} is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise HistoryError(f"{path} is not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise HistoryError(f"{path} is nested too deeply to be JSON a run wrote") from None
    if not isinstance(value, dict):
        raise HistoryError(f"{path} is not a JSON object")
    return value


def write_json(path: Path, value: Mapping[str, Any]) -> None:
    """Write atomically (temp file + rename): readers never see half a file. A path that is
    a device or a pipe (`--out /dev/null`, `/dev/stdout`) is written into, never replaced:
    renaming over it would, as root, put a regular file where /dev/null was."""
    text = json.dumps(value, indent=2, sort_keys=True, default=str) + "\n"
    if path.exists() and not path.is_file() and not path.is_dir():
        with path.open("w") as fh:
            fh.write(text)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
