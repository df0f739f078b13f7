"""One lease clock in both gather policies: a lease's first renewal is due half a lease after
its claim was *sent* (no later than the claim's UPDATE, where the database starts the lease),
however long the claim took to come back. Counting from the claim's return instead would
renew late by the claim's duration, and a lease whose claim took long enough would run out
before it was renewed.

Pure scheduling logic: the queue is the in-memory model with a claim that comes back late
(as a stalled commit would), and the target a loopback HTTP server that answers slowly, so
the call is still in flight when the renewal is due."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import pytest
from aiohttp import web

from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.dispatcher import Dispatcher
from skiplock.queue_impl.interface import Account, Lease, NewJob
from skiplock.queue_impl.memory import InMemoryQueue

LEASE = 4.0
HALF = LEASE / 2
CLAIM_TAKES = 0.8  # the claim's UPDATE is done, its answer comes back this much later
CALL_TAKES = 2.5  # the call runs from CLAIM_TAKES to past CLAIM_TAKES + HALF


class LateClaim(InMemoryQueue):
    """Records when each claim was sent and each renewal arrived, on the monotonic clock."""

    def __init__(self) -> None:
        super().__init__()
        self.claims_sent: list[float] = []
        self.renewals: list[float] = []
        self._times_lock = threading.Lock()

    def claim(self, worker_id: str, batch: int, lease: timedelta) -> list[Lease]:
        sent = time.monotonic()
        leases = super().claim(worker_id, batch, lease)
        if leases:
            with self._times_lock:
                self.claims_sent.append(sent)
            time.sleep(CLAIM_TAKES)
        return leases

    def renew(self, leases: Sequence[Lease], extend: timedelta) -> list[Lease | None]:
        with self._times_lock:
            self.renewals.append(time.monotonic())
        return super().renew(leases, extend)


async def _slow(request: web.Request) -> web.Response:
    await request.read()
    await asyncio.sleep(CALL_TAKES)
    return web.Response(text="ok")


async def _first_renewal_after_send(refill: bool, serving: Any) -> tuple[float, list[str]]:
    async with serving({"/slow": _slow}) as port:
        return await _run_once(refill, port=port)


async def _run_once(refill: bool, *, port: int) -> tuple[float, list[str]]:
    queue = LateClaim()
    queue.upsert_accounts([Account(id="acct", concurrency_limit=2)])
    queue.enqueue([NewJob(id=uuid.uuid4(), account_id="acct",
                          target_url=f"http://127.0.0.1:{port}/slow", payload={})])
    config = DispatcherConfig(
        batch=2, lease_seconds=LEASE, http_timeout_seconds=2.9, write_margin_seconds=0.2,
        poll_seconds=0.05, recovery_enabled=False, refill=refill,
        allow_targets=(f"127.0.0.1:{port}",),
    )
    kinds: list[str] = []
    dispatcher: Dispatcher

    def sink(kind: str, fields: Mapping[str, Any]) -> None:
        kinds.append(kind)
        if kind == "write":
            dispatcher.request_stop("test over")

    dispatcher = Dispatcher(queue, config, "worker-t", sink)
    await asyncio.wait_for(dispatcher.run(), timeout=30.0)
    [sent] = queue.claims_sent
    assert queue.renewals, f"no renewal while the call ran: {kinds}"
    return queue.renewals[0] - sent, kinds


@pytest.mark.parametrize("refill", [True, False], ids=["refill", "whole-batches"])
def test_the_first_renewal_is_timed_from_the_claims_send(
        refill: bool, loopback_target: Any) -> None:
    after, kinds = asyncio.run(_first_renewal_after_send(refill, loopback_target))
    assert kinds.count("http") == 1 and kinds.count("write") == 1, kinds
    # Not before half the lease (a small allowance for the claim reaching its thread) ...
    assert after >= HALF - 0.1
    # ... and not from the claim's return (HALF + CLAIM_TAKES), with room for a busy machine.
    assert after < HALF + CLAIM_TAKES / 2, f"first renewal {after:.2f}s after the claim's send"
    # The renewal happened while the call was in flight: renew comes before http.
    assert kinds.index("renew") < kinds.index("http")


class StopDuringRenewal(InMemoryQueue):
    """Asks the dispatcher to stop from inside the renewal of the job claimed ahead, and
    answers only once the stop has had time to give that job back: a renewal that covered a
    lease the dispatcher no longer holds when it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.stop: Any = None
        self.claimed: list[uuid.UUID] = []  # job ids in the order claimed

    def claim(self, worker_id: str, batch: int, lease: timedelta) -> list[Lease]:
        leases = super().claim(worker_id, batch, lease)
        self.claimed.extend(lease.job_id for lease in leases)
        return leases

    def renew(self, leases: Sequence[Lease], extend: timedelta) -> list[Lease | None]:
        answers = super().renew(leases, extend)
        ahead = self.claimed[1:2]  # the job claimed second, while the first one's call ran
        if self.stop is not None and any(lease.job_id in ahead for lease in leases):
            self.stop()
            self.stop = None
            time.sleep(0.3)
        return answers


async def _stop_while_renewing(port: int) -> list[str]:
    queue = StopDuringRenewal()
    queue.upsert_accounts([Account(id="acct")])
    queue.enqueue([NewJob(id=uuid.uuid4(), account_id="acct",
                          target_url=f"http://127.0.0.1:{port}/slow", payload={})
                   for _ in range(2)])
    # One slot and one job claimed ahead: the ahead one waits while the first call outlasts
    # half the lease, so both are renewed.
    config = DispatcherConfig(
        batch=1, claim_ahead=1, lease_seconds=LEASE, http_timeout_seconds=2.9,
        write_margin_seconds=0.2, poll_seconds=0.05, recovery_enabled=False,
        allow_targets=(f"127.0.0.1:{port}",),
    )
    kinds: list[str] = []
    dispatcher = Dispatcher(queue, config, "worker-t", lambda kind, _: kinds.append(kind))
    loop = asyncio.get_running_loop()
    queue.stop = lambda: loop.call_soon_threadsafe(dispatcher.request_stop, "SIGTERM")
    await asyncio.wait_for(dispatcher.run(), timeout=30.0)
    return kinds


def test_a_job_given_back_while_its_renewal_runs_does_not_stop_the_worker(
        loopback_target: Any) -> None:
    async def go() -> list[str]:
        async with loopback_target({"/slow": _slow}) as port:
            return await _stop_while_renewing(port)

    kinds = asyncio.run(go())
    # The first call finished and was written; the job claimed ahead was given back unsent.
    assert kinds.count("renew") == 2, kinds
    assert kinds.count("http") == 1 and kinds.count("write") == 1, kinds
    assert kinds.count("release") == 1, kinds
    assert kinds[-1] == "stop"
