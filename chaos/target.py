"""The duplicate-detecting echo target: the HTTP endpoint every job is delivered to.

It records every request it receives as one `skiplock.reports.history.Delivery` line in
`OUT/deliveries/<name>.csv`, and does what the job's script (`payload["script"]`, a
`JobScript.to_json()`) says: answer at once, answer a status, answer slowly, answer past the
dispatcher's timeout, never answer, or reset the connection. A payload without a script
succeeds.

A hang window (`POST /control/hang?seconds=S`, the `hang_target` fault) holds every delivery
that arrives while it is open, unanswered, until it closes; each then goes on with its
script. A stopping target gives held deliveries up as unanswered rather than wait.

The target counts deliveries per job itself (`seen`) and picks the script step from that
count, never from the attempt header, so a queue sending wrong attempt numbers cannot change
what a job does. It counts deliveries in flight per account; a delivery stops counting when it
is answered or when its client goes away (a dispatcher that timed out no longer holds it).

Records are written with one `write()` each, before the response is sent and without fsync:
they survive a crash of the target process, not a crash of the machine. The hot path is a dict
lookup, a CSV line and one write; asyncio's single thread is the only lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import json
import math
import os
import re
import signal
import socket
import struct
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, assert_never

from aiohttp import web

from skiplock.plumbing.orphans import die_with_parent, name_this_process
from skiplock.queue_impl.interface import (
    ACCOUNT_HEADER,
    ATTEMPT_HEADER,
    JOB_ID_HEADER,
    LEASE_HEADER,
    WORKER_HEADER,
)
from skiplock.reports.history import (
    DELIVERIES_DIR,
    DELIVERY_LOG,
    LOG_SUFFIX,
    Behaviour,
    Delivery,
    JobScript,
    LogWriter,
    Step,
    arrow_convert_options,
    read_log,
    unescape_text,
)

DEFAULT_HANG_CAP_SECONDS = 600.0
# How long a stopping target waits for deliveries still being answered (slow, hang).
DEFAULT_GRACE_SECONDS = 5.0
# How often held deliveries are checked for a client that has gone.
_POLL_SECONDS = 0.05
# How long a restarted target retries binding its old port while the kernel still holds it.
RESTART_BIND_SECONDS = 5.0
# Behaviour recorded for a request the target could not read (no job id, bad payload).
BAD_REQUEST = "bad_request"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_host(host: str) -> str:
    """The address to bind for `host`, which must be loopback (IPv4, IPv6 or `localhost`):
    the target accepts scripted faults from anyone who can reach it, so it never listens on
    a network. Raises ValueError with a one-line message otherwise."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"host {host!r} is not an IP address; use 127.0.0.1, ::1 or localhost"
        ) from None
    if not address.is_loopback:
        raise ValueError(f"host {host} is not loopback; use 127.0.0.1, ::1 or localhost")
    return str(address)


def check_name(name: str) -> str:
    """The target's name becomes a file name: letters, digits, `.`, `_`, `-`."""
    if not _NAME_RE.match(name):
        raise ValueError(f"target name {name!r} must be 1-64 letters, digits, '.', '_' or '-'")
    return name


