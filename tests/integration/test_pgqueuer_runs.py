"""pgqueuer, a third-party PostgreSQL queue, under test as its users deploy it: its own
QueueManager in every worker process (`skiplock.queue_impl.pgqueuer_backend`), judged by the same
checker against the promises it declares, with picks told apart by lease token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from skiplock.reports.history import LOG_SUFFIX, WORKER_LOG, WORKERS_DIR, read_log

pytest.importorskip("pgqueuer", reason="pgqueuer is the optional extra skiplock[pgqueuer]")
pytest.importorskip("asyncpg", reason="pgqueuer's asyncpg driver: skiplock[pgqueuer]")

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BACKEND = "skiplock.queue_impl.pgqueuer_backend:factory"


def _run(scenario: str, out: Path, pg_dsn: str, *extra: str) -> tuple[dict, Path]:
    done = subprocess.run(
        [sys.executable, "-m", "skiplock", "run", scenario, "--backend", BACKEND,
         "--out", str(out), "--quiet", "--json", "--no-report", "--seed", "5", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "SKIPLOCK_PG_DSN": pg_dsn})
    assert "Traceback" not in done.stderr, done.stderr
    (run_dir,) = out.iterdir()
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    return json.loads(done.stdout), run_dir


def test_steady_on_pgqueuer(pg_dsn: str, tmp_path: Path) -> None:
    verdict, run_dir = _run("steady", tmp_path / "runs", pg_dsn, "--duration", "3")
    assert verdict["valid"] is True
    counts = verdict["counts"]
    assert counts["completed"] == counts["enqueued"] == counts["delivered"] > 100
    # Its accounts' limits are pgqueuer's entrypoint limits, so they are judged; fencing is
    # not promised.
    assert set(verdict["details"]["not_applicable"]) == {"stale_write"}
    spec = json.loads((run_dir / "spec.json").read_text())
    assert spec["guarantees"] == {"account_limits": True, "fencing": False, "fairness": True,
                                  "attempts_count": "finished", "retry_cap": True,
                                  "claim_transaction": False, "recovery_switch": False}
    assert spec["lease"] == "heartbeat"


def test_kill_workers_on_pgqueuer_repicks_are_keyed_by_lease(pg_dsn: str,
                                                             tmp_path: Path) -> None:
    verdict, _ = _run("kill-workers", tmp_path / "runs", pg_dsn)
    assert verdict["valid"] is True, verdict
    # Killed workers' jobs are picked again once their heartbeat stops, under the same
    # attempt number: each such pick is keyed apart, and every redelivery is explained.
    assert verdict["details"]["repicks_keyed_by_lease"] > 0
    assert verdict["counts"]["duplicate_explained"] > 0


def test_long_calls_on_pgqueuer_record_heartbeats_as_renewals(pg_dsn: str,
                                                               tmp_path: Path) -> None:
    """Calls longer than half the lease: pgqueuer's heartbeats keep the picks alive, and
    each is recorded as a renewal of the pick it kept, so the checker's lease ends move."""
    verdict, run_dir = _run("long-calls", tmp_path / "runs", pg_dsn)
    assert verdict["valid"] is True, verdict
    events = [e for path in (run_dir / WORKERS_DIR).glob(f"*{LOG_SUFFIX}")
              for e in read_log(path, WORKER_LOG)]
    claimed = {e["data"]["lease_token"] for e in events if e["kind"] == "claim"}
    renewed = [e for e in events if e["kind"] == "renew"]
    assert renewed, "no heartbeat was recorded"
    assert {e["data"]["lease_token"] for e in renewed} <= claimed


def test_a_setting_pgqueuer_cannot_honour_is_refused(pg_dsn: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "skiplock", "run", "steady", "--backend", BACKEND,
         "--no-recovery", "--out", str(tmp_path / "runs")],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "SKIPLOCK_PG_DSN": pg_dsn})
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "cannot be switched off" in line
    # Refused once the plug-in said what it promises: nothing of the run is left.
    assert not (tmp_path / "runs").exists()


