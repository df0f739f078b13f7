"""The dispatcher against real PostgreSQL and a real HTTP server on loopback.

The server runs in a thread of the test process and records every request; the dispatcher
runs in the test's own event loop (the worker pool's processes are covered in
tests/chaos/test_worker_signals.py). Leases are 2 s and the HTTP timeout 0.5 s, so the
tests stay fast while keeping timeout + margin inside the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from aiohttp import web

from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.dispatcher import Dispatcher
from skiplock.queue_impl.events import EventSink
from skiplock.queue_impl.interface import (
    ACCOUNT_HEADER,
    ATTEMPT_HEADER,
    JOB_ID_HEADER,
    WORKER_HEADER,
    Account,
    AttemptResult,
    JobState,
    JobStatus,
    Lease,
    NewJob,
    WriteResult,
)
from skiplock.queue_impl.pg import PgQueue
from skiplock.queue_impl.ssrf import UrlGuard
from skiplock.reports.history import LOG_SUFFIX, WORKER_LOG, LogWriter, read_log
from skiplock.scenarios.run.workers import LogSink

pytestmark = pytest.mark.integration

CONFIG = DispatcherConfig(
    batch=5,
    lease_seconds=2.0,
    http_timeout_seconds=0.5,
    write_margin_seconds=0.5,
    poll_seconds=0.1,
    recovery_interval_seconds=0.2,
    retry_base_seconds=0.3,
    retry_cap_seconds=1.0,
    retry_jitter=0.0,
)


@dataclass
class Hit:
    path: str
    headers: dict[str, str]
    body: Any
    received: float
    answered: float | None = None


@dataclass
class EchoServer:
    """A tiny HTTP server with one behaviour per path, recording every request."""

    port: int = 0
    hits: list[Hit] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def hits_for(self, job_id: uuid.UUID) -> list[Hit]:
        with self.lock:
            return [h for h in self.hits if h.headers.get(JOB_ID_HEADER) == str(job_id)]

    def paths(self) -> list[str]:
        with self.lock:
            return [h.path for h in self.hits]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        hit = Hit(
            path=request.path,
            headers=dict(request.headers),
            body=json.loads(body) if body else None,
            received=time.time(),
        )
        with self.lock:
            self.hits.append(hit)
            seen = sum(
                1
                for h in self.hits
                if h.headers.get(JOB_ID_HEADER) == hit.headers.get(JOB_ID_HEADER)
            )
        response: web.StreamResponse
        if request.path == "/redirect":
            response = web.Response(status=302, headers={"Location": self.url("/landing")})
        elif request.path == "/flaky":
            response = web.Response(status=503 if seen == 1 else 200)
        elif request.path == "/fail-twice":
            response = web.Response(status=503 if seen <= 2 else 200)
        elif request.path == "/bad":
            response = web.Response(status=400)
        elif request.path == "/slow":
            await asyncio.sleep(1.6)
            response = web.Response(status=200)
        elif request.path == "/pause":
            await asyncio.sleep(0.2)  # well inside the 0.5 s HTTP timeout
            response = web.Response(status=200)
        elif request.path == "/linger":
            await asyncio.sleep(1.5)  # for a test that raises the HTTP timeout past it
            response = web.Response(status=200)
        elif request.path == "/hang-once":
            if seen == 1:
                await asyncio.sleep(1.5)  # past the 0.5 s HTTP timeout
            response = web.Response(status=200)
        else:
            response = web.Response(status=200)
        hit.answered = time.time()
        return response


@pytest.fixture(scope="module")
def server() -> Iterator[EchoServer]:
    echo = EchoServer()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, web.AppRunner] = {}

    async def start() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", echo.handle)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        holder["runner"] = runner
        echo.port = runner.addresses[0][1]

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, name="echo-server", daemon=True)
    thread.start()
    assert ready.wait(10), "the test HTTP server did not start"
    try:
        yield echo
    finally:
        asyncio.run_coroutine_threadsafe(holder["runner"].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


class Queue(PgQueue):
    """The test's own handle on the queue, which remembers where it lives so each
    dispatcher can open its own backend."""

    def __init__(self, dsn: str, *, schema: str) -> None:
        super().__init__(dsn, schema=schema)
        self.dsn = dsn


@pytest.fixture
def queue(pg_dsn: str, fresh_schema: str) -> Iterator[Queue]:
    q = Queue(pg_dsn, schema=fresh_schema)
    q.setup()
    q.upsert_accounts([Account(id="acct-1"), Account(id="acct-2")])
    try:
        yield q
    finally:
        q.close()


def enqueue(queue: Queue, url: str, count: int = 1, account: str = "acct-1") -> list[NewJob]:
    jobs = [
        NewJob(
            id=uuid.uuid4(),
            account_id=account,
            target_url=url,
            payload={"n": n, "note": "hello"},
            max_attempts=3,
        )
        for n in range(count)
    ]
    queue.enqueue(jobs)
    return jobs


Event = tuple[str, dict[str, Any]]


def _as_logged(kind: str, fields: dict[str, Any]) -> tuple[Any, ...]:
    """An emitted event as the worker log gives it back: job id and attempt lifted out, and
    no empty fields (the log writes null and the empty string alike, as an empty cell)."""
    data = {k: v for k, v in fields.items()
            if k not in ("job_id", "attempt") and v is not None and v != ""}
    return kind, fields.get("job_id"), fields.get("attempt"), data


@contextlib.contextmanager
def recorded(worker_id: str) -> Iterator[tuple[list[Event], EventSink]]:
    """A sink that keeps the dispatcher's events for the test and also writes them to a
    worker log as the worker pool does. On leaving, the log must read back as exactly those
    events: a field it had no column for would have killed a real worker."""
    events: list[Event] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{worker_id}{LOG_SUFFIX}"
        with LogWriter(path, WORKER_LOG) as writer:
            to_log = LogSink(writer, worker_id)

            def sink(kind: str, fields: Mapping[str, Any]) -> None:
                events.append((kind, dict(fields)))
                to_log(kind, fields)

            yield events, sink
        logged = list(read_log(path, WORKER_LOG))
    assert {e["worker"] for e in logged} <= {worker_id}
    assert [(e["kind"], e["job_id"], e["attempt"], e["data"]) for e in logged] == [
        _as_logged(kind, fields) for kind, fields in events
    ]


def run_until(
    queue: Queue,
    config: DispatcherConfig,
    done: Callable[[dict[uuid.UUID, JobState]], bool],
    *,
    worker_id: str = "worker-t",
    limit: float = 20.0,
    backend: PgQueue | None = None,
    guard: UrlGuard | None = None,
) -> tuple[dict[uuid.UUID, JobState], list[Event]]:
    """Run one dispatcher (its own backend, as a worker process would have) until `done`
    holds for the queue's snapshot, then stop it gracefully."""
    backend = backend or PgQueue(queue.dsn, schema=queue.schema)
    with recorded(worker_id) as (events, sink):
        dispatcher = Dispatcher(backend, config, worker_id, sink, guard=guard)

        async def go() -> dict[uuid.UUID, JobState]:
            task = asyncio.create_task(dispatcher.run())
            deadline = time.monotonic() + limit
            try:
                while True:
                    states = {s.job_id: s for s in await asyncio.to_thread(queue.snapshot)}
                    if done(states) or task.done() or time.monotonic() > deadline:
                        return states
                    await asyncio.sleep(0.05)
            finally:
                dispatcher.request_stop("test over")
                await task

        states = asyncio.run(go())
    assert events[-1][0] == "stop"
    return states, events


