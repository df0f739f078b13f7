"""Loading a run's history, in three steps, one module each: reading the files
(`skiplock.reports.checker.read`: the CSV logs and nemesis.jsonl through Arrow's readers,
files in parallel, line by line only to name a bad line), validating what was read
(`validate`: the tables and their values; `run_config`: run.json and spec.json), and joining
it (`join`: the job universe, each job's oracle inputs, the deliveries, the worker events,
the faults and the final states). `read_history` returns them as a `History`.

A history that cannot be trusted is never judged: it is bad input (`HistoryError`, one line
naming the file, and the line where there is one). See `skiplock.reports.checker` for the rules."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import cast

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]

from skiplock.reports import columnar
from skiplock.reports.checker.join import (
    History,
    JobUniverse,
    deliveries_of,
    events_of,
    faults_of,
    finals_of,
    key_picks_by_lease,
    lease_from_sent,
)
from skiplock.reports.checker.read import checked_run_dirs, log_kinds, read_parts, refuse_repeats
from skiplock.reports.checker.run_config import run_config
from skiplock.reports.checker.validate import Table, table_of
from skiplock.reports.history import (
    RUN_FILE,
    SPEC_FILE,
    read_json,
)


def _objects(column: pa.ChunkedArray) -> np.ndarray:
    """An Arrow string column as an object array of str / None."""
    return cast(np.ndarray, column.to_numpy(zero_copy_only=False))


def read_history(run_dirs: Sequence[Path], cache_writes: columnar.BackgroundWrites) -> History:
    """The history recorded in `run_dirs` (the first holds the run; the others add
    delivery, worker and fault logs, and may add enqueues). The columnar cache of the files
    parsed goes to `cache_writes`. Raises HistoryError."""
    dirs = checked_run_dirs(run_dirs)
    main = dirs[0]
    config = run_config(main / RUN_FILE, read_json(main / SPEC_FILE))
    # Lease tokens key a queue's re-picks apart, for a queue whose attempt number does not
    # name a claim; no other check reads them.
    keyed_by_lease = config.guarantees.attempts_count != "claims"
    kinds = log_kinds(dirs, lease_tokens=keyed_by_lease)
    refuse_repeats([p for _, paths, _ in kinds for p in paths], "a log", "file")
    read = read_parts([(p, source) for _, paths, source in kinds for p in paths], cache_writes)
    # Parsing used every core; what follows uses one, and the cache writes can have another.
    cache_writes.release()
    parts = iter(read)
    cut: dict[str, str] = {}  # file cut off -> its kind of log
    tables: list[Table] = []
    for kind_name, paths, source in kinds:
        mine = [next(parts) for _ in paths]
        cut.update((str(p.path), kind_name) for p in mine if p.truncated)
        tables.append(table_of(mine, source.shape))
    enq, dl, ev, nem, fin = tables
    enq.require_str("type", "enqueue")
    enq.require_str("job_id", "enqueue")
    fin.require_str("job_id", "final job state")
    jobs = JobUniverse.read(enq, (enq, dl, ev, fin))
    deliveries, events = deliveries_of(dl, jobs), events_of(ev, jobs)
    if config.lease_kind == "heartbeat":
        lease_from_sent(events, ev.nested["data"])
    repicks = 0
    if keyed_by_lease:
        repicks = key_picks_by_lease(events, _objects(ev.tokens["lease_token"]), deliveries,
                                     _objects(dl.tokens["lease"]))
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
        faults=faults_of(nem),
        final=finals_of(fin, jobs),
        files=[str(main / SPEC_FILE), str(main / RUN_FILE), *(str(p.path) for p in read)],
        truncated=[str(p.path) + (" is empty: it was cut off before its header" if p.empty
                                  else " is truncated mid-line")
                   for p in read if p.truncated],
        cut=cut,
        worker_files=len(kinds[2][1]),
        repicks=repicks,
    )
