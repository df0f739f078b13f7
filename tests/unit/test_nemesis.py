"""The fault schedule: parsing `[[nemesis]]`, seeded planning, refusals, and the scheduler
recording every fault with its window (pure logic: a fake context, no processes)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from skiplock.chaos import nemesis
from skiplock.chaos.nemesis import (
    NemesisError,
    NemesisSpec,
    PlannedFault,
    ScheduledNemesis,
    check_schedule,
    plan,
    shortcut,
    spec_from_mapping,
)
from skiplock.reports.history import FaultEvent
from skiplock.scenarios import spec as spec_mod


def planned(specs: list[NemesisSpec], seed: int) -> list[PlannedFault]:
    return plan(specs, seed=seed, load_seconds=10.0, lease_seconds=4.0,
                http_timeout_seconds=1.0)


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    specs = [NemesisSpec(kind="kill_worker", at=1.0, interval=1.0, probability=0.5),
             NemesisSpec(kind="pause_worker", at=2.0, interval=3.0)]
    assert planned(specs, 7) == planned(specs, 7)
    firings = {tuple(p.at for p in planned(specs, seed) if p.kind == "kill_worker")
               for seed in range(10)}
    assert len(firings) > 1  # the coin flips depend on the seed


def test_a_schedule_repeats_inside_the_load_and_uses_the_kinds_defaults() -> None:
    [spec] = [NemesisSpec(kind="pause_worker", at=1.0, interval=3.0)]
    times = [p.at for p in planned([spec], 1)]
    assert times == [1.0, 4.0, 7.0]
    assert {p.duration for p in planned([spec], 1)} == {5.0}  # lease + 1
    [hang] = planned([NemesisSpec(kind="hang_target", at=2.0)], 1)
    assert hang.duration == 2.0  # HTTP timeout + 1


def test_terminate_backends_aimed_at_commits_lasts_a_window() -> None:
    [cut] = planned([NemesisSpec(kind="terminate_backends", at=1.0)], 1)
    assert (cut.duration, cut.phase) == (0.0, "lease")  # instantaneous
    [hunt] = planned([NemesisSpec(kind="terminate_backends", at=1.0, phase="commit",
                                  count=4)], 1)
    assert (hunt.duration, hunt.phase, hunt.count) == (nemesis.COMMIT_WINDOW_SECONDS,
                                                       "commit", 4)


def test_failpoint_windows_always_fire_and_carry_their_probability() -> None:
    [window] = planned([NemesisSpec(kind="crash_after_http", at=1.0, probability=0.05)], 3)
    assert window.probability == 0.05


@pytest.mark.parametrize(("raw", "message"), [
    ({"kind": "kill_wroker"}, "unknown nemesis kind 'kill_wroker'"),
    ({"at": 1}, "needs kind"),
    ({"kind": "kill_worker", "when": 1}, "unknown key 'when'"),
    ({"kind": "kill_worker", "at": -1}, "at must not be negative"),
    ({"kind": "kill_worker", "at": float("nan")}, "at must be a finite number"),
    # A tiny interval once planned faults until the harness ran out of memory.
    ({"kind": "kill_worker", "interval": 1e-300}, r"interval must be 0 \(once\) or at least 0.1"),
    ({"kind": "kill_worker", "count": 0}, "count must be a positive whole number"),
    ({"kind": "kill_worker", "count": 1.5}, "count must be a whole number"),
    ({"kind": "kill_worker", "probability": 2}, "probability must be between 0 and 1"),
    ({"kind": "kill_worker", "at": "soon"}, "at must be a number"),
    ({"kind": "restart_postgres", "external": "maybe"}, "external must be 'refuse' or 'skip'"),
    ({"kind": "kill_worker", "phase": "commit"},
     "phase 'commit' applies to terminate_backends only"),
    ({"kind": "terminate_backends", "phase": "claim"},
     "phase 'claim' applies to pause_worker only"),
    ({"kind": "terminate_backends", "phase": "later"}, "phase must be 'lease', 'claim' or"),
])
def test_bad_entries_are_refused_in_one_line(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(NemesisError, match=message):
        spec_from_mapping(raw)


def test_refusals_that_depend_on_the_run() -> None:
    late = NemesisSpec(kind="kill_worker", at=5.0)
    with pytest.raises(NemesisError, match="starts at 5 s but the load phase lasts 5 s"):
        check_schedule([late], load_seconds=5.0)
    restart = NemesisSpec(kind="restart_postgres", at=1.0)
    with pytest.raises(NemesisError, match="needs a PostgreSQL the harness starts"):
        check_schedule([restart], load_seconds=5.0, server_owned=False)
    check_schedule([restart], load_seconds=5.0, server_owned=True)
    skip = NemesisSpec(kind="restart_postgres", at=1.0, external="skip")
    check_schedule([skip], load_seconds=5.0, server_owned=False)


def test_the_shortcut_staggers_kinds_and_never_refuses_an_external_server() -> None:
    specs = shortcut("kill_worker,restart_postgres")
    assert [s.at for s in specs] == [1.0, 1.7]
    assert all(s.external == "skip" for s in specs)
    with pytest.raises(NemesisError, match="unknown nemesis kind"):
        shortcut("kill_worker,nope")
    with pytest.raises(NemesisError, match="expects KIND"):
        shortcut("kill_worker,,pause_worker")


def test_scenario_files_take_nemesis_arrays_unlimited_accounts_and_account_mix(
        tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('duration = 5\n[accounts]\na = 2\nb = "unlimited"\n'
                    '[account_mix]\na = 3\n[[nemesis]]\nkind = "kill_worker"\nat = 1\n')
    spec = spec_mod.load(str(path))
    assert spec.accounts == {"a": 2, "b": None}
    assert spec.account_weights() == [3.0, 1.0]
    assert [n.kind for n in spec.nemesis] == ["kill_worker"]
    # The resolved spec survives its own JSON (what producers and spec.json read back).
    again = spec_mod.from_mapping(spec.to_json()).validate()
    assert again.accounts == spec.accounts and again.nemesis == spec.nemesis
    with pytest.raises(spec_mod.SpecError, match=r"account_mix\.c: no such account"):
        spec_mod.load(str(path), ["account_mix.c=1"])
    with pytest.raises(spec_mod.SpecError, match='positive whole number or "unlimited"'):
        spec_mod.load(str(path), ["accounts.a=lots"])
    with pytest.raises(spec_mod.SpecError, match="starts at 1 s but the load phase lasts"):
        spec_mod.load(str(path), ["duration=1"])


def test_every_shipped_scenario_loads_and_its_faults_fit_its_load() -> None:
    for name in spec_mod.available():
        loaded = spec_mod.load(name)
        check_schedule(loaded.nemesis, load_seconds=loaded.duration)


# --- the scheduler, on a fake context ---------------------------------------------------


@dataclass
class FakeContext:
    holders: list[str] = field(default_factory=lambda: ["worker-1"])
    signals: list[tuple[str, int]] = field(default_factory=list)
    failpoints: list[tuple[str, float]] = field(default_factory=list)
    run_dir: Path = Path("/nonexistent")
    dsn: str = ""
    schema: str = "s"
    app_prefix: str = "p-"
    server_owned: bool = True
    lease_seconds: float = 4.0
    http_timeout_seconds: float = 1.0

    def restart_server(self) -> None:
        raise AssertionError("not in this test")

    def targets(self) -> list[Any]:
        return []

    def workers_alive(self) -> list[str]:
        return list(self.holders)

    def workers_holding_leases(self) -> list[str]:
        return list(self.holders)

    def signal_worker(self, worker_id: str, signum: int) -> None:
        self.signals.append((worker_id, signum))

    def set_failpoint(self, name: str, probability: float) -> None:
        self.failpoints.append((name, probability))


def run_schedule(faults: list[PlannedFault], ctx: FakeContext,
                 stop_after: float) -> list[FaultEvent]:
    events: list[FaultEvent] = []
    lock = threading.Lock()

    def record(event: FaultEvent) -> None:
        with lock:
            events.append(event)

    scheduled = ScheduledNemesis(faults, record)
    scheduled.start(ctx, time.time())
    time.sleep(stop_after)
    scheduled.stop()
    return events


def fault(kind: str, at: float = 0.0, duration: float = 0.0) -> PlannedFault:
    return PlannedFault(kind=kind, at=at, duration=duration, count=1, probability=0.3,
                        external="refuse", seed=1)


def test_a_pause_is_healed_when_the_load_ends_and_recorded_with_its_window() -> None:
    import signal

    ctx = FakeContext()
    before = time.time()
    [event] = run_schedule([fault("pause_worker", duration=30.0)], ctx, stop_after=0.2)
    assert ctx.signals == [("worker-1", signal.SIGSTOP), ("worker-1", signal.SIGCONT)]
    assert event.fault == "pause_worker" and event.target == "worker-1"
    assert event.end is not None and before <= event.start < event.end < before + 5


def test_a_firing_with_no_lease_holder_is_recorded_as_skipped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from skiplock.chaos import nemesis_worker

    monkeypatch.setattr(nemesis_worker, "HOLDER_WAIT_SECONDS", 0.05)
    ctx = FakeContext(holders=[])
    [event] = run_schedule([fault("kill_worker")], ctx, stop_after=0.3)
    assert event.skipped is not None and "no worker held a lease" in event.skipped
    assert ctx.signals == []


def test_a_failpoint_window_opens_and_closes() -> None:
    ctx = FakeContext()
    [event] = run_schedule([fault("crash_after_claim", duration=0.1)], ctx, stop_after=0.5)
    assert ctx.failpoints == [("crash_after_claim", 0.3), ("crash_after_claim", 0.0)]
    assert event.target is None and event.data["probability"] == 0.3


def test_nothing_fires_after_stop() -> None:
    ctx = FakeContext()
    events = run_schedule([fault("kill_worker", at=5.0)], ctx, stop_after=0.1)
    assert events == [] and ctx.signals == []


def test_every_kind_has_a_fault_class() -> None:
    assert set(nemesis.registry()) == set(nemesis.NEMESIS_KINDS)
