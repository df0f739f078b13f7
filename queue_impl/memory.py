"""The in-memory queue: the model the stateful tests hold the PostgreSQL queue to.

Same semantics as the reference SQL, step for step (limits, fencing, recovery, release, dead
letters, backoff taken from the AttemptResult), including which rows a claim picks: each of
the PENDING and RETRYING candidate lists is cut to `batch` before the per-account cut, as the
claim statement does, and only the limited accounts claim step 1 would lock (up to `batch`
with due work and a free slot, oldest due work first) are open. It runs in one process and
has its own clock, moved by `advance()`.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from skiplock.queue_impl.interface import (
    Account,
    AttemptResult,
    Guarantees,
    JobState,
    JobStatus,
    Lease,
    NewJob,
    Outcome,
    WriteResult,
)
from skiplock.queue_impl.validate import check_jobs


@dataclass(kw_only=True)
class _Job:
    id: uuid.UUID
    account_id: str
    target_url: str
    payload: Any
    status: JobStatus
    run_at: datetime
    max_attempts: int
    attempts: int = 0
    next_attempt_at: datetime | None = None
    locked_until: datetime | None = None
    lease_token: uuid.UUID | None = None
    # The lease token its worker confirmed receiving (`receive`); see `recover`.
    received_token: uuid.UUID | None = None
    locked_by: str | None = None
    last_error: str | None = None


@dataclass(frozen=True, kw_only=True)
class FencedWrite:
    job_id: uuid.UUID
    attempt: int
    lease_token: uuid.UUID
    worker: str
    operation: str


class InMemoryQueue:
    """A `QueueBackend` held in a dict, for tests and as the model."""

    name = "memory"
    # One process's dict: producers and workers in other processes would share nothing, so
    # the harness refuses it for runs (skiplock.queue_impl.plugins.is_shared).
    shared = False
    # As the reference: an attempt counts once its worker received the claim.
    guarantees = Guarantees(attempts_count="received")

    def __init__(self, clock: Callable[[], datetime] | None = None) -> None:
        self._clock = clock or (lambda: datetime.now(UTC))
        self._offset = timedelta(0)
        self._jobs: dict[uuid.UUID, _Job] = {}
        self._limits: dict[str, int | None] = {}
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._notified = False
        self.fenced: list[FencedWrite] = []

    def now(self) -> datetime:
        return self._clock() + self._offset

    def advance(self, seconds: float) -> None:
        """Move this queue's clock forward."""
        if seconds < 0:
            raise ValueError("the clock only moves forward")
        with self._lock:
            self._offset += timedelta(seconds=seconds)

    def setup(self) -> None:
        return None

    def upsert_accounts(self, accounts: Sequence[Account]) -> None:
        with self._lock:
            for account in accounts:
                if account.concurrency_limit is not None and account.concurrency_limit <= 0:
                    raise ValueError("concurrency_limit must be positive (or None: unlimited)")
                self._limits[account.id] = account.concurrency_limit

    def enqueue(self, jobs: Sequence[NewJob]) -> None:
        with self._lock:
            now = self.now()
            ids = [job.id for job in jobs]
            if len(set(ids)) != len(ids) or any(i in self._jobs for i in ids):
                raise ValueError("duplicate job id in enqueue")
            check_jobs(jobs)
            for job in jobs:
                self._limits.setdefault(job.account_id, None)
                self._jobs[job.id] = _Job(
                    id=job.id,
                    account_id=job.account_id,
                    target_url=job.target_url,
                    payload=dict(job.payload),
                    status=JobStatus.PENDING,
                    run_at=job.run_at or now,
                    max_attempts=job.max_attempts,
                )
            if jobs:
                self._notified = True
                self._wakeup.notify_all()

    def claim(self, worker_id: str, batch: int, lease: timedelta) -> list[Lease]:
        if batch <= 0:
            raise ValueError("batch must be positive")
        if lease <= timedelta(0):
            raise ValueError("lease must be positive")
        with self._lock:
            now = self.now()
            free = self._open_accounts(now, batch)
            leases = []
            for job_id in self._oldest_due(now, batch, free)[:batch]:
                job = self._jobs[job_id]
                job.status = JobStatus.PROCESSING
                job.attempts += 1
                job.locked_until = now + lease
                job.lease_token = uuid.uuid4()
                job.locked_by = worker_id
                leases.append(_lease(job))
            return leases

    def _open_accounts(self, now: datetime, batch: int) -> dict[str, int]:
        """The claim's step 1: at most `batch` limited accounts with due work and a free
        slot, oldest due work first, ties by id (code point order, as COLLATE "C" in the
        SQL), each with its free slots."""
        active: dict[str, int] = {}
        for job in self._jobs.values():
            if job.status is JobStatus.PROCESSING:
                active[job.account_id] = active.get(job.account_id, 0) + 1
        oldest_due: dict[str, datetime] = {}
        for j in self._jobs.values():
            due = _due_at(j, now)
            if due is not None and self._limits.get(j.account_id) is not None:
                oldest_due[j.account_id] = min(due, oldest_due.get(j.account_id, due))
        eligible = sorted(
            (due, account)
            for account, due in oldest_due.items()
            if active.get(account, 0) < (self._limits[account] or 0)
        )
        return {
            account: (self._limits[account] or 0) - active.get(account, 0)
            for _, account in eligible[:batch]
        }

    def _oldest_due(self, now: datetime, batch: int, free: dict[str, int]) -> list[uuid.UUID]:
        """The claim's step 2: each open account's own due work, oldest first, at most its
        share (a limited account's free slots, an unlimited one's the batch); then the
        oldest of all that, no limited account past its free slots, as the SQL's
        per-account index reads do (the caller takes the first `batch`)."""

        def share(account: str) -> int:
            if self._limits.get(account) is None:
                return batch
            return min(free.get(account, 0), batch)

        def due_by_account(status: JobStatus) -> list[tuple[datetime, uuid.UUID]]:
            by_account: dict[str, list[tuple[datetime, uuid.UUID]]] = {}
            for j in self._jobs.values():
                due = _due_at(j, now)
                if j.status is status and due is not None:
                    by_account.setdefault(j.account_id, []).append((due, j.id))
            return [c for account, due in by_account.items()
                    for c in sorted(due)[:share(account)]]

        candidates = sorted(due_by_account(JobStatus.PENDING)
                            + due_by_account(JobStatus.RETRYING))
        taken: dict[str, int] = {}
        picked: list[uuid.UUID] = []
        for _, job_id in candidates:
            account = self._jobs[job_id].account_id
            taken[account] = taken.get(account, 0) + 1
            if account in free and taken[account] > free[account]:
                continue
            picked.append(job_id)
        return picked

    def _holds(self, lease: Lease) -> _Job | None:
        job = self._jobs.get(lease.job_id)
        if (
            job is None
            or job.status is not JobStatus.PROCESSING
            or job.lease_token != lease.lease_token
        ):
            return None
        return job

    def _fence(self, lease: Lease, operation: str) -> None:
        self.fenced.append(
            FencedWrite(
                job_id=lease.job_id,
                attempt=lease.attempt,
                lease_token=lease.lease_token,
                worker=lease.worker_id,
                operation=operation,
            )
        )

    def finish(self, results: Sequence[AttemptResult]) -> list[WriteResult]:
        out: list[WriteResult] = []
        with self._lock:
            now = self.now()
            for result in results:
                job = self._holds(result.lease)
                if job is None:
                    self._fence(result.lease, "finish")
                    out.append(WriteResult.FENCED)
                    continue
                job.locked_until = None
                job.lease_token = None
                job.next_attempt_at = None
                match result.outcome:
                    case Outcome.SUCCESS:
                        job.status = JobStatus.COMPLETED
                    case Outcome.PERMANENT:
                        job.status = JobStatus.FAILED
                        job.last_error = result.error
                    case Outcome.TRANSIENT:
                        job.last_error = result.error
                        if job.attempts >= job.max_attempts:
                            job.status = JobStatus.FAILED
                        else:
                            job.status = JobStatus.RETRYING
                            job.next_attempt_at = now + result.retry_delay
                out.append(WriteResult.APPLIED)
        return out

    def renew(self, leases: Sequence[Lease], extend: timedelta) -> list[Lease | None]:
        if extend <= timedelta(0):
            raise ValueError("extend must be positive")
        out: list[Lease | None] = []
        with self._lock:
            now = self.now()
            for lease in leases:
                job = self._holds(lease)
                if job is None:
                    self._fence(lease, "renew")
                    out.append(None)
                    continue
                job.locked_until = now + extend
                out.append(dataclasses.replace(lease, locked_until=job.locked_until))
        return out

    def receive(self, leases: Sequence[Lease]) -> list[WriteResult]:
        out: list[WriteResult] = []
        with self._lock:
            for lease in leases:
                job = self._holds(lease)
                if job is None:
                    out.append(WriteResult.FENCED)
                    continue
                job.received_token = job.lease_token
                out.append(WriteResult.APPLIED)
        return out

    def release(self, leases: Sequence[Lease]) -> list[WriteResult]:
        out: list[WriteResult] = []
        with self._lock:
            now = self.now()
            for lease in leases:
                job = self._holds(lease)
                if job is None:
                    self._fence(lease, "release")
                    out.append(WriteResult.FENCED)
                    continue
                _give_back(job, now)
                out.append(WriteResult.APPLIED)
            if any(r is WriteResult.APPLIED for r in out):
                self._notified = True
                self._wakeup.notify_all()
        return out

    def recover(self, limit: int = 100) -> int:
        if limit <= 0:
            raise ValueError("limit must be positive")
        with self._lock:
            now = self.now()
            expired = sorted(
                (
                    j
                    for j in self._jobs.values()
                    if j.status is JobStatus.PROCESSING
                    and j.locked_until is not None
                    and j.locked_until < now
                ),
                key=lambda j: (j.locked_until, j.id),
            )
            # As recover_unreceived then recover, in one transaction: first the leases never
            # received (given back: nothing was delivered), then the others (counted).
            unreceived = [j for j in expired if j.received_token != j.lease_token][:limit]
            for job in unreceived:
                _give_back(job, now)
            received = [j for j in expired if j.lease_token is not None
                        and j.received_token == j.lease_token]
            expired = received[:limit - len(unreceived)]
            for job in expired:
                if job.attempts >= job.max_attempts:
                    job.status = JobStatus.FAILED
                    job.next_attempt_at = None
                else:
                    job.status = JobStatus.RETRYING
                    job.next_attempt_at = now
                job.last_error = f"lease expired (attempt {job.attempts})"
                job.locked_until = None
                job.lease_token = None
            return len(unreceived) + len(expired)

    def wait_for_work(self, timeout: float) -> bool:
        with self._wakeup:
            if not self._notified:
                self._wakeup.wait(timeout=max(timeout, 0.0))
            woke, self._notified = self._notified, False
            return woke

    def snapshot(self) -> list[JobState]:
        with self._lock:
            return [
                JobState(
                    job_id=job.id,
                    account_id=job.account_id,
                    status=job.status,
                    attempts=job.attempts,
                    max_attempts=job.max_attempts,
                    last_error=job.last_error,
                    locked_until=job.locked_until,
                    next_attempt_at=job.next_attempt_at,
                    extra={"run_at": job.run_at, "locked_by": job.locked_by},
                )
                for job in sorted(self._jobs.values(), key=lambda j: j.id)
            ]

    def close(self) -> None:
        return None


