"""Property-based tests of the `skiplock` command line (Hypothesis).

Generated inputs: scenario TOML files (plausible and broken: wrong types, unknown keys,
non-finite and huge numbers, bad UTF-8, empty files, bad `[[nemesis]]` entries and account
limits, names with path characters), command lines for every command with hostile flag values,
and run directories built with `RunBuilder` and then damaged (cut mid-line, a file deleted,
bytes injected, columns swapped, JSON values of another type, the directory given twice).

Properties, for every input: the exit code is 0-3 (4, a harness failure, never comes from bad
input); stderr holds no traceback; exit 2 is exactly one line on stderr; exit 1 comes only
from `check` on a history that is whole, with a violation `verdict.json` reports. Nothing here
can reach a real server: every DSN names a closed loopback port (or cannot be parsed), and
guards stop the test before anything would start a server, a run, a worker or a target, or
connect anywhere else.

Fast by default (about 50 examples per property). `SKIPLOCK_PROPERTY_MINUTES=10` runs each
property again and again for that many minutes and prints how many examples ran.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict

from skiplock.chaos.nemesis import NEMESIS_KINDS
from skiplock.queue_impl.plugins import BACKEND_NAMES, dsn_view
from skiplock.reports.synthetic import RunBuilder
from skiplock.scenarios.cli import main as cli
from skiplock.scenarios.run.spec import FAILPOINT_NAMES, SCALAR_KEYS, SCRIPT_NAMES, available

# --------------------------------------------------------------------------------------------
# Settings: fast in CI, as long as asked for locally.
# --------------------------------------------------------------------------------------------

MINUTES_ENV = "SKIPLOCK_PROPERTY_MINUTES"
try:
    LONG_MINUTES = max(0.0, float(os.environ.get(MINUTES_ENV, "") or 0))
except ValueError:
    LONG_MINUTES = 0.0

settings.register_profile(
    "skiplock-cli-ci", max_examples=50, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture],
)
# The long run calls each property again and again in chunks of this many examples, each
# chunk with fresh random data, until SKIPLOCK_PROPERTY_MINUTES have passed.
settings.register_profile("skiplock-cli-long", parent=settings.get_profile("skiplock-cli-ci"),
                          max_examples=100)
PROFILE = settings.get_profile("skiplock-cli-long" if LONG_MINUTES else "skiplock-cli-ci")

pytestmark = pytest.mark.timeout(int(LONG_MINUTES * 60 * 1.5) + 300 if LONG_MINUTES else 180)

# Examples run per property, and exit codes seen (printed by the long run).
RAN: Counter[str] = Counter()
CODES: dict[str, Counter[str]] = {}


def _count(prop: str, what: str) -> None:
    RAN[prop] += 1
    CODES.setdefault(prop, Counter())[what] += 1


def drive(prop: str, inner: Callable[[], None], capsys: pytest.CaptureFixture[str]) -> None:
    """Run a Hypothesis property once (CI) or in chunks until the time is up (long run)."""
    if not LONG_MINUTES:
        inner()
        return
    deadline = time.monotonic() + LONG_MINUTES * 60
    chunks = 0
    started = time.monotonic()
    known_before = Counter(CODES.get("known_bugs", Counter()))
    while time.monotonic() < deadline:
        inner()
        chunks += 1
    known = Counter(CODES.get("known_bugs", Counter()))
    known.subtract(known_before)
    with capsys.disabled():
        print(f"\n{prop}: {RAN[prop]} examples in {chunks} chunks,"
              f" {time.monotonic() - started:.0f} s; outcomes"
              f" {dict(sorted(CODES.get(prop, Counter()).items()))}; known bugs hit"
              f" {dict(+known)}", flush=True)


# --------------------------------------------------------------------------------------------
# Guards: nothing may start, serve or connect anywhere but a closed loopback port.
# --------------------------------------------------------------------------------------------


class GuardTripped(BaseException):
    """The CLI tried to do something real (start a server, connect elsewhere, run)."""


class WouldServe(BaseException):
    """`target` / `bench target` accepted their input and were about to listen: valid input."""


CLOSED_PORT = "1"
CLOSED_DSN = f"postgresql://u:p@127.0.0.1:{CLOSED_PORT}/db"
_LOOPBACK_LITERALS = frozenset({"127.0.0.1", "::1", "[::1]"})
_PG_ENV = ("SKIPLOCK_PG_DSN", "PGHOST", "PGHOSTADDR", "PGPORT", "PGSERVICE", "PGSERVICEFILE",
           "PGDATABASE", "PGUSER", "PGPASSWORD", "PGPASSFILE", "PGOPTIONS", "PGSSLMODE",
           "PGCONNECT_TIMEOUT", "DOCKER_HOST")


def _connect_target_problem(conninfo: str, kwargs: Mapping[str, Any]) -> str | None:
    """Why a connection with these parameters could reach something other than a closed
    loopback port, or None. An unparsable DSN raises as psycopg would."""
    params = conninfo_to_dict(conninfo, **dict(kwargs))
    if params.get("service"):
        return f"service={params['service']!r}"
    hosts = [h for key in ("host", "hostaddr")
             for h in str(params.get(key) or "").split(",") if h]
    if not hosts:
        return "no host: a Unix socket (a local server may listen there)"
    for host in hosts:
        if host not in _LOOPBACK_LITERALS:
            return f"host {host!r}"
    ports = str(params.get("port") or "").split(",")
    for port in ports:
        text = port.strip()
        if text == CLOSED_PORT:
            continue
        if not text or (text.isdigit() and 1 <= int(text) <= 65535):
            return f"port {port!r}"
    return None


def _guard_connect(real: Callable[..., Any]) -> Callable[..., Any]:
    def connect(conninfo: str = "", *args: Any, **kwargs: Any) -> Any:
        problem = _connect_target_problem(conninfo, kwargs)
        if problem is not None:
            raise GuardTripped(f"psycopg.connect would reach {problem}")
        return real(conninfo, *args, **kwargs)

    return connect


_NUMERIC_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost", "0.0.0.0", "::"})


def _guard_getaddrinfo(real: Callable[..., Any]) -> Callable[..., Any]:
    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if name is not None and name not in _NUMERIC_LOOPBACK:
            raise GuardTripped(f"getaddrinfo({name!r}) would ask DNS")
        return real(host, *args, **kwargs)

    return getaddrinfo


def _trip(what: str) -> Callable[..., Any]:
    def tripped(*args: Any, **kwargs: Any) -> Any:
        raise GuardTripped(what)

    return tripped


def _would_serve(*args: Any, **kwargs: Any) -> Any:
    raise WouldServe("valid input: about to listen")


def install_guards(setattr_: Callable[[Any, str, Any], None],
                   delenv: Callable[[str], None]) -> None:
    """Patch the few places where the CLI would start or reach something real."""
    import skiplock.scenarios.bench.checker
    import skiplock.scenarios.bench.target
    import skiplock.scenarios.cli.target
    import skiplock.scenarios.run.runner
    import skiplock.scenarios.run.workers
    import skiplock.scenarios.servers.postgres as provision

    for name in _PG_ENV:
        delenv(name)
    real_choose = provision.choose_source

    def choose_source(dsn: str | None, docker_probe: Any) -> Any:
        return real_choose(dsn, lambda: False)  # never probe or start Docker

    setattr_(provision, "choose_source", choose_source)
    setattr_(provision, "_start_owned", _trip("would start a PostgreSQL server"))
    real_connect = psycopg.Connection.connect
    setattr_(psycopg, "connect", _guard_connect(real_connect))
    setattr_(psycopg.Connection, "connect",
             classmethod(lambda cls, *a, **k: _guard_connect(real_connect)(*a, **k)))
    setattr_(socket, "getaddrinfo", _guard_getaddrinfo(socket.getaddrinfo))
    setattr_(skiplock.scenarios.run.runner, "run_scenario", _trip("would run a scenario"))
    setattr_(skiplock.scenarios.run.workers.WorkerPool, "start", _trip("would start workers"))
    setattr_(skiplock.scenarios.cli.target, "serve", _would_serve)
    setattr_(skiplock.scenarios.bench.target, "bench", _would_serve)
    # The benchmark waits two seconds so that its history can be cached; no need here.
    setattr_(skiplock.scenarios.bench.checker, "_wait_until_cacheable", lambda run_dir: 0.0)


@pytest.fixture(autouse=True)
def _guards(monkeypatch: pytest.MonkeyPatch) -> None:
    install_guards(monkeypatch.setattr, lambda name: monkeypatch.delenv(name, raising=False))


# --------------------------------------------------------------------------------------------
# Running the CLI.
# --------------------------------------------------------------------------------------------

# Warnings a real process would print (Python's default filters hide these categories).
_HIDDEN_BY_DEFAULT = (DeprecationWarning, PendingDeprecationWarning, ImportWarning,
                      ResourceWarning)
# Third-party warnings known to be harmless, by (category name, message prefix).
KNOWN_WARNINGS: tuple[tuple[str, str], ...] = ()


@dataclass
class Outcome:
    argv: list[str]
    code: int | None
    stdout: str
    stderr: str
    guard: str | None = None
    served: bool = False

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]

    def __str__(self) -> str:
        return (f"argv={self.argv!r}\ncode={self.code} guard={self.guard}\n"
                f"stderr={self.stderr[-3000:]}\nstdout={self.stdout[-1500:]}")


@contextlib.contextmanager
def _inside(cwd: Path) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(old)


def run_cli(argv: Sequence[str], cwd: Path) -> Outcome:
    """`skiplock ARGV` in this process, with stdout and stderr captured as text and warnings
    shown as a real process would print them."""
    out, err = io.StringIO(), io.StringIO()
    code: int | None = None
    guard: str | None = None
    served = False
    with _inside(cwd), warnings.catch_warnings(record=True) as caught, \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        warnings.simplefilter("always")
        try:
            code = cli.main(list(argv))
        except SystemExit as exc:  # --help
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        except WouldServe:
            served = True
        except GuardTripped as exc:
            guard = str(exc)
    stderr = err.getvalue()
    for w in caught:
        if issubclass(w.category, _HIDDEN_BY_DEFAULT):
            continue
        if any(w.category.__name__ == c and str(w.message).startswith(m)
               for c, m in KNOWN_WARNINGS):
            continue
        stderr += warnings.formatwarning(w.message, w.category, w.filename, w.lineno, "")
    return Outcome(list(argv), code, out.getvalue(), stderr, guard, served)


def check_common(o: Outcome, allowed: set[int]) -> None:
    """The properties every command keeps, whatever its input."""
    assert o.guard is None, f"the CLI tried something real: {o.guard}\n{o}"
    if o.served:
        assert 0 in allowed, f"served on input that should be refused\n{o}"
        return
    assert o.code in {0, 1, 2, 3, 4}, o
    debug = _debug_given(o.argv)
    if not debug:
        assert "Traceback" not in o.stderr, o
    if o.code == 4 and _known_bug(o):
        return
    assert o.code != 4, f"a harness failure on generated input (a bug to report)\n{o}"
    if o.code == 0 and "usage:" in o.stdout:
        return  # --help, somewhere among the words
    assert o.code in allowed, f"exit {o.code} not in {sorted(allowed)}\n{o}"
    if o.code == 2:
        lines = o.lines
        if debug:
            assert lines and lines[-1].startswith("skiplock: "), o
        else:
            assert len(lines) == 1, f"exit 2 must be one line on stderr\n{o}"
            assert lines[0].startswith("skiplock: "), o


# Harness failures found by this test and not yet fixed: (commands, pattern of the last
# stderr line). Each entry is a bug to report; an empty tuple means none is known.
KNOWN_BUGS: tuple[tuple[frozenset[str], re.Pattern[str]], ...] = ()


def _known_bug(o: Outcome) -> bool:
    _, command = cli._global_options(o.argv)
    last = o.lines[-1] if o.lines else ""
    hit = any(command in commands and pattern.search(last) for commands, pattern in KNOWN_BUGS)
    if hit:
        _count("known_bugs", f"{command}: {last[:80]}")
    return hit


def _what(argv: Sequence[str], o: Outcome) -> str:
    """The command and its outcome, for the long run's tally."""
    _, command = cli._global_options(argv)
    if command == "bench":
        rest = argv[argv.index("bench") + 1:] if "bench" in argv else []
        command = f"bench {rest[0] if rest and not rest[0].startswith('-') else '?'}"[:20]
    return f"{command or '?'}:{'serve' if o.served else o.code}"


