"""The checker: judge a run directory from its history alone and write `verdict.json`.

Reading. The first run directory must hold `spec.json`, `run.json`, `enqueues.csv`,
`final_jobs.csv`, a `deliveries/` directory and a `workers/` directory; `nemesis.jsonl` is
optional (absent or empty: no fault ran). Further directories add their `deliveries/*.csv`,
`workers/*.csv` and `nemesis.jsonl` (targets and workers on other machines), and may hold an
`enqueues.csv` (producers on other machines). The CSV logs are read by their header's column
names (`reports.history`): columns the checker does not read are ignored. A history that
cannot be trusted is never judged: it is bad input (`HistoryError`, one line naming the file,
and the line where there is one) when a directory is given twice (or one log through two
paths), a file is missing, unreadable or not a regular file, no directory holds a delivery
log, a line is malformed (a wrong number of fields, a number column that holds something
else, an infinite number or a negative time, JSON that is not an object in nemesis.jsonl),
a complete line holds a NUL byte, the first line is no header, a header lacks a column the
checker needs, a record lacks its required values, or run.json's settings have the wrong
type or are not finite. A log cut off mid-line (or empty, so cut off before its header) is
judged on its whole lines and makes the answer "unknown", and the violations its lost tail
may have caused are counted but not reported (`_CUT_MAY_CAUSE`). When run.json records
`final_jobs` (the rows the runner's snapshot had) and `final_jobs.csv` holds a different
number, the answer is "unknown"; an acknowledged job with no final row is a state mismatch
when the snapshot is known to be whole, else it makes the answer "unknown".

Judging. Each job's oracle (`reports.oracle`) comes from its enqueue (script, max_attempts,
account) and the run's configuration; the target's log says what was really delivered. The
whole-run checks are vectorised with pandas; the few suspicious rows they find are then
explained or not, one by one, against the recorded events (worker events and faults). A
job dead-lettered because attempts never reached the target (its worker recorded a timeout or
connection error, the target no delivery of that attempt) is neither valid nor a violation:
the worker is part of the system under test, so its word settles nothing, and the answer is
"unknown" unless something else is violated.

Timing tolerance: the target, the workers and the nemesis share one clock, but a worker logs
an event a little after it happened, so time comparisons allow `tolerance_seconds`. Leases
are the configured `lease_seconds` from the worker's claim or renewal, never the lease end
the queue reported.
"""

from __future__ import annotations

import codecs
import json
import math
import mmap
import os
import stat
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, cast, get_args

import numpy as np
import pandas as pd
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
import pyarrow.csv as pacsv  # type: ignore[import-untyped]
import pyarrow.json as pajson  # type: ignore[import-untyped]

from queue_impl.interface import JobStatus
from queue_impl.retry import RetryPolicy
from reports import columnar
from reports.history import (
    DELIVERIES_DIR,
    DELIVERY_LOG,
    ENQUEUE_LOG,
    ENQUEUES_FILE,
    FINAL_JOBS_FILE,
    FINAL_JOBS_LOG,
    LOG_SUFFIX,
    NEMESIS_FILE,
    RUN_FILE,
    SPEC_FILE,
    VERDICT_FILE,
    WORKER_LOG,
    WORKERS_DIR,
    ColumnKind,
    HistoryError,
    LogFormat,
    WorkerEventKind,
    arrow_convert_options,
    parse_header,
    parse_row,
    read_json,
    unescape_text,
    write_json,
)
from reports.oracle import Expected, OracleCache, script_from_payload

COUNT_KEYS: tuple[str, ...] = (
    "enqueued",
    "delivered",
    "completed",
    "failed",
    "lost",
    "unexpected",
    "duplicate_explained",
    "duplicate_unexplained",
    "concurrent_delivery",
    "attempts_exceeded",
    "early_retry",
    "limit_exceeded",
    "stuck",
    "state_mismatch",
    "stale_write",
)
# Counts that are a violated guarantee when non-zero; the rest describe the run.
_DESCRIPTIVE_KEYS = frozenset({"enqueued", "delivered", "completed", "failed",
                               "duplicate_explained"})
VIOLATION_KEYS: tuple[str, ...] = tuple(k for k in COUNT_KEYS if k not in _DESCRIPTIVE_KEYS)
EXAMPLE_KINDS: tuple[str, ...] = (*VIOLATION_KEYS, "duplicate_explained")
# Each anomaly in a line (the README's table says it in full; a test holds the two to the
# same names). The report shows these next to the counts.
MEANINGS: dict[str, str] = {
    "lost": "acknowledged, never delivered with 2xx, and not legitimately dead-lettered",
    "unexpected": "a delivery of a job never enqueued (or whose enqueue failed)",
    "duplicate_explained": "a 2xx delivered again, explained by a recorded fault or timeout "
                           "(at-least-once, as promised)",
    "duplicate_unexplained": "a 2xx delivered again with nothing recorded to explain it",
    "concurrent_delivery": "two deliveries of one job in flight at once, the first lease "
                           "still held",
    "attempts_exceeded": "more deliveries than max_attempts (or one after a permanent "
                         "failure)",
    "early_retry": "a retry sent before the backoff allows",
    "limit_exceeded": "more deliveries of one account in flight than its limit",
    "stuck": "a job not finished after a completed drain",
    "state_mismatch": "the final state disagrees with what the target saw",
    "stale_write": "a result applied after another worker claimed a later attempt",
}
MAX_EXAMPLES = 10
DEFAULT_TOLERANCE_SECONDS = 0.25
# How long after it was due a retry's claim may come (a poll, a busy worker), for the window
# in which a kill may have hidden it (_Explainer._unlogged_claim).
TRAILING_CLAIM_SLACK_SECONDS = 2.0

# Faults that hit one worker process: they explain what that worker held at the time.
_WORKER_FAULTS = frozenset({"kill_worker", "pause_worker", "crash_after_claim", "crash_after_http"})
# Faults that hit the queue's database: any result write in their window may have been lost.
_DATABASE_FAULTS = frozenset({"terminate_backends", "restart_postgres", "exhaust_pool"})
# Faults that last until they are healed; the others are instants.
_LASTING_FAULTS = frozenset({"pause_worker", "hang_target", "kill_target", "restart_postgres",
                             "pin_xmin", "exhaust_pool"})
# Faults that hit one echo target: a delivery there in their window may have been recorded 2xx
# while its answer never reached the worker (held past the timeout, or lost with the process).
_TARGET_FAULTS = frozenset({"hang_target", "kill_target"})
_KNOWN_FAULTS = frozenset(_WORKER_FAULTS | _DATABASE_FAULTS | _TARGET_FAULTS | {"pin_xmin"})
# The oracle walks a job's attempts one by one: a larger max_attempts is no run's, and would
# hold the checker for hours.
_MAX_ATTEMPTS = 1_000_000

Valid = bool | Literal["unknown"]


# --------------------------------------------------------------------------------------------
# The verdict.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """The answer for one run. `valid` is False when any violation count is non-zero,
    "unknown" when none is but the history cannot decide (see `unknown_reasons`)."""

    valid: Valid
    counts: dict[str, int]
    examples: dict[str, list[dict[str, Any]]]
    unknown_reasons: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        if self.valid is True:
            return 0
        if self.valid is False:
            return 1
        return 3

    def to_json(self) -> dict[str, Any]:
        return {
            "valid": self.valid,
            "counts": dict(self.counts),
            "examples": {k: list(v) for k, v in self.examples.items()},
            "unknown_reasons": list(self.unknown_reasons),
            "files": list(self.files),
            "details": dict(self.details),
            "timings": dict(self.timings),
        }


def write_verdict(run_dir: Path, verdict: Verdict) -> Path:
    path = Path(run_dir) / VERDICT_FILE
    write_json(path, verdict.to_json())
    return path


# --------------------------------------------------------------------------------------------
# Reading: the CSV logs (and nemesis.jsonl) through Arrow's readers, files in parallel; line
# by line only to name a bad line.
# --------------------------------------------------------------------------------------------

_BLOCK_BYTES = 8 << 20  # Arrow parses a file in blocks; a line must fit in one
_ARROW_TYPES: dict[ColumnKind, pa.DataType] = {"str": pa.string(), "num": pa.float64(),
                                               "bool": pa.bool_()}


@dataclass(frozen=True)
class _Source:
    """How the checker reads one kind of history file. `schema` holds the columns it reads
    (and caches); `shape` holds them as the judge's tables do, a record's nested objects as
    struct columns, which `nest` builds from a CSV log's flat columns. `log` is the CSV log
    narrowed to the columns read (None: JSON Lines); a CSV header without a `required`
    column is bad input. `filled` is a required column that every record has a value in:
    Arrow reads a blank line as a record of nulls, so a null there sends the file to the
    line-by-line reader, which skips blank lines and names a bad record's line."""

    schema: pa.Schema
    shape: pa.Schema
    log: LogFormat | None = None
    required: tuple[str, ...] = ()
    filled: str | None = None
    nest: Callable[[pa.RecordBatch], pa.RecordBatch] | None = None

    @property
    def header_lines(self) -> int:
        return 0 if self.log is None else 1


def _csv_source(log: LogFormat, names: Sequence[str], *, required: tuple[str, ...],
                filled: str,
                nest: Callable[[pa.RecordBatch], pa.RecordBatch] | None = None) -> _Source:
    # Narrowed, so that the slow path, like Arrow, never parses a column nothing reads.
    read = replace(log, columns=tuple(c for c in log.columns if c[0] in names))
    schema = pa.schema([(name, _ARROW_TYPES[kind]) for name, kind in read.columns])
    shape = schema if nest is None else nest(pa.RecordBatch.from_pylist([], schema)).schema
    return _Source(schema=schema, shape=shape, log=read, required=required, filled=filled,
                   nest=nest)


_STEP = pa.struct([("behaviour", pa.string()), ("status", pa.float64()),
                   ("seconds", pa.float64())])
_SCRIPT = pa.struct([("name", pa.string()), ("first", _STEP), ("times", pa.float64()),
                     ("then", _STEP)])
_ENQUEUE_BASE = ("type", "job_id", "account", "max_attempts")


