"""Worker processes under real signals: SIGTERM drains, SIGKILL leaves the lease to expire
and be recovered by another worker, a failpoint crash leaves the job to recovery, and
`skiplock worker` leaves no child behind.

Each test starts real processes (the echo target and the worker pool) on loopback; leases are
2 s and the HTTP timeout 0.5 s so the whole file stays short.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest

from skiplock.chaos.target import TargetProcess
from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.failpoints import FAILPOINT_EXIT_CODE
from skiplock.queue_impl.interface import Account, JobStatus, NewJob
from skiplock.queue_impl.pg import PgQueue
from skiplock.queue_impl.plugins import BackendSpec
from skiplock.reports.history import (
    DELIVERY_LOG,
    LOG_SUFFIX,
    WORKER_LOG,
    Behaviour,
    JobScript,
    LogFormat,
    Step,
    read_log,
)
from skiplock.scenarios.run.workers import WorkerPool

pytestmark = pytest.mark.chaos

T = TypeVar("T")

BASE = DispatcherConfig(
    batch=5,
    lease_seconds=2.0,
    http_timeout_seconds=0.5,
    write_margin_seconds=0.5,
    poll_seconds=0.1,
    recovery_interval_seconds=0.2,
    retry_base_seconds=0.1,
    retry_cap_seconds=0.5,
    retry_jitter=0.0,
)


def wait_for(what: str, probe: Callable[[], T | None], limit: float = 30.0) -> T:
    """Poll `probe` until it returns something truthy (bounded)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def target(tmp_path: Path) -> Iterator[TargetProcess]:
    with TargetProcess(tmp_path / "target", grace_seconds=0.5) as process:
        yield process


@pytest.fixture
def spec(pg_dsn: str, fresh_schema: str) -> Iterator[BackendSpec]:
    queue = PgQueue(pg_dsn, schema=fresh_schema)
    queue.setup()
    queue.upsert_accounts([Account(id="acct")])
    queue.close()
    yield BackendSpec(name="pg", dsn=pg_dsn, schema=fresh_schema)


def config_for(target: TargetProcess, **changes: Any) -> DispatcherConfig:
    return replace(BASE, allow_targets=(f"127.0.0.1:{target.port}",), **changes)


def enqueue(spec: BackendSpec, url: str, script: JobScript, count: int) -> list[uuid.UUID]:
    queue = spec.create()
    jobs = [
        NewJob(
            id=uuid.uuid4(),
            account_id="acct",
            target_url=url,
            payload={"script": script.to_json()},
            max_attempts=3,
        )
        for _ in range(count)
    ]
    try:
        queue.enqueue(jobs)
    finally:
        queue.close()
    return [job.id for job in jobs]


def snapshot(spec: BackendSpec) -> dict[uuid.UUID, Any]:
    queue = spec.create()
    try:
        return {state.job_id: state for state in queue.snapshot()}
    finally:
        queue.close()


def events(path: Path, log: LogFormat = WORKER_LOG) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return list(read_log(path, log))


def kinds_of(log: list[dict[str, Any]]) -> list[str]:
    """The kinds of a worker's events but `recover`: one comes from every recovery pass
    (every recovery interval), whatever it moved."""
    return [e["kind"] for e in log if e["kind"] != "recover"]


def deliveries(target: TargetProcess) -> list[dict[str, Any]]:
    return events(target.deliveries_path, DELIVERY_LOG)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes once reaped or defunct.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


SLOW = JobScript(name="slow", first=Step(behaviour=Behaviour.SLOW, seconds=0.3))


