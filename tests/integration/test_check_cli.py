"""`skiplock check` as a user runs it: exit codes, one-line errors, verdict.json, summary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from skiplock.reports.history import ENQUEUE_LOG
from skiplock.reports.synthetic import RunBuilder

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SUCCEED = {"name": "succeed", "first": {"behaviour": "ok"}, "times": None,
           "then": {"behaviour": "ok"}}


def skiplock(*args: str | Path, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, sys.executable, "-m", "skiplock", *map(str, args)],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )


def refused(done: subprocess.CompletedProcess[str], needle: str) -> None:
    """Exit 2 with one line on stderr that says `needle`, and no traceback."""
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert needle in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


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
    done = skiplock("bench", "checker", "--deliveries", "2000", "--rounds", "2", "--out", out)
    assert done.returncode == 0, done.stderr
    assert "load" in done.stdout and "judge" in done.stdout and "total" in done.stdout
    assert "cache" in done.stdout
    assert "round 2 of 2" in done.stdout and "by round: cold s " in done.stdout
    result = json.loads(out.read_text())
    # Every round is kept; the summary's figures are the median round's (of two, the slower).
    assert result["parameters"]["rounds"] == 2 and len(result["rounds"]) == 2
    slower = max(result["rounds"], key=lambda r: r["cold"]["total_seconds"])
    assert result["seconds"] == slower
    assert "the median of 2 rounds" in done.stdout
    # The cache is written beside the check; the total counts what was left to wait for.
    for check in ("cold", "warm"):
        timings = result["seconds"][check]
        assert timings["cache_seconds"] >= 0
        assert timings["total_seconds"] == pytest.approx(
            timings["load_seconds"] + timings["judge_seconds"] + timings["cache_seconds"],
            abs=1e-3)
    assert result["parameters"]["deliveries"] == 2000
    assert result["valid"] is True
    assert {"machine", "packages", "git", "seconds"} <= set(result)
    assert result["packages"]["pandas"] and result["packages"]["pyarrow"]
    assert {"sha", "dirty"} <= set(result["git"])


# --------------------------------------------------------------------------------------------
# Histories that cannot be trusted: exit 2 (bad input) or 3 (unknown), never 1 or 0.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("again", ["same", "slash", "symlink"])
def test_run_directory_given_twice_exits_2(tmp_path: Path, again: str) -> None:
    run_dir = good_run(tmp_path)
    choices: dict[str, str | Path] = {"same": run_dir, "slash": f"{run_dir}/",
                                      "symlink": tmp_path / "link"}
    second = choices[again]
    if again == "symlink":
        (tmp_path / "link").symlink_to(run_dir)
    done = skiplock("check", run_dir, second)
    refused(done, "skiplock: check: RUN_DIR given twice: ")
    assert not (run_dir / "verdict.json").exists()


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--tolerance", "nan", "--tolerance must be a finite number of seconds >= 0, not nan"),
        ("--tolerance", "inf", "--tolerance must be a finite number of seconds >= 0, not inf"),
        ("--tolerance", "1e999", "--tolerance must be a finite number"),
        ("--tolerance", "-1", "--tolerance must be a finite number of seconds >= 0, not -1"),
        ("--examples", "0", "--examples must be a whole number >= 1, not 0"),
        ("--examples", "-3", "--examples must be a whole number >= 1, not -3"),
    ],
)
def test_bad_flags_exit_2(tmp_path: Path, flag: str, value: str, needle: str) -> None:
    run_dir = good_run(tmp_path)
    refused(skiplock("check", run_dir, flag, value), needle)
    assert not (run_dir / "verdict.json").exists()


def _cut(name: str, lines: int) -> Callable[[Path], None]:
    """Cut a log 7 bytes into its `lines`-th line from the end, as a writer killed in the
    middle of a write (and before the lines after it) leaves it."""

    def damage(run_dir: Path) -> None:
        path = run_dir / name
        kept = path.read_bytes().splitlines(keepends=True)[:-lines]
        path.write_bytes(b"".join(kept) + path.read_bytes().splitlines()[-lines][:7])

    return damage


@pytest.mark.parametrize(
    ("damage", "not_judged"),
    [
        # job-1's invoke and answer are the last lines: its delivery looks unexpected.
        (_cut("enqueues.csv", 2), "not judged: 1 unexpected"),
        # job-1's delivery is the last line: it looks lost, COMPLETED without a 2xx.
        (_cut("deliveries/target-0.csv", 1), "not judged: 1 lost, 1 state_mismatch"),
    ],
)
def test_log_cut_off_exits_3_not_1(tmp_path: Path, damage: Callable[[Path], None],
                                   not_judged: str) -> None:
    run_dir = good_run(tmp_path)
    damage(run_dir)
    done = skiplock("check", run_dir)
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert done.stderr == ""
    assert "truncated mid-line" in done.stdout
    assert not_judged in done.stdout.replace("\n", " ")
    assert "UNKNOWN" in done.stdout
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["valid"] == "unknown"


def test_empty_enqueues_log_exits_3(tmp_path: Path) -> None:
    run_dir = good_run(tmp_path)
    (run_dir / "enqueues.csv").write_bytes(b"")
    done = skiplock("check", run_dir)
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert "enqueues.csv is empty: it was cut off before its header" in done.stdout


def _nul_in_job_id(run_dir: Path) -> None:
    log = run_dir / "workers" / "worker-0.csv"
    log.write_bytes(log.read_bytes().replace(b"job-0", b"job-\x000", 1))


def _replace_with(name: str, make: Callable[[Path], object]) -> Callable[[Path], None]:
    def damage(run_dir: Path) -> None:
        path = run_dir / name
        path.unlink()
        make(path)

    return damage


def _run_json(**changes: object) -> Callable[[Path], None]:
    def damage(run_dir: Path) -> None:
        info = json.loads((run_dir / "run.json").read_text())
        (run_dir / "run.json").write_text(json.dumps({**info, **changes}))

    return damage


def _rewrite(name: str, old: str, new: str) -> Callable[[Path], None]:
    def damage(run_dir: Path) -> None:
        path = run_dir / name
        path.write_text(path.read_text().replace(old, new, 1))

    return damage


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (_nul_in_job_id, "worker-0.csv:2 holds a NUL byte, which a run never records"),
        (_write("run.json", "[" * 100_000), "run.json is nested too deeply"),
        (lambda d: (d / "run.json").write_bytes(b'{"drained": "\xff"}'),
         "run.json is not UTF-8"),
        (_run_json(http_timeout_seconds=float("inf")),
         "run.json: http_timeout_seconds must be a finite number, not inf"),
        (_run_json(retry_base_seconds=float("nan")),
         "run.json: retry_base_seconds must be a finite number, not nan"),
        (_run_json(lease_seconds=10**400), "run.json: lease_seconds must be a finite number"),
        (_run_json(account_limits={"acct-0": 10**400}), "run.json: account_limits must map"),
        (_run_json(durable="yes"), "run.json: durable must be true, false or null"),
        (_run_json(exit_reason=["x"]), "run.json: exit_reason must be a string"),
        (_replace_with("enqueues.csv", Path.mkdir),
         "enqueues.csv is a directory: a history file must be a regular file"),
        (_replace_with("workers/worker-0.csv", os.mkfifo),
         "worker-0.csv is not a regular file"),
        (_replace_with("nemesis.jsonl", lambda p: p.symlink_to(p.parent / "gone")),
         "nemesis.jsonl is a symbolic link to nothing"),
        (_replace_with("deliveries/target-0.csv", lambda p: None),
         "deliveries/ holds no delivery log (*.csv), nor does any other directory given"),
        (_rewrite("deliveries/target-0.csv", ",100.001,", ",inf,"),
         "target-0.csv:2: delivery field received is inf, not a time"),
        (_rewrite("deliveries/target-0.csv", ",100.001,", ",-5,"),
         "target-0.csv:2: delivery field received is -5.0, not a time"),
        (_rewrite("enqueues.csv", ",3,,,succeed", ",99999999,,,succeed"),
         "enqueues.csv:2: invoke needs max_attempts >= 1 (a whole number, at most 1000000)"),
    ],
)
def test_damaged_history_exits_2_with_one_line(tmp_path: Path, damage: Callable[[Path], None],
                                               needle: str) -> None:
    run_dir = good_run(tmp_path)
    damage(run_dir)
    refused(skiplock("check", run_dir), needle)
    assert not (run_dir / "verdict.json").exists()


def test_verdict_that_cannot_be_written_exits_2(tmp_path: Path) -> None:
    run_dir = good_run(tmp_path)
    (run_dir / "verdict.json").mkdir()
    refused(skiplock("check", run_dir), f"cannot write {run_dir / 'verdict.json'}")


def _without_file_permissions() -> tuple[str, ...]:
    """A prefix that runs the checker without the power to ignore file permissions."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("root ignores file permissions, and setpriv is not here to drop that")
    return ("setpriv", "--bounding-set=-dac_override,-dac_read_search")


@pytest.mark.parametrize(
    ("name", "needle"),
    [("workers/worker-0.csv", "worker-0.csv cannot be read (Permission denied)"),
     ("spec.json", "spec.json cannot be read (Permission denied)"),
     ("deliveries", "deliveries/ cannot be listed (Permission denied)")],
)
def test_unreadable_file_exits_2(tmp_path: Path, name: str, needle: str) -> None:
    prefix = _without_file_permissions()
    run_dir = good_run(tmp_path)
    (run_dir / name).chmod(0)
    try:
        refused(skiplock("check", run_dir, prefix=prefix), needle)
    finally:
        (run_dir / name).chmod(0o755)
