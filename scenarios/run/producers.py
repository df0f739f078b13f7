"""Producers: Locust users that enqueue jobs through the QueueBackend interface.

Each producer process runs Locust as a library (headless), with users whose client is the
queue itself: one enqueue transaction is one Locust request, timed with
`events.request.measure`, so Locust's own statistics (CSV in RUN_DIR/locust/) describe the
enqueue side. Every job is also recorded as an operation in RUN_DIR/enqueues.csv: `invoke`
with the job's oracle (account, target URL, script, max_attempts) before the transaction,
then `ok`, `fail` (the queue certainly did not take it) or `info` (unknown: the connection was
lost, or the error came with or after COMMIT).

Gevent and psycopg: importing locust monkey-patches the standard library. psycopg 3 (3.1.14
and later) cooperates with gevent, but it picks its wait function when `psycopg` is first
imported: if `select` is already patched it uses a `select`-based wait that yields to other
greenlets, otherwise a C wait that blocks the whole process (every user stalls while one
waits on the server). So this module must be imported in a fresh process before anything
imports psycopg; the runner starts it through `runpy` in a spawned process, passing the
configuration as plain JSON so that unpickling it imports nothing. Should psycopg have been
imported earlier anyway (a spawned child re-imports the parent's main module), `main`
switches its wait function to the cooperative one before any connection is made.

Distributed mode (`distributed = true` in the scenario): one Locust master process and
`producers` Locust worker processes, talking over loopback; the master spreads the users and
aggregates the statistics, each worker enqueues and records its own operations. Workers on
other machines can join the same master with Locust's usual `--worker --master-host`.
"""

# ruff: noqa: E402  (locust, and so gevent's patches, must be imported before the rest)
from __future__ import annotations

# isort: off
import warnings

# A spawned child re-imports its parent's main module, which may have imported ssl: gevent's
# warning about patching it late is about ssl, which producers never use.
warnings.filterwarnings("ignore", message="Monkey-patching ssl after ssl")
# Then locust: gevent must patch the world before psycopg is imported.
import locust  # noqa: F401

# isort: on
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import gevent
import psycopg
import psycopg.waiting
from locust import User, constant, constant_throughput, events, task
from locust.env import Environment
from locust.exception import StopUser
from locust.runners import MasterRunner, Runner
from locust.stats import PERCENTILES_TO_REPORT, StatsCSVFileWriter, stats_history

from skiplock.chaos.target import route
from skiplock.plumbing.orphans import die_with_parent, name_this_process
from skiplock.queue_impl.interface import NewJob, QueueBackend
from skiplock.queue_impl.plugins import BackendSpec
from skiplock.reports.history import (
    ENQUEUE_LOG,
    ENQUEUES_FILE,
    LOCUST_DIR,
    PRODUCER_CPU_SUFFIX,
    EnqueueOp,
    EnqueueType,
    JobScript,
    LogWriter,
    write_json,
)
from skiplock.scenarios.run.spec import Chooser, ScenarioSpec, from_mapping


