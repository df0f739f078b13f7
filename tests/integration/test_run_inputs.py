"""`skiplock run` / `demo` as a user runs them: bad input of any kind is exit 2 with one line on
stderr, no traceback, nothing started and no run directory; a DSN's password never reaches
the terminal or the run's files; the demo says what it runs and its two tables agree."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

PLUGIN = '''
def raises(**kw):
    raise RuntimeError(f"cannot reach my broker with {kw['dsn']}")

def returns_none(**kw):
    return None
'''


def skiplock(*args: str | Path, cwd: Path = REPO, env: dict[str, str] | None = None,
             timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skiplock", *map(str, args)],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
        env={**os.environ, **(env or {})},
    )


def refused(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    """Hostile inputs, each a file under `tmp_path/in`."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "latin1.toml").write_bytes(b'name = "caf\xe9"\n')
    (folder / "empty.toml").write_text("")
    (folder / "yes.toml").write_text('recovery = "yes"\nduration = 1\n')
    (folder / "number.toml").write_text("name = 5\nduration = 1\n")
    (folder / "escape.toml").write_text('name = "../../escaped"\nduration = 1\n')
    (folder / "afile").write_text("")
    (folder / "badplugin.py").write_text(PLUGIN)
    return folder


CASES = [
    (["run", "{in}/latin1.toml"], "is not UTF-8"),
    (["run", "{in}/empty.toml"], "scenario file {in}/empty.toml is empty"),
    (["run", "{in}/yes.toml"], "recovery must be true or false (a TOML boolean), not a string"),
    (["run", "{in}/number.toml"], "name must be a string, not an integer (5)"),
    (["run", "{in}/escape.toml"], "name '../../escaped' cannot name a run directory"),
    (["run", "steady", "--set", "name=../x"], "name '../x' cannot name a run directory"),
    (["demo", "--set", "name=a/b"], "name 'a/b' cannot name a run directory"),
    (["run", "steady", "--out", "{in}/afile"], "--out {in}/afile is a file: give a directory"),
    (["run", "steady", "--out", "{in}/afile/runs"], "{in}/afile is a file, not a directory"),
    (["run", "steady", "--dsn", ""], "--dsn is empty"),
    (["demo", "--dsn", " "], "--dsn is empty"),
    (["run", "steady", "--dsn", "postgresql://bob:Pq7@zZ9@127.0.0.1:1/db"],
     "its password holds a character a URI reserves"),
    (["run", "steady", "--backend", "skiplock.queue_impl.memory:factory"],
     "its queue lives inside one process"),
    (["demo", "--backend", "skiplock.queue_impl.memory:factory"],
     "its queue lives inside one process"),
    (["run", "steady", "--backend", "badplugin:raises"],
     "backend 'badplugin:raises': the factory raised RuntimeError (cannot reach my broker"),
    (["run", "steady", "--backend", "badplugin:returns_none"],
     "backend 'badplugin:returns_none': the factory returned None"),
    (["run", "steady", "--backend", "bullmq", "--redis-url", "redis://u:Pq7zZ9@127.0.0.1:1/0"],
     "cannot reach Redis at redis://u:***@127.0.0.1:1/0"),
    (["run", "steady", "--redis-url", "redis://127.0.0.1:6379/0"],
     "--redis-url is for a Redis backend (bullmq); backend 'pg' does not use Redis"),
    (["run", "steady", "--backend", "bullmq", "--set", "retry_cap=0.5"],
     "backend 'bullmq' cannot honour retry_cap = 0.5: its backoff has no cap"),
    (["run", "steady", "--backend", "bullmq", "--backend-opt", "prefix=x"],
     "backend 'bullmq' takes no --backend-opt"),
    (["run", "steady", "--backend", "bullmq", "--sql", "{in}/afile"],
     "backend 'bullmq' runs none: leave --sql out"),
]


@pytest.mark.parametrize(("argv", "expected"), CASES,
                         ids=[f"{i}-{' '.join(a[:2])}" for i, (a, _) in enumerate(CASES)])
def test_bad_input_is_exit_2_one_line_and_leaves_no_run_directory(
    pg_dsn: str, tmp_path: Path, inputs: Path, argv: list[str], expected: str
) -> None:
    out = tmp_path / "runs"
    args = [a.replace("{in}", str(inputs)) for a in argv]
    if "--out" not in args:
        args += ["--out", str(out)]
    # A server to reach when a case gets that far: its password must stay hidden too.
    env = {"SKIPLOCK_PG_DSN": pg_dsn, "PYTHONPATH": str(inputs), "PYTHONDONTWRITEBYTECODE": "1"}
    done = skiplock(*args, "--duration", "1", env=env, timeout=120)
    line = refused(done)
    assert line.startswith("skiplock: ")
    assert expected.replace("{in}", str(inputs)) in line
    assert "Pq7" not in line and "zZ9" not in line
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]
    assert sorted(p.name for p in inputs.iterdir()) == sorted(
        ["latin1.toml", "empty.toml", "yes.toml", "number.toml", "escape.toml", "afile",
         "badplugin.py"])


