"""One contract suite over every implementation of QueueBackend: the in-memory model, the
reference queue, and the variants whose semantics allow each test. Time is pinned and moved
by the test (`advance`), never slept."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from skiplock.queue_impl.interface import (
    Account,
    AttemptResult,
    ConfirmsReceipt,
    FinishesWhileClaiming,
    JobState,
    JobStatus,
    NewJob,
    Outcome,
    QueueBackend,
    WriteResult,
)
from skiplock.queue_impl.memory import InMemoryQueue
from skiplock.queue_impl.pg import PgQueue

pytestmark = pytest.mark.integration

T0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
LEASE = timedelta(seconds=30)
IMPLEMENTATIONS = ["memory", "pg", "pg-for-update", "pg-long-tx"]


@dataclass
class Clocked:
    """A queue and the hand that moves its clock."""

    queue: QueueBackend
    kind: str
    now: datetime = T0

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)
        if isinstance(self.queue, InMemoryQueue):
            self.queue.advance(seconds)
        else:
            assert isinstance(self.queue, PgQueue)
            self.queue.pin_clock(self.now)

    def state(self, job_id: uuid.UUID) -> JobState:
        return next(s for s in self.queue.snapshot() if s.job_id == job_id)


@pytest.fixture(params=IMPLEMENTATIONS)
def clocked(request: pytest.FixtureRequest) -> Iterator[Clocked]:
    kind: str = request.param
    if kind == "memory":
        yield Clocked(queue=InMemoryQueue(clock=lambda: T0), kind=kind)
        return
    dsn: str = request.getfixturevalue("pg_dsn")
    schema: str = request.getfixturevalue("fresh_schema")
    queue = PgQueue(dsn, schema=schema, variant=kind)  # type: ignore[arg-type]
    queue.setup()
    queue.pin_clock(T0)
    try:
        yield Clocked(queue=queue, kind=kind)
    finally:
        queue.close()


def skip_for(clocked: Clocked, *kinds: str, why: str) -> None:
    if clocked.kind in kinds:
        pytest.skip(f"{clocked.kind}: {why}")


def job(account: str = "a", *, max_attempts: int = 3, run_at: datetime | None = None) -> NewJob:
    return NewJob(
        id=uuid.uuid4(),
        account_id=account,
        target_url="http://127.0.0.1:9/deliver",
        payload={"n": 1},
        max_attempts=max_attempts,
        run_at=run_at,
    )


def ok(lease_result: list[WriteResult]) -> None:
    assert lease_result and lease_result == [WriteResult.APPLIED] * len(lease_result)


def test_implements_the_protocol(clocked: Clocked) -> None:
    assert isinstance(clocked.queue, QueueBackend)
    clocked.queue.setup()  # idempotent


def test_claim_leases_due_jobs_oldest_first(clocked: Clocked) -> None:
    q = clocked.queue
    jobs = [job(run_at=T0 - timedelta(seconds=10 - i)) for i in range(5)]
    q.enqueue(list(reversed(jobs)))
    leases = q.claim("w1", 3, LEASE)
    assert [lease.job_id for lease in leases] == [j.id for j in jobs[:3]]
    assert all(lease.attempt == 1 and lease.worker_id == "w1" for lease in leases)
    assert all(lease.locked_until == T0 + LEASE for lease in leases)
    assert len({lease.lease_token for lease in leases}) == 3
    assert leases[0].payload == {"n": 1}
    rest = q.claim("w2", 10, LEASE)
    assert {lease.job_id for lease in rest} == {j.id for j in jobs[3:]}
    assert q.claim("w3", 10, LEASE) == []


def test_future_jobs_are_not_due_until_their_time(clocked: Clocked) -> None:
    q = clocked.queue
    later = job(run_at=T0 + timedelta(seconds=60))
    q.enqueue([later])
    assert q.claim("w", 10, LEASE) == []
    clocked.advance(60)
    assert [lease.job_id for lease in q.claim("w", 10, LEASE)] == [later.id]


def test_success_completes_and_a_second_write_is_fenced(clocked: Clocked) -> None:
    q = clocked.queue
    j = job()
    q.enqueue([j])
    [lease] = q.claim("w", 1, LEASE)
    ok(q.finish([AttemptResult(lease=lease, outcome=Outcome.SUCCESS, http_status=200)]))
    assert q.finish([AttemptResult(lease=lease, outcome=Outcome.SUCCESS)]) == [WriteResult.FENCED]
    state = clocked.state(j.id)
    assert state.status is JobStatus.COMPLETED and state.attempts == 1
    clocked.advance(3600)
    assert q.claim("w", 10, LEASE) == []
    assert q.recover() == 0


def test_transient_failure_waits_its_backoff_then_dead_letters(clocked: Clocked) -> None:
    q = clocked.queue
    j = job(max_attempts=2)
    q.enqueue([j])
    [first] = q.claim("w", 1, LEASE)
    delay = timedelta(seconds=20)
    ok(
        q.finish(
            [AttemptResult(lease=first, outcome=Outcome.TRANSIENT, error="503", retry_delay=delay)]
        )
    )
    state = clocked.state(j.id)
    assert state.status is JobStatus.RETRYING
    assert state.next_attempt_at == T0 + delay and state.last_error == "503"
    clocked.advance(19)
    assert q.claim("w", 1, LEASE) == []
    clocked.advance(1)
    [second] = q.claim("w", 1, LEASE)
    assert second.attempt == 2 and second.lease_token != first.lease_token
    ok(q.finish([AttemptResult(lease=second, outcome=Outcome.TRANSIENT, error="timeout")]))
    state = clocked.state(j.id)
    assert state.status is JobStatus.FAILED
    assert state.attempts == 2 and state.last_error == "timeout"


def test_permanent_failure_fails_at_once(clocked: Clocked) -> None:
    q = clocked.queue
    j = job(max_attempts=5)
    q.enqueue([j])
    [lease] = q.claim("w", 1, LEASE)
    ok(
        q.finish(
            [
                AttemptResult(
                    lease=lease, outcome=Outcome.PERMANENT, http_status=400, error="400 Bad Request"
                )
            ]
        )
    )
    state = clocked.state(j.id)
    assert state.status is JobStatus.FAILED and state.last_error == "400 Bad Request"


def test_finish_applies_a_batch_in_order(clocked: Clocked) -> None:
    q = clocked.queue
    jobs = [job(run_at=T0 - timedelta(seconds=3 - i)) for i in range(3)]
    q.enqueue(jobs)
    leases = q.claim("w", 3, LEASE)
    outcomes = [Outcome.SUCCESS, Outcome.PERMANENT, Outcome.TRANSIENT]
    written = q.finish(
        [AttemptResult(lease=lease, outcome=o) for lease, o in zip(leases, outcomes, strict=True)]
    )
    assert written == [WriteResult.APPLIED] * 3
    statuses = [clocked.state(j.id).status for j in jobs]
    assert statuses == [JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.RETRYING]


def test_expired_lease_is_recovered_and_the_stale_worker_fenced(clocked: Clocked) -> None:
    skip_for(clocked, "pg-long-tx", why="the claim is uncommitted, so there is no lease to expire")
    q = clocked.queue
    retry, dead = job(max_attempts=2), job(max_attempts=1)
    q.enqueue([retry, dead])
    stale = {lease.job_id: lease for lease in q.claim("old", 2, LEASE)}
    ok(q.receive(list(stale.values())))
    clocked.advance(LEASE.total_seconds() - 1)
    assert q.recover() == 0
    clocked.advance(2)
    assert q.recover() == 2
    assert clocked.state(dead.id).status is JobStatus.FAILED
    assert clocked.state(retry.id).status is JobStatus.RETRYING
    [fresh] = q.claim("new", 10, LEASE)
    assert fresh.job_id == retry.id and fresh.attempt == 2
    assert q.finish([AttemptResult(lease=stale[retry.id], outcome=Outcome.SUCCESS)]) == [
        WriteResult.FENCED
    ]
    assert q.renew([stale[retry.id]], LEASE) == [None]
    ok(q.finish([AttemptResult(lease=fresh, outcome=Outcome.SUCCESS)]))
    assert clocked.state(retry.id).status is JobStatus.COMPLETED


def test_an_expired_lease_never_received_gives_its_attempt_back(clocked: Clocked) -> None:
    """A claim whose worker never confirmed it (its answer lost with the connection) was
    never delivered: recovery makes the job due again with its attempt count unchanged, and
    the lost holder is fenced, its late receipt included."""
    skip_for(clocked, "pg-long-tx", why="the claim is uncommitted, so there is no lease to expire")
    q = clocked.queue
    assert isinstance(q, ConfirmsReceipt)
    first, last = job(max_attempts=2), job(max_attempts=1)
    q.enqueue([first, last])
    leases = {lease.job_id: lease for lease in q.claim("ghost", 2, LEASE)}
    clocked.advance(LEASE.total_seconds() + 1)
    assert q.recover() == 2
    for j in (first, last):
        state = clocked.state(j.id)
        assert (state.status, state.attempts) == (JobStatus.PENDING, 0)
    assert q.receive([leases[first.id]]) == [WriteResult.FENCED]
    again = {lease.job_id: lease for lease in q.claim("new", 10, LEASE)}
    assert {k: v.attempt for k, v in again.items()} == {first.id: 1, last.id: 1}
    # A lease received before it expired counts: the job with one attempt is dead-lettered.
    ok(q.receive(list(again.values())))
    clocked.advance(LEASE.total_seconds() + 1)
    assert q.recover() == 2
    assert clocked.state(last.id).status is JobStatus.FAILED
    assert (clocked.state(first.id).status, clocked.state(first.id).attempts) == (
        JobStatus.RETRYING, 1)


def test_renew_extends_a_held_lease(clocked: Clocked) -> None:
    skip_for(clocked, "pg-long-tx", why="the claim is uncommitted, so there is no lease to expire")
    q = clocked.queue
    q.enqueue([job()])
    [lease] = q.claim("w", 1, LEASE)
    clocked.advance(20)
    [renewed] = q.renew([lease], LEASE)
    assert renewed is not None and renewed.locked_until == T0 + timedelta(seconds=20) + LEASE
    clocked.advance(20)
    assert q.recover() == 0
    ok(q.finish([AttemptResult(lease=renewed, outcome=Outcome.SUCCESS)]))


def test_release_gives_the_job_back_uncounted(clocked: Clocked) -> None:
    q = clocked.queue
    j = job()
    q.enqueue([j])
    [lease] = q.claim("w", 1, LEASE)
    ok(q.release([lease]))
    state = clocked.state(j.id)
    assert state.status is JobStatus.PENDING and state.attempts == 0
    [again] = q.claim("w", 1, LEASE)
    assert again.attempt == 1 and again.lease_token != lease.lease_token
    assert q.release([lease]) == [WriteResult.FENCED]
    ok(q.finish([AttemptResult(lease=again, outcome=Outcome.SUCCESS)]))


def test_account_limits_cap_what_is_in_flight(clocked: Clocked) -> None:
    q = clocked.queue
    q.upsert_accounts([Account(id="small", concurrency_limit=2), Account(id="free")])
    q.enqueue([job("small") for _ in range(5)] + [job("free") for _ in range(3)])
    first = q.claim("w", 10, LEASE)
    assert sorted(lease.account_id for lease in first) == ["free"] * 3 + ["small"] * 2
    if clocked.kind != "pg-long-tx":
        # Long-tx: the next claim shares the open transaction; covered after finish below.
        assert q.claim("w", 10, LEASE) == []
    small = [lease for lease in first if lease.account_id == "small"]
    ok(q.finish([AttemptResult(lease=small[0], outcome=Outcome.SUCCESS)]))
    second = q.claim("w", 10, LEASE)
    assert [lease.account_id for lease in second] == ["small"]
    # (Long-tx: finishing commits the claim, which holds the account row until then.)
    ok(q.finish([AttemptResult(lease=second[0], outcome=Outcome.SUCCESS)]))
    # Raising the limit admits more at once.
    q.upsert_accounts([Account(id="small", concurrency_limit=4)])
    third = q.claim("w", 10, LEASE)
    assert [lease.account_id for lease in third] == ["small", "small"]


def test_enqueue_is_all_or_nothing(clocked: Clocked) -> None:
    q = clocked.queue
    j = job()
    q.enqueue([j])
    with pytest.raises(Exception):  # noqa: B017 - each backend raises its own error type
        q.enqueue([job(), j])
    assert [s.job_id for s in q.snapshot()] == [j.id]


def test_bad_arguments_are_refused(clocked: Clocked) -> None:
    with pytest.raises(ValueError):
        clocked.queue.claim("w", 0, LEASE)
    with pytest.raises(ValueError):
        clocked.queue.recover(0)


BAD_JOBS: dict[str, tuple[dict[str, Any], str]] = {
    "ftp": ({"target_url": "ftp://127.0.0.1/x"}, r"not http\(s\)"),
    "javascript": ({"target_url": "javascript:alert(1)"}, r"not http\(s\)"),
    "no host": ({"target_url": "http:///deliver"}, "no host"),
    "newline in url": ({"target_url": "http://t/\r\nX-Evil: 1"}, "control characters"),
    "header injection": ({"account_id": "a\r\nX-Evil: 1"}, "account_id"),
    "zero attempts": ({"max_attempts": 0}, "max_attempts"),
}


@pytest.mark.parametrize("bad", list(BAD_JOBS), ids=list(BAD_JOBS))
def test_enqueue_refuses_bad_input_and_writes_none_of_the_batch(clocked: Clocked, bad: str) -> None:
    fields, message = BAD_JOBS[bad]
    good = job()
    changes: dict[str, Any] = {"target_url": "https://127.0.0.1:9/deliver", **fields}
    wrong = dataclasses.replace(job(), **changes)
    with pytest.raises(ValueError, match=message) as raised:
        clocked.queue.enqueue([good, wrong])
    text = str(raised.value)
    assert str(wrong.id) in text and "\n" not in text
    assert clocked.queue.snapshot() == []
    clocked.queue.enqueue([good])  # the good job alone goes in
    assert [s.job_id for s in clocked.queue.snapshot()] == [good.id]


def test_a_full_account_does_not_use_up_a_small_claim(clocked: Clocked) -> None:
    """Claim step 1 locks at most `batch` limited accounts: the one whose work waited longest
    first, but never one already full, or a batch of 1 would go to it and take nothing."""
    q = clocked.queue
    q.upsert_accounts(
        [Account(id="full", concurrency_limit=1), Account(id="later", concurrency_limit=1)]
    )
    q.enqueue([job("full", run_at=T0 - timedelta(seconds=9)) for _ in range(2)])
    [first] = q.claim("w", 1, LEASE)
    assert first.account_id == "full"
    newer = job("later", run_at=T0 - timedelta(seconds=1))
    q.enqueue([newer])
    assert [lease.job_id for lease in q.claim("w", 1, LEASE)] == [newer.id]
    assert q.claim("w", 1, LEASE) == []


def test_the_account_whose_work_waited_longest_goes_first(clocked: Clocked) -> None:
    q = clocked.queue
    q.upsert_accounts([Account(id=a, concurrency_limit=5) for a in ("a", "b", "c")])
    # Account ids and ages in opposite orders: "c" has waited longest.
    jobs = {a: job(a, run_at=T0 - timedelta(seconds=s)) for a, s in (("a", 1), ("b", 2), ("c", 3))}
    q.enqueue(list(jobs.values()))
    taken = [lease.account_id for _ in range(3) for lease in q.claim("w", 1, LEASE)]
    assert taken == ["c", "b", "a"]


def test_finish_and_claim_answers_as_finish_then_claim(clocked: Clocked) -> None:
    """The results are written as `finish` writes them (a lease no longer held is fenced),
    and the claim after them sees what they freed: a limited account's slot, taken again."""
    q = clocked.queue
    if not isinstance(q, FinishesWhileClaiming):
        pytest.skip(f"{clocked.kind}: no finish_and_claim")
    q.upsert_accounts([Account(id="lim", concurrency_limit=1)])
    first = job("lim", run_at=T0 - timedelta(seconds=2))
    second = job("lim", run_at=T0 - timedelta(seconds=1))
    later = job("a", run_at=T0 + timedelta(hours=1))
    q.enqueue([first, second, later])
    [held] = q.claim("w1", 5, LEASE)
    assert held.job_id == first.id
    if isinstance(q, ConfirmsReceipt):
        ok(q.receive([held]))
    never_held = dataclasses.replace(held, job_id=later.id, lease_token=uuid.uuid4())
    written, leases = q.finish_and_claim(
        [AttemptResult(lease=held, outcome=Outcome.SUCCESS, http_status=200),
         AttemptResult(lease=never_held, outcome=Outcome.SUCCESS)], "w1", 5, LEASE)
    assert written == [WriteResult.APPLIED, WriteResult.FENCED]
    assert [(lease.job_id, lease.attempt) for lease in leases] == [(second.id, 1)]
    assert clocked.state(first.id).status is JobStatus.COMPLETED
    assert clocked.state(later.id).status is JobStatus.PENDING
    # Nothing to write: a claim alone.
    assert q.finish_and_claim([], "w1", 5, LEASE) == ([], [])
