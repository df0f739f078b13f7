"""The SSRF guard: which URLs the dispatcher may call, and the one address it connects to.

A job's target URL comes from whoever enqueued it, so the dispatcher must not become a way
into the network it runs in. Only http(s) is allowed; loopback, private, link-local,
multicast, reserved, unspecified and other non-global addresses are refused, including the
spellings that hide them (IPv4-mapped IPv6, 6to4 / NAT64 / Teredo embeddings, and the legacy
numeric IPv4 forms `2130706433`, `0177.0.0.1`, `0x7f.1`, `127.1`). A host name is resolved
once; if ANY of its addresses is forbidden the URL is refused, and the vetted address is the
one connected to (`PinnedResolver`), so a second lookup cannot rebind the name to an internal
address. Redirects are never followed (the dispatcher's job, not this module's).

`--allow-target HOST:PORT` admits exactly that host and port: the harness's own echo target
on loopback. It matches on the literal host of the URL, or on a resolved IP and the port. An
entry given as a host name admits whatever that name resolves to when a job is vetted, so
whoever controls its DNS decides what is admitted: list literal IP addresses where possible.

Name resolution fails in two ways that mean different things (`ResolutionFailed`): a
temporary failure (no answer, a failing name server) may succeed later and is retried; a name
that does not exist (NXDOMAIN) is the name server's answer and is not. A host name that cannot
be a DNS name at all (an empty or over-long label) is refused outright (`TargetRefused`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# (host, port) -> the addresses the name resolves to, as strings.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

ALLOWED_SCHEMES = frozenset({"http", "https"})
DEFAULT_PORTS = {"http": 80, "https": 443}

# RFC 6052 well-known NAT64 prefix and the local-use one (RFC 8215): the IPv4 address is the
# last 32 bits.
_NAT64_PREFIXES = (
    ipaddress.IPv6Network("64:ff9b::/96"),
    ipaddress.IPv6Network("64:ff9b:1::/48"),
)
# Carrier-grade NAT is not "private" to Python 3.11, but is not reachable from outside.
_SHARED_ADDRESS_SPACE = ipaddress.IPv4Network("100.64.0.0/10")

# One part of an inet_aton-style IPv4 literal: decimal, octal (leading 0) or hex (0x).
_NUMERIC_PART = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")


class TargetRefused(Exception):
    """The URL may not be called. The message says why; nothing was sent."""


class ResolutionFailed(Exception):
    """The host name could not be resolved; nothing was sent. `temporary` is False only when
    the name server answered that the name does not exist, so asking again will not help."""

    def __init__(self, message: str, *, temporary: bool) -> None:
        super().__init__(message)
        self.temporary = temporary


# getaddrinfo's answers that the name has no address at all, as opposed to no answer yet.
# EAI_NODATA and EAI_ADDRFAMILY are glibc extensions, absent on some platforms.
_NAME_MISSING = frozenset(
    code
    for code in (
        socket.EAI_NONAME,
        getattr(socket, "EAI_NODATA", None),
        getattr(socket, "EAI_ADDRFAMILY", None),
    )
    if code is not None
)


@dataclass(frozen=True, kw_only=True)
class AllowedTarget:
    """One `--allow-target HOST:PORT` entry."""

    host: str  # lower-case, without IPv6 brackets
    port: int

    @classmethod
    def parse(cls, text: str) -> AllowedTarget:
        """Parse `HOST:PORT` (`[v6]:PORT` for IPv6). Raises ValueError with a one-line
        message for anything else."""
        match = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]/@\s]+):(\d+)", text.strip())
        if match is None:
            raise ValueError(f"--allow-target {text!r} is not HOST:PORT (use [ADDR]:PORT for IPv6)")
        host = (match.group(1) or match.group(3)).lower()
        port = int(match.group(2) or match.group(4))
        if not 0 < port < 65536:
            raise ValueError(f"--allow-target {text!r}: port must be 1-65535")
        if match.group(1) is not None:
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise ValueError(
                    f"--allow-target {text!r}: {host!r} is not an IPv6 address"
                ) from None
        return cls(host=host, port=port)

    def address(self) -> IPAddress | None:
        """The entry's host as an IP, when it is one (in any numeric spelling)."""
        return parse_ip_literal(self.host)