def _nest_script(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The script columns of enqueues as one struct column: null without a first step, a
    step null without its behaviour, as `reports.history.read_log` reads them back."""

    def step(part: str) -> pa.StructArray:
        behaviour = batch.column(f"{part}_behaviour")
        return pa.StructArray.from_arrays(
            [behaviour, batch.column(f"{part}_status"), batch.column(f"{part}_seconds")],
            fields=list(_STEP), mask=behaviour.is_null())

    script = pa.StructArray.from_arrays(
        [batch.column("script_name"), step("first"), batch.column("script_times"),
         step("then")],
        fields=list(_SCRIPT), mask=batch.column("first_behaviour").is_null())
    return pa.RecordBatch.from_arrays([*(batch.column(n) for n in _ENQUEUE_BASE), script],
                                      names=[*_ENQUEUE_BASE, "script"])


# The fields of a worker event the judge reads besides its kind, time, job and attempt.
# `started` (write: when the statement was sent) and `end` (http: when the call ended) time
# what the worker did; `outcome` says what a write recorded. The lease end the queue
# reported (`locked_until`) is never used: leases run the configured length. `op` names the
# call an `error` event says failed.
_EVENT_DATA = ("result", "name", "lost", "error", "reason", "outcome", "started", "end", "op")
_EVENT_BASE = ("kind", "worker", "time", "job_id", "attempt")


def _nest_event_data(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A worker event's own fields as one struct column `data`, as they were written."""
    data = pa.StructArray.from_arrays([batch.column(n) for n in _EVENT_DATA],
                                      names=list(_EVENT_DATA))
    return pa.RecordBatch.from_arrays([*(batch.column(n) for n in _EVENT_BASE), data],
                                      names=[*_EVENT_BASE, "data"])


_ENQUEUES = _csv_source(
    ENQUEUE_LOG, (*_ENQUEUE_BASE, "script_name", "script_times", "first_behaviour",
                  "first_status", "first_seconds", "then_behaviour", "then_status",
                  "then_seconds"),
    required=("type", "job_id"), filled="type", nest=_nest_script)
_DELIVERIES = _csv_source(
    DELIVERY_LOG, ("job_id", "attempt", "account", "worker", "target", "received", "answered",
                   "status", "behaviour"),
    required=("job_id", "received"), filled="received")
_EVENTS = _csv_source(
    WORKER_LOG, (*_EVENT_BASE, *_EVENT_DATA),
    required=("kind", "time"), filled="time", nest=_nest_event_data)
_FINAL = _csv_source(FINAL_JOBS_LOG, ("job_id", "status"), required=("job_id", "status"),
                     filled="status")
_FAULT_SCHEMA = pa.schema([
    ("fault", pa.string()), ("start", pa.float64()), ("end", pa.float64()),
    ("target", pa.string()), ("job_id", pa.string()), ("attempt", pa.float64()),
    ("skipped", pa.string()),
])
_FAULTS = _Source(schema=_FAULT_SCHEMA, shape=_FAULT_SCHEMA)


def _without_nulls(value: Any) -> Any:
    """A struct read by Arrow has every field of its schema; leave out the absent (null)
    ones, as they were in the file."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value


@dataclass
class _Nested:
    """A column of objects (an enqueue's script, a worker event's data): Arrow struct
    columns (one per file, converted on demand) or, for a file read line by line, Python
    values."""

    parts: list[pa.ChunkedArray | list[Any]]
    starts: np.ndarray  # first row of each part

    def pick(self, rows: np.ndarray) -> list[Any]:
        """The values of `rows` (ascending), as Python dicts (or whatever the line held)."""
        out: list[Any] = []
        which = np.searchsorted(self.starts, rows, side="right") - 1
        for k in np.unique(which).tolist():
            local = rows[which == k] - self.starts[k]
            part = self.parts[k]
            if isinstance(part, list):
                out.extend(part[i] for i in local.tolist())
            else:
                out.extend(map(_without_nulls, part.take(pa.array(local)).to_pylist()))
        return out

    def field(self, name: str, rows: np.ndarray) -> np.ndarray:
        """One field of the objects at `rows` (ascending), None where absent."""
        values = np.full(len(rows), None, dtype=object)
        which = np.searchsorted(self.starts, rows, side="right") - 1
        for k in np.unique(which).tolist():
            at = which == k
            local = rows[at] - self.starts[k]
            part = self.parts[k]
            if isinstance(part, list):
                values[at] = [_data(part[i]).get(name) for i in local.tolist()]
            elif part.type.get_field_index(name) >= 0:
                column = pc.struct_field(part.take(pa.array(local)), name)
                values[at] = column.to_numpy(zero_copy_only=False)
        return values


@dataclass
class _Part:
    """One file's columns: numbers as float64 (NaN for null), strings as object arrays,
    `job_id` kept in Arrow (it is only ever looked up), objects as `_Nested` parts."""

    path: Path
    rows: int
    typed: bool  # read by Arrow: strings are str or None, numbers are numbers
    truncated: bool
    columns: dict[str, np.ndarray]
    job_id: pa.ChunkedArray
    nested: dict[str, pa.ChunkedArray | list[Any]]
    header_lines: int  # lines before the first record
    lines: list[int] | None = None  # line of each row, when blank lines were skipped
    empty: bool = False  # a CSV log of no bytes at all: cut off before its header


def _parse_json_slow(path: Path, data: bytes) -> tuple[list[dict[str, Any]], list[int]]:
    """Line by line, to name the first bad line; the records and their line numbers."""
    rows: list[dict[str, Any]] = []
    numbers: list[int] = []
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
            raise HistoryError(f"{path}:{number} is not valid JSON ({msg})") from None
        except RecursionError:
            raise HistoryError(f"{path}:{number} is nested too deeply to be a fault event") \
                from None
        if not isinstance(value, dict):
            raise HistoryError(f"{path}:{number} is not a JSON object")
        rows.append(value)
        numbers.append(number)
    return rows, numbers


def _parse_csv_slow(path: Path, data: bytes, names: Sequence[str],
                    log: LogFormat) -> tuple[list[dict[str, Any]], list[int]]:
    """The data lines (after the header) one by one, to name the first bad line; the
    records, nested as they were written, and their line numbers."""
    rows: list[dict[str, Any]] = []
    numbers: list[int] = []
    for number, raw in enumerate(data.split(b"\n")[1:], start=2):
        if not raw.strip():
            continue
        try:
            line = raw.decode()
        except UnicodeDecodeError:
            raise HistoryError(f"{path}:{number} is not UTF-8") from None
        rows.append(parse_row(path, number, line, names, log))
        numbers.append(number)
    return rows, numbers


def _strings(column: pa.ChunkedArray) -> np.ndarray:
    """An Arrow string column (of few distinct values) as an object array of str / None,
    through its dictionary so that each string object is made once."""
    if len(column) == 0:
        return np.empty(0, dtype=object)
    encoded = column.combine_chunks().dictionary_encode()
    labels = np.append(encoded.dictionary.to_numpy(zero_copy_only=False), np.array([None]))
    codes = encoded.indices.fill_null(len(labels) - 1).to_numpy()
    return cast(np.ndarray, labels[codes])


def _arrow_part(path: Path, table: pa.Table, truncated: bool, source: _Source) -> _Part:
    columns: dict[str, np.ndarray] = {}
    nested: dict[str, pa.ChunkedArray | list[Any]] = {}
    for f in table.schema:
        column = table.column(f.name)
        if pa.types.is_struct(f.type):
            nested[f.name] = column
        elif pa.types.is_floating(f.type):
            columns[f.name] = column.to_numpy()
        elif f.name != "job_id":
            columns[f.name] = _strings(column)
    return _Part(path=path, rows=table.num_rows, typed=True, truncated=truncated,
                 columns=columns, job_id=table.column("job_id"), nested=nested,
                 header_lines=source.header_lines)


def _python_part(path: Path, rows: list[dict[str, Any]], lines: list[int],
                 source: _Source, truncated: bool) -> _Part:
    columns: dict[str, np.ndarray] = {}
    nested: dict[str, pa.ChunkedArray | list[Any]] = {}
    for f in source.shape:
        if pa.types.is_struct(f.type):
            nested[f.name] = [r.get(f.name) for r in rows]
        elif f.name != "job_id":
            values = np.empty(len(rows), dtype=object)
            values[:] = [r.get(f.name) for r in rows]
            columns[f.name] = values
    ids = [r.get("job_id") for r in rows]
    job_id = pa.chunked_array([pa.array([v if type(v) is str else None for v in ids],
                                        pa.string())])
    return _Part(path=path, rows=len(rows), typed=False, truncated=truncated,
                 columns=columns, job_id=job_id, nested=nested,
                 header_lines=source.header_lines, lines=lines)


def _shaped(table: pa.Table, source: _Source) -> pa.Table:
    """A table of the columns read (`source.schema`) as the judge holds it (`shape`)."""
    if source.nest is None:
        return table
    return pa.Table.from_batches([source.nest(b) for b in table.to_batches()], source.shape)


def _unescaped(table: pa.Table) -> pa.Table:
    """The text columns with what a writer escaped (backslashes, line breaks) restored.
    Only the few cells holding a backslash are decoded, by `history.unescape_text` itself."""
    for i, f in enumerate(table.schema):
        if not pa.types.is_string(f.type):
            continue
        column = table.column(i).combine_chunks()
        marked = pc.fill_null(pc.match_substring(column, "\\"), False)
        if not pc.any(marked).as_py():
            continue
        # Each distinct value once: a column of few values (accounts, workers) may have
        # many cells with one.
        escaped = column.filter(marked).dictionary_encode()
        distinct = pa.array([unescape_text(v) for v in escaped.dictionary.to_pylist()],
                            pa.string())
        decoded = distinct.take(escaped.indices)
        table = table.set_column(i, f, pc.replace_with_mask(column, marked, decoded))
    return table


def _csv_header(path: Path, data: bytes | mmap.mmap, source: _Source) -> list[str]:
    """The column names of a CSV log (whose first line is whole); a HistoryError when its
    first line is no header of this log or lacks a column the checker needs."""
    try:
        header = data[: data.find(b"\n")].decode()
    except UnicodeDecodeError:
        raise HistoryError(f"{path}:1 is not UTF-8") from None
    names = parse_header(path, header, cast(LogFormat, source.log))
    missing = [name for name in source.required if name not in names]
    if missing:
        raise HistoryError(f"{path}:1: the header has no {missing[0]} column; "
                           f"the checker needs {', '.join(source.required)}")
    return names


def _read_csv(data: bytes | mmap.mmap, end: int, source: _Source) -> pa.Table | None:
    """The columns of a CSV log's first `end` bytes, parsed by Arrow, a row per line; None
    when Arrow cannot parse them, or they hold a blank line (or a record without its
    `filled` value)."""
    try:
        table = pacsv.read_csv(
            pa.BufferReader(pa.py_buffer(memoryview(data)[:end])),
            read_options=pacsv.ReadOptions(block_size=_BLOCK_BYTES),
            parse_options=pacsv.ParseOptions(ignore_empty_lines=False),
            convert_options=arrow_convert_options(
                {f.name: f.type for f in source.schema}),
        )
    except (pa.ArrowInvalid, UnicodeDecodeError):
        return None
    if table.column(source.filled).null_count:
        return None
    # A quote left open on the last line takes its line break into the value (the line-by-line
    # reader does not): no writer leaves one, so such a file is read line by line.
    for f in table.schema:
        if pa.types.is_string(f.type) and pc.any(
                pc.match_substring(table.column(f.name), "\n")).as_py():
            return None
    # Few fields ever hold an escape: look for a backslash before decoding any column.
    return _unescaped(table) if data.find(b"\\", 0, end) >= 0 else table


def _read_jsonl(data: bytes, source: _Source) -> pa.Table | None:
    """A JSON Lines file parsed by Arrow; None when Arrow cannot parse it, or it holds
    blank lines or two objects on a line (rows would not be lines), or bytes that are not
    UTF-8 (Arrow's reader passes them into its strings; the line-by-line reader names the
    line)."""
    try:
        codecs.decode(data, "utf-8")
    except UnicodeDecodeError:
        return None
    try:
        table = pajson.read_json(
            pa.BufferReader(pa.py_buffer(data)),
            read_options=pajson.ReadOptions(block_size=_BLOCK_BYTES),
            parse_options=pajson.ParseOptions(explicit_schema=source.schema,
                                              unexpected_field_behavior="ignore"),
        )
    except (pa.ArrowInvalid, UnicodeDecodeError):
        return None
    return table if table.num_rows == data.count(b"\n") else None


def _map(path: Path) -> bytes | mmap.mmap:
    """The bytes of a history file, mapped rather than read: Arrow parses the CSV logs where
    they lie in the page cache, without a copy of each file."""
    try:
        with path.open("rb") as fh:
            if not os.fstat(fh.fileno()).st_size:
                return b""
            return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise HistoryError(f"{path} cannot be read ({exc.strerror or exc})") from None


def _refuse_nul(path: Path, data: bytes | mmap.mmap, end: int) -> None:
    """A HistoryError naming the first whole line that holds a NUL byte (a memchr over the
    file: cheap next to parsing it). Nothing a run records holds one (job ids, headers and
    database errors cannot), so a NUL is damage done after the writing: a crash that
    zero-filled a block, a bad copy. A NUL in a cut last line is part of what was cut."""
    at = data.find(b"\x00", 0, end)
    if at >= 0:
        line = data[:at].count(b"\n") + 1
        raise HistoryError(f"{path}:{line} holds a NUL byte, which a run never records: the "
                           "file is damaged; judge an undamaged copy")


def _read_part(path: Path, source: _Source) -> _Part:
    cache = columnar.lookup(path, (source.schema,))
    if cache.table is not None:
        return _arrow_part(path, _shaped(cache.table, source), False, source)
    data = _map(path)
    # A file cut off mid-write is judged on its complete lines, and the answer is "unknown".
    # So is an empty CSV log: every writer writes the header first, so an empty one was cut
    # off before it (a process that died between creating its log and writing to it).
    end = data.rfind(b"\n") + 1
    empty = not len(data) and source.log is not None
    truncated = end < len(data) or empty
    _refuse_nul(path, data, end)
    if not end:
        part = _arrow_part(path, source.shape.empty_table(), truncated, source)
        part.empty = empty
        return part
    # Blank lines or two records on a line make Arrow's rows differ from the lines: such a
    # file, or one Arrow cannot parse, is read line by line, to name the line at fault.
    names = None if source.log is None else _csv_header(path, data, source)
    table = _read_jsonl(data[:end], source) if names is None else _read_csv(data, end, source)
    if table is not None:
        if not truncated:
            cache.store(table, read_bytes=end)
        return _arrow_part(path, _shaped(table, source), truncated, source)
    rows, lines = (_parse_json_slow(path, data[:end]) if names is None
                   else _parse_csv_slow(path, data[:end], names, cast(LogFormat, source.log)))
    return _python_part(path, rows, lines, source, truncated)


def _read_parts(jobs: Sequence[tuple[Path, _Source]]) -> list[_Part]:
    """Every file, read in parallel (Arrow parses without the GIL), in the given order."""
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        futures = [pool.submit(_read_part, path, source) for path, source in jobs]
        return [f.result() for f in futures]


@dataclass
class _Table:
    """Columns read from one or more files of one kind, with where each row came from."""

    columns: dict[str, np.ndarray]
    job_id: pa.ChunkedArray
    nested: dict[str, _Nested]
    typed: bool  # every file went through Arrow
    source: list[str]  # file per file appended
    rows_per_file: list[int]
    header_lines: list[int]  # per file: lines before the first record
    lines: list[list[int] | None]  # per file: line of each row (None: rows are lines)

    def where(self, row: int) -> str:
        """"file:line" of a row."""
        offset = row
        for name, count, header, lines in zip(self.source, self.rows_per_file,
                                              self.header_lines, self.lines, strict=True):
            if offset < count:
                return f"{name}:{header + 1 + offset if lines is None else lines[offset]}"
            offset -= count
        return "?"

    def number(self, key: str, what: str, *, required: bool, time: bool = False) -> np.ndarray:
        """A float64 column, NaN for null; a value that is not a number is bad input, and so
        is an infinite one (no writer writes one) and, for a `time` (seconds since the
        epoch), a negative one."""
        values = self.columns[key]
        array: np.ndarray
        if values.dtype == np.float64:
            array = values
        else:
            ok_types = [v is None or (isinstance(v, int | float) and not isinstance(v, bool))
                        for v in values.tolist()]
            if not all(ok_types):
                row = ok_types.index(False)
                raise HistoryError(f"{self.where(row)}: {what} field {key} is not a number")
            array = values.astype(np.float64)
        if required and np.isnan(array).any():
            row = int(np.flatnonzero(np.isnan(array))[0])
            raise HistoryError(f"{self.where(row)}: {what} field {key} is not a number")
        _refuse_out_of_range(array, lambda row: f"{self.where(row)}: {what} field {key}",
                             time=time)
        return array

    def require_str(self, key: str, what: str) -> None:
        if key == "job_id":
            # Anything but a string was read as null.
            missing = pc.or_kleene(pc.is_null(self.job_id), pc.equal(self.job_id, ""))
            bad = np.flatnonzero(missing.to_numpy(zero_copy_only=False))
        elif self.typed:
            values = self.columns[key]
            bad = np.flatnonzero(pd.isna(values) | (values == ""))
        else:
            bad = np.array([i for i, v in enumerate(self.columns[key].tolist())
                            if type(v) is not str or not v], dtype=np.int64)
        if len(bad):
            raise HistoryError(f"{self.where(int(bad[0]))}: {what} has no {key}")


def _refuse_out_of_range(array: np.ndarray, where: Callable[[int], str], *,
                        time: bool) -> None:
    """A HistoryError for the first infinite value of `array` (NaN is null), or for a `time`
    the first negative one: no writer writes either, and judging with them would make up
    anomalies."""
    bad = np.isinf(array)
    if time:
        bad |= array < 0
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        want = "a time (seconds since the epoch, not negative)" if time else "a finite number"
        raise HistoryError(f"{where(row)} is {float(array[row])!r}, not {want}")


def _refuse_bad_times(table: _Table, nested: _Nested, names: Sequence[str], what: str) -> None:
    """`_refuse_out_of_range` for the times held in a nested column (a worker event's own
    fields): the judge reads them only for the few events that explain something, but a bad
    one must not be judged at all."""
    # `starts` has one entry even without parts.
    for part, start in zip(nested.parts, nested.starts.tolist(), strict=False):
        for name in names:
            if isinstance(part, list):
                values = _floats(np.array([_data(v).get(name) for v in part], dtype=object))
            elif part.type.get_field_index(name) >= 0:
                values = pc.struct_field(part, name).to_numpy(zero_copy_only=False)
            else:
                continue

            def where(row: int, at: int = start, field: str = name) -> str:
                return f"{table.where(at + row)}: {what} field {field}"

            _refuse_out_of_range(np.asarray(values, dtype=np.float64), where, time=True)


def _table(parts: Sequence[_Part], schema: pa.Schema) -> _Table:
    """The parts of one kind of file, as one table."""
    columns: dict[str, np.ndarray] = {}
    for f in schema:
        if pa.types.is_struct(f.type) or f.name == "job_id":
            continue
        got = [p.columns[f.name] for p in parts]
        if not got:
            columns[f.name] = np.empty(0, dtype=object)
        elif len(got) == 1:
            columns[f.name] = got[0]
        elif all(a.dtype == np.float64 for a in got):
            columns[f.name] = np.concatenate(got)
        else:
            columns[f.name] = np.concatenate([a.astype(object) for a in got])
    counts = [p.rows for p in parts]
    starts = np.cumsum([0, *counts[:-1]], dtype=np.int64)
    nested = {f.name: _Nested([p.nested[f.name] for p in parts], starts)
              for f in schema if pa.types.is_struct(f.type)}
    job_id = pa.chunked_array([c for p in parts for c in p.job_id.chunks], pa.string())
    return _Table(columns=columns, job_id=job_id, nested=nested,
                  typed=all(p.typed for p in parts),
                  source=[str(p.path) for p in parts], rows_per_file=counts,
                  header_lines=[p.header_lines for p in parts], lines=[p.lines for p in parts])


def _data(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _script_codes(table: _Table, rows: np.ndarray) -> tuple[np.ndarray, list[Any]]:
    """A code per row of `rows` that is equal for equal scripts, and each code's script."""
    nested = table.nested["script"]
    if table.typed:
        # Equal scripts have equal codes in every leaf (and in whether each object is there).
        parts = [cast(pa.ChunkedArray, part) for part in nested.parts]
        column = pa.chunked_array([c for part in parts for c in part.chunks],
                                  parts[0].type).combine_chunks().take(pa.array(rows))
        leaves = [column.is_valid(), *_leaves(column)]
        code = np.zeros(len(rows), dtype=np.int64)
        bound = 1  # every code is below it
        for leaf in leaves:
            encoded = leaf.dictionary_encode()
            width = len(encoded.dictionary) + 1
            if bound * width > 1 << 62:
                # Renumber only when the next leaf could overflow: few scripts, few leaves.
                code = pd.factorize(code)[0].astype(np.int64)
                bound = int(code.max()) + 1
            level = encoded.indices.fill_null(width - 1).to_numpy().astype(np.int64)
            code = code * width + level
            bound *= width
        code = pd.factorize(code)[0].astype(np.int64)
    else:
        keys = [_script_key(s) for s in nested.pick(rows)]
        code = pd.factorize(pd.Series(keys, dtype=object), use_na_sentinel=False)[0]
    # Codes count up in order of first appearance, so each code's first row is ascending.
    first_rows = np.unique(code, return_index=True)[1]
    return code, nested.pick(rows[first_rows]) if len(first_rows) else []


def _leaves(array: pa.Array) -> list[pa.Array]:
    """The leaf columns of a struct array, with each nested struct's validity."""
    out: list[pa.Array] = []
    for i in range(array.type.num_fields):
        child = pc.struct_field(array, [i])
        if pa.types.is_struct(child.type):
            out.append(child.is_valid())
            out.extend(_leaves(child))
        else:
            out.append(child)
    return out


# --------------------------------------------------------------------------------------------
# The history, loaded.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What the checker takes from run.json: the configuration the oracle is built from."""

    drained: bool
    exit_reason: str
    http_timeout_seconds: float
    lease_seconds: float
    retry: RetryPolicy
    account_limits: dict[str, int | None]
    # Rows the runner's final snapshot had (None: not recorded, completeness unknown).
    final_jobs: int | None = None
    # Whether the queue's server was durable (fsync, full page writes, synchronous commit);
    # None when neither run.json nor spec.json says, which is judged as durable.
    durable: bool | None = None
    # The system under test's name (run.json `backend`), "" when not recorded.
    backend: str = ""


def _durability(raw: dict[str, Any], spec: dict[str, Any], path: Path) -> bool | None:
    """run.json's `durable`, else spec.json's `postgres.harness.durable`, else None. A value
    there that is not true, false or null is bad input: guessed, it would change what a
    server restart explains."""
    if raw.get("durable") is not None:
        if not isinstance(raw["durable"], bool):
            raise HistoryError(f"{path}: durable must be true, false or null")
        return bool(raw["durable"])
    postgres = spec.get("postgres")
    harness = postgres.get("harness") if isinstance(postgres, dict) else None
    if isinstance(harness, dict) and harness.get("durable") is not None:
        if not isinstance(harness["durable"], bool):
            raise HistoryError(f"{path.with_name(SPEC_FILE)}: postgres.harness.durable must be "
                               "true, false or null")
        return bool(harness["durable"])
    return None


def _seconds(path: Path, raw: dict[str, Any], key: str) -> float:
    """A setting of run.json that is a number of seconds (or a fraction): a JSON number
    that is finite, else bad input."""
    value = raw[key]
    number = math.nan
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer too large for a float
            number = math.inf
    if not math.isfinite(number):
        raise HistoryError(f"{path}: {key} must be a finite number, not {value!r:.40}")
    return number


# A limit no account reaches (float64 holds every integer up to it exactly).
_MAX_LIMIT = 2**53


def _run_config(path: Path, spec: dict[str, Any] | None = None) -> RunConfig:
    raw = read_json(path)
    need = ("drained", "http_timeout_seconds", "lease_seconds", "retry_base_seconds",
            "retry_cap_seconds", "retry_jitter", "account_limits")
    missing = [k for k in need if k not in raw]
    if missing:
        raise HistoryError(f"{path} lacks {', '.join(missing)}")
    if not isinstance(raw["drained"], bool):
        raise HistoryError(f"{path}: drained must be true or false")
    timeout = _seconds(path, raw, "http_timeout_seconds")
    lease = _seconds(path, raw, "lease_seconds")
    try:
        retry = RetryPolicy(
            base_seconds=_seconds(path, raw, "retry_base_seconds"),
            cap_seconds=_seconds(path, raw, "retry_cap_seconds"),
            jitter=_seconds(path, raw, "retry_jitter"),
        )
    except (TypeError, ValueError) as exc:
        raise HistoryError(f"{path}: bad retry or timing setting ({exc})") from None
    if not (timeout > 0 and lease > 0):
        raise HistoryError(f"{path}: http_timeout_seconds and lease_seconds must be positive")
    limits = raw["account_limits"]
    if not isinstance(limits, dict) or not all(
        v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_LIMIT)
        for v in limits.values()
    ):
        raise HistoryError(f"{path}: account_limits must map accounts to an integer "
                           f"(0 to 2**53) or null")
    exit_reason = raw.get("exit_reason", "completed")
    if not isinstance(exit_reason, str):
        raise HistoryError(f"{path}: exit_reason must be a string")
    final_jobs = raw.get("final_jobs")
    if final_jobs is not None and (not isinstance(final_jobs, int) or isinstance(final_jobs, bool)
                                   or final_jobs < 0):
        raise HistoryError(f"{path}: final_jobs must be a row count or null")
    return RunConfig(
        drained=raw["drained"],
        exit_reason=exit_reason,
        http_timeout_seconds=timeout,
        lease_seconds=lease,
        retry=retry,
        account_limits={str(k): v for k, v in limits.items()},
        final_jobs=final_jobs,
        durable=_durability(raw, spec or {}, path),
        backend=raw["backend"] if isinstance(raw.get("backend"), str) else "",
    )