def all_terminal(states: dict[uuid.UUID, JobState]) -> bool:
    return bool(states) and all(s.status.terminal for s in states.values())


def test_jobs_are_delivered_with_the_protocol_headers(queue: Queue, server: EchoServer) -> None:
    config = replace(CONFIG, allow_targets=(f"127.0.0.1:{server.port}",))
    jobs = enqueue(queue, server.url("/ok"), count=7)
    states, events = run_until(queue, config, all_terminal, worker_id="worker-h")

    for job in jobs:
        assert states[job.id].status is JobStatus.COMPLETED
        assert states[job.id].attempts == 1
        [hit] = server.hits_for(job.id)
        assert hit.headers[ATTEMPT_HEADER] == "1"
        assert hit.headers[ACCOUNT_HEADER] == "acct-1"
        assert hit.headers[WORKER_HEADER] == "worker-h"
        assert hit.body == dict(job.payload)
    kinds = [kind for kind, _ in events]
    assert kinds.count("claim") == 7
    assert kinds.count("http") == 7
    writes = [f for kind, f in events if kind == "write"]
    assert {w["result"] for w in writes} == {"applied"}
    assert {w["job_id"] for w in writes} == {str(j.id) for j in jobs}
    # Claims of at most a batch (5): a claim's events share the instant it was sent.
    per_claim = Counter(f["started"] for kind, f in events if kind == "claim")
    assert max(per_claim.values()) <= 5


@pytest.mark.parametrize("ahead", [0, 2])
def test_jobs_claimed_ahead_wait_for_a_call_slot(
    queue: Queue, server: EchoServer, ahead: int
) -> None:
    """A worker holds up to `claim_ahead` leases beyond its slots, claimed before they free,
    and calls at most `batch` at once: each job claimed ahead starts as a call ends."""
    config = replace(CONFIG, batch=2, claim_ahead=ahead,
                     allow_targets=(f"127.0.0.1:{server.port}",))
    jobs = enqueue(queue, server.url("/pause"), count=6)
    states, events = run_until(queue, config, all_terminal, worker_id="worker-a")

    assert all(states[job.id].status is JobStatus.COMPLETED for job in jobs)
    assert all(len(server.hits_for(job.id)) == 1 for job in jobs)
    # Leases claimed before the target answered the first call (0.2 s after it came): the
    # slots' and the claimed-ahead ones.
    hits = [h for job in jobs for h in server.hits_for(job.id)]
    first_answer = min(h.answered or math.inf for h in hits)
    claims = [f for kind, f in events if kind == "claim"]
    assert sum(1 for f in claims if f["started"] < first_answer) == 2 + ahead
    # Never more than `batch` calls at the target at once.
    for hit in hits:
        assert hit.answered is not None
        overlapping = [h for h in hits if h.received <= hit.received < (h.answered or 0)]
        assert len(overlapping) <= 2
    per_claim = Counter(f["started"] for f in claims)
    assert max(per_claim.values()) <= 2