def _debug_given(argv: Sequence[str]) -> bool:
    debug, _ = cli._global_options(argv)
    return debug


# --------------------------------------------------------------------------------------------
# Strategies: hostile text, numbers, paths, DSNs.
# --------------------------------------------------------------------------------------------

_CHARS = st.characters(exclude_categories=["Cs"], exclude_characters="\x00")
# Text as a program's argv holds it: any Unicode, or bytes that are not UTF-8 (surrogates).
garbage: st.SearchStrategy[str] = st.one_of(
    st.text(_CHARS, max_size=24),
    st.binary(max_size=16).map(
        lambda b: b.replace(b"\x00", b"").decode("utf-8", "surrogateescape")),
    st.sampled_from(["", " ", "-", "--", "-x", "=", "\n", "\t", "\\", "'", '"', "%", "%s",
                     "{}", "$HOME", "~", "é", "\u202e", "\ufeff", "a" * 300]),
)
number_text: st.SearchStrategy[str] = st.one_of(
    st.sampled_from(["nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e309", "-1e309",
                     "1e308", "1e-320", "-0", "0", "0.0", "-1", "-0.5", "1", "2", "3", "5",
                     "10", "0.25", "1.5", "1e18", "-1e18", "9" * 40, "9" * 400, "0x10",
                     "1_000", " 1", "1 ", "+1", "٣", "1,5", "", "true"]),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats().map(repr),
    garbage,
)
int_text: st.SearchStrategy[str] = st.one_of(
    number_text, st.integers(min_value=-3, max_value=8).map(str))

# Every path is relative to the example's own directory: never a system path (as root, a
# command that writes `--out /dev/null` by renaming over it, or makes `/dev/null-runs`
# beside it, would change the machine).
_FIXED_PATHS = ["file.txt", "dir", "nope", "file.txt/sub", "dir/new/deeper", "", ".",
                "dir/../file.txt", "sp ace", "ü/ñ", "empty.toml", "run",
                "x" * 300, "dir/" + "x" * 300, "x" * 300 + ".toml", "/".join(["d"] * 2100)]


def _relative(text: str) -> str:
    """A generated path that stays inside the example's own directory."""
    parts = [p if p != ".." else "_" for p in text.replace("\\", "/").split("/")]
    path = "/".join(parts).lstrip("/")
    return path


paths: st.SearchStrategy[str] = st.one_of(st.sampled_from(_FIXED_PATHS), garbage.map(_relative))

_DSN_QUERY = ["", "?sslmode=bogus", "?connect_timeout=-1", "?connect_timeout=nan",
              "?nonsense=1", "?application_name=%zz", "?options=-c%20x", "?port=99999",
              "?sslmode=require", "?target_session_attrs=any"]


def _no_host_words(text: str) -> bool:
    low = text.lower()
    return "host" not in low and "service" not in low and "port" not in low


dsn_piece = garbage.filter(_no_host_words)


@st.composite
def uri_dsns(draw: st.DrawFn) -> str:
    scheme = draw(st.sampled_from(["postgresql", "postgres", "POSTGRESQL", "pg", "http"]))
    user = draw(st.one_of(st.just("u"), dsn_piece))
    password = draw(st.one_of(st.just("p"), dsn_piece,
                              st.sampled_from(["p@ss", "a/b", "x:y", "p@127.0.0.1", "%40",
                                               "%zz", "p?q", "p#q", "@", "/"])))
    if draw(st.booleans()):
        user, password = (quote(x.encode("utf-8", "surrogateescape"), safe="")
                          for x in (user, password))
    auth = draw(st.sampled_from(["{u}:{p}@", "{u}@", ":{p}@", "", "{u}:{p}@{u}:{p}@"]))
    host = draw(st.sampled_from(["127.0.0.1", "[::1]", "127.0.0.1,127.0.0.1"]))
    port = draw(st.sampled_from([CLOSED_PORT, CLOSED_PORT, "99999", "abc", "-1", "0",
                                 f"{CLOSED_PORT},{CLOSED_PORT}"]))
    if "," in host and "," not in port:
        port = f"{port},{port}"
    db = draw(st.one_of(st.just("db"), dsn_piece))
    query = draw(st.sampled_from(_DSN_QUERY))
    return (f"{scheme}://{auth.format(u=user, p=password)}{host}:{port}/"
            f"{db.replace('?', '_')}{query}")