class _EndedUserNote(logging.Filter):
    """Locust logs an error when, stopping users at the end of the load, it meets one whose
    greenlet has already ended (a user stops itself with StopUser once its job count is
    done). Nothing is wrong, and the line lands in the middle of a run's progress."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "didn't have proper args" not in record.getMessage()


logging.getLogger("locust.runners").addFilter(_EndedUserNote())

# Errors the server raised about the statement itself: the transaction was rolled back
# before COMMIT could take effect, so the jobs are certainly not in the queue.
_DEFINITE_ERRORS: tuple[type[BaseException], ...] = (
    psycopg.errors.DataError,
    psycopg.errors.IntegrityError,
    psycopg.errors.ProgrammingError,
    ValueError,
    TypeError,
)


def classify_error(exc: BaseException) -> EnqueueType:
    """`fail` when the enqueue certainly did not happen, `info` when it may have.

    An error raised out of a COMMIT is `info` whatever its class: a deferred constraint
    raises there too, and from the client's side a failed COMMIT cannot be told from one
    whose answer was lost."""
    if isinstance(exc, _DEFINITE_ERRORS) and not raised_in_commit(exc):
        return "fail"
    return "info"


def raised_in_commit(exc: BaseException) -> bool:
    """True when the traceback passes through psycopg's commit (`Connection.commit`, or a
    `transaction()` block committing on exit)."""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if "commit" in code.co_name.lower() and "psycopg" in code.co_filename:
            return True
        tb = tb.tb_next
    return False


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


class _Context:
    """What every user in this process shares (set once by `main`)."""

    spec: ScenarioSpec
    backend: BackendSpec
    # One per echo target process; every delivery of a job goes to the one its id picks.
    target_urls: list[str]
    seed: int
    process: str
    writer: LogWriter
    users_started: int = 0
    # Set when the load phase ends: users start no new enqueue, and the process waits for the
    # ones in flight before Locust stops the users (killing a user mid-enqueue would leave an
    # `info` outcome for a job that never had a chance).
    stopping: bool = False
    in_flight: int = 0
    # Jobs whose enqueue was acknowledged, for the CPU per enqueued job (`_report_cpu`).
    acknowledged: int = 0


CTX = _Context()


class InvokeLines:
    """The `invoke` lines of one producer stream, as `ENQUEUE_LOG.line` writes them, built
    from a cached tail: a line's first three columns are the type, the job id and the time,
    and everything after them (process, account, target URL, max_attempts, the script's
    columns) repeats for every job of one script, account and URL. Building each record's
    line in full was most of a producer's CPU per job."""

    def __init__(self, process: str, max_attempts: int) -> None:
        self.process, self.max_attempts = process, max_attempts
        self._tails: dict[tuple[int, str, str], tuple[dict[str, Any], str]] = {}

    def payload_script(self, script: JobScript, account: str, url: str) -> dict[str, Any]:
        """The script as the job's payload carries it (one dict per script, account, URL)."""
        return self._tail(script, account, url)[0]

    def line(self, job_id: str, now: float, script: JobScript, account: str,
             url: str) -> str:
        return f"invoke,{job_id},{now!r},{self._tail(script, account, url)[1]}"

    def _tail(self, script: JobScript, account: str, url: str) -> tuple[dict[str, Any], str]:
        # Keyed by the script object: a chooser's scripts live as long as it does.
        key = (id(script), account, url)
        found = self._tails.get(key)
        if found is None:
            shown = script.to_json()
            full = ENQUEUE_LOG.line(EnqueueOp(
                type="invoke", job_id="-", time=0.0, process=self.process, account=account,
                target_url=url, script=shown, max_attempts=self.max_attempts))
            found = self._tails[key] = (shown, full.split(",", 3)[3])
        return found


class EnqueueUser(User):
    """One producer user: its own queue connection and its own seeded choice stream."""

    abstract = True
    # Filled in by `main` on a concrete subclass: the per-user enqueue throughput.
    tasks_per_second: ClassVar[float] = 0.0

    def on_start(self) -> None:
        index = CTX.users_started
        CTX.users_started += 1
        self.stream = f"{CTX.process}-u{index}"
        self.chooser = Chooser.for_spec(CTX.spec, CTX.seed, self.stream)
        self.lines = InvokeLines(self.stream, CTX.spec.max_attempts)
        self.queue: QueueBackend = CTX.backend.create()

    def on_stop(self) -> None:
        self.queue.close()

    def _record(self, type_: EnqueueType, jobs: list[NewJob], error: str | None = None) -> None:
        """One outcome for every job of a transaction, written in one go."""
        now = time.time()
        if error is None:
            # The line `ENQUEUE_LOG.line` writes for an outcome without an error, built once.
            tail = ENQUEUE_LOG.line(EnqueueOp(type=type_, job_id="-", time=0.0,
                                              process=self.stream)).split(",", 3)[3]
            CTX.writer.write_text("".join(f"{type_},{job.id},{now!r},{tail}" for job in jobs))
            return
        CTX.writer.write_many(
            EnqueueOp(type=type_, job_id=str(job.id), time=now, process=self.stream,
                      error=error)
            for job in jobs
        )

    @task
    def enqueue(self) -> None:
        if CTX.stopping:
            raise StopUser()
        CTX.in_flight += 1
        try:
            self._enqueue()
        finally:
            CTX.in_flight -= 1

    def _enqueue(self) -> None:
        spec = CTX.spec
        jobs: list[NewJob] = []
        invokes: list[str] = []
        urls, lines = CTX.target_urls, self.lines
        for _ in range(spec.enqueue_batch):
            script, account = self.chooser.next()
            job_id = uuid.uuid4()
            url = route(job_id, urls)
            jobs.append(NewJob(id=job_id, account_id=account, target_url=url,
                               payload={"script": lines.payload_script(script, account, url),
                                        "account": account},
                               max_attempts=spec.max_attempts))
            invokes.append(lines.line(str(job_id), time.time(), script, account, url))
        # Every invoke is on disk before the transaction starts, as one write.
        CTX.writer.write_text("".join(invokes))
        name = f"enqueue x{len(jobs)}"
        with self.environment.events.request.measure("queue", name) as meta:
            try:
                self.queue.enqueue(jobs)
            except BaseException as exc:
                # GreenletExit (Locust stopping a user mid-call) lands here too: unknown.
                kind = classify_error(exc) if isinstance(exc, Exception) else "info"
                self._record(kind, jobs, one_line(exc))
                if kind == "info":
                    # The connection may be broken: start the next enqueue on a fresh one.
                    self.queue.close()
                raise
            meta["response_length"] = len(jobs)
            self._record("ok", jobs)
            CTX.acknowledged += len(jobs)


