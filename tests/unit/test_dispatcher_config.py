"""DispatcherConfig validation: every bad setting is refused with one line saying what to fix."""

from __future__ import annotations

import pickle
import re
from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest

from skiplock.queue_impl.config import ConfigError, DispatcherConfig, validate_worker_count
from skiplock.queue_impl.dispatcher import Dispatcher
from skiplock.queue_impl.interface import QueueBackend


def test_defaults_are_valid_and_picklable() -> None:
    config = DispatcherConfig()
    config.validate()
    assert pickle.loads(pickle.dumps(config)) == config


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"batch": 0}, "batch must be a positive whole number"),
        ({"batch": -3}, "batch must be a positive whole number"),
        ({"batch": 2.5}, "batch must be a positive whole number"),
        ({"lease_seconds": 0.0}, "lease must be a positive number"),
        ({"lease_seconds": float("nan")}, "lease must be a positive number"),
        ({"http_timeout_seconds": -1.0}, "HTTP timeout must be a positive number"),
        ({"poll_seconds": 0.0}, "poll interval must be a positive number"),
        ({"recovery_interval_seconds": 0.0}, "recovery interval must be a positive"),
        ({"write_margin_seconds": -0.5}, "write margin must be 0 or more"),
        ({"retry_base_seconds": 10.0, "retry_cap_seconds": 1.0}, "base <= cap"),
        ({"retry_jitter": 1.5}, "jitter must be between 0 and 1"),
        ({"allow_targets": ("127.0.0.1",)}, "is not HOST:PORT"),
        ({"allow_targets": ("localhost:0",)}, "port must be 1-65535"),
        ({"failpoints": (("crash_sometimes", 0.5),)}, "unknown failpoint 'crash_sometimes'"),
        ({"failpoints": (("crash_after_http", 1.5),)}, "probability must be between 0 and 1"),
        ({"seed": 1.5}, "seed must be a whole number"),
        ({"seed": True}, "seed must be a whole number"),
    ],
)
def test_bad_setting_is_refused_with_one_line(changes: dict[str, object], expected: str) -> None:
    config = replace(DispatcherConfig(), **changes)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as info:
        config.validate()
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("timeout", "margin", "lease"),
    [(10.0, 5.0, 15.0), (10.0, 5.0, 12.0), (30.0, 0.0, 30.0), (0.5, 2.0, 2.0)],
)
def test_timeout_plus_margin_must_fit_inside_the_lease(
    timeout: float, margin: float, lease: float
) -> None:
    config = DispatcherConfig(
        http_timeout_seconds=timeout, write_margin_seconds=margin, lease_seconds=lease
    )
    with pytest.raises(ConfigError) as info:
        config.validate()
    message = str(info.value)
    assert "must be shorter than the lease" in message
    assert "another worker may take the job" in message
    assert "--unsafe-timing" in message
    # The explicit flag for experiments lets the same numbers through.
    replace(config, unsafe_timing=True).validate()


def test_timing_that_fits_is_accepted() -> None:
    DispatcherConfig(
        http_timeout_seconds=0.5, write_margin_seconds=0.5, lease_seconds=2.0
    ).validate()


def test_known_failpoints_and_their_probabilities() -> None:
    config = DispatcherConfig(failpoints=(("crash_after_claim", 0.25), ("crash_after_http", 1.0)))
    config.validate()
    assert config.failpoint_probability("crash_after_claim") == 0.25
    assert config.failpoint_probability("crash_after_http") == 1.0
    assert DispatcherConfig().failpoint_probability("crash_after_http") == 0.0


def test_retry_policy_follows_the_config() -> None:
    policy = DispatcherConfig(
        retry_base_seconds=2.0, retry_cap_seconds=10.0, retry_jitter=0.0
    ).retry_policy()
    assert [policy.delay(n).total_seconds() for n in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 10.0]


