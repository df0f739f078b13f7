"""The harness's own servers: started, restarted, and gone afterwards, on a real PostgreSQL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from skiplock.scenarios.servers.postgres import (
    DSN_ENV,
    PgServer,
    docker_answers,
    fresh_database,
    postgres,
)

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pid: int, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _postmaster(server: PgServer) -> tuple[int, Path]:
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT current_setting('data_directory')").fetchone()
    assert row is not None
    data = Path(row[0])
    return int((data / "postmaster.pid").read_text().split()[0]), data


def test_embedded_server_answers_restarts_keeps_data_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Always the embedded path, whatever the environment says.
    monkeypatch.delenv(DSN_ENV, raising=False)
    with postgres(durable=True, docker_probe=lambda: False) as server:
        assert (server.kind, server.owned) == ("embedded", True)
        settings = server.settings()
        assert settings["durable"] is True
        assert (settings["fsync"], settings["full_page_writes"]) == ("on", "on")
        assert settings["server_version"]
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (v int)")
            conn.execute("INSERT INTO kept VALUES (41), (1)")
        first_pid, data = _postmaster(server)

        server.restart()
        second_pid, _ = _postmaster(server)
        assert second_pid != first_pid
        assert _wait_gone(first_pid)

        # An immediate stop skips the shutdown checkpoint: the start runs crash recovery,
        # and committed rows survive it.
        server.restart("immediate")
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            row = conn.execute("SELECT sum(v) FROM kept").fetchone()
        assert row == (42,)
        last_pid, _ = _postmaster(server)
    assert _wait_gone(last_pid), "the server outlived its context"
    assert not data.exists(), "the data directory was left behind"


def test_fast_settings_are_recorded_as_not_durable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DSN_ENV, raising=False)
    with postgres(durable=False, docker_probe=lambda: False) as server:
        settings = server.settings()
    assert settings["durable"] is False
    assert settings["durable_requested"] is False
    assert settings["fsync"] == "off"


def test_sigterm_stops_and_removes_the_server(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != DSN_ENV}
    env["DOCKER_HOST"] = "tcp://127.0.0.1:1"  # make sure the embedded path is taken
    child = subprocess.Popen(
        [sys.executable, "-m", "skiplock.scenarios.servers.postgres"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    with child:
        assert child.stdout is not None
        dsn = child.stdout.readline().strip()
        assert dsn.startswith("postgresql://"), dsn
        server = PgServer(dsn=dsn, kind="embedded", owned=False, durable=True)
        pid, data = _postmaster(server)
        child.send_signal(signal.SIGTERM)
        try:
            assert child.wait(timeout=60) == 128 + signal.SIGTERM
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    assert _wait_gone(pid)
    assert not data.parent.exists()


@pytest.mark.docker
def test_docker_container_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    if not docker_answers(timeout=2.0):
        pytest.skip("no Docker engine answers here (DOCKER_HOST / /var/run/docker.sock)")
    monkeypatch.delenv(DSN_ENV, raising=False)
    with postgres(durable=False) as server:
        assert server.kind == "docker"
        assert server.settings()["fsync"] == "off"


def test_fresh_database_is_empty_and_dropped_afterwards(pg_dsn: str) -> None:
    with fresh_database(pg_dsn) as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SELECT current_database()").fetchone()
            assert row is not None
            name = row[0]
            conn.execute("CREATE TABLE t (v int)")
        assert name != psycopg.conninfo.conninfo_to_dict(pg_dsn).get("dbname")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        gone = conn.execute(
            "SELECT count(*) FROM pg_database WHERE datname = %s", [name]
        ).fetchone()
    assert gone == (0,)


@pytest.mark.skipif(os.geteuid() != 0, reason="the server runs as an account of its own "
                    "only when the harness runs as root")
def test_a_restart_reopens_a_parent_folder_closed_since_the_start(
    monkeypatch: pytest.MonkeyPatch, harness_tmp: Any,
) -> None:
    # What a pytest starting beside this one does to its temporary root: 0o700 again.
    monkeypatch.delenv(DSN_ENV, raising=False)
    with postgres(durable=False, docker_probe=lambda: False) as server:
        first_pid, _ = _postmaster(server)
        harness_tmp.path.chmod(0o700)
        server.restart("immediate")
        second_pid, _ = _postmaster(server)
        assert second_pid != first_pid