def test_a_stop_gives_back_the_jobs_claimed_ahead_unsent(
    queue: Queue, server: EchoServer
) -> None:
    config = replace(CONFIG, batch=1, claim_ahead=2, lease_seconds=6.0,
                     http_timeout_seconds=2.5, allow_targets=(f"127.0.0.1:{server.port}",))
    jobs = enqueue(queue, server.url("/linger"), count=3)

    def all_claimed_and_one_called(states: dict[uuid.UUID, JobState]) -> bool:
        # The first call lingers 1.5 s at the target; the other two wait for its slot.
        return (all(states[job.id].status is JobStatus.PROCESSING for job in jobs)
                and any(server.hits_for(job.id) for job in jobs))

    states, events = run_until(queue, config, all_claimed_and_one_called, worker_id="worker-g")

    [called] = [job for job in jobs if server.hits_for(job.id)]
    assert [f["job_id"] for kind, f in events if kind == "http"] == [str(called.id)]
    released = {f["job_id"]: f for kind, f in events if kind == "release"}
    assert set(released) == {str(job.id) for job in jobs if job is not called}
    assert {f["result"] for f in released.values()} == {"applied"}
    states = {s.job_id: s for s in queue.snapshot()}
    assert states[called.id].status is JobStatus.COMPLETED
    for job in jobs:
        if job is not called:
            # Given back uncounted: due again, as if never claimed.
            assert states[job.id].status is JobStatus.PENDING
            assert states[job.id].attempts == 0


def test_target_not_on_the_allow_list_is_refused_and_never_called(
    queue: Queue, server: EchoServer
) -> None:
    # Same server, but no allow-list entry: loopback is refused before anything is sent.
    [job] = enqueue(queue, server.url("/ok"))
    states, events = run_until(queue, CONFIG, all_terminal)
    assert states[job.id].status is JobStatus.FAILED
    assert states[job.id].attempts == 1
    assert "loopback" in (states[job.id].last_error or "")
    assert server.hits_for(job.id) == []
    [http] = [f for kind, f in events if kind == "http"]
    assert http["result"] == "refused"


def test_redirect_is_not_followed(queue: Queue, server: EchoServer) -> None:
    config = replace(CONFIG, allow_targets=(f"127.0.0.1:{server.port}",))
    [job] = enqueue(queue, server.url("/redirect"))
    states, _ = run_until(queue, config, all_terminal)
    assert states[job.id].status is JobStatus.FAILED
    assert states[job.id].attempts == 1
    assert "redirect not followed" in (states[job.id].last_error or "")
    assert len(server.hits_for(job.id)) == 1
    assert "/landing" not in server.paths()


def test_503_then_200_is_retried_after_its_backoff_and_completes(
    queue: Queue, server: EchoServer
) -> None:
    config = replace(CONFIG, allow_targets=(f"127.0.0.1:{server.port}",))
    [job] = enqueue(queue, server.url("/flaky"))
    states, events = run_until(queue, config, all_terminal)
    assert states[job.id].status is JobStatus.COMPLETED
    assert states[job.id].attempts == 2
    first, second = server.hits_for(job.id)
    assert (first.headers[ATTEMPT_HEADER], second.headers[ATTEMPT_HEADER]) == ("1", "2")
    assert first.answered is not None
    # Never earlier than the policy's shortest backoff after the first attempt ended.
    backoff = config.retry_policy().min_delay(1)
    assert second.received - first.answered >= backoff - 0.05
    outcomes = [f["outcome"] for kind, f in events if kind == "write"]
    assert outcomes == ["transient", "success"]


def test_400_dead_letters_at_once(queue: Queue, server: EchoServer) -> None:
    config = replace(CONFIG, allow_targets=(f"127.0.0.1:{server.port}",))
    [job] = enqueue(queue, server.url("/bad"))
    states, events = run_until(queue, config, all_terminal)
    assert states[job.id].status is JobStatus.FAILED
    assert states[job.id].attempts == 1
    assert "400" in (states[job.id].last_error or "")
    assert len(server.hits_for(job.id)) == 1
    [http] = [f for kind, f in events if kind == "http"]
    assert (http["result"], http["status"]) == ("http_error", 400)


def test_a_job_that_times_out_is_retried(queue: Queue, server: EchoServer) -> None:
    config = replace(CONFIG, allow_targets=(f"127.0.0.1:{server.port}",))
    [job] = enqueue(queue, server.url("/hang-once"))
    states, events = run_until(queue, config, all_terminal)
    assert states[job.id].status is JobStatus.COMPLETED
    assert states[job.id].attempts == 2
    results = [f["result"] for kind, f in events if kind == "http"]
    assert results == ["timeout", "ok"]
    assert len(server.hits_for(job.id)) == 2


def test_unreachable_target_is_a_transient_connection_error(
    queue: Queue, server: EchoServer
) -> None:
    # A port nobody listens on (the allow-list admits it): refused connections are retried,
    # and the job dead-letters after max_attempts.
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = replace(CONFIG, allow_targets=(f"127.0.0.1:{port}",), retry_base_seconds=0.05)
    [job] = enqueue(queue, f"http://127.0.0.1:{port}/")
    states, events = run_until(queue, config, all_terminal)
    assert states[job.id].status is JobStatus.FAILED
    assert states[job.id].attempts == 3
    results = [f["result"] for kind, f in events if kind == "http"]
    assert results == ["connection_error"] * 3


class LostWrite(PgQueue):
    """The first result write dies with the connection before it commits."""

    failed = False

    def finish(self, results: Sequence[AttemptResult]) -> list[WriteResult]:
        if not self.failed:
            self.failed = True
            self.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return super().finish(results)


def test_a_write_that_lost_its_connection_is_sent_again_and_applied(
    queue: Queue, server: EchoServer
) -> None:
    config = replace(CONFIG, allow_targets=(f"127.0.0.1:{server.port}",))
    [job] = enqueue(queue, server.url("/ok"))
    states, events = run_until(
        queue, config, all_terminal, backend=LostWrite(queue.dsn, schema=queue.schema)
    )
    assert [f["result"] for kind, f in events if kind == "write"] == ["applied"]
    [error] = [f for kind, f in events if kind == "error"]
    assert error["op"] == "finish" and "server closed the connection" in error["error"]
    assert (states[job.id].status, states[job.id].attempts) == (JobStatus.COMPLETED, 1)
    assert len(server.hits_for(job.id)) == 1


