"""`skiplock plans` at two small sizes: the table holds the mix asked for, every size has its
four variants, and each variant costs what its table state must cost: plain indexes and a
pinned snapshot make the claim walk rows the partial indexes and VACUUM spare it. Bad input
is one line and exit 2; an interrupted run leaves no schema and no session behind."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from skiplock.queue_impl.sqlfile import reference_statements
from skiplock.scenarios.bench import plans
from skiplock.scenarios.cli import main as cli

pytestmark = pytest.mark.integration

SIZES = (2_000, 8_000)
BATCH = 10
Result = tuple[dict[str, Any], Path]  # plans.json, and the folder it was written to


@pytest.fixture(scope="module")
def result(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Result:
    out = tmp_path_factory.mktemp("plans")
    code = cli.main(["plans", "--sizes", "2k,8000", "--batch", str(BATCH), "--repeat", "3",
                     "--dsn", pg_dsn, "--out", str(out)])
    assert code == 0
    return json.loads((out / "plans.json").read_text()), out


def _measured(doc: dict[str, Any], size: int, variant: str) -> dict[str, Any]:
    [found] = [m for m in doc["measurements"] if m["size"] == size and m["variant"] == variant]
    return found


def test_every_size_has_the_mix_asked_for(result: Result) -> None:
    doc, _ = result
    assert [f["size"] for f in doc["fills"]] == list(SIZES)
    for fill in doc["fills"]:
        assert fill["statuses"] == plans.planned_statuses(fill["size"])
        assert sum(fill["statuses"].values()) == fill["size"]
        # The noisy neighbour: at its limit of 8, with 4% of the table due behind it.
        assert fill["accounts"]["full"]["PROCESSING"] == 8
        assert fill["accounts"]["full"]["PENDING"] == fill["size"] * 4 // 100
    # The mix in figures, at 8k: 4% failed, 8% due, 1% retrying, 0.2% leased (one lease in
    # ten expired) beside the limited accounts' 19 leases, the rest history.
    assert doc["fills"][1]["statuses"] == {"COMPLETED": 6_926, "FAILED": 320, "PENDING": 640,
                                           "RETRYING": 80, "PROCESSING": 34}
    assert doc["fills"][1]["added"] == 6_000
    assert all(f["seconds"] >= 0 for f in doc["fills"])
    assert doc["durability"]["tables"].startswith("logged")


def test_every_size_has_every_variant_with_its_plans(result: Result) -> None:
    doc, out = result
    assert {(m["size"], m["variant"]) for m in doc["measurements"]} == {
        (size, variant) for size in SIZES for variant in plans.VARIANTS}
    for m in doc["measurements"]:
        assert m["claimed"] == BATCH, m["variant"]
        assert m["finish"]["jobs"] == BATCH, m["variant"]  # every claimed job written
        assert m["claim_runs"] == 3 and m["claim_p50_ms"] > 0
        assert m["buffers_per_claimed_job"] == m["claim"]["buffers"] / BATCH
        for block in ("claim_lock_accounts", "claim", "recover", "finish"):
            assert "Execution Time" in m["plans"][block], block
    # 8k jobs hold one expired lease (0.02%), and recovery takes it in every variant.
    assert {m["recover"]["jobs"] for m in doc["measurements"] if m["size"] == 8_000} == {1}
    frame = (out / "plans.csv").read_text().splitlines()
    assert len(frame) == 1 + len(SIZES) * len(plans.VARIANTS)
    assert (out / "plans.png").stat().st_size > 10_000


def test_plain_indexes_and_a_pinned_snapshot_make_the_claim_walk_rows(
        result: Result) -> None:
    doc, _ = result
    size = SIZES[-1]
    partial, plain = _measured(doc, size, "partial"), _measured(doc, size, "plain")
    bloated, vacuumed = _measured(doc, size, "bloated"), _measured(doc, size, "vacuumed")
    # Without the predicate, the in-flight count and each account's due scan pass over that
    # account's history: thousands of rows filtered where the partial indexes filter a few.
    assert plain["claim"]["rows_removed"] > 1_000 > partial["claim"]["rows_removed"]
    assert plain["buffers_per_claimed_job"] > 2 * partial["buffers_per_claimed_job"]
    # 800 churned jobs leave 2,400 row versions the snapshot keeps, at the head of the due
    # scans; VACUUM after its release removes them.
    assert bloated["dead_row_versions"] == 3 * size // 10
    assert bloated["buffers_per_claimed_job"] > 1.5 * vacuumed["buffers_per_claimed_job"]
    assert vacuumed["dead_row_versions"] == 0


def test_a_finished_run_leaves_no_database_behind(result: Result, pg_dsn: str) -> None:
    doc, _ = result
    assert doc["isolation"].startswith("a database of its own")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_database WHERE datname = %s",
                           (doc["database"],)).fetchone()
    assert row == (0,)


def test_sql_measures_your_own_blocks(pg_dsn: str, tmp_path: Path) -> None:
    """A recovery that never recovers anything, in place of the reference's."""
    recover = reference_statements()["recover"].replace("LIMIT %(limit)s",
                                                        "LIMIT %(limit)s * 0")
    mine = tmp_path / "mine.sql"
    mine.write_text(f"-- name: recover\n{recover}\n")
    code = cli.main(["plans", "--sizes", "8k", "--repeat", "1", "--sql", str(mine),
                     "--dsn", pg_dsn, "--out", str(tmp_path / "out")])
    assert code == 0
    doc = json.loads((tmp_path / "out" / "plans.json").read_text())
    assert doc["params"]["sql"] == str(mine)
    assert {m["recover"]["jobs"] for m in doc["measurements"]} == {0}
    assert {m["claimed"] for m in doc["measurements"]} == {10}  # the reference's claim


