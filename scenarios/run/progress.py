"""Per-second samples of a running scenario, and the live display built on them.

The sampler reads what the run is already writing (enqueue operations, the target's delivery
logs, the workers' event logs) incrementally, and asks the queue only how many jobs are live
(pending, retrying, in flight), through the partial indexes: the cost of that query follows
the live jobs, never the finished history, so sampling does not load the server it measures
as the table grows. Completed and failed jobs are counted from the workers' applied writes
while the run goes on, and read exactly from the table once, in the final sample.
"""

from __future__ import annotations

import csv
import time
from collections.abc import Callable, Mapping
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from skiplock.queue_impl.interface import JobStatus, QueueBackend
from skiplock.reports.history import (
    DELIVERIES_DIR,
    DELIVERY_LOG,
    ENQUEUE_LOG,
    ENQUEUES_FILE,
    LOG_SUFFIX,
    WAITS_FILE,
    WAITS_LOG,
    WORKER_LOG,
    WORKERS_DIR,
    HistoryError,
    LogFormat,
    LogWriter,
    parse_header,
    parse_row,
)


@dataclass(frozen=True, kw_only=True)
class Sample:
    time: float
    elapsed: float
    phase: str
    invoked: int
    enqueued: int  # acknowledged (ok)
    enqueue_errors: int  # fail + info
    delivered: int  # requests the target recorded
    delivered_ok: int  # of which answered 2xx
    duplicates: int  # 2xx answers for a job that already had one (timeouts explain most)
    completed: int
    failed: int
    in_flight: int  # PROCESSING
    queue_depth: int  # PENDING + RETRYING
    rate: float  # acknowledged enqueues per second since the previous sample
    # Anomalies the target's log shows while the run goes. Raw signals: the checker decides
    # after the run which ones a recorded fault or timeout explains.
    unexpected: int = 0  # deliveries of a job id no producer invoked
    over_attempts: int = 0  # deliveries of a job beyond its max_attempts
    over_limit: int = 0  # deliveries that arrived with their account above its limit


SAMPLE_COLUMNS = [f.name for f in fields(Sample)]


class _Tail:
    """Reads the records appended to a CSV log since the last call. Only whole lines count:
    a last line still being written waits for its rest. The first line is the header. The
    display only counts: a malformed line is skipped (the checker will name it), and a log
    whose header is not one is not read at all."""

    def __init__(self, path: Path, log: LogFormat) -> None:
        self.path = path
        self.log = log
        self.offset = 0
        self.partial = b""
        self.names: list[str] | None = None
        self.line_number = 0
        self.unreadable = False
        self.bad_lines = 0

    def records(self) -> list[dict[str, Any]]:
        if self.unreadable:
            return []
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *whole, self.partial = data.split(b"\n")
        records = []
        # Writers escape line breaks inside fields, so every b"\n" ends a record.
        for raw in whole:
            self.line_number += 1
            try:
                line = raw.decode()
                if self.names is None:
                    self.names = parse_header(self.path, line, self.log)
                elif line.strip():
                    records.append(parse_row(self.path, self.line_number, line, self.names,
                                             self.log))
            except (HistoryError, UnicodeDecodeError):
                if self.names is None:
                    self.unreadable = True
                    return []
                self.bad_lines += 1
        return records


def live_counts_query(schema: str) -> sql.Composed:
    """PENDING, RETRYING and PROCESSING jobs, each counted through its partial index: the
    work follows the live jobs, not the finished ones."""
    return sql.SQL(
        "SELECT (SELECT count(*) FROM {t} WHERE status = 'PENDING'),"
        " (SELECT count(*) FROM {t} WHERE status = 'RETRYING'),"
        " (SELECT count(*) FROM {t} WHERE status = 'PROCESSING')"
    ).format(t=sql.SQL("{}.jobs").format(sql.Identifier(schema)))


# The run database's client sessions by what they wait on; a NULL label is an idle session.
# pg_stat_activity is shared memory, not a table: reading it costs the same at any size.
WAITS_QUERY = (
    "SELECT label, count(*) FROM ("
    " SELECT CASE WHEN state LIKE 'idle in transaction%' THEN 'idle in transaction'"
    " WHEN state = 'active' THEN COALESCE(wait_event_type || ':' || wait_event, 'CPU')"
    " END AS label FROM pg_stat_activity"
    " WHERE backend_type = 'client backend' AND datname = current_database()"
    " AND pid <> pg_backend_pid()) AS sessions GROUP BY label")