def _give_back(job: _Job, now: datetime) -> None:
    """A lease ended unexecuted (released, or expired unreceived): due now, the attempt not
    counted; PENDING if it never ran, else RETRYING."""
    job.attempts -= 1
    if job.attempts == 0:
        job.status = JobStatus.PENDING
        job.next_attempt_at = None
    else:
        job.status = JobStatus.RETRYING
        job.next_attempt_at = now
    job.locked_until = None
    job.lease_token = None


def _due_at(job: _Job, now: datetime) -> datetime | None:
    """When a due job became due (PENDING: run_at; RETRYING: next_attempt_at), else None."""
    if job.status is JobStatus.PENDING and job.run_at <= now:
        return job.run_at
    if (
        job.status is JobStatus.RETRYING
        and job.next_attempt_at is not None
        and job.next_attempt_at <= now
    ):
        return job.next_attempt_at
    return None


def _lease(job: _Job) -> Lease:
    assert job.lease_token is not None and job.locked_until is not None
    assert job.locked_by is not None
    return Lease(
        job_id=job.id,
        account_id=job.account_id,
        target_url=job.target_url,
        payload=job.payload,
        attempt=job.attempts,
        max_attempts=job.max_attempts,
        lease_token=job.lease_token,
        locked_until=job.locked_until,
        worker_id=job.locked_by,
    )


def factory(**_: object) -> InMemoryQueue:
    """`skiplock.queue_impl.memory:factory` for `--backend`: ignores dsn, schema and sql_path. One
    queue per process, so it only suits single-process use (tests)."""
    return InMemoryQueue()


factory.shared = False  # type: ignore[attr-defined]
