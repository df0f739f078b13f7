"""The lean HTTP/1.1 client over real loopback sockets: against the echo target in its own
process, and against small servers written here that misbehave on purpose (close in the
middle of an answer, never answer, answer in chunks, close the connection after answering,
close a pooled connection while it is idle, or after reading a request). Those servers run on
their own threads with blocking sockets, apart from the client's event loop, so a test can
stall the loop while the server acts, as a busy worker would."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from skiplock.chaos.target import TargetProcess
from skiplock.queue_impl import http11
from skiplock.queue_impl.http11 import ConnectionFailed, Http11Client, Response, request_target
from skiplock.queue_impl.interface import (
    ACCOUNT_HEADER,
    ATTEMPT_HEADER,
    JOB_ID_HEADER,
    LEASE_HEADER,
    WORKER_HEADER,
)
from skiplock.queue_impl.ssrf import UrlGuard, VettedTarget
from skiplock.reports.history import DELIVERY_LOG, Behaviour, JobScript, Step, read_log
from skiplock.scenarios.cli.main import main as cli_main

pytestmark = pytest.mark.integration

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class Server:
    """A loopback server whose every connection runs `serve(server, sock)` on its own thread.
    It records each request it read, in order, and how many connections were open at once."""

    def __init__(self, serve: Callable[[Server, socket.socket], None]) -> None:
        self.serve = serve
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.port = self.listener.getsockname()[1]
        self.requests: list[bytes] = []
        self.connections = 0
        self.open = 0
        self.max_open = 0
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._accepter = threading.Thread(target=self._accept, daemon=True)

    def target(self, host: str = "127.0.0.1") -> VettedTarget:
        return VettedTarget(url=f"http://{host}:{self.port}/deliver", scheme="http", host=host,
                            port=self.port, address="127.0.0.1", allowed_by_list=True)

    def __enter__(self) -> Server:
        self._accepter.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stopping.set()
        self._accepter.join()
        for thread in self._threads:
            thread.join(5.0)
        self.listener.close()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            with self._lock:
                self.connections += 1
                self.open += 1
                self.max_open = max(self.max_open, self.open)
            thread = threading.Thread(target=self._run, args=(sock,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _run(self, sock: socket.socket) -> None:
        try:
            with sock:
                sock.settimeout(10.0)
                self.serve(self, sock)
        except OSError:
            pass
        finally:
            with self._lock:
                self.open -= 1

    def read_request(self, sock: socket.socket) -> bytes | None:
        """One whole request off `sock` (head and Content-Length body), recorded; None when
        the client closed the connection first."""
        data = b""
        while b"\r\n\r\n" not in data:
            piece = sock.recv(65536)
            if not piece:
                return None
            data += piece
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            piece = sock.recv(65536)
            if not piece:
                return None
            body += piece
        with self._lock:
            self.requests.append(head + b"\r\n\r\n" + body)
        return head


def answer_each(response: bytes) -> Callable[[Server, socket.socket], None]:
    """Answer every request on the connection with `response`."""
    def serve(server: Server, sock: socket.socket) -> None:
        while server.read_request(sock) is not None:
            sock.sendall(response)
    return serve


def reset(sock: socket.socket) -> None:
    """Close with a TCP RST instead of a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def post(target: VettedTarget, client: Http11Client, *, timeout: float | None = 5.0,
         headers: dict[str, str] | None = None) -> Any:
    return client.post(target, "/deliver", headers or {"X-Job": "1"}, b'{"job":1}', timeout)


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


# -- a well-behaved server ------------------------------------------------------------------