def url_for(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def deliveries_path(out_dir: Path, name: str) -> Path:
    return out_dir / DELIVERIES_DIR / f"{name}{LOG_SUFFIX}"


def _int_or_none(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        return None


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _parse_script(body: bytes) -> JobScript | str:
    """The job's script, or a one-line reason the payload cannot be obeyed."""
    if not body:
        return "empty body; expected the job payload as JSON"
    try:
        payload = json.loads(body)
    except ValueError:
        return "body is not JSON"
    if not isinstance(payload, dict):
        return "payload is not a JSON object"
    raw = payload.get("script")
    if raw is None:
        return _SUCCEED
    try:
        script = JobScript.from_json(raw)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return f"bad script: {type(exc).__name__}: {exc}"
    for step in (script.first, script.then):
        if step.behaviour is Behaviour.STATUS and not 200 <= step.status <= 599:
            return f"bad script: status {step.status} is not 200-599"
        if step.seconds < 0:
            return f"bad script: seconds {step.seconds} is negative"
    return script


_SUCCEED = JobScript(name="succeed", first=Step(behaviour=Behaviour.OK))


class _Open:
    """A delivery the target has not finished with yet (mutable; becomes a Delivery)."""

    __slots__ = (
        "account",
        "account_in_flight",
        "attempt",
        "behaviour",
        "done",
        "job_id",
        "lease",
        "left",
        "received",
        "seen",
        "worker",
    )

    def __init__(
        self,
        *,
        job_id: str,
        attempt: int | None,
        account: str | None,
        worker: str | None,
        received: float,
        behaviour: str,
        seen: int,
        account_in_flight: int,
        lease: str | None = None,
    ) -> None:
        self.job_id = job_id
        self.lease = lease
        self.attempt = attempt
        self.account = account
        self.worker = worker
        self.received = received
        self.behaviour = behaviour
        self.seen = seen
        self.account_in_flight = account_in_flight
        self.left = False  # no longer counted in its account's in-flight
        self.done = False  # its record is written


class _Held:
    """A delivery being held (slow, hang): woken early when its client goes away."""

    __slots__ = ("delivery", "request", "until_gone", "wake")

    def __init__(self, *, request: web.Request, delivery: _Open, until_gone: bool) -> None:
        self.request = request
        self.delivery = delivery
        self.until_gone = until_gone
        self.wake = asyncio.Event()


def _earlier_deliveries(path: Path, name: str) -> Iterator[tuple[str, Any, Any, Any]]:
    """(job id, seen, status, behaviour) of each record `name` wrote to its log before; the
    job id is "" for a request that had none. Read with Arrow: a restart must not keep a
    run's workers waiting while a million records are parsed. A log Arrow cannot read is
    read line by line, so that the error names the line."""
    import pyarrow as pa  # type: ignore[import-untyped]  # only a restart needs Arrow
    import pyarrow.csv as pacsv  # type: ignore[import-untyped]

    columns = {"job_id": pa.string(), "target": pa.string(), "seen": pa.float64(),
               "status": pa.float64(), "behaviour": pa.string()}
    try:
        table = pacsv.read_csv(path, convert_options=arrow_convert_options(columns))
        rows: Iterable[tuple[Any, ...]] = zip(
            *(table.column(c).to_pylist() for c in columns), strict=True)
    except pa.ArrowInvalid:
        rows = ((r["job_id"], r["target"], r["seen"], r["status"], r["behaviour"])
                for r in read_log(path, DELIVERY_LOG))
    for job, target, seen, status, behaviour in rows:
        if target is None or target == name:
            yield unescape_text(job or ""), seen, status, behaviour


class EchoTarget:
    """The target's state and its aiohttp application. One per process (one event loop)."""

    def __init__(
        self,
        *,
        out_dir: Path,
        name: str = "target-0",
        hang_cap_seconds: float = DEFAULT_HANG_CAP_SECONDS,
    ) -> None:
        self.name = check_name(name)
        self.hang_cap_seconds = hang_cap_seconds
        self.path = deliveries_path(out_dir, name)
        self._writer = LogWriter(self.path, DELIVERY_LOG)
        self._seen: dict[str, int] = {}
        self._answered_ok: set[str] = set()
        self._in_flight: dict[str, int] = {}
        self._max_in_flight: dict[str, int] = {}
        self._by_status: dict[int, int] = {}
        self._open: set[_Open] = set()
        self._deliveries = 0
        self._duplicates = 0
        self._unanswered = 0
        self._bad_requests = 0
        self._held: set[_Held] = set()
        self._stopping = False
        # The hang window: set when it closes; None while no window is open.
        self._window: asyncio.Event | None = None
        self._window_end = 0.0  # loop time
        self._window_timer: asyncio.TimerHandle | None = None
        self._window_held = 0
        self._resume()

    def _resume(self) -> None:
        """Pick up the counts of a log this target's name wrote before (a target restarted
        on the same run directory): each job's script goes on from the deliveries already
        answered rather than starting over, and the stats count them too. A job's count is
        the highest `seen` recorded for it (records are written when answered, so a slow
        first delivery can be logged after its retry). Deliveries in flight when the earlier
        process died were never recorded; the queue saw them fail."""
        if self.path.stat().st_size <= len(DELIVERY_LOG.header()):
            return
        for job, seen, status, behaviour in _earlier_deliveries(self.path, self.name):
            count = self._seen.get(job, 0)
            self._seen[job] = count + 1 if seen is None else max(count, int(seen))
            self._deliveries += 1
            if job in self._answered_ok:
                self._duplicates += 1
            if behaviour == BAD_REQUEST:
                self._bad_requests += 1
            if status is None:
                self._unanswered += 1
            else:
                self._by_status[int(status)] = self._by_status.get(int(status), 0) + 1
                if 200 <= status < 300:
                    self._answered_ok.add(job)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/deliver", self._deliver)
        app.router.add_post("/deliver/{tail:.*}", self._deliver)
        app.router.add_get("/stats", self._stats)
        app.router.add_post("/control/hang", self._control_hang)
        app.cleanup_ctx.append(self._sweeper)
        return app

    @property
    def open_count(self) -> int:
        return len(self._open)

    def stats(self) -> dict[str, Any]:
        """Counts so far. Accounts are keyed by id ("" for deliveries without one)."""
        return {
            "target": self.name,
            "deliveries": self._deliveries,
            "answered": {str(k): v for k, v in sorted(self._by_status.items())},
            "unanswered": self._unanswered,
            "open": len(self._open),
            "duplicates": self._duplicates,
            "unique_jobs": len(self._seen),
            "bad_requests": self._bad_requests,
            "in_flight": dict(self._in_flight),
            "max_in_flight": dict(self._max_in_flight),
        }

    def begin_stop(self) -> None:
        """Stop holding deliveries that would never be answered anyway (those in a hang
        window included: a stopping target does not wait the window out)."""
        self._stopping = True
        self._close_window()

    # -- the hang window -------------------------------------------------------------------

    def hang(self, seconds: float) -> float | None:
        """Hold every delivery that arrives in the next `seconds` until then. A window
        already open is extended, never shortened; `seconds` 0 closes it at once (what is
        held goes on with its script). Returns the window's end (epoch seconds), or None
        when no window is open. Call on the target's event loop."""
        if seconds <= 0:
            self._close_window()
            return None
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        if self._window is None:
            self._window = asyncio.Event()
        elif end <= self._window_end:
            return time.time() + (self._window_end - loop.time())
        if self._window_timer is not None:
            self._window_timer.cancel()
        self._window_end = end
        self._window_timer = loop.call_at(end, self._close_window)
        return time.time() + seconds

    def _close_window(self) -> None:
        if self._window_timer is not None:
            self._window_timer.cancel()
            self._window_timer = None
        if self._window is not None:
            self._window.set()
            self._window = None

    async def _wait_window(
        self, request: web.Request, delivery: _Open, window: asyncio.Event
    ) -> None:
        """Hold a delivery that arrived in a hang window until the window closes. Its
        client may give up meanwhile: it then stops counting as in flight (the sweeper)."""
        held = _Held(request=request, delivery=delivery, until_gone=False)
        self._held.add(held)
        self._window_held += 1
        try:
            await window.wait()
        finally:
            self._window_held -= 1
            self._held.discard(held)

    def give_up_all(self) -> None:
        """Record every delivery still open as unanswered and close the log."""
        now = time.time()
        for delivery in list(self._open):
            self._record(delivery, None, None, now)
        self._writer.close()

    # -- bookkeeping -----------------------------------------------------------------------

    def _arrive(
        self,
        *,
        job_id: str,
        attempt: int | None,
        account: str | None,
        worker: str | None,
        received: float,
        script: JobScript | None,
        lease: str | None = None,
    ) -> tuple[_Open, Step | None]:
        seen = self._seen.get(job_id, 0) + 1
        self._seen[job_id] = seen
        self._deliveries += 1
        if job_id in self._answered_ok:
            self._duplicates += 1
        key = account or ""
        in_flight = self._in_flight.get(key, 0) + 1
        self._in_flight[key] = in_flight
        if in_flight > self._max_in_flight.get(key, 0):
            self._max_in_flight[key] = in_flight
        step = None if script is None else script.step_for(seen)
        delivery = _Open(
            job_id=job_id,
            attempt=attempt,
            account=account,
            worker=worker,
            lease=lease,
            received=received,
            behaviour=BAD_REQUEST if step is None else step.behaviour.value,
            seen=seen,
            account_in_flight=in_flight,
        )
        self._open.add(delivery)
        return delivery, step

    def _leave(self, delivery: _Open) -> None:
        if not delivery.left:
            delivery.left = True
            self._in_flight[delivery.account or ""] -= 1

    def _record(
        self, delivery: _Open, answered: float | None, status: int | None, now: float
    ) -> None:
        """Write the delivery's one record (at most once) and drop it from the open set."""
        if delivery.done:
            return
        delivery.done = True
        self._leave(delivery)
        self._open.discard(delivery)
        if status is None:
            self._unanswered += 1
        else:
            self._by_status[status] = self._by_status.get(status, 0) + 1
            if 200 <= status < 300:
                self._answered_ok.add(delivery.job_id)
        record = Delivery(
            job_id=delivery.job_id,
            attempt=delivery.attempt,
            account=delivery.account,
            worker=delivery.worker,
            target=self.name,
            received=delivery.received,
            answered=answered,
            status=status,
            behaviour=delivery.behaviour,
            seen=delivery.seen,
            account_in_flight=delivery.account_in_flight,
            lease=delivery.lease,
        )
        # vars() rather than asdict(): the fields are flat, and asdict's deep copy would be
        # most of the hot path's cost.
        self._writer.write(vars(record))

    def _answer(self, delivery: _Open, status: int) -> web.Response:
        now = time.time()
        self._record(delivery, now, status, now)
        return web.Response(
            body=b'{"seen":%d}' % delivery.seen, status=status, content_type="application/json"
        )

    async def _hold(
        self, request: web.Request, delivery: _Open, seconds: float, *, until_gone: bool
    ) -> None:
        """Wait `seconds`. A client that goes away stops counting as in flight; with
        `until_gone` it also ends the wait (nobody is left to answer)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        held = _Held(request=request, delivery=delivery, until_gone=until_gone)
        self._held.add(held)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(held.wake.wait(), seconds)
            if not until_gone:
                # The client left early; the work still finishes when it would have.
                await asyncio.sleep(max(0.0, deadline - loop.time()))
        finally:
            self._held.discard(held)

    async def _sweep(self) -> None:
        """One task watches every held delivery's connection, rather than one wake-up per
        delivery per tick: hundreds of hung deliveries then cost one loop over a set."""
        while True:
            for held in list(self._held):
                if held.wake.is_set():
                    continue
                if _client_gone(held.request):
                    self._leave(held.delivery)
                    held.wake.set()
                elif held.until_gone and self._stopping:
                    held.wake.set()
            await asyncio.sleep(_POLL_SECONDS)

    async def _sweeper(self, app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self._sweep())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    # -- handlers --------------------------------------------------------------------------

    async def _deliver(self, request: web.Request) -> web.StreamResponse:
        received = time.time()
        # Taken on arrival: a request that arrived in the window is held even if the window
        # closes while its body is read.
        window = self._window
        headers = request.headers
        job_id = headers.get(JOB_ID_HEADER, "")
        problem: str | None
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            body, problem = b"", f"body too large ({exc.text})"
        else:
            problem = None if job_id else f"missing {JOB_ID_HEADER} header"
        parsed = problem or _parse_script(body)
        delivery, step = self._arrive(
            job_id=job_id,
            attempt=_int_or_none(headers.get(ATTEMPT_HEADER)),
            account=headers.get(ACCOUNT_HEADER),
            worker=headers.get(WORKER_HEADER),
            lease=headers.get(LEASE_HEADER),
            received=received,
            script=parsed if isinstance(parsed, JobScript) else None,
        )
        try:
            if window is not None:
                await self._wait_window(request, delivery, window)
                if self._stopping:
                    # Stopped during the window: given up unanswered, as at the hang cap.
                    self._record(delivery, None, None, time.time())
                    _drop(request, reset=False)
                    return web.Response(status=200)
            if step is None:
                self._bad_requests += 1
                now = time.time()
                self._record(delivery, now, 400, now)
                return web.json_response({"error": parsed}, status=400)
            return await self._obey(request, delivery, step)
        finally:
            # Cancelled (shutdown) or failed: the client got no answer from us.
            self._record(delivery, None, None, time.time())

    async def _obey(self, request: web.Request, delivery: _Open, step: Step) -> web.Response:
        behaviour = step.behaviour
        match behaviour:
            case Behaviour.OK:
                return self._answer(delivery, 200)
            case Behaviour.STATUS:
                return self._answer(delivery, step.status)
            case Behaviour.SLOW | Behaviour.HANG:
                # Finishes even if the client has gone (aiohttp does not cancel handlers on
                # disconnect by default): a late answer is recorded at the time it finished.
                await self._hold(request, delivery, step.seconds, until_gone=False)
                return self._answer(delivery, 200)
            case Behaviour.HANG_FOREVER:
                await self._hold(request, delivery, self.hang_cap_seconds, until_gone=True)
                self._record(delivery, None, None, time.time())
                _drop(request, reset=False)
                return web.Response(status=200)
            case Behaviour.RESET:
                self._record(delivery, None, None, time.time())
                _drop(request, reset=True)
                return web.Response(status=200)
            case _:
                assert_never(behaviour)

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    async def _control_hang(self, request: web.Request) -> web.Response:
        """`POST /control/hang?seconds=S`: open (or extend) a hang window of S seconds; 0
        closes it. S must be a number from 0 to the hang cap."""
        raw = request.query.get("seconds")
        try:
            seconds = float(raw) if raw is not None else math.nan
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or not 0 <= seconds <= self.hang_cap_seconds:
            return web.json_response(
                {"error": f"seconds must be a number from 0 to the hang cap "
                          f"{self.hang_cap_seconds:g} (got {raw!r})"},
                status=400,
            )
        until = self.hang(seconds)
        return web.json_response({"hang_until": until, "held": self._window_held})


def _drop(request: web.Request, *, reset: bool) -> None:
    """Close the connection without an answer; with `reset`, as a TCP RST (SO_LINGER 0)."""
    transport = request.transport
    if transport is None:
        return
    if reset:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def _bind_retrying(host: str, port: int, retry_seconds: float) -> socket.socket:
    """`_bind`, retried while the port is still in use for up to `retry_seconds` (a target
    restarted on its port right after a kill)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_seconds
    while True:
        try:
            return _bind(host, port)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or loop.time() >= deadline:
                raise
        await asyncio.sleep(_POLL_SECONDS)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


async def serve(
    *,
    out_dir: Path,
    name: str = "target-0",
    host: str = "127.0.0.1",
    port: int = 0,
    hang_cap_seconds: float = DEFAULT_HANG_CAP_SECONDS,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    on_ready: Callable[[int], None] | None = None,
    stop: asyncio.Event | None = None,
    bind_retry_seconds: float = 0.0,
) -> int:
    """Run a target until SIGINT / SIGTERM (or `stop` is set). Calls `on_ready(port)` once it
    listens. Returns the signal number that stopped it (0 for `stop`). A port still in use
    is retried for `bind_retry_seconds`.

    Stopping: no new connections, up to `grace_seconds` for deliveries still being answered,
    then every delivery still open is recorded as unanswered."""
    bind_host = check_host(host)
    target = EchoTarget(out_dir=out_dir, name=name, hang_cap_seconds=hang_cap_seconds)
    stop_event = stop or asyncio.Event()
    stopped_by = 0
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        nonlocal stopped_by
        stopped_by = signum
        stop_event.set()

    runner = web.AppRunner(
        target.app(), access_log=None, handle_signals=False, shutdown_timeout=0.5
    )
    await runner.setup()
    try:
        sock = await _bind_retrying(bind_host, port, bind_retry_seconds)
        site = web.SockSite(runner, sock, backlog=1024)
        await site.start()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_signal, signum)
        if on_ready is not None:
            on_ready(sock.getsockname()[1])
        await stop_event.wait()
        target.begin_stop()
        await site.stop()
        deadline = loop.time() + grace_seconds
        while target.open_count and loop.time() < deadline:
            await asyncio.sleep(_POLL_SECONDS)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        await runner.cleanup()
        target.give_up_all()
    return stopped_by


# ----------------------------------------------------------------------------------------------
# Running a target in its own process.
# ----------------------------------------------------------------------------------------------


def _child_main(
    conn: Any,
    out_dir: str,
    name: str,
    host: str,
    port: int,
    hang_cap_seconds: float,
    grace_seconds: float,
    parent_pid: int | None = None,
    bind_retry_seconds: float = 0.0,
) -> None:
    die_with_parent(parent_pid)
    name_this_process("skiplock-target")
    ready = False

    def on_ready(bound: int) -> None:
        nonlocal ready
        ready = True
        conn.send(("ready", bound))

    try:
        asyncio.run(
            serve(
                out_dir=Path(out_dir),
                name=name,
                host=host,
                port=port,
                hang_cap_seconds=hang_cap_seconds,
                grace_seconds=grace_seconds,
                on_ready=on_ready,
                bind_retry_seconds=bind_retry_seconds,
            )
        )
    except Exception as exc:
        if not ready:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    finally:
        conn.close()


# A child asks to be signalled when its parent dies (`die_with_parent`), and to Linux the
# parent is the *thread* that started it: a target restarted from a short-lived thread (a
# fault's heal) would be stopped as soon as that thread ended. So a start from any thread but
# the main one runs on this one thread, which lives as long as the interpreter.
_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def _on_long_lived_thread(start: Callable[[], None]) -> None:
    global _spawner
    if threading.current_thread() is threading.main_thread():
        start()
        return
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skiplock-spawner")
    _spawner.submit(start).result()


class TargetProcess:
    """An echo target in its own (spawned) process, for runs and tests.

    Started on entering the context (or by `start()`); port 0 lets the system pick a port,
    which the child reports back. Leaving the context stops it and leaves no process.
    `kill()` and `restart()` crash it and bring it back on the same address; `hang()` opens
    a hang window. These are what the target faults act on
    (`skiplock.chaos.nemesis.TargetHandle`)."""

    def __init__(
        self,
        out_dir: Path,
        name: str = "target-0",
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        hang_cap_seconds: float = DEFAULT_HANG_CAP_SECONDS,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        start_timeout: float = 60.0,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.name = check_name(name)
        self.host = check_host(host)
        self._requested_port = port
        self.hang_cap_seconds = hang_cap_seconds
        self.grace_seconds = grace_seconds
        self.start_timeout = start_timeout
        self._process: Any = None
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("target not started; use `with TargetProcess(...)` or start()")
        return self._port

    @property
    def url(self) -> str:
        return url_for(self.host, self.port)

    @property
    def deliver_url(self) -> str:
        return self.url + "/deliver"

    @property
    def deliveries_path(self) -> Path:
        return deliveries_path(self.out_dir, self.name)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else int(self._process.pid)

    def alive(self) -> bool:
        return self._process is not None and bool(self._process.is_alive())

    def start(self) -> TargetProcess:
        if self._process is not None:
            return self
        _on_long_lived_thread(lambda: self._spawn(self._requested_port, 0.0))
        return self

    def restart(self) -> None:
        """Start the target again after `kill()` (or `stop()`), on the same host and port
        (jobs carry its URL), resuming each job's script from its log. Retries the port
        for a few seconds if the kernel still holds it. Does nothing while it runs."""
        if self.alive():
            return
        if self._port is None:
            raise RuntimeError("target never started; use start() first")
        if self._process is not None:
            self._process.join()
            self._process = None
        port = self._port
        _on_long_lived_thread(lambda: self._spawn(port, RESTART_BIND_SECONDS))

    def hang(self, seconds: float, timeout: float = 10.0) -> None:
        """Open a hang window of `seconds` (0 closes it at once): every delivery arriving
        while it is open is held unanswered until it closes (`POST /control/hang`).
        Raises ValueError for seconds the target refuses (negative, not finite, past the
        hang cap), OSError if the target cannot be reached."""
        query = urllib.parse.urlencode({"seconds": repr(float(seconds))})
        request = urllib.request.Request(
            f"{self.url}/control/hang?{query}", data=b"", method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            with exc:
                detail = exc.read().decode("utf-8", "replace")
            if exc.code == 400:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    detail = str(json.loads(detail)["error"])
                raise ValueError(f"target {self.name} refused the hang: {detail}") from None
            raise

    def _spawn(self, port: int, bind_retry_seconds: float) -> None:
        import multiprocess  # heavy import, only where a process is started

        ctx = multiprocess.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=_child_main,
            args=(
                child,
                str(self.out_dir),
                self.name,
                self.host,
                port,
                self.hang_cap_seconds,
                self.grace_seconds,
                os.getpid(),
                bind_retry_seconds,
            ),
            name=f"skiplock-{self.name}",
            daemon=True,
        )
        process.start()
        child.close()
        self._process = process
        try:
            message = self._wait_ready(parent)
        finally:
            parent.close()
        if message[0] != "ready":
            self.kill()
            raise RuntimeError(f"target {self.name} did not start: {message[1]}")
        self._port = int(message[1])

    def _wait_ready(self, conn: Any) -> tuple[str, Any]:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if conn.poll(0.1):
                try:
                    kind, value = conn.recv()
                    return str(kind), value
                except EOFError:
                    return ("error", "the target process exited during start")
            if not self._process.is_alive():
                return ("error", f"the target process exited ({self._process.exitcode})")
        return ("error", f"no answer within {self.start_timeout:g} s")

    def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """GET /stats."""
        with urllib.request.urlopen(self.url + "/stats", timeout=timeout) as response:
            value = json.loads(response.read())
        if not isinstance(value, dict):
            raise RuntimeError("target /stats did not return a JSON object")
        return value

    def stop(self, grace_seconds: float | None = None) -> int | None:
        """SIGTERM and wait (the target records what is still open); SIGKILL after the
        target's grace plus a margin. Returns the exit code."""
        process = self._process
        if process is None:
            return None
        if process.is_alive():
            os.kill(process.pid, signal.SIGTERM)
            grace = self.grace_seconds if grace_seconds is None else grace_seconds
            process.join(grace + 10.0)
        if process.is_alive():
            self.kill()
        process.join()
        return None if process.exitcode is None else int(process.exitcode)

    def kill(self) -> None:
        """SIGKILL: what a crash of the target looks like."""
        process = self._process
        if process is None:
            return
        if process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
        process.join()

    def __enter__(self) -> TargetProcess:
        try:
            return self.start()
        except BaseException:
            self.kill()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ----------------------------------------------------------------------------------------------
# Several target processes behind one run.
# ----------------------------------------------------------------------------------------------

# Deliveries per second one target process is given at most when sized automatically: about
# a third of what one process answers on a core here (`skiplock bench target`), so that the
# target keeps the headroom the design asks of it and is never what a run measures.
RATE_PER_TARGET_PROCESS = 1000.0


def processes_for_rate(rate: float, cores: int | None = None) -> int:
    """How many target processes a run offering `rate` jobs/s gets: one per
    `RATE_PER_TARGET_PROCESS`, at least one, at most one per core. A closed loop (rate 0)
    offers what the queue takes, so it gets one per core."""
    cores = max(1, cores if cores is not None else (os.cpu_count() or 1))
    if rate <= 0:
        return cores
    return max(1, min(cores, math.ceil(rate / RATE_PER_TARGET_PROCESS)))


def route(job_id: uuid.UUID, urls: Sequence[str]) -> str:
    """The URL of the target process that receives every delivery of `job_id`.

    Each process counts a job's deliveries itself and picks the script's step from that
    count, so all deliveries of one job must reach the same process: the job id picks it.
    Spreading connections instead (`SO_REUSEPORT`) would split a job's retries over
    processes whose counts would each see only part of them."""
    return urls[job_id.int % len(urls)]


class TargetGroup:
    """`count` echo targets, each its own process, port and delivery log (`target-0`,
    `target-1`, ...). Jobs are spread over them by `route`; every fault acts on the
    targets one by one (`members`), as on targets on several hosts."""

    def __init__(self, out_dir: Path, count: int, host: str = "127.0.0.1",
                 **options: Any) -> None:
        if count < 1:
            raise ValueError("a target group needs at least one process")
        self.members = [TargetProcess(out_dir, name=f"target-{i}", host=host, **options)
                        for i in range(count)]

    @property
    def deliver_urls(self) -> list[str]:
        return [t.deliver_url for t in self.members]

    @property
    def addresses(self) -> tuple[str, ...]:
        """`host:port` of each member, for the dispatcher's allow-list."""
        return tuple(f"{t.host}:{t.port}" for t in self.members)

    @property
    def url(self) -> str:
        """The members' base URLs, for people to read."""
        return ", ".join(t.url for t in self.members)

    def start(self) -> TargetGroup:
        try:
            for target in self.members:
                target.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM every member at once, then wait for each (they record what is open)."""
        for target in self.members:
            pid = target.pid
            if pid is not None and target.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        for target in self.members:
            target.stop()

    def __enter__(self) -> TargetGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