def test_jobs_of_an_enqueue_that_skipped_its_notify_wait_the_interval_not_the_poll(
    queue: Queue, server: EchoServer
) -> None:
    # Two enqueues a few ms apart: the second sends no NOTIFY (within the interval), and the
    # worker woken by the first may have claimed before the second commits. With a 5 s poll,
    # the second job is delivered soon only by a later claim: the one the worker makes once
    # the interval has passed, or the one it makes when the first job's slot frees. The
    # second often comes first here, so this test shows the behaviour a user sees; the
    # re-claim itself is held by tests/unit/test_dispatcher_idle.py.
    config = replace(CONFIG, allow_targets=(f"127.0.0.1:{server.port}",), poll_seconds=5.0)
    producer = PgQueue(queue.dsn, schema=queue.schema)
    # Gaps of 4 to 16 ms, twice, so that some rounds put the claim between the two commits
    # whatever this machine's wake-up latency.
    gaps = [0.004, 0.008, 0.012, 0.016] * 2
    rounds = len(gaps)
    seconds: list[tuple[uuid.UUID, float]] = []

    def done(states: dict[uuid.UUID, JobState]) -> bool:
        if len(states) == 2 * len(seconds) and (not states or all_terminal(states)):
            if len(seconds) == rounds:
                return True
            time.sleep(0.3)  # the worker is idle, listening
            enqueue(producer, server.url("/ok"))
            time.sleep(gaps[len(seconds)])  # inside the interval, maybe after the claim
            at = time.time()
            [second] = enqueue(producer, server.url("/ok"))
            seconds.append((second.id, at))
        return False

    try:
        states, _ = run_until(queue, config, done, limit=30)
    finally:
        producer.close()
    assert len(states) == 2 * rounds
    assert all(s.status is JobStatus.COMPLETED for s in states.values())
    for job_id, at in seconds:
        [hit] = server.hits_for(job_id)
        assert hit.received - at < 1.0, "a job whose enqueue sent no NOTIFY waited for the poll"


class ShortAnswer(PgQueue):
    """A plug-in's finish that answers fewer results than it was given: a bug of its own."""

    def finish(self, results: Sequence[AttemptResult]) -> list[WriteResult]:
        super().finish(results)
        return []


def test_a_failure_in_the_write_stops_the_worker_loudly(
    queue: Queue, server: EchoServer
) -> None:
    config = replace(CONFIG, allow_targets=(f"127.0.0.1:{server.port}",))
    enqueue(queue, server.url("/ok"))
    backend = ShortAnswer(queue.dsn, schema=queue.schema)
    with recorded("worker-f") as (events, sink):
        dispatcher = Dispatcher(backend, config, "worker-f", sink)
        with pytest.raises(ValueError):
            asyncio.run(asyncio.wait_for(dispatcher.run(), 20))
    [stop] = [f for kind, f in events if kind == "stop"]
    assert stop["reason"].startswith("error: ValueError"), stop


class EveryWriteLost(PgQueue):
    """Every result write sent in the 2.5 s after the first loses the connection: longer than
    the 2 s lease, so the worker gives the write up."""

    first: float | None = None

    def finish(self, results: Sequence[AttemptResult]) -> list[WriteResult]:
        now = time.monotonic()
        self.first = self.first or now
        if now - self.first < 2.5:
            self.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return super().finish(results)


def test_a_write_lost_on_every_send_is_info_then_the_worker_goes_on(
    queue: Queue, server: EchoServer
) -> None:
    config = replace(CONFIG, allow_targets=(f"127.0.0.1:{server.port}",))
    [job] = enqueue(queue, server.url("/ok"))
    states, events = run_until(
        queue, config, all_terminal, backend=EveryWriteLost(queue.dsn, schema=queue.schema)
    )
    writes = [f for kind, f in events if kind == "write"]
    assert [w["result"] for w in writes] == ["info", "applied"]
    assert "server closed the connection" in writes[0]["error"]
    # Sent again, backing off, until the lease (2 s) may have passed: then given up.
    sends = [f for kind, f in events if kind == "error" and f["op"] == "finish"]
    assert len(sends) > 3
    # The unknown write never landed: the lease expired, recovery retried the job.
    assert states[job.id].status is JobStatus.COMPLETED
    assert states[job.id].attempts == 2
    assert any(kind == "recover" for kind, _ in events)
    assert len(server.hits_for(job.id)) == 2


class CommittedThenLost(PgQueue):
    """The first result write commits, then its answer is lost with the connection."""

    lost = 1

    def finish(self, results: Sequence[AttemptResult]) -> list[WriteResult]:
        written = super().finish(results)
        if self.lost:
            self.lost -= 1
            self.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return written


def test_a_resent_write_that_had_committed_is_fenced_and_logged_as_unknown(
    queue: Queue, server: EchoServer
) -> None:
    """The resend finds the lease gone (its own first send took it): "fenced" cannot tell
    that from another worker's claim, so the write is logged as info, never as applied."""
    config = replace(CONFIG, allow_targets=(f"127.0.0.1:{server.port}",))
    [job] = enqueue(queue, server.url("/ok"))
    states, events = run_until(
        queue, config, all_terminal, backend=CommittedThenLost(queue.dsn, schema=queue.schema)
    )
    [write] = [f for kind, f in events if kind == "write"]
    assert write["result"] == "info"
    assert (states[job.id].status, states[job.id].attempts) == (JobStatus.COMPLETED, 1)
    assert len(server.hits_for(job.id)) == 1


