"""The HTTP delivery of one job, and its result's classification.

`Deliverer` vets a lease's target through the SSRF guard, POSTs the job with its identity
headers under one deadline (the HTTP timeout, which covers name resolution and the call
together), judges the answer and records the `http` event. The dispatcher's loop uses it, and
so does a native worker loop, once per job.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import aiohttp

from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.events import Call, EventSink, HttpResultName, http_event, one_line
from skiplock.queue_impl.http11 import ConnectionFailed, Http11Client, request_target
from skiplock.queue_impl.interface import (
    ACCOUNT_HEADER,
    ATTEMPT_HEADER,
    JOB_ID_HEADER,
    LEASE_HEADER,
    WORKER_HEADER,
    Lease,
    Outcome,
)
from skiplock.queue_impl.retry import classify_status
from skiplock.queue_impl.ssrf import (
    PinnedResolver,
    ResolutionFailed,
    TargetRefused,
    UrlGuard,
    VettedTarget,
)


def call_for_status(status: int, start: float, end: float) -> Call:
    """An answered call, judged by its status: a redirect is not followed (it would connect
    somewhere the guard never vetted) and is permanent; the rest as `classify_status` says."""
    if 300 <= status < 400:
        return Call(result="http_error", outcome=Outcome.PERMANENT, status=status,
                    error=f"redirect not followed (HTTP {status})", start=start, end=end)
    outcome = classify_status(status)
    return Call(
        result="ok" if outcome is Outcome.SUCCESS else "http_error",
        outcome=outcome,
        status=status,
        error=None if outcome is Outcome.SUCCESS else f"HTTP {status}",
        start=start,
        end=end,
    )


def timed_out_call(start: float, end: float, timeout_seconds: float) -> Call:
    """A call the target did not answer within the HTTP timeout."""
    return Call(result="timeout", outcome=Outcome.TRANSIENT, status=None,
                error=f"no answer within {timeout_seconds:g}s", start=start, end=end)


class Deliverer:
    """One worker's HTTP side: vet a lease's target through the SSRF guard, POST the job with
    its identity headers under one deadline (the HTTP timeout), judge the answer, and record
    the `http` event. The dispatcher's loop uses it, and so does a native-worker plug-in whose
    own consumer loop calls `deliver` once per job: every backend's calls go through the same
    guard, timeout, headers, events and failpoint (`after_success`, called with the lease of
    each successful call, is where the dispatcher crashes on purpose)."""

    def __init__(
        self,
        config: DispatcherConfig,
        worker_id: str,
        sink: EventSink,
        *,
        guard: UrlGuard | None = None,
        after_success: Callable[[Lease], None] | None = None,
    ) -> None:
        self.config = config
        self.worker_id = worker_id
        self._sink = sink
        self._guard = guard or UrlGuard(config.allow_targets)
        self._after_success = after_success
        self._session: aiohttp.ClientSession | None = None
        self._resolver: PinnedResolver | None = None
        # Plain http goes through the lean client (about half aiohttp's CPU per call, the
        # largest part of a worker's per-job cost); https through aiohttp.
        self._lean: Http11Client | None = None

    async def __aenter__(self) -> Deliverer:
        if self._session is not None:
            raise RuntimeError("a Deliverer is entered once at a time")
        self._resolver = PinnedResolver()
        # No DNS cache: every connection asks the pinned resolver, which knows only the
        # address the guard vetted. One connection pool per worker, sized to its slots.
        connector = aiohttp.TCPConnector(
            resolver=self._resolver, use_dns_cache=False, limit=max(self.config.batch, 1)
        )
        self._session = aiohttp.ClientSession(
            connector=connector, raise_for_status=False, auto_decompress=True
        )
        self._lean = Http11Client(max(self.config.batch, 1))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        session, self._session = self._session, None
        lean, self._lean = self._lean, None
        if lean is not None:
            lean.close()
        if session is not None:
            await session.close()

    async def deliver(self, lease: Lease) -> Call:
        """Vet and call one job's target under one deadline, the HTTP timeout, and record
        the `http` event. Never raises (but for cancellation): anything unexpected becomes
        this job's permanent outcome, so one bad job cannot take its batch down with it."""
        if self._session is None or self._resolver is None:
            raise RuntimeError("Deliverer.deliver outside `async with deliverer`")
        session, resolver = self._session, self._resolver
        start = time.time()
        timeout = self.config.http_timeout_seconds
        phase = "resolving the host name"
        try:
            async with asyncio.timeout(timeout) as deadline:
                try:
                    target = await self._guard.vet(lease.target_url)
                except TargetRefused as exc:
                    call = self._failed(start, "refused", Outcome.PERMANENT, str(exc))
                except ResolutionFailed as exc:
                    outcome = Outcome.TRANSIENT if exc.temporary else Outcome.PERMANENT
                    call = self._failed(start, "connection_error", outcome, str(exc))
                else:
                    phase = "waiting for the answer"
                    if self._lean is not None and self._lean.handles(target):
                        call = await self._post_lean(self._lean, target, lease, start)
                    else:
                        resolver.pin(target)
                        when = deadline.when()
                        left = (timeout if when is None
                                else when - asyncio.get_running_loop().time())
                        call = await self._post(session, lease, start, max(left, 0.001))
        except TimeoutError:
            call = self._failed(
                start,
                "timeout",
                Outcome.TRANSIENT,
                f"no answer within {timeout:g}s (still {phase})",
            )
        except Exception as exc:
            # Not the target's doing, and retrying would fail the same way. The known causes
            # (a host name the IDNA codec rejects, a header carrying CR/LF) fail before
            # anything is sent, so this is recorded as a refusal, with the error.
            call = self._failed(
                start,
                "refused",
                Outcome.PERMANENT,
                f"cannot dispatch this job: {type(exc).__name__}: {one_line(exc)}",
            )
        self._sink("http", http_event(lease, call))
        if call.outcome is Outcome.SUCCESS and self._after_success is not None:
            self._after_success(lease)
        return call

    @staticmethod
    def _failed(start: float, result: HttpResultName, outcome: Outcome, error: str) -> Call:
        """An attempt that ended without an HTTP status."""
        return Call(
            result=result, outcome=outcome, status=None, error=error, start=start, end=time.time()
        )

    def _headers(self, lease: Lease) -> dict[str, str]:
        return {
            JOB_ID_HEADER: lease.job_id_text,
            ATTEMPT_HEADER: str(lease.attempt),
            ACCOUNT_HEADER: lease.account_id,
            WORKER_HEADER: self.worker_id,
            LEASE_HEADER: lease.token_text,
        }

    async def _post_lean(self, client: Http11Client, target: VettedTarget, lease: Lease,
                         start: float) -> Call:
        """The call on the lean client, under `deliver`'s deadline (it has none of its own):
        it connects to the vetted address only, and sends each request at most once."""
        body = json.dumps(dict(lease.payload)).encode()
        try:
            response = await client.post(target, request_target(lease.target_url),
                                         self._headers(lease), body, None)
        except (ConnectionFailed, OSError) as exc:
            status = exc.status if isinstance(exc, ConnectionFailed) else None
            if status is not None:  # the status line arrived, the body did not
                return call_for_status(status, start, time.time())
            return Call(result="connection_error", outcome=Outcome.TRANSIENT, status=None,
                        error=one_line(exc) or type(exc).__name__, start=start,
                        end=time.time())
        return call_for_status(response.status, start, time.time())

    async def _post(
        self, session: aiohttp.ClientSession, lease: Lease, start: float, timeout_seconds: float
    ) -> Call:
        headers = self._headers(lease)
        timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        status: int | None = None
        try:
            async with session.post(
                lease.target_url,
                json=dict(lease.payload),
                headers=headers,
                timeout=timeout,
                allow_redirects=False,
            ) as response:
                status = response.status
                await response.read()
        except TimeoutError:
            return timed_out_call(start, time.time(), self.config.http_timeout_seconds)
        except (aiohttp.ClientError, OSError) as exc:
            if status is None:
                return Call(
                    result="connection_error",
                    outcome=Outcome.TRANSIENT,
                    status=None,
                    error=one_line(exc) or type(exc).__name__,
                    start=start,
                    end=time.time(),
                )
            # The status line arrived but the body did not: judge by the status.
        assert status is not None
        return call_for_status(status, start, time.time())


__all__ = ["Deliverer", "call_for_status", "timed_out_call"]
