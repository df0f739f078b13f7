"""Sampling the queue in the background, one sample a second, and the drain that reads it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from skiplock.queue_impl.interface import JobStatus
from skiplock.scenarios.run.progress import Observer, Sample, Sampler, SampleWriter
from skiplock.scenarios.run.spec import ScenarioSpec

if TYPE_CHECKING:
    from skiplock.scenarios.run.workers import WorkerPool


class SampleLoop:
    def __init__(self, sampler: Sampler, writer: SampleWriter,
                 observer: Observer | None) -> None:
        self.sampler = sampler
        self.writer = writer
        self.observer = observer
        self.phase = "setup"
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="skiplock-sampler",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def take(self, *, final: bool = False) -> Sample:
        with self._lock:
            sample = self.sampler.sample(self.phase, final=final)
            self.samples.append(sample)
            self.writer.write(sample)
        if self.observer is not None:
            self.observer(sample)
        return sample

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            with contextlib.suppress(Exception):
                self.take()

    def drain_state(self) -> tuple[dict[str, int] | None, int | None]:
        """(jobs per status, jobs stranded in an expired lease); None where unknown."""
        with self._lock:
            return self.sampler.status_counts(), self.sampler.stranded_jobs()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)
        with contextlib.suppress(Exception):
            self.take(final=True)
        self.writer.close()
        self.sampler.close()


def wait_drained(loop: SampleLoop, spec: ScenarioSpec, pool: WorkerPool,
                 watch: Callable[[], None] = lambda: None) -> bool:
    """True when the queue is quiescent, False when the drain timeout came first.

    Quiescent means every job is terminal, or, with recovery off, some jobs are stranded in
    expired leases and nothing has changed for longer than any legitimate pause (a lease, a
    retry backoff, a poll): nothing will ever move those jobs, nor the jobs queued behind
    them on a full account, and the checker reports them as stuck."""
    deadline = time.monotonic() + spec.drain_timeout
    settle = spec.lease + spec.retry_cap + spec.poll + 1.0
    last: tuple[tuple[str, int], ...] | None = None
    unchanged_since = time.monotonic()
    while True:
        watch()
        counts, stranded = loop.drain_state()
        if counts is not None:
            live = sum(n for status, n in counts.items() if not JobStatus(status).terminal)
            if live == 0:
                return True
            signature = tuple(sorted(counts.items()))
            if signature != last:
                last, unchanged_since = signature, time.monotonic()
            elif (not spec.recovery and stranded
                  and time.monotonic() - unchanged_since >= settle):
                return True
        if time.monotonic() >= deadline or not any(pool.alive()):
            # No worker left (failpoints, kills) means nothing more can drain either.
            return False
        time.sleep(0.2)


def drain(loop: SampleLoop, spec: ScenarioSpec, pool: WorkerPool, say: Callable[[str], None],
          watch: Callable[[], None] = lambda: None) -> tuple[bool, float]:
    """Wait, bounded by the drain timeout, for the queue to settle, and say how it ended.
    Returns (drained, seconds waited)."""
    drain_started = time.monotonic()
    drained = wait_drained(loop, spec, pool, watch)
    drain_seconds = time.monotonic() - drain_started
    if drained:
        say("drained")
    elif not any(pool.alive()):
        say("drain stopped: every worker process has died")
    else:
        say(f"drain timed out after {spec.drain_timeout:g} s")
    return drained, drain_seconds
