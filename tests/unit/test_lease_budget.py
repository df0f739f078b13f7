"""The lease budget: how much of a lease the dispatcher can count on before it sends a call,
from its own monotonic clock alone, and what it does with a batch whose claim came back too
late (tests/chaos/test_claim_stall.py shows the same against PostgreSQL and real workers)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.dispatcher import Dispatcher, _Held, lease_left
from skiplock.queue_impl.events import LEASE_TOO_SHORT
from skiplock.queue_impl.interface import Account, JobStatus, Lease, NewJob
from skiplock.queue_impl.memory import InMemoryQueue


def test_a_claim_that_came_back_at_once_has_the_whole_lease() -> None:
    assert lease_left(30.0, granted_after=100.0, now=100.0) == 30.0


def test_the_bound_counts_from_when_the_claim_was_sent_not_when_it_came_back() -> None:
    # Sent at 100, committed and back at 112.5: the lease may have started at 100.
    assert lease_left(30.0, granted_after=100.0, now=112.5) == 17.5


def test_a_commit_that_stalled_past_the_lease_leaves_nothing() -> None:
    # The bug's case: a 3 s lease whose claim took 6 s to commit ran out 3 s ago.
    left = lease_left(3.0, granted_after=10.0, now=16.0)
    assert left == -3.0
    assert left < 1.0 + 1.0  # HTTP timeout + write margin: not sent


def test_a_renewal_restarts_the_bound_from_when_it_was_sent() -> None:
    claim_sent, renew_sent, now = 0.0, 15.0, 20.0
    assert lease_left(30.0, granted_after=claim_sent, now=now) == 10.0
    assert lease_left(30.0, granted_after=renew_sent, now=now) == 25.0


@given(
    lease=st.floats(0.1, 3600.0),
    sent=st.floats(0.0, 1e6),
    took=st.floats(0.0, 7200.0),
    later=st.floats(0.0, 7200.0),
)
def test_the_bound_is_the_lease_less_the_time_since_sending(
    lease: float, sent: float, took: float, later: float
) -> None:
    left = lease_left(lease, granted_after=sent, now=sent + took)
    assert left <= lease
    assert left == pytest.approx(lease - took, abs=1e-6)
    # Time only uses it up.
    assert lease_left(lease, granted_after=sent, now=sent + took + later) <= left


# A dispatcher over the in-memory queue: nothing it could send is reachable (no target is
# allowed, so a call it makes ends as "refused" without touching the network).
CONFIG = DispatcherConfig(
    batch=5,
    lease_seconds=1.0,
    http_timeout_seconds=0.3,
    write_margin_seconds=0.3,
    poll_seconds=0.05,
    recovery_enabled=False,
    renew_leases=False,
)


class SlowCommit(InMemoryQueue):
    """A claim that takes `delay` seconds to come back after its leases were taken, as a
    commit stalled by a synchronous standby would."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def claim(self, worker_id: str, batch: int, lease: timedelta) -> list[Lease]:
        leases = super().claim(worker_id, batch, lease)
        time.sleep(self.delay)
        return leases


def first_batch(
    queue: InMemoryQueue, config: DispatcherConfig = CONFIG
) -> list[tuple[str, Mapping[str, Any]]]:
    """Run a dispatcher until it has sent or given back its first batch; its events."""
    events: list[tuple[str, Mapping[str, Any]]] = []
    dispatcher: Dispatcher

    def sink(kind: str, fields: Mapping[str, Any]) -> None:
        events.append((kind, fields))
        if kind in ("http", "release"):
            dispatcher.request_stop("test over")

    dispatcher = Dispatcher(queue, config, "worker-t", sink)
    asyncio.run(asyncio.wait_for(dispatcher.run(), timeout=30.0))
    return events


def with_jobs(queue: InMemoryQueue, count: int) -> list[uuid.UUID]:
    queue.upsert_accounts([Account(id="acct", concurrency_limit=2)])
    jobs = [
        NewJob(
            id=uuid.uuid4(), account_id="acct", target_url="http://127.0.0.1:9/deliver", payload={}
        )
        for _ in range(count)
    ]
    queue.enqueue(jobs)
    return [job.id for job in jobs]


def kinds(events: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    return [kind for kind, _ in events]


def test_a_claim_back_too_late_is_given_back_unsent_and_not_written() -> None:
    queue = SlowCommit(delay=0.5)  # 1 s lease - 0.5 s < 0.3 s timeout + 0.3 s margin
    with_jobs(queue, 2)
    events = first_batch(queue)
    assert kinds(events) == ["start", "claim", "claim", "release", "release", "stop"]
    for _, fields in events[3:5]:
        assert fields["result"] == "applied"
        assert fields["reason"] == LEASE_TOO_SHORT
    # Back to due, the attempt not counted.
    assert {(s.status, s.attempts) for s in queue.snapshot()} == {(JobStatus.PENDING, 0)}


def test_a_claim_back_in_time_is_sent() -> None:
    queue = InMemoryQueue()
    with_jobs(queue, 2)
    events = first_batch(queue)
    assert "release" not in kinds(events)
    assert kinds(events).count("http") == 2
    assert kinds(events).count("write") == 2


def test_unsafe_timing_waives_the_budget_as_it_waives_the_timing_rule() -> None:
    queue = SlowCommit(delay=0.5)
    with_jobs(queue, 2)
    events = first_batch(queue, replace(CONFIG, unsafe_timing=True))
    assert "release" not in kinds(events)
    assert kinds(events).count("http") == 2


@pytest.mark.parametrize("unsafe", [False, True])
def test_a_lease_a_renewal_found_gone_is_never_called(unsafe: bool) -> None:
    """Lost is not a matter of timing: the job may be with its next holder, so even
    `unsafe_timing` (which waives the timing rule only) gives it back unsent."""
    queue = InMemoryQueue()
    with_jobs(queue, 1)
    [lease] = queue.claim("worker-t", 1, timedelta(seconds=CONFIG.lease_seconds))
    dispatcher = Dispatcher(queue, replace(CONFIG, unsafe_timing=unsafe), "worker-t",
                            lambda kind, fields: None)
    now = time.monotonic()
    assert dispatcher._still_fits(_Held(lease=lease, granted_after=now))
    assert not dispatcher._still_fits(_Held(lease=lease, granted_after=now, lost=True))