def test_stop_arriving_during_the_claim_releases_the_leases(
    queue: Queue, server: EchoServer
) -> None:
    config = replace(CONFIG, allow_targets=(f"127.0.0.1:{server.port}",))
    jobs = enqueue(queue, server.url("/ok"), count=3)
    loop_box: dict[str, Any] = {}

    class StopDuringClaim(PgQueue):
        def claim(self, worker_id: str, batch: int, lease: timedelta) -> list[Lease]:
            leases = super().claim(worker_id, batch, lease)
            loop, dispatcher = loop_box["loop"], loop_box["dispatcher"]
            loop.call_soon_threadsafe(dispatcher.request_stop, "SIGTERM")
            return leases

    with recorded("worker-s") as (events, sink):
        dispatcher = Dispatcher(
            StopDuringClaim(queue.dsn, schema=queue.schema), config, "worker-s", sink
        )

        async def go() -> None:
            loop_box.update(loop=asyncio.get_running_loop(), dispatcher=dispatcher)
            await asyncio.wait_for(dispatcher.run(), 20)

        asyncio.run(go())
    # The recovery pass before the claim is an event too (it moved nothing).
    kinds = [kind for kind, _ in events]
    assert kinds == ["start", "recover", "claim", "claim", "claim", "release", "release",
                     "release", "stop"]
    assert {f["result"] for kind, f in events if kind == "release"} == {"applied"}
    assert server.hits_for(jobs[0].id) == []
    states = {s.job_id: s for s in queue.snapshot()}
    for job in jobs:
        # Given back uncounted: due again, as if never claimed.
        assert states[job.id].status is JobStatus.PENDING
        assert states[job.id].attempts == 0


def test_long_call_renews_its_lease_so_recovery_leaves_it_alone(
    queue: Queue, server: EchoServer
) -> None:
    # A call longer than the lease (allowed only with unsafe_timing): renewal at half the
    # lease keeps the job held, so a recovery pass after the first lease ran out moves nothing.
    config = replace(
        CONFIG,
        allow_targets=(f"127.0.0.1:{server.port}",),
        lease_seconds=1.0,
        http_timeout_seconds=3.0,
        unsafe_timing=True,
        recovery_enabled=False,
    )
    [job] = enqueue(queue, server.url("/slow"))
    recovered: list[int] = []

    def done(states: dict[uuid.UUID, JobState]) -> bool:
        hits = server.hits_for(job.id)
        if hits and not recovered and time.time() > hits[0].received + 1.2:
            recovered.append(queue.recover())
        return all_terminal(states)

    states, events = run_until(queue, config, done)
    assert recovered == [0]
    assert states[job.id].status is JobStatus.COMPLETED
    assert states[job.id].attempts == 1
    renewals = [f for kind, f in events if kind == "renew"]
    assert renewals
    assert not any(r.get("lost") for r in renewals)
    [claim] = [f for kind, f in events if kind == "claim"]
    assert renewals[-1]["locked_until"] > claim["locked_until"]
    [write] = [f for kind, f in events if kind == "write"]
    assert write["result"] == "applied"


class LosesEveryRenewal(PgQueue):
    """Every renewal finds the lease gone, as when recovery handed it to another worker."""

    def renew(self, leases: Sequence[Lease], extend: timedelta) -> list[Lease | None]:
        return [None for _ in leases]


def test_a_lost_lease_is_logged_once_and_never_renewed_again(
    queue: Queue, server: EchoServer
) -> None:
    config = replace(
        CONFIG,
        allow_targets=(f"127.0.0.1:{server.port}",),
        lease_seconds=0.5,
        http_timeout_seconds=3.0,
        unsafe_timing=True,
        recovery_enabled=False,
    )
    [job] = enqueue(queue, server.url("/slow"))

    def answered_and_written(states: dict[uuid.UUID, JobState]) -> bool:
        hits = server.hits_for(job.id)
        return bool(hits) and hits[0].answered is not None and (
            time.time() > hits[0].answered + 0.5)

    _, events = run_until(queue, config, answered_and_written,
                          backend=LosesEveryRenewal(queue.dsn, schema=queue.schema))
    # Renewals come every half lease while the 1.6 s call runs; only the first one is sent.
    renewals = [f for kind, f in events if kind == "renew"]
    [claim] = [f for kind, f in events if kind == "claim"]
    assert renewals == [{"job_id": str(job.id), "attempt": 1, "lost": True,
                         "lease_token": claim["lease_token"]}]
    assert [f["job_id"] for kind, f in events if kind == "write"] == [str(job.id)]


class FlakyDatabase(PgQueue):
    """The first recovery pass and the first claim each lose the connection."""

    broken = {"recover", "claim"}

    def recover(self, limit: int = 100) -> int:
        if "recover" in self.broken:
            self.broken = self.broken - {"recover"}
            raise psycopg.OperationalError("terminating connection due to administrator command")
        return super().recover(limit)

    def claim(self, worker_id: str, batch: int, lease: timedelta) -> list[Lease]:
        if "claim" in self.broken:
            self.broken = self.broken - {"claim"}
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return super().claim(worker_id, batch, lease)


def test_database_errors_outside_the_write_do_not_stop_the_worker(
    queue: Queue, server: EchoServer
) -> None:
    config = replace(CONFIG, allow_targets=(f"127.0.0.1:{server.port}",))
    jobs = enqueue(queue, server.url("/ok"), count=3)
    backend = FlakyDatabase(queue.dsn, schema=queue.schema)
    states, events = run_until(queue, config, all_terminal, backend=backend)
    assert backend.broken == set()
    assert all(states[job.id].status is JobStatus.COMPLETED for job in jobs)
    assert [kind for kind, _ in events].count("stop") == 1