@dataclass(frozen=True, kw_only=True)
class VettedTarget:
    """A URL that passed the guard, with the one address the connection must go to."""

    url: str
    scheme: str
    host: str
    port: int
    address: str
    allowed_by_list: bool


def parse_ipv4_loose(host: str) -> ipaddress.IPv4Address | None:
    """Parse the numeric IPv4 forms `inet_aton` accepts (1 to 4 dot-separated parts, each
    decimal, octal or hex, the last filling the remaining bytes). None when `host` is not
    numeric at all; ValueError when it looks numeric but is out of range."""
    parts = host.lower().split(".")
    if host.endswith("."):
        parts = parts[:-1]
    if not 1 <= len(parts) <= 4 or not all(_NUMERIC_PART.match(p) for p in parts):
        return None
    values: list[int] = []
    for part in parts:
        if part.startswith("0x"):
            values.append(int(part[2:] or "0", 16))
        elif len(part) > 1 and part.startswith("0"):
            if not set(part) <= set("01234567"):
                raise ValueError(f"{host!r} is not a valid numeric address")
            values.append(int(part, 8))
        else:
            values.append(int(part, 10))
    *head, last = values
    if any(v > 255 for v in head) or last >= 256 ** (4 - len(head)):
        raise ValueError(f"{host!r} is not a valid numeric address")
    number = 0
    for value in head:
        number = number * 256 + value
    number = number * 256 ** (4 - len(head)) + last
    return ipaddress.IPv4Address(number)


def parse_ip_literal(host: str) -> IPAddress | None:
    """The address a host string denotes by itself, or None for a name to resolve."""
    bare = host.strip("[]")
    if ":" in bare:
        try:
            return ipaddress.IPv6Address(bare)
        except ValueError:
            return None
    return parse_ipv4_loose(bare)


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, 6to4, NAT64), if any."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    for prefix in _NAT64_PREFIXES:
        if address in prefix:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def forbidden_reason(address: IPAddress) -> str | None:
    """Why connecting to `address` is refused, or None when it is a public address."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            inner = forbidden_reason(embedded)
            return None if inner is None else f"an address embedding {embedded}, {inner}"
        if address.teredo is not None:
            server, client = address.teredo
            for inner_address in (server, client):
                inner = forbidden_reason(inner_address)
                if inner is not None:
                    return f"a Teredo address embedding {inner_address}, {inner}"
    if address.is_unspecified:
        return "an unspecified address"
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address"
    if address.is_multicast:
        return "a multicast address"
    if isinstance(address, ipaddress.IPv6Address) and address.is_site_local:
        # fec0::/10 is deprecated (RFC 3879) but still routed inside some networks, and
        # Python counts it as global.
        return "a site-local address"
    if address.is_reserved:
        return "a reserved address"
    if address.is_private:
        return "a private address"
    if isinstance(address, ipaddress.IPv4Address) and address in _SHARED_ADDRESS_SPACE:
        return "a carrier-grade NAT address"
    if not address.is_global:
        return "not a public address"
    return None


def resolution_error(host: str, exc: Exception) -> TargetRefused | ResolutionFailed:
    """What a failed lookup of `host` means for the job: a refusal for a name that can never
    resolve, a permanent failure for a name that does not exist, else a temporary one."""
    if isinstance(exc, ValueError):
        # UnicodeError from the IDNA codec (an empty or over-long label), or an embedded NUL:
        # raised before any query is sent, and it will never resolve.
        return TargetRefused(
            f"refused by SSRF guard: {host!r} is not a valid host name ({_first_line(exc)})"
        )
    if isinstance(exc, socket.gaierror) and exc.errno in _NAME_MISSING:
        return ResolutionFailed(
            f"cannot resolve {host!r}: {_first_line(exc)} (the name does not exist)",
            temporary=False,
        )
    return ResolutionFailed(f"cannot resolve {host!r}: {_first_line(exc)}", temporary=True)


async def system_resolver(host: str, port: int) -> list[str]:
    """Resolve with the operating system, once, returning every address. Raises TargetRefused
    or ResolutionFailed (`resolution_error`)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError) as exc:
        raise resolution_error(host, exc) from None
    seen: list[str] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        address = str(sockaddr[0]).split("%", 1)[0]
        if address not in seen:
            seen.append(address)
    return seen


