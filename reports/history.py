"""The run directory: the one schema that writers (runner, target, workers, nemeses) and
readers (checker, reports) share.

A run directory is the contract between running and judging, as a Jepsen history is. Every
file is JSON Lines (one self-contained record per line, appended and flushed as it happens,
so a crash loses at most the line being written) except the few written once at the end.

    RUN_DIR/
      spec.json            resolved spec + self-description (seed, versions, machine, git sha)
      enqueues.jsonl       producer operations: invoke / ok / fail / info, with the job oracle
      deliveries/*.jsonl   one file per echo target: every request it received
      workers/*.jsonl      one file per dispatcher process: claims, HTTP calls, result writes
      nemesis.jsonl        fault events, each with a start and an end
      final_jobs.jsonl     the queue's job states after the drain
      run.json             how the run ended (drain completed or timed out, exit reason)
      samples.csv          per-second samples; locust/ holds Locust's CSV statistics
      verdict.json         written by the checker

Times are wall-clock seconds since the epoch (`time.time()`), comparable across processes on
one machine. Writers use `JsonlWriter`; readers call `read_jsonl`, which refuses a
truncated file rather than judging half a history.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Literal

# The wire protocol belongs to the dispatcher; re-exported so readers import one module.
from queue_impl.interface import (  # noqa: F401
    ACCOUNT_HEADER,
    ATTEMPT_HEADER,
    JOB_ID_HEADER,
    WORKER_HEADER,
)
from queue_impl.retry import status_is_transient  # noqa: F401

SPEC_FILE = "spec.json"
ENQUEUES_FILE = "enqueues.jsonl"
DELIVERIES_DIR = "deliveries"
WORKERS_DIR = "workers"
NEMESIS_FILE = "nemesis.jsonl"
FINAL_JOBS_FILE = "final_jobs.jsonl"
RUN_FILE = "run.json"
SAMPLES_FILE = "samples.csv"
LOCUST_DIR = "locust"
VERDICT_FILE = "verdict.json"



class HistoryError(Exception):
    """The run directory cannot be read as a history (missing or truncated file)."""


# --------------------------------------------------------------------------------------------
# Job scripts: what the echo target does with each delivery of a job. The script travels in
# the job's payload under "script", so the target needs no side channel, and the checker
# derives each job's oracle from it (never from what the queue wrote about itself).
# --------------------------------------------------------------------------------------------


class Behaviour(str, Enum):
    OK = "ok"  # answer 200 at once
    STATUS = "status"  # answer `status` at once
    SLOW = "slow"  # answer 200 after `seconds` (meant to be inside the HTTP timeout)
    HANG = "hang"  # answer 200 after `seconds` (meant to be past the HTTP timeout): late
    HANG_FOREVER = "hang_forever"  # never answer; the target drops it when the client leaves
    RESET = "reset"  # reset the TCP connection without an answer


@dataclass(frozen=True, kw_only=True)
class Step:
    behaviour: Behaviour
    status: int = 200
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"behaviour": self.behaviour.value}
        if self.behaviour is Behaviour.STATUS:
            out["status"] = self.status
        if self.behaviour in (Behaviour.SLOW, Behaviour.HANG):
            out["seconds"] = self.seconds
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Step:
        behaviour = Behaviour(raw["behaviour"])
        return cls(
            behaviour=behaviour,
            status=int(raw.get("status", 200)),
            seconds=float(raw.get("seconds", 0.0)),
        )


@dataclass(frozen=True, kw_only=True)
class JobScript:
    """`first` for the first `times` deliveries the target sees of this job (None: all of
    them), then `then`. The target counts deliveries itself, by job id, so a queue that sends
    a wrong attempt header cannot change what the job does."""

    name: str
    first: Step
    times: int | None = None
    then: Step = field(default_factory=lambda: Step(behaviour=Behaviour.OK))

    def step_for(self, delivery_number: int) -> Step:
        """The step for the n-th delivery (1-based) the target has seen of this job."""
        if self.times is None or delivery_number <= self.times:
            return self.first
        return self.then

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "first": self.first.to_json(),
            "times": self.times,
            "then": self.then.to_json(),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> JobScript:
        return cls(
            name=str(raw.get("name", "custom")),
            first=Step.from_json(raw["first"]),
            times=None if raw.get("times") is None else int(raw["times"]),
            then=Step.from_json(raw.get("then", {"behaviour": "ok"})),
        )


SUCCEED = JobScript(name="succeed", first=Step(behaviour=Behaviour.OK))


# --------------------------------------------------------------------------------------------
# Records. Each file's lines are one of these, as JSON; `kind` names the record type.
# --------------------------------------------------------------------------------------------

EnqueueType = Literal["invoke", "ok", "fail", "info"]


@dataclass(frozen=True, kw_only=True)
class EnqueueOp:
    """One producer operation. `invoke` carries the oracle (script, max_attempts, account);
    `ok` / `fail` / `info` carry only the job id and, for fail / info, the error. An error
    during COMMIT is `info`: the insert may or may not have happened."""

    type: EnqueueType
    job_id: str
    time: float
    process: str
    account: str | None = None
    target_url: str | None = None
    script: dict[str, Any] | None = None
    max_attempts: int | None = None
    run_at: float | None = None
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class Delivery:
    """One request the echo target received. Written (and flushed) before the response is
    sent; for requests never answered, when the target gives up on them."""

    job_id: str
    attempt: int | None  # from the header, as the queue claimed it; may be missing or wrong
    account: str | None
    worker: str | None
    target: str
    received: float
    answered: float | None  # None: never answered (reset, hang forever, client went away)
    status: int | None  # None when not answered
    behaviour: str
    # The target's own 1-based count of deliveries of this job (it decides the script step).
    seen: int
    # Deliveries of this account in flight at the target when this one arrived (this one
    # included).
    account_in_flight: int


WorkerEventKind = Literal[
    "start",  # worker process started (fields: pid)
    "stop",  # worker process leaving cleanly (fields: reason)
    "claim",  # got a lease (job_id, attempt, lease_token, locked_until)
    "http",  # an HTTP call ended (job_id, attempt, start, end, result, status, error)
    "write",  # a result write (job_id, attempt, outcome, result: applied|fenced|info, error)
    "renew",  # a lease renewed or lost (job_id, attempt, locked_until or lost=True)
    "release",  # a lease given back on graceful shutdown (job_id, attempt)
    "recover",  # this worker's recovery moved `count` expired leases
    "failpoint",  # a failpoint fired (name, job_id, attempt): the process is about to die
]

HttpResult = Literal["ok", "http_error", "timeout", "connection_error", "refused"]


@dataclass(frozen=True, kw_only=True)
class WorkerEvent:
    kind: WorkerEventKind
    worker: str
    time: float
    job_id: str | None = None
    attempt: int | None = None
    data: dict[str, Any] = field(default_factory=dict)


FaultKind = Literal[
    "kill_worker",  # SIGKILL a worker mid-lease
    "crash_after_claim",  # failpoint: die after claim, before HTTP
    "crash_after_http",  # failpoint: die after a successful HTTP call, before the DB write
    "hang_target",  # the target holds requests past the HTTP timeout
    "pause_worker",  # SIGSTOP past the lease, then SIGCONT
    "terminate_backends",  # pg_terminate_backend on the queue's connections
    "restart_postgres",  # stop and start the server the harness owns
    "pin_xmin",  # an idle transaction holding back xmin
    "exhaust_pool",  # connections held until the pool is exhausted
]


@dataclass(frozen=True, kw_only=True)
class FaultEvent:
    """A fault with its window. `target` names what it hit (a worker id, "postgres", ...);
    `job_id` / `attempt` are set when the fault hit one known attempt (failpoints)."""

    fault: FaultKind
    start: float
    end: float | None
    target: str | None = None
    job_id: str | None = None
    attempt: int | None = None
    skipped: str | None = None  # why the fault was not applied (e.g. server is external)
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """How the run ended. `drained` False means jobs were still live when the drain's time
    ran out: the checker then answers "unknown" for them rather than calling them stuck."""

    started: float
    finished: float
    drained: bool
    drain_seconds: float
    exit_reason: str  # "completed", "interrupted", "error: ..."
    backend: str
    retry_base_seconds: float
    retry_cap_seconds: float
    retry_jitter: float
    http_timeout_seconds: float
    lease_seconds: float
    account_limits: dict[str, int | None]
    # Rows in final_jobs.jsonl; None when no final snapshot was taken.
    final_jobs: int | None = None


# --------------------------------------------------------------------------------------------
# Writing and reading.
# --------------------------------------------------------------------------------------------


def to_record(obj: Any) -> dict[str, Any]:
    """A dataclass record as a JSON-ready dict (enums as their values)."""
    raw = asdict(obj)
    return {k: (v.value if isinstance(v, Enum) else v) for k, v in raw.items()}


class JsonlWriter:
    """Appends one JSON object per line with a single write() each, so a line is either whole
    or absent if the process dies (and lines from one process never interleave)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: Mapping[str, Any] | Any) -> None:
        data = record if isinstance(record, Mapping) else to_record(record)
        line = json.dumps(data, separators=(",", ":"), default=str) + "\n"
        os.write(self._fd, line.encode())

    def fsync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Yield the records of a JSON Lines file. A last line without its newline, or a line
    that is not JSON, means the file was cut off mid-write: that is a HistoryError, because
    a history is never judged with parts of it missing."""
    if not path.exists():
        raise HistoryError(f"{path} is missing")
    with path.open("rb") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.endswith(b"\n"):
                raise HistoryError(f"{path}:{number} is truncated mid-line")
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise HistoryError(f"{path}:{number} is not valid JSON ({exc.msg})") from None
            if not isinstance(value, dict):
                raise HistoryError(f"{path}:{number} is not a JSON object")
            yield value


def read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise HistoryError(f"{path} is missing")
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise HistoryError(f"{path} is not valid JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise HistoryError(f"{path} is not a JSON object")
    return value


def write_json(path: Path, value: Mapping[str, Any]) -> None:
    """Write atomically (temp file + rename): readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)