def test_sigterm_drains_gracefully(
    spec: BackendSpec, target: TargetProcess, tmp_path: Path
) -> None:
    job_ids = enqueue(spec, target.deliver_url, SLOW, count=30)
    events_dir = tmp_path / "workers"
    pool = WorkerPool(spec, config_for(target), 2, events_dir)
    with pool:
        # Stop while calls are in flight.
        wait_for("a delivery in flight", lambda: target.stats()["open"] > 0)
        pool.stop(grace_seconds=15.0)
        assert pool.exitcodes() == [0, 0]

    states = snapshot(spec)
    assert not [s for s in states.values() if s.status is JobStatus.PROCESSING]
    claimed: set[tuple[str, int]] = set()
    settled: set[tuple[str, int]] = set()
    for worker_id in pool.worker_ids:
        log = events(pool.events_path(worker_id))
        assert log[0]["kind"] == "start"
        assert log[-1]["kind"] == "stop"
        assert log[-1]["data"]["reason"] == "SIGTERM"
        for event in log:
            key = (event["job_id"], event["attempt"])
            if event["kind"] == "claim":
                claimed.add(key)
            elif event["kind"] in ("write", "release"):
                settled.add(key)
    # Every lease taken was either written back or released: nothing left to expire.
    assert claimed
    assert claimed == settled
    completed = {s.job_id for s in states.values() if s.status is JobStatus.COMPLETED}
    assert completed <= set(job_ids)
    assert len(completed) >= 1


def test_sigkill_mid_lease_leaves_the_lease_for_another_worker_to_recover(
    spec: BackendSpec, target: TargetProcess, tmp_path: Path
) -> None:
    config = config_for(target, batch=1)
    [job_id] = enqueue(spec, target.deliver_url, SLOW, count=1)
    first = WorkerPool(spec, config, 1, tmp_path / "first", name_prefix="first")
    with first:
        claim = wait_for(
            "the first worker's claim",
            lambda: [e for e in events(first.events_path("first-0")) if e["kind"] == "claim"],
        )[0]
        # Killed once its call is at the target, so the claim was received and its attempt
        # counts: killed between its claim and its receipt, the attempt would be given back
        # unreceived and the re-claim be attempt 1 again (another test's subject).
        wait_for("the first worker's call at the target",
                 lambda: sum(target.stats()["in_flight"].values()) >= 1)
        first.kill(0, signal.SIGKILL)
        assert first.join(10.0)
        assert first.exitcodes() == [-signal.SIGKILL]

    # The killed worker said nothing more, and its lease is still held.
    assert kinds_of(events(first.events_path("first-0"))) in (
        ["start", "claim"],
        ["start", "claim", "http"],
    )
    held = snapshot(spec)[job_id]
    assert held.status is JobStatus.PROCESSING
    assert held.attempts == 1

    second = WorkerPool(spec, config, 1, tmp_path / "second", name_prefix="second")
    with second:
        wait_for(
            "the job to complete after recovery",
            lambda: snapshot(spec)[job_id].status is JobStatus.COMPLETED,
        )
    log = events(second.events_path("second-0"))
    assert sum(e["data"].get("count", 0) for e in log if e["kind"] == "recover") >= 1
    [reclaim] = [e for e in log if e["kind"] == "claim"]
    assert (reclaim["job_id"], reclaim["attempt"]) == (str(job_id), 2)
    # Not before the first lease ran out.
    assert reclaim["data"]["locked_until"] > claim["data"]["locked_until"]
    second_delivery = [d for d in deliveries(target) if d["attempt"] == 2]
    assert len(second_delivery) == 1
    assert snapshot(spec)[job_id].attempts == 2


def test_crash_after_http_failpoint_kills_the_worker_before_the_write(
    spec: BackendSpec, target: TargetProcess, tmp_path: Path
) -> None:
    config = config_for(target, batch=1, failpoints=(("crash_after_http", 1.0),))
    [job_id] = enqueue(
        spec, target.deliver_url, JobScript(name="ok", first=Step(behaviour=Behaviour.OK)), count=1
    )
    pool = WorkerPool(spec, config, 1, tmp_path / "workers")
    with pool:
        assert pool.join(30.0)
        assert pool.exitcodes() == [FAILPOINT_EXIT_CODE]
    kinds = kinds_of(events(pool.events_path("worker-0")))
    assert kinds == ["start", "claim", "http", "failpoint"]
    # The target answered, but the queue never heard: the job waits for its lease to expire.
    assert [d["status"] for d in deliveries(target)] == [200]
    assert snapshot(spec)[job_id].status is JobStatus.PROCESSING


