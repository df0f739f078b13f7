"""The SSRF guard against hostile URLs. No DNS here: names resolve through a fake table, and
the tests of the system resolver use inputs that fail before any query leaves the machine
(names the IDNA codec rejects, numeric addresses) or a stubbed `socket.getaddrinfo`."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence
from typing import Any

import pytest

from skiplock.queue_impl.ssrf import (
    AllowedTarget,
    PinnedResolver,
    ResolutionFailed,
    TargetRefused,
    UrlGuard,
    VettedTarget,
    parse_ipv4_loose,
    system_resolver,
)

DNS: dict[str, list[str]] = {
    "public.example": ["93.184.216.34"],
    "dual.example": ["93.184.216.34", "2606:2800:220:1::1"],
    "rebind.example": ["93.184.216.34", "10.0.0.5"],
    "sneaky6.example": ["2606:2800:220:1::1", "::ffff:169.254.169.254"],
    "metadata.example": ["169.254.169.254"],
    "localhost": ["127.0.0.1", "::1"],
    "localhost.": ["127.0.0.1", "::1"],
    "nothing.example": [],
}


async def fake_resolver(host: str, port: int) -> Sequence[str]:
    if host not in DNS:
        raise TargetRefused(f"cannot resolve {host!r}")
    return DNS[host]


def vet(url: str, allow: Sequence[str] = ()) -> VettedTarget:
    return asyncio.run(UrlGuard(allow, resolver=fake_resolver).vet(url))


HOSTILE = [
    # numeric spellings of 127.0.0.1
    ("http://2130706433/", "127.0.0.1"),
    ("http://0177.0.0.1/", "127.0.0.1"),
    ("http://0x7f.1/", "127.0.0.1"),
    ("http://0x7f000001/", "127.0.0.1"),
    ("http://127.1/", "127.0.0.1"),
    ("http://127.0.0.1/", "loopback"),
    ("http://127.255.0.9:8080/x", "loopback"),
    ("http://[::1]/", "loopback"),
    ("http://[::ffff:127.0.0.1]/", "loopback"),
    ("http://[::ffff:7f00:1]/", "loopback"),
    ("http://[::ffff:10.1.2.3]/", "private"),
    ("http://[2002:7f00:1::]/", "loopback"),  # 6to4 embedding 127.0.0.1
    ("http://[64:ff9b::a9fe:a9fe]/", "link-local"),  # NAT64 embedding 169.254.169.254
    ("http://169.254.169.254/latest/meta-data/", "link-local"),
    ("http://[fe80::1]/", "link-local"),
    ("http://10.0.0.1/", "private"),
    ("http://10.255.255.255/", "private"),
    ("http://172.16.0.1/", "private"),
    ("http://172.31.255.254/", "private"),
    ("http://192.168.1.1/", "private"),
    ("http://[fd00::1]/", "private"),
    ("http://[fec0::1]/", "site-local"),  # deprecated, but still routed inside some sites
    ("http://[feff:ffff::1]/", "site-local"),
    ("http://0.0.0.0/", "unspecified"),
    ("http://[::]/", "unspecified"),
    ("http://224.0.0.1/", "multicast"),
    ("http://239.255.255.250/", "multicast"),
    ("http://[ff02::1]/", "multicast"),
    ("http://100.64.0.1/", "carrier-grade NAT"),
    ("http://192.0.2.10/", "private"),  # documentation range
    ("http://198.18.0.1/", "private"),  # benchmarking range
    ("http://240.0.0.1/", "reserved"),
    ("http://255.255.255.255/", "reserved"),  # broadcast
    ("http://metadata.example/", "169.254.169.254"),
    ("http://rebind.example/", "10.0.0.5"),
    ("http://sneaky6.example/", "169.254.169.254"),
    ("http://localhost:8080/", "loopback"),
    ("ftp://public.example/", "scheme"),
    ("file:///etc/passwd", "scheme"),
    ("gopher://public.example:70/", "scheme"),
    ("javascript:alert(1)", "scheme"),
    ("//public.example/", "scheme"),
    ("http:///nohost", "no host"),
    ("http://public.example:99999/", "malformed"),
    ("http://nothing.example/", "no address"),
    ("http://unknown.example/", "cannot resolve"),
    ("http://08.0.0.1/", "not a valid numeric"),
    ("http://134744072/", "non-canonical"),  # 8.8.8.8, but in a spelling nobody needs
    # Parser confusion: the guard must see the host the HTTP client will connect to.
    ("http://public.example@127.0.0.1/", "loopback"),
    ("http://127.0.0.1\\@public.example/", "malformed"),
    ("http://\u2460\u2461\u2466.0.0.1/", "loopback"),  # circled digits normalise to 127
    ("http://127\u30020\u30020\u30021/", "loopback"),  # ideographic full stops
    ("http://localhost./", "loopback"),
    ("http://[::ffff:127.0.0.1%25eth0]/", "embedding 127.0.0.1, a loopback"),
]


@pytest.mark.parametrize(("url", "why"), HOSTILE)
def test_hostile_url_is_refused_with_its_reason(url: str, why: str) -> None:
    with pytest.raises(TargetRefused) as info:
        vet(url)
    message = str(info.value)
    assert why in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("url", "address", "port"),
    [
        ("http://public.example/", "93.184.216.34", 80),
        ("https://public.example/hook", "93.184.216.34", 443),
        ("https://dual.example:8443/", "93.184.216.34", 8443),
        ("http://93.184.216.34:81/", "93.184.216.34", 81),
        ("http://[2606:2800:220:1::1]/", "2606:2800:220:1::1", 80),
        ("HTTP://PUBLIC.EXAMPLE/", "93.184.216.34", 80),
    ],
)
def test_public_url_is_allowed_and_pinned_to_the_vetted_address(
    url: str, address: str, port: int
) -> None:
    target = vet(url)
    assert target.address == address
    assert target.port == port
    assert not target.allowed_by_list


def test_allow_list_admits_exact_host_and_port_only() -> None:
    allow = ["127.0.0.1:8080", "localhost:9000", "[::1]:7000"]
    assert vet("http://127.0.0.1:8080/deliver", allow).address == "127.0.0.1"
    assert vet("http://localhost:9000/", allow).allowed_by_list
    assert vet("http://[::1]:7000/", allow).address == "::1"
    # The mapped spelling of an allowed address is the same address.
    assert vet("http://[::ffff:127.0.0.1]:8080/", allow).address == "127.0.0.1"
    for url in (
        "http://127.0.0.1:8081/",  # right host, wrong port
        "http://127.0.0.2:8080/",  # right port, wrong host
        "http://localhost:7000/",  # localhost resolves to 127.0.0.1 too: not listed on 7000
        "http://10.0.0.1:8080/",
        "http://2130706433:8080/",  # a numeric spelling is still refused
    ):
        with pytest.raises(TargetRefused):
            vet(url, allow)


def test_allow_list_matches_a_name_on_its_resolved_address_and_port() -> None:
    # localhost resolves to 127.0.0.1 and ::1, both listed for port 8080.
    target = vet("http://localhost:8080/", ["127.0.0.1:8080", "[::1]:8080"])
    assert target.allowed_by_list
    assert target.address == "127.0.0.1"
    # Only one of its addresses listed: the other is still forbidden.
    with pytest.raises(TargetRefused, match="::1"):
        vet("http://localhost:8080/", ["127.0.0.1:8080"])


@pytest.mark.parametrize(
    "text",
    ["127.0.0.1", "127.0.0.1:", ":80", "host:0", "host:70000", "http://h:80", "[zz]:80", ""],
)
def test_malformed_allow_target_is_a_one_line_error(text: str) -> None:
    with pytest.raises(ValueError) as info:
        AllowedTarget.parse(text)
    assert "\n" not in str(info.value)


def test_loose_ipv4_parsing_matches_inet_aton() -> None:
    assert parse_ipv4_loose("2130706433") == ipaddress.IPv4Address("127.0.0.1")
    assert parse_ipv4_loose("0177.0.0.1") == ipaddress.IPv4Address("127.0.0.1")
    assert parse_ipv4_loose("0x7f.1") == ipaddress.IPv4Address("127.0.0.1")
    assert parse_ipv4_loose("10.1") == ipaddress.IPv4Address("10.0.0.1")
    assert parse_ipv4_loose("192.168.257") == ipaddress.IPv4Address("192.168.1.1")
    assert parse_ipv4_loose("public.example") is None
    with pytest.raises(ValueError):
        parse_ipv4_loose("256.0.0.1")


def test_pinned_resolver_returns_only_the_vetted_address() -> None:
    resolver = PinnedResolver()
    target = vet("http://public.example/")
    resolver.pin(target)

    async def go() -> None:
        results = await resolver.resolve("public.example", 80)
        assert [r["host"] for r in results] == ["93.184.216.34"]
        with pytest.raises(OSError, match="not vetted"):
            await resolver.resolve("other.example", 80)
        with pytest.raises(OSError, match="not vetted"):
            await resolver.resolve("public.example", 81)

    asyncio.run(go())


# -- the system resolver's own failure modes ----------------------------------------------

LONG_LABEL = "a" * 64 + ".com"


@pytest.mark.parametrize("host", ["a..com", LONG_LABEL, "."])
def test_system_resolver_refuses_a_name_the_idna_codec_rejects(host: str) -> None:
    # Python encodes the name before calling getaddrinfo, and raises UnicodeError for an
    # empty or over-long label: nothing is asked of any DNS server.
    with pytest.raises(TargetRefused) as info:
        asyncio.run(system_resolver(host, 80))
    assert "not a valid host name" in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("url", ["http://a..com/", f"http://{LONG_LABEL}/"])
def test_guard_with_the_system_resolver_refuses_a_malformed_name(url: str) -> None:
    with pytest.raises(TargetRefused, match="not a valid host name"):
        asyncio.run(UrlGuard().vet(url))


def test_system_resolver_returns_a_numeric_address_without_asking_dns() -> None:
    assert asyncio.run(system_resolver("127.0.0.1", 80)) == ["127.0.0.1"]


def stub_getaddrinfo(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> list[str]:
    """Make every getaddrinfo raise `error`, recording the names asked for."""
    asked: list[str] = []

    def fake(host: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(str(host))
        raise error

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    return asked


@pytest.mark.parametrize(
    ("errno", "temporary"),
    [
        (socket.EAI_AGAIN, True),  # "temporary failure in name resolution"
        (socket.EAI_FAIL, True),  # the name server failed (SERVFAIL): may recover
        (socket.EAI_NONAME, False),  # the name does not exist (NXDOMAIN)
    ],
)
def test_system_resolver_tells_temporary_failures_from_missing_names(
    monkeypatch: pytest.MonkeyPatch, errno: int, temporary: bool
) -> None:
    asked = stub_getaddrinfo(monkeypatch, socket.gaierror(errno, "stubbed failure"))
    with pytest.raises(ResolutionFailed) as info:
        asyncio.run(system_resolver("hooks.example", 443))
    assert asked == ["hooks.example"]
    assert info.value.temporary is temporary
    assert "hooks.example" in str(info.value)
    assert "\n" not in str(info.value)


def test_system_resolver_treats_another_os_error_as_temporary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stub_getaddrinfo(monkeypatch, OSError(24, "Too many open files"))
    with pytest.raises(ResolutionFailed) as info:
        asyncio.run(system_resolver("hooks.example", 443))
    assert info.value.temporary


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"), True),
        (socket.gaierror(socket.EAI_NONAME, "Name or service not known"), False),
    ],
)
def test_an_injected_resolver_raising_gaierror_is_classified_too(
    error: socket.gaierror, expected: bool
) -> None:
    async def failing(host: str, port: int) -> Sequence[str]:
        raise error

    with pytest.raises(ResolutionFailed) as info:
        asyncio.run(UrlGuard(resolver=failing).vet("http://hooks.example/"))
    assert info.value.temporary is expected


def test_an_injected_resolver_raising_unicode_error_is_a_refusal() -> None:
    async def failing(host: str, port: int) -> Sequence[str]:
        raise UnicodeError("label empty or too long")

    with pytest.raises(TargetRefused, match="not a valid host name"):
        asyncio.run(UrlGuard(resolver=failing).vet("http://hooks.example/"))


def test_a_url_with_an_address_is_vetted_once_and_a_name_on_every_call() -> None:
    """A vet that asked no resolver is kept (the URL and the allow list decide it); a name is
    resolved again on every vet, so a name that rebinds to a private address is refused."""
    answers = {"flip.example": [["93.184.216.34"], ["10.0.0.5"]]}
    asked: list[str] = []

    async def resolver(host: str, port: int) -> Sequence[str]:
        asked.append(host)
        return answers[host].pop(0)

    async def vet_all() -> None:
        guard = UrlGuard(["127.0.0.1:8080"], resolver=resolver)
        first = await guard.vet("http://127.0.0.1:8080/deliver")
        assert await guard.vet("http://127.0.0.1:8080/deliver") is first
        for _ in range(2):  # a refusal kept is raised afresh, with its reason
            with pytest.raises(TargetRefused, match="loopback"):
                await guard.vet("http://127.0.0.1:9/")
        assert (await guard.vet("http://flip.example/")).address == "93.184.216.34"
        with pytest.raises(TargetRefused, match="private"):
            await guard.vet("http://flip.example/")

    asyncio.run(vet_all())
    assert asked == ["flip.example", "flip.example"]