def test_sequential_calls_share_one_connection_and_send_what_they_should() -> None:
    with Server(answer_each(OK)) as server:
        async def go() -> list[Response]:
            async with Http11Client(4) as client:
                answers = [await post(server.target("jobs.example"), client) for _ in range(5)]
                assert client.connections_opened == 1
                return answers

        answers = run(go())
    assert answers == [Response(200, b"ok")] * 5
    assert server.connections == 1 and len(server.requests) == 5
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    # The name is the Host header; the connection went to the pinned address all the same.
    assert lines[0] == b"POST /deliver HTTP/1.1"
    assert f"Host: jobs.example:{server.port}".encode() in lines
    assert b"Content-Length: 9" in lines and b"X-Job: 1" in lines
    assert body == b'{"job":1}'


def test_calls_in_flight_never_exceed_the_limit() -> None:
    def slow(server: Server, sock: socket.socket) -> None:
        while server.read_request(sock) is not None:
            time.sleep(0.1)
            sock.sendall(OK)

    with Server(slow) as server:
        async def go() -> list[Response]:
            async with Http11Client(2) as client:
                return await asyncio.gather(*(post(server.target(), client) for _ in range(6)))

        answers = run(go())
    assert [a.status for a in answers] == [200] * 6
    assert server.max_open == 2 and server.connections == 2


def test_a_chunked_answer_sent_in_pieces_is_read_whole() -> None:
    def chunked(server: Server, sock: socket.socket) -> None:
        while server.read_request(sock) is not None:
            for piece in (b"HTTP/1.1 201 Created\r\nTransfer-", b"Encoding: chunked\r\n\r\n5\r",
                          b"\nhello\r\n", b"6\r\n world\r\n0\r\n", b"\r\n"):
                sock.sendall(piece)
                time.sleep(0.02)

    with Server(chunked) as server:
        async def go() -> tuple[Response, Response, int]:
            async with Http11Client(1) as client:
                first = await post(server.target(), client)
                second = await post(server.target(), client)
                return first, second, client.connections_opened

        first, second, opened = run(go())
    assert first == second == Response(201, b"hello world")
    assert opened == 1  # chunked answers keep the connection


def test_connection_close_is_honoured_and_the_next_call_connects_again() -> None:
    def close_after(server: Server, sock: socket.socket) -> None:
        if server.read_request(sock) is not None:
            sock.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")

    with Server(close_after) as server:
        async def go() -> int:
            async with Http11Client(1) as client:
                for _ in range(3):
                    assert await post(server.target(), client) == Response(200, b"ok")
                return client.connections_opened

        assert run(go()) == 3
    assert server.connections == 3 and len(server.requests) == 3


def test_an_answer_without_length_is_read_until_the_server_closes() -> None:
    def to_eof(server: Server, sock: socket.socket) -> None:
        if server.read_request(sock) is not None:
            sock.sendall(b"HTTP/1.1 200 OK\r\n\r\npart one, ")
            time.sleep(0.05)
            sock.sendall(b"part two")

    with Server(to_eof) as server:
        assert run(post(server.target(), Http11Client(1))) == Response(200, b"part one, part two")


def test_a_body_past_the_cap_is_cut_and_its_connection_closed() -> None:
    big = b"HTTP/1.1 200 OK\r\nContent-Length: 300000\r\n\r\n" + b"x" * 300000
    with Server(answer_each(big)) as server:
        async def go() -> tuple[Response, Response, int]:
            async with Http11Client(1, max_body=1000) as client:
                first = await post(server.target(), client)
                second = await post(server.target(), client)
                return first, second, client.connections_opened

        first, second, opened = run(go())
    assert first == second == Response(200, b"x" * 1000)
    assert opened == 2


# -- servers that fail ------------------------------------------------------------------------


def test_connection_refused_is_a_connection_failure() -> None:
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        port = placeholder.getsockname()[1]
    closed = VettedTarget(url=f"http://127.0.0.1:{port}/", scheme="http", host="127.0.0.1",
                          port=port, address="127.0.0.1", allowed_by_list=True)
    with pytest.raises(ConnectionFailed, match="cannot connect") as failed:
        run(post(closed, Http11Client(1)))
    assert failed.value.status is None