def _file_type(path: Path) -> int | None:
    """The file type bits of what `path` leads to (symbolic links followed), None when
    nothing is there; a HistoryError when it cannot be looked at or is a broken link."""
    try:
        return stat.S_IFMT(path.stat().st_mode)
    except FileNotFoundError:
        if path.is_symlink():
            raise HistoryError(f"{path} is a symbolic link to nothing: point it at the file "
                               "or remove it") from None
        return None
    except OSError as exc:
        raise HistoryError(f"{path} cannot be read ({exc.strerror or exc})") from None


def _is_file(path: Path) -> bool:
    """Whether a history file is there: True for a regular file, False for nothing; a
    HistoryError for anything else (a directory, a FIFO, a device would block or mislead
    the reader)."""
    kind = _file_type(path)
    if kind is None:
        return False
    if kind != stat.S_IFREG:
        what = "a directory" if kind == stat.S_IFDIR else "not a regular file"
        raise HistoryError(f"{path} is {what}: a history file must be a regular file")
    return True


def _is_dir(path: Path) -> bool:
    kind = _file_type(path)
    if kind is None:
        return False
    if kind != stat.S_IFDIR:
        raise HistoryError(f"{path} is not a directory")
    return True


def _log_files(directory: Path) -> list[Path]:
    """The `*.csv` logs of a `deliveries/` or `workers/` directory (none when it is absent);
    every one must be a regular file, so that no log is skipped without a word."""
    if not _is_dir(directory):
        return []
    try:
        names = sorted(entry.name for entry in os.scandir(directory))
    except OSError as exc:
        raise HistoryError(f"{directory}/ cannot be listed ({exc.strerror or exc})") from None
    paths = [directory / name for name in names if name.endswith(LOG_SUFFIX)]
    for path in paths:
        _is_file(path)
    return paths


def _refuse_repeats(paths: Sequence[Path], what: str, kind: str) -> None:
    """A HistoryError when two of `paths` are one file or directory (the same path written
    twice, with a trailing slash, through a symbolic link or a hard link): its records
    would be judged twice, as hundreds of duplicates."""
    seen: dict[tuple[int, int], Path] = {}
    for path in paths:
        try:
            st = path.stat()
        except OSError as exc:
            raise HistoryError(f"{path} cannot be read ({exc.strerror or exc})") from None
        first = seen.setdefault((st.st_dev, st.st_ino), path)
        if first is not path:
            same = (str(path) if os.path.normpath(path) == os.path.normpath(first)
                    else f"{path} is the same {kind} as {first}")
            raise HistoryError(f"{what} given twice: {same}; give each once")


@dataclass
class _History:
    config: RunConfig
    job_ids: pd.Index  # every job an enqueue was invoked for; position = job code
    job_account: np.ndarray  # object
    job_max_attempts: np.ndarray  # int
    job_script: np.ndarray  # int: index into `scripts`
    scripts: list[tuple[Any, dict[str, Any] | None]]
    job_ack: np.ndarray  # int8: 1 ok, 0 unknown (info / no answer), -1 fail
    deliveries: pd.DataFrame
    events: pd.DataFrame  # row i's `data` is event_data's row i
    event_data: _Nested
    faults: list[dict[str, Any]]
    final: pd.DataFrame
    files: list[str]
    truncated: list[str]  # why each file cut off is: "<path> is truncated mid-line"
    cut: dict[str, str]  # each file cut off -> the kind of log it is (its file or directory)
    worker_files: int


_SCRIPT_PART_KEYS = ("behaviour", "status", "seconds")


def _script_key(script: Any) -> Any:
    """A hashable key for a script dict, cheaper than serialising it."""
    if type(script) is not dict:
        return script if script is None else repr(script)
    first = script.get("first")
    then = script.get("then")
    return (
        script.get("name"),
        script.get("times"),
        tuple(first.get(k) for k in _SCRIPT_PART_KEYS) if type(first) is dict else repr(first),
        tuple(then.get(k) for k in _SCRIPT_PART_KEYS) if type(then) is dict else repr(then),
    )