@pytest.mark.parametrize(
    ("how", "exit_code"),
    [("sigterm", 143), ("ctrl-c", 130)],
)
@pytest.mark.usefixtures("sigint_as_from_a_terminal")
def test_worker_command_drains_and_leaves_no_child(
    spec: BackendSpec,
    target: TargetProcess,
    tmp_path: Path,
    pg_dsn: str,
    how: str,
    exit_code: int,
) -> None:
    events_dir = tmp_path / "cli"
    env = {k: v for k, v in os.environ.items() if k != "SKIPLOCK_PG_DSN"}
    env["SKIPLOCK_PG_DSN"] = pg_dsn
    job_ids = enqueue(spec, target.deliver_url, SLOW, count=6)
    process = subprocess.Popen(
        [
            sys.executable, "-m", "skiplock", "worker",
            "--workers", "2", "--batch", "2", "--lease", "2", "--http-timeout", "0.5",
            "--write-margin", "0.5", "--poll", "0.1",
            "--schema", spec.schema,
            "--allow-target", f"127.0.0.1:{target.port}",
            "--events-dir", str(events_dir),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Its own process group, as a terminal gives it: Ctrl-C reaches every process in it.
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(
            "the jobs to complete",
            lambda: all(snapshot(spec)[j].status is JobStatus.COMPLETED for j in job_ids),
        )
        starts = [
            e["data"]["pid"]
            for path in sorted(events_dir.glob(f"*{LOG_SUFFIX}"))
            for e in events(path)
            if e["kind"] == "start"
        ]
        assert len(starts) == 2
        if how == "sigterm":
            process.send_signal(signal.SIGTERM)
        else:
            os.killpg(process.pid, signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == exit_code, err
    assert "skiplock worker: stopped" in err
    for pid in starts:
        assert not pid_alive(pid)
    for path in events_dir.glob(f"*{LOG_SUFFIX}"):
        assert events(path)[-1]["kind"] == "stop"


def test_crash_after_claim_failpoint_dies_before_any_http(
    spec: BackendSpec, target: TargetProcess, tmp_path: Path
) -> None:
    config = config_for(target, batch=1, failpoints=(("crash_after_claim", 1.0),))
    [job_id] = enqueue(spec, target.deliver_url, SLOW, count=1)
    pool = WorkerPool(spec, config, 1, tmp_path / "workers")
    with pool:
        assert pool.join(30.0)
        assert pool.exitcodes() == [FAILPOINT_EXIT_CODE]
    log = events(pool.events_path("worker-0"))
    assert kinds_of(log) == ["start", "claim", "failpoint"]
    assert log[-1]["data"]["name"] == "crash_after_claim"
    assert (log[-1]["job_id"], log[-1]["attempt"]) == (str(job_id), 1)
    assert deliveries(target) == []
    assert snapshot(spec)[job_id].status is JobStatus.PROCESSING


def test_a_pool_started_again_on_its_old_logs_waits_for_its_own_start(
    spec: BackendSpec, target: TargetProcess, tmp_path: Path
) -> None:
    config = config_for(target, batch=1)
    for run in (1, 2):
        pool = WorkerPool(spec, config, 1, tmp_path / "workers")
        with pool:
            # start() has returned: this run's own start event is in the log already.
            kinds = [e["kind"] for e in events(pool.events_path("worker-0"))]
            assert kinds.count("start") == run
    path = pool.events_path("worker-0")
    assert path.read_text().count("kind,worker,") == 1
    assert kinds_of(events(path)) == ["start", "stop", "start", "stop"]


_HARNESS_THAT_STARTS_A_TARGET = """
import sys, time
from pathlib import Path
from skiplock.chaos.target import TargetProcess
target = TargetProcess(Path(sys.argv[1]))
target.start()
print(target.pid, flush=True)
time.sleep(120)
"""


def test_a_target_dies_with_a_harness_killed_by_sigkill(tmp_path: Path) -> None:
    """SIGKILL leaves the harness no chance to clean up: the kernel's parent-death signal
    is what stops the target it started."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with subprocess.Popen([sys.executable, "-c", _HARNESS_THAT_STARTS_A_TARGET, str(tmp_path)],
                          stdout=subprocess.PIPE, text=True, env=env) as harness:
        assert harness.stdout is not None
        target_pid = int(harness.stdout.readline())
        os.kill(target_pid, 0)  # running
        harness.kill()
        harness.wait(10)

    def gone() -> bool | None:
        try:
            os.kill(target_pid, 0)
        except ProcessLookupError:
            return True
        # A zombie until init reaps it still counts as gone.
        try:
            stat = Path(f"/proc/{target_pid}/stat").read_text()
        except FileNotFoundError:
            return True
        return True if stat.split(") ")[1].startswith("Z") else None

    assert wait_for("the orphaned target to exit", gone, limit=15.0)


def _worker_command(spec: BackendSpec, target: TargetProcess, events_dir: Path, pg_dsn: str,
                    *extra: str) -> subprocess.Popen[str]:
    """`skiplock worker --workers 1` in its own session, as a terminal would start it."""
    env = {k: v for k, v in os.environ.items() if k != "SKIPLOCK_PG_DSN"}
    env["SKIPLOCK_PG_DSN"] = pg_dsn
    return subprocess.Popen(
        [
            sys.executable, "-m", "skiplock", "worker",
            "--workers", "1", "--batch", "2", "--lease", "2", "--http-timeout", "0.5",
            "--write-margin", "0.5", "--poll", "0.1",
            "--schema", spec.schema,
            "--allow-target", f"127.0.0.1:{target.port}",
            "--events-dir", str(events_dir), *extra,
        ],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def _starts(events_dir: Path) -> list[dict[str, Any]]:
    """Every worker's `start` event, oldest first."""
    found = [e for path in events_dir.glob(f"*{LOG_SUFFIX}") for e in events(path)
             if e["kind"] == "start"]
    return sorted(found, key=lambda e: float(e["time"]))


def test_worker_command_replaces_a_killed_worker_every_time_and_keeps_delivering(
    spec: BackendSpec, target: TargetProcess, tmp_path: Path, pg_dsn: str
) -> None:
    """Ten SIGKILLs in a row, each once the worker has delivered a job (2.5 s apart at the
    least, as an operator would): each time a new worker takes the slot, with a new id that
    names the one it replaces, and the command runs on."""
    events_dir = tmp_path / "cli"
    process = _worker_command(spec, target, events_dir, pg_dsn)
    kills = 10
    try:
        for n in range(kills + 1):
            start = wait_for(f"worker {n} to start",
                             lambda n=n: (_starts(events_dir)[n:] or [None])[0])
            [job_id] = enqueue(spec, target.deliver_url, SLOW, count=1)
            wait_for(f"job {n} to complete",
                     lambda j=job_id: snapshot(spec)[j].status is JobStatus.COMPLETED)
            assert process.poll() is None, process.communicate()[1]
            if n < kills:
                time.sleep(max(0.0, float(start["time"]) + 2.5 - time.time()))
                os.kill(int(start["data"]["pid"]), signal.SIGKILL)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 143, err
    starts = _starts(events_dir)
    assert len(starts) == kills + 1
    ids = [s["worker"] for s in starts]
    assert len(set(ids)) == len(ids)
    # host, the command's pid and a counter: unique across invocations and hosts
    assert ids[0].endswith(f"-{process.pid}-0")
    assert [s["data"].get("replaces") for s in starts] == [None, *ids[:-1]]
    by_job = {d["job_id"] for d in deliveries(target)}
    assert len(by_job) == kills + 1


def test_worker_command_gives_up_on_a_crash_loop_in_one_line(
    spec: BackendSpec, target: TargetProcess, tmp_path: Path, pg_dsn: str
) -> None:
    """Every worker dies at its first claim: three deaths within 30 s end the command with
    exit 4 and one line that says so; no worker is left behind."""
    events_dir = tmp_path / "cli"
    enqueue(spec, target.deliver_url, SLOW, count=20)
    process = _worker_command(spec, target, events_dir, pg_dsn,
                              "--failpoint", "crash_after_claim=1", "--crash-loop", "3/30")
    try:
        _, err = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 4, err
    [line] = [e for e in err.splitlines() if "crash loop" in e]
    assert "3 worker deaths within 30 s" in line
    starts = _starts(events_dir)
    assert len(starts) == 3
    for start in starts:
        assert not pid_alive(int(start["data"]["pid"]))
