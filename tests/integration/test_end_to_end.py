"""End to end on real PostgreSQL, a real echo target and real processes: short runs (a few
seconds of load each), judged by the checker from the recorded history alone."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skiplock import __version__
from skiplock.reports.history import (
    DELIVERIES_DIR,
    DELIVERY_LOG,
    ENQUEUE_LOG,
    ENQUEUES_FILE,
    FINAL_JOBS_FILE,
    FINAL_JOBS_LOG,
    LOCUST_DIR,
    LOG_SUFFIX,
    NEMESIS_FILE,
    RUN_FILE,
    SAMPLES_FILE,
    SPEC_FILE,
    VERDICT_FILE,
    WORKER_LOG,
    WORKERS_DIR,
    FaultEvent,
    read_json,
    read_jsonl,
    read_log,
)
from skiplock.reports.objectives import Objectives
from skiplock.scenarios.bench.cpu import process_stats
from skiplock.scenarios.run import spec as spec_mod
from skiplock.scenarios.run.fault_context import RunContext
from skiplock.scenarios.run.options import RunOptions, RunResult
from skiplock.scenarios.run.runner import run_scenario

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

SHORT = ["warmup=0.5", "duration=3", "drain_timeout=30"]

# backend -> (jobs completed per second over load and drain, enqueued, valid, completed)
THROUGHPUT: dict[str, tuple[float, int, object, int]] = {}


def _run(pg_dsn: str, tmp_path: Path, scenario: str, overrides: list[str], *,
         backend: str = "pg", seed: int = 1, nemesis: Any = None,
         objectives: bool = True) -> RunResult:
    spec = spec_mod.load(scenario, [*SHORT, *overrides])
    if not objectives:
        spec = dataclasses.replace(spec, objectives=Objectives())
    options = RunOptions(backend=backend, seed=seed, out=tmp_path, dsn=pg_dsn)
    return run_scenario(spec, options, nemesis=nemesis)


def _children() -> set[int]:
    """Live (not zombie) child processes of this test process."""
    found = set()
    for pid, _, fields in process_stats():
        if int(fields[1]) != os.getpid() or fields[0] == "Z":
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        # multiprocessing's resource tracker lives as long as this process, by design.
        if "resource_tracker" not in cmdline:
            found.add(pid)
    return found


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    before = _children()
    yield
    assert _children() - before == set()


def _throughput(result: RunResult) -> float:
    samples = [s for s in result.samples if s.phase in ("warmup", "load", "drain", "done")]
    completed = int(result.verdict.counts["completed"])
    if not samples:
        return 0.0
    seconds = max(samples[-1].time - samples[0].time, 1e-9)
    return completed / seconds


def test_pg_passes_a_fault_free_run(pg_dsn: str, tmp_path: Path, no_leftovers: None) -> None:
    result = _run(pg_dsn, tmp_path, "steady", ["workers=3", "rate=80"])
    verdict = result.verdict
    assert verdict.valid is True, verdict.to_json()
    assert result.exit_code == 0
    counts = verdict.counts
    assert counts["enqueued"] > 50
    assert counts["completed"] == counts["enqueued"]
    # A healthy run gives every enqueue an outcome: the load phase ends without killing a
    # producer mid-enqueue, so no invoke is left "info".
    assert verdict.to_json()["details"]["enqueue_unknown"] == 0
    for kind in ("lost", "duplicate_unexplained", "concurrent_delivery", "limit_exceeded",
                 "stuck", "stale_write", "unexpected"):
        assert counts[kind] == 0, kind

    run_dir = result.run_dir
    for name in (SPEC_FILE, ENQUEUES_FILE, FINAL_JOBS_FILE, RUN_FILE, SAMPLES_FILE,
                 NEMESIS_FILE, VERDICT_FILE):
        assert (run_dir / name).is_file(), name
    worker_logs = sorted((run_dir / WORKERS_DIR).glob(f"*{LOG_SUFFIX}"))
    assert len(worker_logs) == 3
    assert len(list((run_dir / DELIVERIES_DIR).glob(f"*{LOG_SUFFIX}"))) == 1
    kinds_logged: set[str] = set()
    for log in worker_logs:
        kinds = [event["kind"] for event in read_log(log, WORKER_LOG)]
        assert kinds[0] == "start" and kinds[-1] == "stop"
        kinds_logged.update(kinds)
    assert {"claim", "http", "write"} <= kinds_logged
    assert list((run_dir / LOCUST_DIR).glob("*_stats.csv"))
    described = read_json(run_dir / SPEC_FILE)
    assert described["seed"] == 1
    assert described["git"]["sha"]
    assert described["skiplock"]["version"] == __version__
    assert described["postgres"]["settings"]["fsync"]
    assert described["scenario"]["workers"] == 3
    assert [p["name"] for p in described["phases"]] == ["setup", "warmup", "load", "drain"]
    info = read_json(run_dir / RUN_FILE)
    assert info["drained"] is True and info["exit_reason"] == "completed"
    assert info["final_jobs"] == len(list(read_log(run_dir / FINAL_JOBS_FILE, FINAL_JOBS_LOG)))
    assert info["final_jobs"] == counts["enqueued"]
    accounts = {r["account"] for r in read_log(run_dir / ENQUEUES_FILE, ENQUEUE_LOG)
                if r["type"] == "invoke"}
    assert len(accounts) >= 3
    assert json.loads((run_dir / VERDICT_FILE).read_text())["valid"] is True
    # The run's own check kept a columnar copy, so re-checking it skips the CSV parsing.
    assert list((run_dir / ".cache").rglob("*.arrow"))


def test_same_seed_same_scripts_and_accounts(pg_dsn: str, tmp_path: Path) -> None:
    """The seed decides each user's sequence of (script, account)."""

    def sequences(run_dir: Path) -> dict[str, list[tuple[str, str]]]:
        out: dict[str, list[tuple[str, str]]] = {}
        for r in read_log(run_dir / ENQUEUES_FILE, ENQUEUE_LOG):
            if r["type"] == "invoke":
                out.setdefault(r["process"], []).append((r["script"]["name"], r["account"]))
        return out

    overrides = ["rate=40", "duration=1.5", "users=2", "mix.slow=1", "mix.always_400=1"]
    first = sequences(_run(pg_dsn, tmp_path, "steady", overrides, seed=5).run_dir)
    second = sequences(_run(pg_dsn, tmp_path, "steady", overrides, seed=5).run_dir)
    for user, draws in first.items():
        shorter = min(len(draws), len(second[user]))
        assert shorter > 10
        assert draws[:shorter] == second[user][:shorter]


