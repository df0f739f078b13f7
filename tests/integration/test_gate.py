"""`skiplock gate` and its pytest plugin as a user runs them, and the fault schedule's
bad-input answers (exit 2, one line, nothing started)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from skiplock import __version__

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def skiplock(*args: str | Path, cwd: Path = REPO,
             timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skiplock", *map(str, args)],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
    )


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_an_unknown_nemesis_kind_is_refused(tmp_path: Path) -> None:
    line = one_line_error(skiplock("run", "steady", "--nemesis", "kill_wroker",
                                   "--out", tmp_path))
    assert "unknown nemesis kind 'kill_wroker'" in line
    assert not any(tmp_path.iterdir())


def test_a_fault_after_the_load_ends_is_refused(tmp_path: Path) -> None:
    line = one_line_error(skiplock("run", "kill-workers", "--duration", "1",
                                   "--out", tmp_path))
    assert "starts at 1 s but the load phase lasts 1 s" in line


def test_a_restart_needs_a_server_the_harness_owns(tmp_path: Path) -> None:
    spec = tmp_path / "restart.toml"
    spec.write_text('duration = 3\n[[nemesis]]\nkind = "restart_postgres"\nat = 1\n')
    line = one_line_error(skiplock("run", spec, "--dsn", "postgresql://u@127.0.0.1:1/db",
                                   "--out", tmp_path / "runs"))
    assert "needs a PostgreSQL the harness starts" in line
    assert not (tmp_path / "runs").exists()


def test_nemesis_entries_are_checked_like_every_key(tmp_path: Path) -> None:
    spec = tmp_path / "bad.toml"
    spec.write_text('[[nemesis]]\nkind = "kill_worker"\nat = 1\ncount = 0\n')
    assert "count must be a positive whole number" in one_line_error(
        skiplock("run", spec, "--out", tmp_path))
    spec.write_text('[[nemesis]]\nkind = "kill_worker"\nwhen = 1\n')
    assert "unknown key 'when' in nemesis[0]" in one_line_error(
        skiplock("run", spec, "--out", tmp_path))


def test_gate_bad_input(tmp_path: Path) -> None:
    assert "unknown scenario 'nope'" in one_line_error(
        skiplock("gate", "--only", "nope", "--out", tmp_path))
    assert "--seeds must be between 1 and 1000 (got 0)" in one_line_error(
        skiplock("gate", "--seeds", "0", "--out", tmp_path))
    # Once ran out of memory making the list of seeds.
    assert "--seeds must be between 1 and 1000 (got 1000000000000)" in one_line_error(
        skiplock("gate", "--seeds", "1000000000000", "--out", tmp_path))
    assert "--nemesis expects KIND" in one_line_error(
        skiplock("run", "steady", "--nemesis", "", "--out", tmp_path))
    (tmp_path / "file").write_text("")
    assert "is a file" in one_line_error(skiplock("gate", "--out", tmp_path / "file"))


@pytest.mark.chaos
def test_gate_fails_the_naive_queue_with_junit_naming_the_anomaly(tmp_path: Path) -> None:
    out = tmp_path / "gate"
    done = skiplock("gate", "--backend", "pg-naive", "--only", "noisy-neighbour",
                    "--seed", "1", "--out", out)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "FAIL" in done.stdout and "noisy-neighbour" in done.stdout
    [case] = ET.parse(out / "junit.xml").getroot().iter("testcase")
    assert case.get("name") == "noisy-neighbour[seed=1]"
    failure = case.find("failure")
    assert failure is not None
    # Two workers take the same job; accounts go over their limits.
    message = failure.get("message") or ""
    assert "duplicate_unexplained=" in message or "concurrent_delivery=" in message
    # What a CI page shows: one short line with the replay, a body of examples, not JSON.
    assert len(message) < 200 and "\n" not in message, message
    assert message.endswith("replay: skiplock gate --only noisy-neighbour --seed 1"
                            " --backend pg-naive")
    body = (failure.text or "").splitlines()
    assert len(body) < 60 and body[-1].startswith("re-check: skiplock check "), body
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_code"] == 1
    assert summary["skiplock_version"] == __version__
    assert summary["counts"] == {"runs": 1, "pass": 0, "not_applicable": 0, "fail": 1,
                                 "unknown": 0, "error": 0}
    run_dir = Path(summary["results"][0]["run_dir"])
    # The run directory stands on its own: the same verdict from `skiplock check`.
    assert skiplock("check", run_dir).returncode == 1
    # The gate's page lists the case as failed and links its run's own report.
    page = (out / "report.html").read_text()
    assert "noisy-neighbour seed 1" in page and ">FAIL</span>" in page
    assert ("replay: <code>skiplock gate --only noisy-neighbour --seed 1 --backend pg-naive"
            "</code>") in page
    assert f"href='runs/{run_dir.name}/report.html'" in page
    assert ">VIOLATED</span>" in (run_dir / "report.html").read_text()


def _inner_pytest(folder: Path) -> list[str]:
    """A pytest run inside this one, with a temporary root of its own: at its start pytest
    sets the shared one (`pytest-of-<user>`) back to 0o700, which shuts an embedded server
    running as its own account out of the folders of tests running beside it."""
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
            str(folder), "--basetemp", str(folder / "basetemp")]


@pytest.mark.chaos
def test_the_pytest_plugin_gates_a_queue_inside_a_test_suite(tmp_path: Path) -> None:
    (tmp_path / "test_queue.py").write_text(textwrap.dedent("""
        def test_reference_keeps_its_promises(skiplock_gate):
            summary = skiplock_gate(only=["noisy-neighbour"], seed=3)
            assert summary.exit_code == 0, summary.report()
    """))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [*_inner_pytest(tmp_path), "--skiplock-backend", "pg-naive", "--skiplock-only",
         "noisy-neighbour", "--skiplock-seed", "1", "--skiplock-out", str(tmp_path / "g")],
        cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False, env=env,
    )
    assert done.returncode == 1, done.stdout[-3000:]
    assert "1 failed, 1 passed" in done.stdout
    assert "FAILED ::skiplock-gate[noisy-neighbour-seed1]" in done.stdout
    assert "re-check: skiplock check" in done.stdout


@pytest.mark.parametrize("only", ["", ",", " , "])
def test_an_only_that_names_no_scenario_is_bad_input(tmp_path: Path, only: str) -> None:
    # `--only "$SCENARIOS"` with the CI variable unset must not pass a gate that ran nothing.
    line = one_line_error(skiplock("gate", "--only", only, "--out", tmp_path / "g"))
    assert "--only names no scenario" in line
    assert not (tmp_path / "g").exists()


def test_a_gate_refused_on_its_server_writes_no_artifact(tmp_path: Path, pg_dsn: str) -> None:
    # Refused only once a server answers (the plug-in check needs one): still before the
    # header and before any file, so nothing can read as a passed gate.
    line = one_line_error(skiplock("gate", "--backend-opt", "a=b", "--only", "noisy-neighbour",
                                   "--dsn", pg_dsn, "--out", tmp_path / "g"))
    assert "takes no --backend-opt" in line
    assert not (tmp_path / "g").exists()


def test_an_interrupted_gate_leaves_junit_with_an_error_for_the_cut_case(
        tmp_path: Path, pg_dsn: str) -> None:
    import signal
    import time

    out = tmp_path / "g"
    gate = subprocess.Popen(
        [sys.executable, "-m", "skiplock", "gate", "--only", "noisy-neighbour",
         "--seed", "5", "--dsn", pg_dsn, "--out", str(out)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / "runs").is_dir() or not any((out / "runs").iterdir()):
            assert gate.poll() is None and time.monotonic() < deadline, gate.communicate()
            time.sleep(0.2)
        time.sleep(2)  # inside the case's load
        gate.send_signal(signal.SIGTERM)
        _, stderr = gate.communicate(timeout=60)
    finally:
        if gate.poll() is None:
            gate.kill()
    assert gate.returncode == 143, stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_code"] == 143 and summary["interrupted"] is True
    suite = ET.parse(out / "junit.xml").getroot()
    assert suite.get("errors") == "1" and suite.get("tests") == "1"
    [case] = suite.iter("testcase")
    assert case.get("name") == "noisy-neighbour[seed=5]"
    error = case.find("error")
    assert error is not None and error.get("type") == "interrupted"
    assert "exit 143" in (error.get("message") or "")


def test_the_pytest_plugin_refuses_bad_sql_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "broken.sql").write_text("SELECT 1;\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [*_inner_pytest(tmp_path), "--skiplock-sql", "broken.sql", "--skiplock-only",
         "noisy-neighbour"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False, env=env,
    )
    assert done.returncode == 4, done.stdout[-2000:]  # pytest's usage error, not a failure
    output = done.stdout + done.stderr
    assert "ERROR: skiplock: broken.sql: line 1: SQL before the first '-- name: BLOCK'" \
        in output
    assert "Traceback" not in output and "CallInfo" not in output
