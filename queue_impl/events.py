"""What a worker records: the event sink, and the fields of each event about one lease.

Module functions, so that whatever writes a worker's history by hand (a synthetic history, a
test's) writes exactly what the dispatcher and the native worker loops do. Kinds and fields as
`skiplock.reports.history.WorkerEventKind` documents them; this package imports nothing from
the harness, and the worker pool wires the sink to the run directory.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from skiplock.queue_impl.interface import Lease, Outcome

# (kind, fields): `job_id` and `attempt` are lifted into the record; every other field is its
# data. The worker log is CSV with a column per field (`skiplock.reports.history.WORKER_LOG`),
# and it refuses a field it has no column for: a new field needs its column there first.
EventSink = Callable[[str, Mapping[str, Any]], None]

# The backend call an `error` event names.
FailedOp = Literal["recover", "claim", "receive", "finish", "renew", "release", "wait"]

HttpResultName = Literal["ok", "http_error", "timeout", "connection_error", "refused"]

# The `reason` of a `release` event for leases given back because too little of them was left.
LEASE_TOO_SHORT = "lease too short to send"
# The `reason` of a `release` event for leases given back because their receipt never landed.
NOT_RECEIVED = "receipt not confirmed"


@dataclass(frozen=True, kw_only=True)
class Call:
    """One HTTP call as it ended: the `http` event's content."""

    result: HttpResultName
    outcome: Outcome
    status: int | None
    error: str | None
    start: float
    end: float


def _iso(when: datetime) -> str:
    return when.isoformat()


def claim_event(lease: Lease, started: float | None = None) -> dict[str, Any]:
    """A lease taken; `started`: when the claim that took it was sent (epoch seconds), the
    earliest the row can have been taken (the checker orders claims by it)."""
    event = {"job_id": str(lease.job_id), "attempt": lease.attempt,
             "lease_token": str(lease.lease_token), "locked_until": _iso(lease.locked_until)}
    if started is not None:
        event["started"] = started
    return event


def renew_event(lease: Lease, locked_until: datetime | None) -> dict[str, Any]:
    """A lease renewed until `locked_until`, or found gone (None: the renewal was refused)."""
    held: dict[str, Any] = ({"lost": True} if locked_until is None
                            else {"locked_until": _iso(locked_until)})
    return {"job_id": str(lease.job_id), "attempt": lease.attempt,
            "lease_token": str(lease.lease_token), **held}


def http_event(lease: Lease, call: Call) -> dict[str, Any]:
    return {"job_id": str(lease.job_id), "attempt": lease.attempt, "start": call.start,
            "end": call.end, "result": call.result, "status": call.status, "error": call.error,
            "lease_token": str(lease.lease_token)}


def write_event(lease: Lease, outcome: Outcome, result: str, error: str | None,
                started: float) -> dict[str, Any]:
    """A result write: `result` applied | fenced | info (unknown: the write may or may not
    have committed); `started` when its statement was first sent."""
    return {"job_id": str(lease.job_id), "attempt": lease.attempt, "outcome": outcome.value,
            "result": result, "error": error, "started": started,
            "lease_token": str(lease.lease_token)}


def release_event(lease: Lease, result: str, reason: str | None = None) -> dict[str, Any]:
    """A lease given back unsent: `result` applied | fenced; `reason` why, when not a stop."""
    because = {} if reason is None else {"reason": reason}
    return {"job_id": str(lease.job_id), "attempt": lease.attempt, "result": result, **because}


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def log(message: str) -> None:
    """One line on the worker's stderr."""
    print(f"skiplock worker: {message}", file=sys.stderr, flush=True)


__all__ = ["LEASE_TOO_SHORT", "NOT_RECEIVED", "Call", "EventSink", "FailedOp", "HttpResultName",
           "claim_event", "http_event", "log", "one_line", "release_event", "renew_event",
           "write_event"]