class Sampler:
    """Counts, one call per sample. Reads the reference's tables on its own connection only
    when `reads_tables` (the reference and its variants); a plug-in's tables are its own
    business, whatever they are named, so its live counts come from its snapshot. With a
    DSN it also writes waits.csv: the run database's sessions by wait event."""

    def __init__(self, run_dir: Path, dsn: str | None, schema: str,
                 backend: QueueBackend | None = None,
                 limits: Mapping[str, int | None] | None = None,
                 reads_tables: bool = True) -> None:
        self.run_dir = run_dir
        self.limits = dict(limits or {})
        self.max_attempts: dict[str, int] = {}
        self.seen: dict[str, int] = {}
        self.unexpected = self.over_attempts = self.over_limit = 0
        self.dsn = dsn
        self.schema = schema
        self.backend = backend
        self.enqueues = _Tail(run_dir / ENQUEUES_FILE, ENQUEUE_LOG)
        self.delivery_tails: dict[Path, _Tail] = {}
        self.worker_tails: dict[Path, _Tail] = {}
        self.completed = self.failed = 0  # from the workers' applied writes
        self.invoked = self.ok = self.errors = 0
        self.delivered = self.delivered_ok = self.duplicates = 0
        self.succeeded: set[str] = set()
        self.waiting: list[str] = []  # deliveries of jobs whose invoke has not been read yet
        self.started = time.time()
        self.last: Sample | None = None
        self._conn: psycopg.Connection[Any] | None = None
        self._use_sql = dsn is not None and reads_tables
        self._waits: LogWriter | None = None

    def _read_files(self) -> None:
        # Enqueues first: an invoke is written before its job exists. A delivery read right
        # after them may still belong to an invoke written in between (the two files are read
        # a few milliseconds apart, about an enqueue-to-delivery latency), so a delivery of no
        # known job waits for the next read of the enqueues, which is newer than it: a job
        # still unknown then was never invoked.
        self._read_enqueues()
        self._judge_waiting()
        for path in sorted((self.run_dir / DELIVERIES_DIR).glob(f"*{LOG_SUFFIX}")):
            tail = self.delivery_tails.setdefault(path, _Tail(path, DELIVERY_LOG))
            for record in tail.records():
                self.delivered += 1
                self._judge_arrival(record)
                status = record.get("status")
                if isinstance(status, int) and 200 <= status < 300:
                    self.delivered_ok += 1
                    job = str(record.get("job_id"))
                    if job in self.succeeded:
                        self.duplicates += 1
                    self.succeeded.add(job)
        for path in sorted((self.run_dir / WORKERS_DIR).glob(f"*{LOG_SUFFIX}")):
            tail = self.worker_tails.setdefault(path, _Tail(path, WORKER_LOG))
            for record in tail.records():
                if record.get("kind") == "write":
                    self._count_write(record)

    def _count_write(self, record: Mapping[str, Any]) -> None:
        """A job's final state as its applied write decided it: success completes it, a
        permanent failure or a transient one on its last attempt fails it. (Recovery that
        dead-letters an expired lease writes no such event: the final sample reads the
        table.)"""
        data = record.get("data") or {}
        if data.get("result") != "applied":
            return
        outcome = data.get("outcome")
        if outcome == "success":
            self.completed += 1
        elif outcome == "permanent":
            self.failed += 1
        elif outcome == "transient":
            allowed = self.max_attempts.get(str(record.get("job_id")))
            attempt = record.get("attempt")
            if allowed and isinstance(attempt, int) and attempt >= allowed:
                self.failed += 1

    def _read_enqueues(self) -> None:
        for op in self.enqueues.records():
            kind = op.get("type")
            if kind == "invoke":
                self.invoked += 1
                self.max_attempts[str(op.get("job_id"))] = int(op.get("max_attempts") or 0)
            elif kind == "ok":
                self.ok += 1
            else:
                self.errors += 1

    def _judge_waiting(self) -> None:
        """Judge the deliveries that waited for this read of the enqueues."""
        waiting, self.waiting = self.waiting, []
        for job in waiting:
            if not self._count_attempt(job):
                self.unexpected += 1

    def _count_attempt(self, job: str) -> bool:
        """Count a delivery of `job` against its max_attempts; False if no invoke is known."""
        allowed = self.max_attempts.get(job)
        if allowed is None:
            return False
        self.seen[job] = self.seen.get(job, 0) + 1
        if allowed and self.seen[job] > allowed:
            self.over_attempts += 1
        return True

    def _judge_arrival(self, record: Mapping[str, Any]) -> None:
        job = str(record.get("job_id"))
        if not self._count_attempt(job):
            self.waiting.append(job)
        limit = self.limits.get(str(record.get("account")))
        in_flight = record.get("account_in_flight")
        if limit is not None and isinstance(in_flight, int) and in_flight > limit:
            self.over_limit += 1

    def status_counts(self, *, exact: bool = False) -> dict[str, int] | None:
        """Jobs per live status (PENDING, RETRYING, PROCESSING), each counted through its
        partial index; with `exact`, every status, over the whole table (once, at the end).
        None when the queue cannot be asked right now. A plug-in's tables are not read: its
        snapshot gives every status."""
        if self._use_sql and self.dsn is not None:
            try:
                self._connect()
                assert self._conn is not None
                table = sql.SQL("{}.jobs").format(sql.Identifier(self.schema))
                if exact:
                    query = sql.SQL("SELECT status, count(*) FROM {} GROUP BY status").format(
                        table)
                    return {str(s): int(n) for s, n in self._conn.execute(query).fetchall()}
                row = self._conn.execute(live_counts_query(self.schema)).fetchone()
                assert row is not None
                return dict(zip((JobStatus.PENDING.value, JobStatus.RETRYING.value,
                                 JobStatus.PROCESSING.value), map(int, row), strict=True))
            except psycopg.errors.UndefinedTable:
                self._use_sql = False
            except psycopg.Error:
                # A fault may have cut the connection; count again next second.
                if self._conn is not None:
                    self._conn.close()
                self._conn = None
                return None
        if self.backend is None:
            return None
        counts: dict[str, int] = {}
        for state in self.backend.snapshot():
            counts[state.status.value] = counts.get(state.status.value, 0) + 1
        return counts

    def _connect(self) -> None:
        """The sampler's own connection, opened (again) when there is none."""
        if self.dsn is not None and (self._conn is None or self._conn.closed):
            self._conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=5)

    def _sample_waits(self, now: float) -> None:
        """One waits.csv sample: the run database's sessions, and what the busy ones wait on.
        Skipped when the server cannot be asked right now (a fault may be cutting it)."""
        if self.dsn is None:
            return
        if self._use_sql and (self._conn is None or self._conn.closed):
            return  # the counts could not connect this second: no second try here
        try:
            self._connect()
            assert self._conn is not None
            rows = self._conn.execute(WAITS_QUERY).fetchall()
        except psycopg.Error:
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            return
        if self._waits is None:
            self._waits = LogWriter(self.run_dir / WAITS_FILE, WAITS_LOG)
        stamp = round(now, 3)
        self._waits.write({"time": stamp, "row": "connected",
                           "sessions": sum(int(n) for _, n in rows)})
        for label, count in rows:
            if label is not None:
                self._waits.write({"time": stamp, "row": "wait", "wait": str(label),
                                   "sessions": int(count)})

    def sample(self, phase: str, *, final: bool = False) -> Sample:
        """The counts now. `final`: nothing writes any more, so deliveries still waiting for
        their invoke are judged against one more read of the enqueues."""
        self._read_files()
        if final:
            self._read_enqueues()
            self._judge_waiting()
        counts = self.status_counts(exact=final) or {}
        now = time.time()
        if not final:
            self._sample_waits(now)
        rate = 0.0
        if self.last is not None and now > self.last.time:
            rate = (self.ok - self.last.enqueued) / (now - self.last.time)
        sample = Sample(
            time=now,
            elapsed=now - self.started,
            phase=phase,
            invoked=self.invoked,
            enqueued=self.ok,
            enqueue_errors=self.errors,
            delivered=self.delivered,
            delivered_ok=self.delivered_ok,
            duplicates=self.duplicates,
            completed=counts.get(JobStatus.COMPLETED.value, self.completed),
            failed=counts.get(JobStatus.FAILED.value, self.failed),
            in_flight=counts.get(JobStatus.PROCESSING.value, 0),
            queue_depth=counts.get(JobStatus.PENDING.value, 0)
            + counts.get(JobStatus.RETRYING.value, 0),
            rate=rate,
            unexpected=self.unexpected,
            over_attempts=self.over_attempts,
            over_limit=self.over_limit,
        )
        self.last = sample
        return sample

    def stranded_jobs(self) -> int | None:
        """PROCESSING jobs whose lease has expired: with recovery off, nothing will ever move
        them again. None when the queue's tables cannot be read directly."""
        if not self._use_sql or self._conn is None:
            return None
        query = sql.SQL(
            "SELECT count(*) FROM {}.jobs WHERE status = 'PROCESSING' AND locked_until < now()"
        ).format(sql.Identifier(self.schema))
        try:
            row = self._conn.execute(query).fetchone()
        except psycopg.Error:
            return None
        return None if row is None else int(row[0])

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._waits is not None:
            self._waits.close()
            self._waits = None


