"""report.html from real runs: written by the run itself, rendered from damaged run
directories, compared side by side, refused for bad input, and opened in a real browser."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from skiplock.chaos.nemesis import shortcut
from skiplock.reports.history import (
    FINAL_JOBS_FILE,
    VERDICT_FILE,
    WAITS_FILE,
    WORKERS_DIR,
    read_json,
)
from skiplock.reports.report import REPORT_FILE
from skiplock.scenarios.run import spec as spec_mod
from skiplock.scenarios.run.options import RunOptions, RunResult
from skiplock.scenarios.run.runner import run_scenario

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PLOTS = 5  # throughput, latency, queue and account load, attempts, wait events
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def faulted_run(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """A short faulty-targets run with workers killed during the load."""
    spec = spec_mod.load("faulty-targets", ["warmup=0.5", "duration=4", "drain_timeout=40"])
    spec = dataclasses.replace(spec, nemesis=shortcut("kill_worker")).validate()
    out = tmp_path_factory.mktemp("report-runs")
    return run_scenario(spec, RunOptions(seed=7, out=out, dsn=pg_dsn))


def _plots(page: str) -> int:
    return len(re.findall(r"<img class=\"plot\"", page))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "skiplock", *args],
                          capture_output=True, text=True, timeout=120)


def test_a_run_writes_its_report_with_every_plot_and_the_replay_command(
        faulted_run: RunResult) -> None:
    run_dir = faulted_run.run_dir
    assert faulted_run.report == run_dir / REPORT_FILE, faulted_run.report_error
    page = (run_dir / REPORT_FILE).read_text()
    word = {True: "VALID", False: "VIOLATED"}.get(faulted_run.verdict.valid, "UNKNOWN")
    assert 'class="badge' in page and f">{word}</span>" in page
    assert _plots(page) == PLOTS
    assert "could not be drawn" not in page
    assert "What this report could not read" not in page
    # Self-contained: nothing fetched from the network when it is opened.
    assert not re.search(r"(src|href)=['\"]https?:", page)
    # The faults the nemesis applied are named in the run's history, and the page says how
    # to replay the run.
    replay = read_json(run_dir / "spec.json")["replay"]
    assert replay.startswith("skiplock run faulty-targets --seed 7 --set warmup=0.5")
    assert "fault schedule recorded in spec.json" in replay
    assert "skiplock run faulty-targets --seed 7" in page
    # Wait events were sampled from pg_stat_activity once a second during the run.
    lines = (run_dir / WAITS_FILE).read_text().splitlines()
    assert lines[0] == "time,row,wait,sessions"
    connected = [line for line in lines[1:] if ",connected," in line]
    assert len(connected) >= 4
    assert all(int(line.rsplit(",", 1)[1]) >= 1 for line in connected)


def test_a_damaged_run_still_gets_a_report_that_says_what_is_missing(
        faulted_run: RunResult, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(faulted_run.run_dir, damaged)
    (damaged / VERDICT_FILE).unlink()
    (damaged / FINAL_JOBS_FILE).unlink()
    (damaged / REPORT_FILE).unlink()
    log = sorted((damaged / WORKERS_DIR).glob("*.csv"))[0]
    data = log.read_bytes()
    log.write_bytes(data[: data.rfind(b"\n", 0, len(data) - 1) + 12])  # cut mid-line
    done = _cli("report", str(damaged))
    assert done.returncode == 0, done.stderr
    page = (damaged / REPORT_FILE).read_text()
    assert ">NOT CHECKED</span>" in page
    assert "verdict.json is missing" in page
    assert "final_jobs.csv is missing" in page
    assert f"{WORKERS_DIR}/{log.name} was cut off mid-line" in page
    # Throughput and latency still drawn from the logs that remain.
    assert _plots(page) >= 4


def test_several_runs_compare_on_one_page(faulted_run: RunResult, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(faulted_run.run_dir, other)
    out = tmp_path / "compare.html"
    done = _cli("report", str(faulted_run.run_dir), str(other), "--out", str(out))
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    assert "Headline figures" in page
    assert page.count(faulted_run.run_dir.name) >= 2 and ">other<" in page
    assert _plots(page) == 3


@pytest.mark.parametrize("args, says", [
    (["/nonexistent/run"], "does not exist"),
    (["."], "holds no run"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], says: str) -> None:
    done = _cli("report", *args)
    assert done.returncode == 2
    assert says in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_out_that_is_a_directory_is_refused(faulted_run: RunResult, tmp_path: Path) -> None:
    done = _cli("report", str(faulted_run.run_dir), "--out", str(tmp_path))
    assert done.returncode == 2 and "is a directory" in done.stderr


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get "
                                             "install chromium); .ci/run installs it")
def test_the_report_renders_in_a_real_browser(faulted_run: RunResult, tmp_path: Path) -> None:
    """Headless Chromium opens the page: every plot decodes (the page counts them on load),
    the console stays silent, and a screenshot is taken for a person to look at."""
    assert CHROMIUM is not None
    page = faulted_run.run_dir / REPORT_FILE
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True,
                         text=True, timeout=90)
    assert dom.returncode == 0, dom.stderr[-2000:]
    rendered = re.search(r'data-plots="(\d+)" data-plots-rendered="(\d+)"', dom.stdout)
    assert rendered is not None, dom.stdout[:500]
    assert rendered.groups() == (str(PLOTS), str(PLOTS))
    assert "CONSOLE" not in dom.stderr, [line for line in dom.stderr.splitlines()
                                         if "CONSOLE" in line]
    shot = tmp_path / "report.png"
    taken = subprocess.run([*flags, "--window-size=1300,2400", f"--screenshot={shot}",
                            page.as_uri()], capture_output=True, text=True, timeout=90)
    assert taken.returncode == 0, taken.stderr[-2000:]
    assert shot.stat().st_size > 50_000  # a page of plots, not a blank one