def _quoted(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


@st.composite
def keyword_dsns(draw: st.DrawFn) -> str:
    password = draw(dsn_piece)
    dbname = draw(dsn_piece)
    quote_it = draw(st.booleans())
    pw = _quoted(password) if quote_it else password
    db = _quoted(dbname) if quote_it else dbname
    extra = draw(st.sampled_from(["", " sslmode=bogus", " connect_timeout=x", " bogus=1",
                                  " password='unterminated"]))
    return f"host=127.0.0.1 port={CLOSED_PORT} user=u password={pw} dbname={db}{extra}"


def _may_generate(dsn: str) -> bool:
    """A DSN a command may connect with names the closed port, or cannot be parsed, or is
    one `dsn_view` does not trust (libpq would misread it): those every command must refuse
    before connecting. Any other DSN (random text that libpq reads as a real host, a Unix
    socket) would only trip the guard, a tester's mistake rather than the CLI's."""
    try:
        if _connect_target_problem(dsn, {}) is None:
            return True
    except Exception:
        return True
    try:
        return not dsn_view(dsn).trusted
    except Exception:
        return True  # dsn_view itself fails: the CLI should say so in one line


dsns: st.SearchStrategy[str] = st.one_of(
    st.just(CLOSED_DSN),
    st.just(CLOSED_DSN),
    st.sampled_from([
        "", " ", "postgresql://", "postgresql://[::1", f"postgresql://127.0.0.1:{CLOSED_PORT}",
        f"postgresql://u@127.0.0.1:{CLOSED_PORT},127.0.0.1:{CLOSED_PORT}/db",
        f"host=127.0.0.1 port={CLOSED_PORT}", "notadsn", "=", "host=", "postgresql://u:p%@x",
        f"postgresql://u:p@127.0.0.1:{CLOSED_PORT}/db?host=",
        f"postgresql://u:p@@127.0.0.1:{CLOSED_PORT}/db",
        f"postgresql://u:p/q@127.0.0.1:{CLOSED_PORT}/db",
        f"postgresql://u:\udcff@127.0.0.1:{CLOSED_PORT}/db",
        f"postgresql://\u00fc:\u00e9@127.0.0.1:{CLOSED_PORT}/db",
        f"postgresql:///db?host=127.0.0.1&port={CLOSED_PORT}",
    ]),
    uri_dsns(),
    keyword_dsns(),
    garbage,
).filter(_may_generate)

# Plug-in names: the shipped ones, names the factory syntax refuses, and a few importable
# modules that are no queue factory (never an arbitrary module: importing one may act).
_FACTORY_SYNTAX = re.compile(r"^[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
backends: st.SearchStrategy[str] = st.one_of(
    st.sampled_from([*BACKEND_NAMES, "bullmq", "pg", "PG", "pg-naive ", "memory", "json:loads",
                     "json:nope", "os.path:join", "skiplock_no_such_module_xyz:factory",
                     "skiplock.queue_impl.memory:MemoryQueue",
                     "skiplock.scenarios.run.spec:SCALAR_KEYS", ":", "a:",
                     ":b", "a.:b", "1a:b"]),
    garbage.filter(lambda s: not _FACTORY_SYNTAX.match(s)),
)


# --------------------------------------------------------------------------------------------
# Scenario files.
# --------------------------------------------------------------------------------------------

_FLOAT_KEYS = ("warmup", "duration", "drain_timeout", "rate", "lease", "http_timeout",
               "write_margin", "write_gather", "poll", "recovery_interval", "retry_base",
               "retry_cap",
               "retry_jitter", "slow_seconds", "hang_seconds", "quiesce", "restart_delay")
_INT_KEYS = ("producers", "users", "enqueue_batch", "workers", "batch", "max_attempts",
             "fail_times", "fail_status")
_BOOL_KEYS = ("distributed", "recovery", "renew_leases", "refill", "unsafe_timing", "supervise")
_STR_KEYS = ("name", "description")

hostile_float = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 0.0, -0.0, 5e-324]),
    st.integers(min_value=-(2**70), max_value=2**70),
)
hostile_int = st.one_of(
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([0, -1, 2**63, 2**63 - 1, -(2**63), 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
)
names = st.one_of(
    st.sampled_from(["../x", "a/b", "a\\b", "", ".hidden", "x" * 65, "x" * 64, "ok-name",
                     "ok.name", "-dash", "sp ace", "ü", "..", ".", "a\nb", "a\x00b", "CON",
                     "nul", "a:b", "*", "?"]),
    st.text(_CHARS, max_size=70),
)


def _wrong_type() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.text(_CHARS, max_size=8), st.booleans(), st.lists(st.integers(), max_size=3),
        st.dictionaries(st.sampled_from(["a", "b"]), st.integers(), max_size=2),
        st.sampled_from(["4", "true", "nan", "10", "unlimited"]))


def _value_for(key: str) -> st.SearchStrategy[Any]:
    if key in _FLOAT_KEYS:
        plausible: st.SearchStrategy[Any] = st.one_of(
            st.floats(min_value=0, max_value=60), st.integers(min_value=0, max_value=60))
        return st.one_of(plausible, plausible, hostile_float, _wrong_type())
    if key in _INT_KEYS:
        return st.one_of(st.integers(min_value=0, max_value=20),
                         st.integers(min_value=100, max_value=599), hostile_int, _wrong_type())
    if key in _BOOL_KEYS:
        return st.one_of(st.booleans(), st.booleans(), _wrong_type(), hostile_int)
    if key == "name":
        return st.one_of(names, names, _wrong_type(), hostile_int)
    return st.one_of(st.text(_CHARS, max_size=40), _wrong_type())


account_limits = st.one_of(
    st.integers(min_value=1, max_value=10),
    st.sampled_from(["unlimited", "UNLIMITED", " unlimited ", "lots", "", "4", 0, -1, 1.5,
                     True, 2**63, 2**64, 10**30, math.nan, math.inf]),
    _wrong_type(),
)
weights = st.one_of(st.floats(min_value=0, max_value=10), st.integers(min_value=0, max_value=5),
                    hostile_float, _wrong_type())
table_keys = st.one_of(st.sampled_from(["acme", "bulk", "a.b", "", " ", "ü", "a b", '"q"']),
                       st.text(_CHARS, min_size=1, max_size=10))


@st.composite
def nemesis_entry(draw: st.DrawFn) -> Any:
    shape = draw(st.sampled_from(["table"] * 6 + ["int", "string", "list"]))
    if shape == "int":
        return draw(st.integers())
    if shape == "string":
        return draw(st.sampled_from(NEMESIS_KINDS))
    if shape == "list":
        return draw(st.lists(st.integers(), max_size=2))
    entry: dict[str, Any] = {}
    if draw(st.integers(0, 9)):
        entry["kind"] = draw(st.one_of(st.sampled_from(NEMESIS_KINDS),
                                       st.text(_CHARS, max_size=12), hostile_int))
    for key, strategy in (
        ("at", st.one_of(st.floats(min_value=0, max_value=20), hostile_float, _wrong_type())),
        ("interval", st.one_of(st.floats(min_value=0, max_value=10), hostile_float)),
        ("duration", st.one_of(st.floats(min_value=0, max_value=10), hostile_float)),
        ("count", st.one_of(st.integers(min_value=0, max_value=4), hostile_int, _wrong_type())),
        ("probability", st.one_of(st.floats(min_value=0, max_value=1), hostile_float)),
        ("external", st.one_of(st.sampled_from(["refuse", "skip", "SKIP", ""]), hostile_int)),
        ("phase", st.one_of(st.sampled_from(["lease", "claim", "commit", "nope"]), st.booleans())),
        ("bogus", st.integers()),
    ):
        if draw(st.integers(0, 3)) == 0:
            entry[key] = draw(strategy)
    return entry


@st.composite
def scenario_documents(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(SCALAR_KEYS), max_size=8, unique=True)):
        doc[key] = draw(_value_for(key))
    if draw(st.integers(0, 4)) == 0:
        doc[draw(st.one_of(st.sampled_from(["nope", "Duration", "accounts.x", "nemesis_",
                                            "mix.slow"]), table_keys))] = draw(st.integers())
    if draw(st.booleans()):
        doc["accounts"] = draw(st.one_of(
            st.dictionaries(table_keys, account_limits, max_size=4),
            st.dictionaries(table_keys, account_limits, max_size=4),
            _wrong_type()))
    if draw(st.booleans()):
        doc["mix"] = draw(st.one_of(
            st.dictionaries(st.one_of(st.sampled_from(SCRIPT_NAMES), table_keys), weights,
                            max_size=4), _wrong_type()))
    if draw(st.integers(0, 3)) == 0:
        doc["account_mix"] = draw(st.one_of(st.dictionaries(table_keys, weights, max_size=3),
                                            _wrong_type()))
    if draw(st.integers(0, 3)) == 0:
        doc["failpoints"] = draw(st.one_of(st.dictionaries(
            st.one_of(st.sampled_from(FAILPOINT_NAMES), table_keys), weights, max_size=2),
            _wrong_type()))
    if draw(st.booleans()):
        doc["nemesis"] = draw(st.one_of(st.lists(nemesis_entry(), max_size=3),
                                        st.lists(nemesis_entry(), max_size=3), _wrong_type()))
    return doc


