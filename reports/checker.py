"""The checker: judge a run directory from its history alone and write `verdict.json`.

Reading. The first run directory must hold `spec.json`, `run.json`, `enqueues.jsonl`,
`final_jobs.jsonl`, a `deliveries/` directory and a `workers/` directory; `nemesis.jsonl` is
optional (absent or empty: no fault ran). Further directories add their `deliveries/*.jsonl`,
`workers/*.jsonl` and `nemesis.jsonl` (targets and workers on other machines). A file cut off
mid-line makes the answer "unknown" rather than judging half a history; a line that is not
JSON, or a record without its required fields, is bad input (`HistoryError`).

Judging. Each job's oracle (`reports.oracle`) comes from its enqueue (script, max_attempts,
account) and the run's configuration; the target's log says what was really delivered. The
whole-run checks are vectorised with pandas; the few suspicious rows they find are then
explained or not, one by one, against the recorded events (worker events and faults).

Timing tolerance: the target, the workers and the nemesis share one clock, but a worker logs
an event a little after it happened, so time comparisons allow `tolerance_seconds`.
"""

from __future__ import annotations

import gc
import json
import math
import re
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from operator import itemgetter
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import pandas as pd

from queue_impl.interface import JobStatus
from queue_impl.retry import RetryPolicy
from reports.history import (
    DELIVERIES_DIR,
    ENQUEUES_FILE,
    FINAL_JOBS_FILE,
    NEMESIS_FILE,
    RUN_FILE,
    SPEC_FILE,
    VERDICT_FILE,
    WORKERS_DIR,
    HistoryError,
    read_json,
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
# Counts that are a violated guarantee when non-zero (the rest describe the run).
VIOLATION_KEYS: tuple[str, ...] = (
    "lost",
    "unexpected",
    "duplicate_unexplained",
    "concurrent_delivery",
    "attempts_exceeded",
    "early_retry",
    "limit_exceeded",
    "stuck",
    "state_mismatch",
    "stale_write",
)
EXAMPLE_KINDS: tuple[str, ...] = (*VIOLATION_KEYS, "duplicate_explained")
MAX_EXAMPLES = 10
DEFAULT_TOLERANCE_SECONDS = 0.25

# Faults that hit one worker process: they explain what that worker held at the time.
_WORKER_FAULTS = frozenset({"kill_worker", "pause_worker", "crash_after_claim", "crash_after_http"})
# Faults that hit the queue's database: any result write in their window may have been lost.
_DATABASE_FAULTS = frozenset({"terminate_backends", "restart_postgres", "exhaust_pool"})
# Faults that last until they are healed; the others are instants.
_LASTING_FAULTS = frozenset({"pause_worker", "hang_target", "restart_postgres", "pin_xmin",
                             "exhaust_pool"})
_KNOWN_FAULTS = frozenset(_WORKER_FAULTS | _DATABASE_FAULTS | {"hang_target", "pin_xmin"})

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

    @property
    def violations(self) -> dict[str, int]:
        return {k: self.counts[k] for k in VIOLATION_KEYS if self.counts.get(k, 0) > 0}

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
# Reading: a fast JSON Lines loader (one json.loads per chunk of lines, collector paused).
# --------------------------------------------------------------------------------------------

_CHUNK_LINES = 200_000

# The writers in this package (JsonlWriter: compact separators, dataclass field order) produce
# one canonical layout per file. A line in that layout is read with one regular expression
# pass over the whole file, which is several times faster than json.loads; a file with any
# other line (hand-edited, another writer, escapes in a string we need) is read as JSON.
_STR = rb'("[^"\\\n]*+"|null)'
_NUM = rb"(-?[0-9][0-9.eE+-]*+|null)"
_SKIP_STR = rb'(?:"[^"\\\n]*+(?:\\.[^"\\\n]*+)*+"|null)'
_SKIP_NUM = rb"(?:-?[0-9][0-9.eE+-]*+|null)"
# An object nested at most one level (a job script), or null; possessive, so no backtracking.
_RAW = rb"(null|\{(?:[^{}\n]++|\{[^{}\n]*+\})*+\})"
_RAW_LAST = rb"(\{[^\n]*\}|null)"
_REST = rb"[^\n]*"

FieldKind = Literal["str", "num", "raw"]


@dataclass(frozen=True)
class _Format:
    pattern: re.Pattern[bytes]
    fields: tuple[tuple[str, FieldKind], ...]  # captured groups, in order


def _format(parts: Sequence[tuple[str, bytes]], *, rest: bool = False) -> _Format:
    kinds: dict[bytes, FieldKind] = {_STR: "str", _NUM: "num", _RAW: "raw", _RAW_LAST: "raw"}
    body = b",".join(b'"' + key.encode() + b'":' + value for key, value in parts)
    if rest:
        body += b"," + _REST
    fields = tuple((key, kinds[value]) for key, value in parts if value in kinds)
    return _Format(re.compile(rb"^\{" + body + rb"\}$", re.MULTILINE), fields)


_DELIVERY_FORMAT = _format([
    ("job_id", _STR), ("attempt", _NUM), ("account", _STR), ("worker", _STR),
    ("target", _STR), ("received", _NUM), ("answered", _NUM), ("status", _NUM),
    ("behaviour", _STR), ("seen", _SKIP_NUM), ("account_in_flight", _SKIP_NUM),
])
_EVENT_FORMAT = _format([
    ("kind", _STR), ("worker", _STR), ("time", _NUM), ("job_id", _STR), ("attempt", _NUM),
    ("data", _RAW_LAST),
])
_ENQUEUE_FORMAT = _format([
    ("type", _STR), ("job_id", _STR), ("time", _NUM), ("process", _SKIP_STR),
    ("account", _STR), ("target_url", _SKIP_STR), ("script", _RAW), ("max_attempts", _NUM),
    ("run_at", _SKIP_NUM), ("error", _SKIP_STR),
])
_FINAL_FORMAT = _format([("job_id", _STR), ("account_id", _SKIP_STR), ("status", _STR)],
                        rest=True)


@contextmanager
def _no_gc() -> Iterator[None]:
    # Millions of small objects make the cyclic collector run constantly while nothing here
    # creates cycles; pausing it halves the load time.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass
class _Table:
    """Columns read from one or more JSON Lines files, with where each row came from."""

    columns: dict[str, np.ndarray]
    source: list[str]  # file per file appended
    rows_per_file: list[int]

    def where(self, row: int) -> str:
        """"file:line" of a row (blank lines aside, rows are lines)."""
        offset = row
        for name, count in zip(self.source, self.rows_per_file, strict=True):
            if offset < count:
                return f"{name}:{1 + offset}"
            offset -= count
        return "?"


def _parse_slow(path: Path, data: bytes) -> list[dict[str, Any]]:
    """Line by line, to name the first bad line."""
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
            raise HistoryError(f"{path}:{number} is not valid JSON ({msg})") from None
        if not isinstance(value, dict):
            raise HistoryError(f"{path}:{number} is not a JSON object")
        rows.append(value)
    return rows


def _json_chunks(path: Path, data: bytes) -> list[list[dict[str, Any]]]:
    """The records of a file's complete lines, a chunk of lines per json.loads call."""
    lines = data[:-1].split(b"\n")
    chunks: list[list[dict[str, Any]]] = []
    for start in range(0, len(lines), _CHUNK_LINES):
        part = lines[start : start + _CHUNK_LINES]
        try:
            rows = json.loads(b"[" + b",".join(part) + b"]")
        except (json.JSONDecodeError, UnicodeDecodeError):
            rows = None
        if (
            not isinstance(rows, list)
            or len(rows) != len(part)
            or not all(type(r) is dict for r in rows)
        ):
            # Blank lines, a bad line, or a line holding two values: find out which.
            return [_parse_slow(path, data)]
        chunks.append(rows)
    return chunks


def _decode_strings(raw: list[bytes]) -> np.ndarray | None:
    """Quoted JSON strings (or null) as an object array of str / None. The layout admits
    no escapes, so the text between the quotes is the string; None if it is not UTF-8."""
    column = np.empty(len(raw), dtype=object)
    try:
        column[:] = [None if v == b"null" else v[1:-1].decode() for v in raw]
    except UnicodeDecodeError:
        return None
    return column


def _decode_numbers(raw: list[bytes]) -> np.ndarray | None:
    try:
        return np.fromiter(map(float, raw), np.float64, len(raw))
    except ValueError:
        pass  # nulls (or a malformed number): the slower route
    array = np.array(raw, dtype=np.bytes_)
    array[array == b"null"] = b"nan"
    try:
        return array.astype(np.float64)
    except ValueError:
        return None


def _fast_columns(data: bytes, fmt: _Format, keys: Sequence[str]) -> dict[str, np.ndarray] | None:
    """The columns of a file whose every line is in the canonical layout, else None."""
    lines = data.count(b"\n")
    matches = fmt.pattern.findall(data)
    if len(matches) != lines:
        return None
    if not matches:
        return {k: np.empty(0, dtype=object) for k in keys}
    names = [name for name, _ in fmt.fields]
    columns: dict[str, np.ndarray] = {}
    groups: list[tuple[Any, ...]] = (
        list(zip(*matches, strict=True)) if len(names) > 1 else [tuple(matches)])
    for (name, kind), raw in zip(fmt.fields, groups, strict=True):
        if name not in keys:
            continue
        values = list(raw)
        if kind == "str":
            strings = _decode_strings(values)
            if strings is None:
                return None
            columns[name] = strings
        elif kind == "num":
            numbers = _decode_numbers(values)
            if numbers is None:
                return None
            columns[name] = numbers
        else:
            column = np.array(values, dtype=object)
            column[column == b"null"] = None
            columns[name] = column
    for key in keys:
        if key not in columns:
            columns[key] = np.full(len(matches), None, dtype=object)
    return columns


def _json_columns(path: Path, data: bytes, keys: Sequence[str]) -> dict[str, np.ndarray]:
    pieces: dict[str, list[Any]] = {k: [] for k in keys}
    for rows in _json_chunks(path, data):
        try:
            picked = list(map(itemgetter(*keys), rows)) if len(keys) > 1 else [
                (r[keys[0]],) for r in rows]
            for key, values in zip(keys, zip(*picked, strict=True), strict=True):
                pieces[key].extend(values)
        except KeyError:
            for key in keys:
                pieces[key].extend([r.get(key) for r in rows])
    out: dict[str, np.ndarray] = {}
    for key, collected in pieces.items():
        column = np.empty(len(collected), dtype=object)
        column[:] = collected
        out[key] = column
    return out


class _Reader:
    """Reads the files of a run, remembering which were read and which were cut off."""

    def __init__(self) -> None:
        self.files: list[str] = []
        self.truncated: list[str] = []

    def table(self, paths: Sequence[Path], keys: Sequence[str],
              fmt: _Format | None = None) -> _Table:
        parts: dict[str, list[np.ndarray]] = {k: [] for k in keys}
        counts: list[int] = []
        with _no_gc():
            for path in paths:
                data = path.read_bytes()
                self.files.append(str(path))
                if data and not data.endswith(b"\n"):
                    # Cut off mid-write: judge the complete lines, answer "unknown".
                    self.truncated.append(str(path))
                    data = data[: data.rfind(b"\n") + 1]
                columns = None
                if fmt is not None and data:
                    columns = _fast_columns(data, fmt, keys)
                if columns is None:
                    columns = (_json_columns(path, data, keys) if data
                               else {k: np.empty(0, dtype=object) for k in keys})
                for key in keys:
                    parts[key].append(columns[key])
                counts.append(len(columns[keys[0]]))
        merged = {
            k: (np.concatenate(v) if len(v) > 1 else v[0]) if v
            else np.empty(0, dtype=object)
            for k, v in parts.items()
        }
        return _Table(columns=merged, source=[str(p) for p in paths], rows_per_file=counts)


def _require_str(table: _Table, key: str, what: str) -> None:
    values = table.columns[key]
    bad = [i for i, v in enumerate(values.tolist()) if type(v) is not str or not v]
    if bad:
        raise HistoryError(f"{table.where(bad[0])}: {what} has no {key}")


def _float_column(table: _Table, key: str, what: str, *, required: bool) -> np.ndarray:
    values = table.columns[key]
    array: np.ndarray | None
    if values.dtype == np.float64:
        array = values
    else:
        ok_types = [v is None or (isinstance(v, int | float) and not isinstance(v, bool))
                    for v in values.tolist()]
        if not all(ok_types):
            row = ok_types.index(False)
            raise HistoryError(f"{table.where(row)}: {what} field {key} is not a number")
        array = values.astype(np.float64)
    if required and np.isnan(array).any():
        row = int(np.flatnonzero(np.isnan(array))[0])
        raise HistoryError(f"{table.where(row)}: {what} field {key} is not a number")
    return array


def _data(value: Any) -> dict[str, Any]:
    """A worker event's `data`, parsed on demand (the fast reader keeps it as bytes)."""
    if type(value) is bytes:
        try:
            parsed = json.loads(value)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return value if isinstance(value, dict) else {}


def _write_result(value: Any) -> Any:
    # A write's data is flat, so this byte string can only be its own result field.
    if type(value) is bytes and b'"result":"applied"' in value:
        return "applied"
    return _data(value).get("result")


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


def _run_config(path: Path) -> RunConfig:
    raw = read_json(path)
    need = ("drained", "http_timeout_seconds", "lease_seconds", "retry_base_seconds",
            "retry_cap_seconds", "retry_jitter", "account_limits")
    missing = [k for k in need if k not in raw]
    if missing:
        raise HistoryError(f"{path} lacks {', '.join(missing)}")
    if not isinstance(raw["drained"], bool):
        raise HistoryError(f"{path}: drained must be true or false")
    try:
        retry = RetryPolicy(
            base_seconds=float(raw["retry_base_seconds"]),
            cap_seconds=float(raw["retry_cap_seconds"]),
            jitter=float(raw["retry_jitter"]),
        )
        timeout = float(raw["http_timeout_seconds"])
        lease = float(raw["lease_seconds"])
    except (TypeError, ValueError) as exc:
        raise HistoryError(f"{path}: bad retry or timing setting ({exc})") from None
    if not (timeout > 0 and lease > 0):
        raise HistoryError(f"{path}: http_timeout_seconds and lease_seconds must be positive")
    limits = raw["account_limits"]
    if not isinstance(limits, dict) or not all(
        v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)
        for v in limits.values()
    ):
        raise HistoryError(f"{path}: account_limits must map accounts to an integer or null")
    return RunConfig(
        drained=raw["drained"],
        exit_reason=str(raw.get("exit_reason", "completed")),
        http_timeout_seconds=timeout,
        lease_seconds=lease,
        retry=retry,
        account_limits={str(k): v for k, v in limits.items()},
    )