def _load(run_dirs: Sequence[Path]) -> _History:
    if not run_dirs:
        raise HistoryError("no run directory given")
    dirs = [Path(d) for d in run_dirs]
    for d in dirs:
        if not _is_dir(d):
            raise HistoryError(f"{d} is not a directory")
    _refuse_repeats(dirs, "RUN_DIR", "directory")
    main = dirs[0]
    for name in (SPEC_FILE, RUN_FILE, ENQUEUES_FILE, FINAL_JOBS_FILE):
        if not _is_file(main / name):
            raise HistoryError(f"{main / name} is missing (the first directory holds the run)")
    for name in (DELIVERIES_DIR, WORKERS_DIR):
        if not _is_dir(main / name):
            raise HistoryError(f"{main / name}/ is missing")
    for d in dirs[1:]:
        if not (_is_dir(d / DELIVERIES_DIR) or _is_dir(d / WORKERS_DIR)
                or _is_file(d / ENQUEUES_FILE)):
            raise HistoryError(f"{d} holds none of {DELIVERIES_DIR}/, {WORKERS_DIR}/, "
                               f"{ENQUEUES_FILE}")

    spec = read_json(main / SPEC_FILE)
    config = _run_config(main / RUN_FILE, spec)
    delivery_files = [p for d in dirs for p in _log_files(d / DELIVERIES_DIR)]
    if not delivery_files:
        # Every echo target writes its log's header when it starts: without one, every job
        # would look lost.
        raise HistoryError(f"{main / DELIVERIES_DIR}/ holds no delivery log (*{LOG_SUFFIX}), "
                           "nor does any other directory given: give the directory the echo "
                           "target wrote to")
    worker_files = [p for d in dirs for p in _log_files(d / WORKERS_DIR)]
    nemesis_files = [d / NEMESIS_FILE for d in dirs if _is_file(d / NEMESIS_FILE)]
    # Producers on other machines write their own enqueues.csv: merged like the rest.
    enqueue_files = [main / ENQUEUES_FILE,
                     *(d / ENQUEUES_FILE for d in dirs[1:] if _is_file(d / ENQUEUES_FILE))]
    kinds: list[tuple[str, list[Path], _Source]] = [
        (ENQUEUES_FILE, enqueue_files, _ENQUEUES),
        (DELIVERIES_DIR, delivery_files, _DELIVERIES),
        (WORKERS_DIR, worker_files, _EVENTS),
        (NEMESIS_FILE, nemesis_files, _FAULTS),
        (FINAL_JOBS_FILE, [main / FINAL_JOBS_FILE], _FINAL),
    ]
    _refuse_repeats([p for _, paths, _ in kinds for p in paths], "a log", "file")
    read = _read_parts([(p, source) for _, paths, source in kinds for p in paths])
    files = [str(main / SPEC_FILE), str(main / RUN_FILE), *(str(p.path) for p in read)]
    parts = iter(read)
    cut: dict[str, str] = {}  # file cut off -> its kind of log
    read_tables: list[_Table] = []
    for kind_name, paths, source in kinds:
        mine = [next(parts) for _ in paths]
        cut.update((str(p.path), kind_name) for p in mine if p.truncated)
        read_tables.append(_table(mine, source.shape))
    truncated = [str(p.path) + (" is empty: it was cut off before its header" if p.empty
                                else " is truncated mid-line")
                 for p in read if p.truncated]
    enq, dl, ev, nem, fin = read_tables

    # Enqueues: the job universe and each job's oracle inputs.
    enq.require_str("type", "enqueue")
    enq.require_str("job_id", "enqueue")
    types = pd.Series(enq.columns["type"], dtype=object)
    bad_type = ~types.isin(["invoke", "ok", "fail", "info"])
    if bad_type.any():
        row = int(np.flatnonzero(bad_type.to_numpy())[0])
        raise HistoryError(f"{enq.where(row)}: enqueue type {types[row]!r} is not "
                           "invoke, ok, fail or info")
    # A request without the job id header has an empty job_id, read as null: judged as an
    # unexpected delivery, not as an unreadable history.
    fin.require_str("job_id", "final job state")
    # Job ids are only compared, never read: one dictionary over every file's ids turns
    # them into codes without making a Python string per row.
    tables = (enq, dl, ev, fin)
    encoded = pa.chunked_array([c for t in tables for c in t.job_id.chunks],
                               pa.string()).dictionary_encode()
    dictionary = (encoded.chunk(0).dictionary if encoded.num_chunks
                  else pa.array([], pa.string()))
    missing = len(dictionary)
    indices = pa.chunked_array([c.indices for c in encoded.chunks], pa.int32())
    all_codes = indices.fill_null(missing).to_numpy().astype(np.int64)
    ends = np.cumsum([len(t.job_id) for t in tables])
    enq_ids, dl_ids, ev_ids, fin_ids = np.split(all_codes, ends[:-1])
    is_invoke = (types == "invoke").to_numpy()
    invoke_rows = np.flatnonzero(is_invoke)
    first = np.sort(np.unique(enq_ids[invoke_rows], return_index=True)[1])
    invoke_rows = invoke_rows[first]
    job_of_id = np.full(missing + 1, -1, dtype=np.int64)  # dictionary index -> job code
    job_of_id[enq_ids[invoke_rows]] = np.arange(len(invoke_rows))
    job_ids = pd.Index(dictionary.take(pa.array(enq_ids[invoke_rows]))
                       .to_numpy(zero_copy_only=False), dtype=object)

    def job_id_column(table: _Table, codes: np.ndarray) -> np.ndarray:
        """The job id of each row, as the job's string (one per job, shared)."""
        out = np.asarray(job_ids, dtype=object)[np.maximum(codes, 0)] if len(job_ids) else (
            np.full(len(codes), None, dtype=object))
        unknown = np.flatnonzero(codes < 0)
        if len(unknown):
            out[unknown] = table.job_id.take(pa.array(unknown)).to_numpy(zero_copy_only=False)
        return cast(np.ndarray, out)

    max_attempts_all = enq.number("max_attempts", "enqueue", required=False)[invoke_rows]
    bad_max = np.flatnonzero(~(max_attempts_all >= 1) | (max_attempts_all % 1 != 0)
                             | (max_attempts_all > _MAX_ATTEMPTS))
    if len(bad_max):
        raise HistoryError(f"{enq.where(int(invoke_rows[bad_max[0]]))}: invoke needs "
                           f"max_attempts >= 1 (a whole number, at most {_MAX_ATTEMPTS})")
    max_attempts_raw = max_attempts_all.astype(np.int64)
    script_codes, script_values = _script_codes(enq, invoke_rows)
    scripts: list[tuple[Any, dict[str, Any] | None]] = []
    for code, raw_script in enumerate(script_values):
        if raw_script is not None and not isinstance(raw_script, dict):
            at = int(np.flatnonzero(script_codes == code)[0])
            raise HistoryError(f"{enq.where(int(invoke_rows[at]))}: script is not an object")
        scripts.append((_script_key(raw_script), raw_script))
    # Answers: ok beats info beats fail (an info that later turned out ok is ok).
    answer_rows = np.flatnonzero(~is_invoke)
    answer_codes = job_of_id[enq_ids[answer_rows]]
    if (answer_codes < 0).any():
        row = int(answer_rows[np.flatnonzero(answer_codes < 0)[0]])
        job_id = enq.job_id.take(pa.array([row]))[0].as_py()
        raise HistoryError(f"{enq.where(row)}: {types[row]} for job {job_id} without an invoke")
    job_ack = np.zeros(len(job_ids), dtype=np.int8)
    answer_types = types.to_numpy()[answer_rows]
    fail_codes = answer_codes[answer_types == "fail"]
    ok_codes = answer_codes[answer_types == "ok"]
    info_codes = answer_codes[answer_types == "info"]
    job_ack[fail_codes] = -1
    job_ack[info_codes] = 0
    job_ack[ok_codes] = 1
    job_account = enq.columns["account"][invoke_rows]
    del enq

    # Deliveries, merged over every target of every directory.
    dl_jobs = job_of_id[dl_ids]
    deliveries = pd.DataFrame({
        "job": dl_jobs,
        "job_id": pd.Series(job_id_column(dl, dl_jobs), dtype=object),
        "attempt": dl.number("attempt", "delivery", required=False),
        "account": pd.Series(dl.columns["account"], dtype=object),
        "worker": pd.Series(dl.columns["worker"], dtype=object),
        "target": pd.Series(dl.columns["target"], dtype=object),
        "received": dl.number("received", "delivery", required=True, time=True),
        "answered": dl.number("answered", "delivery", required=False, time=True),
        "status": dl.number("status", "delivery", required=False),
        "behaviour": pd.Series(dl.columns["behaviour"], dtype=object),
    })
    # The target writes a delivery's answer time and status together, or neither (never
    # answered): one without the other is damage, and judging it would guess.
    no_status = np.isnan(deliveries["status"].to_numpy())
    half_answered = np.flatnonzero(np.isnan(deliveries["answered"].to_numpy()) != no_status)
    if len(half_answered):
        row = int(half_answered[0])
        has = "an answer time" if no_status[row] else "a status"
        raise HistoryError(f"{dl.where(row)}: delivery has {has} but not the other (the "
                           "target writes both or neither): the log is damaged")
    del dl

    # Worker events, merged over every worker of every directory. Only writes need a field
    # of `data` for every row; the rest is read for the few events that explain something.
    ev.require_str("kind", "worker event")
    known_kind = pd.Series(ev.columns["kind"], dtype=object).isin(get_args(WorkerEventKind))
    if not known_kind.all():
        row = int(np.flatnonzero(~known_kind.to_numpy())[0])
        raise HistoryError(f"{ev.where(row)}: unknown worker event kind "
                           f"{ev.columns['kind'][row]!r}")
    result = np.full(len(ev.columns["kind"]), None, dtype=object)
    # Few distinct kinds: as a categorical, the judge's comparisons on it are cheap.
    kind = pd.Categorical(pd.Series(ev.columns["kind"], dtype=object))
    # The results the judge reads: a write's, and a release's (an applied release gave its
    # attempt back).
    writes = np.flatnonzero((kind == "write") | (kind == "release"))
    result[writes] = ev.nested["data"].field("result", writes)
    events = pd.DataFrame({
        "kind": kind,
        "worker": pd.Series(ev.columns["worker"], dtype=object),
        "time": ev.number("time", "worker event", required=True, time=True),
        "job": job_of_id[ev_ids],
        "attempt": ev.number("attempt", "worker event", required=False),
        "result": pd.Series(result, dtype=object),
    })
    event_data = ev.nested["data"]
    _refuse_bad_times(ev, event_data, ("end", "started"), "worker event")
    del ev

    # Faults: optional; every directory may hold some.
    faults: list[dict[str, Any]] = []
    if len(nem.columns["fault"]):
        starts = nem.number("start", "fault", required=True, time=True)
        ends = nem.number("end", "fault", required=False, time=True)
        attempts = nem.number("attempt", "fault", required=False)
        for row, kind in enumerate(nem.columns["fault"]):
            if not isinstance(kind, str) or kind not in _KNOWN_FAULTS:
                raise HistoryError(f"{nem.where(row)}: unknown fault kind {kind!r}")
            faults.append({
                "fault": kind,
                "start": float(starts[row]),
                "end": None if math.isnan(ends[row]) else float(ends[row]),
                "target": nem.columns["target"][row],
                "job_id": nem.job_id[row].as_py(),
                "attempt": None if math.isnan(attempts[row]) else int(attempts[row]),
                "skipped": nem.columns["skipped"][row],
            })

    # Final states.
    fin.require_str("status", "final job state")
    fin_jobs = job_of_id[fin_ids]
    statuses = pd.Series(pd.Categorical(pd.Series(fin.columns["status"], dtype=object)))
    known_status = statuses.isin([s.value for s in JobStatus])
    if not known_status.all():
        row = int(np.flatnonzero(~known_status.to_numpy())[0])
        raise HistoryError(f"{fin.where(row)}: unknown job status {statuses[row]!r}")
    final = pd.DataFrame({
        "job": fin_jobs,
        "job_id": pd.Series(job_id_column(fin, fin_jobs), dtype=object),
        "status": statuses,
    })
    del fin

    return _History(
        config=config,
        job_ids=job_ids,
        job_account=job_account,
        job_max_attempts=max_attempts_raw,
        job_script=np.asarray(script_codes, dtype=np.int64),
        scripts=scripts,
        job_ack=job_ack,
        deliveries=deliveries,
        events=events,
        faults=faults,
        final=final,
        event_data=event_data,
        files=files,
        truncated=truncated,
        cut=cut,
        worker_files=len(worker_files),
    )