def _seconds(low: float, high: float) -> st.SearchStrategy[Any]:
    return st.one_of(st.floats(min_value=low, max_value=high),
                     st.integers(min_value=math.ceil(low), max_value=math.floor(high)))


_PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "warmup": _seconds(0, 5), "duration": _seconds(1, 20), "drain_timeout": _seconds(1, 60),
    "rate": _seconds(0, 100), "producers": st.integers(1, 4), "users": st.integers(1, 8),
    "enqueue_batch": st.integers(1, 10), "distributed": st.booleans(),
    "workers": st.integers(1, 8), "batch": st.integers(1, 20), "lease": _seconds(10, 30),
    "http_timeout": _seconds(0.1, 3), "write_margin": _seconds(0, 5), "poll": _seconds(0.1, 2),
    "write_gather": _seconds(0, 1),
    "recovery": st.booleans(), "recovery_interval": _seconds(0.1, 2),
    "renew_leases": st.booleans(), "refill": st.booleans(), "unsafe_timing": st.booleans(),
    "retry_base": _seconds(0, 1), "retry_cap": _seconds(1, 10), "retry_jitter": _seconds(0, 1),
    "max_attempts": st.integers(1, 10), "fail_times": st.integers(1, 5),
    "fail_status": st.integers(100, 599), "slow_seconds": _seconds(0, 2),
    "hang_seconds": _seconds(0, 5), "quiesce": _seconds(0, 5), "supervise": st.booleans(),
    "restart_delay": _seconds(0, 2),
    "name": st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,20}", fullmatch=True),
    "description": st.text(_CHARS, max_size=40),
}
_ACCOUNT = st.from_regex(r"[a-z][a-z0-9_-]{0,8}", fullmatch=True)


@st.composite
def plausible_documents(draw: st.DrawFn) -> dict[str, Any]:
    """A scenario every check accepts: it may only be refused for the closed port."""
    doc: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(sorted(_PLAUSIBLE)), min_size=1, max_size=10,
                             unique=True)):
        doc[key] = draw(_PLAUSIBLE[key])
    if draw(st.booleans()):
        doc["accounts"] = draw(st.dictionaries(_ACCOUNT, st.one_of(
            st.integers(1, 10), st.just("unlimited")), min_size=1, max_size=4))
        if draw(st.booleans()):
            doc["account_mix"] = {a: draw(st.integers(1, 5)) for a in doc["accounts"]}
    if draw(st.booleans()):
        mix = draw(st.dictionaries(st.sampled_from(SCRIPT_NAMES), _seconds(0, 5), max_size=4))
        mix[draw(st.sampled_from(SCRIPT_NAMES))] = draw(st.integers(1, 5))
        doc["mix"] = mix
    failpoints = draw(st.booleans())
    if failpoints:
        doc["failpoints"] = draw(st.dictionaries(st.sampled_from(FAILPOINT_NAMES),
                                                 _seconds(0, 1), min_size=1, max_size=2))
    if draw(st.booleans()):
        duration = float(doc.get("duration", 10.0))
        kinds = [k for k in NEMESIS_KINDS if not (failpoints and k in FAILPOINT_NAMES)]
        entries = []
        for _ in range(draw(st.integers(1, 3))):
            kind = draw(st.sampled_from(kinds))
            entry: dict[str, Any] = {"kind": kind, "at": draw(st.floats(0, duration / 2)),
                                     "external": "skip"}
            interval = st.one_of(st.just(0.0), _seconds(0.1, 5))  # 0: once; else >= 0.1 s
            for key, strategy in (("interval", interval), ("duration", _seconds(0, 5)),
                                  ("count", st.integers(1, 3)),
                                  ("probability", _seconds(0, 1))):
                if draw(st.booleans()):
                    entry[key] = draw(strategy)
            if kind == "pause_worker" and draw(st.booleans()):
                entry["phase"] = draw(st.sampled_from(["lease", "claim"]))
            entries.append(entry)
        doc["nemesis"] = entries
    return doc


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else toml_string(key)


def toml_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def to_toml(doc: Mapping[str, Any]) -> str:
    """A document as TOML text: scalars first, then tables, then arrays of tables."""
    lines: list[str] = []
    tables: list[tuple[str, Mapping[str, Any]]] = []
    arrays: list[tuple[str, list[Mapping[str, Any]]]] = []
    for key, value in doc.items():
        if isinstance(value, dict) and key in ("accounts", "mix", "account_mix", "failpoints"):
            tables.append((key, value))
        elif (isinstance(value, list) and value and key == "nemesis"
              and all(isinstance(v, dict) for v in value)):
            arrays.append((key, value))
        else:
            lines.append(f"{toml_key(key)} = {toml_value(value)}")
    for key, table in tables:
        lines.append(f"[{toml_key(key)}]")
        lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items()]
    for key, entries in arrays:
        for entry in entries:
            lines.append(f"[[{toml_key(key)}]]")
            lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


@st.composite
def scenario_files(draw: st.DrawFn) -> bytes:
    """A scenario file's bytes: a generated document, maybe damaged."""
    kind = draw(st.sampled_from(["doc"] * 8 + ["empty", "comments", "bytes", "raw"]))
    if kind == "empty":
        return b""
    if kind == "comments":
        return b"# nothing here\n\n   \n# still nothing\n"
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "raw":
        return draw(st.text(_CHARS, max_size=200)).encode("utf-8", "surrogatepass")
    data = to_toml(draw(scenario_documents())).encode()
    damage = draw(st.sampled_from(["none"] * 6 + ["bom", "inject", "cut", "latin1"]))
    if damage == "bom":
        data = b"\xef\xbb\xbf" + data
    elif damage == "inject":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]
    elif damage == "cut":
        data = data[: draw(st.integers(0, len(data)))]
    elif damage == "latin1":
        data = data.decode().encode("latin-1", "replace") + b'description = "caf\xe9"\n'
    return data


file_stems = st.one_of(st.sampled_from(["mine", "steady", "x" * 70, "", ".", "a b", "ü",
                                        ".hidden", "-dash", "a.b"]),
                       st.text(st.characters(exclude_categories=["Cs"],
                                             exclude_characters="\x00/"), max_size=40))


def write_scenario(root: Path, stem: str, data: bytes) -> Path:
    path = root / "scenarios" / f"{stem}.toml"
    if len(path.name.encode()) > 250:
        path = root / "scenarios" / "long.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return path


# --------------------------------------------------------------------------------------------
# The example's own directory: a file, a directory, SQL files, a good run.
# --------------------------------------------------------------------------------------------

SUCCEED: dict[str, Any] = {"name": "succeed", "first": {"behaviour": "ok"}, "times": None,
                           "then": {"behaviour": "ok"}}
FAIL_TWICE: dict[str, Any] = {"name": "fail-2x-503",
                              "first": {"behaviour": "status", "status": 503}, "times": 2,
                              "then": {"behaviour": "ok"}}
ALWAYS_400: dict[str, Any] = {"name": "always-400",
                              "first": {"behaviour": "status", "status": 400}, "times": None,
                              "then": {"behaviour": "ok"}}


def good_run(run_dir: Path) -> Path:
    b = RunBuilder()
    for n, at in enumerate((100.0, 101.0)):
        b.enqueue(f"job-{n}", script=SUCCEED, time=at - 0.5)
        b.attempt(f"job-{n}", 1, claimed=at)
        b.final(f"job-{n}", "COMPLETED")
    return b.write(run_dir)


_E2E = ('{"benchmark": "e2e", "params": {"enqueue_batch": %s}, "queue": {"jobs_per_second":'
        ' 3000.0}, "e2e": {"jobs_per_second": %s, "job_p99_ms": 40.0}, "ratio": 0.8}')
# Result files for `compare`: two alike but for a setting, and figures no result should hold.
_RESULTS = {
    "base.json": _E2E % ("1", "2400.0"),
    "batch10.json": _E2E % ("10", "2400.0"),
    "nan.json": _E2E % ("1", "NaN"),
    "bool.json": _E2E % ("1", "true"),
    "huge.json": _E2E % ("1", "1" + "0" * 400),
    "deep.json": "[" * 50_000 + "]" * 50_000,
}


@contextlib.contextmanager
def sandbox() -> Iterator[Path]:
    """A fresh directory per example, with the entries the path strategies name."""
    with tempfile.TemporaryDirectory(prefix="skiplock-prop-") as tmp:
        root = Path(tmp)
        (root / "file.txt").write_text("not a directory\n")
        (root / "dir").mkdir()
        (root / "empty.toml").write_text("")
        (root / "good.sql").write_text("-- name: recover\nSELECT 1\n")
        (root / "bad.sql").write_text("-- name: nope\nSELECT %(x)s\n")
        (root / "latin1.sql").write_bytes(b"-- name: recover\nSELECT '\xe9'\n")
        for name, text in _RESULTS.items():
            (root / name).write_text(text)
        good_run(root / "run")
        yield root


