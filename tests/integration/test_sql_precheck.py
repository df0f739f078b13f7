"""Every statement of a run is prepared on its fresh schema before any load starts.

A `--sql` block the database refuses (a syntax error, an unknown column, a missing function)
is bad input: `run`, `demo` and `gate` exit 2 with one line naming the file and the block,
with nothing left running and no run directory. A reference block refused against the
reference schema is a skiplock bug: exit 4. A statement that only fails when it runs (the
recover block `SELECT 1/0`) passes the check, and then the run's verdict is unknown (exit 3),
because the history cannot show that recovery ever ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from skiplock.plumbing.errors import UsageError
from skiplock.queue_impl.interface import (
    Account,
    AttemptResult,
    ChecksStatements,
    JobStatus,
    NewJob,
    Outcome,
    StatementError,
)
from skiplock.queue_impl.memory import InMemoryQueue
from skiplock.queue_impl.pg import PgQueue, _sample_params
from skiplock.queue_impl.sqlfile import BLOCK_NAMES, REFERENCE_PATH, allowed_placeholders
from skiplock.reports.history import VERDICT_FILE, read_json
from skiplock.scenarios.run import spec as spec_mod
from skiplock.scenarios.run.options import RunOptions
from skiplock.scenarios.run.runner import run_scenario

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
MUTANTS = sorted((REPO / "tests" / "mutants").glob("*.sql"))

BROKEN = {
    "claim_syntax.sql": (
        "-- name: claim\n"
        "SELEC id FROM jobs WHERE account_id = ANY(%(locked_accounts)s)\n"
        "  AND %(batch)s > 0 AND %(lease)s IS NOT NULL AND %(worker_id)s <> ''\n",
        "claim", 'syntax error at or near "SELEC"'),
    "finish_column.sql": (
        "-- name: finish\n"
        "SELECT o AS ord FROM unnest(%(ords)s::int[]) AS o\n"
        "WHERE EXISTS (SELECT 1 FROM jobs WHERE no_such_column = ANY(%(job_ids)s))\n"
        "  AND %(lease_tokens)s IS NOT NULL AND %(outcomes)s IS NOT NULL\n"
        "  AND %(retry_delays)s IS NOT NULL\n",
        "finish", 'column "no_such_column" does not exist'),
    "recover_function.sql": (
        "-- name: recover\nSELECT recover_every_lease(%(limit)s)\n",
        "recover", "function recover_every_lease(smallint) does not exist"),
}
# Valid SQL that fails every time it runs: only a run can tell.
RECOVER_DIVIDES_BY_ZERO = "-- name: recover\nSELECT 1 / 0 WHERE %(limit)s > 0\n"


@pytest.fixture
def sql_files(tmp_path: Path) -> Path:
    folder = tmp_path / "sql"
    folder.mkdir()
    for name, (text, _, _) in BROKEN.items():
        (folder / name).write_text(text)
    (folder / "recover_div.sql").write_text(RECOVER_DIVIDES_BY_ZERO)
    return folder


MakeQueue = Callable[..., PgQueue]


@pytest.fixture
def make_queue(pg_dsn: str, fresh_schema: str) -> Iterator[MakeQueue]:
    """A queue on the test's fresh schema, with the given SQL file (None: the reference)."""
    made: list[PgQueue] = []

    def make(sql: str | Path | None = None) -> PgQueue:
        made.append(PgQueue(pg_dsn, schema=fresh_schema, sql=sql))
        return made[-1]

    yield make
    for queue in made:
        queue.close()


def checked(queue: PgQueue) -> None:
    queue.setup()
    queue.check_statements()


# --------------------------------------------------------------------------------------------
# PgQueue.check_statements
# --------------------------------------------------------------------------------------------


def test_the_check_is_an_optional_capability() -> None:
    assert issubclass(PgQueue, ChecksStatements)
    assert not isinstance(InMemoryQueue(), ChecksStatements)


def test_every_placeholder_a_block_may_use_has_a_typed_sample() -> None:
    samples = _sample_params()
    for block in BLOCK_NAMES:
        assert allowed_placeholders(block) <= samples.get(block, {}).keys(), block


@pytest.mark.parametrize("path", [None, *MUTANTS], ids=["reference", *(p.stem for p in MUTANTS)])
def test_the_reference_and_every_mutant_pass(make_queue: MakeQueue,
                                             path: Path | None) -> None:
    checked(make_queue(path))


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_refused_block_is_named_with_its_file(make_queue: MakeQueue, sql_files: Path,
                                                name: str) -> None:
    _, block, error = BROKEN[name]
    path = sql_files / name
    with pytest.raises(StatementError) as caught:
        checked(make_queue(path))
    assert str(caught.value) == f"{path}: block {block!r}: {error}"
    assert (caught.value.block, caught.value.source, caught.value.ours) == (block, str(path),
                                                                            False)


