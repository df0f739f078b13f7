"""Every command under real signals, as a user or CI sends them: SIGTERM exits 143 and Ctrl-C
130, each after the command's cleanup, whatever the server source; SIGKILL leaves neither a
process nor an embedded server's data folder behind.

The runs here use the embedded server (no DSN, no Docker), as a fresh machine and CI do: its
own SIGTERM handling once bypassed the CLI's and skipped the final snapshot."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from skiplock.reports.history import (
    ENQUEUES_FILE,
    FINAL_JOBS_FILE,
    FINAL_JOBS_LOG,
    LOG_SUFFIX,
    RUN_FILE,
    WORKER_LOG,
    read_json,
    read_log,
)
from skiplock.scenarios.servers.postgres import DATA_PREFIX, DSN_ENV, OWNER_FILE

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("sigint_as_from_a_terminal"),
]

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "skiplock", *map(str, args)]


def _embedded_env() -> dict[str, str]:
    """No DSN, and a Docker address nothing answers: the embedded server is used."""
    env = {k: v for k, v in os.environ.items() if k != DSN_ENV}
    env["DOCKER_HOST"] = "tcp://127.0.0.1:1"
    return env


def _poll(what: str, condition: Callable[[], object], seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _stat(pid: int) -> list[str] | None:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _descendants(root: int) -> dict[int, str]:
    """Every live process below `root`, with its command line."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return {pid: _cmdline(pid) for pid in found if _running(pid)}


def _data_folders(harness: int) -> list[Path]:
    """Embedded servers' folders that `harness` owns."""
    return [
        root
        for root in Path(tempfile.gettempdir()).glob(f"{DATA_PREFIX}*")
        if (root / OWNER_FILE).exists() and (root / OWNER_FILE).read_text().strip() == str(harness)
    ]


@pytest.fixture
def started_run(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, dict[int, str]]]:
    """`skiplock run steady` on the embedded server, caught mid-load: the process, its runs
    folder, and every process it had started by then (server, target, workers, producers)."""
    runs = tmp_path / "runs"
    with (tmp_path / "stderr").open("w") as err:
        run = subprocess.Popen(
            _cli("run", "steady", "--quiet", "--seed", "1", "--out", runs,
                 "--warmup", "0.5", "--duration", "60", "--rate", "40"),
            cwd=REPO, env=_embedded_env(), stdout=subprocess.DEVNULL, stderr=err,
            # Its own process group, as a terminal gives a command: Ctrl-C reaches all of it.
            start_new_session=True,
        )  # fmt: skip
    try:

        def loading() -> bool:
            logs = list(runs.glob(f"*/{ENQUEUES_FILE}"))
            # `type` is the first column; the log may end mid-line, so no read_log here.
            return bool(logs) and sum(
                line.startswith("ok,") for line in logs[0].read_text().splitlines()
            ) >= 20

        _poll("the load phase", lambda: loading() or run.poll() is not None, 60.0)
        assert run.poll() is None, (tmp_path / "stderr").read_text()
        children = _descendants(run.pid)
        yield run, runs, children
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()


def _own_lines(stderr: str) -> str:
    """stderr without what child processes print as they die of a Ctrl-C sent to the whole
    group: multiprocessing's "Process NAME:" and the child's traceback, and gevent's own
    "KeyboardInterrupt" and time stamp. (The producers still print those: not the CLI's.)"""
    kept: list[str] = []
    in_child = False
    for line in stderr.splitlines():
        if line.startswith("Process skiplock-"):
            in_child = True
        elif in_child:
            in_child = line != "KeyboardInterrupt"
        elif line != "KeyboardInterrupt" and not line[:4].isdigit():
            kept.append(line)
    return "\n".join(kept)


def _no_process_left(run: subprocess.Popen[bytes], children: dict[int, str]) -> None:
    """Every process the command started has exited. multiprocessing's resource tracker
    leaves on its own once its parent is gone, so it gets a few seconds."""
    leftover = {
        pid: cmd
        for pid, cmd in children.items()
        if _running(pid) and "resource_tracker" not in cmd
    }
    assert leftover == {}, leftover
    _poll("the resource tracker to leave", lambda: not any(map(_running, children)), 10.0)


