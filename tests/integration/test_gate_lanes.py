"""`skiplock gate` with its cases two at a time: each lane owns its server (a restart fault
reaches one run only), results come back in the gate's order, and a stopped gate stops
every lane and leaves no process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

REPO = Path(__file__).resolve().parents[2]


def _gate(*args: str | Path, env: dict[str, str] | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "skiplock", "gate", *map(str, args)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          check=False, env=env)


def _run_window(run_dir: Path) -> tuple[float, float]:
    run = json.loads((run_dir / "run.json").read_text())
    return float(run["started"]), float(run["finished"])


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (by each process's parent in /proc)."""
    parent_of: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z":
                parent_of[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parent_of.items() if parent in frontier}
        found |= frontier
    return found


def test_two_lanes_on_embedded_servers_of_their_own(tmp_path: Path, harness_tmp: Any) -> None:
    from skiplock.scenarios.servers.postgres import DATA_PREFIX, DSN_ENV

    # As on a fresh machine: no server given, each lane starts an embedded one; the
    # restart fault of db-faults must run (not be skipped as on a shared server) and
    # reach its own run only, so both runs are judged valid.
    env = {k: v for k, v in os.environ.items() if k != DSN_ENV}
    out = tmp_path / "gate"
    done = _gate("--only", "db-faults,kill-workers", "--seed", "2", "--lanes", "2",
                 "--no-report", "--out", out, env=env)
    assert done.returncode == 0, (done.stdout, done.stderr)
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["scenario"], r["outcome"]) for r in summary["results"]] == [
        ("db-faults", "pass"), ("kill-workers", "pass")]
    runs = {r["scenario"]: Path(r["run_dir"]) for r in summary["results"]}
    (a_start, a_end), (b_start, b_end) = map(_run_window, runs.values())
    assert a_start < b_end and b_start < a_end, "the two cases did not run side by side"
    restarts = [json.loads(line) for line in
                (runs["db-faults"] / "nemesis.jsonl").read_text().splitlines()]
    restarts = [f for f in restarts if f["fault"] == "restart_postgres"]
    assert restarts and all(f["skipped"] is None for f in restarts), restarts
    assert [c.get("name") for c in ET.parse(out / "junit.xml").getroot().iter("testcase")] \
        == ["db-faults[seed=2]", "kill-workers[seed=2]"]
    assert harness_tmp.left_behind(DATA_PREFIX) == ([], {})


def test_sigterm_stops_every_lane_and_names_a_cut_case(tmp_path: Path, pg_dsn: str) -> None:
    out = tmp_path / "g"
    gate = subprocess.Popen(
        [sys.executable, "-m", "skiplock", "gate", "--only",
         "kill-workers,long-calls,crash-points", "--lanes", "2", "--seed", "5", "--dsn",
         pg_dsn, "--no-report", "--out", str(out)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / "runs").is_dir() or len(list((out / "runs").iterdir())) < 2:
            assert gate.poll() is None and time.monotonic() < deadline, gate.communicate()
            time.sleep(0.2)
        time.sleep(2)  # inside both cases' load
        below = _descendants(gate.pid)
        assert len(below) > 4, below  # two lanes, each with workers, target, producers
        gate.send_signal(signal.SIGTERM)
        _, stderr = gate.communicate(timeout=90)
    finally:
        if gate.poll() is None:
            gate.kill()
    assert gate.returncode == 143, stderr
    assert stderr.count("terminated (SIGTERM)") == 1, stderr
    alive = {pid for pid in below if Path(f"/proc/{pid}").exists()
             and (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z")}
    assert not alive, alive
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_code"] == 143 and summary["interrupted"] is True
    suite = ET.parse(out / "junit.xml").getroot()
    assert suite.get("errors") == "1"
    names = [c.get("name") for c in suite.iter("testcase")]
    assert "kill-workers[seed=5]" in names, names


def test_a_plugin_refused_by_every_lane_is_said_once(tmp_path: Path, pg_dsn: str) -> None:
    done = _gate("--backend-opt", "a=b", "--only", "kill-workers,long-calls", "--lanes", "2",
                 "--dsn", pg_dsn, "--out", tmp_path / "g")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.strip().splitlines() == [
        "skiplock: backend 'pg' takes no --backend-opt (options are passed to a"
        " package.module:factory plug-in's factory)"]
    assert not (tmp_path / "g").exists()