def test_nothing_is_run_by_the_check(make_queue: MakeQueue, sql_files: Path) -> None:
    """The check parses; it neither plans (1/0 would fold) nor executes anything."""
    queue = make_queue(sql_files / "recover_div.sql")
    queue.setup()
    queue.upsert_accounts([Account(id="acct-0")])
    job = NewJob(id=uuid.uuid4(), account_id="acct-0", target_url="http://127.0.0.1:1/x",
                 payload={})
    queue.enqueue([job])
    queue.check_statements()
    [state] = queue.snapshot()
    assert (state.status, state.attempts) == (JobStatus.PENDING, 0)
    # The queue is as usable as before.
    [lease] = queue.claim("worker-0", 5, timedelta(seconds=30))
    queue.finish([AttemptResult(lease=lease, outcome=Outcome.SUCCESS, http_status=200)])
    with pytest.raises(psycopg.errors.DivisionByZero):
        queue.recover()


def test_a_script_without_placeholders_is_left_alone(make_queue: MakeQueue,
                                                     tmp_path: Path) -> None:
    """psycopg sends a block with no placeholders as one simple query, so a script works
    there and cannot be prepared: it is not refused. With placeholders it cannot run."""
    script = tmp_path / "script.sql"
    script.write_text("-- name: list_fenced\nSET LOCAL work_mem = '8MB';\n"
                      "SELECT * FROM fenced_writes\n")
    checked(make_queue(script))
    with_params = tmp_path / "with_params.sql"
    with_params.write_text("-- name: recover\nSET LOCAL work_mem = '8MB';\n"
                           "SELECT count(*) FROM jobs WHERE %(limit)s > 0\n")
    with pytest.raises(StatementError, match="cannot insert multiple commands"):
        checked(make_queue(with_params))


def test_a_refused_schema_block_is_named_by_setup(make_queue: MakeQueue,
                                                  tmp_path: Path) -> None:
    path = tmp_path / "schema.sql"
    path.write_text("-- name: schema\nCREATE TABLE jobs (id uuid PRIMARY KEY,);\n")
    with pytest.raises(StatementError) as caught:
        make_queue(path).setup()
    assert str(caught.value) == f"{path}: block 'schema': syntax error at or near \")\""


def test_a_reference_block_refused_by_your_schema_is_bad_input(
    make_queue: MakeQueue, tmp_path: Path
) -> None:
    reference = REFERENCE_PATH.read_text()
    schema = reference.split("-- name: schema\n", 1)[1].split("\n-- name: ", 1)[0]
    assert "    last_error text,\n" in schema
    path = tmp_path / "schema.sql"
    path.write_text("-- name: schema\n" + schema.replace("    last_error text,\n", ""))
    with pytest.raises(StatementError) as caught:
        checked(make_queue(path))
    assert caught.value.source == str(REFERENCE_PATH)
    assert not caught.value.ours
    assert str(caught.value).endswith(
        f"(a reference block, run against the schema block of {path})")


def test_a_refused_reference_block_is_a_harness_bug(make_queue: MakeQueue) -> None:
    queue = make_queue()
    renew = queue._statements["renew"]
    assert "skiplock_lease_base()" in renew
    queue._statements["renew"] = renew.replace("skiplock_lease_base()", "lease_bas()")
    with pytest.raises(StatementError) as caught:
        checked(queue)
    assert caught.value.ours
    assert str(caught.value) == (
        f"{REFERENCE_PATH}: block 'renew': function lease_bas() does not exist (the "
        "reference SQL's own block: a skiplock bug, please report it)")


# --------------------------------------------------------------------------------------------
# The runner: refused before anything starts, and nothing left behind.
# --------------------------------------------------------------------------------------------


