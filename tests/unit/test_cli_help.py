"""The CLI's help pages and its one place for exit codes: every help page lists its exit
codes and examples; any error a command raises becomes one line and 2, 4, 130 or 143 (never
a traceback without --debug, never 1, which only a verdict may return)."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from skiplock.plumbing.errors import HarnessError, Terminated, UsageError, sigterm_as_interrupt
from skiplock.scenarios.cli import main as cli
from skiplock.scenarios.servers import postgres as provision

EXIT_CODES = ("0", "1", "2", "3", "4", "130", "143")


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        cli.main([*argv, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_top_help_is_for_users_with_commands_exit_codes_and_examples(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = _help(capsys)
    assert text.splitlines()[2].startswith("skiplock: load and correctness harness")
    assert "one module per command" not in text  # not the developer docstring
    for command in cli.COMMANDS:
        assert f"    {command} " in text
    codes = text.split("exit codes", 1)[1]
    for code in EXIT_CODES:
        assert f"\n  {code} " in codes
    assert "examples:" in text
    assert "--debug" in text


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_each_command_help_has_examples_and_exit_codes(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    text = _help(capsys, command)
    assert "examples:" in text
    assert f"skiplock {command}" in text.split("examples:", 1)[1]
    codes = text.split("exit codes:", 1)[1]
    for code in ("2", "4", "130", "143"):
        assert f" {code} " in codes


def test_run_help_lists_scenarios_and_the_keys_of_set(capsys: pytest.CaptureFixture[str]) -> None:
    from skiplock.scenarios.run.spec import SCALAR_KEYS, available

    text = " ".join(_help(capsys, "run").split())
    for name in available():
        assert name in text
    assert "--set KEY=VALUE keys" in text
    for key in (*SCALAR_KEYS, "mix.SCRIPT", "accounts.ID", "failpoints.NAME"):
        assert key in text
    for code in EXIT_CODES:
        assert f" {code} " in text.split("exit codes:", 1)[1]


def _raising(exc: BaseException) -> Callable[..., int]:
    def run(*_: object) -> int:
        raise exc

    return run


def _run_target_raising(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], exc: BaseException,
    *flags: str,
) -> tuple[int, str]:
    import skiplock.scenarios.cli.target

    monkeypatch.setattr(skiplock.scenarios.cli.target, "run", _raising(exc))
    code = cli.main([*flags, "target", "--port", "0"])
    captured = capsys.readouterr()
    return code, captured.err


def test_unexpected_exception_is_4_and_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _run_target_raising(monkeypatch, capsys, RuntimeError("boom\n  on two lines"))
    assert code == 4
    assert err == (
        "skiplock: harness failure: RuntimeError: boom on two lines"
        " (run with --debug for the traceback)\n"
    )


def test_debug_shows_the_traceback_and_keeps_the_exit_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _run_target_raising(monkeypatch, capsys, RuntimeError("boom"), "--debug")
    assert code == 4
    assert err.startswith("Traceback (most recent call last):")
    assert "RuntimeError: boom" in err
    assert err.splitlines()[-1] == "skiplock: harness failure: RuntimeError: boom (traceback above)"


@pytest.mark.parametrize(
    ("exc", "code", "line"),
    [
        (UsageError("--port: bad\nvalue"), 2, "skiplock: --port: bad value"),
        (HarnessError("the target died"), 4, "skiplock: harness failure: the target died"),
        (SystemExit(1), 4, "skiplock: harness failure: exit(1) called inside the command"),
        (KeyboardInterrupt(), 130, "skiplock: interrupted"),
        (Terminated(), 143, "skiplock: terminated (SIGTERM)"),
    ],
    ids=["usage", "harness", "exit-1", "ctrl-c", "sigterm"],
)
def test_every_error_maps_to_its_exit_code_with_one_line(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    exc: BaseException,
    code: int,
    line: str,
) -> None:
    got, err = _run_target_raising(monkeypatch, capsys, exc)
    assert got == code
    assert len(err.splitlines()) == 1, err
    assert err.startswith(line)
    assert "Traceback" not in err


def test_a_harness_error_from_a_crash_says_where_the_traceback_is(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        try:
            raise ZeroDivisionError("division by zero")
        except ZeroDivisionError as cause:
            raise HarnessError("ZeroDivisionError: division by zero") from cause
    except HarnessError as exc:
        chained = exc
    code, err = _run_target_raising(monkeypatch, capsys, chained)
    assert code == 4
    assert err.strip().endswith("(run with --debug for the traceback)")


def test_bad_usage_before_the_command_obeys_debug(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["nope"]) == 2
    assert capsys.readouterr().err.startswith("skiplock: argument COMMAND: invalid choice")
    assert cli.main(["--debug", "run", "--workers", "x", "steady"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err
    assert err.splitlines()[-1] == "skiplock: run: argument --workers: invalid int value: 'x'"


def test_a_verdict_is_the_only_way_to_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import skiplock.scenarios.cli.target

    monkeypatch.setattr(skiplock.scenarios.cli.target, "run", lambda _args: 1)
    assert cli.main(["target"]) == 1
    assert capsys.readouterr().err == ""


def test_an_embedded_server_keeps_the_cli_sigterm_handler() -> None:
    """Inside a command, the server's lifetime must not replace how SIGTERM unwinds (it once
    turned SIGTERM into SystemExit, skipping a run's final snapshot)."""
    with sigterm_as_interrupt():
        handler = signal.getsignal(signal.SIGTERM)
        with provision._cleanup_on_sigterm():
            assert signal.getsignal(signal.SIGTERM) is handler
        with sigterm_as_interrupt():
            assert signal.getsignal(signal.SIGTERM) is handler
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        # Used on its own (a test, a script), it still stops the server on SIGTERM.
        with provision._cleanup_on_sigterm():
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)