def _jsonl_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.jsonl") if p.is_file())


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
    events: pd.DataFrame
    faults: list[dict[str, Any]]
    final: pd.DataFrame
    files: list[str]
    truncated: list[str]
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
        if not d.is_dir():
            raise HistoryError(f"{d} is not a directory")
    main = dirs[0]
    for name in (SPEC_FILE, RUN_FILE, ENQUEUES_FILE, FINAL_JOBS_FILE):
        if not (main / name).is_file():
            raise HistoryError(f"{main / name} is missing (the first directory holds the run)")
    for name in (DELIVERIES_DIR, WORKERS_DIR):
        if not (main / name).is_dir():
            raise HistoryError(f"{main / name}/ is missing")
    for d in dirs[1:]:
        if not (d / DELIVERIES_DIR).is_dir() and not (d / WORKERS_DIR).is_dir():
            raise HistoryError(f"{d} holds neither {DELIVERIES_DIR}/ nor {WORKERS_DIR}/")

    reader = _Reader()
    read_json(main / SPEC_FILE)
    reader.files.append(str(main / SPEC_FILE))
    config = _run_config(main / RUN_FILE)
    reader.files.append(str(main / RUN_FILE))

    # Enqueues: the job universe and each job's oracle inputs.
    enq = reader.table(
        [main / ENQUEUES_FILE],
        ("type", "job_id", "time", "account", "script", "max_attempts"),
        _ENQUEUE_FORMAT,
    )
    _require_str(enq, "type", "enqueue")
    _require_str(enq, "job_id", "enqueue")
    types = pd.Series(enq.columns["type"], dtype=object)
    bad_type = ~types.isin(["invoke", "ok", "fail", "info"])
    if bad_type.any():
        row = int(np.flatnonzero(bad_type.to_numpy())[0])
        raise HistoryError(f"{enq.where(row)}: enqueue type {types[row]!r} is not "
                           "invoke, ok, fail or info")
    ids = pd.Series(enq.columns["job_id"], dtype=object)
    is_invoke = (types == "invoke").to_numpy()
    invoke_rows = np.flatnonzero(is_invoke)
    invoke_ids = ids.to_numpy()[invoke_rows]
    first = ~pd.Series(invoke_ids).duplicated().to_numpy()
    invoke_rows = invoke_rows[first]
    job_ids = pd.Index(ids.to_numpy()[invoke_rows], dtype=object)
    max_attempts_all = enq.columns["max_attempts"][invoke_rows]
    bad_max = [i for i, v in enumerate(max_attempts_all.tolist())
               if not isinstance(v, int | float) or isinstance(v, bool) or v != v
               or v < 1 or v != int(v)]
    if bad_max:
        raise HistoryError(f"{enq.where(int(invoke_rows[bad_max[0]]))}: invoke needs "
                           "max_attempts >= 1")
    max_attempts_raw = max_attempts_all.astype(np.int64)
    scripts_raw = enq.columns["script"][invoke_rows].tolist()
    # The fast reader keeps a script as its JSON text, which is its own key.
    keys = [s if type(s) is bytes else _script_key(s) for s in scripts_raw]
    script_codes, uniques = pd.factorize(pd.Series(keys, dtype=object), use_na_sentinel=False)
    scripts: list[tuple[Any, dict[str, Any] | None]] = []
    for code in range(len(uniques)):
        at = int(np.flatnonzero(script_codes == code)[0])
        raw_script = scripts_raw[at]
        if type(raw_script) is bytes:
            try:
                raw_script = json.loads(raw_script)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raw_script = "?"
        if raw_script is not None and not isinstance(raw_script, dict):
            raise HistoryError(f"{enq.where(int(invoke_rows[at]))}: script is not an object")
        scripts.append((uniques[code], raw_script))
    # Answers: ok beats info beats fail (an info that later turned out ok is ok).
    answer_rows = np.flatnonzero(~is_invoke)
    answer_codes = job_ids.get_indexer(ids.to_numpy()[answer_rows])
    if (answer_codes < 0).any():
        row = int(answer_rows[np.flatnonzero(answer_codes < 0)[0]])
        raise HistoryError(f"{enq.where(row)}: {types[row]} for job {ids[row]} without an invoke")
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
    delivery_files = [p for d in dirs if (d / DELIVERIES_DIR).is_dir()
                      for p in _jsonl_files(d / DELIVERIES_DIR)]
    dl = reader.table(
        delivery_files,
        ("job_id", "attempt", "account", "worker", "target", "received", "answered", "status",
         "behaviour"),
        _DELIVERY_FORMAT,
    )
    _require_str(dl, "job_id", "delivery")
    deliveries = pd.DataFrame({
        "job": job_ids.get_indexer(pd.Index(dl.columns["job_id"], dtype=object)),
        "job_id": pd.Series(dl.columns["job_id"], dtype=object),
        "attempt": _float_column(dl, "attempt", "delivery", required=False),
        "account": pd.Series(dl.columns["account"], dtype=object),
        "worker": pd.Series(dl.columns["worker"], dtype=object),
        "target": pd.Series(dl.columns["target"], dtype=object),
        "received": _float_column(dl, "received", "delivery", required=True),
        "answered": _float_column(dl, "answered", "delivery", required=False),
        "status": _float_column(dl, "status", "delivery", required=False),
        "behaviour": pd.Series(dl.columns["behaviour"], dtype=object),
    })
    del dl

    # Worker events, merged over every worker of every directory.
    worker_files = [p for d in dirs if (d / WORKERS_DIR).is_dir()
                    for p in _jsonl_files(d / WORKERS_DIR)]
    ev = reader.table(
        worker_files, ("kind", "worker", "time", "job_id", "attempt", "data"), _EVENT_FORMAT)
    _require_str(ev, "kind", "worker event")
    # Only writes need a field of `data` for every row; the rest is parsed for the few
    # events that explain something.
    result = np.full(len(ev.columns["kind"]), None, dtype=object)
    writes = np.flatnonzero(ev.columns["kind"] == "write")
    result[writes] = [_write_result(v) for v in ev.columns["data"][writes].tolist()]
    events = pd.DataFrame({
        "kind": pd.Series(ev.columns["kind"], dtype=object),
        "worker": pd.Series(ev.columns["worker"], dtype=object),
        "time": _float_column(ev, "time", "worker event", required=True),
        "job": job_ids.get_indexer(pd.Index(ev.columns["job_id"], dtype=object)),
        "attempt": _float_column(ev, "attempt", "worker event", required=False),
        "result": result,
        "data": ev.columns["data"],
    })
    del ev

    # Faults: optional; every directory may hold some.
    faults: list[dict[str, Any]] = []
    nemesis_files = [d / NEMESIS_FILE for d in dirs if (d / NEMESIS_FILE).is_file()]
    nem = reader.table(nemesis_files,
                       ("fault", "start", "end", "target", "job_id", "attempt", "skipped"))
    if len(nem.columns["fault"]):
        starts = _float_column(nem, "start", "fault", required=True)
        ends = _float_column(nem, "end", "fault", required=False)
        attempts = _float_column(nem, "attempt", "fault", required=False)
        for row, kind in enumerate(nem.columns["fault"]):
            if kind not in _KNOWN_FAULTS:
                raise HistoryError(f"{nem.where(row)}: unknown fault kind {kind!r}")
            faults.append({
                "fault": kind,
                "start": float(starts[row]),
                "end": None if math.isnan(ends[row]) else float(ends[row]),
                "target": nem.columns["target"][row],
                "job_id": nem.columns["job_id"][row],
                "attempt": None if math.isnan(attempts[row]) else int(attempts[row]),
                "skipped": nem.columns["skipped"][row],
            })

    # Final states.
    fin = reader.table([main / FINAL_JOBS_FILE], ("job_id", "status"), _FINAL_FORMAT)
    _require_str(fin, "job_id", "final job state")
    _require_str(fin, "status", "final job state")
    statuses = pd.Series(fin.columns["status"], dtype=object)
    known_status = statuses.isin([s.value for s in JobStatus])
    if not known_status.all():
        row = int(np.flatnonzero(~known_status.to_numpy())[0])
        raise HistoryError(f"{fin.where(row)}: unknown job status {statuses[row]!r}")
    final = pd.DataFrame({
        "job": job_ids.get_indexer(pd.Index(fin.columns["job_id"], dtype=object)),
        "job_id": pd.Series(fin.columns["job_id"], dtype=object),
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
        files=reader.files,
        truncated=reader.truncated,
        worker_files=len(worker_files),
    )


# --------------------------------------------------------------------------------------------
# Explanations: the recorded events that make a redelivery legitimate.
# --------------------------------------------------------------------------------------------


def _as_epoch(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            return None
    return None


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows as dicts of plain Python values (much faster than DataFrame.to_dict)."""
    names = [str(c) for c in frame.columns]
    values = [frame[c].tolist() for c in frame.columns]
    return [dict(zip(names, row, strict=True)) for row in zip(*values, strict=True)]


def _fmt(seconds: float) -> str:
    return f"{seconds:.3f}"


_DATA_FIELDS = ("name", "lost", "locked_until", "error", "reason")


def _with_data(rec: dict[str, Any]) -> dict[str, Any]:
    """An event record with the fields of its `data` the explanations read."""
    data = _data(rec.pop("data", None))
    for key in _DATA_FIELDS:
        rec[key] = data.get(key)
    if rec.get("result") is None:
        rec["result"] = data.get("result")
    return rec


class _Explainer:
    """Looks up, for one delivery, a recorded event that overlaps its attempt."""

    def __init__(self, history: _History, jobs: np.ndarray, tolerance: float) -> None:
        self.cfg = history.config
        self.tol = tolerance
        self.faults = [f for f in history.faults if not f.get("skipped")]
        ev = history.events
        subset = ev[ev["job"].isin(jobs)] if len(jobs) else ev.iloc[:0]
        self.by_attempt: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
        self.attempts_of: dict[int, set[int]] = defaultdict(set)
        for rec in _records(subset):
            if not math.isnan(rec["attempt"]):
                key = (int(rec["job"]), int(rec["attempt"]))
                self.by_attempt[key].append(_with_data(rec))
                self.attempts_of[key[0]].add(key[1])
        # Worker-wide deaths: a failpoint or an error stop ends every lease the worker held.
        self.deaths: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for rec in _records(ev[ev["kind"].isin(["failpoint", "stop"])]):
            rec = _with_data(rec)
            if rec["kind"] == "failpoint" or str(rec["reason"]).startswith("error"):
                self.deaths[str(rec["worker"])].append(rec)

    def worker_of(self, job: int, attempt: float, header: Any) -> str | None:
        if isinstance(header, str) and header:
            return header
        if not math.isnan(attempt):
            for rec in self.by_attempt.get((job, int(attempt)), ()):
                if rec["kind"] == "claim":
                    return str(rec["worker"])
        return None

    def lease_end(self, job: int, attempt: float, received: float) -> float:
        """When the lease of this attempt ran out: the last locked_until the worker recorded,
        else (claim time or, failing that, the delivery time) plus the lease."""
        start = received
        latest: float | None = None
        if not math.isnan(attempt):
            for rec in self.by_attempt.get((job, int(attempt)), ()):
                if rec["kind"] == "claim":
                    start = min(start, float(rec["time"]))
                if rec["kind"] in ("claim", "renew") and not rec["lost"]:
                    until = _as_epoch(rec["locked_until"])
                    if until is not None:
                        latest = until if latest is None else max(latest, until)
        return latest if latest is not None else start + self.cfg.lease_seconds

    def has_applied_write(self, job: int, attempt: float) -> bool:
        if math.isnan(attempt):
            return False
        return any(rec["kind"] == "write" and rec["result"] == "applied"
                   for rec in self.by_attempt.get((job, int(attempt)), ()))

    def explain(self, d: dict[str, Any], until: float, *, timeouts: bool = True) -> str | None:
        """A one-line reason why the attempt that made delivery `d` may be executed again
        before `until` (the next delivery), or None. `timeouts` False leaves out HTTP
        timeouts (the caller judges those by time)."""
        timeout = self.cfg.http_timeout_seconds
        job = int(d["job"])
        attempt = d["attempt"]
        label = "?" if math.isnan(attempt) else str(int(attempt))
        answered = d["answered"]
        # A timeout explains a redelivery only once the worker had given up on the call.
        if (timeouts and not math.isnan(answered)
                and answered - d["received"] >= timeout - self.tol
                and until >= d["received"] + timeout - self.tol):
            return (f"HTTP timeout: the target answered attempt {label} after "
                    f"{answered - d['received']:.2f}s, past the {timeout:g}s timeout")
        if not math.isnan(attempt):
            for rec in self.by_attempt.get((job, int(attempt)), ()):
                if (timeouts and rec["kind"] == "http"
                        and rec["result"] in ("timeout", "connection_error")
                        and until >= float(rec["time"]) - self.tol):
                    return (f"worker {rec['worker']} recorded an HTTP {rec['result']} "
                            f"for attempt {label}")
                if rec["kind"] == "write" and rec["result"] == "info":
                    error = f" ({rec['error']})" if rec["error"] else ""
                    return (f"connection lost during the result write of attempt {label} "
                            f"by {rec['worker']}{error}")
                if rec["kind"] == "failpoint":
                    return (f"failpoint {rec['name']} fired in {rec['worker']} at "
                            f"{_fmt(rec['time'])} for attempt {label}")
        worker = self.worker_of(job, attempt, d["worker"])
        lo, hi = d["received"] - self.tol, until + self.tol
        if worker is not None:
            for rec in self.deaths.get(worker, ()):
                if lo <= rec["time"] <= hi:
                    what = (f"failpoint {rec['name']}" if rec["kind"] == "failpoint"
                            else f"error stop ({rec['reason']})")
                    return (f"{what} ended {worker} at {_fmt(rec['time'])} while it held "
                            f"attempt {label}")
        for fault in self.faults:
            kind = fault["fault"]
            start = fault["start"]
            end = fault["end"]
            if end is None:
                end = math.inf if kind in _LASTING_FAULTS else start
            if not (start <= hi and end >= lo):
                continue
            hits = False
            if kind in _WORKER_FAULTS:
                hits = (worker is not None and fault["target"] == worker) or (
                    fault["job_id"] == d["job_id"]
                    and (fault["attempt"] is None or str(fault["attempt"]) == label)
                )
            elif kind in _DATABASE_FAULTS:
                hits = True
            elif kind == "hang_target":
                hits = fault["target"] in (None, d["target"])
            if hits:
                target = fault["target"] or "the run"
                return (f"{kind} on {target} at {_fmt(start)}"
                        f"{'' if end == start else '-' + _fmt(end)} overlaps attempt {label}")
        return None

    def fault_touched(self, job: int, job_id: str) -> str | None:
        """A recorded fault that hit one of this job's attempts without a delivery to show
        for it (a crash after claim, a kill before the call)."""
        for attempt in sorted(self.attempts_of.get(job, ())):
            for rec in self.by_attempt[(job, attempt)]:
                if rec["kind"] == "failpoint":
                    return f"failpoint {rec['name']} fired for attempt {attempt}"
                if rec["kind"] == "claim":
                    worker = str(rec["worker"])
                    lo = float(rec["time"]) - self.tol
                    hi = self.lease_end(job, float(attempt), float(rec["time"])) + self.tol
                    for death in self.deaths.get(worker, ()):
                        if lo <= death["time"] <= hi:
                            return f"{worker} died while it held attempt {attempt}"
                    for fault in self.faults:
                        if fault["fault"] in _WORKER_FAULTS and fault["target"] == worker:
                            end = fault["end"] if fault["end"] is not None else (
                                math.inf if fault["fault"] in _LASTING_FAULTS
                                else fault["start"])
                            if fault["start"] <= hi and end >= lo:
                                return (f"{fault['fault']} on {worker} overlaps attempt "
                                        f"{attempt}")
        for fault in self.faults:
            if fault["job_id"] == job_id:
                return f"{fault['fault']} hit attempt {fault['attempt']}"
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
    n_jobs = len(h.job_ids)

    # Oracles, one per distinct (script, max_attempts).
    cache = OracleCache(timeout)
    expected_completed = np.zeros(n_jobs, dtype=bool)
    pairs = pd.DataFrame({"s": h.job_script, "m": h.job_max_attempts})
    for group, idx in pairs.groupby(["s", "m"], sort=False).indices.items():
        s, m = cast(tuple[int, int], group)
        key, raw = h.scripts[int(s)]
        try:
            script = script_from_payload(raw)
        except (KeyError, ValueError, TypeError) as exc:
            job_id = h.job_ids[int(idx[0])]
            raise HistoryError(f"enqueue of job {job_id}: unreadable script ({exc})") from None
        oracle = cache.get(repr(key), script, int(m))
        expected_completed[idx] = oracle.expected is Expected.COMPLETED

    # ---- deliveries -------------------------------------------------------------------------
    d = h.deliveries
    found.counts["delivered"] = len(d)
    unknown_job = d["job"].to_numpy() < 0
    acked = h.job_ack
    failed_enqueue = np.zeros(len(d), dtype=bool)
    known = ~unknown_job
    failed_enqueue[known] = acked[d["job"].to_numpy()[known]] == -1
    for rec in _records(d[unknown_job | failed_enqueue]):
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
    # Early retries: the delivery after one the worker saw fail transiently.
    n_for_policy = np.where(np.isnan(attempt), position, np.minimum(position, attempt))
    n_for_policy = np.maximum(n_for_policy, 1).astype(np.int64)
    # The policy itself decides each bound (a few distinct attempt numbers, looked up).
    numbers = np.unique(n_for_policy)
    bounds = np.array([cfg.retry.min_delay(int(n)) for n in numbers], dtype=np.float64)
    min_delay = bounds[np.searchsorted(numbers, n_for_policy)] if len(numbers) else (
        np.zeros(0))
    fail_seen = np.where(in_time, answered,
                         np.where(late | hang_forever, received + timeout - tolerance, received))
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

    # Final states.
    f = h.final
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
    failed_with_2xx = is_failed & in_time_2xx
    failed_vs_oracle = is_failed & expected_completed & ~in_time_2xx
    # A job its oracle dead-letters and the queue dead-lettered needs no closer look.
    lost_candidate = (acked == 1) & ~any_2xx & ~is_live & ~(is_failed & ~expected_completed)
    for mask in (completed_no_2xx, failed_with_2xx, failed_vs_oracle, lost_candidate):
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

    explained_extra: dict[int, int] = defaultdict(int)
    explained_dups: set[int] = set()
    explained_any: dict[int, str] = {}

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
            explained_extra[j] += 1
            explained_dups.add(int(i))
            explained_any[j] = dup_why
            found.add("duplicate_explained", job_id, dup_why)

    # Concurrent deliveries: overlapping an earlier one still in flight at the target.
    for i in conc_rows.tolist():
        j = int(job[i])
        overlapping = [r for r in job_rows[j] if r < i and target_end[r] > received[i]]
        reasons: list[str] = []
        for r in overlapping:
            rec = records[r]
            why = None
            if ((late[r] or (hang_forever[r] and not is_answered[r]))
                    and received[i] >= received[r] + timeout - tolerance):
                why = (f"attempt {_label(attempt[r])} was abandoned at its "
                       f"{timeout:g}s HTTP timeout")
            if why is None and received[i] >= explainer.lease_end(
                    j, float(attempt[r]), float(received[r])) - tolerance:
                why = f"the lease of attempt {_label(attempt[r])} had expired"
            if why is None:
                why = explainer.explain(rec, float(received[i]), timeouts=False)
            if why is None:
                found.add("concurrent_delivery", h.job_ids[j],
                          f"delivery at {_fmt(received[i])} (attempt {_label(attempt[i])}) "
                          f"while attempt {_label(attempt[r])} from {_fmt(received[r])} "
                          "was still in flight with its lease held")
                break
            reasons.append(why)
        else:
            if int(i) not in explained_dups:
                explained_extra[j] += 1
            if reasons:
                explained_any[j] = reasons[0]

    # Early retries.
    for p in early_prev_rows.tolist():
        j = int(job[p])
        i = p + 1
        if received[i] >= explainer.lease_end(j, float(attempt[p]), float(received[p])) \
                - tolerance and not explainer.has_applied_write(j, float(attempt[p])):
            continue  # the lease expired: recovery makes the job due at once
        # Nothing else excuses it: a timeout or a fault is still a transient failure whose
        # write sets the backoff, and without that write the lease holds the job.
        gap = received[i] - fail_seen[p]
        found.add("early_retry", h.job_ids[j],
                  f"retry at {_fmt(received[i])} came {gap:.3f}s after attempt "
                  f"{_label(attempt[p])} failed; the backoff allows no less than "
                  f"{min_delay[p]:.3f}s")

    # Attempts: beyond max_attempts (explained redeliveries aside), or after a permanent
    # failure.
    over = np.flatnonzero(delivered_per_job > h.job_max_attempts)
    exceeded: dict[int, str] = {}
    for j in over.tolist():
        extra = explained_extra.get(j, 0)
        count = int(delivered_per_job[j])
        if count - extra > h.job_max_attempts[j]:
            exceeded[j] = (f"{count} deliveries ({extra} explained) for max_attempts "
                           f"{h.job_max_attempts[j]}")
    for i in after_perm_rows.tolist():
        j = int(job[i])
        if j in exceeded:
            continue
        perm = [r for r in job_rows[j] if r < i and seen[r] == _PERMANENT][-1]
        if explainer.explain(records[perm], float(received[i])) is None:
            exceeded[j] = (f"delivered again at {_fmt(received[i])} after attempt "
                           f"{_label(attempt[perm])} failed permanently "
                           f"(status {int(status[perm])})")
    for j, why in exceeded.items():
        found.add("attempts_exceeded", h.job_ids[j], why)

    # Account limits, from delivery intervals as the queue sees them: a delivery the worker
    # abandoned on its timeout no longer holds a slot.
    _check_limits(h, d, job, received, answered, target_end, is_answered, late, hang_forever,
                  timeout, tolerance, found)

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
    for j in np.flatnonzero(failed_with_2xx).tolist():
        ok_rows = [r for r in job_rows[j] if success_2xx[r] and in_time[r]]
        reason = None
        for r in ok_rows:
            nxt_time = next_received[r] if same_next[r] else math.inf
            reason = explainer.explain(records[r], float(nxt_time))
            if reason is not None:
                break
        if reason is None:
            found.add("state_mismatch", h.job_ids[j],
                      f"FAILED although the target answered 2xx to attempt "
                      f"{_label(attempt[ok_rows[0]])} and nothing explains it")
    fault_consumed: dict[int, str | None] = {}

    def consumed(j: int) -> str | None:
        if j not in fault_consumed:
            reason = explained_any.get(j)
            if reason is None:
                for r in job_rows[j]:
                    nxt_time = next_received[r] if same_next[r] else math.inf
                    reason = explainer.explain(records[r], float(nxt_time))
                    if reason is not None:
                        break
            if reason is None:
                reason = explainer.fault_touched(j, str(h.job_ids[j]))
            fault_consumed[j] = reason
        return fault_consumed[j]

    for j in np.flatnonzero(failed_vs_oracle).tolist():
        if consumed(j) is None:
            found.add("state_mismatch", h.job_ids[j],
                      "FAILED but its script completes within max_attempts "
                      f"({int(delivered_per_job[j])} deliveries, no fault recorded)")
    for j in np.flatnonzero(lost_candidate).tolist():
        if is_missing[j]:
            found.add("lost", h.job_ids[j],
                      "enqueue acknowledged, never delivered with 2xx, absent from the "
                      "final states")
        elif is_completed[j]:
            found.add("lost", h.job_ids[j],
                      "enqueue acknowledged, marked COMPLETED but never delivered with 2xx")
        elif is_failed[j] and (not expected_completed[j] or consumed(j) is not None):
            continue  # legitimately dead-lettered
        else:
            found.add("lost", h.job_ids[j],
                      f"enqueue acknowledged, FAILED after {int(delivered_per_job[j])} "
                      "deliveries without 2xx, though its script completes and no fault "
                      "consumed its attempts")

    # Stale writes.
    if len(stale_candidates):
        claim_recs = claims[claims["job"].isin(stale_candidates["job"])]
        by_job: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
        for rec in _records(claim_recs):
            by_job[int(rec["job"])].append((rec["attempt"], rec["time"], str(rec["worker"])))
        for rec in _records(stale_candidates):
            later = [c for c in by_job[int(rec["job"])]
                     if c[0] > rec["attempt"] and c[1] < rec["time"] - tolerance]
            if later:
                a, t, w = min(later, key=lambda c: c[1])
                found.add("stale_write", h.job_ids[int(rec["job"])],
                          f"{rec['worker']} applied its result for attempt "
                          f"{_label(rec['attempt'])} at {_fmt(rec['time'])}, after {w} "
                          f"claimed attempt {_label(a)} at {_fmt(t)}")

    if n_jobs == 0:
        unknown.append("no job was enqueued: there is nothing to judge")
    # Every worker the target saw must have left its event log, or its faults are unknown.
    silent = sorted(set(h.deliveries["worker"].dropna().unique().tolist())
                    - set(h.events["worker"].dropna().unique().tolist()))
    if silent and len(h.events):
        shown = ", ".join(map(str, silent[:5])) + (" ..." if len(silent) > 5 else "")
        unknown.append(f"no worker event log for {shown}, though the target saw its "
                       "deliveries")

    found.counts["enqueued"] = int((acked == 1).sum())
    details = {
        "enqueue_invoked": n_jobs,
        "enqueue_unknown": int((acked == 0).sum()),
        "enqueue_failed": int((acked == -1).sum()),
        "jobs_live": int((is_live & exists).sum()),
        "faults": len(h.faults),
        "faults_skipped": sum(1 for f_ in h.faults if f_.get("skipped")),
        "worker_events": len(h.events),
        "distinct_oracles": len(cache._cache),
    }
    return found, unknown, details


def _label(value: Any) -> str:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "?"
    return "?" if math.isnan(number) else str(int(number))


def _check_limits(h: _History, d: pd.DataFrame, job: np.ndarray, received: np.ndarray,
                  answered: np.ndarray, target_end: np.ndarray, is_answered: np.ndarray,
                  late: np.ndarray, hang_forever: np.ndarray, timeout: float, tolerance: float,
                  found: _Findings) -> None:
    limits = {k: v for k, v in h.config.account_limits.items() if v is not None}
    if not limits or not len(d):
        return
    # The account comes from the enqueue (configuration), not from a header the queue sent.
    account = h.job_account[job]
    header_account = d["account"].to_numpy()
    account = np.where(pd.isna(account), header_account, account)
    limit = pd.Series(account).map(limits).to_numpy(dtype="float64")
    limited = ~np.isnan(limit)
    if not limited.any():
        return
    abandoned = received + timeout - tolerance
    queue_end = np.where(late | (~is_answered & hang_forever), np.minimum(target_end, abandoned),
                         target_end)
    rows = np.flatnonzero(limited)
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
    for row, count in zip(events["row"].to_numpy()[over], running[over], strict=True):
        found.add("limit_exceeded", h.job_ids[int(job[row])],
                  f"account {account[row]} had {int(count)} deliveries in flight at "
                  f"{_fmt(received[row])}, limit {int(limit[row])}")


def check_run(run_dirs: Sequence[Path], *,
              tolerance_seconds: float = DEFAULT_TOLERANCE_SECONDS) -> Verdict:
    """Judge the run recorded in `run_dirs` (the first holds the run; the others add
    delivery, worker and fault logs). Raises HistoryError when the history cannot be read."""
    started, cpu_started = time.perf_counter(), time.process_time()
    history = _load(run_dirs)
    loaded, cpu_loaded = time.perf_counter(), time.process_time()
    found, unknown, details = _judge(history, tolerance_seconds)
    judged, cpu_judged = time.perf_counter(), time.process_time()
    for path in history.truncated:
        unknown.append(f"{path} is truncated mid-line")
    if history.config.exit_reason != "completed":
        unknown.append(f"the run ended with {history.config.exit_reason!r}")
    if found.counts["delivered"] and not len(history.events):
        unknown.append("deliveries were recorded but no worker events: nothing can explain a "
                       "redelivery")
    valid: Valid
    if any(found.counts[k] > 0 for k in VIOLATION_KEYS):
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