def _children() -> set[int]:
    """Live child processes of this test process (not the resource tracker)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and (
                b"resource_tracker" not in cmdline):
            found.add(int(entry.name))
    return found


def test_the_runner_refuses_bad_sql_and_leaves_nothing(
    pg_dsn: str, tmp_path: Path, sql_files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    schema = f"skiplock_{uuid.uuid4().hex[:8]}"
    # The run names its schema (and its directory) with secrets.token_hex: pinned, so the
    # test knows which schema must be gone.
    monkeypatch.setattr("secrets.token_hex",
                        lambda n: schema.removeprefix("skiplock_")[: 2 * n])
    before = _children()
    spec = spec_mod.load("steady", ["duration=1", "warmup=0"])
    out = tmp_path / "runs"
    out.mkdir()
    said: list[str] = []
    path = sql_files / "claim_syntax.sql"
    with pytest.raises(UsageError) as caught:
        run_scenario(spec, RunOptions(out=out, dsn=pg_dsn, sql_path=str(path)),
                     announce=said.append)
    assert str(caught.value) == f"{path}: block 'claim': syntax error at or near \"SELEC\""
    assert said == []
    assert list(out.iterdir()) == []
    assert _children() - before == set()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        left = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", [schema])
        assert left.fetchall() == []
        sessions = conn.execute(
            "SELECT application_name FROM pg_stat_activity WHERE application_name LIKE %s",
            [f"%{schema}%"])
        assert sessions.fetchall() == []


# --------------------------------------------------------------------------------------------
# The commands, as a user runs them.
# --------------------------------------------------------------------------------------------


def skiplock(*args: str | Path, env: dict[str, str],
             timeout: float = 200) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skiplock", *map(str, args)],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
        env={**os.environ, **env},
    )


@pytest.mark.parametrize("command", ["run", "demo", "gate"])
def test_each_command_exits_2_with_one_line(pg_dsn: str, tmp_path: Path, sql_files: Path,
                                            command: str) -> None:
    path = sql_files / "finish_column.sql"
    out = tmp_path / "out"
    argv = {"run": ["run", "steady", "--duration", "1"],
            "demo": ["demo", "--duration", "1"],
            "gate": ["gate", "--only", "steady", "--set", "duration=1"]}[command]
    done = skiplock(*argv, "--sql", path, "--out", out, env={"SKIPLOCK_PG_DSN": pg_dsn})
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    expected = f"skiplock: {path}: block 'finish': column \"no_such_column\" does not exist"
    if command == "gate":
        # The gate announces what it runs (a line rich may wrap) before its first case.
        assert lines[0].startswith("skiplock gate: backend pg, sql ")
        lines = lines[-1:]
        assert json.loads((out / "summary.json").read_text())["results"] == []
        assert list((out / "runs").iterdir()) == []
    else:
        assert not out.exists() or list(out.iterdir()) == []
    assert lines == [expected]


def test_a_refused_reference_block_is_exit_4(pg_dsn: str, tmp_path: Path) -> None:
    (tmp_path / "brokenref.py").write_text(
        "from skiplock.queue_impl.pg import PgQueue\n\n"
        "def factory(*, dsn, schema, sql_path=None):\n"
        "    queue = PgQueue(dsn, schema=schema, sql=sql_path)\n"
        "    queue._statements['recover'] = 'SELECT recover_nothing(%(limit)s)'\n"
        "    return queue\n")
    done = skiplock("run", "steady", "--duration", "1", "--backend", "brokenref:factory",
                    "--out", tmp_path / "out",
                    env={"SKIPLOCK_PG_DSN": pg_dsn, "PYTHONPATH": str(tmp_path),
                         "PYTHONDONTWRITEBYTECODE": "1"})
    assert done.returncode == 4, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"skiplock: harness failure: {REFERENCE_PATH}: block 'recover': "
                           "function recover_nothing(smallint) does not exist (the reference "
                           "SQL's own block: a skiplock bug, please report it)")


def test_recovery_that_always_fails_makes_the_run_unknown(pg_dsn: str, tmp_path: Path,
                                                          sql_files: Path) -> None:
    """The check passes (the SQL is valid); every recovery call fails when it runs; the
    run's history never shows recovery working, so it is not called valid."""
    out = tmp_path / "out"
    done = skiplock("run", "steady", "--sql", sql_files / "recover_div.sql", "--quiet",
                    "--set", "warmup=0.5", "--set", "duration=2", "--set", "rate=40",
                    "--set", "recovery_interval=0.25", "--out", out,
                    env={"SKIPLOCK_PG_DSN": pg_dsn})
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert "recovery failed: DivisionByZero: division by zero" in done.stderr
    assert "UNKNOWN" in done.stdout
    assert "  unknown: recovery failed " in done.stdout
    [run_dir] = list(out.iterdir())
    verdict = read_json(run_dir / VERDICT_FILE)
    assert verdict["valid"] == "unknown"
    [reason] = verdict["unknown_reasons"]
    assert reason.startswith("recovery failed ")
    assert "and never succeeded (the history cannot show that expired leases were ever " \
           "recovered)" in reason
    assert reason.endswith(": DivisionByZero: division by zero")
    assert verdict["counts"]["completed"] == verdict["counts"]["enqueued"] > 0
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        schema = read_json(run_dir / "spec.json")["schema"]
        left = conn.execute(sql.SQL("SELECT 1 FROM pg_namespace WHERE nspname = {}").format(
            sql.Literal(schema)))
        assert left.fetchall() == []