def test_pause_workers_on_pgqueuer_drops_only_the_claim_phase_pause(pg_dsn: str,
                                                                   tmp_path: Path) -> None:
    """pgqueuer has no claim transaction: the claim-phase pause is dropped alone, said in one
    line, and both lease-phase pauses run; the run is judged on a heartbeat lease."""
    out = tmp_path / "runs"
    done = subprocess.run(
        [sys.executable, "-m", "skiplock", "run", "pause-workers", "--backend", BACKEND,
         "--out", str(out), "--no-report", "--seed", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "SKIPLOCK_PG_DSN": pg_dsn})
    said = done.stdout + done.stderr
    dropped = [line for line in said.splitlines() if "fault dropped" in line]
    assert len(dropped) == 1 and "pause_worker (phase claim)" in dropped[0], said[-3000:]
    assert "Traceback" not in said
    (run_dir,) = out.iterdir()
    spec = json.loads((run_dir / "spec.json").read_text())
    assert spec["lease"] == "heartbeat"
    assert len(spec["faults_dropped"]) == 1
    faults = [json.loads(line) for line in (run_dir / "nemesis.jsonl").read_text().splitlines()]
    # Both lease-phase pauses were carried out (or skipped for want of a lease holder, as on
    # any queue), and nothing stalled a claim.
    pauses = [f for f in faults if f.get("fault") == "pause_worker"]
    assert len(pauses) == 2, faults
    assert all((f.get("data") or {}).get("phase") != "claim" for f in pauses)
    # The library's own logging went to the run's logs/, one file per worker.
    assert sorted(p.name for p in (run_dir / "logs").iterdir())
    # Judged, whatever the verdict: a worker woken after its pick's heartbeat ran out still
    # delivers the job pgqueuer gave another worker meanwhile (a finding, not asserted away).
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert done.returncode in (0, 1, 3), said[-3000:]
    assert verdict["counts"]["enqueued"] > 0


def test_db_faults_on_pgqueuer_hunts_its_claims_in_their_own_commits(pg_dsn: str,
                                                                   tmp_path: Path) -> None:
    """pgqueuer's dequeue commits alone (no claim transaction, so no COMMIT statement): the
    commit-phase terminate_backends looks for its sessions waiting for a commit's flush, and
    on a server that waits for one it ends some there. A manager whose session is cut is
    started again, as `pgq run --restart-on-failure` does, so the run is judged: no worker
    stops on the error and leaves what it held unknown."""
    out = tmp_path / "runs"
    done = subprocess.run(
        [sys.executable, "-m", "skiplock", "run", "db-faults", "--backend", BACKEND,
         "--out", str(out), "--quiet", "--json", "--no-report", "--seed", "5"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "SKIPLOCK_PG_DSN": pg_dsn})
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode in (0, 1), (done.stdout[-3000:], done.stderr[-3000:])
    verdict = json.loads(done.stdout)
    assert not [r for r in verdict["unknown_reasons"] if "stopped on an error" in r], verdict
    (run_dir,) = out.iterdir()
    events = [e for path in sorted((run_dir / WORKERS_DIR).glob("*" + LOG_SUFFIX))
              for e in read_log(path, WORKER_LOG)]
    assert not [e for e in events if e["kind"] == "stop"
                and str(e["data"].get("reason", "")).startswith("error")], events
    restarts = [e for e in events if e["kind"] == "error" and e["data"].get("op") == "pgqueuer"]
    faults = [json.loads(line) for line in (run_dir / "nemesis.jsonl").read_text().splitlines()]
    hunts = [f["data"] for f in faults
             if f.get("fault") == "terminate_backends" and (f.get("data") or {}).get("phase")]
    assert hunts and all(h["aim"] == "commit flushes" for h in hunts), hunts
    with psycopg.connect(pg_dsn) as conn:
        waits = [conn.execute("SHOW fsync").fetchone(),
                 conn.execute("SHOW synchronous_commit").fetchone()]
    if waits == [("on",), ("on",)]:
        assert sum(h["terminated"] for h in hunts) > 0, hunts
    if any(h["terminated"] for h in hunts):
        # A cut manager was started again and went on claiming.
        assert restarts, hunts
        first = min(e["time"] for e in restarts)
        assert [e for e in events if e["kind"] == "claim" and e["time"] > first + 1.0]
