"""One end-to-end phase's measured window: wait it out, then judge it from the worker event
logs (jobs written in it, claim to write latency) and the CPU each process group spent."""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, Protocol

import pandas as pd

from skiplock.plumbing.errors import HarnessError
from skiplock.scenarios.bench.common import Params, percentile
from skiplock.scenarios.bench.cpu import CpuWindow
from skiplock.scenarios.bench.target import cpu_seconds

Cpu = tuple[float | None, float | None]


@dataclass(frozen=True, kw_only=True)
class E2eResult:
    jobs: int
    seconds: float
    jobs_per_second: float
    # Per job, claim to result written, in ms.
    job_p50_ms: float | None
    job_p99_ms: float | None
    ran_dry: bool
    worker_cpu_seconds: float | None
    target_cpu_seconds: float | None
    # The PostgreSQL and Redis processes on this machine (None: none seen, a remote server),
    # and the share of the machine's CPU time that was busy, over the same window.
    server_cpu_seconds: float | None = None
    redis_cpu_seconds: float | None = None
    machine_busy: float | None = None
    # Where a job's time went, p50 ms per stage (`STAGES`), for a path whose workers log
    # what skiplock's dispatcher logs (None: a peer's own loop, which logs less).
    stages_p50_ms: dict[str, float] | None = None


# A job's stages, each from one logged instant to the next (`_stages`): the claim's round
# trip (its statements and durable commit), then until its call starts (the receipt's round
# trip and the wait for the loop), the call, until its result is sent in a write (the
# gather), and the write's round trip. Claim to written spans the last four.
STAGES = ("claim", "to call", "call", "to write", "write")


class CountingTarget(Protocol):
    """What a window needs of the target (`skiplock.chaos.target.TargetProcess`)."""

    @property
    def pid(self) -> int | None: ...

    def stats(self, timeout: float = ...) -> dict[str, Any]: ...


@dataclass(kw_only=True)
class Window:
    """One phase's measured window: when it started, the CPU seconds of (workers, target)
    at its start and end, and every group's CPU over it."""

    started: float
    before: Cpu
    after: Cpu
    machine: CpuWindow


def timed_window(worker_pids: list[int | None], target: CountingTarget,
                 duration: float) -> Window:
    """Wait out one phase's window, saying each second how many deliveries the target has
    seen so far."""
    machine = CpuWindow()
    machine.start()
    started = time.time()
    before = _cpu(worker_pids), _cpu([target.pid])
    deadline = started + duration
    while (now := time.time()) < deadline:
        time.sleep(min(1.0, deadline - now))
        _say(f"  {time.time() - started:4.0f} s  {_deliveries(target)}")
    after = _cpu(worker_pids), _cpu([target.pid])
    machine.stop()
    return Window(started=started, before=before, after=after, machine=machine)


def _deliveries(target: CountingTarget) -> str:
    """The target's delivery count, for progress only: a count it could not give is left out
    (the window is judged from the event logs, not from this)."""
    try:
        return f"{target.stats(timeout=0.5)['deliveries']:>9,} deliveries"
    except (OSError, KeyError, RuntimeError, ValueError):
        return ""


def judge_window(events: Path, window: Window, params: Params) -> E2eResult:
    """The jobs whose result was written in the window, and their claim to write latency,
    from the worker event logs in `events`; where the CPU went meanwhile."""
    started = window.started
    ended = started + params.duration
    frames = [pd.read_csv(path, usecols=lambda name: name in _READ)
              for path in sorted(events.glob("*.csv"))]
    if not frames:
        raise HarnessError("no worker event log was written")
    ev = pd.concat(frames, ignore_index=True)
    claims = ev[ev["kind"] == "claim"].groupby("job_id")["time"].min()
    writes = ev[ev["kind"] == "write"].groupby("job_id")["time"].min()
    in_window = writes[(writes >= started) & (writes < ended)]
    latency = ((in_window - claims.reindex(in_window.index)) * 1000).dropna().sort_values()
    return E2eResult(
        jobs=len(in_window), seconds=params.duration,
        jobs_per_second=len(in_window) / params.duration,
        job_p50_ms=percentile(latency.tolist(), 0.50),
        job_p99_ms=percentile(latency.tolist(), 0.99),
        ran_dry=len(writes) >= params.prefill,
        worker_cpu_seconds=_delta(window.before[0], window.after[0]),
        target_cpu_seconds=_delta(window.before[1], window.after[1]),
        server_cpu_seconds=window.machine.seconds("server"),
        redis_cpu_seconds=window.machine.seconds("redis"),
        machine_busy=window.machine.machine_busy(),
        stages_p50_ms=_stages(ev, in_window.index))


# The columns a window reads: the kind, time and job of every event, and the instants
# within them that skiplock's dispatcher logs (a peer's log has only the first three).
_READ = frozenset({"kind", "time", "job_id", "started", "start", "end"})


def _stages(ev: pd.DataFrame, jobs: pd.Index) -> dict[str, float] | None:
    """The p50 of each of `STAGES` over `jobs`, each job's first claim, call and write;
    None when the log lacks the instants (a peer's loop)."""
    if not {"started", "start", "end"} <= set(ev.columns) or not len(jobs):
        return None
    first = ev.groupby(["kind", "job_id"])[["time", "started", "start", "end"]].min()
    if not {"claim", "http", "write"} <= set(first.index.get_level_values("kind")):
        return None

    def of(kind: str, column: str) -> pd.Series:
        return first.loc[kind][column].reindex(jobs)

    instants = [of("claim", "started"), of("claim", "time"), of("http", "start"),
                of("http", "end"), of("write", "started"), of("write", "time")]
    stages = {}
    for name, (begin, end) in zip(STAGES, pairwise(instants), strict=True):
        spans = ((end - begin) * 1000).dropna().sort_values().tolist()
        value = percentile(spans, 0.50)
        if value is None:
            return None
        stages[name] = round(value, 2)
    return stages


def _cpu(pids: list[int | None]) -> float | None:
    seconds = [cpu_seconds(pid) for pid in pids if pid is not None]
    return None if not seconds or any(s is None for s in seconds) else \
        sum(s for s in seconds if s is not None)


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else round(after - before, 2)


def _say(line: str) -> None:
    print(line, flush=True)
