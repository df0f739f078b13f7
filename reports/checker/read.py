"""Reading a run's history files: the CSV logs (and nemesis.jsonl) through Arrow's readers,
files in parallel, each file's cache looked up first (`skiplock.reports.columnar`); line by
line only to name a bad line. What each kind of log is read as (`Source`), and the run
directories and their log files, refused when they cannot be trusted."""

from __future__ import annotations

import codecs
import json
import math
import mmap
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
import pyarrow.csv as pacsv  # type: ignore[import-untyped]
import pyarrow.json as pajson  # type: ignore[import-untyped]

from skiplock.reports import columnar
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
    arrow_convert_options,
    parse_header,
    parse_row,
    unescape_text,
)

_BLOCK_BYTES = 8 << 20  # Arrow parses a file in blocks; a line must fit in one


_ARROW_TYPES: dict[ColumnKind, pa.DataType] = {"str": pa.string(), "num": pa.float64(),
                                               "bool": pa.bool_()}


@dataclass(frozen=True)
class Source:
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
                nest: Callable[[pa.RecordBatch], pa.RecordBatch] | None = None) -> Source:
    # Narrowed, so that the slow path, like Arrow, never parses a column nothing reads.
    read = replace(log, columns=tuple(c for c in log.columns if c[0] in names))
    schema = pa.schema([(name, _ARROW_TYPES[kind]) for name, kind in read.columns])
    shape = schema if nest is None else nest(pa.RecordBatch.from_pylist([], schema)).schema
    return Source(schema=schema, shape=shape, log=read, required=required, filled=filled,
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


# Columns of lease tokens (a worker event's, a delivery's): read only to key a queue's
# re-picks apart (`join.key_picks_by_lease`), so kept in Arrow as `job_id` is.
TOKENS = ("lease_token", "lease")


def _nest_event_data(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A worker event's own fields as one struct column `data`, as they were written."""
    data = pa.StructArray.from_arrays([batch.column(n) for n in _EVENT_DATA],
                                      names=list(_EVENT_DATA))
    base = [n for n in _EVENT_BASE if n in batch.schema.names]  # lease_token may be left out
    return pa.RecordBatch.from_arrays([*(batch.column(n) for n in base), data],
                                      names=[*base, "data"])


_ENQUEUES = _csv_source(
    ENQUEUE_LOG, (*_ENQUEUE_BASE, "script_name", "script_times", "first_behaviour",
                  "first_status", "first_seconds", "then_behaviour", "then_status",
                  "then_seconds"),
    required=("type", "job_id"), filled="type", nest=_nest_script)


_DELIVERY_COLUMNS = ("job_id", "attempt", "account", "worker", "target", "received",
                     "answered", "status", "behaviour", "lease")


_DELIVERIES = _csv_source(DELIVERY_LOG, _DELIVERY_COLUMNS, required=("job_id", "received"),
                          filled="received")


_EVENTS = _csv_source(
    WORKER_LOG, (*_EVENT_BASE, *_EVENT_DATA),
    required=("kind", "time"), filled="time", nest=_nest_event_data)


# The same without the lease tokens, for a queue whose attempt number names its claim: the
# tokens are then never read, and are a sixth of what the logs hold.
_DELIVERIES_WITHOUT_TOKENS = _csv_source(
    DELIVERY_LOG, tuple(n for n in _DELIVERY_COLUMNS if n not in TOKENS),
    required=("job_id", "received"), filled="received")


_EVENTS_WITHOUT_TOKENS = _csv_source(
    WORKER_LOG, tuple(n for n in (*_EVENT_BASE, *_EVENT_DATA) if n not in TOKENS),
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


_FAULTS = Source(schema=_FAULT_SCHEMA, shape=_FAULT_SCHEMA)


def _without_nulls(value: Any) -> Any:
    """A struct read by Arrow has every field of its schema; leave out the absent (null)
    ones, as they were in the file."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value


def _number(value: Any) -> float:
    """A value as read, as a float: NaN for anything but a number."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return math.nan


@dataclass
class Nested:
    """A column of objects (an enqueue's script, a worker event's data): Arrow struct
    columns (one per file, converted on demand) or, for a file read line by line, Python
    values."""

    parts: list[pa.ChunkedArray | list[Any]]
    starts: np.ndarray  # first row of each part

    def _by_part(self, rows: np.ndarray
                 ) -> Iterator[tuple[np.ndarray, np.ndarray, pa.ChunkedArray | list[Any]]]:
        """For `rows` (ascending), each part they fall in, in order: which of `rows` are in
        it (a mask), their rows within it, and the part."""
        which = np.searchsorted(self.starts, rows, side="right") - 1
        for k in np.unique(which).tolist():
            at = which == k
            yield at, rows[at] - self.starts[k], self.parts[k]

    def pick(self, rows: np.ndarray) -> list[Any]:
        """The values of `rows` (ascending), as Python dicts (or whatever the line held)."""
        out: list[Any] = []
        for _, local, part in self._by_part(rows):
            if isinstance(part, list):
                out.extend(part[i] for i in local.tolist())
            else:
                out.extend(map(_without_nulls, part.take(pa.array(local)).to_pylist()))
        return out

    def fields(self, names: Sequence[str], rows: np.ndarray) -> dict[str, list[Any]]:
        """Fields of the objects at `rows` (ascending) as Python values, None where absent:
        what `pick` and then `.get(name)` give, read column by column instead of through a
        dict per row."""
        out: dict[str, list[Any]] = {name: [] for name in names}
        for _, local, part in self._by_part(rows):
            if isinstance(part, list):
                picked = [data_dict(part[i]) for i in local.tolist()]
                for name in names:
                    out[name].extend(d.get(name) for d in picked)
                continue
            taken = pa.array(local)
            for name in names:
                out[name].extend(pc.struct_field(part, name).take(taken).to_pylist()
                                 if part.type.get_field_index(name) >= 0
                                 else [None] * len(local))
        return out

    def numbers(self, name: str, rows: np.ndarray) -> np.ndarray:
        """One number field of the objects at `rows` (ascending) as float64: NaN where it is
        absent or not a number. Arrow's columns are converted whole, without a Python value
        per row."""
        values = np.full(len(rows), np.nan)
        for at, local, part in self._by_part(rows):
            if isinstance(part, list):
                values[at] = [_number(data_dict(part[i]).get(name)) for i in local.tolist()]
            elif part.type.get_field_index(name) >= 0:
                column = pc.struct_field(part, name).take(pa.array(local))
                if pa.types.is_floating(column.type) or pa.types.is_integer(column.type):
                    values[at] = column.to_numpy(zero_copy_only=False).astype(np.float64)
                else:
                    values[at] = [_number(v) for v in column.to_pylist()]
        return values

    def field(self, name: str, rows: np.ndarray) -> np.ndarray:
        """One field of the objects at `rows` (ascending), None where absent; a text field's
        strings one object per distinct value (a write's result has few)."""
        values = np.full(len(rows), None, dtype=object)
        for at, local, part in self._by_part(rows):
            if isinstance(part, list):
                values[at] = [data_dict(part[i]).get(name) for i in local.tolist()]
            elif part.type.get_field_index(name) >= 0:
                column = pc.struct_field(part, name).take(pa.array(local))
                values[at] = (_coded(column).objects() if pa.types.is_string(column.type)
                              else column.to_numpy(zero_copy_only=False))
        return values


@dataclass
class Part:
    """One file's columns: numbers as float64 (NaN for null); text as `coded` for a file
    read by Arrow (an object array only once a table needs one: see `validate.Table`), as
    object arrays in `columns` for one read line by line; `job_id` and the lease tokens
    (`tokens`) kept in Arrow (one distinct value per job or claim, only ever looked up or
    matched: a Python string per row would cost more than parsing them); objects as
    `Nested` parts."""

    path: Path
    rows: int
    typed: bool  # read by Arrow: strings are str or None, numbers are numbers
    truncated: bool
    columns: dict[str, np.ndarray]
    job_id: pa.ChunkedArray
    tokens: dict[str, pa.ChunkedArray]
    nested: dict[str, pa.ChunkedArray | list[Any]]
    header_lines: int  # lines before the first record
    lines: list[int] | None = None  # line of each row, when blank lines were skipped
    empty: bool = False  # a CSV log of no bytes at all: cut off before its header
    coded: dict[str, Coded] = field(default_factory=dict)  # text columns read by Arrow


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


@dataclass(frozen=True)
class Coded:
    """A text column as Arrow's dictionary gave it: `codes` (int64, -1 for null) into
    `labels` (distinct str, in no order). The judge's categoricals and its checks for empty
    values are made from these, so no string is hashed twice."""

    codes: np.ndarray
    labels: np.ndarray

    def objects(self, rows: np.ndarray | None = None) -> np.ndarray:
        """The values (of `rows`, or all) as an object array of str / None, each distinct
        string one object."""
        codes = self.codes if rows is None else self.codes[rows]
        # Code -1 picks the None appended last.
        return cast(np.ndarray, np.append(self.labels, np.array([None]))[codes])


def _coded(column: pa.ChunkedArray) -> Coded:
    """An Arrow string column (of few distinct values) as codes into its distinct values,
    hashed once, by Arrow."""
    if len(column) == 0:
        return Coded(np.empty(0, dtype=np.int64), np.empty(0, dtype=object))
    encoded = column.combine_chunks().dictionary_encode()
    labels = encoded.dictionary.to_numpy(zero_copy_only=False)
    return Coded(encoded.indices.fill_null(-1).to_numpy().astype(np.int64), labels)


def _arrow_part(path: Path, table: pa.Table, truncated: bool, source: Source) -> Part:
    columns: dict[str, np.ndarray] = {}
    nested: dict[str, pa.ChunkedArray | list[Any]] = {}
    tokens: dict[str, pa.ChunkedArray] = {}
    coded: dict[str, Coded] = {}
    for f in table.schema:
        column = table.column(f.name)
        if pa.types.is_struct(f.type):
            nested[f.name] = column
        elif f.name in TOKENS:
            tokens[f.name] = column
        elif pa.types.is_floating(f.type):
            columns[f.name] = column.to_numpy()
        elif f.name != "job_id":
            coded[f.name] = _coded(column)
    return Part(path=path, rows=table.num_rows, typed=True, truncated=truncated,
                 columns=columns, job_id=table.column("job_id"), tokens=tokens,
                 nested=nested, header_lines=source.header_lines, coded=coded)


def _python_part(path: Path, rows: list[dict[str, Any]], lines: list[int],
                 source: Source, truncated: bool) -> Part:
    columns: dict[str, np.ndarray] = {}
    nested: dict[str, pa.ChunkedArray | list[Any]] = {}
    tokens: dict[str, pa.ChunkedArray] = {}
    for f in source.shape:
        if pa.types.is_struct(f.type):
            nested[f.name] = [r.get(f.name) for r in rows]
        elif f.name in TOKENS:
            tokens[f.name] = _arrow_strings([r.get(f.name) for r in rows])
        elif f.name != "job_id":
            values = np.empty(len(rows), dtype=object)
            values[:] = [r.get(f.name) for r in rows]
            columns[f.name] = values
    job_id = _arrow_strings([r.get("job_id") for r in rows])
    return Part(path=path, rows=len(rows), typed=False, truncated=truncated,
                 columns=columns, job_id=job_id, tokens=tokens, nested=nested,
                 header_lines=source.header_lines, lines=lines)


def _arrow_strings(values: list[Any]) -> pa.ChunkedArray:
    """Values read line by line as an Arrow string column: anything but a string is null."""
    return pa.chunked_array([pa.array([v if type(v) is str else None for v in values],
                                      pa.string())])


def _shaped(table: pa.Table, source: Source) -> pa.Table:
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


def _csv_header(path: Path, data: bytes | mmap.mmap, source: Source) -> list[str]:
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


def _read_csv(data: bytes | mmap.mmap, end: int, source: Source, *,
              threaded: bool) -> pa.Table | None:
    """The columns of a CSV log's first `end` bytes, parsed by Arrow, a row per line; None
    when Arrow cannot parse them, or they hold a blank line (or a record without its
    `filled` value). `threaded`: Arrow's thread pool parses its blocks too."""
    # A file of one block gains nothing from Arrow's thread pool, and a read that fails with
    # blocks still in flight on it can leave a pool thread running into interpreter exit,
    # where the C++ runtime aborts the process (seen once: exit -6 after a clean exit 2).
    threaded = threaded and end > _BLOCK_BYTES
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
    # reader does not): no writer leaves one, so such a file is read line by line. Only a
    # quoted value can hold a line break: a file without a quote needs no look (a memchr).
    if data.find(b'"', 0, end) >= 0:
        for f in table.schema:
            if pa.types.is_string(f.type) and pc.any(
                    pc.match_substring(table.column(f.name), "\n")).as_py():
                return None
    # Few fields ever hold an escape: look for a backslash before decoding any column.
    return _unescaped(table) if data.find(b"\\", 0, end) >= 0 else table


def _read_jsonl(data: bytes, source: Source) -> pa.Table | None:
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


def _read_part(path: Path, source: Source, cache_writes: columnar.BackgroundWrites, *,
               threaded: bool) -> Part:
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
    table = (_read_jsonl(data[:end], source) if names is None
             else _read_csv(data, end, source, threaded=threaded))
    if table is not None:
        if not truncated:
            cache_writes.store(cache, table, read_bytes=end)
        return _arrow_part(path, _shaped(table, source), truncated, source)
    rows, lines = (_parse_json_slow(path, data[:end]) if names is None
                   else _parse_csv_slow(path, data[:end], names, cast(LogFormat, source.log)))
    return _python_part(path, rows, lines, source, truncated)


def read_parts(jobs: Sequence[tuple[Path, Source]],
               cache_writes: columnar.BackgroundWrites) -> list[Part]:
    """Every file, read in parallel (Arrow parses without the GIL), returned in the given
    order; the tables of files parsed whole go to `cache_writes`. Files are parsed one per
    thread, largest first; only a file larger than a thread's share of all the bytes is
    also split among Arrow's threads. Blocks of many files parsed at once each hold their
    buffers: one file per thread keeps less memory in flight, and fresh memory is most of
    what a cold check costs."""
    threads = max(2, os.cpu_count() or 2)
    sizes = [_size(path) for path, _ in jobs]
    share = sum(sizes) / threads
    with ThreadPoolExecutor(max_workers=threads) as pool:
        futures = {i: pool.submit(_read_part, jobs[i][0], jobs[i][1], cache_writes,
                                  threaded=sizes[i] > share)
                   for i in sorted(range(len(jobs)), key=lambda i: -sizes[i])}
        return [futures[i].result() for i in range(len(jobs))]


def _size(path: Path) -> int:
    """The bytes of a history file, 0 when it cannot be looked at (its reader says why)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def data_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


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


def refuse_repeats(paths: Sequence[Path], what: str, kind: str) -> None:
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


def checked_run_dirs(run_dirs: Sequence[Path]) -> list[Path]:
    """The run directories, refused unless the first holds a run and each other one holds
    logs of it."""
    if not run_dirs:
        raise HistoryError("no run directory given")
    dirs = [Path(d) for d in run_dirs]
    for d in dirs:
        if not _is_dir(d):
            raise HistoryError(f"{d} is not a directory")
    refuse_repeats(dirs, "RUN_DIR", "directory")
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


def log_kinds(dirs: Sequence[Path], *, lease_tokens: bool
              ) -> list[tuple[str, list[Path], Source]]:
    """Each kind of log (named by its file or directory), its files in every directory,
    and how it is read; in the order `load` unpacks them. `lease_tokens`: whether the
    deliveries' and events' lease tokens (`TOKENS`) are read."""
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
        (DELIVERIES_DIR, delivery_files,
         _DELIVERIES if lease_tokens else _DELIVERIES_WITHOUT_TOKENS),
        (WORKERS_DIR, worker_files, _EVENTS if lease_tokens else _EVENTS_WITHOUT_TOKENS),
        (NEMESIS_FILE, nemesis_files, _FAULTS),
        (FINAL_JOBS_FILE, [main / FINAL_JOBS_FILE], _FINAL),
    ]