def _user_class(spec: ScenarioSpec, total_users: int) -> type[EnqueueUser]:
    per_user = spec.rate / spec.enqueue_batch / total_users if spec.rate > 0 else 0.0
    wait = constant_throughput(per_user) if per_user > 0 else constant(0)
    return type(
        "Producer",
        (EnqueueUser,),
        {"abstract": False, "wait_time": wait, "tasks_per_second": per_user},
    )


def _final_csv(writer: StatsCSVFileWriter) -> None:
    """Write the CSV files once more with the final numbers and close them."""
    writer.requests_csv_filehandle.seek(0)
    writer.requests_csv_writer.writerow(writer.requests_csv_columns)
    writer._requests_data_rows(writer.requests_csv_writer)
    writer.requests_csv_filehandle.truncate()
    writer.failures_csv_filehandle.seek(0)
    writer.failures_csv_writer.writerow(writer.failures_columns)
    writer._failures_data_rows(writer.failures_csv_writer)
    writer.failures_csv_filehandle.truncate()
    writer.close_files()


def _run_until(runner: Runner, env: Environment, csv_base: Path | None, users: int,
               spawn_rate: float, stop_at: float) -> None:
    csv_writer = None
    greenlets = []
    if csv_base is not None:
        csv_writer = StatsCSVFileWriter(env, PERCENTILES_TO_REPORT, str(csv_base),
                                        full_history=False)
        greenlets.append(gevent.spawn(csv_writer.stats_writer))
        greenlets.append(gevent.spawn(stats_history, runner))
    runner.start(users, spawn_rate=spawn_rate)
    gevent.sleep(max(0.0, stop_at - time.time()))
    _let_enqueues_finish()
    runner.stop()
    runner.quit()
    gevent.killall(greenlets)
    if csv_writer is not None:
        _final_csv(csv_writer)


def _let_enqueues_finish(limit_seconds: float = 10.0) -> None:
    """End of the load phase: no new enqueue starts, and the ones in flight get up to
    `limit_seconds` to finish, so every invoke in an ordinary run gets its ok or fail."""
    CTX.stopping = True
    deadline = time.time() + limit_seconds
    while CTX.in_flight > 0 and time.time() < deadline:
        gevent.sleep(0.01)


