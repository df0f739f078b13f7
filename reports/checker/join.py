"""Joining the validated tables into one history: the job universe from the enqueues (each
job's code, oracle inputs and acknowledgement), every log's job ids as codes, the
deliveries, worker events, faults and final states as frames (`History`), and a queue's
re-picks keyed by lease token (`key_picks_by_lease`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast, get_args

import numpy as np
import pandas as pd
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]

from skiplock.queue_impl.interface import JobStatus
from skiplock.reports.checker.common import floats
from skiplock.reports.checker.faults import KNOWN_FAULTS
from skiplock.reports.checker.read import Nested
from skiplock.reports.checker.run_config import RunConfig
from skiplock.reports.checker.validate import Table, refuse_bad_times
from skiplock.reports.history import (
    HistoryError,
    WorkerEventKind,
)

# The oracle walks a job's attempts one by one: a larger max_attempts is no run's, and would
# hold the checker for hours.
_MAX_ATTEMPTS = 1_000_000


def _script_codes(table: Table, rows: np.ndarray) -> tuple[np.ndarray, list[Any]]:
    """A code per row of `rows` that is equal for equal scripts, and each code's script."""
    nested = table.nested["script"]
    if table.typed:
        # Equal scripts have equal codes in every leaf (and in whether each object is there).
        parts = [cast(pa.ChunkedArray, part) for part in nested.parts]
        # Taken from the chunks as they are: only the invokes' rows are copied.
        column = pa.chunked_array([c for part in parts for c in part.chunks],
                                  parts[0].type).take(pa.array(rows)).combine_chunks()
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


@dataclass
class JobUniverse:
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
    def read(cls, enq: Table, tables: Sequence[Table]) -> JobUniverse:
        # Few distinct types: as a categorical, comparing a million of them is cheap.
        types = pd.Series(enq.categorical("type"))
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
            account=enq.text("account", invoke_rows),
            max_attempts=max_attempts,
            script_codes=np.asarray(script_codes, dtype=np.int64),
            scripts=scripts,
            ack=ack,
            codes={id(t): job_of_id[i] for t, i in zip(tables, ids, strict=True)},
            due=_due(enq, types, job_of_id[enq_ids], invoke_rows, len(job_ids)),
        )

    def of(self, table: Table) -> np.ndarray:
        return self.codes[id(table)]

    def id_column(self, table: Table) -> np.ndarray:
        """The job id of each row, as the job's string (one per job, shared)."""
        codes = self.of(table)
        out = (np.asarray(self.job_ids, dtype=object)[np.maximum(codes, 0)]
               if len(self.job_ids) else np.full(len(codes), None, dtype=object))
        unknown = np.flatnonzero(codes < 0)
        if len(unknown):
            out[unknown] = table.job_id.take(pa.array(unknown)).to_numpy(zero_copy_only=False)
        return cast(np.ndarray, out)


def _max_attempts(enq: Table, invoke_rows: np.ndarray) -> np.ndarray:
    max_attempts_all: np.ndarray = enq.number("max_attempts", "enqueue",
                                              required=False)[invoke_rows]
    bad_max = np.flatnonzero(~(max_attempts_all >= 1) | (max_attempts_all % 1 != 0)
                             | (max_attempts_all > _MAX_ATTEMPTS))
    if len(bad_max):
        raise HistoryError(f"{enq.where(int(invoke_rows[bad_max[0]]))}: invoke needs "
                           f"max_attempts >= 1 (a whole number, at most {_MAX_ATTEMPTS})")
    return max_attempts_all.astype(np.int64)


def _scripts(enq: Table, invoke_rows: np.ndarray
             ) -> tuple[np.ndarray, list[tuple[Any, dict[str, Any] | None]]]:
    script_codes, script_values = _script_codes(enq, invoke_rows)
    scripts: list[tuple[Any, dict[str, Any] | None]] = []
    for code, raw_script in enumerate(script_values):
        if raw_script is not None and not isinstance(raw_script, dict):
            at = int(np.flatnonzero(script_codes == code)[0])
            raise HistoryError(f"{enq.where(int(invoke_rows[at]))}: script is not an object")
        scripts.append((_script_key(raw_script), raw_script))
    return script_codes, scripts