def test_a_close_in_the_middle_of_the_body_keeps_the_status_it_saw() -> None:
    def cut(server: Server, sock: socket.socket) -> None:
        if server.read_request(sock) is not None:
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly some")

    with Server(cut) as server, pytest.raises(ConnectionFailed, match="body") as failed:
        run(post(server.target(), Http11Client(1)))
    assert failed.value.status == 200


@pytest.mark.parametrize("close", [socket.socket.close, reset], ids=["fin", "rst"])
def test_a_close_before_any_answer_is_a_connection_failure(
        close: Callable[[socket.socket], None]) -> None:
    def drop(server: Server, sock: socket.socket) -> None:
        if server.read_request(sock) is not None:
            close(sock)

    with Server(drop) as server, pytest.raises(ConnectionFailed) as failed:
        run(post(server.target(), Http11Client(1)))
    assert failed.value.status is None
    assert len(server.requests) == 1


def test_a_server_that_speaks_first_is_a_connection_failure_not_a_hang() -> None:
    def banner(server: Server, sock: socket.socket) -> None:
        sock.sendall(b"220 mail.example ESMTP\r\n")
        server.stopping.wait()

    with Server(banner) as server:
        async def go() -> None:
            async with Http11Client(1) as client:
                await asyncio.sleep(0)
                await client.post(server.target(), "/deliver", {}, b"{}", 2.0)

        started = time.monotonic()
        with pytest.raises(ConnectionFailed):
            run(go())
        assert time.monotonic() - started < 1.5


