"""Where PostgreSQL comes from, for the CLI and the tests alike.

In order: a DSN given (`--dsn`, else `SKIPLOCK_PG_DSN`); else a testcontainers container when
a Docker engine answers; else an embedded server run from the binaries the `pgserver` package
ships. A server the harness started is stopped and its data removed when the context exits:
normally, on error, on Ctrl-C and on SIGTERM. SIGTERM unwinds as the caller arranged (the
CLI turns it into `Terminated`, a KeyboardInterrupt, for every command and every server
source); only a process that would otherwise die of it outright gets that same handling here.
If the harness is SIGKILLed, the embedded server gets SIGQUIT from the kernel and a small
remover process deletes its data folder (`skiplock.plumbing.orphans`).

The embedded server is driven directly (initdb, then `postgres` as a child in its own session)
rather than through `pgserver.get_server`, so the harness owns its whole lifecycle: a fresh
data directory, TCP on 127.0.0.1 at a free port (one DSN that every process and pgbench can
use), trust authentication, and a restart that the "restart PostgreSQL" fault can call.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, assert_never

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from skiplock.plumbing.errors import HarnessError, Terminated, UsageError, sigterm_as_interrupt
from skiplock.plumbing.orphans import FolderRemover, die_with_parent, start_folder_remover
from skiplock.queue_impl.plugins import dsn_problem, redact

DSN_ENV = "SKIPLOCK_PG_DSN"

ServerKind = Literal["dsn", "docker", "embedded"]
RestartMode = Literal["fast", "immediate"]

# Settings that trade crash safety for speed. Off only where nothing crashes the server and
# nothing is timed (the ordinary test suite); benchmarks and chaos runs keep them on.
FAST_SETTINGS: Mapping[str, str] = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
}
# What `PgServer.settings()` reports, so every result file says how durable its server was.
REPORTED_SETTINGS = (
    "fsync",
    "synchronous_commit",
    "full_page_writes",
    "wal_level",
    "max_connections",
)

CONNECT_TIMEOUT_SECONDS = 3
START_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 30.0
DOCKER_IMAGE = "postgres:16-alpine"
# Unprivileged account the embedded server runs as when we are root; the same name the
# pgserver package creates, so a machine that used pgserver already has it.
EMBEDDED_USER = "pgserver"
DATA_PREFIX = "skiplock-pg-"
OWNER_FILE = "harness.pid"


def redact_dsn(dsn: str) -> str:
    """The DSN without any part of its password, safe for logs and reports."""
    return redact(dsn)


def _scrub(text: str, dsn: str) -> str:
    """`text` on one line, with no part of the DSN's password in it (see plugins.scrub: a
    DSN libpq misreads hides the whole text, since any value it quotes may hold a piece)."""
    from skiplock.queue_impl.plugins import scrub

    return scrub(text, dsn)


def with_database(dsn: str, dbname: str) -> str:
    """The same server and credentials, another database."""
    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items() if v is not None}
    params["dbname"] = dbname
    return make_conninfo(**params)


@dataclass(kw_only=True)
class PgServer:
    """A reachable PostgreSQL server and what the harness may do with it."""

    dsn: str = field(repr=False)
    kind: ServerKind
    # True when the harness started this server and may restart or stop it.
    owned: bool
    # What was asked for; `settings()` reports what the server actually runs with.
    durable: bool
    _control: _Control | None = field(default=None, repr=False, compare=False)

    @property
    def display(self) -> str:
        return redact_dsn(self.dsn)

    def restart(self, mode: RestartMode = "fast") -> None:
        """Stop and start the server on the same address and data. `immediate` skips the
        shutdown checkpoint, so the start runs crash recovery, as after a power cut of the
        server process (not of the disk). Raises `ServerNotOwnedError` for external servers."""
        if not self.owned or self._control is None:
            raise ServerNotOwnedError(
                f"cannot restart {self.display}: server is external (the harness did not start it)"
            )
        self._control.restart(mode)
        self.dsn = self._control.dsn

    def settings(self) -> dict[str, Any]:
        """Version and durability settings, as the server reports them, for result files."""
        with psycopg.connect(
            self.dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT_SECONDS
        ) as conn:
            row = conn.execute("SELECT current_setting('server_version')").fetchone()
            out: dict[str, Any] = {"server_version": row[0] if row else None}
            for name in REPORTED_SETTINGS:
                found = conn.execute("SELECT current_setting(%s, true)", (name,)).fetchone()
                out[name] = found[0] if found else None
        out["kind"] = self.kind
        out["owned"] = self.owned
        out["durable_requested"] = self.durable
        out["durable"] = (
            out["fsync"] == "on"
            and out["full_page_writes"] == "on"
            and out["synchronous_commit"] in ("on", "remote_apply", "remote_write", "local")
        )
        return out


class ServerNotOwnedError(HarnessError):
    """The operation needs a server the harness started; the caller reports it as skipped."""


class _Control:
    """Lifecycle of a server the harness started."""

    dsn: str

    def restart(self, mode: RestartMode) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


# --- choosing a source -------------------------------------------------------------------

Source = Literal["dsn", "docker", "embedded"]


def choose_source(dsn: str | None, docker_probe: Callable[[], bool]) -> tuple[Source, str | None]:
    """Which source to use, and the DSN if one was given (argument first, then environment).
    The Docker probe runs only when no DSN was given."""
    given = dsn or os.environ.get(DSN_ENV) or None
    if given:
        return "dsn", given
    if docker_probe():
        return "docker", None
    return "embedded", None


def docker_answers(timeout: float = 1.0) -> bool:
    """True when a Docker engine answers a ping within `timeout`. Quiet and quick: with no
    DOCKER_HOST and no local socket it returns without importing the Docker client."""
    host = os.environ.get("DOCKER_HOST", "")
    if not host:
        candidates = [Path("/var/run/docker.sock"), Path.home() / ".docker/run/docker.sock"]
        if not any(path.exists() for path in candidates):
            return False
    try:
        import docker

        client = docker.from_env(timeout=max(1, round(timeout)))
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        # Any failure (no engine, no permission, bad DOCKER_HOST) means: no Docker here.
        return False


# --- the DSN path ------------------------------------------------------------------------


def check_reachable(dsn: str) -> None:
    """Connect once with a short timeout; a bad or unreachable DSN is the user's to fix."""
    try:
        conninfo_to_dict(dsn)
    except (psycopg.ProgrammingError, UnicodeError):  # UnicodeError: not UTF-8
        raise UsageError(
            "the PostgreSQL DSN cannot be parsed; give a URI like "
            "postgresql://USER@HOST:PORT/DB or key=value pairs"
        ) from None
    # A password with an unescaped `@` or `/`: libpq would take part of it for the host and
    # look that up, so refuse it before any connection (every command's DSN comes here).
    problem = dsn_problem(dsn)
    if problem is not None:
        raise UsageError(f"the PostgreSQL DSN {redact_dsn(dsn)}: {problem}")
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT_SECONDS):
            pass
    except psycopg.Error as exc:
        raise UsageError(
            f"cannot connect to PostgreSQL at {redact_dsn(dsn)}: {_scrub(str(exc), dsn)}; "
            f"check --dsn / {DSN_ENV}"
        ) from None


