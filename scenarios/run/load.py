"""The load: producer processes (skiplock.scenarios.run.producers, each spawned on its own),
given one start time, watched through warm-up and load, and checked once they are done."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any, Protocol

from skiplock.plumbing.errors import HarnessError
from skiplock.plumbing.orphans import children_deaf_to_ctrl_c
from skiplock.queue_impl.plugins import BackendSpec
from skiplock.reports.history import LOCUST_DIR, write_json
from skiplock.scenarios.run.spec import ScenarioSpec

# Written by the runner once every producer is ready: the one time they all start at.
GO_FILE = "go.json"


class ProducerProcess(Protocol):
    """A started producer process (a `multiprocess` Process), as the runner watches it."""

    @property
    def name(self) -> str: ...

    @property
    def pid(self) -> int: ...

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...


def producer_configs(spec: ScenarioSpec, backend: BackendSpec, run_dir: Path,
                     target_urls: list[str], seed: int) -> list[dict[str, Any]]:
    """Each producer process's configuration, plain data: local producers, or a Locust
    master and its workers when the spec asks for distributed ones."""
    base = {
        "spec": spec.to_json(),
        "backend": dataclasses.asdict(backend),
        "run_dir": str(run_dir),
        # One per target process; each job goes to one of them, by its id.
        "target_urls": target_urls,
        "seed": seed,
        "go_file": str(run_dir / LOCUST_DIR / GO_FILE),
    }
    if not spec.distributed:
        return [{**base, "role": "local", "index": i} for i in range(spec.producers)]
    with contextlib.closing(__import__("socket").socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    master = {**base, "role": "master", "index": 0, "master_port": port}
    workers = [
        {**base, "role": "worker", "index": i, "master_port": port}
        for i in range(spec.producers)
    ]
    return [master, *workers]


@contextlib.contextmanager
def producer_processes(configs: list[dict[str, Any]]) -> Iterator[list[ProducerProcess]]:
    """Start producer processes; on leaving, any still running are terminated, then killed."""
    import multiprocess  # heavy import, only where processes start

    ctx = multiprocess.get_context("spawn")
    processes: list[ProducerProcess] = []
    try:
        for config in configs:
            # runpy, not a function of skiplock.scenarios.run.producers: that module imports
            # locust (and so gevent's patches) first, which must not happen in this process, and its
            # configuration is plain data so that unpickling it imports nothing (psycopg
            # must be imported after the patches in the child).
            process = ctx.Process(
                target=__import__("runpy").run_module,
                args=("skiplock.scenarios.run.producers",),
                kwargs={"init_globals": {"PRODUCER_CONFIG": config}, "run_name": "__main__"},
                name=f"skiplock-producer-{config['role']}-{config['index']}",
                daemon=True,
            )
            # The runner stops producers itself (SIGTERM below), after a Ctrl-C too: they
            # start with SIGINT blocked, so it cannot land in their start-up imports.
            with children_deaf_to_ctrl_c():
                process.start()
            processes.append(process)
        yield processes
    finally:
        for process in processes:
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
                process.join()


def wait_phases(spec: ScenarioSpec, producers: list[ProducerProcess], start_at: float,
                phase: Callable[[str], None], overrun_seconds: float = 15.0,
                watch: Callable[[], None] = lambda: None) -> list[str]:
    """Warm-up then load, by the clock; returns early if every producer has exited.

    Returns the names of the producers this function had to stop because they overran the
    load phase (plus `overrun_seconds` and a join grace): their history is whole (an enqueue
    cut short has an invoke and no outcome, which the checker treats as unknown), so the
    run is still judged."""
    load_at = start_at + spec.warmup
    end_at = load_at + spec.duration
    in_load = False
    stopped: list[str] = []
    while time.time() < end_at + overrun_seconds:
        watch()
        if not in_load and time.time() >= load_at:
            phase("load")
            in_load = True
        if not any(p.is_alive() for p in producers):
            break
        time.sleep(0.1)
    for process in producers:
        process.join(timeout=5.0)
        if process.is_alive():
            # Past its stop time and grace: stop it so that no job is enqueued in the drain.
            stopped.append(process.name)
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
            process.join(timeout=5.0)
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
                process.join()
    return stopped


def go(run_dir: Path, producers: list[ProducerProcess], timeout: float = 120.0) -> float:
    """Wait until every producer process is ready, then give them one start time."""
    deadline = time.monotonic() + timeout
    while len(list((run_dir / LOCUST_DIR).glob("*.ready"))) < len(producers):
        dead = [p.name for p in producers if not p.is_alive()]
        if dead:
            raise HarnessError(f"producer process(es) exited during start: {', '.join(dead)}")
        if time.monotonic() > deadline:
            raise HarnessError(f"producers not ready after {timeout:g} s")
        time.sleep(0.05)
    start_at = time.time() + 0.2
    write_json(run_dir / LOCUST_DIR / GO_FILE, {"start_at": start_at})
    return start_at


def check_producers(producers: list[ProducerProcess], stopped: Collection[str] = ()) -> None:
    """A producer that exited non-zero on its own is a harness failure; one the runner
    stopped for overrunning is not (its exit code is the runner's own signal)."""
    failed = [p.name for p in producers if p.exitcode != 0 and p.name not in stopped]
    if failed:
        raise HarnessError(f"producer process(es) failed: {', '.join(failed)}"
                           " (see stderr above)")
