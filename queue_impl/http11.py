"""A lean HTTP/1.1 client for the dispatcher's one kind of call: POST a JSON body to a target
the SSRF guard vetted, and bring back the status.

aiohttp was the largest single part of a worker's CPU per job; the dispatcher needs little of
what it does (no redirects, no cookies, no decompression, no DNS, no TLS on the echo target),
so this client does only that, on asyncio's Protocol/Transport layer. Streams measured the
same per call (`skiplock bench http`'s driver, alternating: 167.8 against 168.9 µs); the
protocol is kept because its own callbacks see an idle connection's end of stream or loss
with no reader task, and one timer per call does the work of a timeout context.

What it guarantees:

- It connects only to the guard's address (`VettedTarget.address`, an IP literal: anything
  else is refused before a socket exists), never resolving a name, so the guard's pin holds;
  `Host:` carries the URL's host.
- Each worker has one client, with a keep-alive pool keyed by (address, port, host) and at
  most `limit` calls at once (the worker's slots, as aiohttp's connector `limit`).
- Responses framed by `Content-Length`, by `Transfer-Encoding: chunked`, or by the end of the
  connection are read; `Connection: close` (or HTTP/1.0 without keep-alive) ends the
  connection after the answer. At most `max_body` bytes of a body are kept: past that the
  connection is closed, as the dispatcher needs only the status. Redirects are answers.
- Only `http`: `handles(target)` says whether a target can go this way; an `https` one goes
  through aiohttp (`post` refuses it with `SchemeNotSupported`).
- A header value with CR, LF or NUL, or a header the client writes itself, is a ValueError
  before anything is sent (as aiohttp refuses CR/LF).
- Failures before a complete answer raise `ConnectionFailed` (refused, reset, closed early,
  a malformed answer); `status` is set when the status line had arrived, so the caller may
  judge by it as it does with aiohttp. The deadline raises TimeoutError.

Resending: a POST is sent at most once per `post`. A pooled connection is checked just
before it is reused, with a non-blocking peek at its socket: if the server closed it while it
was idle (end of stream, a reset, or bytes nobody asked for), it is dropped and another (or a
new one) is used, and nothing of the request had been written. Once any byte of the request
is written, a failure is final: an empty end of stream after the request is exactly what a
server that read the request, acted on it and then died looks like (the echo target's `reset`
script does it on purpose), so resending it could deliver the job twice. A close that races
the write itself (the peek passed, then the server's idle timer fired) is therefore reported
as a connection error, transient: the queue retries the job, as it would any other.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import re
import socket
import time
from collections.abc import Mapping
from typing import NamedTuple

from yarl import URL

from skiplock.queue_impl.ssrf import VettedTarget

# A body past this is not kept, and its connection is closed.
MAX_BODY = 1 << 20
# A response head (status line and headers) past this is malformed.
MAX_HEAD = 64 << 10
# An idle pooled connection older than this is closed rather than reused (aiohttp's
# keepalive_timeout is 15 s too).
KEEPALIVE_SECONDS = 15.0

# Headers the client writes itself: the caller may not set them (a second Content-Length or a
# Host naming another server is how requests are smuggled).
_OWN_HEADERS = frozenset({"host", "content-type", "content-length", "transfer-encoding",
                          "connection"})
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Header lines of a response head, each with its CRLF: all of them checked by one match, then
# split into (name, value) by one findall.
_HEADER_LINES = re.compile(rb"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[^\r\n]*\r\n)*")
_HEADER_FIELD = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):([^\r\n]*)\r\n")
# The only headers that frame the body or end the connection, found in checked lines.
_FRAMING_FIELD = re.compile(rb"\n(content-length|transfer-encoding|connection):([^\r\n]*)",
                            re.IGNORECASE)
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?:[ \t][^\r\n]*)?")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]+)[ \t]*(?:;[^\r\n]*)?")
# Header names already checked to be tokens (the dispatcher sends the same few every time).
_GOOD_NAMES: set[str] = set()


class SchemeNotSupported(Exception):
    """The target is not plain http: call it some other way (the dispatcher's aiohttp)."""


class ConnectionFailed(Exception):
    """No complete answer: the connection was refused, reset or closed early, or the answer
    was malformed. `status` is the answer's status when its head had arrived, else None."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class MalformedResponse(Exception):
    """Bytes that are not an HTTP/1.x response, or a response cut short."""


class Response(NamedTuple):
    status: int
    # At most `max_body` bytes of it; the transfer coding removed, the content coding not.
    body: bytes


# --------------------------------------------------------------------------------------------
# The response parser: pure, fed whatever bytes arrive, in any pieces.
# --------------------------------------------------------------------------------------------

_HEAD, _LENGTH, _CHUNK_SIZE_LINE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _TO_EOF, _DONE = range(8)


class ResponseParser:
    """One response, fed in pieces (`feed`, then `feed_eof` if the stream ends). `done` once
    the answer is complete; then `status`, `body()`, and `reusable` (whether the connection
    may carry another request: keep-alive, framed, nothing left over, nothing cut off).
    Raises MalformedResponse for what is not a response, or one the stream's end cut short."""

    def __init__(self, *, max_body: int = MAX_BODY, max_head: int = MAX_HEAD) -> None:
        self.max_body = max_body
        self.max_head = max_head
        self.status: int | None = None
        self._head = b""
        self.done = False
        self.reusable = False
        self.truncated = False
        self._keep_alive = True
        self._state = _HEAD
        self._buffer = bytearray()
        self._body = bytearray()
        self._left = 0  # bytes still due of the Content-Length body or the current chunk
        self._received = 0

    def body(self) -> bytes:
        return bytes(self._body)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The answer's header fields as received (names not folded, values stripped)."""
        return [(name, value.strip(b" \t")) for name, value in _HEADER_FIELD.findall(self._head)]

    def feed(self, data: bytes) -> None:
        self._received += len(data)
        if self._state == _DONE:
            self.reusable = False  # bytes nobody asked for: the stream is out of step
            return
        self._buffer += data
        self._advance()

    def feed_eof(self) -> None:
        """The server ended the stream: the answer is complete only when read to the end."""
        if self._state == _DONE:
            self.reusable = False
            return
        if self._state == _TO_EOF:
            self._finish(reusable=False)
            return
        if self._state == _HEAD and not self._received:
            raise MalformedResponse("connection closed before any answer")
        where = "head" if self._state == _HEAD else "body"
        raise MalformedResponse(f"connection closed in the middle of the response {where}")

    # -- states ------------------------------------------------------------------------------

    def _advance(self) -> None:
        while self._state != _DONE:
            before, size = self._state, len(self._buffer)
            if before == _HEAD:
                self._read_head()
            elif before == _LENGTH:
                self._read_length()
            elif before == _CHUNK_SIZE_LINE:
                self._read_chunk_size()
            elif before == _CHUNK_DATA:
                self._read_chunk_data()
            elif before == _CHUNK_END:
                self._read_chunk_end()
            elif before == _TRAILERS:
                self._read_trailers()
            else:  # _TO_EOF
                self._keep(self._buffer)
                self._buffer.clear()
            if self._state == before and len(self._buffer) == size:
                return  # waiting for more bytes

    def _read_head(self) -> None:
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buffer) > self.max_head:
                raise MalformedResponse(f"response head longer than {self.max_head} bytes")
            # Not HTTP at all is known from the first bytes: say so now, not at the timeout.
            first = self._buffer.find(b"\r\n")
            if not b"HTTP/".startswith(self._buffer[:5]) or (
                    first >= 0 and not _STATUS_LINE.fullmatch(self._buffer, 0, first)):
                line = bytes(self._buffer[: first if first >= 0 else 80])
                raise MalformedResponse(f"not an HTTP/1.x status line: {line[:80]!r}")
            return
        head = bytes(self._buffer[: end + 2])  # each line with its CRLF
        del self._buffer[: end + 4]
        first = head.index(b"\r\n")
        match = _STATUS_LINE.fullmatch(head, 0, first)
        if match is None:
            raise MalformedResponse(f"not an HTTP/1.x status line: {head[:min(first, 80)]!r}")
        if not _HEADER_LINES.fullmatch(head, first + 2):
            # Also a folded line (starting with a space), which RFC 9112 lets a client refuse.
            bad = next(line for line in head[first + 2:].split(b"\r\n")
                       if not _HEADER_LINES.fullmatch(line + b"\r\n"))
            raise MalformedResponse(f"bad header line {bad[:80]!r}")
        status = int(match.group(2))
        if 100 <= status < 200:
            if status == 101:
                raise MalformedResponse("101 Switching Protocols, but no upgrade was asked for")
            return  # an interim answer: the real one follows
        self.status = status
        self._head = head[first + 2:]
        self._frame(_FRAMING_FIELD.findall(head, first), http10=match.group(1) == b"0")

    def _frame(self, fields: list[tuple[bytes, bytes]], *, http10: bool) -> None:
        """Pick how the body is delimited, from the status and the framing `fields`."""
        by_name: dict[bytes, list[bytes]] = {}
        for name, value in fields:
            by_name.setdefault(name.lower(), []).append(value)
        connection = _tokens(by_name.get(b"connection"))
        self._keep_alive = (b"keep-alive" in connection) if http10 else (b"close" not in connection)
        raw_lengths = by_name.get(b"content-length")
        lengths = {v.strip() for r in raw_lengths for v in r.split(b",")} if raw_lengths else set()
        codings = [v for v in _tokens(by_name.get(b"transfer-encoding")) if v]
        assert self.status is not None
        if self.status in (204, 304):
            self._finish(reusable=True)
        elif codings:
            if codings[-1] != b"chunked":
                self._state = _TO_EOF  # an encoding only the end of the stream delimits
            else:
                # Content-Length beside chunked is ignored, but such a server is not trusted
                # with a second request (RFC 9112 6.3).
                self._keep_alive = self._keep_alive and not lengths
                self._state = _CHUNK_SIZE_LINE
        elif lengths:
            if len(lengths) != 1 or not next(iter(lengths)).isdigit():
                raise MalformedResponse(f"bad Content-Length {sorted(lengths)!r}")
            self._left = int(next(iter(lengths)))
            if self._left == 0:
                self._finish(reusable=True)
            else:
                self._state = _LENGTH
        else:
            self._state = _TO_EOF

    def _read_length(self) -> None:
        piece = self._take(self._left)
        self._left -= len(piece)
        if not self._keep(piece):
            return
        if self._left == 0:
            self._finish(reusable=True)

    def _read_chunk_size(self) -> None:
        line = self._line()
        if line is None:
            return
        match = _CHUNK_SIZE.fullmatch(line)
        if match is None:
            raise MalformedResponse(f"bad chunk size line {line[:80]!r}")
        self._left = int(match.group(1), 16)
        self._state = _CHUNK_DATA if self._left else _TRAILERS

    def _read_chunk_data(self) -> None:
        piece = self._take(self._left)
        self._left -= len(piece)
        if self._keep(piece) and self._left == 0:
            self._state = _CHUNK_END

    def _read_chunk_end(self) -> None:
        line = self._line()
        if line is None:
            return
        if line:
            raise MalformedResponse("chunk data longer than its size")
        self._state = _CHUNK_SIZE_LINE

    def _read_trailers(self) -> None:
        while (line := self._line()) is not None:
            if not line:
                self._finish(reusable=True)
                return
            if not _HEADER_LINES.fullmatch(line + b"\r\n"):
                raise MalformedResponse(f"bad trailer line {line[:80]!r}")

    # -- pieces ------------------------------------------------------------------------------

    def _line(self) -> bytes | None:
        """One CRLF-ended line off the buffer (without its CRLF), or None until it is whole."""
        end = self._buffer.find(b"\r\n")
        if end < 0:
            if len(self._buffer) > self.max_head:
                raise MalformedResponse(f"a line longer than {self.max_head} bytes")
            return None
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 2]
        return line

    def _take(self, count: int) -> bytes:
        piece = bytes(self._buffer[:count])
        del self._buffer[:count]
        return piece

    def _keep(self, piece: bytes | bytearray) -> bool:
        """Keep a piece of the body; past `max_body`, stop: the answer is done, cut off, and
        its connection cannot be reused. Returns whether reading goes on."""
        room = self.max_body - len(self._body)
        if len(piece) > room:
            self._body += piece[:room]
            self.truncated = True
            self._finish(reusable=False)
            return False
        self._body += piece
        return True

    def _finish(self, *, reusable: bool) -> None:
        self._state = _DONE
        self.done = True
        self.reusable = reusable and self._keep_alive and not self._buffer


