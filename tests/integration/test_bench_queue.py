"""The queue benchmark end to end for a second per phase: it runs and describes itself.
Speed is measured by `skiplock bench queue`, never asserted here."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import psycopg
import pytest

from plumbing.errors import UsageError
from scenarios import bench_claim, bench_queue

pytestmark = pytest.mark.integration


def test_bench_queue_writes_a_self_describing_result(pg_dsn: str, tmp_path: Path) -> None:
    out = tmp_path / "queue.json"
    parser = argparse.ArgumentParser()
    bench_queue.configure(parser)
    args = parser.parse_args(
        [
            "--workers",
            "2",
            "--batch",
            "5",
            "--duration",
            "1",
            "--prefill",
            "3000",
            "--dsn",
            pg_dsn,
            "--out",
            str(out),
        ]
    )
    assert bench_queue.run(args) == 0
    doc = json.loads(out.read_text())
    assert doc["params"] == {"workers": 2, "batch": 5, "duration": 1.0, "prefill": 3000}
    for phase in ("queue", "ceiling"):
        assert doc[phase]["jobs"] > 0, f"{phase} completed no job"
        assert doc[phase]["cycles"] > 0
        assert doc[phase]["cycle_p50_ms"] <= doc[phase]["cycle_p99_ms"]
    assert doc["ratio"] == pytest.approx(
        doc["queue"]["jobs_per_second"] / doc["ceiling"]["jobs_per_second"]
    )
    assert doc["postgres"]["server_version"]
    assert "fsync" in doc["postgres"]
    assert {"sha", "dirty"} <= set(doc["git"])
    assert doc["machine"]["cpu_count"] >= 1
    # Nothing of the benchmark is left in the database.
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'bench\\_%'"
        ).fetchone()
    assert row == (0,)


def test_bench_queue_against_pgqueuer_measures_it_beside_the_reference(
        pg_dsn: str, tmp_path: Path) -> None:
    """pgqueuer's own QueueManager processes drain the same backlog on the same server, and
    their database is gone afterwards."""
    pytest.importorskip("pgqueuer", reason="pip install 'skiplock[pgqueuer]'")
    out = tmp_path / "queue.json"
    parser = argparse.ArgumentParser()
    bench_queue.configure(parser)
    args = parser.parse_args(["--workers", "2", "--batch", "5", "--duration", "1",
                              "--prefill", "3000", "--against", "pgqueuer", "--dsn", pg_dsn,
                              "--out", str(out)])
    assert bench_queue.run(args) == 0
    doc = json.loads(out.read_text())
    assert 0 < doc["pgqueuer"]["jobs"] <= 3000
    assert doc["pgqueuer"]["version"]
    assert doc["ratio_to_pgqueuer"] == pytest.approx(
        doc["queue"]["jobs_per_second"] / doc["pgqueuer"]["jobs_per_second"])
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pg_database "
                           "WHERE datname LIKE 'skiplock\\_pgqueuer%'").fetchone()
    assert row == (0,)


def test_bench_claim_measures_each_backlog_and_leaves_nothing(pg_dsn: str,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "claim.json"
    parser = argparse.ArgumentParser()
    bench_claim.configure(parser)
    args = parser.parse_args(["--backlogs", "50,500", "--accounts", "1,30", "--repeat", "3",
                              "--batch", "10", "--dsn", pg_dsn, "--out", str(out)])
    assert bench_claim.run(args) == 0
    doc = json.loads(out.read_text())
    assert [(s["backlog"], s["unlimited_accounts"]) for s in doc["sizes"]] == [
        (50, 1), (50, 30), (500, 1), (500, 30)]
    for size in doc["sizes"]:
        # The other two accounts' due work fills the batch; the full account gives nothing.
        assert size["claimed"] == 10
        assert 0 < size["p50_ms"] <= size["p99_ms"]
        assert size["buffers"] > 0
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname LIKE %s",
                           (bench_claim.SCHEMA_PREFIX + "%",)).fetchone()
    assert row == (0,)


@pytest.mark.parametrize(("flag", "value"), [("--backlogs", "10,x"), ("--backlogs", "0"),
                                             ("--accounts", "0"), ("--repeat", "0")])
def test_bench_claim_refuses_bad_input(flag: str, value: str, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench_claim.configure(parser)
    args = parser.parse_args([flag, value, "--out", str(tmp_path / "x.json")])
    with pytest.raises(UsageError, match=flag):
        bench_claim.run(args)
