"""What a run leaves behind however it ends: the final-state snapshot (after the drain, or
bounded in time after an interrupt), the run's schema dropped, and the run stopped before a
full disk cuts its history short."""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from skiplock.plumbing.errors import HarnessError
from skiplock.queue_impl.interface import JobState
from skiplock.queue_impl.plugins import BackendSpec
from skiplock.reports.history import FINAL_JOBS_LOG, LogWriter, to_record


def drop_schema(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


# Longest the final snapshot of an interrupted run may take (connect plus query).
INTERRUPTED_SNAPSHOT_SECONDS = 15.0


def write_final_jobs(path: Path, states: list[JobState],
                     abandoned: threading.Event | None = None) -> int:
    """Write the snapshot whole or not at all (a partial file would be judged as if it were
    the queue's final state); returns the number of rows."""
    partial = path.with_name(path.name + ".partial")
    with LogWriter(partial, FINAL_JOBS_LOG) as writer:
        for state in states:
            record = to_record(state)
            record["job_id"] = str(state.job_id)
            record["status"] = state.status.value
            for key in ("locked_until", "next_attempt_at"):
                value = getattr(state, key)
                record[key] = None if value is None else value.timestamp()
            record["extra"] = dict(state.extra)
            writer.write(record)
    if abandoned is not None and abandoned.is_set():
        partial.unlink(missing_ok=True)
        raise TimeoutError("the snapshot came too late")
    os.replace(partial, path)
    return len(states)


def bounded_dsn(dsn: str, seconds: float) -> str:
    """`dsn` with a connect timeout and a statement timeout, so that a snapshot taken on the
    way out cannot hang on a server that has stopped answering."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(dsn)
    options = str(params.get("options") or "")
    params["options"] = f"{options} -c statement_timeout={int(seconds * 1000)}".strip()
    params["connect_timeout"] = str(max(1, int(seconds / 2)))
    return make_conninfo("", **params)


def interrupted_snapshot(backend: BackendSpec, path: Path,
                         seconds: float = INTERRUPTED_SNAPSHOT_SECONDS) -> tuple[int | None, str]:
    """Take the final snapshot after an interrupt, bounded in time, on a fresh connection
    (the run's own may have been cut mid-call). Returns (rows or None, a note for run.json);
    on failure nothing is written."""
    outcome: dict[str, Any] = {}
    abandoned = threading.Event()

    def take() -> None:
        try:
            bounded = dataclasses.replace(
                backend, dsn=None if backend.dsn is None else bounded_dsn(backend.dsn, seconds)
            )
            queue = bounded.create()
            try:
                states = queue.snapshot()
            finally:
                queue.close()
            outcome["rows"] = write_final_jobs(path, states, abandoned)
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            outcome["error"] = f"{type(exc).__name__}: {first}"

    thread = threading.Thread(target=take, name="skiplock-final-snapshot", daemon=True)
    thread.start()
    thread.join(seconds + 5.0)
    if thread.is_alive():
        abandoned.set()
        return None, f"not taken: no answer within {seconds + 5.0:g} s"
    if "rows" in outcome:
        return int(outcome["rows"]), "taken after the interrupt"
    return None, f"not taken: {outcome.get('error', 'unknown error')}"


# Below this much free space where the run writes its history, the run stops: a history
# cut short by a full disk judges nothing, and every process would fail on every write.
MIN_FREE_BYTES = 16 * 1024 * 1024


def check_disk(run_dir: Path) -> None:
    """HarnessError (one line) when the file system holding `run_dir` is (nearly) full."""
    try:
        stat = os.statvfs(run_dir)
    except OSError:
        return  # cannot tell: the writes themselves will say
    free = stat.f_bavail * stat.f_frsize
    if free < MIN_FREE_BYTES:
        raise HarnessError(f"the disk holding {run_dir} is full ({free // 1024} KiB free): the"
                           " run stopped rather than write a history cut short; free space"
                           " and run again")
