"""The gate's lanes, in what needs no process: how many, what a lane is told, what it reads."""

from __future__ import annotations

import io
from pathlib import Path

from skiplock.scenarios.cli.main import build_parser
from skiplock.scenarios.run.gate_lanes import LaneCommand, cases_from, lane_count
from skiplock.scenarios.servers.postgres import DSN_ENV


def test_lanes_are_as_asked_else_one_per_core_up_to_two_never_more_than_cases(
        monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert lane_count(None, 9) == 2
    assert lane_count(3, 9) == 3
    assert lane_count(None, 1) == 1
    assert lane_count(4, 2) == 2
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert lane_count(None, 9) == 1
    monkeypatch.setattr("os.cpu_count", lambda: None)
    assert lane_count(None, 9) == 1


def test_a_lane_command_is_a_gate_command_line_without_the_password() -> None:
    secret = "postgresql://app:hunter2@127.0.0.1:5432/app"
    command = LaneCommand(backend="pkg.mod:factory", sql_path="q.sql", dsn=secret,
                          backend_options=(("queue", "jobs"), ("mode", "a=b")),
                          overrides=["recovery=false", "duration=3"], out=Path("out dir"),
                          html=False)
    argv = command.argv()
    assert not any("hunter2" in word for word in argv)
    assert command.env()[DSN_ENV] == secret
    args = build_parser("gate").parse_args(argv[3:])
    assert (args.lane, args.backend, args.sql_path, args.out, args.no_report) == (
        True, "pkg.mod:factory", "q.sql", Path("out dir"), True)
    assert args.backend_opts == ["queue=jobs", "mode=a=b"]
    assert args.overrides == ["recovery=false", "duration=3"]
    assert args.dsn is None


def test_a_lane_reads_scenario_and_seed_per_line_until_its_input_ends() -> None:
    given = io.StringIO("kill-workers 7\n\nnoisy-neighbour -3\n./my spec.toml 12\n")
    assert list(cases_from(given)) == [("kill-workers", 7), ("noisy-neighbour", -3),
                                       ("./my spec.toml", 12)]