HOSTILE_DSNS = [
    # (DSN, pieces of its password that must never be printed)
    ("postgresql://bob:Pq7@zZ9@127.0.0.1:1/db", ["Pq7@zZ9", "zZ9"]),
    ("postgresql://bob:Pq7/zZ9@127.0.0.1:1/db", ["Pq7/zZ9", "Pq7", "zZ9"]),
    ("postgresql://bob:Pq7%zz@127.0.0.1:1/db", ["Pq7%zz", "Pq7"]),
    ("postgresql://bob:Pq7zZ9xY@127.0.0.1:1/db", ["Pq7zZ9xY"]),
    ("postgresql://127.0.0.1:1/db?password=Pq7zZ9xY", ["Pq7zZ9xY"]),
    ("host=127.0.0.1 port=1 password='Pq7 zZ9' dbname=db", ["Pq7 zZ9"]),
    ("host=127.0.0.1 port=1 password='Pq7zZ9", ["Pq7zZ9"]),
]


@pytest.mark.parametrize(("dsn", "pieces"), HOSTILE_DSNS)
@pytest.mark.parametrize("where", ["--dsn", "SKIPLOCK_PG_DSN"])
def test_a_dsn_that_cannot_be_used_never_prints_its_password(
    tmp_path: Path, dsn: str, pieces: list[str], where: str
) -> None:
    out = tmp_path / "runs"
    if where == "--dsn":
        done = skiplock("run", "steady", "--dsn", dsn, "--out", out, timeout=60)
    else:
        done = skiplock("run", "steady", "--out", out, env={"SKIPLOCK_PG_DSN": dsn}, timeout=60)
    refused(done)
    for piece in pieces:
        assert piece not in done.stdout + done.stderr, done.stderr
    assert not out.exists()


def test_a_password_never_reaches_the_terminal_or_the_run_files(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A real run with a password holding every URI-reserved character (percent-encoded),
    against the test server: it must accept any password (trust), or there is no run."""
    params = conninfo_to_dict(pg_dsn)
    if params.get("password"):
        pytest.skip("the test server needs its own password")
    password = "Zq9@Xw7/Kp:Rt5?Mn3#"
    try:
        psycopg.connect(pg_dsn, password=password, connect_timeout=5).close()
    except psycopg.OperationalError:
        pytest.skip("the test server checks passwords")
    host = str(params.get("host") or "127.0.0.1")
    dsn = (f"postgresql://{quote(str(params.get('user') or 'postgres'), safe='')}:"
           f"{quote(password, safe='')}@{host}:{params.get('port') or 5432}/"
           f"{params.get('dbname') or 'postgres'}")
    out = tmp_path / "runs"
    done = skiplock("run", "steady", "--dsn", dsn, "--out", out, "--duration", "1",
                    "--warmup", "0.2", "--rate", "20", "--seed", "3", timeout=180)
    assert done.returncode == 0, done.stderr
    secrets = [password, quote(password, safe=""), "Zq9", "Xw7", "Rt5", "Mn3"]
    for secret in secrets:
        assert secret not in done.stdout + done.stderr
    (run_dir,) = out.iterdir()
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "spec.json" for p in files)
    for path in files:
        data = path.read_bytes()
        if path.name == "report.html":
            # Embedded plots are base64 PNG drawn from numbers: any three letters turn up
            # in them by chance. The text around them is what could leak.
            data = re.sub(rb"data:image/png;base64,[A-Za-z0-9+/=]+", b"", data)
        for secret in secrets:
            assert secret.encode() not in data, path
    spec = json.loads((run_dir / "spec.json").read_text())
    assert "password=***" in spec["postgres"]["dsn"]
    assert "password=***" in spec["backend"]


def test_the_demo_says_what_it_runs_and_its_tables_agree(pg_dsn: str, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    done = skiplock("demo", "--dsn", pg_dsn, "--out", out, "--warmup", "0.5", "--duration",
                    "2", "--rate", "20", "--seed", "4", timeout=180)
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert "scenario demo," in first and "steady" not in first
    assert "fail_then_succeed" in done.stdout and "always_400" in done.stdout
    (run_dir,) = out.iterdir()
    assert "-demo-" in run_dir.name
    scenario = json.loads((run_dir / "spec.json").read_text())["scenario"]
    assert scenario["name"] == "demo"
    assert "fault-free" not in scenario["description"]
    assert "fail_then_succeed" in scenario["description"]
    # The live table's last state, then the summary: the same labels, the same numbers.
    for label in ("deliveries (requests received)", "of which answered 2xx",
                  "enqueued (jobs acknowledged)", "completed (jobs)"):
        values = re.findall(rf"{re.escape(label)}\s*│\s*(\d+)", done.stdout)
        assert len(values) == 2 and values[0] == values[1], (label, values)


OPTIONED_PG = '''
from skiplock.queue_impl.pg import PgQueue

def factory(*, dsn, schema, sql_path=None, note="none"):
    assert note == "kept", note
    return PgQueue(dsn, schema=schema, sql=sql_path)
'''


def test_backend_options_reach_every_process_and_are_recorded(pg_dsn: str,
                                                               tmp_path: Path) -> None:
    """A plug-in's option reaches the check, the producers and the workers (the factory
    refuses any other value), is recorded in spec.json, and replays."""
    (tmp_path / "optioned.py").write_text(OPTIONED_PG)
    out = tmp_path / "out"
    done = skiplock("run", "steady", "--quiet", "--no-report", "--duration", "1",
                    "--warmup", "0.5", "--backend", "optioned:factory",
                    "--backend-opt", "note=kept", "--out", out,
                    env={"SKIPLOCK_PG_DSN": pg_dsn, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, (done.stdout, done.stderr[-2000:])
    [run_dir] = list(out.iterdir())
    spec = json.loads((run_dir / "spec.json").read_text())
    assert spec["backend_options"] == {"note": "kept"}
    assert "--backend-opt note=kept" in spec["replay"]


@pytest.mark.parametrize(("argv", "needle"), [
    (["--backend-opt", "note"], "--backend-opt takes KEY=VALUE"),
    (["--backend-opt", "note=1"], "backend 'pg' takes no --backend-opt"),
    (["--backend", "optioned:factory", "--backend-opt", "color=red"],
     "backend 'optioned:factory': its factory takes no option 'color'"),
])
def test_a_backend_option_that_cannot_be_honoured_is_one_line(
        pg_dsn: str, tmp_path: Path, argv: list[str], needle: str) -> None:
    (tmp_path / "optioned.py").write_text(OPTIONED_PG)
    done = skiplock("run", "steady", "--out", tmp_path / "out", *argv,
                    env={"SKIPLOCK_PG_DSN": pg_dsn, "PYTHONPATH": str(tmp_path)})
    assert needle in refused(done)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


DECOY_TABLES = '''
import psycopg
from psycopg import sql
from skiplock.queue_impl.pg import PgQueue

class Queue(PgQueue):
    """The reference queue in a schema of its own, beside a `jobs` table in the run's schema
    that is the plug-in's own business: two rows that stay PENDING forever."""

    def __init__(self, dsn, schema):
        super().__init__(dsn, schema=f"{schema}_q")
        self._decoy = (dsn, schema)

    def setup(self):
        super().setup()
        dsn, schema = self._decoy
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
            conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {}.jobs (status text)").format(
                sql.Identifier(schema)))
            conn.execute(sql.SQL("INSERT INTO {}.jobs VALUES ('PENDING'), ('PENDING')").format(
                sql.Identifier(schema)))