def http_results(events: list[Event], job_id: uuid.UUID) -> list[str]:
    return [f["result"] for kind, f in events if kind == "http" and f["job_id"] == str(job_id)]


class InjectedAccount(PgQueue):
    """Hands out the leases of chosen jobs with an account id carrying CR/LF. Enqueue refuses
    such ids, but rows written before that check, or by another backend, still reach the
    dispatcher."""

    poisoned: frozenset[uuid.UUID] = frozenset()

    def claim(self, worker_id: str, batch: int, lease: timedelta) -> list[Lease]:
        return [
            replace(held, account_id="acct-1\r\nX-Injected: yes")
            if held.job_id in self.poisoned
            else held
            for held in super().claim(worker_id, batch, lease)
        ]


def test_a_poisoned_job_fails_alone_and_its_batch_mates_are_written(
    queue: Queue, server: EchoServer
) -> None:
    # Each poisoned job makes the HTTP stack raise something other than a refusal: the IDNA
    # codec's UnicodeError for an empty or over-long label, aiohttp's ValueError for a header
    # carrying CR/LF. They share one batch with good jobs.
    config = replace(CONFIG, batch=6, allow_targets=(f"127.0.0.1:{server.port}",))
    good = enqueue(queue, server.url("/ok"), count=3)
    [empty_label] = enqueue(queue, "http://a..com/")
    [long_label] = enqueue(queue, f"http://{'a' * 64}.com/")
    [bad_header] = enqueue(queue, server.url("/ok"))
    backend = InjectedAccount(queue.dsn, schema=queue.schema)
    backend.poisoned = frozenset({bad_header.id})
    later: list[NewJob] = []

    def done(states: dict[uuid.UUID, JobState]) -> bool:
        # Once the batch is settled, one more job shows the worker is still at work.
        if not later and all_terminal(states):
            later.extend(enqueue(queue, server.url("/ok")))
            return False
        return bool(later) and later[0].id in states and all_terminal(states)

    states, events = run_until(queue, config, done, backend=backend)

    kinds = [kind for kind, _ in events]
    assert kinds[: kinds.index("http")].count("claim") == 6, "the six jobs share one batch"
    for job in [*good, *later]:
        assert states[job.id].status is JobStatus.COMPLETED
        assert states[job.id].attempts == 1
        assert len(server.hits_for(job.id)) == 1
    for job, why in (
        (empty_label, "not a valid host name"),
        (long_label, "not a valid host name"),
        (bad_header, "ValueError"),
    ):
        state = states[job.id]
        assert (state.status, state.attempts) == (JobStatus.FAILED, 1)
        assert why in (state.last_error or "")
        assert http_results(events, job.id) == ["refused"]
    assert server.hits_for(bad_header.id) == []
    assert {f["result"] for kind, f in events if kind == "write"} == {"applied"}
    assert [f["reason"] for kind, f in events if kind == "stop"] == ["test over"]


@pytest.mark.parametrize(
    ("errno", "status", "attempts", "results"),
    [
        # "Temporary failure in name resolution": retried after its backoff.
        (socket.EAI_AGAIN, JobStatus.COMPLETED, 2, ["connection_error", "ok"]),
        # The name does not exist: an answer, not an outage, so no retry.
        (socket.EAI_NONAME, JobStatus.FAILED, 1, ["connection_error"]),
    ],
)
def test_a_failed_name_lookup_is_retried_unless_the_name_does_not_exist(
    queue: Queue,
    server: EchoServer,
    errno: int,
    status: JobStatus,
    attempts: int,
    results: list[str],
) -> None:
    config = replace(CONFIG, allow_targets=(f"127.0.0.1:{server.port}",))
    failures = [errno]  # the first lookup fails, any later one succeeds

    async def resolver(host: str, port: int) -> list[str]:
        if failures:
            raise socket.gaierror(failures.pop(), "injected lookup failure")
        return ["127.0.0.1"]

    [job] = enqueue(queue, f"http://hooks.test:{server.port}/ok")
    states, events = run_until(
        queue, config, all_terminal, guard=UrlGuard(config.allow_targets, resolver=resolver)
    )
    assert (states[job.id].status, states[job.id].attempts) == (status, attempts)
    assert http_results(events, job.id) == results
    assert len(server.hits_for(job.id)) == (1 if status is JobStatus.COMPLETED else 0)
    [first] = [f for kind, f in events if kind == "write"][:1]
    assert "injected lookup failure" in first["error"]


def test_name_resolution_counts_against_the_http_timeout(queue: Queue, server: EchoServer) -> None:
    # A lookup slower than the whole HTTP timeout (0.5 s) ends the attempt as a timeout,
    # rather than eating into the time the lease keeps for the call and the write.
    config = replace(CONFIG, allow_targets=(f"127.0.0.1:{server.port}",))
    stalls = [1.2]

    async def resolver(host: str, port: int) -> list[str]:
        if stalls:
            await asyncio.sleep(stalls.pop())
        return ["127.0.0.1"]

    [job] = enqueue(queue, f"http://hooks.test:{server.port}/ok")
    states, events = run_until(
        queue, config, all_terminal, guard=UrlGuard(config.allow_targets, resolver=resolver)
    )
    assert (states[job.id].status, states[job.id].attempts) == (JobStatus.COMPLETED, 2)
    assert http_results(events, job.id) == ["timeout", "ok"]
    first = next(f for kind, f in events if kind == "http")
    assert "resolving" in first["error"]
    assert len(server.hits_for(job.id)) == 1


