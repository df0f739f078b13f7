"""Scenario specs: the shipped files load, overrides apply, bad input is one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest

from skiplock.reports.history import Behaviour
from skiplock.scenarios.run import spec as spec_mod
from skiplock.scenarios.run.spec import Chooser, ScenarioSpec, SpecError


@pytest.mark.parametrize("name", ["steady", "faulty-targets"])
def test_shipped_scenarios_load_and_validate(name: str) -> None:
    spec = spec_mod.load(name)
    assert spec.name == name
    assert len(spec.accounts) >= 2
    assert spec.http_timeout + spec.write_margin < spec.lease


def test_steady_is_fault_free_and_faulty_targets_mixes_every_script() -> None:
    assert set(spec_mod.load("steady").scripts()) == {"succeed"}
    assert set(spec_mod.load("faulty-targets").scripts()) == set(spec_mod.SCRIPT_NAMES)


def test_scenario_resolves_from_a_path(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('duration = 3\n[accounts]\na = 1\n[mix]\nslow = 1\n')
    spec = spec_mod.load(str(path))
    assert spec.name == "mine"
    assert spec.duration == 3.0
    assert spec.scripts()["slow"].first.behaviour is Behaviour.SLOW


def test_overrides_scalars_and_tables() -> None:
    spec = spec_mod.load(
        "steady", ["workers=5", "rate=0", "recovery=false", "mix.slow=2", "accounts.new=7"]
    )
    assert spec.workers == 5
    assert spec.rate == 0.0
    assert spec.recovery is False
    assert spec.mix["slow"] == 2.0
    assert spec.mix["succeed"] == 1.0
    assert spec.accounts["new"] == 7


def test_hang_then_late_answers_past_the_timeout() -> None:
    spec = spec_mod.load("steady", ["mix.hang_then_late=1", "http_timeout=1.5"])
    script = spec.scripts()["hang_then_late"]
    assert script.first.behaviour is Behaviour.HANG
    assert script.first.seconds > spec.http_timeout
    assert script.step_for(2).behaviour is Behaviour.OK


def test_fail_then_succeed_fails_k_times() -> None:
    spec = spec_mod.load("steady", ["mix.fail_then_succeed=1", "fail_times=3"])
    script = spec.scripts()["fail_then_succeed"]
    assert [script.step_for(n).status for n in (1, 2, 3)] == [503, 503, 503]
    assert script.step_for(4).behaviour is Behaviour.OK


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["bogus=1"], "unknown key 'bogus'"),
        (["mix.nope=1"], "unknown script 'nope'"),
        (["workers=0"], "workers must be positive"),
        (["duration=-1"], "duration must be positive"),
        (["batch=abc"], "batch must be a int"),
        (["http_timeout=5", "write_margin=5", "lease=10"], "must be shorter than lease"),
        (["mix.succeed=0"], "mix weights sum to 0"),
        (["accounts.acme=0"], "accounts.acme limit must be positive"),
        (["retry_jitter=2"], "retry_jitter must be between 0 and 1"),
        (["retry_cap=0.1"], "retry_cap"),
        (["failpoints.explode=0.1"], "unknown failpoint 'explode'"),
        (["noequals"], "--set expects key=value"),
    ],
)
def test_impossible_values_are_one_line_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(SpecError, match=message) as info:
        spec_mod.load("steady", overrides)
    assert "\n" not in str(info.value)


def test_unknown_key_lists_the_valid_ones(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("durration = 3\n")
    with pytest.raises(SpecError) as info:
        spec_mod.load(str(path))
    assert "durration" in str(info.value)
    assert "duration" in str(info.value)
    assert "mix.<script>" in str(info.value)


def test_unsafe_timing_allows_a_short_lease() -> None:
    spec = spec_mod.load("steady", ["lease=1", "unsafe_timing=true"])
    assert spec.lease == 1.0


def test_unknown_scenario_names_the_available_ones() -> None:
    with pytest.raises(SpecError, match="steady"):
        spec_mod.load("no-such-scenario")


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="not found"):
        spec_mod.load(str(tmp_path / "absent.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("duration = = 3\n")
    with pytest.raises(SpecError, match="not valid TOML"):
        spec_mod.load(str(bad))


def test_chooser_is_seeded() -> None:
    spec = spec_mod.load("faulty-targets")

    def draws(seed: int, stream: str) -> list[tuple[str, str]]:
        chooser = Chooser.for_spec(spec, seed, stream)
        return [(s.name, a) for s, a in (chooser.next() for _ in range(50))]

    assert draws(7, "p0-u0") == draws(7, "p0-u0")
    assert draws(7, "p0-u0") != draws(8, "p0-u0")
    assert draws(7, "p0-u0") != draws(7, "p0-u1")
    assert {name for name, _ in draws(7, "p0-u0")} <= set(spec_mod.SCRIPT_NAMES)


def test_to_json_round_trips() -> None:
    spec = spec_mod.load("faulty-targets", ["failpoints.crash_after_claim=0.1"])
    again = spec_mod.from_mapping(spec.to_json())
    assert again == spec
    assert isinstance(again, ScenarioSpec)


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "steady", "--set", "bogus=1"],
        ["run", "steady", "--workers", "0"],
        ["run", "no-such-scenario"],
        ["run", "steady", "--backend", "nope"],
        ["run", "steady", "--set", "http_timeout=20"],
        ["demo", "--set", "mix.unknown=1"],
    ],
)
def test_cli_bad_input_is_exit_2_with_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from skiplock.scenarios.cli.main import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("skiplock: ")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "override",
    ["duration=nan", "duration=inf", "lease=-inf", "rate=NaN", "workers=inf", "mix.slow=inf",
     "failpoints.crash_after_claim=nan", "hang_seconds=inf", "retry_jitter=nan"],
)
def test_non_finite_numbers_are_refused(override: str) -> None:
    with pytest.raises(SpecError, match="must be a finite number") as caught:
        spec_mod.load("steady", [override])
    assert "\n" not in str(caught.value)


def test_non_finite_toml_values_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "nan.toml"
    path.write_text("duration = nan\n[accounts]\na = 1\n")
    with pytest.raises(SpecError, match="duration must be a finite number"):
        spec_mod.load(str(path))


@pytest.mark.parametrize("flags", [["--set", "duration=nan"], ["--duration", "inf"],
                                   ["--set", "lease=inf"]])
def test_cli_refuses_non_finite_values_with_exit_2(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from skiplock.scenarios.cli.main import main

    assert main(["run", "steady", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "finite" in err


def test_a_scenario_path_that_is_no_file_says_what_it_is(tmp_path: Path) -> None:
    import os

    (tmp_path / "folder.toml").mkdir()
    os.mkfifo(tmp_path / "fifo.toml")
    (tmp_path / "zero.toml").symlink_to("/dev/zero")
    (tmp_path / "dangling.toml").symlink_to(tmp_path / "absent")
    for name, said in (("folder.toml", "is a directory"), ("fifo.toml", "not a regular file"),
                       ("zero.toml", "not a regular file"),
                       ("dangling.toml", "is a broken symlink")):
        with pytest.raises(SpecError, match=said):
            spec_mod.load(str(tmp_path / name))


def test_the_replay_names_a_given_dsn_without_its_password() -> None:
    spec = spec_mod.load("steady")
    line = spec_mod.replay_command(spec, seed=3, backend="pg", sql_path=None,
                                   dsn="postgresql://u:s3cret@127.0.0.1:5432/db")
    assert line.startswith("skiplock run steady --seed 3 --dsn ")  # last: after any --set
    assert "s3cret" not in line and "password=***" in line and "host=127.0.0.1" in line
    # No DSN given (provisioned, or from the environment): none in the line.
    assert "--dsn" not in spec_mod.replay_command(spec, seed=3, backend="pg", sql_path=None)
