"""Reading a run's history: the CSV logs (and nemesis.jsonl) through Arrow's readers, files
in parallel, line by line only to name a bad line; then the job universe, each job's oracle
inputs, the deliveries, the worker events, the faults and the final states: `read_history`
returns them as a `History`.

A history that cannot be trusted is never judged: it is bad input (`HistoryError`, one line
naming the file, and the line where there is one). See `skiplock.reports.checker` for the rules."""

from __future__ import annotations

import codecs
import json
import math
import mmap
import os
import stat
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast, get_args

import numpy as np
import pandas as pd
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
import pyarrow.csv as pacsv  # type: ignore[import-untyped]
import pyarrow.json as pajson  # type: ignore[import-untyped]

from skiplock.queue_impl.interface import (
    REFERENCE_GUARANTEES,
    Guarantees,
    JobStatus,
    LeaseKind,
)
from skiplock.queue_impl.retry import RetryPolicy
from skiplock.reports import columnar
from skiplock.reports.checker.common import floats
from skiplock.reports.checker.faults import KNOWN_FAULTS
from skiplock.reports.history import (
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
)
from skiplock.reports.objectives import ObjectiveError, Objectives

# The oracle walks a job's attempts one by one: a larger max_attempts is no run's, and would
# hold the checker for hours.
_MAX_ATTEMPTS = 1_000_000

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
_ENQUEUE_BASE = ("type", "job_id", "account", "max_attempts", "time", "run_at")