def _slow_call_and_three_fast(
    queue: Queue, server: EchoServer, *, refill: bool
) -> tuple[NewJob, list[NewJob], dict[uuid.UUID, JobState], list[Event], list[int]]:
    """One claim takes a slow job (1.6 s, past the 1 s lease) and three fast ones; a recovery
    pass runs once the first lease has run out. (slow, fast, states, events, what recovery
    moved)."""
    config = replace(
        CONFIG,
        allow_targets=(f"127.0.0.1:{server.port}",),
        lease_seconds=1.0,
        http_timeout_seconds=3.0,
        unsafe_timing=True,
        recovery_enabled=False,
        refill=refill,
    )
    [slow] = enqueue(queue, server.url("/slow"))
    fast = enqueue(queue, server.url("/ok"), count=3)
    recovered: list[int] = []

    def done(states: dict[uuid.UUID, JobState]) -> bool:
        hits = server.hits_for(slow.id)
        if hits and not recovered and time.time() > hits[0].received + 1.2:
            recovered.append(queue.recover())
        return all_terminal(states)

    states, events = run_until(queue, config, done)
    return slow, fast, states, events, recovered


def _calls_and_writes(events: list[Event]) -> list[tuple[str, Any]]:
    return [(kind, f.get("job_id")) for kind, f in events if kind in ("http", "write")]


def test_fast_batch_mates_of_a_long_call_are_written_without_waiting_for_it(
    queue: Queue, server: EchoServer
) -> None:
    # The fast results are written as they end, not held for the slow call; the slow call's
    # lease alone is renewed, so the recovery pass moves nothing.
    slow, fast, states, events, recovered = _slow_call_and_three_fast(queue, server,
                                                                      refill=True)
    kinds = [kind for kind, _ in events]
    assert kinds[: kinds.index("http")].count("claim") == 4, "the four jobs share one claim"
    assert recovered == [0]
    for job in [slow, *fast]:
        assert (states[job.id].status, states[job.id].attempts) == (JobStatus.COMPLETED, 1)
        assert len(server.hits_for(job.id)) == 1
    order = _calls_and_writes(events)
    slow_call = order.index(("http", str(slow.id)))
    for job in fast:
        assert order.index(("write", str(job.id))) < slow_call, order
    writes = [f for kind, f in events if kind == "write"]
    assert sorted(w["job_id"] for w in writes) == sorted(str(j.id) for j in [slow, *fast])
    assert {w["result"] for w in writes} == {"applied"}
    renewed = {f["job_id"] for kind, f in events if kind == "renew" and not f.get("lost")}
    assert renewed == {str(slow.id)}


def test_the_batch_barrier_holds_batch_mates_until_the_slowest_call(
    queue: Queue, server: EchoServer
) -> None:
    # refill=False, the former loop (and pg-long-tx's): the fast results wait for the slow
    # call, and their leases are renewed meanwhile so that none is recovered.
    slow, fast, states, events, recovered = _slow_call_and_three_fast(queue, server,
                                                                      refill=False)
    assert recovered == [0]
    for job in [slow, *fast]:
        assert (states[job.id].status, states[job.id].attempts) == (JobStatus.COMPLETED, 1)
    order = _calls_and_writes(events)
    slow_call = order.index(("http", str(slow.id)))
    for job in fast:
        assert order.index(("write", str(job.id))) > slow_call, order
    renewed = {f["job_id"] for kind, f in events if kind == "renew" and not f.get("lost")}
    assert renewed == {str(j.id) for j in [slow, *fast]}


