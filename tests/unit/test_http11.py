"""The lean HTTP/1.1 client's pure parts: the response parser fed whole answers and the same
answers in every split, the request it writes, and what it refuses before any socket."""

from __future__ import annotations

import asyncio

import pytest

from skiplock.queue_impl.http11 import (
    ConnectionFailed,
    Http11Client,
    MalformedResponse,
    ResponseParser,
    SchemeNotSupported,
    build_request,
    request_target,
)
from skiplock.queue_impl.ssrf import VettedTarget

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
LENGTH = HEAD + b"Content-Length: 10\r\nServer: test\r\n\r\n" + b'{"seen":1}'
CHUNKED = (HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
           b"4;name=value\r\n{\"se\r\n6\r\nen\":1}\r\n0\r\nX-Trailer: yes\r\n\r\n")


def target(*, host: str = "127.0.0.1", port: int = 8080, scheme: str = "http",
           address: str = "127.0.0.1") -> VettedTarget:
    return VettedTarget(url=f"{scheme}://{host}:{port}/deliver", scheme=scheme, host=host,
                        port=port, address=address, allowed_by_list=True)


def parse(*pieces: bytes, eof: bool = False, max_body: int = 1 << 20) -> ResponseParser:
    parser = ResponseParser(max_body=max_body)
    for piece in pieces:
        parser.feed(piece)
    if eof:
        parser.feed_eof()
    return parser


def every_split(data: bytes) -> list[tuple[bytes, ...]]:
    """`data` whole, byte by byte, and cut in two at every offset."""
    splits: list[tuple[bytes, ...]] = [(data,), tuple(data[i:i + 1] for i in range(len(data)))]
    splits += [(data[:i], data[i:]) for i in range(1, len(data))]
    return splits


# -- framing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [LENGTH, CHUNKED], ids=["content-length", "chunked"])
def test_an_answer_parses_the_same_however_it_is_split(raw: bytes) -> None:
    for pieces in every_split(raw):
        parser = parse(*pieces)
        assert parser.done, pieces
        assert (parser.status, parser.body(), parser.reusable) == (200, b'{"seen":1}', True)


def test_an_answer_is_not_done_before_its_last_byte() -> None:
    for raw in (LENGTH, CHUNKED):
        parser = parse(raw[:-1])
        assert not parser.done
        parser.feed(raw[-1:])
        assert parser.done


def test_headers_are_kept_as_received() -> None:
    parser = parse(LENGTH)
    assert (b"Server", b"test") in parser.headers()
    assert parse(CHUNKED).headers()[-1] == (b"Transfer-Encoding", b"chunked")


@pytest.mark.parametrize(("raw", "reusable"), [
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", False),
    (b"HTTP/1.1 200 OK\r\nconnection: Keep-Alive, CLOSE\r\nContent-Length: 2\r\n\r\nok", False),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", False),
    (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok", True),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA", False),
    # Both framings: chunked wins, but such a server gets no second request.
    (b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"2\r\nok\r\n0\r\n\r\n", False),
], ids=["close", "close-among-tokens", "http10", "http10-keep-alive", "extra-bytes",
        "te-and-cl"])
def test_when_the_connection_may_carry_another_request(raw: bytes, reusable: bool) -> None:
    parser = parse(raw)
    assert parser.done and parser.body() == b"ok"
    assert parser.reusable is reusable


def test_bytes_after_a_complete_answer_make_it_not_reusable() -> None:
    parser = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    assert parser.reusable
    parser.feed(b"HTTP/1.1 408 Request Timeout\r\n")
    assert not parser.reusable


def test_an_answer_without_length_is_read_to_the_end_of_the_stream() -> None:
    parser = parse(b"HTTP/1.1 200 OK\r\n\r\nfirst ", b"second")
    assert not parser.done
    parser.feed_eof()
    assert parser.done and parser.body() == b"first second" and not parser.reusable


def test_a_transfer_coding_other_than_chunked_last_is_read_to_the_end() -> None:
    parser = parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\nzz", eof=True)
    assert parser.body() == b"zz" and not parser.reusable


@pytest.mark.parametrize("status", [204, 304])
def test_bodiless_statuses_end_at_their_head(status: int) -> None:
    parser = parse(f"HTTP/1.1 {status} X\r\nContent-Length: 10\r\n\r\n".encode())
    assert parser.done and parser.status == status and parser.body() == b"" and parser.reusable


def test_an_interim_answer_is_skipped() -> None:
    parser = parse(b"HTTP/1.1 100 Continue\r\n\r\n" + LENGTH)
    assert parser.status == 200 and parser.body() == b'{"seen":1}'


def test_status_line_without_a_reason_is_accepted() -> None:
    assert parse(b"HTTP/1.1 503\r\nContent-Length: 0\r\n\r\n").status == 503


# -- the body cap ----------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100,
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"20\r\n" + b"x" * 32 + b"\r\n",
    b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 100,
], ids=["content-length", "chunked", "to-eof"])
def test_a_body_past_the_cap_ends_the_answer_and_the_connection(raw: bytes) -> None:
    for pieces in every_split(raw):
        parser = parse(*pieces, max_body=16)
        assert parser.done, pieces
        assert parser.body() == b"x" * 16 and parser.truncated and not parser.reusable


def test_a_body_exactly_at_the_cap_is_whole() -> None:
    parser = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 16\r\n\r\n" + b"x" * 16, max_body=16)
    assert parser.done and not parser.truncated and parser.reusable