def factory(*, dsn, schema, sql_path=None):
    return Queue(dsn, schema)
'''


def test_a_plugins_own_jobs_table_is_never_read(pg_dsn: str, tmp_path: Path) -> None:
    """Live counts and the drain come from the plug-in's snapshot, not from whatever table
    of its is called `jobs` (reading this one, the drain waited for its two rows until the
    drain timeout: exit 3)."""
    (tmp_path / "decoy.py").write_text(DECOY_TABLES)
    out = tmp_path / "out"
    done = skiplock("run", "steady", "--quiet", "--no-report", "--duration", "1",
                    "--warmup", "0.5", "--drain-timeout", "8", "--backend", "decoy:factory",
                    "--out", out,
                    env={"SKIPLOCK_PG_DSN": pg_dsn, "PYTHONPATH": str(tmp_path)})
    try:
        assert done.returncode == 0, (done.stdout, done.stderr[-2000:])
        assert "VALID" in done.stdout
        [run_dir] = list(out.iterdir())
        run = json.loads((run_dir / "run.json").read_text())
        assert run["drained"] is True
        assert run["drain_seconds"] < 8, run["drain_seconds"]
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for (name,) in conn.execute("SELECT nspname FROM pg_namespace "
                                        "WHERE nspname LIKE 'skiplock%\\_q'").fetchall():
                conn.execute(f'DROP SCHEMA "{name}" CASCADE')


def test_worker_with_a_native_loop_needs_the_accounts_it_serves(pg_dsn: str,
                                                                tmp_path: Path) -> None:
    """A plug-in that runs its own worker loop serves only the accounts it is told; without
    any it would start, serve nothing and look healthy."""
    pytest.importorskip("pgqueuer")
    line = refused(skiplock("worker", "--dsn", pg_dsn, "--backend",
                            "skiplock.queue_impl.pgqueuer_backend:factory",
                            "--schema", "native_accounts", "--events-dir", tmp_path / "ev"))
    assert "add --account NAME[=LIMIT]" in line
    assert not (tmp_path / "ev").exists() or not any((tmp_path / "ev").iterdir())
    for bad in ("=3", "a=0", "a=x"):
        line = refused(skiplock("worker", "--dsn", pg_dsn, "--account", bad))
        assert "--account" in line, line
