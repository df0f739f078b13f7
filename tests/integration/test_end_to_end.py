"""End to end on real PostgreSQL, a real echo target and real processes: short runs (a few
seconds of load each), judged by the checker from the recorded history alone."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reports.history import (
    DELIVERIES_DIR,
    ENQUEUES_FILE,
    FINAL_JOBS_FILE,
    LOCUST_DIR,
    NEMESIS_FILE,
    RUN_FILE,
    SAMPLES_FILE,
    SPEC_FILE,
    VERDICT_FILE,
    WORKERS_DIR,
    FaultEvent,
    read_json,
    read_jsonl,
)
from scenarios import spec as spec_mod
from scenarios.runner import RunContext, RunOptions, RunResult, run_scenario

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

SHORT = ["warmup=0.5", "duration=3", "drain_timeout=30"]

# backend -> (jobs completed per second over load and drain, enqueued)
THROUGHPUT: dict[str, tuple[float, int]] = {}


def _run(pg_dsn: str, tmp_path: Path, scenario: str, overrides: list[str], *,
         backend: str = "pg", seed: int = 1, nemesis: Any = None) -> RunResult:
    spec = spec_mod.load(scenario, [*SHORT, *overrides])
    options = RunOptions(backend=backend, seed=seed, out=tmp_path, dsn=pg_dsn)
    return run_scenario(spec, options, nemesis=nemesis)


def _children() -> set[int]:
    """Live (not zombie) child processes of this test process."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) != os.getpid() or fields[0] == "Z":
            continue
        cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        # multiprocessing's resource tracker lives as long as this process, by design.
        if "resource_tracker" not in cmdline:
            found.add(int(entry.name))
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
    for kind in ("lost", "duplicate_unexplained", "concurrent_delivery", "limit_exceeded",
                 "stuck", "stale_write", "unexpected"):
        assert counts[kind] == 0, kind

    run_dir = result.run_dir
    for name in (SPEC_FILE, ENQUEUES_FILE, FINAL_JOBS_FILE, RUN_FILE, SAMPLES_FILE,
                 NEMESIS_FILE, VERDICT_FILE):
        assert (run_dir / name).is_file(), name
    assert len(list((run_dir / WORKERS_DIR).glob("*.jsonl"))) == 3
    assert len(list((run_dir / DELIVERIES_DIR).glob("*.jsonl"))) == 1
    assert list((run_dir / LOCUST_DIR).glob("*_stats.csv"))
    described = read_json(run_dir / SPEC_FILE)
    assert described["seed"] == 1
    assert described["git"]["sha"]
    assert described["postgres"]["settings"]["fsync"]
    assert described["scenario"]["workers"] == 3
    assert [p["name"] for p in described["phases"]] == ["setup", "warmup", "load", "drain"]
    info = read_json(run_dir / RUN_FILE)
    assert info["drained"] is True and info["exit_reason"] == "completed"
    accounts = {r["account"] for r in read_jsonl(run_dir / ENQUEUES_FILE)
                if r["type"] == "invoke"}
    assert len(accounts) >= 3
    assert json.loads((run_dir / VERDICT_FILE).read_text())["valid"] is True


def test_same_seed_same_scripts_and_accounts(pg_dsn: str, tmp_path: Path) -> None:
    """The seed decides each user's sequence of (script, account)."""

    def sequences(run_dir: Path) -> dict[str, list[tuple[str, str]]]:
        out: dict[str, list[tuple[str, str]]] = {}
        for r in read_jsonl(run_dir / ENQUEUES_FILE):
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
    statuses = {r["status"] for r in read_jsonl(result.run_dir / FINAL_JOBS_FILE)}
    assert statuses == {"COMPLETED", "FAILED"}


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
    assert verdict.valid is not True
    assert verdict.counts["stuck"] + verdict.counts["lost"] > 0, verdict.to_json()
    assert len(list(read_jsonl(result.run_dir / NEMESIS_FILE))) == 1


# Jobs enqueued 10 per transaction, so that the producers are not what limits the rate.
OFFERED = ["workers=3", "rate=400", "enqueue_batch=10", "batch=10"]


@pytest.mark.parametrize("backend", ["pg", "pg-for-update", "pg-long-tx"])
def test_locking_variants_pass_and_their_throughput_is_measured(
    pg_dsn: str, tmp_path: Path, backend: str
) -> None:
    result = _run(pg_dsn, tmp_path, "steady", OFFERED, backend=backend)
    assert result.verdict.valid is True, result.verdict.to_json()
    THROUGHPUT[backend] = (_throughput(result), result.verdict.counts["enqueued"])


def test_print_throughput_beside_pg(capsys: pytest.CaptureFixture[str]) -> None:
    """Not a timing assertion: prints the figures of the runs above side by side."""
    if "pg" not in THROUGHPUT:
        pytest.skip("the pg run did not run in this session")
    with capsys.disabled():
        print(f"\nbackend          completed jobs/s   enqueued   ({' '.join(OFFERED)})")
        for backend, (rate, enqueued) in THROUGHPUT.items():
            print(f"{backend:<16} {rate:>16.1f}   {enqueued:>8}")
    assert all(rate > 0 for rate, _ in THROUGHPUT.values())


def _in_fresh_python(code: str) -> str:
    """Run code in a new interpreter: importing the producers module patches the world with
    gevent, which must not happen inside the test process."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_producer_classifies_enqueue_errors() -> None:
    out = _in_fresh_python(
        "import scenarios.producers as p, psycopg, gevent\n"
        "print(p.classify_error(psycopg.errors.UniqueViolation('dup')),"
        " p.classify_error(psycopg.OperationalError('server closed the connection')),"
        " p.classify_error(ValueError('bad job')))"
    )
    assert out.split() == ["fail", "info", "fail"]


def test_producer_makes_psycopg_cooperative_even_if_imported_first() -> None:
    out = _in_fresh_python(
        "import psycopg, psycopg.waiting\n"
        "blocking = psycopg.waiting.wait is getattr(psycopg.waiting, 'wait_c', None)\n"
        "import scenarios.producers as p\n"
        "p._cooperative_psycopg()\n"
        "print(blocking, psycopg.waiting.wait.__name__)"
    )
    assert out.split()[1] in ("wait_poll", "wait_select", "wait_selector")