def test_a_malformed_answer_is_a_connection_failure() -> None:
    with Server(answer_each(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")) as server, \
            pytest.raises(ConnectionFailed, match="status line"):
        run(post(server.target(), Http11Client(1)))


@pytest.mark.parametrize("own_deadline", [True, False], ids=["own-timeout", "callers-timeout"])
def test_a_server_that_never_answers_times_out_and_its_connection_is_not_reused(
        own_deadline: bool) -> None:
    """With its own timeout, or with none under the caller's (as the dispatcher's deadline
    covers vetting and calling): either way the call ends on time and its connection, which
    may still get the late answer, is closed."""
    def first_hangs(server: Server, sock: socket.socket) -> None:
        hung = len(server.requests) == 0
        while server.read_request(sock) is not None:
            if hung:
                server.stopping.wait()
                return
            sock.sendall(OK)

    with Server(first_hangs) as server:
        async def go() -> tuple[float, Response, int]:
            async with Http11Client(1) as client:
                started = time.monotonic()
                with pytest.raises(TimeoutError):
                    if own_deadline:
                        await post(server.target(), client, timeout=0.3)
                    else:
                        async with asyncio.timeout(0.3):
                            await post(server.target(), client, timeout=None)
                took = time.monotonic() - started
                return took, await post(server.target(), client), client.connections_opened

        took, answer, opened = run(go())
    assert 0.3 <= took < 2.0
    assert answer == Response(200, b"ok") and opened == 2


# -- a pooled connection the server closed ------------------------------------------------------


@pytest.mark.parametrize("close", [socket.socket.close, reset], ids=["fin", "rst"])
@pytest.mark.parametrize("loop_busy", [False, True], ids=["loop-idle", "loop-busy"])
def test_a_pooled_connection_closed_while_idle_is_replaced_before_anything_is_sent(
        close: Callable[[socket.socket], None], loop_busy: bool) -> None:
    """The server answers, then closes the idle connection. With the loop idle, the client's
    loop sees the close as it happens; with the loop busy (blocked), it has not, and the
    check before reuse must find it. Either way the second call goes out once, on a new
    connection, and succeeds."""
    def answer_then_close(server: Server, sock: socket.socket) -> None:
        if server.read_request(sock) is not None:
            sock.sendall(OK)
            time.sleep(0.05)
            close(sock)

    with Server(answer_then_close) as server:
        async def go() -> tuple[Response, int, int]:
            async with Http11Client(1) as client:
                await post(server.target(), client)
                if loop_busy:
                    time.sleep(0.3)  # the loop cannot run: nothing has told the client
                else:
                    await asyncio.sleep(0.3)
                answer = await post(server.target(), client)
                return answer, client.connections_opened, client.stale_dropped

        answer, opened, dropped = run(go())
    assert answer == Response(200, b"ok")
    assert (opened, dropped) == (2, 1)
    assert len(server.requests) == 2 and server.connections == 2


def test_a_request_a_pooled_connection_carried_is_never_sent_twice() -> None:
    """The server reads the second request on a reused connection, then closes without an
    answer: exactly what a server that acted on it and then died looks like. The client
    reports a connection failure and does not send the request again."""
    def answer_once_then_drop(server: Server, sock: socket.socket) -> None:
        if server.read_request(sock) is not None:
            sock.sendall(OK)
        if server.read_request(sock) is not None:
            sock.close()

    with Server(answer_once_then_drop) as server:
        async def go() -> int:
            async with Http11Client(1) as client:
                await post(server.target(), client)
                with pytest.raises(ConnectionFailed):
                    await post(server.target(), client)
                await asyncio.sleep(0.2)
                return client.connections_opened

        assert run(go()) == 1
    assert len(server.requests) == 2 and server.connections == 1


def test_an_idle_connection_past_its_keepalive_is_not_reused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http11, "KEEPALIVE_SECONDS", 0.1)
    with Server(answer_each(OK)) as server:
        async def go() -> tuple[int, int]:
            async with Http11Client(1) as client:
                await post(server.target(), client)
                await post(server.target(), client)  # soon after: the same connection
                await asyncio.sleep(0.3)
                await post(server.target(), client)
                return client.connections_opened, client.stale_dropped

        assert run(go()) == (2, 1)
    assert len(server.requests) == 3


def test_stray_bytes_on_an_idle_connection_retire_it() -> None:
    def answer_then_babble(server: Server, sock: socket.socket) -> None:
        if server.read_request(sock) is not None:
            sock.sendall(OK + b"HTTP/1.1 408 Request Timeout\r\n\r\n")
        while server.read_request(sock) is not None:
            sock.sendall(OK)

    with Server(answer_then_babble) as server:
        async def go() -> int:
            async with Http11Client(1) as client:
                for _ in range(2):
                    assert await post(server.target(), client) == Response(200, b"ok")
                return client.connections_opened

        assert run(go()) == 2
    assert len(server.requests) == 2


def test_a_header_carrying_crlf_sends_nothing() -> None:
    with Server(answer_each(OK)) as server:
        with pytest.raises(ValueError):
            run(post(server.target(), Http11Client(1),
                     headers={"X-Account": "a\r\nX-Injected: yes"}))
        time.sleep(0.1)
    assert server.connections == 0 and server.requests == []


# -- the echo target --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def echo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TargetProcess]:
    with TargetProcess(tmp_path_factory.mktemp("http11-target"), hang_cap_seconds=2.0,
                       grace_seconds=1.0) as process:
        yield process


def job(script: JobScript) -> tuple[dict[str, str], bytes]:
    job_id = str(uuid.uuid4())
    headers = {JOB_ID_HEADER: job_id, ATTEMPT_HEADER: "1", ACCOUNT_HEADER: "acct-é",
               WORKER_HEADER: "w-1", LEASE_HEADER: str(uuid.uuid4())}
    return headers, json.dumps({"script": script.to_json()}).encode()


def test_the_echo_target_answers_each_script_through_the_lean_client(
        echo: TargetProcess) -> None:
    scripts = {
        "ok": (JobScript(name="ok", first=Step(behaviour=Behaviour.OK)), 200),
        "503": (JobScript(name="503", first=Step(behaviour=Behaviour.STATUS, status=503)), 503),
        "400": (JobScript(name="400", first=Step(behaviour=Behaviour.STATUS, status=400)), 400),
    }
    sent: dict[str, dict[str, str]] = {}

    async def go() -> tuple[dict[str, int], int]:
        vetted = await UrlGuard([f"{echo.host}:{echo.port}"]).vet(echo.deliver_url)
        statuses = {}
        async with Http11Client(2) as client:
            for name, (script, _) in scripts.items():
                headers, body = job(script)
                sent[name] = headers
                answer = await client.post(vetted, request_target(echo.deliver_url), headers,
                                           body, 5.0)
                statuses[name] = answer.status
            return statuses, client.connections_opened

    statuses, opened = run(go())
    assert statuses == {name: status for name, (_, status) in scripts.items()}
    assert opened == 1
    deliveries = read_log(echo.deliveries_path, DELIVERY_LOG)
    by_job = {d["job_id"]: d for d in deliveries}
    for name, headers in sent.items():
        delivery = by_job[headers[JOB_ID_HEADER]]
        assert (delivery["status"], delivery["account"], delivery["lease"]) == (
            scripts[name][1], "acct-é", headers[LEASE_HEADER])


@pytest.mark.parametrize(("behaviour", "error"), [
    (Behaviour.RESET, ConnectionFailed),
    (Behaviour.HANG_FOREVER, TimeoutError),
], ids=["reset", "hang"])
def test_the_echo_targets_faults_are_a_failure_and_one_delivery(
        echo: TargetProcess, behaviour: Behaviour, error: type[Exception]) -> None:
    headers, body = job(JobScript(name="fault", first=Step(behaviour=behaviour)))

    async def go() -> None:
        vetted = await UrlGuard([f"{echo.host}:{echo.port}"]).vet(echo.deliver_url)
        async with Http11Client(1) as client:
            # A warm connection first, so the faulty call goes out on a reused one.
            await client.post(vetted, "/deliver", *job(JobScript(
                name="ok", first=Step(behaviour=Behaviour.OK))), 5.0)
            with pytest.raises(error):
                await client.post(vetted, "/deliver", headers, body, 0.5)

    run(go())
    deadline = time.monotonic() + 5.0
    while True:
        seen = [d for d in read_log(echo.deliveries_path, DELIVERY_LOG)
                if d["job_id"] == headers[JOB_ID_HEADER]]
        if seen or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(seen) == 1  # delivered once: a failed call is never sent again


# -- the benchmark ----------------------------------------------------------------------------


def test_bench_http_times_both_clients_and_leaves_nothing_running(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "http.json"
    code = cli_main(["bench", "http", "--requests", "60", "--concurrency", "3", "--rounds", "2",
                     "--warmup", "5", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "aiohttp:" in printed and "lean:" in printed and "lean / aiohttp" in printed
    results = json.loads(out.read_text())["results"]
    for name in ("aiohttp", "lean"):
        client = results[name]
        assert (client["requests"], client["errors"]) == (60, 0)
        assert [r["requests"] for r in client["rounds"]] == [30, 30]
        assert client["cpu_us_per_request"] > 0
    assert results["cpu_ratio_lean_to_aiohttp"] > 0
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]


def test_bench_dispatcher_delivers_every_job_and_prints_its_cpu_per_job(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dispatcher.json"
    code = cli_main(["bench", "dispatcher", "--jobs", "120", "--batch", "8", "--rounds", "2",
                     "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "round 2:" in printed and "event loop CPU per job: median" in printed
    results = json.loads(out.read_text())["results"]
    assert [(r["jobs"], r["delivered"]) for r in results["rounds"]] == [(120, 120)] * 2
    assert all(r["loop_cpu_us_per_job"] > 0 for r in results["rounds"])
    assert results["loop_cpu_us_per_job_median"] > 0
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]