def main(config: Mapping[str, Any]) -> int:
    """Run one producer process until the load phase ends. `config` is plain JSON data."""
    die_with_parent()
    name_this_process("skiplock-produc")
    _cooperative_psycopg()
    spec = from_mapping(config["spec"]).validate()
    run_dir = Path(config["run_dir"])
    role: str = config["role"]  # "local", "master" or "worker"
    index: int = config["index"]
    CTX.spec = spec
    CTX.backend = BackendSpec(**config["backend"])
    CTX.target_urls = list(config["target_urls"])
    CTX.seed = int(config["seed"])
    CTX.process = f"producer-{index}" if role != "master" else "producer-master"
    # Every producer process appends to the one log; the writer puts the header first.
    CTX.writer = LogWriter(run_dir / ENQUEUES_FILE, ENQUEUE_LOG)

    total_users = spec.users * spec.producers
    user_class = _user_class(spec, total_users)
    env = Environment(user_classes=[user_class], events=events, stop_timeout=10.0)
    start_at = _ready_then_wait_for_go(run_dir, CTX.process, Path(config["go_file"]))
    stop_at = start_at + spec.warmup + spec.duration
    # The warm-up phase is the ramp: users are spawned evenly over it.
    users = spec.users if role == "local" else total_users
    spawn_rate = users / spec.warmup if spec.warmup > 0 else float(users)
    csv_base = run_dir / LOCUST_DIR / CTX.process
    csv_base.parent.mkdir(parents=True, exist_ok=True)
    cpu_at_go = time.process_time()
    try:
        if role == "local":
            _run_until(env.create_local_runner(), env, csv_base, users, spawn_rate, stop_at)
        elif role == "master":
            master = env.create_master_runner("127.0.0.1", int(config["master_port"]))
            _wait_for_workers(master, spec.producers, deadline=start_at + 30.0)
            _run_until(master, env, csv_base, users, spawn_rate, stop_at)
        elif role == "worker":
            worker = env.create_worker_runner("127.0.0.1", int(config["master_port"]))
            # The master stops the users at stop_at; Locust's own quit path may leave this
            # process waiting on its greenlets, so leave once the users are gone.
            gevent.sleep(max(0.0, stop_at - time.time()))
            _let_enqueues_finish()
            deadline = time.time() + (env.stop_timeout or 0.0) + 5.0
            while worker.user_count > 0 and time.time() < deadline:
                gevent.sleep(0.1)
            gevent.sleep(1.0)  # the final statistics report to the master
            worker.greenlet.kill(block=False)
        else:
            raise ValueError(f"unknown producer role {role!r}")
        _report_cpu(run_dir, role, time.process_time() - cpu_at_go, time.time() - start_at)
    finally:
        CTX.writer.close()
    return 0


def _report_cpu(run_dir: Path, role: str, cpu_seconds: float, seconds: float) -> None:
    """RUN_DIR/locust/<process>.cpu.json: the CPU this process used from the go signal to
    the end of the load, and the jobs it had acknowledged, so a sweep can say what each
    enqueued job cost the producers (a master enqueues nothing; its CPU counts too)."""
    write_json(run_dir / LOCUST_DIR / f"{CTX.process}{PRODUCER_CPU_SUFFIX}",
               {"process": CTX.process, "role": role, "cpu_seconds": round(cpu_seconds, 4),
                "seconds": round(seconds, 3), "acknowledged": CTX.acknowledged})


def _ready_then_wait_for_go(run_dir: Path, process: str, go_file: Path) -> float:
    """Tell the runner this process is ready (a file), then wait for its go file, which
    holds the wall-clock start time shared by every producer. Slow starts (imports, spawn)
    then do not eat into the load phase."""
    ready = run_dir / LOCUST_DIR / f"{process}.ready"
    ready.write_text(str(os.getpid()))
    deadline = time.time() + 120.0
    while not go_file.exists():
        if time.time() > deadline:
            raise RuntimeError("the runner never gave the go signal")
        gevent.sleep(0.02)
    start_at = float(json.loads(go_file.read_text())["start_at"])
    gevent.sleep(max(0.0, start_at - time.time()))
    return start_at


def _cooperative_psycopg() -> None:
    """Make sure psycopg waits by way of gevent's patched `poll`.

    psycopg picks its wait function once, at import. When something imported psycopg before
    gevent patched `select` (the spawned child re-imports the parent's main module, which may
    import psycopg), it chose the C wait, which blocks every greenlet while one waits on the
    server. `waiting.wait` is looked up at each call, so rebinding it is enough; it is the
    same switch as psycopg's PSYCOPG_WAIT_FUNC variable, applied after the fact."""
    import gevent.monkey

    if not gevent.monkey.is_module_patched("select"):
        raise RuntimeError(
            "gevent has not patched select: import skiplock.scenarios.run.producers first")
    if psycopg.waiting.wait is getattr(psycopg.waiting, "wait_c", None):
        psycopg.waiting.wait = psycopg.waiting.wait_poll


def _wait_for_workers(master: MasterRunner, count: int, deadline: float) -> None:
    while len(master.clients.ready) < count:
        if time.time() > deadline:
            raise RuntimeError(f"only {len(master.clients.ready)} of {count} Locust workers"
                               " connected to the master")
        gevent.sleep(0.1)


if __name__ == "__main__":
    # Started by the runner through runpy with PRODUCER_CONFIG in the module's globals, or by
    # hand: python -m skiplock.scenarios.run.producers CONFIG.json
    _config = globals().get("PRODUCER_CONFIG")
    if _config is None:
        _config = json.loads(Path(sys.argv[1]).read_text())
    sys.exit(main(_config))