@pytest.mark.parametrize(
    ("make_bad", "message"),
    [
        (lambda p: p.write_text("when,what\n1,something\n"), "written with other columns"),
        (lambda p: p.mkdir(), "cannot write the event log"),
    ],
)
def test_worker_command_refuses_an_event_log_it_cannot_append_to(
    pg_dsn: str, fresh_schema: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    make_bad: Callable[[Path], object], message: str,
) -> None:
    from skiplock.scenarios.cli.main import main
    from skiplock.scenarios.run.workers import unique_prefix

    events_dir = tmp_path / "events"
    events_dir.mkdir()
    # The second worker's log (ids name the host and the command's pid: this process).
    bad = events_dir / f"{unique_prefix()}-1.csv"
    make_bad(bad)
    before = sorted(events_dir.rglob("*"))
    argv = ["worker", "--dsn", pg_dsn, "--schema", fresh_schema, "--events-dir",
            str(events_dir), "--workers", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and bad.name in err
    assert err.count("\n") == 1
    # Refused before anything was written: no log for the other worker either.
    assert sorted(events_dir.rglob("*")) == before


def test_worker_command_with_a_bad_events_dir_leaves_the_database_untouched(
    pg_dsn: str, fresh_schema: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from skiplock.scenarios.cli.main import main

    not_a_dir = tmp_path / "events"
    not_a_dir.write_text("")
    argv = ["worker", "--dsn", pg_dsn, "--schema", fresh_schema, "--events-dir", str(not_a_dir)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--events-dir" in err
    assert err.count("\n") == 1
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT 1 FROM information_schema.schemata WHERE schema_name = %s", (fresh_schema,)
        ).fetchone()
    assert row is None, "the queue schema was created before the bad input was refused"


class GhostClaims(PgQueue):
    """Its first `ghosts` claims that take rows commit, then lose their session before the
    worker reads them: the claim's own session is ended with pg_terminate_backend right after
    its COMMIT, and the worker gets the error a terminated session gives."""

    def __init__(self, dsn: str, *, schema: str, ghosts: int,
                 sql: str | Path | None = None) -> None:
        super().__init__(dsn, schema=schema, sql=sql)
        self.dsn = dsn
        self.ghosts = ghosts
        self.claim_result_hook = self._terminate

    def _terminate(self) -> None:
        if not self.ghosts:
            return
        self.ghosts -= 1
        pid = self.backend_pids()["lease"]
        with psycopg.connect(self.dsn, autocommit=True) as admin:
            # Waits (up to 5 s) until the session is gone.
            [[ended]] = admin.execute("SELECT pg_terminate_backend(%s, 5000)", [pid]).fetchall()
        assert ended
        raise psycopg.errors.AdminShutdown("terminating connection due to administrator command")


def _ghost_run(queue: Queue, server: EchoServer, sql: Path | None
               ) -> tuple[JobState, list[Event], list[dict[str, Any]], int]:
    """A job scripted 503, 503, 200 with max_attempts 3, whose first two claims are ghosts."""
    config = replace(CONFIG, allow_targets=(f"127.0.0.1:{server.port}",))
    [job] = enqueue(queue, server.url("/fail-twice"))
    backend = GhostClaims(queue.dsn, schema=queue.schema, ghosts=2, sql=sql)
    states, events = run_until(queue, config, all_terminal, backend=backend, limit=30)
    attempts = [row for row in queue.attempts_log() if row["job_id"] == job.id]
    return states[job.id], events, attempts, len(server.hits_for(job.id))


def test_a_claim_whose_result_was_lost_with_its_session_uses_no_attempt(
    queue: Queue, server: EchoServer
) -> None:
    state, events, attempts, hits = _ghost_run(queue, server, None)
    # The worker saw two failed claims, never their leases ...
    assert [f["op"] for kind, f in events if kind == "error"] == ["claim", "claim"]
    # ... both had committed, expired unreceived and were given back, attempt unchanged ...
    unreceived = [a for a in attempts if a["outcome"] == "unreceived"]
    assert [a["attempt"] for a in unreceived] == [1, 1]
    # ... so the job kept its three attempts, and was delivered three times.
    assert hits == 3
    assert (state.status, state.attempts) == (JobStatus.COMPLETED, 3)
    assert sorted(a["outcome"] for a in attempts if a["outcome"] != "unreceived") == [
        "success", "transient", "transient"]
    assert [f["attempt"] for kind, f in events if kind == "claim"] == [1, 2, 3]


def test_a_queue_that_counts_unreceived_claims_dead_letters_the_job_early(
    queue: Queue, server: EchoServer
) -> None:
    """The same run against the mutant that keeps the attempt of a claim nobody received:
    the job is dead-lettered after a single delivery (so the test above can fail)."""
    mutant = Path(__file__).parents[1] / "mutants" / "unreceived_attempt_counts.sql"
    state, _, _, hits = _ghost_run(queue, server, mutant)
    assert (state.status, hits) == (JobStatus.FAILED, 1)


@pytest.mark.chaos
def test_a_result_write_outlasts_a_server_restart_of_two_seconds(
    owned_pg_server: Any, server: EchoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server goes down (immediate stop) while a call is in flight and is back about
    two seconds later: the write is sent again, backing off, until it lands, well inside
    the 8 s lease; the job is completed on its one delivery, not given up and redelivered."""
    pg = owned_pg_server
    control = type(pg._control)
    started = control.start

    def slow_start(self: Any) -> None:
        time.sleep(1.5)  # the server stays down this much longer than its own restart
        started(self)

    config = replace(CONFIG, allow_targets=(f"127.0.0.1:{server.port}",), lease_seconds=8.0,
                     http_timeout_seconds=3.0, write_margin_seconds=2.0)
    queue = Queue(pg.dsn, schema="restart")
    queue.setup()
    queue.upsert_accounts([Account(id="acct-1")])
    [job] = enqueue(queue, server.url("/slow"))  # answers after 1.6 s
    queue.close()
    outage: list[float] = []

    def restart() -> None:
        begun = time.monotonic()
        monkeypatch.setattr(control, "start", slow_start)
        pg.restart("immediate")
        outage.append(time.monotonic() - begun)

    def state() -> JobState | None:
        with contextlib.suppress(psycopg.OperationalError):
            return {s.job_id: s for s in queue.snapshot()}.get(job.id)
        return None

    with recorded("worker-r") as (events, sink):
        dispatcher = Dispatcher(PgQueue(pg.dsn, schema="restart"), config, "worker-r", sink)

        async def go() -> JobState | None:
            task = asyncio.create_task(dispatcher.run())
            try:
                while not server.hits_for(job.id):
                    await asyncio.sleep(0.01)
                restarting = asyncio.create_task(asyncio.to_thread(restart))
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    found = await asyncio.to_thread(state) if restarting.done() else None
                    if found is not None and found.status.terminal:
                        return found
                    await asyncio.sleep(0.1)
                return None
            finally:
                dispatcher.request_stop("test over")
                await task

        final = asyncio.run(go())
        queue.close()
    if pg.dsn != queue.dsn:
        pytest.skip("the server came back on another address")
    [down] = outage
    assert 1.5 < down < 5.0, down
    assert final is not None and (final.status, final.attempts) == (JobStatus.COMPLETED, 1)
    assert [f["result"] for kind, f in events if kind == "write"] == ["applied"]
    assert any(kind == "error" and f["op"] == "finish" for kind, f in events)
    assert len(server.hits_for(job.id)) == 1