def _acks(enq: Table, types: pd.Series, enq_jobs: np.ndarray, n_jobs: int) -> np.ndarray:
    """Each job's acknowledgement: ok beats info beats fail (an info that later turned out
    ok is ok)."""
    answer_rows = np.flatnonzero((types != "invoke").to_numpy())
    answer_codes = enq_jobs[answer_rows]
    if (answer_codes < 0).any():
        row = int(answer_rows[np.flatnonzero(answer_codes < 0)[0]])
        job_id = enq.job_id.take(pa.array([row]))[0].as_py()
        raise HistoryError(f"{enq.where(row)}: {types[row]} for job {job_id} without an invoke")
    job_ack = np.zeros(n_jobs, dtype=np.int8)
    answer_types = types.iloc[answer_rows]
    for answer, value in (("fail", -1), ("info", 0), ("ok", 1)):
        job_ack[answer_codes[(answer_types == answer).to_numpy()]] = value
    return job_ack


def _due(enq: Table, types: pd.Series, enq_jobs: np.ndarray, invoke_rows: np.ndarray,
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


def deliveries_of(dl: Table, jobs: JobUniverse) -> pd.DataFrame:
    """Deliveries, merged over every target of every directory. A request without the job
    id header has an empty job_id, read as null: judged as an unexpected delivery, not as
    an unreadable history."""
    deliveries = pd.DataFrame({
        "job": jobs.of(dl),
        "job_id": pd.Series(jobs.id_column(dl), dtype=object),
        "attempt": dl.number("attempt", "delivery", required=False),
        # Few distinct values each: categoricals, made from the codes Arrow gave.
        "account": dl.categorical("account"),
        "worker": dl.categorical("worker"),
        "target": dl.categorical("target"),
        "received": dl.number("received", "delivery", required=True, time=True),
        "answered": dl.number("answered", "delivery", required=False, time=True),
        "status": dl.number("status", "delivery", required=False),
        "behaviour": dl.categorical("behaviour"),
    }, copy=False)  # the columns are this frame's alone: no copy of a million rows
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


def events_of(ev: Table, jobs: JobUniverse) -> pd.DataFrame:
    """Worker events, merged over every worker of every directory. Only writes need a field
    of `data` for every row; the rest is read for the few events that explain something."""
    ev.require_str("kind", "worker event")
    # Few distinct kinds: as a categorical, the judge's comparisons on it are cheap.
    kind = ev.categorical("kind")
    known_kind = pd.Series(kind).isin(get_args(WorkerEventKind))
    if not known_kind.all():
        row = int(np.flatnonzero(~known_kind.to_numpy())[0])
        raise HistoryError(f"{ev.where(row)}: unknown worker event kind "
                           f"{ev.columns['kind'][row]!r}")
    # The results the judge reads: a write's, and a release's (an applied release gave its
    # attempt back); a categorical, null for every other event.
    writes = np.flatnonzero((kind == "write") | (kind == "release"))
    written = pd.Categorical(ev.nested["data"].field("result", writes))
    codes = np.full(len(kind), -1, dtype=written.codes.dtype)
    codes[writes] = written.codes
    result = pd.Categorical.from_codes(codes, dtype=written.dtype)
    events = pd.DataFrame({
        "kind": kind,
        "worker": ev.categorical("worker"),
        "time": ev.number("time", "worker event", required=True, time=True),
        "job": jobs.of(ev),
        "attempt": ev.number("attempt", "worker event", required=False),
        "result": result,
    }, copy=False)
    refuse_bad_times(ev, ev.nested["data"], ("end", "started"), "worker event")
    return events


def faults_of(nem: Table) -> list[dict[str, Any]]:
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


def finals_of(fin: Table, jobs: JobUniverse) -> pd.DataFrame:
    fin.require_str("status", "final job state")
    statuses = pd.Series(fin.categorical("status"))
    known_status = statuses.isin([s.value for s in JobStatus])
    if not known_status.all():
        row = int(np.flatnonzero(~known_status.to_numpy())[0])
        raise HistoryError(f"{fin.where(row)}: unknown job status {statuses[row]!r}")
    return pd.DataFrame({
        "job": jobs.of(fin),
        "job_id": pd.Series(jobs.id_column(fin), dtype=object),
        "status": statuses,
    })
