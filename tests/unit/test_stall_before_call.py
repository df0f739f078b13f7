"""A worker that stands still between its claim's lease check and its calls (SIGSTOP, a
stalled loop) checks each lease again as its call starts: one whose call and result write no
longer fit in what is surely left is given back unsent, not called beside the job's next
holder. Seen in the `pause-workers` scenario: a worker paused with calls not yet sent woke past
their leases and delivered a job whose next attempt had already succeeded.

Pure scheduling logic: the in-memory queue, a loopback HTTP server, and the loop blocked for
a while right after the claim's check (where the crash_after_claim failpoint is asked)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.dispatcher import Dispatcher
from skiplock.queue_impl.events import LEASE_TOO_SHORT
from skiplock.queue_impl.interface import JOB_ID_HEADER, Account, Lease, NewJob
from skiplock.queue_impl.memory import InMemoryQueue

# The `loopback_target` fixture (tests/conftest.py).
Serving = Callable[[Mapping[str, Any]], contextlib.AbstractAsyncContextManager[int]]

JOBS = 3
LEASE_SECONDS = 1.0
# The call and its write need 0.6 s of the lease; after this stall less than 0.4 s is left.
STALL_SECONDS = 0.6


class StallsOnce(Dispatcher):
    """Blocks its loop once, after the claim's lease check and before the calls start."""

    stalled = False

    def _failpoint(self, name: Any, lease: Lease) -> None:
        if name == "crash_after_claim" and not self.stalled:
            self.stalled = True
            time.sleep(STALL_SECONDS)
        super()._failpoint(name, lease)


async def _run(serving: Serving, stop_after_writes: Any
               ) -> tuple[list[str], list[Mapping[str, Any]]]:
    delivered: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        delivered.append(request.headers[JOB_ID_HEADER])
        return web.Response(text="ok")

    async with serving({"/ok": answer}) as port:
        queue = InMemoryQueue()
        queue.upsert_accounts([Account(id="acct", concurrency_limit=None)])
        queue.enqueue([NewJob(id=uuid.uuid4(), account_id="acct", payload={},
                              target_url=f"http://127.0.0.1:{port}/ok") for _ in range(JOBS)])
        config = DispatcherConfig(
            batch=10, lease_seconds=LEASE_SECONDS, http_timeout_seconds=0.3,
            write_margin_seconds=0.3, poll_seconds=0.05, recovery_enabled=False,
            allow_targets=(f"127.0.0.1:{port}",))
        sink = stop_after_writes(JOBS)
        dispatcher = sink.serves(StallsOnce(queue, config, "worker-t", sink))
        await asyncio.wait_for(dispatcher.run(), timeout=30.0)
        return delivered, sink.of("release")


def test_a_lease_that_ran_short_while_the_worker_stood_still_is_given_back_unsent(
        loopback_target: Serving, stop_after_writes: Any) -> None:
    delivered, releases = asyncio.run(_run(loopback_target, stop_after_writes))
    # The first claim's leases went back unsent, each saying why; the jobs were claimed
    # again and each delivered once.
    assert len(releases) == JOBS, releases
    assert all(r["reason"] == LEASE_TOO_SHORT for r in releases), releases
    assert sorted(set(delivered)) == sorted(delivered) and len(delivered) == JOBS
