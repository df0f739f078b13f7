"""`skiplock worker`'s supervision settings and worker ids (pure logic; the real kills are
in tests/chaos/test_worker_signals.py)."""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

import pytest

from skiplock.plumbing.errors import UsageError
from skiplock.scenarios.cli.worker import _crash_loop
from skiplock.scenarios.run.workers import CrashLoop, unique_prefix


def test_crash_loop_is_deaths_over_seconds() -> None:
    assert _crash_loop("3/30") == CrashLoop(deaths=3, seconds=30.0)
    assert _crash_loop("1/0.5") == CrashLoop(deaths=1, seconds=0.5)


@pytest.mark.parametrize("text", ["3", "0/5", "-1/5", "3/0", "3/-2", "x/5", "3/y", "2.5/5"])
def test_a_crash_loop_that_means_nothing_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="is not N/SECONDS"):
        _crash_loop(text)


def test_crash_loop_validation_names_the_bad_value() -> None:
    with pytest.raises(UsageError, match="deaths must be a positive whole number"):
        CrashLoop(deaths=0).validate()
    with pytest.raises(UsageError, match="seconds must be positive"):
        CrashLoop(seconds=float("nan")).validate()


def test_worker_ids_name_the_host_and_this_process() -> None:
    prefix = unique_prefix()
    host = socket.gethostname().split(".")[0]
    assert prefix.startswith("worker-") and prefix.endswith(f"-{os.getpid()}")
    if host.replace("-", "").isalnum():
        assert f"-{host}-" in prefix
    assert unique_prefix("w").startswith("w-")


def test_the_lease_tracker_keeps_each_open_attempt_with_its_claim_time(tmp_path: Path) -> None:
    from skiplock.reports.history import WORKER_LOG, LogWriter, WorkerEvent
    from skiplock.scenarios.run.workers import _LeaseTracker

    path = tmp_path / "w-1.csv"
    tracker = _LeaseTracker()
    with LogWriter(path, WORKER_LOG) as writer:
        writer.write(WorkerEvent(kind="start", worker="w-1", time=1.0, data={"pid": 1}))
        for job, at in (("a", 2.0), ("b", 2.5), ("c", 2.75)):
            writer.write(WorkerEvent(kind="claim", worker="w-1", time=at, job_id=job,
                                     attempt=3, data={"lease_token": job}))
        assert [(x.worker, x.job_id, x.attempt, x.claimed_at) for x in tracker.leases(
            {"w-1": path, "w-2": tmp_path / "none.csv"})] == [
            ("w-1", "a", 3, 2.0), ("w-1", "b", 3, 2.5), ("w-1", "c", 3, 2.75)]
        writer.write(WorkerEvent(kind="write", worker="w-1", time=3.0, job_id="a", attempt=3,
                                 data={"result": "applied", "outcome": "transient"}))
        writer.write(WorkerEvent(kind="release", worker="w-1", time=3.1, job_id="b",
                                 attempt=3, data={"result": "applied"}))
    assert [(x.worker, x.job_id, x.attempt, x.claimed_at)
            for x in tracker.leases({"w-1": path})] == [("w-1", "c", 3, 2.75)]
    assert tracker.holding({"w-1": path}) == ["w-1"]