def test_faulty_targets_pass_with_retries_dead_letters_and_explained_duplicates(
    pg_dsn: str, tmp_path: Path, no_leftovers: None
) -> None:
    result = _run(pg_dsn, tmp_path, "faulty-targets", ["rate=50"])
    verdict = result.verdict
    assert verdict.valid is True, verdict.to_json()
    counts = verdict.counts
    assert counts["failed"] > 0  # always_400 jobs are dead letters
    assert counts["completed"] > 0
    assert counts["duplicate_unexplained"] == 0
    assert counts["early_retry"] == 0
    assert counts["attempts_exceeded"] == 0
    assert counts["completed"] + counts["failed"] == counts["enqueued"]
    statuses = {r["status"] for r in read_log(result.run_dir / FINAL_JOBS_FILE, FINAL_JOBS_LOG)}
    assert statuses == {"COMPLETED", "FAILED"}

    # The seeded mix (about 175 draws, 1 in 20 for each of these) enqueued every faulty
    # script, and the target really played each one: a faulty script that never ran would
    # make the verdict above say nothing about it.
    script_of = {r["job_id"]: r["script"]["name"] for r in read_log(
        result.run_dir / ENQUEUES_FILE, ENQUEUE_LOG) if r["type"] == "invoke"}
    played: dict[str, set[str]] = {}
    for path in (result.run_dir / DELIVERIES_DIR).glob(f"*{LOG_SUFFIX}"):
        for delivery in read_log(path, DELIVERY_LOG):
            played.setdefault(delivery["behaviour"], set()).add(delivery["job_id"])
    for script, behaviour in (("hang_then_late", "hang"), ("hang_forever", "hang_forever"),
                              ("reset", "reset"), ("fail_then_succeed", "status"),
                              ("slow", "slow")):
        jobs = {job for job, name in script_of.items() if name == script}
        assert jobs, f"the mix drew no {script} job"
        assert jobs & played.get(behaviour, set()), f"no {behaviour} delivery was played"
    # A hang_then_late job answers 200 after the HTTP timeout, so its retry's 2xx is a
    # duplicate that the recorded timeout explains: every such job that completed makes one.
    late_completed = {r["job_id"] for r in read_log(result.run_dir / FINAL_JOBS_FILE,
                                                     FINAL_JOBS_LOG)
                      if r["status"] == "COMPLETED" and script_of[r["job_id"]]
                      == "hang_then_late"}
    assert late_completed
    assert counts["duplicate_explained"] > 0, verdict.to_json()