sql_paths = st.one_of(st.sampled_from(["good.sql", "bad.sql", "latin1.sql", "empty.toml"]),
                      paths)


# --------------------------------------------------------------------------------------------
# Command lines.
# --------------------------------------------------------------------------------------------

def parser_of(*command: str) -> argparse.ArgumentParser:
    """The argparse parser of `skiplock COMMAND [SUBCOMMAND]`, as the CLI builds it."""
    parser: argparse.ArgumentParser = cli.build_parser(only=command[0])
    for word in command:
        [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[word]
    return parser


def options_of(parser: argparse.ArgumentParser,
               special: Mapping[str, st.SearchStrategy[str] | None] | None = None,
               ) -> dict[str, st.SearchStrategy[str] | None]:
    """Every long option of `parser`, each with a strategy for its value: `special`'s where
    it gives one, else one from how the option is declared (a flag takes none; choices,
    whole numbers, numbers and paths their own, plus garbage). Built from the parser, so a
    flag added to a command is fuzzed from the start."""
    special = special or {}
    unknown = set(special) - {f for a in parser._actions for f in a.option_strings}
    assert not unknown, f"fuzzed flags the parser does not have: {sorted(unknown)}"
    options: dict[str, st.SearchStrategy[str] | None] = {}
    for action in parser._actions:
        longs = [f for f in action.option_strings if f.startswith("--")]
        if not longs or isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        flag = longs[0]
        if flag in special:
            options[flag] = special[flag]
        elif action.nargs == 0:
            options[flag] = None
        elif action.choices is not None:
            options[flag] = st.one_of(st.sampled_from([str(c) for c in action.choices]),
                                      garbage)
        elif action.type is int:
            options[flag] = int_text
        elif action.type is float:
            options[flag] = number_text
        elif action.type is Path:
            options[flag] = paths
        else:
            options[flag] = garbage
    return options



def _flags(draw: st.DrawFn, options: Mapping[str, st.SearchStrategy[str] | None],
           max_size: int = 6) -> list[str]:
    words: list[str] = []
    chosen = draw(st.lists(st.sampled_from(sorted(options)), max_size=max_size))
    for name in chosen:
        strategy = options[name]
        if strategy is None:
            words.append(name)
            continue
        value = draw(strategy)
        if draw(st.integers(0, 3)) == 0:
            words.append(f"{name}={value}")
        else:
            words += [name, value]
    return words


_NEMESIS_LIST = st.one_of(
    st.lists(st.one_of(st.sampled_from(NEMESIS_KINDS), garbage), max_size=3).map(",".join),
    garbage)
_SET_KEYS = st.one_of(st.sampled_from([*SCALAR_KEYS, "accounts.acme", "accounts.", "mix.slow",
                                       "mix.nope", "account_mix.acme", "failpoints.crash_after_"
                                       "claim", "failpoints.x", "nemesis", "nope", ""]),
                      garbage)
set_items = st.one_of(
    st.builds(lambda k, v: f"{k}={v}", _SET_KEYS, st.one_of(number_text, names, garbage)),
    garbage)


redis_urls = st.one_of(garbage, st.sampled_from(
    ["redis://127.0.0.1:1/0", "redis://:pw@127.0.0.1:1/0", "http://x", "", "redis://[::1"]))


def _scenario_options(parser: argparse.ArgumentParser
                      ) -> dict[str, st.SearchStrategy[str] | None]:
    """The values worth more than their type for `run` and `demo` (those it has)."""
    special: dict[str, st.SearchStrategy[str] | None] = {
        "--backend": backends, "--redis-url": redis_urls, "--seed": int_text, "--out": paths,
        "--dsn": dsns, "--sql": sql_paths, "--nemesis": _NEMESIS_LIST, "--set": set_items,
    }
    flags = {f for a in parser._actions for f in a.option_strings}
    return {flag: strategy for flag, strategy in special.items() if flag in flags}


scenario_args = st.one_of(st.sampled_from(available()), st.sampled_from(
    ["nope", "steady.toml", "scenarios/", "file.txt", "dir", "empty.toml", "-", ""]), garbage)


@dataclass
class Line:
    """A generated command line and the exit codes it may give (1 never, for commands that
    cannot reach a server; `check` decides its own)."""

    argv: list[str]
    allowed: set[int] = field(default_factory=lambda: {2})


@st.composite
def run_lines(draw: st.DrawFn, command: str) -> Line:
    options = options_of(parser_of(command), _scenario_options(parser_of(command)))
    words = [command]
    if command == "run" or draw(st.booleans()):
        words.append(draw(scenario_args))
    words += _flags(draw, options)
    # The closed port last, unless the hostile DSN above is the one to judge.
    words += closed_port_last(draw, words)
    return Line(words)


def closed_port_last(draw: st.DrawFn, words: list[str]) -> list[str]:
    """`--dsn` at the closed port, last (so it wins), unless a hostile DSN drawn above is the
    one to judge."""
    if draw(st.integers(0, 2)) or not any(w.startswith("--dsn") for w in words):
        return ["--dsn", CLOSED_DSN]
    return []


@st.composite
def gate_lines(draw: st.DrawFn) -> Line:
    words = ["gate", *_flags(draw, options_of(parser_of("gate"), {
        "--backend": backends, "--sql": sql_paths, "--dsn": dsns, "--seed": int_text,
        "--seeds": st.one_of(int_text, st.sampled_from(["1000000000000", "1001", "1000"])),
        "--only": st.one_of(st.lists(st.one_of(
            st.sampled_from(available()), garbage), max_size=3).map(",".join), paths,
            st.sampled_from(["", ",", " , "])),
        "--set": set_items, "--out": paths,
    }))]
    words += closed_port_last(draw, words)
    return Line(words)


@st.composite
def worker_lines(draw: st.DrawFn) -> Line:
    words = ["worker", *_flags(draw, options_of(parser_of("worker"), {
        "--dsn": dsns, "--backend": backends, "--sql": sql_paths,
        "--allow-target": st.one_of(st.sampled_from(
            ["127.0.0.1:8080", "[::1]:80", "[x]:1", "host:0", "a:99999", ":80", "a:b",
             "127.0.0.1:٣"]), garbage),
        "--events-dir": paths,
        "--failpoint": st.one_of(st.builds(lambda n, p: f"{n}={p}", st.one_of(
            st.sampled_from(FAILPOINT_NAMES), garbage), number_text), garbage),
    }), max_size=8)]
    words += closed_port_last(draw, words)
    return Line(words)


@st.composite
def target_lines(draw: st.DrawFn) -> Line:
    words = ["target", *_flags(draw, options_of(parser_of("target"), {
        "--host": st.one_of(st.sampled_from(["127.0.0.1", "::1", "localhost", "0.0.0.0",
                                             "10.0.0.1", "example.com", "::", "127.1",
                                             "[::1]", "::ffff:127.0.0.1", ""]), garbage),
        "--port": int_text, "--name": st.one_of(names, garbage), "--out": paths,
    }))]
    return Line(words, allowed={2, 0})


# Deliveries for `bench checker`: anything argparse refuses or a small count (a large valid
# one would build that many deliveries).
def _small_or_refused(text: str) -> bool:
    try:
        return int(text) <= 60
    except ValueError:
        return True


@st.composite
def bench_lines(draw: st.DrawFn) -> Line:
    which = draw(st.sampled_from(["queue", "e2e", "claim", "checker", "target", "recovery",
                                  "nope", ""]))
    words = ["bench"] + ([which] if which else [])
    allowed = {2}
    if which == "queue":
        words += _flags(draw, options_of(parser_of("bench", "queue"), {
            "--redis-url": redis_urls, "--dsn": dsns, "--out": paths}))
    elif which == "e2e":
        words += _flags(draw, options_of(parser_of("bench", "e2e"), {
            "--redis-url": redis_urls, "--dsn": dsns, "--out": paths}))
    elif which == "claim":
        words += _flags(draw, options_of(parser_of("bench", "claim"), {
            "--backlogs": st.one_of(garbage, st.sampled_from(
                ["10,100", "0", "1,x", "-5", "99999999999"])),
            "--sql": paths, "--dsn": dsns, "--out": paths}))
    elif which == "checker":
        # A small history first (the default is a million deliveries); the flags may
        # override it with a hostile count.
        words += ["--deliveries", str(draw(st.integers(1, 40)))]
        words += _flags(draw, options_of(parser_of("bench", "checker"), {
            "--deliveries": int_text.filter(_small_or_refused), "--out": paths,
            "--keep": paths}))
        allowed = {0, 2}  # a synthetic correct history: valid, never 1
    elif which == "target":
        words += _flags(draw, options_of(parser_of("bench", "target"), {"--out": paths}))
        allowed = {0, 2}
    elif which == "recovery":
        words += _flags(draw, options_of(parser_of("bench", "recovery"), {
            "--kinds": _NEMESIS_LIST, "--dsn": dsns, "--out": paths, "--runs": paths}))
    if which in ("queue", "recovery", "e2e", "claim"):
        words += closed_port_last(draw, words)
    return Line(words, allowed=allowed)


@st.composite
def sweep_lines(draw: st.DrawFn) -> Line:
    words = ["sweep", *draw(st.lists(st.one_of(names, garbage), max_size=1))]
    words += _flags(draw, options_of(parser_of("sweep"), {
        "--rates": st.one_of(garbage, number_text, st.sampled_from(
            ["10,20", "20,10", "0", "1,,2", "nan"])),
        "--set": st.one_of(garbage, st.sampled_from(["workers=2", "nope=1", "rate=x"])),
        "--dsn": dsns, "--out": paths}))
    words += closed_port_last(draw, words)
    return Line(words, allowed={2})


@st.composite
def compare_lines(draw: st.DrawFn) -> Line:
    files = draw(st.lists(st.one_of(st.sampled_from(sorted(_RESULTS)), paths, garbage),
                          max_size=3))
    words = ["compare", *files, *_flags(draw, options_of(parser_of("compare"),
                                                         {"--threshold": number_text}))]
    # Two readable results of different settings pass with a warning (0), or --strict
    # refuses them (2); a regression (1) cannot arise: their figures are equal.
    return Line(words, allowed={0, 2})


@st.composite
def plans_lines(draw: st.DrawFn) -> Line:
    words = ["plans", *_flags(draw, options_of(parser_of("plans"), {
        "--sizes": st.one_of(garbage, st.sampled_from(
            ["10k,100k", "1m", "0", "1,x", "-5", "10k,10k", "99999999999999", "100m",
             "10k,100m"])),
        "--sql": paths, "--dsn": dsns, "--out": paths}))]
    words += closed_port_last(draw, words)
    return Line(words, allowed={2})


@st.composite
def report_lines(draw: st.DrawFn) -> Line:
    dirs = draw(st.lists(st.one_of(st.just("run"), paths), min_size=0, max_size=2))
    return Line(["report", *dirs, *_flags(draw, options_of(parser_of("report"),
                                                          {"--out": paths}))],
                allowed={0, 2})


@st.composite
def check_lines(draw: st.DrawFn) -> Line:
    dirs = draw(st.lists(st.one_of(st.just("run"), paths), min_size=0, max_size=3))
    words = ["check", *dirs, *_flags(draw, options_of(parser_of("check"), {
        "--tolerance": number_text, "--examples": int_text,
        "--set": st.one_of(garbage, st.sampled_from(
            ["objectives.first_delivery_p99=0.5", "objectives.nope=1", "rate=2",
             "objectives.account.x.oldest_due_age=nan", "objectives.delivered_ratio=2"]))}))]
    return Line(words, allowed={0, 2, 3})


@st.composite
def command_lines(draw: st.DrawFn) -> Line:
    line: Line = draw(st.one_of(
        run_lines("run"), run_lines("demo"), gate_lines(), worker_lines(), target_lines(),
        bench_lines(), check_lines(), sweep_lines(), compare_lines(), plans_lines(),
        report_lines(), st.lists(garbage, max_size=3).map(Line)))
    if draw(st.integers(0, 9)) == 0:
        line.argv.insert(0, "--debug")
    if draw(st.integers(0, 19)) == 0:
        line.argv.insert(draw(st.integers(0, len(line.argv))), draw(st.sampled_from(
            ["--help", "-h", "--", "--debug", "--dsn"])))
    return line


# --------------------------------------------------------------------------------------------
# Properties: command lines and scenario files.
# --------------------------------------------------------------------------------------------


def test_command_lines_exit_with_a_known_code_and_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    @PROFILE
    @given(line=command_lines())
    def prop(line: Line) -> None:
        with sandbox() as root:
            outcome = run_cli(line.argv, root)
        note(str(outcome))
        _count("command_lines", _what(line.argv, outcome))
        check_common(outcome, line.allowed)

    drive("command_lines", prop, capsys)


def test_plausible_scenario_files_reach_the_closed_port_and_one_bad_value_does_not(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A file every check accepts is refused only for the closed port; the same file with one
    value made hostile is refused for that value, or still reaches only the port."""

    @PROFILE
    @given(doc=plausible_documents(), data=st.data(),
           command=st.sampled_from(["run", "run", "demo", "gate"]))
    def prop(doc: dict[str, Any], data: st.DataObject, command: str) -> None:
        doc = dict(doc)
        mutated = data.draw(st.booleans(), label="mutate")
        if mutated:
            key = data.draw(st.sampled_from(sorted(doc)), label="key")
            doc[key] = data.draw(_value_for(key) if key in SCALAR_KEYS else _wrong_type(),
                                 label="value")
        with sandbox() as root:
            path = write_scenario(root, "plausible", to_toml(doc).encode())
            argv = (["gate", "--only", str(path), "--out", "gate"] if command == "gate"
                    else [command, str(path)])
            outcome = run_cli([*argv, "--dsn", CLOSED_DSN], root)
        note(f"doc: {doc!r}")
        note(str(outcome))
        reached = "cannot connect to PostgreSQL" in outcome.stderr
        _count("plausible", f"{command}:{outcome.code}:{'mutated' if mutated else 'as made'}:"
                            f"{'port' if reached else 'file'}")
        check_common(outcome, {2})
        if not mutated:
            assert reached, f"a plausible file refused\n{outcome}"

    drive("plausible", prop, capsys)


def test_scenario_files_are_refused_in_one_line_or_reach_only_the_closed_port(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`run`, `demo` and `gate --only` on a generated file: exit 2 (the file is refused, or
    it is fine and the closed port is refused), one line, nothing started."""

    @PROFILE
    @given(data=scenario_files(), stem=file_stems,
           how=st.sampled_from(["absolute", "relative", "dot"]),
           command=st.sampled_from(["run", "run", "demo", "gate"]),
           extra=st.lists(set_items, max_size=2))
    def prop(data: bytes, stem: str, how: str, command: str, extra: list[str]) -> None:
        with sandbox() as root:
            path = write_scenario(root, stem, data)
            given_as = {"absolute": str(path), "relative": str(path.relative_to(root)),
                        "dot": f"./{path.relative_to(root)}"}[how]
            sets = [w for item in extra for w in ("--set", item)]
            if command == "gate":
                argv = ["gate", "--only", given_as, "--out", "gate", *sets]
            else:
                argv = [command, given_as, *sets]
            outcome = run_cli([*argv, "--dsn", CLOSED_DSN], root)
        note(f"file: {data!r}")
        note(str(outcome))
        reached = "cannot connect to PostgreSQL" in outcome.stderr
        _count("scenario_files", f"{command}:{outcome.code}:{'port' if reached else 'file'}")
        check_common(outcome, {2})

    drive("scenario_files", prop, capsys)


# --------------------------------------------------------------------------------------------
# Damaged run directories for `check`.
# --------------------------------------------------------------------------------------------

# The table of what a cut log may hide (docs/reference/anomalies.md, "A history cut off").
VIOLATIONS = ("lost", "unexpected", "duplicate_unexplained", "concurrent_delivery",
              "attempts_exceeded", "early_retry", "limit_exceeded", "stuck", "state_mismatch",
              "stale_write")
NOT_REPORTED_WHEN_CUT: dict[str, frozenset[str]] = {
    "enqueues.csv": frozenset({"unexpected", "lost"}),
    "deliveries": frozenset({"unexpected", "lost", "state_mismatch", "duplicate_unexplained",
                             "early_retry", "attempts_exceeded"}),
    "workers": frozenset(VIOLATIONS) - {"stale_write", "stuck"},
    "nemesis.jsonl": frozenset(VIOLATIONS) - {"stale_write", "stuck", "limit_exceeded"},
    "final_jobs.csv": frozenset({"unexpected", "lost", "state_mismatch"}),
}
REQUIRED = ("spec.json", "run.json", "enqueues.csv", "final_jobs.csv", "deliveries", "workers")
JOB_KINDS = ("succeed", "retry", "dead", "dup_info", "dup_killed")
BAD_KINDS = ("stuck", "dup_unexplained", "unexpected", "completed_undelivered")


def build_history(run_dir: Path, jobs: Sequence[str], workers: int) -> Path:
    """A history of one job per entry of `jobs`, 40 s apart; the JOB_KINDS are correct,
    the BAD_KINDS each a violation."""
    b = RunBuilder()
    for n, kind in enumerate(jobs):
        job = f"job-{n}"
        at = 1010.0 + 40 * n
        worker = f"worker-{n % workers}"
        other = f"worker-{(n + 1) % workers}"
        if kind == "succeed":
            b.enqueue(job, script=SUCCEED, time=at - 0.5)
            b.attempt(job, 1, claimed=at, worker=worker)
            b.final(job, "COMPLETED")
        elif kind == "retry":
            b.enqueue(job, script=FAIL_TWICE, time=at - 0.5)
            b.attempt(job, 1, claimed=at, status=503, behaviour="status", worker=worker)
            b.attempt(job, 2, claimed=at + 5, status=503, behaviour="status", worker=other)
            b.attempt(job, 3, claimed=at + 12, worker=worker)
            b.final(job, "COMPLETED", attempts=3)
        elif kind == "dead":
            b.enqueue(job, script=ALWAYS_400, time=at - 0.5)
            b.attempt(job, 1, claimed=at, status=400, behaviour="status", worker=worker)
            b.final(job, "FAILED", last_error="HTTP 400")
        elif kind == "dup_info":
            b.enqueue(job, script=SUCCEED, time=at - 0.5)
            b.attempt(job, 1, claimed=at, worker=worker, write="info")
            b.attempt(job, 2, claimed=at + 10.5, worker=other)
            b.final(job, "COMPLETED", attempts=2)
        elif kind == "dup_killed":
            b.enqueue(job, script=SUCCEED, time=at - 0.5)
            b.attempt(job, 1, claimed=at, worker=worker, write=None)
            b.fault("kill_worker", at + 0.2, None, target=worker)
            b.attempt(job, 2, claimed=at + 10.5, worker=other)
            b.final(job, "COMPLETED", attempts=2)
        elif kind == "stuck":
            b.enqueue(job, script=SUCCEED, time=at - 0.5)
            b.final(job, "PENDING", attempts=0)
        elif kind == "dup_unexplained":
            b.enqueue(job, script=SUCCEED, time=at - 0.5)
            b.attempt(job, 1, claimed=at, worker=worker)
            b.attempt(job, 2, claimed=at + 20, worker=other)
            b.final(job, "COMPLETED", attempts=2)
        elif kind == "unexpected":
            b.attempt(job, 1, claimed=at, worker=worker)
        elif kind == "completed_undelivered":
            b.enqueue(job, script=SUCCEED, time=at - 0.5)
            b.final(job, "COMPLETED")
        else:
            raise AssertionError(kind)
    return b.write(run_dir)


histories = st.tuples(
    st.lists(st.sampled_from(JOB_KINDS), min_size=1, max_size=6),
    st.lists(st.sampled_from(BAD_KINDS), max_size=1),
    st.integers(min_value=1, max_value=3),
).map(lambda t: (t[0] + t[1], t[2]))


def _files(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.rglob("*") if p.is_file() and ".cache" not in p.parts)


@dataclass
class Damage:
    what: str
    file: str = ""
    detail: str = ""


def _cut_mid_line(data: bytes, draw: st.DrawFn) -> bytes | None:
    lines = data.splitlines(keepends=True)
    long_enough = [i for i, line in enumerate(lines) if len(line.rstrip(b"\n")) >= 2]
    if not long_enough:
        return None
    i = draw(st.sampled_from(long_enough))
    keep = draw(st.integers(1, len(lines[i].rstrip(b"\n")) - 1))
    return b"".join(lines[:i]) + lines[i][:keep]


_JSON_REPLACEMENTS: list[Any] = ["x", "", None, [], {}, [1], {"a": 1}, True, False, 0, -1,
                                 1e308, 2**64, -1e-9, "1000", "true", "NaN"]


def _swap_columns(data: bytes, i: int, j: int, header_too: bool, line_index: int | None
                  ) -> bytes:
    lines = data.split(b"\n")
    out = []
    for n, line in enumerate(lines):
        if not line or (n == 0 and not header_too) or (
                line_index is not None and n not in (0, line_index)):
            out.append(line)
            continue
        cells = line.split(b",")
        if max(i, j) < len(cells):
            cells[i], cells[j] = cells[j], cells[i]
        out.append(b",".join(cells))
    return b"\n".join(out)


# Each `_damage_*` function damages one file in its own way, drawing what it needs. It returns
# the detail to record ("" for none), or None when this file cannot take that damage (too
# short, wrong kind of file), in which case the file is left untouched and nothing is recorded.
# The draws each makes, and their order, are part of how a failing example is reproduced.


def _damage_cut(draw: st.DrawFn, path: Path, data: bytes) -> str | None:
    cut = _cut_mid_line(data, draw)
    if cut is None:
        return None
    path.write_bytes(cut)
    return ""


def _damage_delete(draw: st.DrawFn, path: Path, data: bytes) -> str | None:
    path.unlink()
    return ""


def _damage_empty(draw: st.DrawFn, path: Path, data: bytes) -> str | None:
    path.write_bytes(b"")
    return ""


def _damage_inject(draw: st.DrawFn, path: Path, data: bytes) -> str | None:
    at = draw(st.integers(0, len(data)))
    blob = draw(st.one_of(st.binary(min_size=1, max_size=12), st.sampled_from(
        [b"\x00", b"\n", b"\r\n", b",", b'"', b"\n\n", b"\xff\xfe", b"inf", b"-1",
         b"nan", b"1e400", b"\\", b"\r"])))
    path.write_bytes(data[:at] + blob + data[at:])
    return repr(blob) + f"@{at}"


def _damage_dup_line(draw: st.DrawFn, path: Path, data: bytes) -> str | None:
    lines = data.splitlines(keepends=True)
    if len(lines) < 2:
        return None
    i = draw(st.integers(1, len(lines) - 1))
    path.write_bytes(b"".join(lines[: i + 1] + lines[i:]))
    return ""


def _damage_swap(draw: st.DrawFn, path: Path, data: bytes) -> str | None:
    if path.suffix != ".csv":
        return None
    width = data.split(b"\n", 1)[0].count(b",") + 1
    i, j = draw(st.integers(0, width - 1)), draw(st.integers(0, width - 1))
    header_too = draw(st.booleans())
    n_lines = data.count(b"\n")
    line_index = draw(st.one_of(st.none(), st.integers(1, max(1, n_lines))))
    path.write_bytes(_swap_columns(data, i, j, header_too, line_index))
    return f"{i}<->{j} header={header_too} line={line_index}"


def _damage_json(draw: st.DrawFn, path: Path, data: bytes) -> str | None:
    """Give one JSON value another type: in a .json document, in one line of a .jsonl log,
    or in final_jobs.csv's `extra` column."""
    if path.suffix == ".json":
        return _damage_json_document(draw, path, data)
    if path.suffix == ".jsonl" and data.strip():
        return _damage_jsonl_line(draw, path, data)
    if path.name == "final_jobs.csv":
        return _damage_extra_column(draw, path, data)
    return None


def _damage_json_document(draw: st.DrawFn, path: Path, data: bytes) -> str | None:
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not doc:
        return None
    key = draw(st.sampled_from(sorted(doc)))
    doc[key] = draw(st.sampled_from(_JSON_REPLACEMENTS))
    path.write_text(json.dumps(doc))
    return f"{key}={doc[key]!r}"


def _damage_jsonl_line(draw: st.DrawFn, path: Path, data: bytes) -> str | None:
    lines = data.splitlines(keepends=True)
    i = draw(st.integers(0, len(lines) - 1))
    try:
        record = json.loads(lines[i])
    except ValueError:
        return None
    if not isinstance(record, dict) or not record:
        return None
    key = draw(st.sampled_from(sorted(record)))
    record[key] = draw(st.sampled_from(_JSON_REPLACEMENTS))
    lines[i] = (json.dumps(record) + "\n").encode()
    path.write_bytes(b"".join(lines))
    return f"line {i}: {key}={record[key]!r}"


def _damage_extra_column(draw: st.DrawFn, path: Path, data: bytes) -> str | None:
    # the `extra` column holds JSON: make it another type
    text = data.decode("utf-8", "replace")
    repl = draw(st.sampled_from(['"[1,2]"', "1", '"""x"""', "null", '"{"', "true"]))
    text = re.sub(r'"\{[^\n]*\}"$', repl, text, count=1, flags=re.MULTILINE)
    path.write_text(text)
    return repl


_DAMAGE_FILE: dict[str, Callable[[st.DrawFn, Path, bytes], str | None]] = {
    "cut": _damage_cut,
    "delete": _damage_delete,
    "inject": _damage_inject,
    "swap": _damage_swap,
    "json": _damage_json,
    "empty": _damage_empty,
    "dup_line": _damage_dup_line,
}


@st.composite
def damages(draw: st.DrawFn, run_dir: Path) -> list[Damage]:
    """Apply 1-3 kinds of damage to `run_dir`, returning what was done."""
    done: list[Damage] = []
    for _ in range(draw(st.integers(1, 3))):
        files = _files(run_dir)
        what = draw(st.sampled_from(["cut", "delete", "inject", "swap", "json", "empty",
                                     "delete_dir", "dup_line"]))
        if what == "delete_dir":
            name = draw(st.sampled_from(["deliveries", "workers"]))
            shutil.rmtree(run_dir / name, ignore_errors=True)
            done.append(Damage(what, name))
            continue
        if not files:
            break
        path = draw(st.sampled_from(files))
        rel = str(path.relative_to(run_dir))
        data = path.read_bytes()
        detail = _DAMAGE_FILE[what](draw, path, data)
        if detail is not None:
            done.append(Damage(what, rel, detail))
    return done


def _log_group(rel: Path) -> str | None:
    """The name docs/reference/anomalies.md gives the log a file belongs to, or None."""
    if rel.parts[0] in ("deliveries", "workers") and rel.suffix == ".csv":
        return rel.parts[0]
    if str(rel) in ("enqueues.csv", "final_jobs.csv", "nemesis.jsonl"):
        return str(rel)
    return None


def cut_logs(run_dir: Path) -> set[str]:
    """The logs that end inside a line (or are empty: cut before their header)."""
    cut: set[str] = set()
    for path in _files(run_dir):
        rel = path.relative_to(run_dir)
        group = _log_group(rel)
        if group is None:
            continue
        data = path.read_bytes()
        if group == "nemesis.jsonl" and not data:
            continue  # absent or empty: no fault ran
        if not data.endswith(b"\n"):
            cut.add(group)
    return cut


def missing_required(run_dir: Path) -> list[str]:
    missing = [name for name in REQUIRED if not (run_dir / name).exists()]
    if (run_dir / "deliveries").is_dir() and not any((run_dir / "deliveries").glob("*.csv")):
        missing.append("deliveries/*.csv")
    return missing


def reported_violations(verdict: Mapping[str, Any]) -> set[str]:
    not_judged = set((verdict.get("details") or {}).get("not_judged") or {})
    counts = verdict.get("counts") or {}
    return {k for k in VIOLATIONS if counts.get(k, 0) > 0 and k not in not_judged}


def test_undamaged_histories_are_judged_as_built(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The generator itself: correct jobs are valid (0), each bad kind a violation (1)."""

    @settings(PROFILE, max_examples=max(10, PROFILE.max_examples // 3))
    @given(history=histories)
    def prop(history: tuple[list[str], int]) -> None:
        jobs, workers = history
        with sandbox() as root:
            run_dir = build_history(root / "h", jobs, workers)
            outcome = run_cli(["check", "h"], root)
            note(str(outcome))
            _count("undamaged", str(outcome.code))
            check_common(outcome, {0, 1})
            assert outcome.code == (1 if set(jobs) & set(BAD_KINDS) else 0), outcome
            assert outcome.lines == [], outcome
            assert (run_dir / "verdict.json").is_file()

    drive("undamaged", prop, capsys)


def test_damaged_histories_never_pass_for_whole_or_crash(
        capsys: pytest.CaptureFixture[str]) -> None:
    @PROFILE
    @given(history=histories, data=st.data(),
           dup=st.sampled_from([None, None, None, "same", "slash", "dot", "link"]),
           flags=st.lists(st.sampled_from([["--tolerance", "0"], ["--examples", "1"],
                                           ["--tolerance", "5"]]), max_size=1))
    def prop(history: tuple[list[str], int], data: st.DataObject, dup: str | None,
             flags: list[list[str]]) -> None:
        jobs, workers = history
        with sandbox() as root:
            run_dir = build_history(root / "h", jobs, workers)
            done = data.draw(damages(run_dir), label="damage")
            argv = ["check", "h"]
            if dup == "link":
                (root / "link").symlink_to(run_dir)
            if dup is not None:
                argv.append({"same": "h", "slash": "h/", "dot": "h/.", "link": "link"}[dup])
            argv += [w for f in flags for w in f]
            cut = cut_logs(run_dir)
            missing = missing_required(run_dir)
            deleted_logs = [d for d in done if d.what == "delete"
                            and _log_group(Path(d.file)) in ("deliveries", "workers")]
            outcome = run_cli(argv, root)
            verdict_path = run_dir / "verdict.json"
            verdict = json.loads(verdict_path.read_text()) if verdict_path.exists() else None
        note(f"damage: {done}; cut: {cut}; missing: {missing}")
        note(str(outcome))
        _count("damaged", str(outcome.code))
        check_common(outcome, {0, 1, 2, 3})
        if outcome.code == 4:
            return  # a known bug (KNOWN_BUGS)
        if dup is not None or missing:
            assert outcome.code == 2, outcome
        if outcome.code == 2:
            assert verdict is None, "exit 2 writes no verdict.json"
            return
        assert outcome.lines == [], f"a verdict with words on stderr\n{outcome}"
        assert verdict is not None, outcome
        assert verdict["valid"] == {0: True, 1: False, 3: "unknown"}[outcome.code or 0]
        if cut or deleted_logs:
            assert outcome.code != 0, "a history with a part missing was judged valid"
        if outcome.code == 1:
            reported = reported_violations(verdict)
            assert reported, f"exit 1 reports no violation: {verdict['counts']}"
            for log in cut:
                hidden = reported & NOT_REPORTED_WHEN_CUT[log]
                assert not hidden, f"{log} was cut, yet {hidden} were reported"
            # A worker's log deleted lost all it held, as a log cut at its start: only what
            # the other records prove alone may be reported (docs/reference/anomalies.md: a
            # stuck job, a stale write).
            for gone in deleted_logs:
                log = _log_group(Path(gone.file)) or ""
                hidden = reported & NOT_REPORTED_WHEN_CUT[log]
                assert not hidden, f"{gone.file} was deleted, yet {hidden} were reported"

    drive("damaged", prop, capsys)


# --------------------------------------------------------------------------------------------
# A sample through a real process: the same guards, the real interpreter's streams.
# --------------------------------------------------------------------------------------------


def subprocess_main() -> None:
    """Entry point of the child process: the guards, then the CLI."""

    def setattr_(obj: Any, name: str, value: Any) -> None:
        setattr(obj, name, value)

    def delenv(name: str) -> None:
        os.environ.pop(name, None)

    install_guards(setattr_, delenv)
    try:
        code = cli.main(sys.argv[1:])
    except WouldServe:
        print("skiplock-test: would serve", file=sys.stderr, flush=True)
        os._exit(98)
    except GuardTripped as exc:
        print(f"skiplock-test: guard: {exc}", file=sys.stderr, flush=True)
        os._exit(97)
    sys.exit(code)


_CHILD = ("import importlib.util, sys; "
          "s = importlib.util.spec_from_file_location('skiplock_cli_property', {path!r}); "
          "m = importlib.util.module_from_spec(s); sys.modules[s.name] = m; "
          "s.loader.exec_module(m); "
          "m.subprocess_main()")


def run_process(argv: Sequence[str], cwd: Path) -> Outcome:
    env = {k: v for k, v in os.environ.items() if k not in _PG_ENV}
    repo = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _CHILD.format(path=str(Path(__file__).resolve())), *argv],
        cwd=cwd, env=env, capture_output=True, timeout=120, check=False,
    )
    stderr = done.stderr.decode("utf-8", "backslashreplace")
    outcome = Outcome(list(argv), done.returncode, done.stdout.decode("utf-8", "replace"),
                      stderr)
    if done.returncode == 97:
        outcome.guard = stderr
    if done.returncode == 98:
        outcome.served = True
    return outcome


def test_a_sample_through_a_real_process(
        capsys: pytest.CaptureFixture[str]) -> None:
    @settings(PROFILE, max_examples=max(4, PROFILE.max_examples // 12))
    @given(line=command_lines())
    def prop(line: Line) -> None:
        # An argument holding a NUL byte cannot reach a real process (the OS ends it there).
        assume(not any("\x00" in arg for arg in line.argv))
        with sandbox() as root:
            outcome = run_process(line.argv, root)
        note(str(outcome))
        _count("process", _what(line.argv, outcome))
        check_common(outcome, line.allowed)

    drive("process", prop, capsys)