def test_without_createdb_it_measures_in_a_schema_and_drops_it(pg_dsn: str,
                                                               tmp_path: Path) -> None:
    role, password = f"plans_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        database = str(admin.info.dbname)
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN NOCREATEDB PASSWORD {}").format(
            sql.Identifier(role), sql.Literal(password)))
        admin.execute(sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
            sql.Identifier(database), sql.Identifier(role)))
        try:
            params = {k: str(v) for k, v in conninfo_to_dict(pg_dsn).items() if v is not None}
            params.update(user=role, password=password)
            code = cli.main(["plans", "--sizes", "2k", "--repeat", "1",
                             "--dsn", make_conninfo(**params), "--out", str(tmp_path)])
            assert code == 0
            doc = json.loads((tmp_path / "plans.json").read_text())
            assert doc["isolation"].startswith(f"schema {doc['schema']} of the given database")
            assert doc["database"] == database
            assert len(doc["measurements"]) == len(plans.VARIANTS)
            row = admin.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s",
                                (doc["schema"],)).fetchone()
            assert row == (0,)
        finally:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_an_interrupted_run_drops_its_schema_and_closes_its_sessions(
        pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    databases: list[str] = []

    def interrupted_churn(conn: psycopg.Connection[Any], jobs: int) -> None:
        # While the snapshot is pinned: the worst moment, with two sessions to close.
        databases.append(str(conn.info.dbname))
        raise KeyboardInterrupt

    monkeypatch.setattr(plans, "churn", interrupted_churn)
    code = cli.main(["plans", "--sizes", "2k", "--repeat", "1", "--dsn", pg_dsn,
                     "--out", str(tmp_path / "out")])
    assert code == 130
    assert capsys.readouterr().err.strip() == "skiplock: interrupted"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_database WHERE datname = %s",
                           (databases[0],)).fetchone()
        assert row == (0,)
        # A backend ends a moment after its client closes the connection. The run's sessions
        # were in this database or its own; another test's `plans` run has sessions of the
        # same name in others.
        deadline = time.monotonic() + 5
        while True:
            left = conn.execute("SELECT count(*) FROM pg_stat_activity"
                                " WHERE application_name = %s"
                                " AND datname IN (current_database(), %s)",
                                (plans.APPLICATION_NAME, databases[0])).fetchone()
            if left == (0,) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert left == (0,), "a session of the run was left open"


@pytest.mark.parametrize(("args", "message"), [
    (["--sizes", "10k,5k"], "--sizes must increase"),
    (["--sizes", "10k,abc"], "'abc' is not a number of jobs"),
    (["--sizes", "2.5"], "'2.5' is not a number of jobs"),
    (["--sizes", "10"], "--sizes must each be from 1,000"),
    (["--sql", "no-such-file.sql"], "cannot read the SQL file"),
    (["--dsn", "postgresql://u:secret@127.0.0.1:1/db"], "cannot connect to PostgreSQL"),
    (["--batch", "0"], "--batch"),
    # Hours and tens of GB: said first, and run only when asked for.
    (["--sizes", "10k,100m"], "--sizes up to 100,000,000 jobs: about 100 min and 45.0 GB"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert cli.main(["plans", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("skiplock: "), err
    assert "Traceback" not in err and "secret" not in err
    assert not out.exists()


def test_an_out_that_is_a_file_is_refused(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "file"
    taken.write_text("")
    assert cli.main(["plans", "--out", str(taken / "sub")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_sql_the_server_refuses_is_bad_input_before_any_fill(
        pg_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.sql"
    broken.write_text("-- name: claim\nSELEC %(batch)s, %(lease)s, %(locked_accounts)s,"
                      " %(worker_id)s;\n")
    out = tmp_path / "out"
    assert cli.main(["plans", "--sizes", "2k", "--sql", str(broken), "--dsn", pg_dsn,
                     "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "block 'claim': syntax error at or near \"SELEC\"" in err and err.count("\n") == 1
    assert not out.exists()


def test_a_database_left_by_a_killed_plans_is_dropped_by_the_next(
        pg_dsn: str, tmp_path: Path) -> None:
    gone_pid = _exited_pid()
    left, marked_elsewhere = (f"{plans.SCHEMA_PREFIX}_{uuid.uuid4().hex[:12]}" for _ in "ab")
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        for name, note in ((left, f"skiplock plans: host={socket.gethostname()} pid={gone_pid}"),
                           (marked_elsewhere, f"skiplock plans: host=elsewhere pid={gone_pid}")):
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            admin.execute(sql.SQL("COMMENT ON DATABASE {} IS {}").format(
                sql.Identifier(name), sql.Literal(note)))
    try:
        assert cli.main(["plans", "--sizes", "2k", "--repeat", "1", "--dsn", pg_dsn,
                         "--out", str(tmp_path / "out")]) == 0
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            found = {str(r[0]) for r in admin.execute(
                "SELECT datname FROM pg_database WHERE datname = ANY(%s)",
                [[left, marked_elsewhere]]).fetchall()}
        # Its process gone on this host: dropped; another host's: not this run's to judge.
        assert found == {marked_elsewhere}
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            for name in (left, marked_elsewhere):
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(
                    sql.Identifier(name)))


def _exited_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid
