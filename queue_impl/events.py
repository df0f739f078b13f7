"""What a worker records: the event sink, and the fields of each event about one lease.

Module functions, so that whatever writes a worker's history by hand (a synthetic history, a
test's) writes exactly what the dispatcher and the native worker loops do. Kinds and fields as
`skiplock.reports.history.WorkerEventKind` documents them; this package imports nothing from
the harness, and the worker pool wires the sink to the run directory.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Protocol, runtime_checkable

from skiplock.queue_impl.interface import Lease, Outcome

# (kind, fields): `job_id` and `attempt` are lifted into the record; every other field is its
# data. The worker log is CSV with a column per field (`skiplock.reports.history.WORKER_LOG`),
# and it refuses a field it has no column for: a new field needs its column there first.
EventSink = Callable[[str, Mapping[str, Any]], None]


@runtime_checkable
class EventBatchSink(Protocol):
    """A sink that also takes several events of one kind at once (a claim's, a result
    write's), recording them as it would one by one, in one write."""

    def __call__(self, kind: str, fields: Mapping[str, Any]) -> None: ...

    def many(self, kind: str, events: Sequence[Mapping[str, Any]]) -> None: ...


def emitter_of_many(sink: EventSink) -> Callable[[str, Sequence[Mapping[str, Any]]], None]:
    """How to record several events of one kind on `sink`: at once where it can."""
    if isinstance(sink, EventBatchSink):
        return sink.many

    def one_by_one(kind: str, events: Sequence[Mapping[str, Any]]) -> None:
        for fields in events:
            sink(kind, fields)

    return one_by_one


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
    event = {"job_id": lease.job_id_text, "attempt": lease.attempt,
             "lease_token": lease.token_text, "locked_until": _iso(lease.locked_until)}
    if started is not None:
        event["started"] = started
    return event


def renew_event(lease: Lease, locked_until: datetime | None) -> dict[str, Any]:
    """A lease renewed until `locked_until`, or found gone (None: the renewal was refused)."""
    held: dict[str, Any] = ({"lost": True} if locked_until is None
                            else {"locked_until": _iso(locked_until)})
    return {"job_id": lease.job_id_text, "attempt": lease.attempt,
            "lease_token": lease.token_text, **held}


def http_event(lease: Lease, call: Call) -> dict[str, Any]:
    return {"job_id": lease.job_id_text, "attempt": lease.attempt, "start": call.start,
            "end": call.end, "result": call.result, "status": call.status, "error": call.error,
            "lease_token": lease.token_text}


def write_event(lease: Lease, outcome: Outcome, result: str, error: str | None,
                started: float) -> dict[str, Any]:
    """A result write: `result` applied | fenced | info (unknown: the write may or may not
    have committed); `started` when its statement was first sent."""
    return {"job_id": lease.job_id_text, "attempt": lease.attempt, "outcome": outcome.value,
            "result": result, "error": error, "started": started,
            "lease_token": lease.token_text}


def release_event(lease: Lease, result: str, reason: str | None = None) -> dict[str, Any]:
    """A lease given back unsent: `result` applied | fenced; `reason` why, when not a stop."""
    because = {} if reason is None else {"reason": reason}
    return {"job_id": lease.job_id_text, "attempt": lease.attempt, "result": result, **because}


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def log(message: str) -> None:
    """One line on the worker's stderr."""
    print(f"skiplock worker: {message}", file=sys.stderr, flush=True)


__all__ = ["LEASE_TOO_SHORT", "NOT_RECEIVED", "Call", "EventBatchSink", "EventSink", "FailedOp",
           "HttpResultName", "claim_event", "emitter_of_many", "http_event", "log", "one_line",
           "release_event", "renew_event", "write_event"]
