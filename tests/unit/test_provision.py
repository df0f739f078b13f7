"""Provisioning without a server: which source is chosen, and what errors say."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from skiplock.plumbing.errors import HarnessError, UsageError
from skiplock.scenarios.servers import postgres as provision
from skiplock.scenarios.servers.postgres import DSN_ENV, choose_source, postgres, redact_dsn


def _docker_yes() -> bool:
    return True


def _docker_no() -> bool:
    return False


def _docker_must_not_be_asked() -> bool:
    raise AssertionError("the Docker probe ran although a DSN was given")


def test_dsn_argument_wins_over_environment_and_docker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DSN_ENV, "postgresql://env@127.0.0.1/env")
    assert choose_source("postgresql://arg@127.0.0.1/arg", _docker_must_not_be_asked) == (
        "dsn",
        "postgresql://arg@127.0.0.1/arg",
    )


def test_environment_dsn_is_used_when_no_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DSN_ENV, "postgresql://env@127.0.0.1/env")
    assert choose_source(None, _docker_must_not_be_asked) == (
        "dsn",
        "postgresql://env@127.0.0.1/env",
    )


def test_empty_environment_dsn_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DSN_ENV, "")
    assert choose_source(None, _docker_no) == ("embedded", None)


@pytest.mark.parametrize(("answers", "expected"), [(True, "docker"), (False, "embedded")])
def test_docker_when_engine_answers_else_embedded(
    monkeypatch: pytest.MonkeyPatch, answers: bool, expected: str
) -> None:
    monkeypatch.delenv(DSN_ENV, raising=False)
    assert choose_source(None, _docker_yes if answers else _docker_no) == (expected, None)


def test_postgres_uses_docker_when_probe_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DSN_ENV, raising=False)
    started: list[bool] = []

    class FakeDocker(provision._Control):
        def __init__(self, *, durable: bool, settings: dict[str, str]) -> None:
            started.append(durable)
            self.dsn = "postgresql://test:pw@127.0.0.1:5999/test"
            self.closed = False

        def restart(self, mode: provision.RestartMode) -> None:
            self.dsn = "postgresql://test:pw@127.0.0.1:6000/test"

        def close(self) -> None:
            started.append(True)

    monkeypatch.setattr(provision, "_Docker", FakeDocker)
    with postgres(durable=False, docker_probe=_docker_yes) as server:
        assert (server.kind, server.owned, server.durable) == ("docker", True, False)
        server.restart()
        assert server.dsn.endswith(":6000/test")
    assert started == [False, True], "the container is started, then stopped on exit"


def test_docker_probe_is_quiet_and_false_without_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    # An address nothing listens on: the probe must say no, not raise or print.
    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:1")
    assert provision.docker_answers(timeout=1.0) is False


def test_embedded_failure_is_one_line_that_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DSN_ENV, raising=False)

    def broken(**_: object) -> provision._Embedded:
        raise HarnessError("initdb failed: disk full")

    monkeypatch.setattr(provision, "_start_embedded", broken)
    with pytest.raises(HarnessError) as caught, postgres(docker_probe=_docker_no):
        pass
    message = str(caught.value)
    assert "\n" not in message
    assert "no Docker engine answered" in message
    assert "disk full" in message
    assert DSN_ENV in message


def test_unparsable_dsn_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="cannot be parsed"), postgres("not a dsn ==="):
        pass


def test_unreachable_dsn_is_one_line_without_password() -> None:
    dsn = "postgresql://bob:hunter2secret@127.0.0.1:1/db"
    with pytest.raises(UsageError) as caught, postgres(dsn):
        pass
    message = str(caught.value)
    assert "\n" not in message
    assert "hunter2secret" not in message
    assert "127.0.0.1" in message


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://bob:hunter2secret@db.example:5432/app",
        "host=db.example user=bob password=hunter2secret dbname=app",
    ],
)
def test_redact_dsn_hides_password(dsn: str) -> None:
    shown = redact_dsn(dsn)
    assert "hunter2secret" not in shown
    assert "db.example" in shown


def test_restart_of_external_server_says_it_is_external() -> None:
    server = provision.PgServer(
        dsn="postgresql://x@127.0.0.1/x", kind="dsn", owned=False, durable=True
    )
    with pytest.raises(provision.ServerNotOwnedError, match="server is external"):
        server.restart()


def test_with_database_keeps_credentials_and_host() -> None:
    dsn = provision.with_database("postgresql://bob:pw@127.0.0.1:5433/app", "other")
    params = dict(item.split("=", 1) for item in dsn.split())
    assert params == {
        "user": "bob",
        "password": "pw",
        "host": "127.0.0.1",
        "port": "5433",
        "dbname": "other",
    }


def test_stale_data_dirs_of_dead_harnesses_are_swept(tmp_path: Path) -> None:
    tmp = tmp_path
    dead = tmp / f"{provision.DATA_PREFIX}dead"
    alive = tmp / f"{provision.DATA_PREFIX}alive"
    for root, pid in ((dead, 2**22 + 12345), (alive, os.getpid())):
        (root / "data").mkdir(parents=True)
        (root / provision.OWNER_FILE).write_text(str(pid))
    provision._sweep_stale(tmp)
    assert not dead.exists()
    assert alive.exists()


def test_failed_container_falls_back_to_embedded(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(DSN_ENV, raising=False)

    def no_image(**_: object) -> provision._Control:
        raise RuntimeError("pull access denied for postgres")

    class FakeEmbedded(provision._Control):
        dsn = "postgresql://postgres@127.0.0.1:5998/postgres"
        closed = False

        def close(self) -> None:
            FakeEmbedded.closed = True

    monkeypatch.setattr(provision, "_Docker", no_image)
    monkeypatch.setattr(provision, "_start_embedded", lambda **_: FakeEmbedded())
    with postgres(docker_probe=_docker_yes) as server:
        assert server.kind == "embedded"
    assert FakeEmbedded.closed
    err = capsys.readouterr().err
    assert "pull access denied" in err
    assert err.count("\n") == 1
