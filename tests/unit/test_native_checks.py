"""What the checker makes of a native worker's history: a heartbeat lease runs from when each
heartbeat was sent, and a worker loop that stopped on an error keeps the run from VALID."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from skiplock.queue_impl.interface import Guarantees
from skiplock.reports.checker import check_run
from skiplock.reports.synthetic import RunBuilder

PGQUEUER = Guarantees(account_limits=True, fencing=False, attempts_count="finished",
                      retry_cap=True, claim_transaction=False, recovery_switch=False)
FAIL_ONCE = {"name": "fail_once", "first": {"behaviour": "status", "status": 503}, "times": 1,
             "then": {"behaviour": "ok"}}
SUCCEED = {"name": "succeed", "first": {"behaviour": "ok"}, "times": None}


def _written(b: RunBuilder, run_dir: Path, lease: str | None) -> Path:
    b.write(run_dir)
    if lease is not None:
        spec = json.loads((run_dir / "spec.json").read_text())
        (run_dir / "spec.json").write_text(json.dumps({**spec, "lease": lease}))
    return run_dir


def _repicked_after_a_late_recorded_heartbeat() -> RunBuilder:
    """worker-0 picks the job at 100 and is still calling at 115.5; its one heartbeat was
    sent at 105 but recorded at 108.5 (the worker was paused in between). The heartbeat
    expired at 115 (105 + the 10 s lease), so worker-1's re-pick at 115.5 is legitimate."""
    b = RunBuilder(lease_seconds=10.0, http_timeout_seconds=30.0, guarantees=PGQUEUER.to_json())
    b.enqueue("j", script=FAIL_ONCE)
    b.attempt("j", 1, claimed=100.0, latency=16.0, status=503, behaviour="status")
    b.event("renew", "worker-0", 108.5, job_id="j", attempt=1, started=105.0,
            lease_token=str(uuid.uuid5(uuid.NAMESPACE_URL, "j-1")),
            locked_until="2026-01-01T00:00:00+00:00")
    b.attempt("j", 1, claimed=115.5, pick="again", worker="worker-1")
    b.final("j", "COMPLETED", attempts=1)
    return b


def test_a_heartbeat_lease_runs_from_when_the_heartbeat_was_sent(tmp_path: Path) -> None:
    b = _repicked_after_a_late_recorded_heartbeat()
    heartbeat = check_run([_written(b, tmp_path / "heartbeat", "heartbeat")])
    assert heartbeat.counts["concurrent_delivery"] == 0
    # The same history with the lease measured from when the renewal was recorded: the
    # re-pick lands inside worker-0's lease.
    for kind in ("renewal", None):
        renewal = check_run([_written(b, tmp_path / f"renewal-{kind}", kind)])
        assert renewal.counts["concurrent_delivery"] == 1


def test_an_unknown_lease_kind_is_bad_input(tmp_path: Path) -> None:
    import pytest

    from skiplock.reports.history import HistoryError

    run_dir = _written(_repicked_after_a_late_recorded_heartbeat(), tmp_path / "r", "ttl")
    with pytest.raises(HistoryError, match="lease must be"):
        check_run([run_dir])


def test_a_worker_that_stopped_on_an_error_leaves_the_run_unknown(tmp_path: Path) -> None:
    b = RunBuilder()
    b.enqueue("j", script=SUCCEED)
    b.attempt("j", 1, claimed=100.0)
    b.final("j", "COMPLETED", attempts=1)
    assert check_run([b.write(tmp_path / "clean")]).valid is True
    b.event("stop", "worker-1", 103.0, reason="error: InterfaceError: connection is closed")
    verdict = check_run([b.write(tmp_path / "stopped")])
    assert verdict.valid == "unknown"
    assert any("1 worker stopped on an error" in r and "worker-1" in r
               and "connection is closed" in r for r in verdict.unknown_reasons)
    stopped = verdict.details["workers_stopped_on_error"]
    assert stopped["count"] == 1 and stopped["examples"][0]["worker"] == "worker-1"