class SampleWriter:
    """samples.csv, one row per sample, flushed as written."""

    def __init__(self, path: Path) -> None:
        self._fh = path.open("w", newline="")
        self._csv = csv.writer(self._fh)
        self._csv.writerow(SAMPLE_COLUMNS)

    def write(self, sample: Sample) -> None:
        self._csv.writerow(
            [round(v, 3) if isinstance(v, float) else v for v in astuple(sample)]
        )
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


Observer = Callable[[Sample], None]


# Labels the live table and the demo's summary share, so that one number has one name in
# both: deliveries count requests (retries included), completed and failed count jobs.
LABELS = {
    "enqueued": "enqueued (jobs acknowledged)",
    "delivered": "deliveries (requests received)",
    "delivered_ok": "  of which answered 2xx",
    "completed": "completed (jobs)",
    "failed": "failed (jobs dead-lettered)",
}


def _table(sample: Sample, title: str) -> Table:
    """Label / value rows: narrow enough for an 80-column terminal."""
    table = Table(title=title, show_header=False, expand=False, min_width=44)
    table.add_column("measure", style="bold")
    table.add_column("value", justify="right")
    rows: list[tuple[str, str | Text]] = [
        ("phase", f"{sample.phase} ({sample.elapsed:.0f} s)"),
        ("enqueue rate", f"{sample.rate:.0f} jobs/s"),
        (LABELS["enqueued"], str(sample.enqueued)),
        (LABELS["delivered"], str(sample.delivered)),
        (LABELS["delivered_ok"], str(sample.delivered_ok)),
        (LABELS["completed"], str(sample.completed)),
        (LABELS["failed"], str(sample.failed)),
        ("in flight", str(sample.in_flight)),
        ("queued", str(sample.queue_depth)),
        # Not an anomaly by itself: a 2xx that came back after the HTTP timeout is retried by
        # design. Only the checker, after the run, can tell explained repeats from bugs.
        ("repeat deliveries after a 2xx (judged after the run)", str(sample.duplicates)),
    ]
    raw = sample.unexpected + sample.over_attempts + sample.over_limit
    anomalies = (
        f"unexpected {sample.unexpected}, over max_attempts {sample.over_attempts},"
        f" in flight over an account's limit {sample.over_limit}"
    )
    rows.append(("raw signals so far (the checker judges them after the run)",
                 Text(anomalies, style="yellow") if raw else anomalies))
    for label, value in rows:
        table.add_row(label, value)
    return table