# --- the embedded path -------------------------------------------------------------------


def pg_bin_dir() -> Path:
    """The directory holding the `pgserver` package's PostgreSQL binaries, found without
    importing the package (its import has side effects we do not need)."""
    spec = importlib.util.find_spec("pgserver")
    if spec is None or not spec.submodule_search_locations:
        raise HarnessError("the pgserver package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def pg_binary(name: str) -> Path:
    """Path of one bundled PostgreSQL program (initdb, postgres, pgbench, psql, ...)."""
    path = pg_bin_dir() / name
    if not path.exists():
        raise HarnessError(f"{name} not found in {path.parent}")
    return path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True, kw_only=True)
class _RunAs:
    """Credentials for the server's processes: ourselves, or an unprivileged account."""

    uid: int | None
    gid: int | None

    @classmethod
    def for_current_user(cls) -> _RunAs:
        if os.geteuid() != 0:
            return cls(uid=None, gid=None)
        # PostgreSQL refuses to run as root.
        try:
            entry = pwd.getpwnam(EMBEDDED_USER)
        except KeyError:
            subprocess.run(
                [
                    "useradd",
                    "--system",
                    "--no-create-home",
                    "-s",
                    "/usr/sbin/nologin",
                    EMBEDDED_USER,
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            entry = pwd.getpwnam(EMBEDDED_USER)
        return cls(uid=entry.pw_uid, gid=entry.pw_gid)

    def popen_kwargs(self) -> dict[str, Any]:
        if self.uid is None:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def own(self, path: Path) -> None:
        if self.uid is not None and self.gid is not None:
            os.chown(path, self.uid, self.gid)


def _kill_server_with_harness() -> None:
    """In the server's child before exec: if the harness dies without cleaning up (SIGKILL),
    the kernel sends the postmaster SIGQUIT (its immediate shutdown)."""
    die_with_parent(signum=signal.SIGQUIT)


def _on_main_thread() -> bool:
    # The parent-death signal fires when the forking *thread* ends, so it is only safe when
    # the server is started from the main thread (a restart from a fault thread is not).
    return threading.current_thread() is threading.main_thread()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _sweep_stale(tmp: Path) -> None:
    """Remove data directories left by a harness that was SIGKILLed (its server died with
    it) when its remover could not run (itself SIGKILLed, say): both the harness and the
    postmaster recorded there are gone."""
    for root in tmp.glob(f"{DATA_PREFIX}*"):
        owner = _read_pid(root / OWNER_FILE)
        if owner is None or _pid_alive(owner):
            continue
        postmaster = _read_pid(root / "data" / "postmaster.pid")
        if postmaster is not None and _pid_alive(postmaster):
            continue
        shutil.rmtree(root, ignore_errors=True)


def log_tail(path: Path) -> str:
    """The last 2,000 characters of a server's log, for a one-line reason it did not start."""
    try:
        return path.read_text(errors="replace")[-2000:]
    except OSError:
        return ""


def _make_traversable(path: Path) -> None:
    """Let the unprivileged server account reach the bundled binaries (o+rx on each parent)."""
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if mode & 0o005 != 0o005:
            parent.chmod(mode | 0o005)


class _Embedded(_Control):
    """A PostgreSQL server from the bundled binaries, in a fresh temporary directory."""

    def __init__(self, *, durable: bool, settings: Mapping[str, str]) -> None:
        self.bin_dir = pg_bin_dir()
        if not (self.bin_dir / "postgres").exists():
            raise HarnessError(f"no postgres binary in {self.bin_dir}")
        self.run_as = _RunAs.for_current_user()
        _sweep_stale(Path(tempfile.gettempdir()))
        self.root = Path(tempfile.mkdtemp(prefix=DATA_PREFIX))
        (self.root / OWNER_FILE).write_text(str(os.getpid()))
        self.data = self.root / "data"
        # Deletes the folder (and stops what is left of the server) if this process dies
        # without closing it; closed last in `close`.
        self.remover: FolderRemover | None = start_folder_remover(
            self.root, self.data / "postmaster.pid"
        )
        self.log_path = self.root / "postgres.log"
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.settings = dict(settings)
        if not durable:
            self.settings = {**FAST_SETTINGS, **self.settings}
        self.dsn = ""

    def _run(self, argv: list[str]) -> None:
        result = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            cwd=self.root,
            timeout=START_TIMEOUT_SECONDS,
            check=False,
            **self.run_as.popen_kwargs(),
        )
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
            raise HarnessError(f"{Path(argv[0]).name} failed: {tail[0]}")

    def init(self) -> None:
        if self.run_as.uid is not None:
            _make_traversable(self.bin_dir)
            _make_traversable(self.root.parent)
        self.root.chmod(0o700)
        self.run_as.own(self.root)
        # --no-sync: the directory is thrown away with the run; only an OS crash in the next
        # seconds could lose initdb's files, and then the run is lost anyway.
        self._run(
            [
                str(self.bin_dir / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
            ]
        )

    def start(self) -> None:
        if self.run_as.uid is not None:
            # Again at every start, a restart too: something else may have closed a parent
            # since (pytest sets its own temporary root back to 0o700 each time it starts).
            _make_traversable(self.root.parent)
        last_error = "not started"
        for _ in range(3):
            # A free port can be taken between probing and binding; pick again if so.
            self.port = self.port or _free_port()
            argv = [str(self.bin_dir / "postgres"), "-D", str(self.data)]
            base = {
                "listen_addresses": "127.0.0.1",
                "port": str(self.port),
                # TCP only: one DSN for every process and for pgbench; no socket path limits.
                "unix_socket_directories": "",
                "max_connections": "200",
            }
            for name, value in {**base, **self.settings}.items():
                argv += ["-c", f"{name}={value}"]
            with open(self.log_path, "ab") as log:
                # Own session: Ctrl-C in the terminal reaches the harness, which then stops
                # the server in order, instead of reaching the postmaster directly.
                self.process = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.root,
                    start_new_session=True,
                    preexec_fn=_kill_server_with_harness if _on_main_thread() else None,
                    **self.run_as.popen_kwargs(),
                )
            self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
            error = self._wait_ready()
            if error is None:
                return
            last_error = error
            self._stop_process("immediate")
            if (
                "could not bind" not in self._log_tail()
                and "already in use" not in self._log_tail()
            ):
                break
            self.port = 0
        raise HarnessError(f"embedded PostgreSQL did not start: {last_error}")

    def _log_tail(self) -> str:
        return log_tail(self.log_path)

    def _wait_ready(self) -> str | None:
        """None once the server accepts connections; else why it did not (bounded poll)."""
        assert self.process is not None
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                lines = [ln for ln in self._log_tail().splitlines() if ln.strip()]
                return lines[-1] if lines else f"postgres exited with {self.process.returncode}"
            try:
                with psycopg.connect(self.dsn, connect_timeout=1):
                    return None
            except psycopg.OperationalError:
                time.sleep(0.05)
        return f"not ready after {START_TIMEOUT_SECONDS:.0f} s (log: {self.log_path})"

    def _stop_process(self, mode: RestartMode) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        # SIGINT is PostgreSQL's "fast" shutdown (roll back, checkpoint, exit); SIGQUIT is
        # "immediate" (exit now, crash recovery on the next start).
        match mode:
            case "fast":
                sig = signal.SIGINT
            case "immediate":
                sig = signal.SIGQUIT
            case _:
                assert_never(mode)
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
        try:
            process.wait(timeout=STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=STOP_TIMEOUT_SECONDS)
        # Backends exit with the postmaster; make sure none of its session lingers.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)

    def restart(self, mode: RestartMode) -> None:
        self._stop_process(mode)
        self.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def close(self) -> None:
        try:
            self._stop_process("fast")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
            remover, self.remover = self.remover, None
            if remover is not None:
                remover.close()


def _start_embedded(*, durable: bool, settings: Mapping[str, str]) -> _Embedded:
    server = _Embedded(durable=durable, settings=settings)
    try:
        server.init()
        server.start()
    except BaseException:
        server.close()
        raise
    return server


# --- the Docker path ---------------------------------------------------------------------


class _Docker(_Control):
    """A throwaway PostgreSQL container from testcontainers."""

    def __init__(self, *, durable: bool, settings: Mapping[str, str]) -> None:
        try:
            from testcontainers.community.postgres import PostgresContainer
        except ImportError:  # testcontainers before the community split
            from testcontainers.postgres import PostgresContainer

        merged = dict(settings) if durable else {**FAST_SETTINGS, **settings}
        command = " ".join(f"-c {name}={value}" for name, value in merged.items())
        self.container = PostgresContainer(DOCKER_IMAGE, password=uuid.uuid4().hex, driver=None)
        if command:
            self.container.with_command(f"postgres {command}")
        try:
            self.container.start()
            self.dsn = self._dsn()
        except BaseException:
            with contextlib.suppress(Exception):
                self.container.stop()
            raise

    def _dsn(self) -> str:
        return str(self.container.get_connection_url(driver=None))

    def restart(self, mode: RestartMode) -> None:
        wrapped = self.container.get_wrapped_container()
        match mode:
            case "fast":
                wrapped.restart(timeout=int(STOP_TIMEOUT_SECONDS))
            case "immediate":
                wrapped.kill(signal="SIGQUIT")
                wrapped.start()
            case _:
                assert_never(mode)
        # The host port can change across a container restart.
        wrapped.reload()
        self.dsn = self._dsn()
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while True:
            try:
                with psycopg.connect(self.dsn, connect_timeout=1):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise HarnessError("the PostgreSQL container did not come back") from None
                time.sleep(0.1)

    def close(self) -> None:
        self.container.stop()


# --- signals -----------------------------------------------------------------------------


@contextmanager
def _cleanup_on_sigterm() -> Iterator[None]:
    """While a server is owned, a process that would die of SIGTERM outright (the default
    disposition: no handler) raises `Terminated` instead, so `finally` blocks stop the server
    and remove its data. A handler the caller installed (the CLI's, which every command runs
    under) or SIG_IGN is left alone: how SIGTERM unwinds is the caller's decision, and must
    not depend on where the server came from."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    with sigterm_as_interrupt():
        yield


# --- the entry point ---------------------------------------------------------------------


@contextmanager
def postgres(
    dsn: str | None = None,
    *,
    durable: bool = True,
    settings: Mapping[str, str] | None = None,
    docker_probe: Callable[[], bool] = docker_answers,
) -> Iterator[PgServer]:
    """Yield a reachable PostgreSQL server: the DSN given (argument, else `SKIPLOCK_PG_DSN`),
    else a Docker container, else an embedded server.

    `durable=False` turns off fsync, synchronous_commit and full_page_writes on servers the
    harness starts (tests only). `settings` are extra server settings for those servers; an
    external server runs with its own settings, which `PgServer.settings()` reports.
    """
    if dsn is not None and not dsn.strip():
        # `--dsn ""` (an unset variable, say) is a mistake, not a wish for Docker or the
        # embedded server.
        raise UsageError(f"--dsn is empty: give a PostgreSQL URI such as"
                         f" postgresql://USER@HOST:PORT/DB, or leave --dsn out to use"
                         f" {DSN_ENV}, Docker or the embedded server")
    source, given = choose_source(dsn, docker_probe)
    if source == "dsn":
        assert given is not None
        check_reachable(given)
        yield PgServer(dsn=given, kind="dsn", owned=False, durable=durable)
        return
    extra = dict(settings or {})
    with _cleanup_on_sigterm():
        control, kind = _start_owned(source, durable=durable, settings=extra)
        try:
            yield PgServer(
                dsn=control.dsn, kind=kind, owned=True, durable=durable, _control=control
            )
        finally:
            control.close()


def _start_owned(
    source: Source, *, durable: bool, settings: Mapping[str, str]
) -> tuple[_Control, ServerKind]:
    """Start a container, or the embedded server; a container that fails to start (an
    engine with no access to the image registry, say) falls back to the embedded server."""
    docker_note = "no Docker engine answered"
    match source:
        case "docker":
            try:
                return _Docker(durable=durable, settings=settings), "docker"
            except Exception as exc:
                reason = _scrub(str(exc), "")[:200]
                docker_note = f"the Docker container failed ({reason})"
                print(
                    f"skiplock: {docker_note}; using the embedded server instead",
                    file=sys.stderr,
                )
        case "embedded" | "dsn":
            pass
        case _:
            assert_never(source)
    try:
        return _start_embedded(durable=durable, settings=settings), "embedded"
    except (HarnessError, OSError, subprocess.SubprocessError) as exc:
        raise HarnessError(
            f"no PostgreSQL: no --dsn or {DSN_ENV} given, {docker_note}, "
            f"and the embedded server failed ({_scrub(str(exc), '')}); "
            f"pass --dsn or set {DSN_ENV} to a reachable server"
        ) from None


@contextmanager
def fresh_database(dsn: str, prefix: str = "skiplock") -> Iterator[str]:
    """A new empty database on the same server, dropped afterwards; yields its DSN."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT_SECONDS) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield with_database(dsn, name)
    finally:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT_SECONDS) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def fresh_schema(dsn: str, name: str | None = None) -> str:
    """Create an empty schema (a fresh name unless given) and return its name."""
    schema = name or f"s_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT_SECONDS) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
    return schema


def _main() -> int:
    """`python -m skiplock.scenarios.servers.postgres`: start a server, print its DSN, wait for
    Ctrl-C or SIGTERM; exits 130 or 143, like every command, once the server is gone."""
    try:
        with sigterm_as_interrupt(), postgres() as server:
            print(server.dsn, flush=True)
            print(server.settings(), file=sys.stderr, flush=True)
            while True:
                signal.pause()
    except Terminated as exc:
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(_main())