# --------------------------------------------------------------------------------------------
# Explanations: the recorded events that make a redelivery legitimate.
# --------------------------------------------------------------------------------------------


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows as dicts of plain Python values (much faster than DataFrame.to_dict)."""
    names = [str(c) for c in frame.columns]
    values = [frame[c].tolist() for c in frame.columns]
    return [dict(zip(names, row, strict=True)) for row in zip(*values, strict=True)]


def _fmt(seconds: float) -> str:
    return f"{seconds:.3f}"


_DATA_FIELDS = ("name", "lost", "error", "reason", "outcome", "started", "end")


def _with_data(rec: dict[str, Any], value: Any) -> dict[str, Any]:
    """An event record with the fields of its `data` (`value`) the explanations read."""
    data = _data(value)
    for key in _DATA_FIELDS:
        rec[key] = data.get(key)
    if rec.get("result") is None:
        rec["result"] = data.get("result")
    return rec


@dataclass(frozen=True)
class _Why:
    """Why a redelivery is legitimate. `fault` is True for a recorded fault (a redelivery it
    causes may come on top of `max_attempts`), False for an HTTP timeout (the timed-out
    attempt used one of them)."""

    text: str
    fault: bool


def _fault_end(fault: dict[str, Any]) -> float:
    end = fault["end"]
    if end is not None:
        return float(end)
    return math.inf if fault["fault"] in _LASTING_FAULTS else float(fault["start"])


def _fault_span(fault: dict[str, Any]) -> str:
    start, end = float(fault["start"]), _fault_end(fault)
    return _fmt(start) + ("" if end == start else "-" + _fmt(end))


class _Explainer:
    """Looks up, for one delivery, a recorded event that overlaps its attempt.

    A fault explains a redelivery only inside the earlier attempt's window: from its claim
    (or delivery) to the first of the next delivery, its applied result write and the end
    of its lease (claim and renewal times plus the configured lease), give or take the
    tolerance. Once an attempt's success is applied, nothing explains running it again but
    a restart of a server that is not durable (a committed write may be lost)."""

    def __init__(self, history: _History, jobs: np.ndarray, tolerance: float) -> None:
        self.cfg = history.config
        self.tol = tolerance
        self.durable = history.config.durable is not False
        self.faults = [f for f in history.faults if not f.get("skipped")]
        ev = history.events
        subset = ev[ev["job"].isin(jobs)] if len(jobs) else ev.iloc[:0]
        self.by_attempt: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
        self.attempts_of: dict[int, set[int]] = defaultdict(set)
        data = history.event_data
        for rec, value in zip(_records(subset), data.pick(subset.index.to_numpy()), strict=True):
            if not math.isnan(rec["attempt"]):
                key = (int(rec["job"]), int(rec["attempt"]))
                self.by_attempt[key].append(_with_data(rec, value))
                self.attempts_of[key[0]].add(key[1])
        # Worker-wide deaths: a failpoint or an error stop ends every lease the worker held.
        self.deaths: dict[str, list[dict[str, Any]]] = defaultdict(list)
        ends = ev[ev["kind"].isin(["failpoint", "stop"])]
        for rec, value in zip(_records(ends), data.pick(ends.index.to_numpy()), strict=True):
            rec = _with_data(rec, value)
            if rec["kind"] == "failpoint" or str(rec["reason"]).startswith("error"):
                self.deaths[str(rec["worker"])].append(rec)

    def _events(self, job: int, attempt: float) -> list[dict[str, Any]]:
        if math.isnan(attempt):
            return []
        return self.by_attempt.get((job, int(attempt)), [])

    def worker_of(self, job: int, attempt: float, header: Any) -> str | None:
        if isinstance(header, str) and header:
            return header
        for rec in self._events(job, attempt):
            if rec["kind"] == "claim":
                return str(rec["worker"])
        return None

    def claimed_at(self, job: int, attempt: float, received: float) -> float:
        """When the attempt was claimed (the delivery time when no claim was recorded)."""
        times = [float(r["time"]) for r in self._events(job, attempt) if r["kind"] == "claim"]
        return min([received, *times])

    def lease_end(self, job: int, attempt: float, received: float) -> float:
        """When the lease of this attempt ran out: the configured lease from its last claim
        or renewal the worker recorded (from the delivery when none was). The lease end the
        queue reported is not used: a queue that hands out short leases must not excuse
        itself with them."""
        times = [float(r["time"]) for r in self._events(job, attempt)
                 if r["kind"] == "claim" or (r["kind"] == "renew" and not r["lost"])]
        return (max(times) if times else received) + self.cfg.lease_seconds

    def gave_up(self, job: int, attempt: float, received: float) -> float:
        """When the worker gave up on a call that timed out: the end its http event
        recorded, else the delivery time plus the timeout."""
        ends = [float(r["end"]) for r in self._events(job, attempt)
                if r["kind"] == "http" and isinstance(r["end"], int | float)
                and not isinstance(r["end"], bool) and not math.isnan(r["end"])]
        fallback = received + self.cfg.http_timeout_seconds
        return max(received, min(ends)) if ends else fallback

    def applied_write(self, job: int, attempt: float) -> dict[str, Any] | None:
        """The attempt's first applied result write, if any."""
        applied = [r for r in self._events(job, attempt)
                   if r["kind"] == "write" and r["result"] == "applied"]
        return min(applied, key=lambda r: float(r["time"])) if applied else None

    def has_applied_write(self, job: int, attempt: float) -> bool:
        return self.applied_write(job, attempt) is not None

    def explain(self, d: dict[str, Any], until: float, *, timeouts: bool = True) -> _Why | None:
        """Why the attempt that made delivery `d` may be executed again at `until` (the next
        delivery; inf when there is none), or None. `timeouts` False leaves out HTTP timeouts
        (the caller judges those by time)."""
        job = int(d["job"])
        attempt = float(d["attempt"])
        label = _label(attempt)
        applied = self.applied_write(job, attempt)
        if (applied is not None and applied["outcome"] in (None, "success")
                and float(applied["time"]) <= until):
            # The success was committed before the redelivery.
            lost = self._lost_commit(float(applied["time"]), until)
            return None if lost is None else _Why(
                f"{lost} after the result of attempt {label} was applied", True)
        fault = self._fault(d, until, applied)
        if fault is not None:
            return _Why(fault, True)
        if timeouts:
            timeout = self._timeout(d, until)
            if timeout is not None:
                return _Why(timeout, False)
        return None

    def _timeout(self, d: dict[str, Any], until: float) -> str | None:
        """The worker gave up on the call: the target answered past the timeout, or the
        worker recorded a timeout or a lost connection for the attempt."""
        timeout = self.cfg.http_timeout_seconds
        answered = d["answered"]
        label = _label(d["attempt"])
        if (not math.isnan(answered)
                and answered - d["received"] >= timeout - self.tol
                and until >= d["received"] + timeout - self.tol):
            return (f"HTTP timeout: the target answered attempt {label} after "
                    f"{answered - d['received']:.2f}s, past the {timeout:g}s timeout")
        for rec in self._events(int(d["job"]), float(d["attempt"])):
            if (rec["kind"] == "http" and rec["result"] in ("timeout", "connection_error")
                    and until >= float(rec["time"]) - self.tol):
                return (f"worker {rec['worker']} recorded an HTTP {rec['result']} "
                        f"for attempt {label}")
        return None

    def _lost_commit(self, written: float, until: float) -> str | None:
        """A restart of a server that is not durable between a commit and `until`."""
        if self.durable:
            return None
        for fault in self.faults:
            if (fault["fault"] == "restart_postgres" and fault["start"] <= until + self.tol
                    and _fault_end(fault) >= written - self.tol):
                return (f"restart_postgres of a server that is not durable at "
                        f"{_fault_span(fault)}")
        return None

    def _fault(self, d: dict[str, Any], until: float,
               applied: dict[str, Any] | None) -> str | None:
        job = int(d["job"])
        attempt = float(d["attempt"])
        label = _label(attempt)
        for rec in self._events(job, attempt):
            if rec["kind"] == "write" and rec["result"] == "info":
                error = f" ({rec['error']})" if rec["error"] else ""
                return (f"connection lost during the result write of attempt {label} "
                        f"by {rec['worker']}{error}")
            if rec["kind"] == "failpoint":
                return (f"failpoint {rec['name']} fired in {rec['worker']} at "
                        f"{_fmt(rec['time'])} for attempt {label}")
        received = float(d["received"])
        lo = self.claimed_at(job, attempt, received) - self.tol
        close = min(until, self.lease_end(job, attempt, received))
        if applied is not None:
            close = min(close, float(applied["time"]))
        hi = close + self.tol
        worker = self.worker_of(job, attempt, d["worker"])
        if worker is not None:
            for rec in self.deaths.get(worker, ()):
                if lo <= rec["time"] <= hi:
                    what = (f"failpoint {rec['name']}" if rec["kind"] == "failpoint"
                            else f"error stop ({rec['reason']})")
                    return (f"{what} ended {worker} at {_fmt(rec['time'])} while it held "
                            f"attempt {label}")
        for fault in self.faults:
            kind = fault["fault"]
            top = hi
            if kind == "restart_postgres" and not self.durable:
                top = until + self.tol  # it may lose what was committed before it
            if not (fault["start"] <= top and _fault_end(fault) >= lo):
                continue
            hits = False
            if kind in _WORKER_FAULTS:
                hits = (worker is not None and fault["target"] == worker) or (
                    fault["job_id"] == d["job_id"]
                    and (fault["attempt"] is None or str(fault["attempt"]) == label)
                )
            elif kind in _DATABASE_FAULTS:
                hits = True
            elif kind in _TARGET_FAULTS:
                hits = fault["target"] in (None, d["target"])
            if hits:
                target = fault["target"] or "the run"
                return f"{kind} on {target} at {_fault_span(fault)} overlaps attempt {label}"
        return None

    def late_success(self, d: dict[str, Any]) -> str | None:
        """Why a worker may have taken a 2xx answered after its HTTP timeout: the worker was
        paused during the call, so its timer could not fire before the answer was read."""
        worker = self.worker_of(int(d["job"]), float(d["attempt"]), d["worker"])
        lo, hi = float(d["received"]) - self.tol, float(d["answered"]) + self.tol
        for fault in self.faults:
            if (fault["fault"] == "pause_worker" and worker is not None
                    and fault["target"] == worker
                    and fault["start"] <= hi and _fault_end(fault) >= lo):
                return (f"pause_worker on {worker} at {_fault_span(fault)} overlaps the call "
                        f"of attempt {_label(d['attempt'])}")
        return None

    def unreached(self, job: int, delivered: np.ndarray, max_attempts: int) -> list[int] | None:
        """The attempts of a dead-lettered job that never reached the target: its worker
        recorded an HTTP timeout or connection error for the attempt, and no delivery
        (`delivered`: the attempt headers of the job's deliveries) is of that attempt.
        Returned only when, with the attempts the target did see, they are exactly the
        attempts 1 to `max_attempts`: a correct queue spends them all before it gives up on
        a transient failure, so a job short of more than these was still given up on early,
        and attempt numbers outside them are a queue that numbers wrongly. None as well when
        a delivery has no attempt header to match (it may be one of those attempts)."""
        if not (delivered == np.round(delivered)).all():  # NaN: no header
            return None
        reached = set(delivered.astype(np.int64).tolist())
        unreached = sorted(
            a for a in self.attempts_of.get(job, ()) if a not in reached and any(
                r["kind"] == "http" and r["result"] in ("timeout", "connection_error")
                for r in self.by_attempt[(job, a)]))
        if unreached and reached.union(unreached) == set(range(1, max_attempts + 1)):
            return unreached
        return None

    def ran_normally(self, job: int, attempt: float) -> bool:
        """Whether the attempt was claimed once, answered by the target and its result
        written: it ran as its script says, whatever fault was about, so it is one of the
        deliveries the oracle counts, never one a fault took away."""
        if math.isnan(attempt):
            return False
        events = self.by_attempt.get((job, int(attempt)), ())
        return (sum(r["kind"] == "claim" for r in events) == 1
                and any(r["kind"] == "http" and r["result"] in ("ok", "http_error")
                        for r in events)
                and any(r["kind"] == "write" and r["result"] == "applied" for r in events))

    def fault_touched(self, job: int, job_id: str, max_attempts: int) -> str | None:
        """A recorded fault that hit one of this job's attempts without a delivery to show
        for it (a crash after claim, a kill before the call), inside that attempt's lease
        and before its result was applied."""
        for attempt in sorted(self.attempts_of.get(job, ())):
            events = self.by_attempt[(job, attempt)]
            for rec in events:
                if rec["kind"] == "failpoint":
                    return f"failpoint {rec['name']} fired for attempt {attempt}"
                if rec["kind"] == "write" and rec["result"] == "info":
                    return f"the result write of attempt {attempt} was lost with its connection"
            claims = [r for r in events if r["kind"] == "claim"]
            if not claims:
                continue
            if len(claims) == 1 and any(r["kind"] == "release" and r["result"] == "applied"
                                        for r in events):
                # Given back unexecuted: it used up no attempt, so no fault that hit it can
                # explain an attempt the job is missing.
                continue
            if self.ran_normally(job, attempt):
                continue
            worker = str(claims[0]["worker"])
            start = min(float(r["time"]) for r in claims)
            close = self.lease_end(job, float(attempt), start)
            applied = self.applied_write(job, float(attempt))
            if applied is not None:
                close = min(close, float(applied["time"]))
            lo, hi = start - self.tol, close + self.tol
            for death in self.deaths.get(worker, ()):
                if lo <= death["time"] <= hi:
                    return f"{worker} died while it held attempt {attempt}"
            for fault in self.faults:
                kind = fault["fault"]
                hits = (kind in _WORKER_FAULTS and fault["target"] == worker) or (
                    kind in _DATABASE_FAULTS)
                if hits and fault["start"] <= hi and _fault_end(fault) >= lo:
                    return f"{kind} at {_fault_span(fault)} overlaps attempt {attempt}"
            # A call that timed out or could not connect while the target was hung or down:
            # the fault, not the queue, used up this attempt (the target may not have
            # recorded it at all). The call lies between the claim (`lo`) and its end.
            for rec in events:
                if rec["kind"] != "http" or rec["result"] not in ("timeout", "connection_error"):
                    continue
                for fault in self.faults:
                    if (fault["fault"] in _TARGET_FAULTS
                            and fault["start"] <= float(rec["end"]) + self.tol
                            and _fault_end(fault) >= lo):
                        return (f"{fault['fault']} on {fault['target'] or 'the target'} at "
                                f"{_fault_span(fault)} overlaps the failed call of attempt "
                                f"{attempt}")
        unlogged = self._unlogged_claim(job, max_attempts)
        if unlogged is not None:
            return unlogged
        for fault in self.faults:
            if fault["job_id"] == job_id:
                return f"{fault['fault']} hit attempt {fault['attempt']}"
        return None

    def _unlogged_claim(self, job: int, max_attempts: int) -> str | None:
        """An attempt that left no event at all, with a worker killed in the gap where it
        belongs: a claim commits before its worker logs it, so a SIGKILL in between leaves an
        attempt the history cannot see (recovered later, it still used up the attempt). The
        gap runs from the last event of the attempt before to the claim of the attempt
        after; for an attempt after the last one seen, to when it was due at the latest
        (the longest retry wait, plus slack for the claim to come round)."""
        seen = self.attempts_of.get(job, set())
        if not seen:
            return None
        first_claim: dict[int, float] = {}
        last_event: dict[int, float] = {}
        for number in seen:
            times = [float(r["time"]) for r in self.by_attempt[(job, number)]]
            claims = [float(r["time"]) for r in self.by_attempt[(job, number)]
                      if r["kind"] == "claim"]
            first_claim[number] = min(claims or times)
            last_event[number] = max(times)
        for missing in sorted(set(range(1, max(max(seen), max_attempts) + 1)) - seen):
            before = [n for n in seen if n < missing]
            after = [n for n in seen if n > missing]
            lo = (last_event[max(before)] if before else -math.inf) - self.tol
            hi = (first_claim[min(after)] if after else
                  lo + self.cfg.retry.cap_seconds + TRAILING_CLAIM_SLACK_SECONDS) + self.tol
            for fault in self.faults:
                if fault["fault"] == "kill_worker" and lo <= fault["start"] <= hi:
                    return (f"attempt {missing} left no event, and kill_worker on "
                            f"{fault['target']} at {_fmt(fault['start'])} may have ended the "
                            "worker between committing its claim and logging it")
            for worker, deaths in self.deaths.items():
                for death in deaths:
                    if lo <= float(death["time"]) <= hi:
                        return (f"attempt {missing} left no event, and {worker} died at "
                                f"{_fmt(death['time'])}, where that claim belongs")
        return None