@pytest.mark.parametrize("count", [0, -1])
def test_worker_count_must_be_positive(count: int) -> None:
    with pytest.raises(ConfigError, match="worker count must be a positive whole number"):
        validate_worker_count(count)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--workers", "0"], "worker count must be a positive whole number"),
        (["--workers", "-2"], "worker count must be a positive whole number"),
        (["--batch", "0"], "batch must be a positive whole number"),
        (["--lease", "0"], "lease must be a positive number"),
        (["--lease", "-5"], "lease must be a positive number"),
        (["--lease", "10", "--http-timeout", "6"], "must be shorter than the lease"),
        (["--http-timeout", "0"], "HTTP timeout must be a positive number"),
        (["--backend", "nope"], "unknown backend 'nope'"),
        (["--allow-target", "127.0.0.1"], "is not HOST:PORT"),
        (["--allow-target", "host:99999"], "port must be 1-65535"),
        (["--failpoint", "crash=0.5"], "unknown failpoint"),
        (["--batch", "many"], "invalid int value"),
        (["--sql", "/nonexistent/queue.sql"], "no such file"),
    ],
)
def test_worker_command_refuses_bad_values_with_exit_2(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from skiplock.scenarios.cli.main import main

    # A DSN that is never connected to: every check here happens before any connection.
    dsn = "postgresql://skiplock:secret-password@127.0.0.1:1/none"
    assert main(["worker", "--dsn", dsn, *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert err.count("\n") == 1
    assert "secret-password" not in err


def test_worker_command_needs_a_database(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from skiplock.scenarios.cli.main import main

    monkeypatch.delenv("SKIPLOCK_PG_DSN", raising=False)
    assert main(["worker"]) == 2
    assert "pass --dsn or set SKIPLOCK_PG_DSN" in capsys.readouterr().err


def test_worker_command_reports_an_unreachable_server_without_its_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from skiplock.scenarios.cli.main import main

    # Port 1 on loopback: refused at once, nothing leaves the machine.
    dsn = "postgresql://skiplock:secret-password@127.0.0.1:1/none"
    assert main(["worker", "--dsn", dsn, "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert "secret-password" not in err
    assert err.count("\n") == 1


def failpoint_decisions(config: DispatcherConfig, worker_id: str, draws: int = 200) -> list[bool]:
    # The decisions need no backend: nothing is claimed, and no failpoint is allowed to fire.
    dispatcher = Dispatcher(cast(QueueBackend, object()), config, worker_id, lambda k, f: None)
    return [dispatcher.failpoint_fires("crash_after_http") for _ in range(draws)]


def test_failpoint_decisions_replay_for_the_same_seed_and_worker() -> None:
    config = DispatcherConfig(failpoints=(("crash_after_http", 0.5),), seed=42)
    first = failpoint_decisions(config, "worker-3")
    assert first == failpoint_decisions(config, "worker-3")
    assert 0 < sum(first) < len(first)
    # Another worker, or another seed, draws its own schedule.
    assert first != failpoint_decisions(config, "worker-4")
    assert first != failpoint_decisions(replace(config, seed=43), "worker-3")


def test_retry_jitter_replays_for_the_same_seed_and_worker() -> None:
    config = DispatcherConfig(seed=7, retry_jitter=1.0)

    def delays(worker_id: str) -> list[float]:
        dispatcher = Dispatcher(cast(QueueBackend, object()), config, worker_id, lambda k, f: None)
        return [dispatcher.retry_delay(1).total_seconds() for _ in range(20)]

    assert delays("worker-0") == delays("worker-0")
    assert delays("worker-0") != delays("worker-1")


def test_without_a_seed_failpoints_still_fire_at_their_probability() -> None:
    config = DispatcherConfig(failpoints=(("crash_after_http", 1.0),))
    assert config.seed is None
    assert all(failpoint_decisions(config, "worker-0", draws=20))
    assert not any(failpoint_decisions(DispatcherConfig(seed=1), "worker-0", draws=20))


def test_worker_command_checks_the_events_dir_before_the_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from skiplock.scenarios.cli.main import main

    not_a_dir = tmp_path / "events"
    not_a_dir.write_text("a regular file\n")
    # Port 1 on loopback refuses at once: had the database come first, its error would show.
    dsn = "postgresql://skiplock:secret-password@127.0.0.1:1/none"
    assert main(["worker", "--dsn", dsn, "--events-dir", str(not_a_dir)]) == 2
    err = capsys.readouterr().err
    assert "--events-dir" in err
    assert "not a directory" in err
    assert err.count("\n") == 1
    assert not_a_dir.read_text() == "a regular file\n"


def test_worker_command_refuses_an_events_dir_under_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from skiplock.scenarios.cli.main import main

    (tmp_path / "file").write_text("")
    dsn = "postgresql://skiplock:secret-password@127.0.0.1:1/none"
    assert main(["worker", "--dsn", dsn, "--events-dir", str(tmp_path / "file" / "sub")]) == 2
    err = capsys.readouterr().err
    assert "--events-dir" in err
    assert err.count("\n") == 1


def test_worker_command_takes_back_the_events_dir_it_made_when_the_database_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from skiplock.scenarios.cli.main import main

    dsn = "postgresql://skiplock:secret-password@127.0.0.1:1/none"
    events_dir = tmp_path / "new" / "events"
    assert main(["worker", "--dsn", dsn, "--events-dir", str(events_dir)]) == 2
    err = capsys.readouterr().err
    assert "127.0.0.1" in err and "--events-dir" not in err  # the database's error, one line
    assert err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_optional_capabilities_are_declared_protocols_not_names() -> None:
    """The dispatcher asks a backend for an optional capability with isinstance against a
    Protocol of queue_impl/interface.py, never with getattr or hasattr on a name."""
    from pathlib import Path

    from skiplock.queue_impl.interface import (
        REFERENCE_GUARANTEES,
        ClaimCommitHook,
        DeclaresGuarantees,
        DeclaresSharing,
        HoldsClaims,
        ThrottledNotify,
        guarantees_of,
    )
    from skiplock.queue_impl.memory import InMemoryQueue
    from skiplock.queue_impl.pg import PgQueue
    from skiplock.queue_impl.plugins import is_shared

    long_tx = PgQueue("postgresql://127.0.0.1:1/x", variant="pg-long-tx")
    reference = PgQueue("postgresql://127.0.0.1:1/x")
    assert isinstance(long_tx, HoldsClaims) and long_tx.holds_claims
    assert isinstance(reference, HoldsClaims) and not reference.holds_claims
    assert isinstance(reference, ThrottledNotify) and reference.notify_interval > 0
    assert isinstance(reference, ClaimCommitHook)
    memory = InMemoryQueue()
    assert not isinstance(memory, HoldsClaims | ThrottledNotify | ClaimCommitHook)
    root = Path(__file__).resolve().parents[2]
    looked_up = re.compile(r"\b(getattr|hasattr)\((self\.)?(backend|queue|factory\w*)\b")
    for path in [*root.glob("queue_impl/*.py"), *root.glob("scenarios/**/*.py")]:
        found = looked_up.search(path.read_text())
        assert found is None, f"{path.relative_to(root)}: {found and found.group(0)}"
    assert isinstance(memory, DeclaresSharing) and memory.shared is False
    assert not is_shared(memory) and is_shared(reference)
    assert isinstance(memory, DeclaresGuarantees)
    assert guarantees_of(memory) == memory.guarantees != REFERENCE_GUARANTEES
    assert guarantees_of(object()) is REFERENCE_GUARANTEES
