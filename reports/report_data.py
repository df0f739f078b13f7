"""A run directory read for a person, not for a verdict: whatever can be read is read.

The checker refuses a history it cannot trust; a report must still show what a damaged or
unfinished run did. So here a missing file, a log cut off mid-line, an unparsable line or a
run that never reached its verdict is a note (shown at the top of the report), never an
error: the figures that need the missing part say so, the others are drawn. Only a path that
holds no run at all is bad input.

The time axis of every series is seconds since the load started (the warm-up's start), so
several runs overlay.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import pandas as pd

from skiplock.reports.checker import MEANINGS, VIOLATION_KEYS
from skiplock.reports.history import (
    DELIVERIES_DIR,
    ENQUEUES_FILE,
    FINAL_JOBS_FILE,
    LOG_SUFFIX,
    NEMESIS_FILE,
    RUN_FILE,
    SAMPLES_FILE,
    SPEC_FILE,
    VERDICT_FILE,
    WAITS_FILE,
    WORKERS_DIR,
    Behaviour,
    HistoryError,
)

_ENQUEUE_COLUMNS = ("type", "job_id", "time", "account", "max_attempts", "run_at",
                    "script_name", "error")
_DELIVERY_COLUMNS = ("job_id", "attempt", "account", "worker", "target", "received",
                     "answered", "status", "behaviour", "seen", "account_in_flight")
_EVENT_COLUMNS = ("kind", "worker", "time", "job_id", "attempt", "result", "status", "start",
                  "end", "outcome", "error", "lost", "name", "count", "reason", "op")
_FINAL_COLUMNS = ("job_id", "account_id", "status", "attempts", "max_attempts", "last_error")
# Columns read as numbers, per log (a final state's `status` is a word, a delivery's a code).
_ENQUEUE_NUMBERS = frozenset({"time", "max_attempts", "run_at"})
_DELIVERY_NUMBERS = frozenset({"attempt", "received", "answered", "status", "seen",
                               "account_in_flight"})
_EVENT_NUMBERS = frozenset({"time", "attempt", "status", "start", "end", "count"})
_FINAL_NUMBERS = frozenset({"attempts", "max_attempts"})
_SAMPLE_NUMBERS = frozenset({"time", "elapsed", "enqueued", "delivered", "completed",
                             "failed", "in_flight", "queue_depth"})
_WAIT_NUMBERS = frozenset({"time", "sessions"})


@dataclass
class RunData:
    """One run directory as far as it could be read; `notes` says what could not be."""

    run_dir: Path
    spec: dict[str, Any] | None = None
    run: dict[str, Any] | None = None
    verdict: dict[str, Any] | None = None
    enqueues: pd.DataFrame | None = None
    deliveries: pd.DataFrame | None = None
    events: pd.DataFrame | None = None
    final: pd.DataFrame | None = None
    samples: pd.DataFrame | None = None
    waits: pd.DataFrame | None = None
    faults: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def scenario(self) -> dict[str, Any]:
        value = (self.spec or {}).get("scenario")
        return value if isinstance(value, dict) else {}

    @property
    def phases(self) -> list[dict[str, Any]]:
        value = (self.spec or {}).get("phases")
        return [p for p in value if isinstance(p, dict)] if isinstance(value, list) else []

    @property
    def t0(self) -> float:
        """Where the time axis starts: the warm-up (load) start, else the run's start, else
        the first record."""
        for phase in self.phases:
            if phase.get("name") == "warmup" and _finite(phase.get("start")):
                return float(phase["start"])
        if self.run and _finite(self.run.get("started")):
            return float(self.run["started"])
        firsts = [float(frame[column].min()) for frame, column in (
            (self.enqueues, "time"), (self.deliveries, "received"), (self.events, "time"))
            if frame is not None and len(frame) and _finite(frame[column].min())]
        return min(firsts) if firsts else 0.0

    def limits(self) -> dict[str, int]:
        raw = (self.run or {}).get("account_limits") or self.scenario.get("accounts") or {}
        return {str(k): int(v) for k, v in raw.items()
                if isinstance(v, int) and not isinstance(v, bool)}


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(
        value)


def is_run_dir(path: Path) -> bool:
    """Whether `path` holds anything a run writes (so a report of it is not a mistake)."""
    return path.is_dir() and any((path / name).exists() for name in (
        SPEC_FILE, RUN_FILE, ENQUEUES_FILE, DELIVERIES_DIR, WORKERS_DIR, VERDICT_FILE))


def load_run(run_dir: Path) -> RunData:
    """Read everything readable; HistoryError only when `run_dir` is no run directory."""
    if not run_dir.exists():
        raise HistoryError(f"{run_dir} does not exist")
    if not run_dir.is_dir():
        raise HistoryError(f"{run_dir} is not a directory: give a run directory")
    if not is_run_dir(run_dir):
        raise HistoryError(f"{run_dir} holds no run (no spec.json, run.json or logs): give a "
                           "directory that `skiplock run` wrote")
    data = RunData(run_dir=run_dir)
    notes = data.notes
    data.spec = _json(run_dir / SPEC_FILE, notes)
    data.run = _json(run_dir / RUN_FILE, notes)
    data.verdict = _json(run_dir / VERDICT_FILE, notes, missing=(
        "verdict.json is missing: the run was not judged (run `skiplock check "
        f"{run_dir}`)"))
    data.enqueues = _csv(run_dir / ENQUEUES_FILE, _ENQUEUE_COLUMNS, _ENQUEUE_NUMBERS, notes)
    data.deliveries = _csv_dir(run_dir / DELIVERIES_DIR, _DELIVERY_COLUMNS, _DELIVERY_NUMBERS,
                               notes)
    data.events = _csv_dir(run_dir / WORKERS_DIR, _EVENT_COLUMNS, _EVENT_NUMBERS, notes)
    data.final = _csv(run_dir / FINAL_JOBS_FILE, _FINAL_COLUMNS, _FINAL_NUMBERS, notes)
    data.samples = _csv(run_dir / SAMPLES_FILE, None, _SAMPLE_NUMBERS, notes)
    data.waits = _csv(run_dir / WAITS_FILE, ("time", "row", "wait", "sessions"),
                      _WAIT_NUMBERS, notes,
                      missing="waits.csv is missing: no wait events were sampled (a run "
                              "before they were, or a backend not on PostgreSQL)")
    data.faults = _faults(run_dir / NEMESIS_FILE, notes)
    if data.run is not None and data.run.get("exit_reason") not in (None, "completed"):
        notes.append(f"the run did not complete: {data.run.get('exit_reason')}")
    return data


def _json(path: Path, notes: list[str], missing: str | None = None) -> dict[str, Any] | None:
    if not path.exists():
        notes.append(missing or f"{path.name} is missing")
        return None
    try:
        value = json.loads(path.read_bytes().decode())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        notes.append(f"{path.name} cannot be read ({type(exc).__name__})")
        return None
    if not isinstance(value, dict):
        notes.append(f"{path.name} is not a JSON object")
        return None
    return value


def _csv(path: Path, columns: tuple[str, ...] | None, numbers: frozenset[str],
         notes: list[str], missing: str | None = None) -> pd.DataFrame | None:
    """A log's whole, well-formed lines; a cut-off last line and malformed lines are noted
    and left out."""
    name = path.relative_to(path.parent.parent) if path.parent.name in (
        DELIVERIES_DIR, WORKERS_DIR) else Path(path.name)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        notes.append(missing or f"{name} is missing")
        return None
    except OSError as exc:
        notes.append(f"{name} cannot be read ({exc.strerror or exc})")
        return None
    end = data.rfind(b"\n")
    if end < len(data) - 1:
        notes.append(f"{name} was cut off mid-line: its last line is left out")
        data = data[:end + 1]
    if not data.strip():
        notes.append(f"{name} is empty")
        return None
    data, malformed = _whole_records(data)
    try:
        frame = pd.read_csv(io.BytesIO(data), dtype=str, keep_default_na=False,
                            na_values=[""], on_bad_lines="skip", encoding_errors="replace",
                            usecols=(lambda c: c in columns) if columns else None)
    except (ValueError, pd.errors.ParserError) as exc:
        notes.append(f"{name} cannot be parsed ({' '.join(str(exc).split())[:120]})")
        return None
    if columns is not None:
        if not set(columns) & set(frame.columns):
            notes.append(f"{name} has none of the columns a report reads")
            return None
        for column in columns:
            if column not in frame.columns:
                frame[column] = None
    if malformed:
        notes.append(f"{name}: {malformed} malformed line(s) left out")
    for column in frame.columns:
        if column in numbers:
            frame[column] = pd.to_numeric(frame[column], errors="coerce")
    return frame


def _whole_records(data: bytes) -> tuple[bytes, int]:
    """The header and the lines with as many fields as it has (pandas would pad a short line
    with nulls and read it as a record), and how many lines were dropped. Blank lines are
    neither."""
    lines = data.split(b"\n")
    header, rows = lines[0], [line for line in lines[1:] if line.strip()]
    expected = _fields(header)
    commas = expected - 1
    # Most lines hold no quote, and a comma count settles them: a million lines in 0.3 s.
    kept = [line for line in rows if (line.count(b",") == commas and b'"' not in line)
            or (b'"' in line and _fields(line) == expected)]
    return b"\n".join([header, *kept]) + b"\n", len(rows) - len(kept)


def _fields(line: bytes) -> int:
    if b'"' not in line:
        return line.count(b",") + 1
    try:
        return len(next(csv.reader([line.decode(errors="replace")]), []))
    except csv.Error:
        return -1


def _csv_dir(directory: Path, columns: tuple[str, ...], numbers: frozenset[str],
             notes: list[str]) -> pd.DataFrame | None:
    if not directory.is_dir():
        notes.append(f"{directory.name}/ is missing")
        return None
    frames = [frame for path in sorted(directory.glob(f"*{LOG_SUFFIX}"))
              if (frame := _csv(path, columns, numbers, notes)) is not None]
    if not frames:
        notes.append(f"{directory.name}/ holds no readable log")
        return None
    return pd.concat(frames, ignore_index=True)


def _faults(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    try:
        text = path.read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return []  # no fault ran
    except OSError as exc:
        notes.append(f"{path.name} cannot be read ({exc.strerror or exc})")
        return []
    faults = []
    bad = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(record, dict) and _finite(record.get("start")):
            faults.append(record)
        else:
            bad += 1
    if bad:
        notes.append(f"{path.name}: {bad} unreadable fault record(s) left out")
    return faults


# --------------------------------------------------------------------------------------------
# Series derived from the logs.
# --------------------------------------------------------------------------------------------


def bin_seconds(span: float) -> float:
    """A bin width that gives a plot of about 60 to 150 points."""
    for width in (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0):
        if span / width <= 150:
            return width
    return 600.0


def span(runs: list[RunData]) -> float:
    ends = [0.0]
    for run in runs:
        for frame, column in ((run.enqueues, "time"), (run.deliveries, "received"),
                              (run.events, "time")):
            if frame is not None and len(frame):
                top = frame[column].max()
                if _finite(top):
                    ends.append(float(top) - run.t0)
    return max(ends)


def _rate(times: pd.Series, t0: float, width: float, end: float) -> pd.Series:
    edges = np.arange(min(0.0, float(times.min() - t0)) if len(times) else 0.0,
                      end + width, width)
    counts, _ = np.histogram(times.dropna() - t0, bins=edges) if len(edges) > 1 else (
        np.array([]), None)
    return pd.Series(counts / width, index=edges[:-1] + width / 2)


def max_attempts_by_job(run: RunData) -> pd.Series:
    if run.enqueues is None:
        return pd.Series(dtype=float)
    invokes = run.enqueues[run.enqueues["type"] == "invoke"]
    return invokes.drop_duplicates("job_id").set_index("job_id")["max_attempts"]


def finishing_writes(run: RunData) -> tuple[pd.Series, pd.Series]:
    """Times of the applied writes that completed a job, and of those that dead-lettered one
    (a permanent failure, or a transient one on its last attempt)."""
    if run.events is None:
        return pd.Series(dtype=float), pd.Series(dtype=float)
    writes = run.events[(run.events["kind"] == "write") & (run.events["result"] == "applied")]
    done = writes[writes["outcome"] == "success"]["time"]
    allowed = writes["job_id"].map(max_attempts_by_job(run))
    last = (writes["outcome"] == "transient") & (writes["attempt"] >= allowed)
    failed = writes[(writes["outcome"] == "permanent") | last]["time"]
    return done, failed


# What the echo target does by a job's script that fails the delivery (a 5xx or 4xx status,
# an answer past the timeout, no answer, a reset): the scripted target faults, drawn over
# time as the nemesis faults are shaded.
SCRIPTED_FAILURES = frozenset({Behaviour.HANG.value, Behaviour.HANG_FOREVER.value,
                               Behaviour.RESET.value})


def throughput(run: RunData, width: float, end: float) -> dict[str, pd.Series]:
    """Per-second rates: enqueued (acknowledged), delivered (requests the target received),
    failed by script (deliveries the target failed as the job's script says), completed and
    dead-lettered (applied result writes)."""
    series: dict[str, pd.Series] = {}
    if run.enqueues is not None:
        series["enqueued"] = _rate(run.enqueues[run.enqueues["type"] == "ok"]["time"],
                                   run.t0, width, end)
    if run.deliveries is not None:
        series["delivered"] = _rate(run.deliveries["received"], run.t0, width, end)
        d = run.deliveries
        status = pd.to_numeric(d["status"], errors="coerce")
        scripted = d["behaviour"].isin(SCRIPTED_FAILURES) | (
            (d["behaviour"] == Behaviour.STATUS.value) & ~status.between(200, 299))
        if scripted.any():
            series["failed by script"] = _rate(run.deliveries["received"][scripted], run.t0,
                                               width, end)
    if run.events is not None:
        done, failed = finishing_writes(run)
        series["completed"] = _rate(done, run.t0, width, end)
        series["dead-lettered"] = _rate(failed, run.t0, width, end)
    return series


def _due_times(run: RunData) -> pd.Series:
    """When each job became due, as the checker counts it (its objectives are drawn against
    these waits): its enqueue acknowledged (the invoke where no answer was recorded), or its
    run_at when that is later."""
    assert run.enqueues is not None
    enqueues = run.enqueues
    invokes = enqueues[enqueues["type"] == "invoke"].drop_duplicates("job_id")
    acked = enqueues[enqueues["type"] == "ok"].drop_duplicates("job_id")
    at = pd.Series(invokes["time"].to_numpy(), index=invokes["job_id"].to_numpy())
    at.update(pd.Series(acked["time"].to_numpy(), index=acked["job_id"].to_numpy()))
    run_at = pd.Series(invokes["run_at"].to_numpy(), index=invokes["job_id"].to_numpy())
    return at.where(~(run_at > at), run_at)


def latencies(run: RunData) -> dict[str, pd.DataFrame]:
    """Per latency, a frame of (at: seconds on the run's axis, seconds): enqueue -> first
    claim and enqueue -> first delivery (from when the job was due), and call duration."""
    out: dict[str, pd.DataFrame] = {}
    due = _due_times(run) if run.enqueues is not None else None
    if due is not None and run.events is not None:
        claims = run.events[run.events["kind"] == "claim"]
        first = claims.groupby("job_id")["time"].min()
        waited = first - due.reindex(first.index)
        out["enqueue → claim"] = _latency_frame(first, waited, run.t0)
    if due is not None and run.deliveries is not None:
        first = run.deliveries.groupby("job_id")["received"].min()
        waited = first - due.reindex(first.index)
        out["enqueue → first delivery"] = _latency_frame(first, waited, run.t0)
    if run.events is not None:
        calls = run.events[run.events["kind"] == "http"]
        out["HTTP call"] = _latency_frame(calls["end"], calls["end"] - calls["start"], run.t0)
    return out


def _latency_frame(at: pd.Series, seconds: pd.Series, t0: float) -> pd.DataFrame:
    frame = pd.DataFrame({"at": at.to_numpy() - t0, "seconds": seconds.to_numpy()})
    keep = np.isfinite(frame["at"].to_numpy(float)) & np.isfinite(
        frame["seconds"].to_numpy(float))
    return cast(pd.DataFrame, frame.loc[keep])


def percentiles_over_time(frame: pd.DataFrame, width: float) -> pd.DataFrame:
    """p50 / p95 / p99 per time bin (bins with no observation are left out)."""
    if frame.empty:
        return pd.DataFrame(columns=["p50", "p95", "p99"])
    bins = (frame["at"] // width) * width + width / 2
    grouped = frame.groupby(bins)["seconds"]
    return pd.DataFrame({"p50": grouped.quantile(0.5), "p95": grouped.quantile(0.95),
                         "p99": grouped.quantile(0.99)})


def in_flight_by_account(run: RunData, width: float) -> pd.DataFrame:
    """The most deliveries of each account in flight at the target at once, per time bin
    (the target's own count when each delivery arrived)."""
    if run.deliveries is None or run.deliveries.empty:
        return pd.DataFrame()
    frame = run.deliveries.dropna(subset=["account", "account_in_flight", "received"])
    bins = ((frame["received"] - run.t0) // width) * width + width / 2
    table = frame.groupby([bins, frame["account"]])["account_in_flight"].max().unstack()
    return table.sort_index()


def outstanding_by_account(run: RunData, width: float, end: float) -> pd.DataFrame:
    """Per account, jobs acknowledged and not yet finished by an applied write, at the end of
    each time bin: its share of the queue (waiting, retrying or in flight). A job that
    recovery dead-lettered has no write, so it stays counted: the final snapshot says which."""
    if run.enqueues is None or run.events is None:
        return pd.DataFrame()
    invokes = run.enqueues[run.enqueues["type"] == "invoke"].drop_duplicates("job_id")
    account = pd.Series(invokes["account"].to_numpy(), index=invokes["job_id"].to_numpy())
    oks = run.enqueues[run.enqueues["type"] == "ok"]
    writes = run.events[(run.events["kind"] == "write") & (run.events["result"] == "applied")]
    done, failed = finishing_writes(run)
    finished = writes.loc[done.index.union(failed.index)].drop_duplicates("job_id")
    changes = pd.concat([
        pd.DataFrame({"at": oks["time"].to_numpy() - run.t0, "delta": 1,
                      "account": oks["job_id"].map(account).to_numpy()}),
        pd.DataFrame({"at": finished["time"].to_numpy() - run.t0, "delta": -1,
                      "account": finished["job_id"].map(account).to_numpy()}),
    ]).dropna(subset=["account", "at"])
    if changes.empty:
        return pd.DataFrame()
    edges = np.arange(0.0, end + width, width)
    changes["bin"] = np.clip(np.searchsorted(edges, changes["at"], side="right"), 0,
                             len(edges)) * width
    table = changes.pivot_table(index="bin", columns="account", values="delta", aggfunc="sum")
    table = table.reindex(np.arange(0, len(edges) + 1) * width).fillna(0).cumsum()
    return table.clip(lower=0)


def wait_samples(run: RunData) -> tuple[pd.DataFrame, pd.Series]:
    """(sessions per wait per sample, connected sessions per sample), indexed by time on the
    run's axis."""
    if run.waits is None or run.waits.empty:
        return pd.DataFrame(), pd.Series(dtype=float)
    frame = run.waits.dropna(subset=["time"])
    at = frame["time"] - run.t0
    connected = frame[frame["row"] == "connected"].assign(at=at).set_index("at")["sessions"]
    waits = frame[frame["row"] == "wait"].assign(at=at)
    table = waits.pivot_table(index="at", columns="wait", values="sessions", aggfunc="sum")
    table = table.reindex(connected.index.union(table.index)).fillna(0.0)
    return table, connected


def attempts_table(run: RunData) -> pd.DataFrame:
    """Jobs by the attempts they used and how they ended (the final snapshot's view)."""
    if run.final is None or run.final.empty:
        return pd.DataFrame()
    frame = run.final.dropna(subset=["attempts"])
    table = frame.groupby(["attempts", "status"]).size().unstack(fill_value=0)
    table.index = table.index.astype(int)
    return table


def dead_letter_causes(run: RunData) -> pd.Series:
    if run.final is None or run.final.empty:
        return pd.Series(dtype=int)
    failed = run.final[run.final["status"] == "FAILED"]
    return failed["last_error"].fillna("(no error recorded)").value_counts()


def headline(run: RunData) -> dict[str, Any]:
    """The figures a comparison table puts side by side."""
    counts = (run.verdict or {}).get("counts") or {}
    figures: dict[str, Any] = {
        "verdict": verdict_word((run.verdict or {}).get("valid", "not checked")
                                if run.verdict else "not checked"),
        "scenario": run.scenario.get("name", "?"),
        "backend": (run.spec or {}).get("backend", "?"),
        "seed": (run.spec or {}).get("seed", "?"),
    }
    for key in ("enqueued", "delivered", "completed", "failed"):
        figures[key] = counts.get(key, "?")
    load = next((p for p in run.phases if p.get("name") == "load"), None)
    if load and _finite(load.get("start")) and _finite(load.get("end")):
        seconds = float(load["end"]) - float(load["start"])
        if seconds > 0 and run.deliveries is not None:
            inside = run.deliveries["received"].between(load["start"], load["end"])
            figures["deliveries/s during load"] = round(int(inside.sum()) / seconds, 1)
    for name, frame in latencies(run).items():
        if not frame.empty and name != "enqueue → claim":
            for q in (50, 99):
                figures[f"{name} p{q} (s)"] = round(float(frame["seconds"].quantile(q / 100)),
                                                    3)
    violations = sum(v for k, v in counts.items()
                     if k in VIOLATION_KEYS and isinstance(v, int))
    figures["violations"] = violations if run.verdict else "?"
    return figures


# The verdict's anomalies, each with what it means, in the checker's order.
VIOLATIONS: dict[str, str] = {key: MEANINGS[key] for key in VIOLATION_KEYS}


def verdict_word(valid: Any) -> str:
    if valid is True:
        return "valid"
    if valid is False:
        return "violated"
    return "not checked" if valid == "not checked" else "unknown"


def job_story(run: RunData, job_id: str) -> pd.DataFrame:
    """Everything recorded about one job, oldest first: its enqueue, the workers' events,
    the target's deliveries, the faults that overlapped it, and its final state."""
    rows: list[dict[str, Any]] = []
    t0 = run.t0

    def at(value: Any) -> float | None:
        return float(value) - t0 if _finite(value) else None

    if run.enqueues is not None:
        for rec in run.enqueues[run.enqueues["job_id"] == job_id].to_dict("records"):
            what = f"enqueue {rec['type']}"
            detail = _join(("account", rec.get("account")), ("script", rec.get("script_name")),
                           ("max_attempts", rec.get("max_attempts")), ("error", rec.get("error")))
            rows.append({"at": at(rec["time"]), "source": "producer", "what": what,
                         "detail": detail})
    if run.events is not None:
        for rec in run.events[run.events["job_id"] == job_id].to_dict("records"):
            detail = _join(("attempt", rec.get("attempt")), ("result", rec.get("result")),
                           ("outcome", rec.get("outcome")), ("status", rec.get("status")),
                           ("error", rec.get("error")), ("name", rec.get("name")),
                           ("lost", rec.get("lost")))
            rows.append({"at": at(rec["time"]), "source": str(rec.get("worker")),
                         "what": str(rec.get("kind")), "detail": detail})
    if run.deliveries is not None:
        for rec in run.deliveries[run.deliveries["job_id"] == job_id].to_dict("records"):
            answered = (f"answered {rec['status']:.0f} after "
                        f"{rec['answered'] - rec['received']:.3f}s"
                        if _finite(rec.get("answered")) and _finite(rec.get("status"))
                        else "never answered")
            detail = _join(("attempt header", rec.get("attempt")), ("seen", rec.get("seen")),
                           ("from", rec.get("worker")), ("behaviour", rec.get("behaviour")),
                           ("account in flight", rec.get("account_in_flight")))
            rows.append({"at": at(rec["received"]), "source": str(rec.get("target")),
                         "what": f"delivery: {answered}", "detail": detail})
    times = [r["at"] for r in rows if r["at"] is not None]
    if times:
        first, last = min(times) + t0, max(times) + t0
        for fault in run.faults:
            end = fault.get("end") if _finite(fault.get("end")) else fault["start"]
            if fault["start"] <= last and end >= first - 1.0:
                rows.append({"at": at(fault["start"]), "source": "nemesis",
                             "what": f"fault {fault.get('fault')}",
                             "detail": _join(("target", fault.get("target")),
                                             ("until", at(end)), ("job", fault.get("job_id")),
                                             ("skipped", fault.get("skipped")))})
    story = pd.DataFrame(rows, columns=["at", "source", "what", "detail"])
    story = story.sort_values("at", na_position="last", kind="stable")
    if run.final is not None:
        for rec in run.final[run.final["job_id"] == job_id].to_dict("records"):
            final = pd.DataFrame([{"at": None, "source": "final snapshot",
                                   "what": str(rec.get("status")),
                                   "detail": _join(("attempts", rec.get("attempts")),
                                                   ("last_error", rec.get("last_error")))}])
            story = pd.concat([story, final], ignore_index=True)
    return story


def _join(*pairs: tuple[str, Any]) -> str:
    parts = []
    for key, value in pairs:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        elif isinstance(value, float):
            value = f"{value:.3f}"
        parts.append(f"{key} {value}")
    return ", ".join(parts)