# The most vets a guard keeps (`UrlGuard._kept`); past it, it starts over.
KEPT_VETS = 4096


class UrlGuard:
    """Vets target URLs. One per worker process; `allow_targets` are `HOST:PORT` strings."""

    def __init__(
        self, allow_targets: Sequence[str] = (), *, resolver: Resolver | None = None
    ) -> None:
        self.allowed = tuple(AllowedTarget.parse(text) for text in allow_targets)
        self._resolver: Resolver = resolver or system_resolver
        self._allowed_hosts = {(a.host, a.port) for a in self.allowed}
        self._allowed_addresses = {
            (ip, a.port) for a in self.allowed if (ip := a.address()) is not None
        }
        # URL -> its vet, for vets that asked no resolver (an address written in the URL, or
        # a URL refused before any lookup): the URL and the allow list alone decide those, so
        # a worker calling one target vets its URL once, not once a job (the vet was 6 % of
        # a busy worker's CPU). A host name is resolved on every vet, never kept: what it
        # resolves to may change (DNS rebinding).
        self._kept: dict[str, VettedTarget | str] = {}

    def _address_allowed(self, address: IPAddress, port: int) -> bool:
        if (address, port) in self._allowed_addresses:
            return True
        # 127.0.0.1 listed also admits its mapped spelling ::ffff:127.0.0.1, and vice versa.
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            return (address.ipv4_mapped, port) in self._allowed_addresses
        return False

    async def vet(self, url: str) -> VettedTarget:
        """Check `url` and pick the address to connect to, or raise TargetRefused (never to
        be called) or ResolutionFailed (its name did not resolve)."""
        kept = self._kept.get(url)
        if isinstance(kept, str):
            raise TargetRefused(kept)
        if kept is not None:
            return kept
        try:
            scheme, host, port = _split_target_url(url)
            literal = _canonical_ip_literal(host)
            if literal is not None:
                target = self._vetted(url, scheme, host, port, [literal], host_is_literal=True)
        except TargetRefused as exc:
            self._keep(url, str(exc))
            raise
        if literal is not None:
            self._keep(url, target)
            return target
        addresses = await self._resolve_addresses(host, port)
        return self._vetted(url, scheme, host, port, addresses, host_is_literal=False)

    def _keep(self, url: str, vet: VettedTarget | str) -> None:
        if len(self._kept) >= KEPT_VETS:
            self._kept.clear()
        self._kept[url] = vet

    def _vetted(self, url: str, scheme: str, host: str, port: int,
                addresses: list[IPAddress], *, host_is_literal: bool) -> VettedTarget:
        literal_allowed = (host.rstrip("."), port) in self._allowed_hosts
        by_list = literal_allowed or self._check_every_address(
            host, port, addresses, host_is_literal=host_is_literal
        )
        return VettedTarget(
            url=url,
            scheme=scheme,
            host=host,
            port=port,
            address=_connectable(addresses[0]),
            allowed_by_list=by_list,
        )

    async def _resolve_addresses(self, host: str, port: int) -> list[IPAddress]:
        """Resolve the host name `host` once, returning every address it has. Raises
        TargetRefused or ResolutionFailed when there is no usable answer."""
        try:
            resolved = await self._resolver(host, port)
        except (TargetRefused, ResolutionFailed):
            raise
        except (OSError, ValueError) as exc:
            # A resolver passed in may raise what getaddrinfo raises: classify it the same.
            raise resolution_error(host, exc) from None
        addresses: list[IPAddress] = []
        for text in resolved:
            try:
                addresses.append(ipaddress.ip_address(text.split("%", 1)[0]))
            except ValueError:
                raise TargetRefused(
                    f"{host!r} resolved to {text!r}, which is not an address"
                ) from None
        if not addresses:
            raise TargetRefused(f"{host!r} resolved to no address")
        return addresses

    def _check_every_address(
        self, host: str, port: int, addresses: list[IPAddress], *, host_is_literal: bool
    ) -> bool:
        """Refuse the target unless every address in `addresses` is listed or public.
        Returns whether any of them was admitted by the `--allow-target` list."""
        by_list = False
        # Every address must pass: a name that resolves to a public address first and a
        # private one second would otherwise let a later connection reach the private one.
        for address in addresses:
            if self._address_allowed(address, port):
                by_list = True
                continue
            reason = forbidden_reason(address)
            if reason is not None:
                shown = host if host_is_literal else f"{host} ({address})"
                raise TargetRefused(f"refused by SSRF guard: {shown} is {reason}")
        return by_list


