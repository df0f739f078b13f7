"""What every benchmark that drives worker processes shares: its parameters, starting its
processes in step and saying their progress, the optional packages a comparison needs, and a
percentile."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from skiplock.plumbing.errors import HarnessError, UsageError

# How long a benchmark's worker process may take to get ready (connect, prepare).
READY_SECONDS = 60.0


@dataclass(frozen=True, kw_only=True)
class Params:
    workers: int
    batch: int
    duration: float
    prefill: int
    # The backlog as a queue has it: "vacuumed" (VACUUM ANALYZE after the fill) or "fresh"
    # (only ANALYZE: rows arrive faster than autovacuum visits, so a claim meets them so).
    fill: str = "vacuumed"


# How many rounds a benchmark's `--rounds` may ask for.
MAX_ROUNDS = 20


def bad_rounds(rounds: int) -> str | None:
    """What is wrong with `--rounds`, as one line, or None."""
    if not 1 <= rounds <= MAX_ROUNDS:
        return f"--rounds must be from 1 to {MAX_ROUNDS}, got {rounds}"
    return None


# Printed where a ratio is not given: a phase that ran out of due jobs measured its backlog.
NO_RATIO = "not measured (a phase ran out of due jobs: raise --prefill)"


def ratio_of(one: Any, other: Any) -> float | None:
    """One phase's rate over another's; None when either ran dry (its rate is its backlog
    over the duration, not what it can do) or the other did nothing. A phase is a result
    object or its dict form, with `jobs_per_second` and `ran_dry`."""
    def rate_and_dry(phase: Any) -> tuple[float, bool]:
        if isinstance(phase, Mapping):
            return float(phase["jobs_per_second"]), bool(phase["ran_dry"])
        return float(phase.jobs_per_second), bool(phase.ran_dry)

    (rate, dry), (other_rate, other_dry) = rate_and_dry(one), rate_and_dry(other)
    if dry or other_dry or other_rate <= 0:
        return None
    return rate / other_rate


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def say_progress(procs: Sequence[Any], duration: float, count: Callable[[], int | None],
                 say: Callable[[str], None]) -> None:
    """Until `procs` end, once a second of the `duration` window, the jobs `count` says are
    done (a cheap counter: never a scan of the table being measured)."""
    from multiprocess.connection import wait

    started = shown = time.monotonic()
    while alive := [proc for proc in procs if proc.is_alive()]:
        wait([proc.sentinel for proc in alive], timeout=1.0)
        now = time.monotonic()
        if now - shown >= 1.0 and now - started <= duration + 0.5:
            shown = now
            done = count()
            say(f"  {now - started:4.0f} s  " + ("" if done is None else f"{done:>9,} jobs"))


@contextlib.contextmanager
def processes_in_step(procs: Sequence[Any], ready: Any, *, what: str,
                      join_seconds: float) -> Iterator[None]:
    """Start `procs` and wait until each has released `ready`; the body then lets them go
    and waits out its window. Afterwards each is joined (up to `join_seconds`) and any that
    failed is a HarnessError naming it; whatever still runs on the way out is killed."""
    try:
        for proc in procs:
            proc.start()
        for _ in procs:
            if not ready.acquire(timeout=READY_SECONDS):
                raise HarnessError(f"a {what} worker did not get ready in time")
        yield
        for proc in procs:
            proc.join(timeout=join_seconds)
        failed = [p.name for p in procs if p.exitcode != 0]
        if failed:
            raise HarnessError(f"{what} worker(s) failed: {', '.join(failed)}")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()


def require_package(module: str, flag: str, install: str) -> str:
    """The installed version of the package `module` comes from; UsageError naming `flag`
    and how to install it when it is missing (said before anything runs)."""
    import importlib
    from importlib.metadata import version

    try:
        importlib.import_module(module)
    except ImportError:
        raise UsageError(f"{flag} needs {module}: {install}") from None
    return version(module)


def add_out(parser: argparse.ArgumentParser) -> None:
    """`--out FILE`, for a benchmark that writes its result only when asked."""
    parser.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="write the result as JSON to FILE")


def result_path(out: Path | None, benchmark: str) -> Path:
    """Where a benchmark writes its result: `out`, else `bench-results/BENCHMARK-STAMP.json`.
    A path that cannot be written is refused before the benchmark spends any time."""
    path = out or Path("bench-results") / f"{benchmark}-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    if path.is_dir():
        raise UsageError(f"--out {path} is a directory; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {path}: cannot create its folder ({exc.strerror})") from None
    return path
