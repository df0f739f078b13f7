"""The in-memory model's basics (the contract suite covers the rest, beside the real queue),
and choosing a backend by name."""

from __future__ import annotations

import pickle
import threading
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from skiplock.queue_impl.interface import (
    Account,
    AttemptResult,
    JobStatus,
    NewJob,
    Outcome,
    QueueBackend,
    WriteResult,
)
from skiplock.queue_impl.memory import InMemoryQueue, factory
from skiplock.queue_impl.pg import PgQueue
from skiplock.queue_impl.plugins import BACKEND_NAMES, BackendSpec, validate_backend_name

T0 = datetime(2026, 1, 1, tzinfo=UTC)
LEASE = timedelta(seconds=30)


def new_job(account: str = "a", *, max_attempts: int = 3, run_at: datetime | None = None) -> NewJob:
    return NewJob(
        id=uuid.uuid4(),
        account_id=account,
        target_url="http://t/",
        payload={},
        max_attempts=max_attempts,
        run_at=run_at,
    )


def make() -> InMemoryQueue:
    return InMemoryQueue(clock=lambda: T0)


def test_is_a_queue_backend() -> None:
    assert isinstance(make(), QueueBackend)
    assert isinstance(factory(dsn=None, schema="x", sql_path=None), InMemoryQueue)


def test_clock_advances_only_forward() -> None:
    q = make()
    q.advance(1.5)
    assert q.now() == T0 + timedelta(seconds=1.5)
    with pytest.raises(ValueError):
        q.advance(-1)


def test_future_jobs_wait_for_their_time() -> None:
    q = make()
    q.enqueue([new_job(run_at=T0 + timedelta(seconds=10))])
    assert q.claim("w", 5, LEASE) == []
    q.advance(10)
    [lease] = q.claim("w", 5, LEASE)
    assert lease.attempt == 1 and lease.locked_until == T0 + timedelta(seconds=10) + LEASE


def test_transient_failure_backs_off_then_dead_letters() -> None:
    q = make()
    q.enqueue([new_job(max_attempts=2)])
    [lease] = q.claim("w", 1, LEASE)
    delay = timedelta(seconds=7)
    assert q.finish(
        [AttemptResult(lease=lease, outcome=Outcome.TRANSIENT, error="503", retry_delay=delay)]
    ) == [WriteResult.APPLIED]
    [state] = q.snapshot()
    assert state.status is JobStatus.RETRYING and state.next_attempt_at == T0 + delay
    assert q.claim("w", 1, LEASE) == []
    q.advance(7)
    [lease] = q.claim("w", 1, LEASE)
    assert lease.attempt == 2
    q.finish([AttemptResult(lease=lease, outcome=Outcome.TRANSIENT, error="504")])
    [state] = q.snapshot()
    assert state.status is JobStatus.FAILED and state.last_error == "504"


def test_limits_and_fencing() -> None:
    q = make()
    q.upsert_accounts([Account(id="a", concurrency_limit=1)])
    q.enqueue([new_job("a"), new_job("a"), new_job("b")])
    leases = q.claim("w", 10, LEASE)
    assert sorted(lease.account_id for lease in leases) == ["a", "b"]
    a = next(lease for lease in leases if lease.account_id == "a")
    q.advance(31)
    assert q.recover() == 2
    assert q.finish([AttemptResult(lease=a, outcome=Outcome.SUCCESS)]) == [WriteResult.FENCED]
    assert [f.operation for f in q.fenced] == ["finish"]
    assert q.renew([a], LEASE) == [None]


def test_release_does_not_count_the_attempt() -> None:
    q = make()
    q.enqueue([new_job()])
    [lease] = q.claim("w", 1, LEASE)
    assert q.release([lease]) == [WriteResult.APPLIED]
    [state] = q.snapshot()
    assert state.status is JobStatus.PENDING and state.attempts == 0
    assert q.release([lease]) == [WriteResult.FENCED]