@pytest.mark.parametrize("seed", [1, 2])
def test_naive_backend_is_caught_on_every_run(
    pg_dsn: str, tmp_path: Path, no_leftovers: None, seed: int
) -> None:
    result = _run(pg_dsn, tmp_path, "steady", ["workers=4", "rate=150"], backend="pg-naive",
                  seed=seed)
    counts = result.verdict.counts
    assert result.verdict.valid is False
    assert result.exit_code == 1
    assert counts["duplicate_unexplained"] + counts["concurrent_delivery"] > 0


class KillOneWorker:
    """Nemesis: SIGKILL worker 0 once it holds leases, and log the fault."""

    def __init__(self, after: float) -> None:
        self.after = after
        self._thread: threading.Thread | None = None

    def start(self, ctx: RunContext, seed: int) -> None:
        def kill() -> None:
            time.sleep(self.after)
            start = time.time()
            ctx.pool.kill(0, signal.SIGKILL)
            ctx.nemesis_log.write(FaultEvent(fault="kill_worker", start=start,
                                             end=time.time(), target=ctx.pool.worker_ids[0]))

        self._thread = threading.Thread(target=kill, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.join()


def test_worker_killed_with_recovery_off_is_reported(
    pg_dsn: str, tmp_path: Path, no_leftovers: None
) -> None:
    # Slow jobs keep every worker holding leases, so the kill strands some of them; limits
    # high enough that the stranded leases do not also block their accounts' other jobs.
    overrides = ["workers=2", "rate=40", "mix.succeed=0", "mix.slow=1", "slow_seconds=0.6",
                 "lease=3", "http_timeout=1.2", "write_margin=1", "retry_cap=0.5",
                 "recovery=false", *(f"accounts.{a}=50" for a in ("acme", "globex",
                                                                   "initech", "umbrella"))]
    result = _run(pg_dsn, tmp_path, "steady", overrides, nemesis=KillOneWorker(after=2.0))
    verdict = result.verdict
    assert verdict.valid is False, verdict.to_json()
    assert result.exit_code == 1
    assert verdict.counts["stuck"] + verdict.counts["lost"] > 0, verdict.to_json()
    assert len(list(read_jsonl(result.run_dir / NEMESIS_FILE))) == 1


# Jobs enqueued 10 per transaction, so that the producers are not what limits the rate.
OFFERED = ["workers=3", "rate=400", "enqueue_batch=10", "batch=10"]


# The figures are kept in this module's THROUGHPUT for test_print_throughput_beside_pg: the
# group keeps all four on one xdist worker (in this order), where that dict lives.
@pytest.mark.xdist_group("throughput-beside-pg")
@pytest.mark.parametrize("backend", ["pg", "pg-for-update", "pg-long-tx"])
def test_locking_variants_pass_and_their_throughput_is_measured(
    pg_dsn: str, tmp_path: Path, backend: str
) -> None:
    # More than the queue drains here, to measure how much it drains: the scenario's latency
    # objectives (set for its own rate) are not what this run asks, as in a sweep's step.
    result = _run(pg_dsn, tmp_path, "steady", OFFERED, backend=backend, objectives=False)
    counts = result.verdict.counts
    THROUGHPUT[backend] = (_throughput(result), counts["enqueued"], result.verdict.valid,
                           counts["completed"])
    assert result.verdict.valid is True, result.verdict.to_json()


@pytest.mark.xdist_group("throughput-beside-pg")
def test_print_throughput_beside_pg(capsys: pytest.CaptureFixture[str]) -> None:
    """Not a timing assertion: prints the figures of the runs above side by side."""
    if "pg" not in THROUGHPUT:
        pytest.skip("the pg run did not run in this session")
    with capsys.disabled():
        print(f"\nbackend          completed jobs/s   enqueued   ({' '.join(OFFERED)})")
        for backend, (rate, enqueued, _, _) in THROUGHPUT.items():
            print(f"{backend:<16} {rate:>16.1f}   {enqueued:>8}")
    # The figures compare like with like only if every variant ran the whole load correctly;
    # the speed itself is never asserted.
    for backend, (_, enqueued, valid, completed) in THROUGHPUT.items():
        assert valid is True, backend
        assert enqueued > 0 and completed == enqueued, backend


def _in_fresh_python(code: str, *args: str) -> str:
    """Run code in a new interpreter: importing the producers module patches the world with
    gevent, which must not happen inside the test process."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=60, check=False, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_producer_classifies_enqueue_errors() -> None:
    out = _in_fresh_python(
        "import skiplock.scenarios.run.producers as p, psycopg, gevent\n"
        "print(p.classify_error(psycopg.errors.UniqueViolation('dup')),"
        " p.classify_error(psycopg.OperationalError('server closed the connection')),"
        " p.classify_error(ValueError('bad job')))"
    )
    assert out.split() == ["fail", "info", "fail"]


def test_producer_makes_psycopg_cooperative_even_if_imported_first() -> None:
    out = _in_fresh_python(
        "import psycopg, psycopg.waiting\n"
        "blocking = psycopg.waiting.wait is getattr(psycopg.waiting, 'wait_c', None)\n"
        "import skiplock.scenarios.run.producers as p\n"
        "p._cooperative_psycopg()\n"
        "print(blocking, psycopg.waiting.wait.__name__)"
    )
    assert out.split()[1] in ("wait_poll", "wait_select", "wait_selector")


# Every script of the scenario with the most kinds, over awkward account names and URLs.
LINES_SCRIPT = """
import skiplock.scenarios.run.producers as p
import json
from skiplock.reports.history import ENQUEUE_LOG, EnqueueOp
from skiplock.scenarios.run.spec import load

spec = load("faulty-targets")
lines = p.InvokeLines("producer-0-u3", 7)
out = []
for script in spec.scripts().values():
    for account in ("acme", 'we,ird "one"', "back\\slash"):
        for url in ("http://127.0.0.1:9/deliver", "http://[::1]:80/deliver?a=1,2"):
            for now in (1764790000.123456, 0.1):
                fast = lines.line("5f0b", now, script, account, url)
                slow = ENQUEUE_LOG.line(EnqueueOp(
                    type="invoke", job_id="5f0b", time=now, process="producer-0-u3",
                    account=account, target_url=url, script=script.to_json(),
                    max_attempts=7))
                out.append([fast, slow])
print(json.dumps(out))
"""


def test_producer_invoke_lines_are_the_log_formats_own() -> None:
    """The producers build their invoke lines from a cached tail: each must be the line
    the enqueue log's format writes for the same record, byte for byte."""
    pairs = json.loads(_in_fresh_python(LINES_SCRIPT).splitlines()[-1])
    assert len(pairs) >= 12
    for fast, slow in pairs:
        assert fast == slow


# Runs in a fresh interpreter (the producers module patches the world with gevent).
COMMIT_ERROR_SCRIPT = """
import skiplock.scenarios.run.producers as p
import json, sys, psycopg
from pathlib import Path
from psycopg import sql
from locust import events
from locust.env import Environment
from skiplock.queue_impl.interface import Account
from skiplock.queue_impl.plugins import BackendSpec
from skiplock.reports.history import ENQUEUE_LOG, ENQUEUES_FILE, LogWriter
from skiplock.scenarios.run.spec import load

dsn, schema, run_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
spec = load("steady", ["enqueue_batch=1"])
backend = BackendSpec(name="pg", dsn=dsn, schema=schema)
queue = backend.create()
queue.setup()
queue.upsert_accounts([Account(id=a, concurrency_limit=n)
                       for a, n in spec.account_limits().items()])
queue.close()
s = sql.Identifier(schema)
with psycopg.connect(dsn, autocommit=True) as conn:
    conn.execute(sql.SQL("CREATE TABLE {}.refuse (on_ boolean)").format(s))
    conn.execute(sql.SQL(
        "CREATE FUNCTION {}.refuse_marked() RETURNS trigger LANGUAGE plpgsql AS $$"
        " BEGIN IF EXISTS (SELECT 1 FROM {}.refuse) THEN"
        " RAISE EXCEPTION 'refused at commit'; END IF; RETURN NULL; END $$").format(s, s))
    conn.execute(sql.SQL(
        "CREATE CONSTRAINT TRIGGER refuse_marked AFTER INSERT ON {}.jobs"
        " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {}.refuse_marked()"
    ).format(s, s))
p.CTX.spec = spec
p.CTX.backend = backend
p.CTX.target_urls = ["http://127.0.0.1:9/deliver"]
p.CTX.seed = 1
p.CTX.process = "producer-0"
p.CTX.writer = LogWriter(run_dir / ENQUEUES_FILE, ENQUEUE_LOG)
user_class = p._user_class(spec, 1)
user = user_class(Environment(user_classes=[user_class], events=events))
user.on_start()
user.enqueue()
with psycopg.connect(dsn, autocommit=True) as conn:
    conn.execute(sql.SQL("INSERT INTO {}.refuse VALUES (true)").format(s))
user.enqueue()
user.on_stop()
p.CTX.writer.close()
with psycopg.connect(dsn, autocommit=True) as conn:
    rows = conn.execute(sql.SQL("SELECT id::text FROM {}.jobs").format(s)).fetchall()
print(json.dumps([r[0] for r in rows]))
"""


def test_error_raised_at_commit_is_recorded_as_info(
    pg_dsn: str, fresh_schema: str, tmp_path: Path
) -> None:
    """A deferred constraint trigger raises at COMMIT: the producer cannot know whether the
    job is in the queue, so it must record `info`, not `fail`, whatever the error's class
    (this one is a ProgrammingError, which at INSERT would be a definite failure)."""
    out = _in_fresh_python(COMMIT_ERROR_SCRIPT, pg_dsn, fresh_schema, str(tmp_path))
    in_queue = json.loads(out.splitlines()[-1])
    ops: dict[str, list[dict[str, Any]]] = {}
    for op in read_log(tmp_path / ENQUEUES_FILE, ENQUEUE_LOG):
        ops.setdefault(op["job_id"], []).append(op)
    assert len(ops) == 2
    first, second = sorted(ops.values(), key=lambda seq: seq[0]["time"])
    assert [op["type"] for op in first] == ["invoke", "ok"]
    assert [op["type"] for op in second] == ["invoke", "info"]
    # A ProgrammingError: `fail` if it had come from the statement rather than the COMMIT.
    assert second[1]["error"].startswith("RaiseException: refused at commit")
    # The error came at COMMIT: the statement itself ran, and the job is not in the queue.
    assert in_queue == [first[0]["job_id"]]


class _Proc:
    """A subprocess with the multiprocess.Process surface the runner uses."""

    def __init__(self, name: str, seconds: float) -> None:
        import subprocess
        import sys

        self.name = name
        self._popen = subprocess.Popen([sys.executable, "-c",
                                        f"import time; time.sleep({seconds})"])
        self.pid = self._popen.pid

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        import subprocess

        with __import__("contextlib").suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    @property
    def exitcode(self) -> int | None:
        code = self._popen.poll()
        return None if code is None else int(code)


def test_a_producer_stopped_for_overrunning_is_not_a_harness_failure() -> None:
    from skiplock.plumbing.errors import HarnessError
    from skiplock.scenarios.run.load import check_producers, wait_phases

    spec = spec_mod.load("steady", ["warmup=0", "duration=0.2"])
    prompt, overrun = _Proc("prompt", 0.0), _Proc("overrun", 120.0)
    phases: list[str] = []
    stopped = wait_phases(spec, [prompt, overrun], time.time(), phases.append,
                           overrun_seconds=0.5)
    assert stopped == ["overrun"]
    assert phases == ["load"]
    assert not overrun.is_alive() and overrun.exitcode == -signal.SIGTERM
    check_producers([prompt, overrun], stopped)  # our own stop: no error
    with pytest.raises(HarnessError, match="overrun"):
        check_producers([prompt, overrun])  # the same exit code on its own is a failure


def _descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _in_group(pgid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with __import__("contextlib").suppress(OSError, ValueError):
                if os.getpgid(int(entry.name)) == pgid and _running(int(entry.name)):
                    found.add(int(entry.name))
    return found


def _poll(condition: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_sigterm_mid_load_cleans_up_and_leaves_a_judgeable_run(
    pg_dsn: str, tmp_path: Path
) -> None:
    import subprocess
    import sys

    from skiplock.reports.checker import check_run

    env = {**os.environ, "SKIPLOCK_PG_DSN": pg_dsn}
    with (tmp_path / "stderr").open("w") as err:
        run = subprocess.Popen(
            [sys.executable, "-m", "skiplock", "run", "steady", "--quiet",
             "--seed", "1",
             "--out", str(tmp_path / "runs"), "--warmup", "0.5", "--duration", "60",
             "--rate", "40"],
            cwd=Path(__file__).parents[2], env=env, stdout=subprocess.DEVNULL, stderr=err,
            start_new_session=True,
        )
        try:
            def loading() -> bool:
                dirs = list((tmp_path / "runs").glob("*"))
                if not dirs or not (dirs[0] / ENQUEUES_FILE).exists():
                    return False
                lines = (dirs[0] / ENQUEUES_FILE).read_text().splitlines()
                # `type` is the first column; the log may end mid-line, so no read_log here.
                return sum(line.startswith("ok,") for line in lines) >= 20

            assert _poll(loading, 90.0), (tmp_path / "stderr").read_text()
            children = {pid: _cmdline(pid) for pid in _descendants(run.pid)}
            assert len(children) >= 4  # target, 2 workers, a producer (and perhaps more)
            run.send_signal(signal.SIGTERM)
            code = run.wait(timeout=90)
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
    stderr = (tmp_path / "stderr").read_text()
    assert code == 143, stderr
    assert "terminated" in stderr
    # Every process the run started was stopped and reaped before it exited...
    def command(pid: int) -> str:
        # As seen before the signal: a process that is exiting right now reads as "".
        return children.get(pid) or _cmdline(pid)

    leftover = {pid: command(pid) for pid in {pid for pid in children if _running(pid)}
                | _in_group(run.pid) if "resource_tracker" not in command(pid)}
    assert leftover == {}, leftover
    # ...except multiprocessing's resource tracker, which leaves when its parent has gone.
    assert _poll(lambda: not any(_running(pid) for pid in children) and not _in_group(run.pid),
                 10.0), {pid: cmd for pid, cmd in children.items() if _running(pid)}

    run_dir = next((tmp_path / "runs").glob("*"))
    info = read_json(run_dir / RUN_FILE)
    assert info["exit_reason"] == "interrupted"
    assert info["final_snapshot"] == "taken after the interrupt"
    rows = list(read_log(run_dir / FINAL_JOBS_FILE, FINAL_JOBS_LOG))
    assert info["final_jobs"] == len(rows) > 0
    verdict = check_run([run_dir])
    assert verdict.valid == "unknown", verdict.to_json()
    assert verdict.exit_code == 3


def test_interrupted_snapshot_on_an_unreachable_server_writes_nothing(tmp_path: Path) -> None:
    from skiplock.queue_impl.plugins import BackendSpec
    from skiplock.scenarios.run.snapshot import interrupted_snapshot

    # Port 1 on loopback: nothing listens, so the connection is refused at once.
    backend = BackendSpec(name="pg", dsn="postgresql://postgres@127.0.0.1:1/none")
    rows, note = interrupted_snapshot(backend, tmp_path / FINAL_JOBS_FILE, seconds=2.0)
    assert rows is None
    assert note.startswith("not taken: ")
    assert list(tmp_path.iterdir()) == []


def test_target_dies_with_its_parent(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import os, signal\n"
        "from pathlib import Path\n"
        "from skiplock.chaos.target import TargetProcess\n"
        f"target = TargetProcess(Path({str(tmp_path)!r})).start()\n"
        "print(target.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False, cwd=Path(__file__).parents[2])
    assert done.returncode == -signal.SIGKILL, done.stderr
    pid = int(done.stdout.split()[0])
    died = _poll(lambda: not _running(pid), 20.0)
    if not died:
        os.kill(pid, signal.SIGKILL)
    assert died


def test_demo_latency_starts_at_the_ack_and_ends_at_the_first_timely_2xx(
    tmp_path: Path
) -> None:
    from skiplock.reports.history import LogWriter
    from skiplock.scenarios.cli.demo import latencies

    with LogWriter(tmp_path / ENQUEUES_FILE, ENQUEUE_LOG) as enq:
        for job, ack in (("a", 100.5), ("b", 100.2), ("c", 100.0)):
            enq.write({"type": "invoke", "job_id": job, "time": 100.0})
            enq.write({"type": "ok", "job_id": job, "time": ack})
    with LogWriter(tmp_path / DELIVERIES_DIR / f"target-0{LOG_SUFFIX}", DELIVERY_LOG) as dels:
        # a: its first 2xx came after the 1 s timeout (nobody got it); the retry's counts.
        dels.write({"job_id": "a", "received": 101.0, "answered": 103.0, "status": 200})
        dels.write({"job_id": "a", "received": 104.0, "answered": 104.1, "status": 200})
        dels.write({"job_id": "b", "received": 100.6, "answered": 100.7, "status": 503})
        dels.write({"job_id": "b", "received": 100.7, "answered": 100.8, "status": 200})
        # c: never answered 2xx in time: not counted.
        dels.write({"job_id": "c", "received": 100.1, "answered": None, "status": None})
    lat = latencies(tmp_path, http_timeout=1.0)
    assert lat["jobs"] == 2
    assert lat["p50"] == pytest.approx(((104.0 - 100.5) + (100.7 - 100.2)) / 2)


def test_live_progress_labels_repeat_deliveries_without_calling_them_anomalies() -> None:
    from skiplock.scenarios.run.progress import Sample, _table

    sample = Sample(time=0.0, elapsed=1.0, phase="load", invoked=5, enqueued=5,
                    enqueue_errors=0, delivered=6, delivered_ok=6, duplicates=2, completed=4,
                    failed=0, in_flight=1, queue_depth=0, rate=5.0)
    table = _table(sample, "t")
    labels = list(table.columns[0].cells)
    values = list(table.columns[1].cells)
    row = labels.index("repeat deliveries after a 2xx (judged after the run)")
    assert values[row] == "2"  # plain text: no red, no "duplicate" alarm
    assert not any("duplicate" in str(label) for label in labels)