# --------------------------------------------------------------------------------------------
# Judging.
# --------------------------------------------------------------------------------------------


class _Findings:
    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(COUNT_KEYS, 0)
        self.examples: dict[str, list[dict[str, Any]]] = {k: [] for k in EXAMPLE_KINDS}

    def add(self, kind: str, job_id: Any, why: str) -> None:
        self.counts[kind] += 1
        if len(self.examples[kind]) < MAX_EXAMPLES:
            self.examples[kind].append({"job_id": str(job_id), "why": why})


_SUCCESS = 0
_TRANSIENT = 1
_PERMANENT = 2


def _judge(h: _History, tolerance: float) -> tuple[_Findings, list[str], dict[str, Any]]:
    cfg = h.config
    timeout = cfg.http_timeout_seconds
    found = _Findings()
    unknown: list[str] = []
    details: dict[str, Any] = {}
    n_jobs = len(h.job_ids)

    # Oracles, one per distinct (script, max_attempts).
    cache = OracleCache(timeout)
    expected_completed = np.zeros(n_jobs, dtype=bool)
    # Deliveries a fault-free correct run makes: a job dead-lettered with fewer was given up
    # on early (unless a fault used up its attempts).
    expected_deliveries = np.zeros(n_jobs, dtype=np.int64)
    pairs = pd.DataFrame({"s": h.job_script, "m": h.job_max_attempts})
    for group, idx in pairs.groupby(["s", "m"], sort=False).indices.items():
        s, m = cast(tuple[int, int], group)
        key, raw = h.scripts[int(s)]
        try:
            script = script_from_payload(raw)
        except (KeyError, ValueError, TypeError, OverflowError) as exc:
            job_id = h.job_ids[int(idx[0])]
            raise HistoryError(f"enqueue of job {job_id}: unreadable script ({exc})") from None
        oracle = cache.get(repr(key), script, int(m))
        expected_completed[idx] = oracle.expected is Expected.COMPLETED
        expected_deliveries[idx] = oracle.deliveries

    # ---- deliveries -------------------------------------------------------------------------
    d = h.deliveries
    found.counts["delivered"] = len(d)
    unknown_job = d["job"].to_numpy() < 0
    acked = h.job_ack
    failed_enqueue = np.zeros(len(d), dtype=bool)
    known = ~unknown_job
    failed_enqueue[known] = acked[d["job"].to_numpy()[known]] == -1
    for rec in _records(d[unknown_job | failed_enqueue]):
        if not rec["job_id"]:
            found.add("unexpected", "", f"a request without a job id header at "
                      f"{_fmt(rec['received'])} (target {rec['target']})")
            continue
        what = ("delivered but never enqueued" if rec["job"] < 0
                else "delivered although its enqueue failed")
        found.add("unexpected", rec["job_id"], f"{what} (target {rec['target']})")
    d = d[~unknown_job & ~failed_enqueue]
    d = d.sort_values(["job", "received"], kind="stable").reset_index(drop=True)

    job = d["job"].to_numpy()
    received = d["received"].to_numpy()
    answered = d["answered"].to_numpy()
    status = d["status"].to_numpy()
    attempt = d["attempt"].to_numpy()
    behaviour = d["behaviour"].to_numpy()
    duration = answered - received
    is_answered = ~np.isnan(answered)
    late = is_answered & (duration >= timeout - tolerance)
    in_time = is_answered & ~late
    success_2xx = (status >= 200) & (status < 300)
    transient_status = (status >= 500) | (status == 408) | (status == 429)
    seen = np.where(~in_time, _TRANSIENT,
                    np.where(success_2xx, _SUCCESS,
                             np.where(transient_status, _TRANSIENT, _PERMANENT)))
    hang_forever = behaviour == "hang_forever"
    # In flight at the target: until answered; a request never answered was held until the
    # client left (a hang) or not at all (a reset).
    target_end = np.where(is_answered, answered,
                          np.where(hang_forever, received + timeout, received))
    grouped = pd.Series(job).groupby(job, sort=False)
    position = grouped.cumcount().to_numpy() + 1
    first_of_job = position == 1
    nxt = np.arange(len(d)) + 1
    same_next = np.zeros(len(d), dtype=bool)
    if len(d) > 1:
        same_next[:-1] = job[1:] == job[:-1]
    next_received = np.full(len(d), np.inf)
    next_received[same_next] = received[nxt[same_next]]

    candidates_jobs: set[int] = set()
    success_rank = pd.Series(success_2xx.astype(np.int64)).groupby(job, sort=False).cumsum()
    dup_rows = np.flatnonzero(success_2xx & (success_rank.to_numpy() >= 2))
    prev_max_end = pd.Series(target_end).groupby(job, sort=False).cummax().to_numpy()
    prev_max_end = np.where(first_of_job, -np.inf, np.roll(prev_max_end, 1))
    conc_rows = np.flatnonzero(received < prev_max_end)
    # Early retries: the delivery after one the worker saw fail transiently. The failed
    # attempt's number is the target's own count (the header is the queue's word; it is
    # used only where an explained redelivery precedes, see below).
    n_for_policy = position.astype(np.int64)
    # The policy itself decides each bound (a few distinct attempt numbers, looked up).
    numbers = np.unique(n_for_policy)
    bounds = np.array([cfg.retry.min_delay(int(n)) for n in numbers], dtype=np.float64)
    min_delay = bounds[np.searchsorted(numbers, n_for_policy)] if len(numbers) else (
        np.zeros(0))
    timed_out = ~in_time & (late | hang_forever)
    fail_seen = np.where(in_time, answered,
                         np.where(timed_out, received + timeout - tolerance, received))
    # The worker's own end of a timed-out call, when it recorded one: its timer started
    # before the target saw the request, so the failure may predate received + timeout.
    ask = np.flatnonzero(timed_out & same_next)
    if len(ask):
        ends = _http_ends(h, job[ask], attempt[ask])
        has = ~np.isnan(ends)
        fail_seen[ask[has]] = np.maximum(ends[has], received[ask[has]])
    gap_ok = next_received >= fail_seen + min_delay - tolerance
    early_prev_rows = np.flatnonzero(same_next & (seen == _TRANSIENT) & ~gap_ok)
    # A delivery after one the worker saw fail permanently.
    perm_rank = pd.Series((seen == _PERMANENT).astype(np.int64)).groupby(
        job, sort=False).cumsum().to_numpy()
    after_perm_rows = np.flatnonzero((perm_rank - (seen == _PERMANENT)) >= 1)
    for rows in (dup_rows, conc_rows, early_prev_rows, after_perm_rows):
        candidates_jobs.update(job[rows].tolist())

    # Per-job facts.
    delivered_per_job = np.bincount(job, minlength=n_jobs)
    any_2xx = np.zeros(n_jobs, dtype=bool)
    any_2xx[job[success_2xx]] = True
    in_time_2xx = np.zeros(n_jobs, dtype=bool)
    in_time_2xx[job[success_2xx & in_time]] = True
    # A 2xx a worker could have seen: answered before its timeout, give or take the
    # tolerance. A COMPLETED job needs one.
    visible_2xx = np.zeros(n_jobs, dtype=bool)
    visible_2xx[job[success_2xx & is_answered & (duration < timeout + tolerance)]] = True

    # Final states.
    f = h.final
    # Whether the snapshot holds every row the runner took (None: run.json does not say).
    snapshot_complete = None if cfg.final_jobs is None else cfg.final_jobs == len(f)
    if snapshot_complete is False:
        unknown.append(f"final snapshot incomplete: run.json says {cfg.final_jobs} rows, "
                       f"{FINAL_JOBS_FILE} has {len(f)}")
    unknown_final = f["job"].to_numpy() < 0
    final_status = np.full(n_jobs, "", dtype=object)
    fin_known = f[~unknown_final]
    final_status[fin_known["job"].to_numpy()] = fin_known["status"].to_numpy()
    found.counts["completed"] = int((f["status"] == JobStatus.COMPLETED.value).sum())
    found.counts["failed"] = int((f["status"] == JobStatus.FAILED.value).sum())
    for rec in _records(f[unknown_final].head(MAX_EXAMPLES)):
        unknown.append(f"final state for job {rec['job_id']}, which was never enqueued")
    is_completed = final_status == JobStatus.COMPLETED.value
    is_failed = final_status == JobStatus.FAILED.value
    is_missing = final_status == ""
    is_live = ~(is_completed | is_failed | is_missing)
    exists = (acked == 1) | ~is_missing  # acknowledged, or the queue shows the row

    # Jobs whose final state needs a closer look.
    completed_no_2xx = is_completed & ~any_2xx
    completed_late = is_completed & any_2xx & ~visible_2xx
    failed_with_2xx = is_failed & in_time_2xx
    failed_vs_oracle = is_failed & expected_completed & ~in_time_2xx
    # Dead-lettered as its oracle says, but before the deliveries the oracle requires.
    failed_early = is_failed & ~expected_completed & (delivered_per_job < expected_deliveries)
    # A job its oracle dead-letters and the queue dead-lettered is not lost.
    lost_candidate = (acked == 1) & ~any_2xx & ~is_live & ~(is_failed & ~expected_completed)
    absent_2xx = is_missing & (acked == 1) & any_2xx
    for mask in (completed_no_2xx, completed_late, failed_with_2xx, failed_vs_oracle,
                 failed_early, lost_candidate):
        candidates_jobs.update(np.flatnonzero(mask).tolist())

    # Stale writes: an applied write for attempt n after a claim of a later attempt.
    ev = h.events
    ev_known = ev[ev["job"] >= 0]
    claims = ev_known[ev_known["kind"] == "claim"]
    applied = ev_known[(ev_known["kind"] == "write") & (ev_known["result"] == "applied")]
    max_claim = np.full(n_jobs, -np.inf)
    if len(claims):
        per_job = claims.groupby("job")["attempt"].max()
        max_claim[per_job.index.to_numpy()] = per_job.to_numpy()
    stale_candidates = applied[applied["attempt"].to_numpy()
                               < max_claim[applied["job"].to_numpy()]]

    explainer = _Explainer(h, np.array(sorted(candidates_jobs), dtype=np.int64), tolerance)
    cand_mask = np.isin(job, np.array(sorted(candidates_jobs), dtype=np.int64))
    rows_of = d[cand_mask]
    records: dict[int, dict[str, Any]] = {
        int(i): r for i, r in zip(rows_of.index, _records(rows_of), strict=True)
    }
    job_rows: dict[int, list[int]] = defaultdict(list)
    for i in records:
        job_rows[int(job[i])].append(i)

    # Redeliveries a recorded fault explains: each may come on top of max_attempts (an HTTP
    # timeout explains a repeated 2xx, but the timed-out attempt still used an attempt).
    explained_extra: dict[int, int] = defaultdict(int)
    extra_rows: set[int] = set()
    fault_reason: dict[int, str] = {}

    def allow(j: int, i: int, why: _Why) -> None:
        if i not in extra_rows:
            explained_extra[j] += 1
            extra_rows.add(i)
        fault_reason.setdefault(j, why.text)

    # Duplicates: every 2xx after the first; explained by an event on the earlier success.
    success_rows_by_job: dict[int, list[int]] = defaultdict(list)
    for i in sorted(records):
        if success_2xx[i]:
            success_rows_by_job[int(job[i])].append(i)
    for i in dup_rows.tolist():
        j = int(job[i])
        earlier = [r for r in success_rows_by_job[j] if r < i][-1]
        dup_why = explainer.explain(records[earlier], float(received[i]))
        job_id = h.job_ids[j]
        if dup_why is None:
            found.add("duplicate_unexplained", job_id,
                      f"2xx delivered again at {_fmt(received[i])} (attempt "
                      f"{_label(attempt[i])} by {records[i]['worker']}) after attempt "
                      f"{_label(attempt[earlier])} by {records[earlier]['worker']} succeeded "
                      f"at {_fmt(received[earlier])}; nothing recorded explains it")
        else:
            if dup_why.fault:
                allow(j, int(i), dup_why)
            found.add("duplicate_explained", job_id, dup_why.text)

    # Concurrent deliveries: overlapping an earlier one still in flight at the target.
    for i in conc_rows.tolist():
        j = int(job[i])
        overlapping = [r for r in job_rows[j] if r < i and target_end[r] > received[i]]
        faults: list[_Why] = []
        for r in overlapping:
            fault = explainer.explain(records[r], float(received[i]), timeouts=False)
            if fault is not None:
                faults.append(fault)
                continue
            if ((late[r] or (hang_forever[r] and not is_answered[r]))
                    and received[i] >= explainer.gave_up(j, float(attempt[r]),
                                                         float(received[r])) - tolerance):
                continue  # abandoned at its HTTP timeout
            if received[i] >= explainer.lease_end(j, float(attempt[r]),
                                                  float(received[r])) - tolerance:
                continue  # its lease had expired
            found.add("concurrent_delivery", h.job_ids[j],
                      f"delivery at {_fmt(received[i])} (attempt {_label(attempt[i])}) "
                      f"while attempt {_label(attempt[r])} from {_fmt(received[r])} "
                      "was still in flight with its lease held")
            break
        else:
            if faults:
                allow(j, int(i), faults[0])

    # Early retries.
    for p in early_prev_rows.tolist():
        j = int(job[p])
        i = p + 1
        if received[i] >= explainer.lease_end(j, float(attempt[p]), float(received[p])) \
                - tolerance and not explainer.has_applied_write(j, float(attempt[p])):
            continue  # the lease expired: recovery makes the job due at once
        bound = float(min_delay[p])
        # Redeliveries a fault explains (up to this one) may not have counted as attempts.
        prior = sum(1 for r in job_rows[j] if r <= p and not first_of_job[r] and (
            r in extra_rows
            or explainer.explain(records[r - 1], float(received[r]), timeouts=False)
            is not None))
        if prior:
            # Then the attempt header (or, without one, the count less them) numbers it.
            n = (int(position[p]) - prior if math.isnan(attempt[p])
                 else min(int(position[p]), int(attempt[p])))
            bound = cfg.retry.min_delay(max(n, 1))
            if received[i] >= fail_seen[p] + bound - tolerance:
                continue
        # Nothing else excuses it: a timeout or a fault is still a transient failure whose
        # write sets the backoff, and without that write the lease holds the job.
        gap = received[i] - fail_seen[p]
        found.add("early_retry", h.job_ids[j],
                  f"retry at {_fmt(received[i])} came {gap:.3f}s after attempt "
                  f"{_label(attempt[p])} failed; the backoff allows no less than "
                  f"{bound:.3f}s")

    # Attempts: beyond max_attempts (fault-explained redeliveries aside), or after a
    # permanent failure.
    over = np.flatnonzero(delivered_per_job > h.job_max_attempts)
    exceeded: dict[int, str] = {}
    for j in over.tolist():
        extra = explained_extra.get(j, 0)
        count = int(delivered_per_job[j])
        if count - extra > h.job_max_attempts[j]:
            exceeded[j] = (f"{count} deliveries ({extra} explained by faults) for "
                           f"max_attempts {h.job_max_attempts[j]}")
    for i in after_perm_rows.tolist():
        j = int(job[i])
        if j in exceeded:
            continue
        perm = [r for r in job_rows[j] if r < i and seen[r] == _PERMANENT][-1]
        if explainer.explain(records[perm], float(received[i])) is None:
            exceeded[j] = (f"delivered again at {_fmt(received[i])} after attempt "
                           f"{_label(attempt[perm])} failed permanently "
                           f"(status {int(status[perm])})")
    # Committed claims beyond max_attempts: a fault may explain a repeated delivery, never an
    # extra claim the queue committed. A claim given back by an applied release used no
    # attempt; under pg-long-tx a claim commits only with its result, so a claim whose worker
    # died is rolled back and the rule is not applied there.
    events = h.events
    if cfg.backend != "pg-long-tx" and len(events) and "job" in events:
        of_job = events["job"] >= 0
        claimed = events[of_job & (events["kind"] == "claim")].groupby("job").size()
        given_back = events[of_job & (events["kind"] == "release")
                            & (events["result"] == "applied")].groupby("job").size()
        committed = claimed.sub(given_back, fill_value=0)
        if len(committed):
            limits = h.job_max_attempts[committed.index.to_numpy()]
            for j, count in committed[committed.to_numpy() > limits].items():
                if int(j) not in exceeded:
                    exceeded[int(j)] = (
                        f"{int(count)} committed claims for max_attempts "
                        f"{h.job_max_attempts[int(j)]} ({int(given_back.get(j, 0))} given "
                        "back by release)")
    for j, why in exceeded.items():
        found.add("attempts_exceeded", h.job_ids[j], why)

    # Account limits, from delivery intervals as the queue sees them: a delivery the worker
    # abandoned on its timeout no longer holds a slot, nor does one made after its own lease
    # had run out (recovery had freed that slot).
    excused, excused_examples = _check_limits(h, d, job, attempt, received, target_end,
                                              is_answered, late, hang_forever, timeout,
                                              tolerance, found)
    if excused:
        details["limit_excused"] = {"count": excused, "examples": excused_examples}

    # Final states: stuck, lost, state_mismatch.
    if cfg.drained:
        for j in np.flatnonzero(is_live & exists).tolist():
            found.add("stuck", h.job_ids[j],
                      f"{final_status[j]} after the drain, {int(delivered_per_job[j])} "
                      "deliveries")
    else:
        live = int((is_live & exists).sum())
        if live:
            unknown.append(f"the drain timed out with {live} jobs still live")
    for j in np.flatnonzero(completed_no_2xx).tolist():
        found.add("state_mismatch", h.job_ids[j],
                  "COMPLETED but the target never answered 2xx")
    for j in np.flatnonzero(completed_late).tolist():
        late_rows = [r for r in job_rows[j] if success_2xx[r]]
        if any(explainer.late_success(records[r]) is not None for r in late_rows):
            continue
        first = late_rows[0]
        found.add("state_mismatch", h.job_ids[j],
                  f"COMPLETED but every 2xx came past the {timeout:g}s HTTP timeout (attempt "
                  f"{_label(attempt[first])} after {duration[first]:.2f}s): no worker could "
                  "have seen it")
    for j in np.flatnonzero(failed_with_2xx).tolist():
        ok_rows = [r for r in job_rows[j] if success_2xx[r] and in_time[r]]
        explained = False
        for r in ok_rows:
            nxt_time = next_received[r] if same_next[r] else math.inf
            if explainer.explain(records[r], float(nxt_time)) is not None:
                explained = True
                break
        if not explained:
            found.add("state_mismatch", h.job_ids[j],
                      f"FAILED although the target answered 2xx to attempt "
                      f"{_label(attempt[ok_rows[0]])} and nothing explains it")
    fault_consumed: dict[int, str | None] = {}

    def consumed(j: int) -> str | None:
        """A recorded fault that used up one of the job's attempts (an HTTP timeout does
        not count: the oracle already expects it)."""
        if j not in fault_consumed:
            reason = fault_reason.get(j)
            if reason is None:
                for r in job_rows[j]:
                    if explainer.ran_normally(j, float(records[r]["attempt"])):
                        continue
                    nxt_time = next_received[r] if same_next[r] else math.inf
                    why = explainer.explain(records[r], float(nxt_time), timeouts=False)
                    if why is not None:
                        reason = why.text
                        break
            if reason is None:
                reason = explainer.fault_touched(j, str(h.job_ids[j]),
                                                 int(h.job_max_attempts[j]))
            fault_consumed[j] = reason
        return fault_consumed[j]

    # Dead-lettered after attempts that never reached the target: the worker is part of the
    # system under test, so its word that the call failed to connect can be neither trusted
    # nor refuted. Such a job is neither valid nor a violation: it makes the answer unknown.
    unreached_of: dict[int, list[int] | None] = {}

    def unreached(j: int) -> bool:
        """Whether attempts that never reached the target account for all the job is short
        of (looked up only for the few dead-lettered jobs no fault explains)."""
        if j not in unreached_of:
            unreached_of[j] = explainer.unreached(j, attempt[job_rows.get(j, [])],
                                                  int(h.job_max_attempts[j]))
        return unreached_of[j] is not None

    for j in np.flatnonzero(failed_vs_oracle).tolist():
        if consumed(j) is None and not unreached(j):
            found.add("state_mismatch", h.job_ids[j],
                      "FAILED but its script completes within max_attempts "
                      f"({int(delivered_per_job[j])} deliveries, no fault recorded)")
    for j in np.flatnonzero(failed_early).tolist():
        if consumed(j) is None and not unreached(j):
            found.add("state_mismatch", h.job_ids[j],
                      f"FAILED after {int(delivered_per_job[j])} deliveries, but a correct "
                      f"queue delivers it {int(expected_deliveries[j])} times before "
                      f"dead-lettering it (max_attempts {h.job_max_attempts[j]}), and no "
                      "fault used up attempts")
    # An acknowledged job with no final row: judged only when the snapshot is known to be
    # whole (or, when run.json does not say, if the job was never delivered with 2xx).
    absent_unjudged = 0
    for j in np.flatnonzero(lost_candidate).tolist():
        if is_missing[j]:
            if snapshot_complete is False or (snapshot_complete is None
                                              and consumed(j) is not None):
                absent_unjudged += 1
                continue
            found.add("lost", h.job_ids[j],
                      "enqueue acknowledged, never delivered with 2xx, absent from the "
                      "final states")
        elif is_completed[j]:
            found.add("lost", h.job_ids[j],
                      "enqueue acknowledged, marked COMPLETED but never delivered with 2xx")
        elif is_failed[j] and (not expected_completed[j] or consumed(j) is not None):
            continue  # legitimately dead-lettered
        elif is_failed[j] and unreached(j):
            continue  # judged unknown above
        else:
            found.add("lost", h.job_ids[j],
                      f"enqueue acknowledged, FAILED after {int(delivered_per_job[j])} "
                      "deliveries without 2xx, though its script completes and no fault "
                      "consumed its attempts")
    for j in np.flatnonzero(absent_2xx).tolist():
        if snapshot_complete:
            found.add("state_mismatch", h.job_ids[j],
                      f"delivered with 2xx but absent from the final snapshot, which "
                      f"run.json says is whole ({cfg.final_jobs} rows)")
        else:
            absent_unjudged += 1
    if absent_unjudged:
        unknown.append(f"{absent_unjudged} acknowledged jobs have no row in {FINAL_JOBS_FILE} "
                       "and the snapshot is not known to be whole")
    cut_short = {j: attempts for j, attempts in unreached_of.items() if attempts is not None}
    if cut_short:
        details["unreached_dead_letters"] = {
            "count": len(cut_short),
            "examples": [{"job_id": str(h.job_ids[j]),
                          "why": f"FAILED after {int(delivered_per_job[j])} deliveries; "
                                 f"attempt{'s' if len(attempts) > 1 else ''} "
                                 f"{', '.join(map(str, attempts))} of "
                                 f"{h.job_max_attempts[j]} never reached the target"}
                         for j, attempts in list(cut_short.items())[:MAX_EXAMPLES]],
        }
        shown = ", ".join(str(h.job_ids[j]) for j in list(cut_short)[:3])
        unknown.append(f"{len(cut_short)} jobs dead-lettered after attempts that never reached "
                       "the target (the worker logged a timeout or connection error, the "
                       "target no delivery): the history cannot say whether the queue or the "
                       f"network lost them; examples: {shown}")

    # Stale writes.
    if len(stale_candidates):
        # Each write against the claims of its job: the earliest later attempt claimed
        # before the write was sent (the event is logged after the commit, maybe much
        # later; `started` is when the statement went out).
        cols = ["job", "attempt", "time", "worker"]
        stale_rows = stale_candidates[cols].reset_index(drop=True)
        started = _floats(h.event_data.field("started", stale_candidates.index.to_numpy()))
        logged = stale_rows["time"].to_numpy()
        stale_rows["sent"] = np.where(np.isnan(started), logged, np.minimum(started, logged))
        stale_rows["write"] = np.arange(len(stale_rows))
        matched = stale_rows.merge(claims[claims["job"].isin(stale_rows["job"])][cols], on="job",
                                   suffixes=("", "_claim"))
        matched = matched[(matched["attempt_claim"] > matched["attempt"])
                          & (matched["time_claim"] < matched["sent"] - tolerance)]
        stale = (matched.sort_values("time_claim", kind="stable")
                 .drop_duplicates("write").sort_values("write"))
        for rec in _records(stale):
            found.add("stale_write", h.job_ids[int(rec["job"])],
                      f"{rec['worker']} applied its result for attempt "
                      f"{_label(rec['attempt'])} at {_fmt(rec['sent'])}, after "
                      f"{rec['worker_claim']} claimed attempt {_label(rec['attempt_claim'])} "
                      f"at {_fmt(rec['time_claim'])}")

    if n_jobs == 0:
        unknown.append("no job was enqueued: there is nothing to judge")
    # Every worker the target saw must have left its event log, or its faults are unknown.
    silent = sorted(set(h.deliveries["worker"].dropna().unique().tolist())
                    - set(h.events["worker"].dropna().unique().tolist()))
    if silent and len(h.events):
        shown = ", ".join(map(str, silent[:5])) + (" ..." if len(silent) > 5 else "")
        unknown.append(f"no worker event log for {shown}, though the target saw its "
                       "deliveries")
        details["workers_without_log"] = len(silent)
    failing, failed_calls = _never_succeeded(h)
    unknown.extend(failing)
    if failed_calls:
        details["failed_calls"] = failed_calls

    found.counts["enqueued"] = int((acked == 1).sum())
    details.update({
        "enqueue_invoked": n_jobs,
        "enqueue_unknown": int((acked == 0).sum()),
        "enqueue_failed": int((acked == -1).sum()),
        "jobs_live": int((is_live & exists).sum()),
        "faults": len(h.faults),
        "faults_skipped": sum(1 for f_ in h.faults if f_.get("skipped")),
        "worker_events": len(h.events),
        "distinct_oracles": len(cache._cache),
    })
    return found, unknown, details