def _tokens(values: list[bytes] | None) -> list[bytes]:
    """The comma-separated tokens of a header's values, lower-case, in order."""
    if not values:
        return []
    return [v.strip().lower() for value in values for v in value.split(b",")]


# --------------------------------------------------------------------------------------------
# The request.
# --------------------------------------------------------------------------------------------


# A worker calls the same few URLs over and over: parse each once.
@functools.lru_cache(maxsize=4096)
def request_target(url: str) -> str:
    """The path and query of `url` as sent on the request line (`/` for none; no fragment)."""
    return URL(url).raw_path_qs or "/"


def build_request(
    target: VettedTarget, path_and_query: str, headers: Mapping[str, str], body: bytes
) -> bytes:
    """The bytes of one POST. ValueError, before anything is sent, for a header name that is
    not a token, a value with CR, LF or NUL, a header the client writes itself, or a path
    that is not one."""
    if not path_and_query.startswith("/") or any(c in path_and_query for c in " \t\r\n\x00"):
        raise ValueError(f"request target {path_and_query[:80]!r} is not a path and query")
    host = f"[{target.host}]" if ":" in target.host else target.host
    if target.port != 80:
        host = f"{host}:{target.port}"
    lines = [f"POST {path_and_query} HTTP/1.1\r\nHost: {host}\r\n"
             f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"]
    for name, value in headers.items():
        if name not in _GOOD_NAMES:
            if not _TOKEN.fullmatch(name) or name.lower() in _OWN_HEADERS:
                raise ValueError(
                    f"header {name!r} cannot be sent (not a token, or set by the client)")
            if len(_GOOD_NAMES) < 256:
                _GOOD_NAMES.add(name)
        if "\r" in value or "\n" in value or "\x00" in value:
            raise ValueError(f"header {name} has a carriage return, newline or NUL in its value")
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("utf-8") + body


# --------------------------------------------------------------------------------------------
# Connections and the client.
# --------------------------------------------------------------------------------------------

PoolKey = tuple[str, int, str]  # (address, port, host)


class _Connection(asyncio.Protocol):
    """One TCP connection carrying one request at a time."""

    def __init__(self, sock: socket.socket, max_body: int) -> None:
        self.sock = sock
        self.max_body = max_body
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser: ResponseParser | None = None
        self._waiter: asyncio.Future[Response] | None = None

    # -- asyncio callbacks ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None or self._waiter is None or self._waiter.done():
            self.close()  # bytes while idle: whatever they are, the stream is out of step
            return
        try:
            parser.feed(data)
        except MalformedResponse as exc:
            self._fail(str(exc))
            return
        if parser.done:
            self._answered(parser)

    def eof_received(self) -> bool:
        parser = self._parser
        if parser is not None and self._waiter is not None and not self._waiter.done():
            try:
                parser.feed_eof()
            except MalformedResponse as exc:
                self._fail(str(exc))
            else:
                self._answered(parser)
        self.closed = True
        return False  # let the transport close

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            why = f"connection lost ({exc})" if exc else "connection closed"
            self._fail(why)

    # -- the caller's side -------------------------------------------------------------------

    def fit_for_reuse(self, now: float) -> bool:
        """Whether this idle connection can carry a request: open, not idle too long, and,
        by a non-blocking peek at its socket, with no end of stream, reset or stray bytes
        waiting (the server closing it while idle, before the event loop noticed)."""
        if self.closed or self.transport is None or self.transport.is_closing():
            return False
        if now - self.idle_since > KEEPALIVE_SECONDS:
            return False
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False  # b"": the server closed it; bytes: nobody asked for them

    async def exchange(self, request: bytes, deadline: float | None) -> tuple[Response, bool]:
        """Send one request and wait for its whole answer until `deadline` (on the loop's
        clock; then TimeoutError and the connection is closed; None: no deadline of its own);
        (answer, reusable)."""
        assert self.transport is not None
        if self.closed or self.transport.is_closing():
            # A new connection the server spoke on, or closed, before the request went out.
            raise ConnectionFailed("connection closed before the request was sent")
        loop = asyncio.get_running_loop()
        self._parser = parser = ResponseParser(max_body=self.max_body)
        self._waiter = waiter = loop.create_future()
        # One timer on the waiter: cheaper than a timeout context around the await.
        timer = None if deadline is None else loop.call_at(deadline, self._time_out)
        try:
            self.transport.write(request)
            response = await waiter
        finally:
            if timer is not None:
                timer.cancel()
        return response, parser.reusable and not self.closed

    def _time_out(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(TimeoutError())
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _answered(self, parser: ResponseParser) -> None:
        assert self._waiter is not None and parser.status is not None
        if not parser.reusable:
            # Cut off, or the server ends it: stop reading now.
            self.closed = True
            assert self.transport is not None
            self.transport.close()
        self._waiter.set_result(Response(parser.status, parser.body()))

    def _fail(self, message: str) -> None:
        assert self._waiter is not None
        status = self._parser.status if self._parser is not None else None
        self.close()
        if not self._waiter.done():
            self._waiter.set_exception(ConnectionFailed(message, status=status))


class Http11Client:
    """One worker's client: a keep-alive pool keyed by (address, port, host), at most `limit`
    calls at once, and at most `limit` idle connections kept. Use as an async context manager
    (or call `close`)."""

    def __init__(self, limit: int, *, max_body: int = MAX_BODY) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1 (got {limit})")
        self.limit = limit
        self.max_body = max_body
        self._slots = asyncio.Semaphore(limit)
        self._idle: dict[PoolKey, list[_Connection]] = {}
        self._idle_count = 0
        # Counters, for tests and benchmarks.
        self.connections_opened = 0
        self.stale_dropped = 0

    async def __aenter__(self) -> Http11Client:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    @staticmethod
    def handles(target: VettedTarget) -> bool:
        """Whether `post` can call this target (plain http); else use aiohttp."""
        return target.scheme == "http"

    async def post(
        self,
        target: VettedTarget,
        path_and_query: str,
        headers: Mapping[str, str],
        body: bytes,
        timeout: float | None,
    ) -> Response:
        """POST `body` (JSON) to the vetted address, with `Host:` the URL's host, and return
        the answer, within `timeout` seconds (connecting and waiting for a slot included;
        None: no deadline of its own, for a caller that already runs under one, such as the
        dispatcher's timeout around vetting and calling). Raises SchemeNotSupported,
        ValueError (a header or path that cannot be sent; nothing was), ConnectionFailed, or
        TimeoutError. Cancelled, it closes the connection it was using."""
        if not self.handles(target):
            raise SchemeNotSupported(f"{target.scheme} is not plain http")
        request = build_request(target, path_and_query, headers, body)
        key: PoolKey = (target.address, target.port, target.host)
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        if self._slots.locked():
            async with asyncio.timeout_at(deadline):
                await self._slots.acquire()
        else:
            await self._slots.acquire()  # free: returns at once
        try:
            connection = self._reuse(key)
            if connection is None:
                async with asyncio.timeout_at(deadline):
                    connection = await self._connect(target)
            try:
                response, reusable = await connection.exchange(request, deadline)
            except BaseException:
                connection.close()  # timed out, failed or cancelled: never reused
                raise
        finally:
            self._slots.release()
        if reusable:
            self._put_back(key, connection)
        else:
            connection.close()
        return response

    def close(self) -> None:
        """Close every idle connection (calls in flight close theirs as they end)."""
        idle, self._idle, self._idle_count = self._idle, {}, 0
        for connections in idle.values():
            for connection in connections:
                connection.close()

    def _reuse(self, key: PoolKey) -> _Connection | None:
        """The most recently used idle connection to `key` that is fit for reuse (the rest
        found on the way are closed), or None."""
        connections = self._idle.get(key)
        now = time.monotonic()
        while connections:
            connection = connections.pop()
            self._idle_count -= 1
            if connection.fit_for_reuse(now):
                return connection
            self.stale_dropped += 1
            connection.close()
        return None

    def _put_back(self, key: PoolKey, connection: _Connection) -> None:
        connection.idle_since = time.monotonic()
        if self._idle_count >= self.limit:
            self._drop_oldest_idle()
        self._idle.setdefault(key, []).append(connection)
        self._idle_count += 1

    def _drop_oldest_idle(self) -> None:
        oldest = min((c[0].idle_since, k) for k, c in self._idle.items() if c)
        connections = self._idle[oldest[1]]
        connections.pop(0).close()
        self._idle_count -= 1

    async def _connect(self, target: VettedTarget) -> _Connection:
        """A new connection to the guard's address and nowhere else: the address must be an
        IP literal (ValueError otherwise), so no name is ever resolved here."""
        address = ipaddress.ip_address(target.address)
        family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
        loop = asyncio.get_running_loop()
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, (str(address), target.port))
            except OSError as exc:
                raise ConnectionFailed(
                    f"cannot connect to {target.host} ({address}) port {target.port}: "
                    f"{exc.strerror or type(exc).__name__}"
                ) from None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _, connection = await loop.create_connection(
                lambda: _Connection(sock, self.max_body), sock=sock)
        except BaseException:
            sock.close()
            raise
        self.connections_opened += 1
        return connection


__all__ = [
    "KEEPALIVE_SECONDS",
    "MAX_BODY",
    "ConnectionFailed",
    "Http11Client",
    "MalformedResponse",
    "Response",
    "ResponseParser",
    "SchemeNotSupported",
    "build_request",
    "request_target",
]
