"""Choosing a system under test by name: the reference queue, its variants, or a plug-in.

A `BackendSpec` is what crosses process boundaries: a small picklable record. Each child
process calls `.create()` after it starts, so every connection is opened in the process that
uses it. Names of the form `package.module:factory` load any other implementation of
`QueueBackend`; the factory is called as `factory(dsn=..., schema=..., sql_path=...)`.

A run's producers and workers are separate processes that share nothing but the queue's
store, so a queue that lives inside one process (the in-memory model) cannot serve a run. A
factory says so with `shared = False` on itself or on the class of the queue it returns;
`check_backend` refuses such a backend, and any factory that raises or returns no queue,
before a run starts anything.

DSNs are shown only through `redact` and error texts only through `scrub`: neither prints any
part of a password, whatever shape the DSN has.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import unquote

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from skiplock.queue_impl.interface import (
    DeclaresGuarantees,
    DeclaresSharing,
    Guarantees,
    QueueBackend,
)

BACKEND_NAMES: tuple[str, ...] = ("pg", "pg-naive", "pg-for-update", "pg-long-tx")
# Queues on Redis, with their own worker loops: the run provisions Redis for them.
REDIS_BACKENDS: tuple[str, ...] = ("bullmq",)
BUILT_IN: tuple[str, ...] = (*BACKEND_NAMES, *REDIS_BACKENDS)

_FACTORY = re.compile(r"^(?P<module>[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*)$")

Factory = Callable[..., QueueBackend]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


BackendOptions = tuple[tuple[str, str], ...]
_OPTION_KEY = re.compile(r"^[A-Za-z_]\w*$")
# Option names whose values are shown and recorded as *** (a token, a password).
_SECRET_OPTION = re.compile(r"pass|secret|token|auth|key", re.IGNORECASE)


def parse_backend_options(items: list[str] | tuple[str, ...] | None) -> BackendOptions:
    """`--backend-opt KEY=VALUE` words as (key, value) pairs, in order; ValueError with one
    line for a word that is not KEY=VALUE with KEY a Python name, or a key given twice."""
    found: dict[str, str] = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        if not eq or not _OPTION_KEY.match(key):
            raise ValueError(f"--backend-opt takes KEY=VALUE with KEY a name such as "
                             f"queue_name (got {item!r})")
        if key in found:
            raise ValueError(f"--backend-opt {key} is given twice")
        found[key] = value
    return tuple(found.items())


def shown_options(options: BackendOptions) -> dict[str, str]:
    """Options as a result file or a terminal may show them: secret-looking values hidden."""
    return {k: ("***" if _SECRET_OPTION.search(k) else v) for k, v in options}


# skiplock's own packages, once importable at the top level (before 0.2.0).
_PARTS = frozenset({"plumbing", "queue_impl", "scenarios", "chaos", "reports"})


def load_factory(name: str) -> Factory:
    """The callable named by `package.module:factory`; ValueError with one line if not."""
    match = _FACTORY.match(name)
    if match is None:
        raise ValueError(
            f"unknown backend {name!r}: use one of {', '.join(BUILT_IN)} "
            "or package.module:factory"
        )
    module_name, attr = match.group("module"), match.group("attr")
    moved = _moved_under_skiplock(module_name)
    if moved is not None:
        raise ValueError(f"backend {name!r}: since 0.2.0 skiplock's modules are under the "
                         f"skiplock package; use --backend {moved}:{attr}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure is the user's module, reported as such
        raise ValueError(
            f"backend {name!r}: cannot import {module_name} ({_one_line(exc)}); "
            "check the module is on PYTHONPATH"
        ) from exc
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ValueError(f"backend {name!r}: {module_name} has no callable {attr!r}")
    return cast(Factory, factory)


def _moved_under_skiplock(module_name: str) -> str | None:
    """`queue_impl.x` as skiplock 0.1 spelled its own modules -> `skiplock.queue_impl.x`, when
    that module exists; None for any other name (a team's own `reports.x` still loads)."""
    if module_name.split(".")[0] not in _PARTS:
        return None
    moved = f"skiplock.{module_name}"
    try:
        found = importlib.util.find_spec(moved) is not None
    except ImportError:  # a parent package that does not exist
        found = False
    return moved if found else None


def validate_backend_name(name: str) -> None:
    """Raise ValueError (one line, saying what to use instead) for an unusable name."""
    if name in BUILT_IN:
        return
    load_factory(name)


def is_shared(factory_or_queue: object) -> bool:
    """False when a factory, a queue or the queue's class says `shared = False`: its queue
    lives in the process that built it, so separate processes would each see their own."""
    return not (isinstance(factory_or_queue, DeclaresSharing)
                and factory_or_queue.shared is False)


def _process_local(queue: object) -> bool:
    return not is_shared(queue)


def _not_shared(name: str) -> ValueError:
    return ValueError(
        f"backend {name!r}: its queue lives inside one process (an in-memory queue, for tests);"
        " a run's producers and workers are separate processes and would share nothing:"
        " use pg, a variant, or a queue kept in a store every process reaches"
    )


def _build(factory: Factory, name: str, dsn: str | None, schema: str,
           sql_path: str | None, options: BackendOptions = ()) -> QueueBackend:
    """Call a plug-in's factory; whatever goes wrong is one line naming the factory."""
    call = "factory(dsn=..., schema=..., sql_path=..." + "".join(
        f", {key}=..." for key, _ in options) + ")"
    check_schema_name(schema)
    try:
        backend = factory(dsn=dsn, schema=schema, sql_path=sql_path, **dict(options))
    except TypeError as exc:
        text = scrub(_one_line(exc), dsn)
        unknown = [key for key, _ in options if f"'{key}'" in text]
        if unknown:
            raise ValueError(
                f"backend {name!r}: its factory takes no option {unknown[0]!r} "
                f"(--backend-opt {unknown[0]}=...; {text})") from exc
        raise ValueError(f"backend {name!r}: cannot be called as {call} ({text})") from exc
    except Exception as exc:  # the user's code: any failure is theirs to fix
        raise ValueError(
            f"backend {name!r}: the factory raised {type(exc).__name__}"
            f" ({scrub(_one_line(exc), dsn)}); it is called as {call}"
        ) from exc
    if backend is None:
        raise ValueError(f"backend {name!r}: the factory returned None; it must return a"
                         " QueueBackend (skiplock.queue_impl.interface)")
    if not isinstance(backend, QueueBackend):
        raise ValueError(
            f"backend {name!r}: the factory returned {type(backend).__name__}, "
            "which does not implement QueueBackend"
        )
    return backend


def check_backend(name: str, *, dsn: str | None, schema: str,
                  sql_path: str | None = None, options: BackendOptions = ()) -> None:
    """Refuse, before a run starts anything, a backend it could not use: call a plug-in's
    factory once, here, as every worker and producer will (and close what it returns).
    ValueError with one line naming the factory and what went wrong; the reference names
    pass (their failures are the server's, reported where it is reached)."""
    if name in BUILT_IN:
        if options:
            raise ValueError(f"backend {name!r} takes no --backend-opt (options are passed to "
                             "a package.module:factory plug-in's factory)")
        return
    factory = load_factory(name)
    if not is_shared(factory):
        raise _not_shared(name)
    backend = _build(factory, name, dsn, schema, sql_path, options)
    local = _process_local(backend)
    declared = backend.guarantees if isinstance(backend, DeclaresGuarantees) else None
    if declared is not None and not isinstance(declared, Guarantees):
        with contextlib.suppress(Exception):
            backend.close()
        raise ValueError(f"backend {name!r}: its guarantees must be a "
                         f"skiplock.queue_impl.interface.Guarantees, not {type(declared).__name__}")
    try:
        backend.close()
    except Exception as exc:
        raise ValueError(
            f"backend {name!r}: close() of the queue the factory returned raised"
            f" {type(exc).__name__} ({scrub(_one_line(exc), dsn)})"
        ) from exc
    if local:
        raise _not_shared(name)


_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def check_schema_name(schema: str) -> None:
    """Refuse a schema name a plug-in could not use unquoted (in `search_path`, in its own
    statements): ValueError with one line. Checked before any factory is called."""
    if not _SCHEMA_NAME.match(schema):
        raise ValueError(f"schema {schema!r}: use lower-case letters, digits and '_' "
                         "(at most 63, not starting with a digit)")


def asyncpg_params(dsn: str) -> dict[str, Any]:
    """libpq's reading of the DSN (a URI or key=value pairs) as asyncpg's keywords, for a
    plug-in whose library connects with asyncpg (which reads URIs only)."""
    params = conninfo_to_dict(dsn)
    names = {"host": "host", "port": "port", "user": "user", "password": "password",
             "dbname": "database"}
    found: dict[str, Any] = {names[k]: v for k, v in params.items() if k in names and v}
    if "port" in found:
        found["port"] = int(found["port"])
    return found


class SchemaConnection:
    """A plug-in's one connection in its process: psycopg, autocommit, opened on first use
    (after the process started) with `search_path` set to the run's schema, opened again
    after it broke (a fault may cut it). Built as `Queue(dsn, schema)`."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn, self.schema = dsn, schema
        self._conn: psycopg.Connection[Any] | None = None

    def connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.dsn, autocommit=True,
                                         options=f"-c search_path={self.schema}")
        return self._conn

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


# --------------------------------------------------------------------------------------------
# Showing a DSN without its password.
# --------------------------------------------------------------------------------------------

DSN_HIDDEN = "<DSN hidden>"
_URI = re.compile(r"^(?P<scheme>postgres(?:ql)?)://", re.IGNORECASE)
_SECRET_KEYS = frozenset({"password", "sslpassword"})
# What may be printed of a DSN that libpq does not read the way its text suggests: a host
# list (names, IPv4, [IPv6], ports, a percent-encoded socket directory), nothing else.
_SAFE_HOST = re.compile(r"^[A-Za-z0-9._\-:,\[\]%]+$")
_KV_HOST = re.compile(r"(?:^|\s)host\s*=\s*([A-Za-z0-9._\-:,\[\]/]+)(?=\s|$)")
_SCRUB_HIDDEN = ("details hidden: the DSN's password cannot be told apart from the rest"
                 " (percent-encode @ as %40 and / as %2F in a URI's password)")


@dataclass(frozen=True, kw_only=True)
class DsnView:
    """What may be printed of a DSN, and what never may."""

    display: str
    secrets: tuple[str, ...] = ()
    # True when libpq reads the password exactly where the text puts it, so nothing but the
    # password itself is secret. False: libpq would read part of it as a host, a port or a
    # database (an unescaped `@` or `/`), or cannot parse the DSN at all.
    trusted: bool = True


def _libpq(dsn: str) -> dict[str, Any] | None:
    try:
        return conninfo_to_dict(dsn)
    except (psycopg.Error, UnicodeError):  # not UTF-8: bytes from argv, or %80 decoded
        return None


def _masked(params: dict[str, Any]) -> str:
    shown = {k: ("***" if k in _SECRET_KEYS else str(v))
             for k, v in params.items() if v is not None}
    return make_conninfo("", **shown)


def dsn_view(dsn: str) -> DsnView:
    """Split a DSN (a URI or key=value pairs) into what may be shown and what is secret.

    In a URI the password is taken to run from the first `:` of the user part to the last
    `@` before the query (or the last `@` at all when the query comes first): anything libpq
    might read differently is secret. When libpq's own reading of the password disagrees,
    only the host after the last `@` is shown, if it looks like one."""
    text = dsn.strip()
    if not text:
        return DsnView(display="<empty DSN>")
    params = _libpq(text)
    uri = _URI.match(text)
    if uri is None:
        if params is not None:
            return DsnView(display=_masked(params),
                           secrets=tuple(str(params[k]) for k in _SECRET_KEYS if params.get(k)))
        # An unbalanced quote, a stray word: no telling where a password ends. A host given
        # before any quote or backslash is a token of its own, never part of a value.
        head = re.split(r"['\\]", text, maxsplit=1)[0]
        host_token = _KV_HOST.search(head)
        shown = f"host={host_token.group(1)} {DSN_HIDDEN}" if host_token else DSN_HIDDEN
        return DsnView(display=shown, trusted=False)

    scheme = uri.group("scheme")
    rest = text[uri.end():]
    head = rest.split("?", 1)[0]
    at = head.rfind("@") if "@" in head else rest.rfind("@")
    found: list[str] = []
    password: str | None = None
    if at >= 0:
        _user, colon, password_text = rest[:at].partition(":")
        if colon:
            password = password_text
            found += [password_text, unquote(password_text)]
    query = rest[at + 1:].partition("?")[2]
    for item in query.split("&"):
        key, _eq, value = item.partition("=")
        if unquote(key) in _SECRET_KEYS and value:
            found += [value, unquote(value)]
    if params is not None:
        found += [str(params[k]) for k in _SECRET_KEYS if params.get(k)]
    unique = tuple(dict.fromkeys(s for s in found if s))
    agrees = params is not None and (
        password is None or unquote(password) == str(params.get("password") or "")
    )
    if agrees:
        assert params is not None
        return DsnView(display=_masked(params), secrets=unique)
    last = rest.rfind("@")
    widest = rest[:last].partition(":")[2] if last >= 0 else ""
    unique = tuple(dict.fromkeys(s for s in (widest, *unique) if s))
    host = re.split(r"[/?]", rest[last + 1:], maxsplit=1)[0]
    shown = f"{scheme}://{host} {DSN_HIDDEN}" if _SAFE_HOST.match(host) else DSN_HIDDEN
    return DsnView(display=shown, secrets=unique, trusted=False)


def redact(dsn: str) -> str:
    """The DSN without any part of its password, for display."""
    return dsn_view(dsn).display


def dsn_problem(dsn: str) -> str | None:
    """Why libpq would not read this DSN's password as written, or None."""
    view = dsn_view(dsn)
    if view.trusted:
        return None
    if _libpq(dsn.strip()) is None:
        return ("cannot be parsed: give a URI like postgresql://USER:PASSWORD@HOST:PORT/DB"
                " or key=value pairs")
    return ("its password holds a character a URI reserves, so PostgreSQL would read part"
            " of it as the host, port or database: percent-encode it (@ as %40, / as %2F,"
            " : as %3A)")


def scrub(text: str, dsn: str | None) -> str:
    """`text` (an error message) on one line with no part of the DSN's password in it.

    libpq never echoes a password it parsed, so for a DSN it reads as written the password
    is cut out where it appears; a short one only where it stands as a word of its own
    (cutting every `p` would mangle the text and point at the password). For a DSN libpq
    misreads, any value it quotes back may hold a piece of the password: the text is
    replaced whole."""
    line = " ".join(text.split())
    if not dsn or not dsn.strip():
        return line
    view = dsn_view(dsn)
    if not view.trusted:
        return _SCRUB_HIDDEN
    line = line.replace(dsn.strip(), view.display)
    for secret in sorted(view.secrets, key=len, reverse=True):
        if len(secret) >= 4:
            line = line.replace(secret, "***")
        else:
            line = re.sub(rf"(?<![\w.]){re.escape(secret)}(?![\w.])", "***", line)
    return line


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    """Which queue to build, and where; picklable, with no open resources."""

    name: str
    dsn: str | None = field(default=None, repr=False)
    schema: str = "skiplock"
    sql_path: str | None = None
    # `--backend-opt` pairs, passed to a plug-in's factory as keyword arguments.
    options: BackendOptions = field(default=(), repr=False)
    # The Redis of a Redis backend (its queue name is `schema`).
    redis_url: str | None = field(default=None, repr=False)
    # The scenario's retry base, for a queue whose backoff is set per job when it is
    # enqueued (BullMQ).
    retry_base_seconds: float = 0.2

    def __post_init__(self) -> None:
        # Through JSON (a producer's config) the pairs arrive as lists.
        object.__setattr__(self, "options", tuple((str(k), str(v)) for k, v in self.options))

    def create(self) -> QueueBackend:
        """Build the queue in the calling process (its connections open lazily, here)."""
        if self.name in BACKEND_NAMES:
            from skiplock.queue_impl.pg import PgQueue, Variant

            if not self.dsn:
                raise ValueError(f"backend {self.name!r} needs a PostgreSQL DSN")
            return PgQueue(
                self.dsn,
                schema=self.schema,
                sql=self.sql_path,
                variant=cast(Variant, self.name),
            )
        if self.name in REDIS_BACKENDS:
            from skiplock.queue_impl.bullmq_queue import BullmqQueue

            if not self.redis_url:
                raise ValueError(f"backend {self.name!r} needs a Redis URL")
            return BullmqQueue(self.redis_url, queue_name=self.schema,
                               retry_base_seconds=self.retry_base_seconds)
        return _build(load_factory(self.name), self.name, self.dsn, self.schema, self.sql_path,
                      self.options)

    def display(self) -> str:
        parts = [self.name, f"schema={self.schema}"]
        if self.name in REDIS_BACKENDS:
            # Its server is described (without a password) beside PostgreSQL's.
            return f"{self.name} queue={self.schema}"
        if self.dsn:
            parts.append(f"dsn={redact(self.dsn)}")
        if self.sql_path:
            parts.append(f"sql={self.sql_path}")
        parts += [f"{k}={v}" for k, v in shown_options(self.options).items()]
        return " ".join(parts)