class LiveProgress:
    """A rich live table, refreshed on each sample; falls back to nothing off a terminal."""

    def __init__(self, title: str, console: Console | None = None) -> None:
        self.title = title
        self.console = console or Console(stderr=True)
        self._live: Live | None = None

    def __enter__(self) -> LiveProgress:
        self._live = Live(Group(Text(f"{self.title}: starting...")), console=self.console,
                          refresh_per_second=4, transient=False)
        self._live.__enter__()
        return self

    def __call__(self, sample: Sample) -> None:
        if self._live is not None:
            note = Text("repeats after a timeout are expected; the checker judges them after"
                        " the run", style="dim")
            self._live.update(Group(_table(sample, self.title), note))

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None


def print_line(console: Console) -> Observer:
    """A plain one-line-per-sample observer for `skiplock run` (logs, CI)."""

    def observe(sample: Sample) -> None:
        console.print(
            f"{escape(f'[{sample.phase:>6}]')} {sample.elapsed:5.1f}s enq={sample.enqueued}"
            f" ({sample.rate:.0f}/s) answered_2xx={sample.delivered_ok}"
            f" done={sample.completed} failed={sample.failed} in_flight={sample.in_flight}"
            f" queued={sample.queue_depth} repeat_2xx={sample.duplicates}"
            # Raw signals from the target's log, not the verdict's counts: the checker judges
            # them after the run (a re-delivery after an expired lease holds no slot, say).
            f" | raw, judged after the run: unexpected={sample.unexpected}"
            f" over_max_attempts={sample.over_attempts}"
            f" in_flight_over_limit={sample.over_limit}",
            highlight=False,
            soft_wrap=True,
        )

    return observe
