"""`skiplock check` as a user runs it: exit codes, one-line errors, verdict.json, summary."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from reports.bench_checker import RunBuilder
from reports.history import ENQUEUE_LOG

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SUCCEED = {"name": "succeed", "first": {"behaviour": "ok"}, "times": None,
           "then": {"behaviour": "ok"}}


def skiplock(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scenarios.cli", *map(str, args)],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )


def good_run(tmp_path: Path) -> Path:
    b = RunBuilder()
    for n, at in enumerate((100.0, 101.0)):
        b.enqueue(f"job-{n}", script=SUCCEED)
        b.attempt(f"job-{n}", 1, claimed=at)
        b.final(f"job-{n}", "COMPLETED")
    return b.write(tmp_path / "run")


def test_valid_run_exits_0_and_writes_the_verdict(tmp_path: Path) -> None:
    run_dir = good_run(tmp_path)
    done = skiplock("check", run_dir)
    assert done.returncode == 0, done.stderr
    assert "VALID" in done.stdout
    assert str(run_dir / "verdict.json") in done.stdout.replace("\n", "")
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["valid"] is True
    assert verdict["counts"]["delivered"] == 2


def test_violated_run_exits_1_with_examples(tmp_path: Path) -> None:
    b = RunBuilder()
    b.enqueue("gone", script=SUCCEED)
    run_dir = b.write(tmp_path / "run")
    done = skiplock("check", run_dir)
    assert done.returncode == 1, done.stderr
    assert "VIOLATED" in done.stdout
    assert "lost: gone:" in done.stdout
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["valid"] is False
    assert verdict["examples"]["lost"][0]["job_id"] == "gone"


def test_drain_timeout_exits_3(tmp_path: Path) -> None:
    b = RunBuilder(drained=False)
    b.enqueue("live", script=SUCCEED)
    b.final("live", "PENDING")
    run_dir = b.write(tmp_path / "run")
    done = skiplock("check", run_dir)
    assert done.returncode == 3, done.stderr
    assert json.loads((run_dir / "verdict.json").read_text())["valid"] == "unknown"


def test_truncated_log_exits_3(tmp_path: Path) -> None:
    run_dir = good_run(tmp_path)
    log = next((run_dir / "workers").glob("*.csv"))
    with log.open("a") as fh:
        fh.write("claim,wor")
    done = skiplock("check", run_dir)
    assert done.returncode == 3, done.stderr
    assert "truncated mid-line" in done.stdout


def _unlink(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).unlink()


def _write(name: str, text: str) -> Callable[[Path], None]:
    def damage(run_dir: Path) -> None:
        (run_dir / name).write_text(text)

    return damage


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (_unlink("run.json"), "run.json is missing"),
        (_unlink("enqueues.csv"), "enqueues.csv is missing"),
        (_unlink("spec.json"), "spec.json is missing"),
        (_write("final_jobs.csv", "not a header\n"),
         "final_jobs.csv:1 is not a header of final job state columns"),
        (_write("run.json", "[1, 2]"), "run.json is not a JSON object"),
        (_write("run.json", '{"drained": "maybe"}'), "run.json lacks"),
        (_write("enqueues.csv", ENQUEUE_LOG.header() + ENQUEUE_LOG.line(
            {"type": "maybe", "job_id": "a"})), "enqueues.csv:2: enqueue type 'maybe'"),
        (_write("enqueues.csv", ENQUEUE_LOG.header() + "invoke,a,1.0\n"),
         "enqueues.csv:2 has 3 fields, the header 17"),
        (_write("deliveries/target-0.csv", "received\n1.0\n"),
         "target-0.csv:1: the header has no job_id column"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path: Path, damage: Callable[[Path], None],
                                         needle: str) -> None:
    run_dir = good_run(tmp_path)
    damage(run_dir)
    done = skiplock("check", run_dir)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert needle in done.stderr
    assert "Traceback" not in done.stderr
    assert not (run_dir / "verdict.json").exists()


def test_missing_directory_exits_2(tmp_path: Path) -> None:
    done = skiplock("check", tmp_path / "nope")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"skiplock: check: {tmp_path / 'nope'} is not a directory"]


def test_second_directory_without_logs_exits_2(tmp_path: Path) -> None:
    run_dir = good_run(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    done = skiplock("check", run_dir, empty)
    assert done.returncode == 2
    assert "holds none of deliveries/, workers/, enqueues.csv" in done.stderr


def test_incomplete_final_snapshot_exits_3(tmp_path: Path) -> None:
    """run.json says the snapshot had 5 rows; final_jobs.csv has 2: not judged valid."""
    run_dir = good_run(tmp_path)
    info = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**info, "final_jobs": 5}))
    done = skiplock("check", run_dir)
    assert done.returncode == 3, done.stderr
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["unknown_reasons"] == [
        "final snapshot incomplete: run.json says 5 rows, final_jobs.csv has 2"]


def test_no_directory_is_a_usage_error() -> None:
    done = skiplock("check")
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1


def test_bench_checker_small(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = skiplock("bench", "checker", "--deliveries", "2000", "--out", out)
    assert done.returncode == 0, done.stderr
    assert "load" in done.stdout and "judge" in done.stdout and "total" in done.stdout
    result = json.loads(out.read_text())
    assert result["parameters"]["deliveries"] == 2000
    assert result["valid"] is True
    assert {"machine", "packages", "git", "seconds"} <= set(result)
    assert result["packages"]["pandas"] and result["packages"]["pyarrow"]
    assert {"sha", "dirty"} <= set(result["git"])
