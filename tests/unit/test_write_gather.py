"""The write gather (`write_gather_seconds`, scenario key `write_gather`): a busy refilling
worker lets results gather before writing them, so that it writes in batches; 0 writes each
result as it comes, for an account whose short jobs and small limit cannot spare the time a
gathering lease is held.

Pure scheduling logic: the queue is the in-memory model, recording the size of each result
write, and the target a loopback HTTP server whose answers end a few milliseconds apart."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
from aiohttp import web

from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.dispatcher import Dispatcher
from skiplock.queue_impl.interface import Account, AttemptResult, NewJob, WriteResult
from skiplock.queue_impl.memory import InMemoryQueue

# The `loopback_target` fixture (tests/conftest.py).
Serving = Callable[[Mapping[str, Any]], contextlib.AbstractAsyncContextManager[int]]

JOBS = 8
STAGGER_SECONDS = 0.01  # job i's call ends about i * this after the claim
GATHER_SECONDS = 0.2  # longer than every call: a gathering worker writes them together


class CountingWrites(InMemoryQueue):
    def __init__(self) -> None:
        super().__init__()
        self.write_sizes: list[int] = []
        self._sizes_lock = threading.Lock()

    def finish(self, results: Sequence[AttemptResult]) -> list[WriteResult]:
        with self._sizes_lock:
            self.write_sizes.append(len(results))
        return super().finish(results)


async def _answer_after(request: web.Request) -> web.Response:
    await request.read()
    await asyncio.sleep(float(request.match_info["seconds"]))
    return web.Response(text="ok")


async def _write_sizes(gather: float, serving: Serving, stop_after_writes: Any) -> list[int]:
    async with serving({"/after/{seconds}": _answer_after}) as port:
        queue = CountingWrites()
        queue.upsert_accounts([Account(id="acct", concurrency_limit=None)])
        queue.enqueue([
            NewJob(id=uuid.uuid4(), account_id="acct", payload={},
                   target_url=f"http://127.0.0.1:{port}/after/{i * STAGGER_SECONDS:.3f}")
            for i in range(JOBS)])
        config = DispatcherConfig(
            batch=10, lease_seconds=5.0, http_timeout_seconds=2.0, write_margin_seconds=1.0,
            poll_seconds=0.05, recovery_enabled=False, write_gather_seconds=gather,
            allow_targets=(f"127.0.0.1:{port}",))
        sink = stop_after_writes(JOBS)
        dispatcher = sink.serves(Dispatcher(queue, config, "worker-t", sink))
        await asyncio.wait_for(dispatcher.run(), timeout=30.0)
        return queue.write_sizes


@pytest.mark.parametrize("gather", [GATHER_SECONDS, 0.0], ids=["gathering", "at-once"])
def test_a_busy_worker_gathers_results_only_when_told_to(
        gather: float, loopback_target: Serving, stop_after_writes: Any) -> None:
    sizes = asyncio.run(_write_sizes(gather, loopback_target, stop_after_writes))
    assert sum(sizes) == JOBS
    if gather:
        # The first result waits for the rest, which all end within the gather.
        assert len(sizes) <= 2, sizes
    else:
        # Each result is written as it comes: calls 10 ms apart cannot share many writes.
        assert len(sizes) >= JOBS // 2, sizes


def test_results_gather_inside_the_write_margin() -> None:
    from skiplock.queue_impl.config import ConfigError

    assert DispatcherConfig(write_margin_seconds=0.5, write_gather_seconds=0.6
                            ).gather_seconds() == 0.5
    assert DispatcherConfig(write_margin_seconds=0.0).gather_seconds() == 0.0
    with pytest.raises(ConfigError, match="write gather must be 0 or more"):
        DispatcherConfig(write_gather_seconds=-0.01).validate()


async def _tight_account_written_by(gather: float, serving: Serving) -> float:
    """Seconds from the start until every job of an account limited to one slot is written,
    while an unlimited account's slow calls keep the worker busy."""
    async with serving({"/after/{seconds}": _answer_after}) as port:
        queue = InMemoryQueue()
        queue.upsert_accounts([Account(id="wide", concurrency_limit=None),
                               Account(id="tight", concurrency_limit=1)])
        url = f"http://127.0.0.1:{port}/after/"
        queue.enqueue([NewJob(id=uuid.uuid4(), account_id="wide", payload={},
                              target_url=url + "1.5") for _ in range(3)])
        queue.enqueue([NewJob(id=uuid.uuid4(), account_id="tight", payload={},
                              target_url=url + "0") for _ in range(TIGHT_JOBS)])
        # A long poll: a worker that waits for it instead of for its own writes shows.
        config = DispatcherConfig(
            batch=10, lease_seconds=5.0, http_timeout_seconds=2.0, write_margin_seconds=1.0,
            poll_seconds=2.0, recovery_enabled=False, write_gather_seconds=gather,
            allow_targets=(f"127.0.0.1:{port}",))
        tight_written: list[float] = []
        started = time.monotonic()
        dispatcher: Dispatcher
        tight_jobs = {str(job.job_id) for job in queue.snapshot() if job.account_id == "tight"}

        def sink(kind: str, fields: Mapping[str, Any]) -> None:
            if kind == "write" and fields["job_id"] in tight_jobs:
                tight_written.append(time.monotonic() - started)
                if len(tight_written) == TIGHT_JOBS:
                    dispatcher.request_stop("test over")

        dispatcher = Dispatcher(queue, config, "worker-t", sink)
        await asyncio.wait_for(dispatcher.run(), timeout=30.0)
        return max(tight_written)


TIGHT_JOBS = 5


@pytest.mark.parametrize("gather", [0.05, 0.0], ids=["gathering", "at-once"])
def test_a_claim_short_of_a_full_account_is_sent_again_when_a_write_frees_it(
        gather: float, loopback_target: Serving) -> None:
    """A limited account's slot frees when its job's result is written, not when its call
    ends: a worker whose claim came back short (the account was full) claims again once its
    own write lands, not at the next call's end or poll, so the account's jobs follow each
    other a write apart while other calls hold the worker."""
    seconds = asyncio.run(_tight_account_written_by(gather, loopback_target))
    # Five one-slot jobs a gather and a write apart; the slow calls end at 1.5 s, the poll
    # at 2 s: a worker waiting for either would take past 1.5 s.
    assert seconds < 1.2, f"the tight account's {TIGHT_JOBS} jobs took {seconds:.2f}s"
