"""Failpoints: crashes and stalls a worker inflicts on itself, on purpose, to test recovery.

The configured probabilities and the failpoint file's (a fault schedule opens and closes them
while the run goes on) are decided by one generator, seeded with (config seed, worker id), so
a run with a seed replays the same fault schedule. The dispatcher and a native worker loop use
the same ones.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Literal, Protocol

from skiplock.queue_impl.events import EventSink, log, one_line
from skiplock.queue_impl.interface import Lease

FailpointName = Literal["crash_after_claim", "crash_after_http"]
FAILPOINT_NAMES: tuple[FailpointName, ...] = ("crash_after_claim", "crash_after_http")
# Only through the failpoint file (a fault schedule opens it and a nemesis watches for the
# stalled session): stall inside the claim transaction, before its COMMIT, this many seconds.
PAUSE_IN_CLAIM = "pause_in_claim"
PAUSE_IN_CLAIM_SECONDS = "pause_in_claim_seconds"
# One stall per firing: the firing's number, and the first worker to create the marker file
# named after it is the one that stalls (two workers claiming at once must not both freeze).
PAUSE_IN_CLAIM_FIRING = "pause_in_claim_firing"
_FILE_KEYS = frozenset({*FAILPOINT_NAMES, PAUSE_IN_CLAIM, PAUSE_IN_CLAIM_SECONDS,
                        PAUSE_IN_CLAIM_FIRING})
# The exit status of a process killed by a failpoint, so the pool can tell it from a bug.
FAILPOINT_EXIT_CODE = 77


class FailpointSettings(Protocol):
    """What failpoints read of a worker's configuration (`DispatcherConfig` has it)."""

    @property
    def failpoint_file(self) -> str | None: ...

    @property
    def seed(self) -> int | None: ...

    def failpoint_probability(self, name: FailpointName) -> float: ...


def seeded(stream: str, seed: int | None, worker_id: str) -> random.Random:
    """A generator for one purpose of one worker: replayable when `seed` is given (a string
    seed hashes the same in every process), fresh entropy otherwise."""
    if seed is None:
        return random.Random()
    return random.Random(f"{stream}:{seed}:{worker_id}")


class Failpoints:
    """One worker's failpoints, decided by one generator seeded per worker."""

    def __init__(self, config: FailpointSettings, worker_id: str,
                 rng: random.Random | None = None) -> None:
        self.config = config
        self.worker_id = worker_id
        self._rng = rng or seeded("failpoints", config.seed, worker_id)
        self._cache: tuple[object, dict[str, float]] = (None, {})

    def _file_failpoints(self) -> dict[str, float]:
        """The failpoint file's probabilities, re-read only when the file was replaced."""
        path = self.config.failpoint_file
        if path is None:
            return {}
        try:
            stat = os.stat(path)
        except OSError:
            self._cache = (None, {})
            return {}
        key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if self._cache[0] != key:
            try:
                with open(path, encoding="utf-8") as fh:
                    raw = json.load(fh)
                loaded = {str(k): float(v) for k, v in raw.items() if k in _FILE_KEYS}
            except (OSError, ValueError, TypeError, AttributeError) as exc:
                log(f"{self.worker_id}: ignoring the failpoint file: {one_line(exc)}")
                loaded = {}
            self._cache = (key, loaded)
        return self._cache[1]

    def stall_in_claim(self) -> None:
        """The `pause_in_claim` failpoint, run by the backend between a claim's statements
        and its COMMIT (on the claim's thread): sleep there, as a worker frozen inside its
        claim transaction would, while the leases' clock runs."""
        found = self._file_failpoints()
        probability = found.get(PAUSE_IN_CLAIM, 0.0)
        if probability > 0 and self._rng.random() < probability and self._first_to_stall(
                found.get(PAUSE_IN_CLAIM_FIRING)):
            time.sleep(max(0.0, found.get(PAUSE_IN_CLAIM_SECONDS, 0.0)))

    def _first_to_stall(self, firing: float | None) -> bool:
        """Whether this worker takes the firing's one stall (an exclusive create of its
        marker beside the failpoint file); every claimer stalls when no firing is named."""
        path = self.config.failpoint_file
        if firing is None or path is None:
            return True
        try:
            os.close(os.open(f"{path}.stall-{int(firing)}",
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        except OSError:
            return True
        return True

    def fires(self, name: FailpointName) -> bool:
        """This worker's next decision for failpoint `name`."""
        probability = max(self.config.failpoint_probability(name),
                          self._file_failpoints().get(name, 0.0))
        return probability > 0 and self._rng.random() < probability

    def crash_if_fires(self, name: FailpointName, lease: Lease, sink: EventSink) -> None:
        """Record the failpoint and exit at once, with no cleanup, when it fires: this is
        the crash being simulated."""
        if self.fires(name):
            sink("failpoint", {"name": name, "job_id": lease.job_id_text,
                               "attempt": lease.attempt,
                               "lease_token": lease.token_text})
            os._exit(FAILPOINT_EXIT_CODE)


__all__ = ["FAILPOINT_EXIT_CODE", "FAILPOINT_NAMES", "PAUSE_IN_CLAIM", "PAUSE_IN_CLAIM_FIRING",
           "PAUSE_IN_CLAIM_SECONDS", "FailpointName", "FailpointSettings", "Failpoints",
           "seeded"]