def _never_succeeded(h: _History) -> tuple[list[str], dict[str, int]]:
    """Calls to the queue that failed (`error` events) and never once succeeded, so the
    history cannot show that the queue did that part of its job: recovery (no `recover`
    event anywhere), claims (failed in every worker, no `claim` event anywhere) and result
    writes (no write applied or fenced anywhere). A few failures among successes, as under
    database faults, are not a reason. Returns the unknown reasons and the failed calls by
    operation."""
    ev = h.events
    rows = np.flatnonzero((ev["kind"] == "error").to_numpy())
    if not len(rows):
        return [], {}
    failed = pd.DataFrame({
        "op": h.event_data.field("op", rows),
        "error": h.event_data.field("error", rows),
        "worker": ev["worker"].to_numpy()[rows],
        "time": ev["time"].to_numpy()[rows],
    }).sort_values("time", kind="stable")
    kinds = ev["kind"]
    writes = (kinds == "write") & ev["result"].isin(["applied", "fenced"])
    workers = set(ev["worker"].dropna().unique().tolist())
    reasons: list[str] = []
    for op, what, succeeded, everywhere in (
        ("recover", "recovery", bool((kinds == "recover").any()), False),
        ("claim", "claims", bool((kinds == "claim").any()), True),
        ("finish", "result writes", bool(writes.any()), False),
    ):
        mine = failed[failed["op"] == op]
        if not len(mine) or succeeded:
            continue
        failing = set(mine["worker"].dropna().unique().tolist())
        if everywhere and failing != workers:
            continue
        first = _records(mine.head(1))[0]
        reasons.append(
            f"{what} failed {len(mine)} time{'s' if len(mine) > 1 else ''} in "
            f"{len(failing)} worker{'s' if len(failing) != 1 else ''} and never succeeded "
            f"(the history cannot show that {_NEVER_RAN[op]}); first error, "
            f"{first['worker']} at {_fmt(first['time'])}: {first['error']}")
    counts = failed["op"].fillna("unnamed").value_counts()
    return reasons, {str(k): int(v) for k, v in counts.items()}