def _nest_script(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The script columns of enqueues as one struct column: null without a first step, a
    step null without its behaviour, as `skiplock.reports.history.read_log` reads them back."""

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
_EVENT_BASE = ("kind", "worker", "time", "job_id", "attempt", "lease_token")


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
                   "status", "behaviour", "lease"),
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
    # Where a pause froze its worker ("claim": inside its claim, holding its account locks).
    ("data", pa.struct([("phase", pa.string())])),
])
_FAULTS = _Source(schema=_FAULT_SCHEMA, shape=_FAULT_SCHEMA)


def _without_nulls(value: Any) -> Any:
    """A struct read by Arrow has every field of its schema; leave out the absent (null)
    ones, as they were in the file."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value


@dataclass
class Nested:
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
                values[at] = [data_dict(part[i]).get(name) for i in local.tolist()]
            elif part.type.get_field_index(name) >= 0:
                column = pc.struct_field(part.take(pa.array(local)), name)
                values[at] = column.to_numpy(zero_copy_only=False)
        return values


@dataclass
class _Part:
    """One file's columns: numbers as float64 (NaN for null), strings as object arrays,
    `job_id` kept in Arrow (it is only ever looked up), objects as `Nested` parts."""

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
    # A file of one block gains nothing from Arrow's thread pool, and a read that fails with
    # blocks still in flight on it can leave a pool thread running into interpreter exit,
    # where the C++ runtime aborts the process (seen once: exit -6 after a clean exit 2).
    threaded = end > _BLOCK_BYTES
    try:
        table = pacsv.read_csv(
            pa.BufferReader(pa.py_buffer(memoryview(data)[:end])),
            read_options=pacsv.ReadOptions(block_size=_BLOCK_BYTES, use_threads=threaded),
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
            read_options=pajson.ReadOptions(block_size=_BLOCK_BYTES,
                                            use_threads=len(data) > _BLOCK_BYTES),
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
    nested: dict[str, Nested]
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


def _refuse_bad_times(table: _Table, nested: Nested, names: Sequence[str], what: str) -> None:
    """`_refuse_out_of_range` for the times held in a nested column (a worker event's own
    fields): the judge reads them only for the few events that explain something, but a bad
    one must not be judged at all."""
    # `starts` has one entry even without parts.
    for part, start in zip(nested.parts, nested.starts.tolist(), strict=False):
        for name in names:
            if isinstance(part, list):
                values = floats(np.array([data_dict(v).get(name) for v in part], dtype=object))
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
    nested = {f.name: Nested([p.nested[f.name] for p in parts], starts)
              for f in schema if pa.types.is_struct(f.type)}
    job_id = pa.chunked_array([c for p in parts for c in p.job_id.chunks], pa.string())
    return _Table(columns=columns, job_id=job_id, nested=nested,
                  typed=all(p.typed for p in parts),
                  source=[str(p.path) for p in parts], rows_per_file=counts,
                  header_lines=[p.header_lines for p in parts], lines=[p.lines for p in parts])


def data_dict(value: Any) -> dict[str, Any]:
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
    # What the queue promises (spec.json `guarantees`; the reference's when not recorded).
    guarantees: Guarantees = REFERENCE_GUARANTEES
    # When the load started (epoch seconds): the warm-up's start in spec.json, else run.json
    # `started`; the origin of every time the verdict says. None when neither is recorded.
    time_origin: float | None = None
    # The scenario's objectives (spec.json `scenario.objectives`, or `check --set`).
    objectives: Objectives = field(default_factory=Objectives)
    # The load phase (warm-up start to load end, epoch seconds); None when not recorded.
    load_window: tuple[float, float] | None = None
    # How the queue's lease runs (spec.json `lease`): "renewal" (from the claim or renewal
    # as recorded), or "heartbeat" (`HeartbeatLease`: from when each was sent).
    lease_kind: LeaseKind = "renewal"


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
        guarantees=_guarantees(spec or {}, path),
        time_origin=_time_origin(raw, spec or {}),
        objectives=_objectives(spec or {}, path),
        load_window=_load_window(spec or {}),
        lease_kind=_lease_kind(spec or {}, path),
    )


def _lease_kind(spec: dict[str, Any], path: Path) -> LeaseKind:
    """spec.json's `lease`, else "renewal"; any other value is bad input."""
    kind = spec.get("lease", "renewal")
    if kind not in get_args(LeaseKind):
        raise HistoryError(f"{path.with_name(SPEC_FILE)}: lease must be \"renewal\" or "
                           f"\"heartbeat\", not {kind!r:.40}")
    return cast(LeaseKind, kind)


def _objectives(spec: dict[str, Any], path: Path) -> Objectives:
    """spec.json's `scenario.objectives`; a malformed one is bad input."""
    scenario = spec.get("scenario")
    raw = scenario.get("objectives") if isinstance(scenario, dict) else None
    try:
        return Objectives.from_mapping(raw, "scenario.objectives")
    except ObjectiveError as exc:
        raise HistoryError(f"{path.with_name(SPEC_FILE)}: {exc}") from None


def _load_window(spec: dict[str, Any]) -> tuple[float, float] | None:
    """From the warm-up's start to the load phase's end, as spec.json's phases say."""
    phases = spec.get("phases")
    spans = {p.get("name"): p for p in phases if isinstance(p, dict)} if isinstance(
        phases, list) else {}
    first, last = spans.get("warmup") or spans.get("load"), spans.get("load")
    if first and last and _finite(first.get("start")) and _finite(last.get("end")):
        return float(first["start"]), float(last["end"])
    return None


def _time_origin(raw: dict[str, Any], spec: dict[str, Any]) -> float | None:
    """The load's start, as the report's time axis counts it (`report_data.RunData.t0`)."""
    phases = spec.get("phases")
    for phase in phases if isinstance(phases, list) else []:
        if isinstance(phase, dict) and phase.get("name") == "warmup" and _finite(
                phase.get("start")):
            return float(phase["start"])
    return float(raw["started"]) if _finite(raw.get("started")) else None


def _finite(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def _guarantees(spec: dict[str, Any], path: Path) -> Guarantees:
    """spec.json's `guarantees`, else the reference's; a malformed one is bad input (judged
    against promises guessed, a queue could be called invalid by design or valid unjudged)."""
    raw = spec.get("guarantees")
    if raw is None:
        return REFERENCE_GUARANTEES
    if not isinstance(raw, dict):
        raise HistoryError(f"{path.with_name(SPEC_FILE)}: guarantees must be an object")
    try:
        return Guarantees.from_json(raw)
    except ValueError as exc:
        raise HistoryError(f"{path.with_name(SPEC_FILE)}: {exc}") from None


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
class History:
    config: RunConfig
    job_ids: pd.Index  # every job an enqueue was invoked for; position = job code
    job_account: np.ndarray  # object
    job_max_attempts: np.ndarray  # int
    job_script: np.ndarray  # int: index into `scripts`
    scripts: list[tuple[Any, dict[str, Any] | None]]
    job_ack: np.ndarray  # int8: 1 ok, 0 unknown (info / no answer), -1 fail
    job_due: np.ndarray  # float: acknowledged (or its run_at, if later); NaN if never acked
    deliveries: pd.DataFrame
    events: pd.DataFrame  # row i's `data` is event_data's row i
    event_data: Nested
    faults: list[dict[str, Any]]
    final: pd.DataFrame
    files: list[str]
    truncated: list[str]  # why each file cut off is: "<path> is truncated mid-line"
    cut: dict[str, str]  # each file cut off -> the kind of log it is (its file or directory)
    worker_files: int
    # Claims keyed apart from an earlier pick of the same attempt number (key_picks_by_lease).
    repicks: int = 0


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


def read_history(run_dirs: Sequence[Path]) -> History:
    """The history recorded in `run_dirs` (the first holds the run; the others add
    delivery, worker and fault logs, and may add enqueues). Raises HistoryError."""
    dirs = _run_dirs(run_dirs)
    main = dirs[0]
    config = _run_config(main / RUN_FILE, read_json(main / SPEC_FILE))
    kinds = _log_kinds(dirs)
    _refuse_repeats([p for _, paths, _ in kinds for p in paths], "a log", "file")
    read = _read_parts([(p, source) for _, paths, source in kinds for p in paths])
    parts = iter(read)
    cut: dict[str, str] = {}  # file cut off -> its kind of log
    tables: list[_Table] = []
    for kind_name, paths, source in kinds:
        mine = [next(parts) for _ in paths]
        cut.update((str(p.path), kind_name) for p in mine if p.truncated)
        tables.append(_table(mine, source.shape))
    enq, dl, ev, nem, fin = tables
    enq.require_str("type", "enqueue")
    enq.require_str("job_id", "enqueue")
    fin.require_str("job_id", "final job state")
    jobs = _Jobs.read(enq, (enq, dl, ev, fin))
    deliveries, events = _deliveries(dl, jobs), _events(ev, jobs)
    if config.lease_kind == "heartbeat":
        lease_from_sent(events, ev.nested["data"])
    repicks = 0
    if config.guarantees.attempts_count != "claims":
        repicks = key_picks_by_lease(events, ev.columns["lease_token"], deliveries,
                                     dl.columns["lease"])
    return History(
        config=config,
        job_ids=jobs.job_ids,
        job_account=jobs.account,
        job_max_attempts=jobs.max_attempts,
        job_script=jobs.script_codes,
        scripts=jobs.scripts,
        job_ack=jobs.ack,
        job_due=jobs.due,
        deliveries=deliveries,
        events=events,
        event_data=ev.nested["data"],
        faults=_faults(nem),
        final=_finals(fin, jobs),
        files=[str(main / SPEC_FILE), str(main / RUN_FILE), *(str(p.path) for p in read)],
        truncated=[str(p.path) + (" is empty: it was cut off before its header" if p.empty
                                  else " is truncated mid-line")
                   for p in read if p.truncated],
        cut=cut,
        worker_files=len(kinds[2][1]),
        repicks=repicks,
    )


# A second pick of a job under the attempt number of an earlier one is keyed a fraction above
# it: ordered, never equal, and the queue's own number where a whole number is read (the
# backoff it owes, what the sentence says).
REPICK_STEP = 1 / 64


def key_picks_by_lease(events: pd.DataFrame, event_leases: Any, deliveries: pd.DataFrame,
                       delivery_leases: Any) -> int:
    """Key every record of a pick by its lease token, for a queue whose attempt number does
    not name a claim (it counts finished attempts, so a pick after a stall keeps the number).
    Each job's claims under one number are ranked by time; the k-th distinct lease becomes
    `attempt + k * REPICK_STEP` in every event and delivery that carries its token, so re-picks,
    their calls, their writes and the target's deliveries are told apart and paired whatever
    numbering the queue uses. Returns how many claims were re-picks. Records without a token
    keep their number."""
    leases = pd.Series(np.asarray(event_leases, dtype=object), index=events.index)
    claims = events[(events["kind"] == "claim") & leases.notna()
                    & ~np.isnan(events["attempt"].to_numpy())]
    if not len(claims):
        return 0
    table = pd.DataFrame({"job": claims["job"].to_numpy(),
                          "attempt": claims["attempt"].to_numpy(),
                          "lease": leases[claims.index].to_numpy(),
                          "time": claims["time"].to_numpy()}).sort_values("time", kind="stable")
    table = table.drop_duplicates("lease")
    rank = table.groupby(["job", "attempt"], sort=False).cumcount().to_numpy()
    if not rank.any():
        return 0
    keys = dict(zip(table["lease"].tolist(),
                    (table["attempt"].to_numpy() + rank * REPICK_STEP).tolist(), strict=True))
    for frame, column in ((events, leases.to_numpy()),
                          (deliveries, np.asarray(delivery_leases, dtype=object))):
        mapped = pd.Series(column).map(keys).to_numpy(dtype=np.float64, na_value=np.nan)
        known = ~np.isnan(mapped)
        if known.any():
            attempt = frame["attempt"].to_numpy(dtype=np.float64, copy=True)
            attempt[known] = mapped[known]
            frame["attempt"] = attempt
    return int((rank > 0).sum())


def _run_dirs(run_dirs: Sequence[Path]) -> list[Path]:
    """The run directories, refused unless the first holds a run and each other one holds
    logs of it."""
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
    return dirs


def _log_kinds(dirs: Sequence[Path]) -> list[tuple[str, list[Path], _Source]]:
    """Each kind of log (named by its file or directory), its files in every directory,
    and how it is read; in the order `load` unpacks them."""
    main = dirs[0]
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
    return [
        (ENQUEUES_FILE, enqueue_files, _ENQUEUES),
        (DELIVERIES_DIR, delivery_files, _DELIVERIES),
        (WORKERS_DIR, worker_files, _EVENTS),
        (NEMESIS_FILE, nemesis_files, _FAULTS),
        (FINAL_JOBS_FILE, [main / FINAL_JOBS_FILE], _FINAL),
    ]


@dataclass
class _Jobs:
    """The job universe, from the enqueues: every job an enqueue was invoked for (its
    position is its code), its oracle inputs and its acknowledgement; and each log's job
    ids as codes (-1: a job never invoked)."""

    job_ids: pd.Index
    account: np.ndarray
    max_attempts: np.ndarray
    script_codes: np.ndarray
    scripts: list[tuple[Any, dict[str, Any] | None]]
    ack: np.ndarray  # int8: 1 ok, 0 unknown (info / no answer), -1 fail
    codes: dict[int, np.ndarray]  # id(table) -> its rows' job codes
    due: np.ndarray  # float: when the job could first be claimed (see _due)

    @classmethod
    def read(cls, enq: _Table, tables: Sequence[_Table]) -> _Jobs:
        types = pd.Series(enq.columns["type"], dtype=object)
        bad_type = ~types.isin(["invoke", "ok", "fail", "info"])
        if bad_type.any():
            row = int(np.flatnonzero(bad_type.to_numpy())[0])
            raise HistoryError(f"{enq.where(row)}: enqueue type {types[row]!r} is not "
                               "invoke, ok, fail or info")
        # Job ids are only compared, never read: one dictionary over every file's ids turns
        # them into codes without making a Python string per row.
        encoded = pa.chunked_array([c for t in tables for c in t.job_id.chunks],
                                   pa.string()).dictionary_encode()
        dictionary = (encoded.chunk(0).dictionary if encoded.num_chunks
                      else pa.array([], pa.string()))
        missing = len(dictionary)
        indices = pa.chunked_array([c.indices for c in encoded.chunks], pa.int32())
        all_codes = indices.fill_null(missing).to_numpy().astype(np.int64)
        ends = np.cumsum([len(t.job_id) for t in tables])
        ids = np.split(all_codes, ends[:-1])
        enq_ids = ids[0]
        is_invoke = (types == "invoke").to_numpy()
        invoke_rows = np.flatnonzero(is_invoke)
        first = np.sort(np.unique(enq_ids[invoke_rows], return_index=True)[1])
        invoke_rows = invoke_rows[first]
        job_of_id = np.full(missing + 1, -1, dtype=np.int64)  # dictionary index -> job code
        job_of_id[enq_ids[invoke_rows]] = np.arange(len(invoke_rows))
        job_ids = pd.Index(dictionary.take(pa.array(enq_ids[invoke_rows]))
                           .to_numpy(zero_copy_only=False), dtype=object)
        max_attempts = _max_attempts(enq, invoke_rows)
        script_codes, scripts = _scripts(enq, invoke_rows)
        ack = _acks(enq, types, job_of_id[enq_ids], len(job_ids))
        return cls(
            job_ids=job_ids,
            account=enq.columns["account"][invoke_rows],
            max_attempts=max_attempts,
            script_codes=np.asarray(script_codes, dtype=np.int64),
            scripts=scripts,
            ack=ack,
            codes={id(t): job_of_id[i] for t, i in zip(tables, ids, strict=True)},
            due=_due(enq, types, job_of_id[enq_ids], invoke_rows, len(job_ids)),
        )

    def of(self, table: _Table) -> np.ndarray:
        return self.codes[id(table)]

    def id_column(self, table: _Table) -> np.ndarray:
        """The job id of each row, as the job's string (one per job, shared)."""
        codes = self.of(table)
        out = (np.asarray(self.job_ids, dtype=object)[np.maximum(codes, 0)]
               if len(self.job_ids) else np.full(len(codes), None, dtype=object))
        unknown = np.flatnonzero(codes < 0)
        if len(unknown):
            out[unknown] = table.job_id.take(pa.array(unknown)).to_numpy(zero_copy_only=False)
        return cast(np.ndarray, out)


def _max_attempts(enq: _Table, invoke_rows: np.ndarray) -> np.ndarray:
    max_attempts_all: np.ndarray = enq.number("max_attempts", "enqueue",
                                              required=False)[invoke_rows]
    bad_max = np.flatnonzero(~(max_attempts_all >= 1) | (max_attempts_all % 1 != 0)
                             | (max_attempts_all > _MAX_ATTEMPTS))
    if len(bad_max):
        raise HistoryError(f"{enq.where(int(invoke_rows[bad_max[0]]))}: invoke needs "
                           f"max_attempts >= 1 (a whole number, at most {_MAX_ATTEMPTS})")
    return max_attempts_all.astype(np.int64)


def _scripts(enq: _Table, invoke_rows: np.ndarray
             ) -> tuple[np.ndarray, list[tuple[Any, dict[str, Any] | None]]]:
    script_codes, script_values = _script_codes(enq, invoke_rows)
    scripts: list[tuple[Any, dict[str, Any] | None]] = []
    for code, raw_script in enumerate(script_values):
        if raw_script is not None and not isinstance(raw_script, dict):
            at = int(np.flatnonzero(script_codes == code)[0])
            raise HistoryError(f"{enq.where(int(invoke_rows[at]))}: script is not an object")
        scripts.append((_script_key(raw_script), raw_script))
    return script_codes, scripts


def _acks(enq: _Table, types: pd.Series, enq_jobs: np.ndarray, n_jobs: int) -> np.ndarray:
    """Each job's acknowledgement: ok beats info beats fail (an info that later turned out
    ok is ok)."""
    answer_rows = np.flatnonzero((types != "invoke").to_numpy())
    answer_codes = enq_jobs[answer_rows]
    if (answer_codes < 0).any():
        row = int(answer_rows[np.flatnonzero(answer_codes < 0)[0]])
        job_id = enq.job_id.take(pa.array([row]))[0].as_py()
        raise HistoryError(f"{enq.where(row)}: {types[row]} for job {job_id} without an invoke")
    job_ack = np.zeros(n_jobs, dtype=np.int8)
    answer_types = types.to_numpy()[answer_rows]
    job_ack[answer_codes[answer_types == "fail"]] = -1
    job_ack[answer_codes[answer_types == "info"]] = 0
    job_ack[answer_codes[answer_types == "ok"]] = 1
    return job_ack


def _due(enq: _Table, types: pd.Series, enq_jobs: np.ndarray, invoke_rows: np.ndarray,
         n_jobs: int) -> np.ndarray:
    """When each job was due: its acknowledgement (the enqueue had committed by then), or
    its `run_at` if later; NaN for a job never acknowledged."""
    times = enq.number("time", "enqueue", required=False, time=True)
    acked_at = np.full(n_jobs, np.nan)
    ok_rows = np.flatnonzero((types == "ok").to_numpy())
    # The first acknowledgement of each job (a repeated `ok` changes nothing).
    acked_at[enq_jobs[ok_rows][::-1]] = times[ok_rows][::-1]
    run_at = enq.number("run_at", "enqueue", required=False, time=True)[invoke_rows]
    return np.where(np.isnan(run_at), acked_at, np.fmax(acked_at, run_at))


def _deliveries(dl: _Table, jobs: _Jobs) -> pd.DataFrame:
    """Deliveries, merged over every target of every directory. A request without the job
    id header has an empty job_id, read as null: judged as an unexpected delivery, not as
    an unreadable history."""
    deliveries = pd.DataFrame({
        "job": jobs.of(dl),
        "job_id": pd.Series(jobs.id_column(dl), dtype=object),
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
    return deliveries


def lease_from_sent(events: pd.DataFrame, data: Any) -> None:
    """For a heartbeat lease: time each claim and renewal from when it was sent (its
    `started`), where the lease it took or kept began, instead of when the worker recorded
    it returning (a worker paused in between records it long after). Every lease the judge
    measures from a claim or renewal then runs from there."""
    rows = np.flatnonzero(events["kind"].isin(["claim", "renew"]).to_numpy())
    if not len(rows):
        return
    sent = floats(data.field("started", events.index.to_numpy()[rows]))
    times = events["time"].to_numpy(dtype=np.float64, copy=True)
    earlier = np.isfinite(sent) & (sent < times[rows])
    times[rows[earlier]] = sent[earlier]
    events["time"] = times


def _events(ev: _Table, jobs: _Jobs) -> pd.DataFrame:
    """Worker events, merged over every worker of every directory. Only writes need a field
    of `data` for every row; the rest is read for the few events that explain something."""
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
        "job": jobs.of(ev),
        "attempt": ev.number("attempt", "worker event", required=False),
        "result": pd.Series(result, dtype=object),
    })
    _refuse_bad_times(ev, ev.nested["data"], ("end", "started"), "worker event")
    return events


def _faults(nem: _Table) -> list[dict[str, Any]]:
    """Faults: optional; every directory may hold some."""
    faults: list[dict[str, Any]] = []
    if not len(nem.columns["fault"]):
        return faults
    starts = nem.number("start", "fault", required=True, time=True)
    ends = nem.number("end", "fault", required=False, time=True)
    attempts = nem.number("attempt", "fault", required=False)
    phases = nem.nested["data"].field("phase", np.arange(len(starts))).tolist()
    for row, kind in enumerate(nem.columns["fault"]):
        if not isinstance(kind, str) or kind not in KNOWN_FAULTS:
            raise HistoryError(f"{nem.where(row)}: unknown fault kind {kind!r}")
        faults.append({
            "fault": kind,
            "start": float(starts[row]),
            "end": None if math.isnan(ends[row]) else float(ends[row]),
            "target": nem.columns["target"][row],
            "job_id": nem.job_id[row].as_py(),
            "attempt": None if math.isnan(attempts[row]) else int(attempts[row]),
            "skipped": nem.columns["skipped"][row],
            "phase": phases[row] if isinstance(phases[row], str) else None,
        })
    return faults


def _finals(fin: _Table, jobs: _Jobs) -> pd.DataFrame:
    fin.require_str("status", "final job state")
    statuses = pd.Series(pd.Categorical(pd.Series(fin.columns["status"], dtype=object)))
    known_status = statuses.isin([s.value for s in JobStatus])
    if not known_status.all():
        row = int(np.flatnonzero(~known_status.to_numpy())[0])
        raise HistoryError(f"{fin.where(row)}: unknown job status {statuses[row]!r}")
    return pd.DataFrame({
        "job": jobs.of(fin),
        "job_id": pd.Series(jobs.id_column(fin), dtype=object),
        "status": statuses,
    })