def _split_target_url(url: str) -> tuple[str, str, int]:
    """The (scheme, lower-case host, port) of `url`, or TargetRefused when it is malformed,
    not http(s), has no host or has a port out of range."""
    # Parse with yarl, as aiohttp will: two parsers that disagree on a tricky URL (a
    # backslash, an "@" in the wrong place, IDNA digits) are a classic SSRF bypass.
    try:
        parsed = URL(url)
        raw_host = parsed.raw_host
        port_given = parsed.explicit_port
    except (ValueError, TypeError) as exc:
        raise TargetRefused(f"malformed URL ({_first_line(exc)})") from None
    scheme = parsed.scheme.lower()
    if scheme not in ALLOWED_SCHEMES:
        raise TargetRefused(f"scheme {scheme or '(none)'!r} is not http or https")
    host = (raw_host or "").lower()
    if not host:
        raise TargetRefused("URL has no host")
    port = port_given if port_given is not None else DEFAULT_PORTS[scheme]
    if not 0 < port < 65536:
        raise TargetRefused(f"malformed URL (port {port} out of range)")
    return scheme, host, port


def _canonical_ip_literal(host: str) -> IPAddress | None:
    """The address `host` denotes by itself, or None for a name to resolve. Refuses
    (TargetRefused) a numeric host that is out of range or not written canonically."""
    try:
        literal = parse_ip_literal(host)
    except ValueError as exc:
        raise TargetRefused(str(exc)) from None
    if isinstance(literal, ipaddress.IPv4Address) and str(literal) != host.rstrip("."):
        # Legacy spellings (2130706433, 0177.0.0.1, 0x7f.1, 127.1) exist mostly to slip
        # past filters; nothing legitimate needs them, so they are refused outright.
        why = forbidden_reason(literal) or "not written as a.b.c.d"
        raise TargetRefused(
            f"refused by SSRF guard: {host} is a non-canonical IPv4 form of {literal}, {why}"
        )
    return literal


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _connectable(address: IPAddress) -> str:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


class PinnedResolver(AbstractResolver):
    """The aiohttp resolver: returns only the address the guard vetted for (host, port), and
    refuses any host it was not told about, so the connection cannot go anywhere else."""

    def __init__(self) -> None:
        self._pins: dict[tuple[str, int], str] = {}

    def pin(self, target: VettedTarget) -> None:
        self._pins[(target.host, target.port)] = target.address

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        address = self._pins.get((host.lower(), port))
        if address is None:
            # OSError is what aiohttp turns into a connection error.
            raise OSError(f"{host}:{port} was not vetted by the SSRF guard")
        ip = ipaddress.ip_address(address)
        return [
            ResolveResult(
                hostname=host,
                host=address,
                port=port,
                family=socket.AF_INET6 if ip.version == 6 else socket.AF_INET,
                proto=0,
                flags=socket.AI_NUMERICHOST,
            )
        ]

    async def close(self) -> None:
        self._pins.clear()
