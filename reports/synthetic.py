"""Writing a run directory by hand, in the schema of `skiplock.reports.history`, through the same
record builders the real writers use: the producers' `EnqueueOp`, the echo target's
`Delivery`, the dispatcher's event fields (`skiplock.queue_impl.events.claim_event`,
`http_event`, `write_event`) and its judgement of an answer (`call_for_status`), and the
worker log's `worker_event_record`. `RunBuilder.attempt` writes one attempt as a correct
dispatcher records it, so a hand-built history cannot say what the dispatcher never writes
(`tests/integration/test_synthetic_history.py` holds it to a real run's logs).

`skiplock bench checker` builds its large history with it; the checker's tests build their
hand-made histories with it too."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from skiplock.queue_impl.deliver import call_for_status, timed_out_call
from skiplock.queue_impl.events import Call, claim_event, http_event, write_event
from skiplock.queue_impl.interface import Lease, Outcome
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
    Delivery,
    EnqueueOp,
    LogFormat,
    to_record,
    worker_event_record,
    write_json,
)


class LineWriter:
    """`LogFormat.line`, two to three times faster on the plain values the builder's records
    hold (nulls, numbers, text without separators), which a synthetic history of millions
    of records is made of. Any other value is written by `LogFormat.line` itself, one column
    at a time, so every line is byte for byte what `LogFormat.line` writes for the record."""

    def __init__(self, log: LogFormat) -> None:
        self.log = log
        self._known = frozenset(log.names)
        self._columns = [(name, kind, LogFormat(log.what, ((name, kind),)))
                         for name, kind in log.columns]

    def line(self, record: Mapping[str, Any]) -> str:
        flat = self.log.flatten(record) if self.log.flatten else record
        if not flat.keys() <= self._known:
            return self.log.line(record)  # raises, naming the fields without a column
        cells: list[str] = []
        for name, kind, column in self._columns:
            value = flat.get(name)
            if value is None:
                cells.append("")
            elif kind == "str" and type(value) is str and not (
                    "," in value or '"' in value or "\\" in value or "\n" in value
                    or "\r" in value):
                cells.append(value)
            elif kind == "num" and (type(value) is int or type(value) is float):
                cells.append(repr(value))
            else:
                cells.append(column.line({name: value})[:-1])
        return ",".join(cells) + "\n"


_ENQUEUE_LINES = LineWriter(ENQUEUE_LOG)
_DELIVERY_LINES = LineWriter(DELIVERY_LOG)
_WORKER_LINES = LineWriter(WORKER_LOG)
_FINAL_LINES = LineWriter(FINAL_JOBS_LOG)


class RunBuilder:
    """Collects the records of a run and writes them as a run directory. Each list holds
    its file's lines as written (after the header), newline included."""

    def __init__(
        self,
        *,
        http_timeout_seconds: float = 2.0,
        lease_seconds: float = 10.0,
        retry_base_seconds: float = 1.0,
        retry_cap_seconds: float = 60.0,
        retry_jitter: float = 0.5,
        account_limits: Mapping[str, int | None] | None = None,
        drained: bool = True,
        exit_reason: str = "completed",
        guarantees: Mapping[str, Any] | None = None,
        objectives: Mapping[str, Any] | None = None,
        load_window: tuple[float, float] | None = None,
    ) -> None:
        # What the queue declared (spec.json `guarantees`); None: not recorded.
        self.guarantees = dict(guarantees) if guarantees is not None else None
        # The scenario's `[objectives]` and its load phase (spec.json); None: not recorded.
        self.objectives = dict(objectives) if objectives is not None else None
        self.load_window = load_window
        self.run_info: dict[str, Any] = {
            "started": 0.0,  # the load starts at 0: times in sentences read as written
            "finished": 2000.0,
            "drained": drained,
            "drain_seconds": 1.0,
            "exit_reason": exit_reason,
            "backend": "pg",
            "retry_base_seconds": retry_base_seconds,
            "retry_cap_seconds": retry_cap_seconds,
            "retry_jitter": retry_jitter,
            "http_timeout_seconds": http_timeout_seconds,
            "lease_seconds": lease_seconds,
            "account_limits": dict(account_limits or {}),
        }
        self.enqueues: list[str] = []
        self.deliveries: dict[str, list[str]] = {"target-0": []}
        self.workers: dict[str, list[str]] = {}
        self.faults: list[str] = []
        self.finals: list[str] = []
        self._seen: dict[str, int] = {}
        self._max_attempts: dict[str, int] = {}

    # -- records ----------------------------------------------------------------------------

    def enqueue(
        self,
        job_id: str,
        *,
        script: Mapping[str, Any] | None = None,
        max_attempts: int = 3,
        account: str = "acct-0",
        time: float = 1000.0,
        answer: str | None = "ok",
    ) -> None:
        """An invoke with the job's oracle, then its answer (None: the producer never
        heard back), as the producers write them."""
        self.enqueues.append(_ENQUEUE_LINES.line(to_record(EnqueueOp(
            type="invoke", job_id=job_id, time=time, process="producer-0", account=account,
            target_url="http://127.0.0.1:1/deliver",
            script=None if script is None else dict(script), max_attempts=max_attempts,
        ))))
        self._max_attempts[job_id] = max_attempts
        if answer is not None:
            self.enqueues.append(_ENQUEUE_LINES.line(to_record(EnqueueOp(
                type=answer, job_id=job_id, time=time + 0.001,  # type: ignore[arg-type]
                process="producer-0", error=None if answer == "ok" else "boom",
            ))))

    def deliver(
        self,
        job_id: str,
        *,
        attempt: int | None,
        received: float,
        answered: float | None,
        status: int | None = 200,
        worker: str | None = "worker-0",
        account: str | None = "acct-0",
        behaviour: str = "ok",
        target: str = "target-0",
        lease: str | None = None,
    ) -> None:
        """A request the echo target received, as it records one."""
        seen = self._seen.get(job_id, 0) + 1
        self._seen[job_id] = seen
        self.deliveries.setdefault(target, []).append(_DELIVERY_LINES.line(vars(Delivery(
            job_id=job_id, attempt=attempt, account=account, worker=worker, target=target,
            received=received, answered=answered,
            status=None if answered is None else status, behaviour=behaviour, seen=seen,
            account_in_flight=1, lease=lease,
        ))))

    def event(self, kind: str, worker: str, time: float, *, job_id: str | None = None,
              attempt: int | None = None, **data: Any) -> None:
        """A worker event, its fields as the dispatcher emits them."""
        fields = {"job_id": job_id, "attempt": attempt, **data}
        self.workers.setdefault(worker, []).append(
            _WORKER_LINES.line(worker_event_record(kind, worker, time, fields)))

    def attempt(
        self,
        job_id: str,
        attempt: int,
        *,
        claimed: float,
        status: int | None = 200,
        latency: float = 0.01,
        worker: str = "worker-0",
        account: str = "acct-0",
        behaviour: str = "ok",
        result: str | None = None,
        write: str | None = "applied",
        answered: bool = True,
        pick: str = "",
        sent: float | None = None,
    ) -> float:
        """One attempt as a correct dispatcher records it, through the dispatcher's own
        event builders: claim, delivery at the target, HTTP event (a status judged as the
        dispatcher judges it; no answer within the timeout is a timeout), result write
        (`write`: applied, fenced, info, or None for none). `result` overrides what the
        worker made of the call, for a worker that gets it wrong ("ok": it took the answer
        whenever it came). `pick` tells apart two picks the queue gave one attempt number
        (their lease tokens differ). `sent`: when the claim was sent (a slow claim's, before
        `claimed`; by default `claimed`, as a fast claim's). Returns the time the write was
        logged."""
        lease_seconds = float(self.run_info["lease_seconds"])
        timeout = float(self.run_info["http_timeout_seconds"])
        lease = Lease(
            job_id=uuid.uuid5(uuid.NAMESPACE_URL, job_id), account_id=account,
            target_url="http://127.0.0.1:1/deliver", payload={}, attempt=attempt,
            max_attempts=self._max_attempts.get(job_id, 3),
            lease_token=uuid.uuid5(uuid.NAMESPACE_URL, f"{job_id}-{attempt}{pick}"),
            locked_until=datetime.fromtimestamp(claimed + lease_seconds, UTC),
            worker_id=worker,
        )
        self._event(worker, claimed, job_id, "claim",
                    claim_event(lease, started=claimed if sent is None else sent))
        received = claimed + 0.001
        got = received + latency if answered else None
        self.deliver(job_id, attempt=attempt, received=received, answered=got, status=status,
                     worker=worker, account=account, behaviour=behaviour,
                     lease=str(lease.lease_token))
        end = received + min(latency, timeout) + 0.001
        call = self._call(status, claimed, end, timeout,
                          timed_out=got is None or latency >= timeout, result=result)
        self._event(worker, end, job_id, "http", http_event(lease, call))
        if write is not None:
            self._event(worker, end + 0.002, job_id, "write",
                        write_event(lease, call.outcome, write, call.error, end + 0.001))
        return end + 0.002

    @staticmethod
    def _call(status: int | None, start: float, end: float, timeout: float, *,
              timed_out: bool, result: str | None) -> Call:
        if result is None:
            if timed_out or status is None:
                return timed_out_call(start, end, timeout)
            return call_for_status(status, start, end)
        if result == "ok":
            return call_for_status(200 if status is None else status, start, end)
        if result == "timeout":
            return timed_out_call(start, end, timeout)
        return Call(result=result, outcome=Outcome.TRANSIENT,  # type: ignore[arg-type]
                    status=None, error="no connection", start=start, end=end)

    def _event(self, worker: str, time: float, job_id: str, kind: str,
               fields: dict[str, Any]) -> None:
        # The dispatcher's fields name the job by the lease's UUID; the history names it
        # by the id the builder was given.
        fields["job_id"] = job_id
        self.workers.setdefault(worker, []).append(
            _WORKER_LINES.line(worker_event_record(kind, worker, time, fields)))

    def fault(self, fault: str, start: float, end: float | None, *, target: str | None = None,
              job_id: str | None = None, attempt: int | None = None,
              skipped: str | None = None, data: Mapping[str, Any] | None = None) -> None:
        self.faults.append(json.dumps({
            "fault": fault, "start": start, "end": end, "target": target, "job_id": job_id,
            "attempt": attempt, "skipped": skipped, "data": dict(data or {}),
        }, separators=(",", ":")) + "\n")

    def final(self, job_id: str, status: str, *, attempts: int = 1, max_attempts: int = 3,
              account: str = "acct-0", last_error: str | None = None,
              extra: Mapping[str, Any] | None = None) -> None:
        self.finals.append(_FINAL_LINES.line({
            "job_id": job_id, "account_id": account, "status": status, "attempts": attempts,
            "max_attempts": max_attempts, "last_error": last_error, "locked_until": None,
            "next_attempt_at": None, "extra": dict(extra or {}),
        }))

    # -- output -----------------------------------------------------------------------------

    def write(self, run_dir: Path, *, nemesis: bool = True) -> Path:
        run_dir.mkdir(parents=True, exist_ok=True)
        spec: dict[str, Any] = {"scenario": "synthetic", "seed": 0}
        if self.guarantees is not None:
            spec["guarantees"] = self.guarantees
        if self.objectives is not None:
            spec["scenario"] = {"name": "synthetic", "objectives": self.objectives}
        if self.load_window is not None:
            start, end = self.load_window
            spec["phases"] = [{"name": "warmup", "start": start, "end": start},
                              {"name": "load", "start": start, "end": end}]
        write_json(run_dir / SPEC_FILE, spec)
        write_json(run_dir / RUN_FILE, self.run_info)
        write_log(run_dir / ENQUEUES_FILE, ENQUEUE_LOG, self.enqueues)
        write_log(run_dir / FINAL_JOBS_FILE, FINAL_JOBS_LOG, self.finals)
        (run_dir / DELIVERIES_DIR).mkdir(exist_ok=True)
        for name, lines in self.deliveries.items():
            write_log(run_dir / DELIVERIES_DIR / f"{name}{LOG_SUFFIX}", DELIVERY_LOG, lines)
        (run_dir / WORKERS_DIR).mkdir(exist_ok=True)
        for name, lines in self.workers.items():
            write_log(run_dir / WORKERS_DIR / f"{name}{LOG_SUFFIX}", WORKER_LOG, lines)
        if nemesis:
            write_log(run_dir / NEMESIS_FILE, None, self.faults)
        return run_dir


def write_log(path: Path, log: LogFormat | None, lines: list[str]) -> None:
    """A log as `LogWriter` leaves it: `log`'s header (None: JSON Lines, no header), then
    `lines`, each ending in a newline."""
    with path.open("w") as fh:
        if log is not None:
            fh.write(log.header())
        fh.writelines(lines)


def history_files(run_dir: Path) -> list[Path]:
    """The logs of a run directory (CSV and JSON Lines), not its cache."""
    return [p for p in run_dir.rglob("*") if p.is_file() and p.suffix in (LOG_SUFFIX, ".jsonl")
            and columnar.CACHE_DIR not in p.relative_to(run_dir).parts]
