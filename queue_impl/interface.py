"""The one interface every system under test implements.

The harness (dispatcher, producers, runner, tests) depends on `QueueBackend` only, never on
the PostgreSQL class. The in-memory implementation in `skiplock.queue_impl.memory` is the model the
stateful tests compare the real queues against, and one contract suite runs over all of them.

Times are timezone-aware `datetime`s. A backend reads "now" from its own clock (the database's
for PostgreSQL, so that every worker agrees); tests pin that clock instead of sleeping.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import Enum
from typing import Any, Literal, Protocol, get_args, runtime_checkable

# Every delivery carries these, so a target can deduplicate (at-least-once delivery).
JOB_ID_HEADER = "X-Skiplock-Job-Id"
ATTEMPT_HEADER = "X-Skiplock-Attempt"
ACCOUNT_HEADER = "X-Skiplock-Account"
WORKER_HEADER = "X-Skiplock-Worker"
# The claim's lease token: names one pick of the job, whatever attempt number the queue gives.
LEASE_HEADER = "X-Skiplock-Lease"


class JobStatus(str, Enum):
    PENDING = "PENDING"
    PROCESSING = "PROCESSING"
    RETRYING = "RETRYING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED)


class Outcome(str, Enum):
    """How one attempt ended, as the dispatcher classified it."""

    SUCCESS = "success"
    # Retry later (timeouts, connection errors, 5xx, 408, 429): the job goes to RETRYING,
    # or to FAILED when it has used max_attempts.
    TRANSIENT = "transient"
    # Never retry (other 4xx, bad URL, refused by the SSRF guard): the job goes to FAILED.
    PERMANENT = "permanent"


class WriteResult(str, Enum):
    """What happened to a result write (complete / fail / release)."""

    APPLIED = "applied"
    # The caller no longer holds the lease: another worker (or recovery) took the job, or the
    # token does not match. Nothing was changed, and the fencing was recorded.
    FENCED = "fenced"


@dataclass(frozen=True, kw_only=True)
class Account:
    id: str
    # None means unlimited: claims for that account take no account lock.
    concurrency_limit: int | None = None


@dataclass(frozen=True, kw_only=True)
class NewJob:
    id: uuid.UUID
    account_id: str
    target_url: str
    payload: Mapping[str, Any]
    max_attempts: int = 3
    # None means "due now" (the backend's clock at insert).
    run_at: datetime | None = None


@dataclass(frozen=True, kw_only=True)
class Lease:
    """A claimed job: the worker holding it may execute it until `locked_until`."""

    job_id: uuid.UUID
    account_id: str
    target_url: str
    payload: Mapping[str, Any]
    attempt: int
    max_attempts: int
    lease_token: uuid.UUID
    locked_until: datetime
    worker_id: str

    # The ids as text, made once: a job's events, headers and result write each name them,
    # and `UUID.__str__` was 2 % of a busy worker's CPU.
    @functools.cached_property
    def job_id_text(self) -> str:
        return str(self.job_id)

    @functools.cached_property
    def token_text(self) -> str:
        return str(self.lease_token)


@dataclass(frozen=True, kw_only=True)
class AttemptResult:
    """The outcome of one execution, handed back to the queue in one short transaction."""

    lease: Lease
    outcome: Outcome
    http_status: int | None = None
    error: str | None = None
    # For TRANSIENT outcomes: how long to wait before the next attempt (backoff + jitter,
    # computed by the dispatcher's RetryPolicy). Ignored for other outcomes.
    retry_delay: timedelta = timedelta(0)
    started_at: datetime | None = None
    finished_at: datetime | None = None


@dataclass(frozen=True, kw_only=True)
class JobState:
    """One row of the final-state snapshot the runner writes after the drain."""

    job_id: uuid.UUID
    account_id: str
    status: JobStatus
    attempts: int
    max_attempts: int
    last_error: str | None = None
    locked_until: datetime | None = None
    next_attempt_at: datetime | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


BackendName = Literal["pg", "pg-naive", "pg-for-update", "pg-long-tx"]

AttemptsCount = Literal["claims", "received", "finished"]


@dataclass(frozen=True, kw_only=True)
class Guarantees:
    """What a queue promises, declared by its backend (a `guarantees` attribute on the queue
    or its class; the reference's when absent). The run records it in spec.json; the checker
    judges only the promises made and lists every check it did not apply, and why."""

    # Per-account concurrency limits hold at every moment.
    account_limits: bool = True
    # A result written after the lease was lost (another claim took the job) is refused.
    fencing: bool = True
    # What `max_attempts` counts: every committed claim ("claims": a claim whose worker died,
    # or whose result was lost with its connection, counts); every claim its worker received
    # before calling ("received", the reference: a claim nobody received is given back when
    # its lease expires, so only an attempt that could have been delivered counts); or only
    # attempts that finished ("finished": a pick that stalled is not counted).
    attempts_count: AttemptsCount = "claims"
    # The retry wait is capped at the configured cap (the reference's capped backoff). A
    # queue without a cap waits longer than the cap allows once the cap would bind.
    retry_cap: bool = True
    # Jobs are served in the order they became due, within each account's limit: a due job
    # of an account with a free slot is not left waiting while later jobs of other accounts
    # are claimed (`starvation`).
    fairness: bool = True
    # The queue's claim is a transaction of its own, ended by a COMMIT statement: the
    # pause_in_claim fault stalls it between its statements and its COMMIT, and the
    # commit-phase terminate_backends looks for that COMMIT (without one, for commits
    # waiting on their WAL flush).
    claim_transaction: bool = True
    # Recovery of expired leases can be switched off (`recovery = false`, --no-recovery):
    # the harness's own loop runs it; a library's loop may always run its own.
    recovery_switch: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"account_limits": self.account_limits, "fencing": self.fencing,
                "fairness": self.fairness,
                "attempts_count": self.attempts_count, "retry_cap": self.retry_cap,
                "claim_transaction": self.claim_transaction,
                "recovery_switch": self.recovery_switch}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Guarantees:
        """From spec.json's `guarantees`; ValueError for a value of the wrong type."""
        flags = ("account_limits", "fencing", "fairness", "retry_cap", "claim_transaction",
                 "recovery_switch")
        for key in flags:
            if not isinstance(raw.get(key, True), bool):
                raise ValueError(f"guarantees.{key} must be true or false")
        count = raw.get("attempts_count", "claims")
        if count not in get_args(AttemptsCount):
            raise ValueError("guarantees.attempts_count must be \"claims\", \"received\" or "
                             "\"finished\"")
        return cls(**{k: bool(raw.get(k, True)) for k in flags}, attempts_count=count)


REFERENCE_GUARANTEES = Guarantees()


@runtime_checkable
class DeclaresGuarantees(Protocol):
    """A backend that promises less than the reference (or says what it promises): the
    checker judges it by these, and marks what it does not promise as not applicable."""

    guarantees: Guarantees


@runtime_checkable
class DeclaresSharing(Protocol):
    """A factory, queue or queue class that says whether separate processes share its
    queue: `shared = False` for one that lives in the process that built it (the in-memory
    model), which skiplock then runs in one process only."""

    shared: bool


def guarantees_of(queue: object) -> Guarantees:
    """The promises `queue` declares, else the reference's."""
    if isinstance(queue, DeclaresGuarantees) and isinstance(queue.guarantees, Guarantees):
        return queue.guarantees
    return REFERENCE_GUARANTEES


# -- optional capabilities: a backend has one by having the attribute; the dispatcher asks
# with isinstance, never by name. (docs/guides/writing-a-plugin.md lists them.)


@runtime_checkable
class HoldsClaims(Protocol):
    """A queue whose claim may stay uncommitted until its results are written (pg-long-tx):
    when `holds_claims` is true the dispatcher claims a batch only once the previous one is
    written (a claim sent meanwhile would join the open transaction)."""

    @property
    def holds_claims(self) -> bool: ...


@runtime_checkable
class ThrottledNotify(Protocol):
    """A queue that skips the NOTIFY of enqueues closer together than `notify_interval`
    seconds: a woken worker claims once more that long after each wake-up."""

    @property
    def notify_interval(self) -> float: ...


@runtime_checkable
class ClaimCommitHook(Protocol):
    """A queue whose claim calls `claim_commit_hook` (when set) after its statements and
    before its COMMIT: where the `pause_worker` fault with `phase = "claim"` stalls it."""

    claim_commit_hook: Callable[[], None] | None


@runtime_checkable
class HeartbeatLease(Protocol):
    """A queue whose lease is a heartbeat (pgqueuer's `heartbeat_timeout`): a pick stays its
    worker's while its last heartbeat is younger than the lease, and any worker may pick it
    again after. With `heartbeat_lease` true the checker measures each pick's lease from
    when its claim or last heartbeat was *sent* (the `started` of its `claim` and `renew`
    events, which `NativeDelivery` records; the database stamps the heartbeat no earlier),
    not from when the worker recorded it returning, which a worker paused between the two
    records late, making a legitimate re-pick look like `concurrent_delivery`."""

    @property
    def heartbeat_lease(self) -> bool: ...


LeaseKind = Literal["renewal", "heartbeat"]


def lease_kind(queue: object) -> LeaseKind:
    """How `queue`'s lease runs, as spec.json records it (`lease`) for the checker."""
    return ("heartbeat" if isinstance(queue, HeartbeatLease) and queue.heartbeat_lease
            else "renewal")


@runtime_checkable
class QueueBackend(Protocol):
    """A job queue as the harness drives it.

    One instance per process: it opens its own connections lazily, after the process that uses
    it has started (nothing that holds a socket crosses a process boundary). Every method is
    one short transaction unless the backend's documented anti-pattern says otherwise.
    """

    name: str

    def setup(self) -> None:
        """Create the schema if it is missing. Idempotent; safe from many processes at once."""

    def upsert_accounts(self, accounts: Sequence[Account]) -> None:
        """Create or update accounts and their concurrency limits."""

    def enqueue(self, jobs: Sequence[NewJob]) -> None:
        """Insert a batch of jobs in one transaction (all or nothing)."""

    def claim(self, worker_id: str, batch: int, lease: timedelta) -> list[Lease]:
        """Claim up to `batch` due jobs (PENDING past run_at, RETRYING past next_attempt_at),
        respecting account limits; each gets attempts + 1, a lease and a fresh token."""

    def finish(self, results: Sequence[AttemptResult]) -> list[WriteResult]:
        """Record outcomes, in order. Each is applied only while its lease is still held."""

    def renew(self, leases: Sequence[Lease], extend: timedelta) -> list[Lease | None]:
        """Extend leases still held; None for a lease that was lost (fenced)."""

    def release(self, leases: Sequence[Lease]) -> list[WriteResult]:
        """Give back leases not executed (graceful shutdown): the attempt is not counted."""

    def recover(self, limit: int = 100) -> int:
        """Move up to `limit` expired leases to RETRYING, or FAILED at max_attempts.
        Safe to run in every worker at once. Returns how many jobs it moved."""

    def wait_for_work(self, timeout: float) -> bool:
        """Block until new work may be due (a notification) or `timeout` seconds pass."""

    def snapshot(self) -> list[JobState]:
        """Every job's current state, for the final-state snapshot."""

    def close(self) -> None:
        """Close connections. The backend may be used again after (it reconnects)."""


@runtime_checkable
class ConfirmsReceipt(Protocol):
    """An optional capability: the worker confirms it has a claim's leases in hand before its
    first call, so the queue counts an attempt only if it could have been delivered. A claim
    can commit while its connection dies: the worker sees an error and never the leases, and
    a queue that counted such a claim would dead-letter jobs short of their deliveries. The
    queue gives an expired lease that was never received back on recovery (attempts
    unchanged), and declares `attempts_count="received"`."""

    def receive(self, leases: Sequence[Lease]) -> list[WriteResult]:
        """Mark the leases received, in order; FENCED for one no longer held (the worker
        must not call it). Safe to send again after an error: marking twice changes
        nothing."""


@runtime_checkable
class FinishesWhileClaiming(Protocol):
    """An optional capability: a worker's results and its next claim written together, in
    one transaction and one round trip where the queue can (one commit instead of two), as
    a worker that finishes a batch and claims the next does. The writes are the same as
    `finish` then `claim`: each result applied only where its lease still holds, each lease
    taken only from due work. After an error the outcome of both is unknown, as it is for
    either alone: the results may have been written (a resend of them is fenced) and a
    claim may have committed (its leases expire)."""

    @property
    def one_transaction(self) -> bool:
        """Whether `finish_and_claim` is one transaction as configured now. When it is two
        (a variant or a hook that needs the claim on its own), an error in the claim loses
        the finish's answer, so a worker that logs every write's outcome calls the two
        apart."""

    def finish_and_claim(
        self, results: Sequence[AttemptResult], worker_id: str, batch: int, lease: timedelta
    ) -> tuple[list[WriteResult], list[Lease]]:
        """`finish(results)`'s answer, then `claim(worker_id, batch, lease)`'s."""


@runtime_checkable
class RunsOwnWorker(Protocol):
    """An optional capability: the queue brings its own consumer loop (BullMQ's `Worker`,
    pgqueuer's `QueueManager`, ...), run in each worker process instead of skiplock's
    dispatcher, so a run covers the queue as its users deploy it. The loop hands each job to
    a `skiplock.queue_impl.native.NativeDelivery` (the same SSRF guard, timeout, identity headers,
    failpoints and worker events as the dispatcher's) and returns once `stop` is set and the
    jobs it holds are finished. `claim`, `finish`, `renew`, `release` and `recover` are then
    never called by the harness. `config` is a `skiplock.queue_impl.native.NativeConfig`: the
    dispatcher's settings with the run's accounts, their limits and `max_attempts`."""

    async def run_worker(self, config: Any, worker_id: str, sink: Any,
                         stop: Any) -> None:
        """Consume jobs until `stop` (an asyncio.Event) is set, inside `NativeDelivery`
        (entered with `sink`), which writes the worker's `start` and `stop` events."""


@runtime_checkable
class TearsDown(Protocol):
    """An optional capability: remove everything the queue made (its keys, its tables)
    once the run's final snapshot is taken. Without it, the run drops its PostgreSQL
    schema, where a SQL backend keeps everything."""

    def teardown(self) -> None:
        """Remove the queue's data; safe to call when setup() never ran."""


class StatementError(ValueError):
    """A statement a backend would run that the database refuses to prepare (a syntax error,
    an unknown column or function): found before any load starts, and named by the file and
    block it came from. `ours` says the statement is the harness's own (the reference SQL
    against the reference schema), so a failure is a skiplock bug, not bad input."""

    def __init__(self, *, source: str, block: str, error: str, ours: bool = False,
                 note: str | None = None) -> None:
        self.source = source
        self.block = block
        self.error = error
        self.ours = ours
        self.note = note
        super().__init__(f"{source}: block {block!r}: {error}" + (f" ({note})" if note else ""))


@runtime_checkable
class ChecksStatements(Protocol):
    """An optional capability of a backend: check every statement it may run against the
    database, without running any, once `setup()` has created its schema. The runner calls
    it before any load starts; a backend without it is not checked."""

    def check_statements(self) -> None:
        """Raise `StatementError` for the first statement the database refuses to prepare."""