def test_wait_for_work_wakes_on_enqueue() -> None:
    q = make()
    assert q.wait_for_work(0.0) is False
    timer = threading.Timer(0.05, lambda: q.enqueue([new_job()]))
    timer.start()
    try:
        assert q.wait_for_work(10.0) is True
    finally:
        timer.join()


def test_bad_arguments() -> None:
    q = make()
    with pytest.raises(ValueError):
        q.claim("w", 0, LEASE)
    with pytest.raises(ValueError):
        q.upsert_accounts([Account(id="a", concurrency_limit=0)])
    job = new_job()
    with pytest.raises(ValueError):
        q.enqueue([job, job])


# -- choosing a backend by name (skiplock.queue_impl.plugins) --------------------------------


def test_backend_spec_is_picklable_and_hides_the_password() -> None:
    spec = BackendSpec(name="pg", dsn="postgresql://u:s3cret@127.0.0.1:5432/db", schema="s")
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert "s3cret" not in spec.display() and "s3cret" not in repr(spec)
    assert "schema=s" in spec.display()


def test_reference_names_build_pg_queues_lazily() -> None:
    for name in BACKEND_NAMES:
        validate_backend_name(name)
        queue = BackendSpec(name=name, dsn="postgresql://127.0.0.1:9/none").create()
        # Nothing connects until the queue is used.
        assert isinstance(queue, PgQueue) and queue.name == name
    with pytest.raises(ValueError, match="needs a PostgreSQL DSN"):
        BackendSpec(name="pg").create()


def test_factory_names_load_any_implementation() -> None:
    spec = BackendSpec(name="skiplock.queue_impl.memory:factory")
    validate_backend_name(spec.name)
    assert isinstance(spec.create(), InMemoryQueue)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("redis", "unknown backend 'redis'"),
        ("pg-fast", "unknown backend"),
        ("no_such_module_xyz:make", "cannot import no_such_module_xyz"),
        ("skiplock.queue_impl.memory:nothing_here", "has no callable 'nothing_here'"),
        ("skiplock.queue_impl.memory:", "unknown backend"),
        # skiplock 0.1's spelling, before everything moved under the `skiplock` namespace.
        ("queue_impl.pgqueuer_backend:factory",
         "use --backend skiplock.queue_impl.pgqueuer_backend:factory"),
        ("queue_impl.memory:factory", "use --backend skiplock.queue_impl.memory:factory"),
        # A name under one of those folder names that skiplock does not have is the user's.
        ("reports.no_such_module_xyz:make", "cannot import reports.no_such_module_xyz"),
    ],
)
def test_unusable_backend_names_are_refused_in_one_line(name: str, expected: str) -> None:
    with pytest.raises(ValueError) as info:
        validate_backend_name(name)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_a_factory_must_return_a_queue_backend() -> None:
    with pytest.raises(ValueError, match="does not implement QueueBackend"):
        BackendSpec(name="builtins:dict").create()
    with pytest.raises(ValueError, match="cannot be called as factory"):
        BackendSpec(name="skiplock.queue_impl.memory:FencedWrite").create()


@pytest.mark.parametrize(
    "url",
    ["http://t/", "HTTPS://127.0.0.1:8443/deliver?x=1", "http://[::1]:9/deliver"],
)
def test_enqueue_accepts_any_http_url(url: str) -> None:
    q = InMemoryQueue()
    new = NewJob(id=uuid.uuid4(), account_id="a", target_url=url, payload={})
    q.enqueue([new])
    assert [s.job_id for s in q.snapshot()] == [new.id]


def test_enqueue_refuses_a_naive_run_at() -> None:
    q = InMemoryQueue()
    new = NewJob(
        id=uuid.uuid4(),
        account_id="a",
        target_url="http://t/",
        payload={},
        run_at=datetime(2030, 1, 1),
    )
    with pytest.raises(ValueError, match="timezone"):
        q.enqueue([new])
    assert q.snapshot() == []