@pytest.mark.parametrize(
    ("signum", "code", "said"),
    [(signal.SIGTERM, 143, "terminated (SIGTERM)"), (signal.SIGINT, 130, "interrupted")],
    ids=["sigterm", "ctrl-c"],
)
def test_interrupted_run_on_the_embedded_server_is_cleaned_up_and_judgeable(
    started_run: tuple[subprocess.Popen[bytes], Path, dict[int, str]],
    tmp_path: Path,
    signum: int,
    code: int,
    said: str,
) -> None:
    run, runs, children = started_run
    folders = _data_folders(run.pid)
    assert len(folders) == 1
    assert any("postgres" in cmd for cmd in children.values())
    if signum == signal.SIGINT:
        os.killpg(run.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole group
    else:
        run.send_signal(signal.SIGTERM)  # kill, a CI runner: the top process only
    assert run.wait(timeout=60) == code, (tmp_path / "stderr").read_text()
    stderr = (tmp_path / "stderr").read_text()
    assert f"skiplock: {said}" in stderr
    assert "Traceback" not in _own_lines(stderr), stderr
    _no_process_left(run, children)
    assert not folders[0].exists()

    run_dir = next(runs.iterdir())
    info = read_json(run_dir / RUN_FILE)
    assert info["exit_reason"] == "interrupted"
    assert info["final_snapshot"] == "taken after the interrupt"
    rows = list(read_log(run_dir / FINAL_JOBS_FILE, FINAL_JOBS_LOG))
    assert info["final_jobs"] == len(rows) > 0
    check = subprocess.run(
        _cli("check", run_dir), cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert check.returncode == 3, (check.stdout, check.stderr)


def test_sigkill_leaves_no_process_and_no_data_folder(
    started_run: tuple[subprocess.Popen[bytes], Path, dict[int, str]],
) -> None:
    run, _, children = started_run
    folders = _data_folders(run.pid)
    assert len(folders) == 1
    run.kill()
    assert run.wait(timeout=10) == -signal.SIGKILL
    # The children die with their parent (a parent-death signal); the server's remover stops
    # what is left of the server and deletes its folder.
    _poll("every process to exit", lambda: not any(map(_running, children)), 30.0)
    _poll("the data folder to go", lambda: not folders[0].exists(), 10.0)


def test_worker_sigterm_drains_then_exits_143(
    pg_dsn: str, fresh_schema: str, tmp_path: Path
) -> None:
    events_dir = tmp_path / "events"
    worker = subprocess.Popen(
        _cli("worker", "--dsn", pg_dsn, "--schema", fresh_schema, "--workers", "2",
             "--poll", "0.1", "--events-dir", events_dir),
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        # Once it says how to stop it, the pool has started: both workers run and log.
        assert worker.stderr is not None
        before: list[str] = []
        for line in worker.stderr:
            before.append(line)
            if "Ctrl-C to stop" in line:
                break
        assert "Ctrl-C to stop" in before[-1], "".join(before)
        starts = [
            event["data"]["pid"]
            for path in events_dir.glob(f"*{LOG_SUFFIX}")
            for event in read_log(path, WORKER_LOG)
            if event["kind"] == "start"
        ]
        assert len(starts) == 2
        children = _descendants(worker.pid)
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.communicate()
    assert worker.returncode == 143, err
    assert "skiplock worker: stopped" in err
    assert "skiplock: terminated (SIGTERM)" in err
    for path in events_dir.glob(f"*{LOG_SUFFIX}"):
        assert list(read_log(path, WORKER_LOG))[-1]["kind"] == "stop"  # drained, not killed
    assert not any(map(_running, starts))
    _no_process_left(worker, children)


def test_target_sigterm_exits_143(tmp_path: Path) -> None:
    target = subprocess.Popen(
        _cli("target", "--port", "0", "--out", tmp_path),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert target.stdout is not None
        assert "listening on http://127.0.0.1:" in target.stdout.readline()
        target.send_signal(signal.SIGTERM)
        _, err = target.communicate(timeout=30)
    finally:
        if target.poll() is None:
            os.killpg(target.pid, signal.SIGKILL)
            target.communicate()
    assert target.returncode == 143, err
    assert err.strip() == "skiplock: terminated (SIGTERM)"
