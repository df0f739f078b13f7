"""`skiplock sweep` end to end on two short steps: it measures each from its run
directory, writes a self-describing result and its plot, and names where the time went."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skiplock.scenarios.cli import main as cli

pytestmark = pytest.mark.integration


def test_a_two_step_sweep_writes_its_result_and_plot(
        pg_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["sweep", "steady", "--rates", "20,40", "--step", "2", "--p99", "5",
                     "--set", "warmup=0.5", "--dsn", pg_dsn, "--out", str(tmp_path)])
    assert code == 0
    [folder] = tmp_path.iterdir()
    doc = json.loads((folder / "sweep.json").read_text())
    assert doc["benchmark"] == "sweep" and doc["scenario"] == "steady"
    # A step whose producers fell short on a busy machine is run again with more of them;
    # the first run is kept, marked superseded, and does not count.
    judged = [s for s in doc["steps"] if not s.get("superseded")]
    assert [s["rate"] for s in judged] == [20, 40]
    for step in judged:
        # A light load on an idle queue: every job offered was delivered, well in time.
        assert step["offered_per_second"] > 0
        assert step["delivered_per_second"] >= 0.9 * step["offered_per_second"]
        assert step["meets_objective"] and not step["producers_short"]
        assert step["verdict"] == "True"
        assert Path(step["run_dir"]).is_dir()
        assert step["wait_samples"] > 0
        assert step["cpu"]["workers"] > 0, "the workers' CPU was not found"
        # What the step's slots allowed (Little's law), from its own claim and write times.
        assert 0 < step["lease_hold_seconds"] < 5
        assert {"account initech's slots (2, 25% of the jobs)", "workers' slots (2 x 10)"
                } == set(step["capacities"])
        # Producers and target sized to a light rate: one process each.
        assert step["producers"] == 1 and not step["distributed"]
        assert step["target_processes"] == 1
        # Every producer process said what its enqueues cost it.
        assert 0 < step["producer_cpu_ms_per_job"] < 100
    assert doc["knee_rate"] == 40 and doc["knee_above_rates"] is True
    assert (folder / "sweep.png").stat().st_size > 10_000
    assert "above 40 jobs/s" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    (["--rates", "40,20"], "--rates must increase"),
    (["--rates", "10", "--step", "0"], "--step"),
    (["--rates", "10", "--set", "nope=1"], "nope"),
])
def test_bad_sweeps_are_refused_before_anything_starts(
        args: list[str], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["sweep", *args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
