"""`skiplock bench e2e` for a second per phase, BullMQ's phase included: it runs, describes
itself and leaves nothing behind. Speed is measured by the command, never asserted here."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from skiplock.scenarios.bench import e2e as bench_e2e

pytestmark = pytest.mark.integration


def test_bench_e2e_against_bullmq_relaxed_runs_all_three_phases(
        pg_dsn: str, tmp_path: Path, embedded_redis_only: None,
        assert_ratio: Callable[..., None], capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "e2e.json"
    parser = argparse.ArgumentParser()
    bench_e2e.configure(parser)
    args = parser.parse_args(["--workers", "2", "--batch", "5", "--duration", "1",
                              "--prefill", "2000", "--against", "bullmq",
                              "--durability", "relaxed", "--dsn", pg_dsn, "--out", str(out)])
    assert bench_e2e.run(args) == 0
    # Nothing but the command's own lines: no library noise from any worker process.
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Unclosed" not in err and "Exception" not in err, err
    doc = json.loads(out.read_text())
    assert doc["durability"] == "relaxed" and doc["durable"] is False
    assert doc["postgres"]["session_synchronous_commit"] == "off"
    for phase in ("e2e", "bullmq"):
        assert 0 < doc[phase]["jobs"] <= 2000, phase
        assert 0 < doc[phase]["job_p50_ms"] <= doc[phase]["job_p99_ms"], phase
    assert doc["bullmq"]["redis"]["appendfsync"] == "everysec"
    # Where the CPU went: both servers run on this machine, so each is measured.
    assert doc["e2e"]["server_cpu_seconds"] > 0
    assert doc["bullmq"]["redis_cpu_seconds"] > 0
    for phase in ("e2e", "bullmq"):
        assert 0 < doc[phase]["machine_busy"] <= 1
    assert_ratio(doc["ratio_to_bullmq"], doc["e2e"], doc["bullmq"])
    assert_ratio(doc["ratio"], doc["e2e"], doc["queue"])
    # Nothing left: schemas, Redis's folder, its process.
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'bench\\_%'").fetchone()
    assert row == (0,)


def test_bench_e2e_against_pgqueuer_runs_its_queue_manager_over_http(
        pg_dsn: str, tmp_path: Path, assert_ratio: Callable[..., None],
        capfd: pytest.CaptureFixture[str], pgqueuer_databases: Any) -> None:
    out = tmp_path / "e2e.json"
    parser = argparse.ArgumentParser()
    bench_e2e.configure(parser)
    args = parser.parse_args(["--workers", "2", "--batch", "5", "--duration", "1",
                              "--prefill", "2000", "--against", "pgqueuer",
                              "--dsn", pg_dsn, "--out", str(out)])
    assert bench_e2e.run(args) == 0
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err and "Unclosed" not in captured.err, captured.err
    doc = json.loads(out.read_text())
    # pgqueuer's entrypoint made real calls to the echo target, and was timed like ours.
    assert 0 < doc["pgqueuer"]["jobs"] <= 2000
    assert 0 < doc["pgqueuer"]["job_p50_ms"] <= doc["pgqueuer"]["job_p99_ms"]
    assert doc["pgqueuer"]["target_cpu_seconds"] > 0
    assert doc["pgqueuer"]["version"]
    assert_ratio(doc["ratio_to_pgqueuer"], doc["e2e"], doc["pgqueuer"])
    assert "ratio PgQueue end to end / pgqueuer end to end" in captured.out
    # Where our jobs' time went, stage by stage; pgqueuer's loop logs too little for that.
    stages = doc["e2e"]["stages_p50_ms"]
    assert list(stages) == list(bench_e2e.STAGES) and stages["call"] > 0
    assert all(value >= 0 for value in stages.values()), stages
    assert doc["pgqueuer"]["stages_p50_ms"] is None
    assert captured.out.count("p50 ms per stage: claim ") == 1
    assert len(pgqueuer_databases.names) == 1
    assert pgqueuer_databases.left_on(pg_dsn) == []


def test_bench_e2e_keeps_each_round_and_reports_the_median(pg_dsn: str, tmp_path: Path) -> None:
    from skiplock.scenarios.cli.compare import spread

    out = tmp_path / "e2e.json"
    parser = argparse.ArgumentParser()
    bench_e2e.configure(parser)
    args = parser.parse_args(["--workers", "1", "--batch", "5", "--duration", "1",
                              "--prefill", "1000", "--rounds", "3", "--dsn", pg_dsn,
                              "--out", str(out)])
    assert bench_e2e.run(args) == 0
    doc = json.loads(out.read_text())
    assert doc["params"]["rounds"] == 3 and len(doc["rounds"]) == 3
    rates = sorted(r["e2e"]["jobs_per_second"] for r in doc["rounds"])
    assert doc["e2e"]["jobs_per_second"] == rates[1]  # the median round stands for it
    ranges = spread(out, doc)
    assert ranges["end to end (jobs/s)"] == (rates[0], rates[2])


@pytest.mark.parametrize("rounds", ["0", "21"])
def test_bench_e2e_refuses_rounds_out_of_range(rounds: str, tmp_path: Path) -> None:
    from skiplock.plumbing.errors import UsageError

    parser = argparse.ArgumentParser()
    bench_e2e.configure(parser)
    args = parser.parse_args(["--rounds", rounds, "--out", str(tmp_path / "x.json")])
    with pytest.raises(UsageError, match="--rounds must be from 1 to 20"):
        bench_e2e.run(args)
