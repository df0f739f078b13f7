"""A claim-phase pause stalls one claimer per firing: two workers claiming at the same moment
must not both freeze (the fault's window names one worker)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from skiplock.queue_impl.config import DispatcherConfig
from skiplock.queue_impl.failpoints import (
    PAUSE_IN_CLAIM,
    PAUSE_IN_CLAIM_FIRING,
    PAUSE_IN_CLAIM_SECONDS,
    Failpoints,
)


def _open_window(path: Path, firing: float | None) -> None:
    values = {PAUSE_IN_CLAIM: 1.0, PAUSE_IN_CLAIM_SECONDS: 0.05}
    if firing is not None:
        values[PAUSE_IN_CLAIM_FIRING] = firing
    path.write_text(json.dumps(values))


def _stalls(point: Failpoints) -> bool:
    started = time.monotonic()
    point.stall_in_claim()
    return time.monotonic() - started >= 0.04


def test_one_claimer_stalls_per_firing(tmp_path: Path) -> None:
    path = tmp_path / "failpoints.json"
    config = DispatcherConfig(failpoint_file=str(path))
    workers = [Failpoints(config, f"worker-{n}") for n in range(3)]
    _open_window(path, 1.0)
    assert [_stalls(w) for w in workers] == [True, False, False]
    # The next firing has a number of its own: one worker stalls again.
    _open_window(path, 2.0)
    assert [_stalls(w) for w in reversed(workers)] == [True, False, False]


def test_without_a_firing_number_every_claimer_stalls(tmp_path: Path) -> None:
    path = tmp_path / "failpoints.json"
    config = DispatcherConfig(failpoint_file=str(path))
    _open_window(path, None)
    assert all(_stalls(Failpoints(config, f"worker-{n}")) for n in range(2))