_NEVER_RAN = {
    "recover": "expired leases were ever recovered",
    "claim": "any job was claimed",
    "finish": "any result was written",
}


def _floats(values: np.ndarray) -> np.ndarray:
    """An object array of values as read as float64: NaN for anything but a number."""
    if values.dtype == np.float64:
        return values
    return np.array([float(v) if isinstance(v, int | float) and not isinstance(v, bool)
                     else math.nan for v in values.tolist()], dtype=np.float64)


def _http_ends(h: _History, job: np.ndarray, attempt: np.ndarray) -> np.ndarray:
    """For each (job, attempt), the earliest `end` a worker recorded for that attempt's
    HTTP call; NaN where none was recorded."""
    out = np.full(len(job), np.nan)
    ev = h.events
    http = ev[(ev["kind"] == "http") & ev["job"].isin(np.unique(job))]
    if not len(http):
        return out
    table = pd.DataFrame({
        "job": http["job"].to_numpy(),
        "attempt": http["attempt"].to_numpy(),
        "end": _floats(h.event_data.field("end", http.index.to_numpy())),
    }).dropna().groupby(["job", "attempt"], sort=False)["end"].min().reset_index()
    want = pd.DataFrame({"job": job, "attempt": attempt, "row": np.arange(len(job))})
    merged = want.merge(table, on=["job", "attempt"], how="inner")
    out[merged["row"].to_numpy()] = merged["end"].to_numpy()
    return out


def _lease_last(h: _History, jobs: np.ndarray) -> pd.DataFrame:
    """Per (job, attempt) of `jobs`: the last time its lease was taken or renewed (`last`),
    from the workers' claim and renewal events. A lease runs `lease_seconds` from there."""
    ev = h.events
    kinds = ev[ev["job"].isin(jobs) & ev["kind"].isin(["claim", "renew"])]
    renews = np.flatnonzero((kinds["kind"] == "renew").to_numpy())
    held = np.ones(len(kinds), dtype=bool)
    if len(renews):
        lost = h.event_data.field("lost", kinds.index.to_numpy()[renews])
        held[renews] = [v is not True for v in lost.tolist()]
    kinds = kinds[held]
    return (kinds.groupby(["job", "attempt"], sort=False)["time"].max()
            .rename("last").reset_index())


def _label(value: Any) -> str:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "?"
    return "?" if math.isnan(number) else str(int(number))


def _check_limits(h: _History, d: pd.DataFrame, job: np.ndarray, attempt: np.ndarray,
                  received: np.ndarray, target_end: np.ndarray, is_answered: np.ndarray,
                  late: np.ndarray, hang_forever: np.ndarray, timeout: float, tolerance: float,
                  found: _Findings) -> tuple[int, list[dict[str, Any]]]:
    """Flag deliveries over their account's limit; returns how many deliveries of accounts
    that looked full were left out because their own lease had run out when they were
    made, with examples."""
    limits = {k: v for k, v in h.config.account_limits.items() if v is not None}
    if not limits or not len(d):
        return 0, []
    # The account comes from the enqueue (configuration), not from a header the queue sent.
    account = h.job_account[job]
    header_account = d["account"].to_numpy()
    account = np.where(pd.isna(account), header_account, account)
    limit = pd.Series(account).map(limits).to_numpy(dtype="float64")
    limited = ~np.isnan(limit)
    if not limited.any():
        return 0, []
    abandoned = received + timeout - tolerance
    queue_end = np.where(late | (~is_answered & hang_forever), np.minimum(target_end, abandoned),
                         target_end)
    rows = np.flatnonzero(limited)

    def over_limit(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows (of `rows`) that found their account full, and how many were in flight."""
        n = len(rows)
        events = pd.DataFrame({
            "account": np.concatenate([account[rows], account[rows]]),
            "time": np.concatenate([received[rows], queue_end[rows]]),
            # Ends sort before starts at the same instant: a slot freed then taken is not two.
            "delta": np.concatenate([np.ones(n, dtype=np.int64), -np.ones(n, dtype=np.int64)]),
            "row": np.concatenate([rows, rows]),
        })
        events = events.sort_values(["account", "time", "delta"], kind="stable")
        running = events.groupby("account", sort=False)["delta"].cumsum().to_numpy()
        starts = events["delta"].to_numpy() == 1
        over = starts & (running > limit[events["row"].to_numpy()])
        return events["row"].to_numpy()[over], running[over]

    flagged, counts = over_limit(rows)
    excused: list[dict[str, Any]] = []
    excused_count = 0
    if len(flagged):
        # A worker that resumes past its lease (paused, stalled) and makes its call anyway
        # holds no slot: recovery had freed it for the job's next attempt. The lease is the
        # configured one from the attempt's last claim or renewal. Looked up only when some
        # account looked full, for that account's deliveries.
        full = np.flatnonzero(np.isin(account[rows], np.unique(account[flagged])))
        suspects = rows[full]
        last = _lease_last(h, np.unique(job[suspects]))
        want = pd.DataFrame({"job": job[suspects], "attempt": attempt[suspects],
                             "row": suspects})
        merged = want.merge(last, on=["job", "attempt"], how="inner")
        at = merged["row"].to_numpy()
        expired = received[at] >= merged["last"].to_numpy() + h.config.lease_seconds - tolerance
        stale = np.sort(at[expired])
        if len(stale):
            excused = [{"job_id": str(h.job_ids[int(job[r])]),
                        "why": f"delivered at {_fmt(received[r])}, after the lease of attempt "
                               f"{_label(attempt[r])} had run out: it held no slot"}
                       for r in stale[:MAX_EXAMPLES].tolist()]
            excused_count = len(stale)
            flagged, counts = over_limit(np.setdiff1d(rows, stale))
    for row, count in zip(flagged, counts, strict=True):
        found.add("limit_exceeded", h.job_ids[int(job[row])],
                  f"account {account[row]} had {int(count)} deliveries in flight at "
                  f"{_fmt(received[row])}, limit {int(limit[row])}")
    return excused_count, excused


# What the lost tail of a log cut off mid-line (or cut before its header) may have held, and
# so the violations it may cause, which a history with such a log does not report:
# - enqueues.csv: invokes (their deliveries look unexpected) and acknowledgements;
# - deliveries/: deliveries, answered or not (a delivery never answered is written when the
#   target gives up on it, so it may be older than records before it): jobs look lost,
#   final states unexplained, and redeliveries are paired and counted without it;
# - workers/: claims, renewals, call ends, failpoints, lost writes, error stops: what
#   explains a redelivery, and which lease held a slot; only stale writes (an applied write
#   after a later claim, both recorded) and stuck jobs stand;
# - nemesis.jsonl: faults, which explain redeliveries and dead letters;
# - final_jobs.csv: final states.
# `unexpected` and `lost` are never reported from a cut history.
_CUT_MAY_CAUSE: dict[str, frozenset[str]] = {
    ENQUEUES_FILE: frozenset({"unexpected", "lost"}),
    DELIVERIES_DIR: frozenset({"unexpected", "lost", "state_mismatch", "duplicate_unexplained",
                               "early_retry", "attempts_exceeded"}),
    WORKERS_DIR: frozenset(VIOLATION_KEYS) - {"stale_write", "stuck"},
    NEMESIS_FILE: frozenset(VIOLATION_KEYS) - {"stale_write", "stuck", "limit_exceeded"},
    FINAL_JOBS_FILE: frozenset({"unexpected", "lost", "state_mismatch"}),
}


def _unjudged_kinds(history: _History, enqueued_jobs: int,
                    worker_log_missing: bool) -> frozenset[str]:
    """The violation kinds not reported from this history: those a cut log may cause (a
    worker's log missing altogether is a workers/ log cut before its first line), and every
    kind when nothing was enqueued (the deliveries' enqueues may be elsewhere)."""
    if not enqueued_jobs:
        return frozenset(VIOLATION_KEYS)
    kinds = frozenset().union(*(_CUT_MAY_CAUSE[kind] for kind in history.cut.values()))
    return kinds | _CUT_MAY_CAUSE[WORKERS_DIR] if worker_log_missing else kinds


def check_run(run_dirs: Sequence[Path], *,
              tolerance_seconds: float = DEFAULT_TOLERANCE_SECONDS) -> Verdict:
    """Judge the run recorded in `run_dirs` (the first holds the run; the others add
    delivery, worker and fault logs). Raises HistoryError when the history cannot be read,
    ValueError for a tolerance that is negative or not finite (it would excuse or invent
    anomalies)."""
    if not (math.isfinite(tolerance_seconds) and tolerance_seconds >= 0):
        raise ValueError(f"tolerance_seconds must be finite and >= 0, not {tolerance_seconds}")
    started, cpu_started = time.perf_counter(), time.process_time()
    history = _load(run_dirs)
    loaded, cpu_loaded = time.perf_counter(), time.process_time()
    found, unknown, details = _judge(history, tolerance_seconds)
    judged, cpu_judged = time.perf_counter(), time.process_time()
    unknown.extend(history.truncated)
    if history.config.exit_reason != "completed":
        unknown.append(f"the run ended with {history.config.exit_reason!r}")
    no_events = bool(found.counts["delivered"]) and not len(history.events)
    if no_events:
        unknown.append("deliveries were recorded but no worker events: nothing can explain a "
                       "redelivery")
    # Violations win over unknown, except those a part of the history that is missing may
    # have caused: they are counted, and not reported as violations.
    worker_log_missing = no_events or bool(details.get("workers_without_log"))
    unjudged = _unjudged_kinds(history, len(history.job_ids), worker_log_missing)
    held = {k: found.counts[k] for k in VIOLATION_KEYS if found.counts[k] > 0 and k in unjudged}
    if held:
        cut = list(history.cut)
        why = ("nothing was enqueued (its enqueues.csv may be in a directory not given)"
               if not len(history.job_ids) else
               f"{', '.join(cut[:3])}{' ...' if len(cut) > 3 else ''} was cut off and may "
               "have lost the records that decide them" if cut else
               "a worker's event log is missing, and may have held the events that explain "
               "them")
        unknown.append(f"not judged: {', '.join(f'{n} {k}' for k, n in held.items())}: {why}")
        details["not_judged"] = held
    valid: Valid
    if any(found.counts[k] > 0 for k in VIOLATION_KEYS if k not in held):
        valid = False
    elif unknown:
        valid = "unknown"
    else:
        valid = True
    details["worker_files"] = history.worker_files
    return Verdict(
        valid=valid,
        counts=found.counts,
        examples={k: v for k, v in found.examples.items() if v},
        unknown_reasons=tuple(unknown),
        files=tuple(history.files),
        details=details,
        timings={
            "load_seconds": round(loaded - started, 4),
            "judge_seconds": round(judged - loaded, 4),
            "total_seconds": round(judged - started, 4),
            # CPU time of this process: on a shared machine, wall time includes waiting.
            "load_cpu_seconds": round(cpu_loaded - cpu_started, 4),
            "judge_cpu_seconds": round(cpu_judged - cpu_loaded, 4),
        },
    )


__all__ = [
    "COUNT_KEYS",
    "VIOLATION_KEYS",
    "HistoryError",
    "RunConfig",
    "Verdict",
    "check_run",
    "write_verdict",
]