# -- what is refused ------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [
    b"HTTP/2 200 OK\r\n\r\n",
    b"ICY 200 OK\r\n\r\n",
    b"HTTP/1.1 20 OK\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n folded: line\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nNo Colon Here\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nName : space before colon\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nBad: bare\rCR\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokay\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nbad trailer\r\n\r\n",
    b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
], ids=["http2", "not-http", "short-status", "folded", "no-colon", "space-before-colon",
        "bare-cr", "two-lengths", "negative-length", "bad-chunk-size", "long-chunk",
        "bad-trailer", "upgrade"])
def test_malformed_answers_are_refused(raw: bytes) -> None:
    with pytest.raises(MalformedResponse):
        parse(raw)


@pytest.mark.parametrize("first", [b"2", b"220 mail.example ESMTP",
                                   b"HTTP/1.1 2000 OK\r\nContent-"])
def test_an_answer_that_is_not_http_is_refused_before_its_head_ends(first: bytes) -> None:
    with pytest.raises(MalformedResponse, match="status line"):
        parse(first)


def test_a_status_line_arriving_byte_by_byte_is_not_refused_early() -> None:
    assert parse(*(LENGTH[i:i + 1] for i in range(len(LENGTH)))).status == 200


def test_a_head_that_never_ends_is_refused() -> None:
    parser = ResponseParser(max_head=1024)
    with pytest.raises(MalformedResponse, match="longer than 1024"):
        parser.feed(b"HTTP/1.1 200 OK\r\n" + b"X-Filler: y\r\n" * 100)


def test_a_stream_that_ends_early_is_an_error_that_says_where() -> None:
    with pytest.raises(MalformedResponse, match="before any answer"):
        parse(eof=True)
    with pytest.raises(MalformedResponse, match="head"):
        parse(b"HTTP/1.1 200 OK\r\nContent-", eof=True)
    parser = parse(LENGTH[:-3])
    with pytest.raises(MalformedResponse, match="body"):
        parser.feed_eof()
    assert parser.status == 200  # the caller may still judge by it


# -- the request -----------------------------------------------------------------------------


def test_the_request_carries_host_type_length_and_the_headers() -> None:
    raw = build_request(target(host="jobs.example", port=8080), "/deliver?x=1",
                        {"X-Skiplock-Job-Id": "j-1"}, b'{"a":1}')
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /deliver?x=1 HTTP/1.1"
    assert set(lines[1:]) == {b"Host: jobs.example:8080", b"Content-Type: application/json",
                              b"Content-Length: 7", b"X-Skiplock-Job-Id: j-1"}
    assert body == b'{"a":1}'


def test_host_leaves_out_the_default_port_and_brackets_ipv6() -> None:
    assert b"\r\nHost: jobs.example\r\n" in build_request(target(host="jobs.example", port=80),
                                                         "/", {}, b"")
    assert b"\r\nHost: [2001:db8::1]:8080\r\n" in build_request(target(host="2001:db8::1"),
                                                               "/", {}, b"")


@pytest.mark.parametrize("headers", [
    {"X-Account": "a\r\nX-Injected: 1"},
    {"X-Account": "a\nb"},
    {"X-Account": "a\x00b"},
    {"Bad Name": "v"},
    {"X-Bad\r\nName": "v"},
    {"Content-Length": "0"},
    {"host": "elsewhere.example"},
    {"Transfer-Encoding": "chunked"},
], ids=["crlf", "lf", "nul", "space-in-name", "crlf-in-name", "content-length", "host",
        "transfer-encoding"])
def test_headers_that_cannot_be_sent_are_a_value_error(headers: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        build_request(target(), "/deliver", headers, b"{}")


@pytest.mark.parametrize("path", ["deliver", "/a b", "/a\r\nHost: x", ""])
def test_a_request_target_that_is_not_a_path_is_refused(path: str) -> None:
    with pytest.raises(ValueError):
        build_request(target(), path, {}, b"{}")


@pytest.mark.parametrize(("url", "expected"), [
    ("http://h:1/deliver", "/deliver"),
    ("http://h:1", "/"),
    ("http://h:1/a%20b?q=1&r=%0D#frag", "/a%20b?q=1&r=%0D"),
    ("http://h:1/a b", "/a%20b"),
])
def test_request_target_is_the_encoded_path_and_query(url: str, expected: str) -> None:
    assert request_target(url) == expected


# -- refused before any socket ---------------------------------------------------------------


def test_https_is_left_to_the_other_client() -> None:
    secure = target(scheme="https", port=443)
    assert not Http11Client.handles(secure) and Http11Client.handles(target())

    async def go() -> None:
        async with Http11Client(1) as client:
            await client.post(secure, "/", {}, b"{}", 1.0)

    with pytest.raises(SchemeNotSupported):
        asyncio.run(go())


def test_only_an_address_is_connected_to_never_a_name() -> None:
    """An address that is not an IP literal is refused before a socket exists, so a name can
    never be resolved (and rebound) here: the guard's pin is the only way out."""
    async def go() -> None:
        async with Http11Client(1) as client:
            await client.post(target(address="localhost"), "/", {}, b"{}", 1.0)

    with pytest.raises(ValueError, match="does not appear to be an IPv4 or IPv6 address"):
        asyncio.run(go())


def test_connection_failed_carries_the_status_when_known() -> None:
    assert ConnectionFailed("x").status is None
    assert ConnectionFailed("x", status=200).status == 200


def test_the_limit_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Http11Client(0)
