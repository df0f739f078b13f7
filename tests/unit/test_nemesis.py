"""The fault schedule: parsing `[[nemesis]]`, seeded planning, refusals, and the scheduler
recording every fault with its window (pure logic: a fake context, no processes)."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from skiplock.chaos import nemesis
from skiplock.chaos.faults import worker as nemesis_worker
from skiplock.chaos.nemesis import (
    HeldLease,
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
from skiplock.scenarios.run import spec as spec_mod


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
    ({"kind": "kill_worker", "aim": "last"}, "aim must be one of 'any', 'last_attempt'"),
    ({"kind": "kill_worker", "aim": 3}, "aim must be a string"),
    ({"kind": "pause_worker", "aim": "last_attempt"},
     "aim 'last_attempt' applies to kill_worker only"),
])
def test_bad_entries_are_refused_in_one_line(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(NemesisError, match=message):
        spec_from_mapping(raw)


def test_an_aimed_kill_keeps_its_aim_in_the_schedule_and_the_schedule_is_unchanged() -> None:
    aimed = spec_from_mapping({"kind": "kill_worker", "aim": "last_attempt", "at": 1,
                               "interval": 2})
    plain = spec_from_mapping({"kind": "kill_worker", "at": 1, "interval": 2})
    assert {p.aim for p in planned([aimed], 3)} == {"last_attempt"}
    assert {p.aim for p in planned([plain], 3)} == {"any"}
    # The aim draws nothing from the seed: the same times and fault seeds either way.
    strip = [(p.at, p.seed) for p in planned([plain], 3)]
    assert [(p.at, p.seed) for p in planned([aimed], 3)] == strip
    assert aimed.to_json()["aim"] == "last_attempt"


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


@dataclass(eq=False)
class FakeContext:
    """Lease holders, the attempts they hold (a test may change them under `lock` as time
    passes), and the signals and failpoints sent."""

    holders: list[str] = field(default_factory=lambda: ["worker-1"])
    held: list[HeldLease] = field(default_factory=list)
    signals: list[tuple[str, int]] = field(default_factory=list)
    failpoints: list[tuple[str, float]] = field(default_factory=list)
    run_dir: Path = Path("/nonexistent")
    dsn: str = ""
    schema: str = "s"
    app_prefix: str = "p-"
    server_owned: bool = True
    lease_seconds: float = 4.0
    http_timeout_seconds: float = 1.0
    claim_transaction: bool = True
    account_limits: dict[str, int | None] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def restart_server(self) -> None:
        raise AssertionError("not in this test")

    def targets(self) -> list[Any]:
        return []

    def workers_alive(self) -> list[str]:
        return list(self.holders)

    def workers_holding_leases(self) -> list[str]:
        return list(self.holders)

    def leases_held(self) -> list[HeldLease]:
        # A killed worker's process lingers for a moment: its leases still show here.
        with self.lock:
            return list(self.held)

    def signal_worker(self, worker_id: str, signum: int) -> None:
        self.signals.append((worker_id, signum))

    def set_failpoint(self, name: str, probability: float) -> None:
        self.failpoints.append((name, probability))


def held(worker: str, job: str, attempt: int, claimed_at: float,
         answered: bool = False) -> HeldLease:
    return HeldLease(worker=worker, job_id=job, attempt=attempt, claimed_at=claimed_at,
                     answered=answered)


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
    ctx = FakeContext()
    before = time.time()
    [event] = run_schedule([fault("pause_worker", duration=30.0)], ctx, stop_after=0.2)
    assert ctx.signals == [("worker-1", signal.SIGSTOP), ("worker-1", signal.SIGCONT)]
    assert event.fault == "pause_worker" and event.target == "worker-1"
    assert event.end is not None and before <= event.start < event.end < before + 5


def test_a_firing_with_no_lease_holder_is_recorded_as_skipped(
        monkeypatch: pytest.MonkeyPatch) -> None:
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


# --- kill_worker aimed at last attempts -----------------------------------------------------


def test_last_attempts_are_those_at_max_attempts_of_jobs_that_fail_every_attempt() -> None:
    from skiplock.chaos.faults.worker import last_attempts

    held = {
        "w-1": {("hang", 3): 10.0, ("hang-early", 2): 10.0},  # a last attempt, and not
        "w-2": {("fails-once", 3): 10.0},  # its oracle needs that delivery: never aimed at
        "w-3": {("hang-2", 3): 10.9},  # claimed 0.1 s ago: maybe not received yet
        "w-4": {("hang-3", 4): 10.0},  # past max_attempts: a broken queue's, not aimed at
        "w-5": {("hang-4", 1): 10.0, ("hang-5", 1): 10.0},  # max_attempts 1
    }
    exhausting = {"hang": 3, "hang-early": 3, "hang-2": 3, "hang-3": 3, "hang-4": 1,
                  "hang-5": 1}
    assert last_attempts(held, exhausting, now=11.0, settle=0.2) == {
        "w-1": [("hang", 3)], "w-5": [("hang-4", 1), ("hang-5", 1)]}
    assert set(last_attempts(held, exhausting, now=11.0)) == {"w-1", "w-3", "w-5"}
    assert last_attempts(held, {}, now=11.0) == {}


def _enqueue_log(run_dir: Path, scripts: dict[str, Any], *, cut_last: bool = False,
                 account: str = "a") -> None:
    from skiplock.reports.history import ENQUEUE_LOG, ENQUEUES_FILE, EnqueueOp, LogWriter

    with LogWriter(run_dir / ENQUEUES_FILE, ENQUEUE_LOG) as writer:
        for job, script in scripts.items():
            writer.write(EnqueueOp(type="invoke", job_id=job, time=1.0, process="p",
                                   account=account, script=script.to_json(), max_attempts=3))
            writer.write(EnqueueOp(type="ok", job_id=job, time=1.1, process="p"))
    if cut_last:
        path = run_dir / ENQUEUES_FILE
        path.write_bytes(path.read_bytes()[:-1])  # a line still being written


def test_exhausting_jobs_come_from_the_oracles_as_the_enqueue_log_grows(tmp_path: Path) -> None:
    from skiplock.chaos.faults.worker import ExhaustingJobs

    scripts = spec_mod.load("faulty-targets").scripts()
    jobs = ExhaustingJobs(tmp_path, http_timeout_seconds=1.0)
    assert jobs.read() == {}  # no log yet
    _enqueue_log(tmp_path, {name: script for name, script in scripts.items()})
    # 503 forever and a hang on every attempt fail every attempt; a 400 ends at once, and
    # every other script succeeds sooner or later.
    assert jobs.read() == {"always_fail": 3, "always_hang": 3}
    assert jobs.read() == {"always_fail": 3, "always_hang": 3}  # each line read once


def test_a_half_written_enqueue_line_waits_for_its_rest(tmp_path: Path) -> None:
    from skiplock.chaos.faults.worker import ExhaustingJobs

    scripts = spec_mod.load("faulty-targets").scripts()
    _enqueue_log(tmp_path, {"j-1": scripts["always_hang"]}, cut_last=True)
    jobs = ExhaustingJobs(tmp_path, http_timeout_seconds=1.0)
    assert jobs.read() == {"j-1": 3}  # the invoke is whole; the cut `ok` line waits
    with (tmp_path / "enqueues.csv").open("ab") as fh:
        fh.write(b"\n")
    assert jobs.read() == {"j-1": 3}


def aimed_kill(at: float = 0.0) -> PlannedFault:
    return PlannedFault(kind="kill_worker", at=at, duration=0.0, count=1, probability=1.0,
                        external="refuse", seed=1, aim="last_attempt")


def test_an_aimed_kill_hits_only_a_worker_in_a_last_attempt_and_names_it(
        tmp_path: Path) -> None:
    scripts = spec_mod.load("faulty-targets").scripts()
    _enqueue_log(tmp_path, {"hang": scripts["always_hang"], "ok": scripts["succeed"]})
    long_ago = time.time() - 5.0
    ctx = FakeContext(run_dir=tmp_path, holders=["w-1", "w-2", "w-3"], held=[
        held("w-1", "ok", 3, long_ago),
        held("w-2", "hang", 3, long_ago), held("w-2", "ok", 1, long_ago),
        held("w-3", "hang", 2, long_ago),
    ])
    [event] = run_schedule([aimed_kill()], ctx, stop_after=0.3)
    assert ctx.signals == [("w-2", signal.SIGKILL)]
    assert event.fault == "kill_worker" and event.target == "w-2" and event.skipped is None
    assert event.data == {"aim": "last_attempt",
                          "aimed": [{"worker": "w-2", "job_id": "hang", "attempt": 3}]}


def test_an_aimed_kill_passes_over_a_last_attempt_whose_call_has_ended(
        tmp_path: Path) -> None:
    # Its result may wait a moment in a busy writer: killed then, the worker shows nothing
    # a kill mid-call does not.
    scripts = spec_mod.load("faulty-targets").scripts()
    _enqueue_log(tmp_path, {"hang": scripts["always_hang"], "hang-2": scripts["always_hang"]})
    long_ago = time.time() - 5.0
    ctx = FakeContext(run_dir=tmp_path, holders=["w-1", "w-2"], held=[
        held("w-1", "hang", 3, long_ago, answered=True), held("w-2", "hang-2", 3, long_ago)])
    [event] = run_schedule([aimed_kill()], ctx, stop_after=0.3)
    assert ctx.signals == [("w-2", signal.SIGKILL)]
    assert event.target == "w-2"


def test_aimed_kills_wait_for_a_last_attempt_and_never_kill_one_worker_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nemesis_worker, "AIM_WAIT_SECONDS", 0.8)
    scripts = spec_mod.load("faulty-targets").scripts()
    _enqueue_log(tmp_path, {"hang": scripts["always_hang"]})
    ctx = FakeContext(run_dir=tmp_path, holders=["w-1"])

    claimed_at: list[float] = []

    def claim_later() -> None:
        time.sleep(0.3)
        with ctx.lock:
            claimed_at.append(time.time())
            ctx.held = [held("w-1", "hang", 3, time.time() - 1.0)]

    threading.Thread(target=claim_later, daemon=True).start()
    events = run_schedule([aimed_kill(), aimed_kill(at=0.1)], ctx, stop_after=0.6)
    kills = [e for e in events if e.skipped is None]
    assert ctx.signals == [("w-1", signal.SIGKILL)] and len(kills) == 1
    # At the kill, once the last attempt was there to aim at, not at the firing. (Timed from
    # the claim itself: the thread's sleep starts a little before the schedule does.)
    assert kills[0].start >= claimed_at[0]
    # The other firing saw only the worker already killed (its process still listed), went
    # on looking, and was skipped.
    [skipped] = [e for e in events if e.skipped is not None]
    assert "last attempt" in str(skipped.skipped)


def test_an_aimed_kill_that_finds_no_last_attempt_is_skipped_with_its_aim(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nemesis_worker, "AIM_WAIT_SECONDS", 0.05)
    scripts = spec_mod.load("faulty-targets").scripts()
    _enqueue_log(tmp_path, {"hang": scripts["always_hang"]})
    ctx = FakeContext(run_dir=tmp_path, held=[held("w-1", "hang", 3, time.time())])
    [event] = run_schedule([aimed_kill()], ctx, stop_after=0.4)
    assert event.skipped is not None and "last attempt" in event.skipped
    assert event.data == {"aim": "last_attempt"} and ctx.signals == []


def test_a_scenario_with_a_bad_aim_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('duration = 5\n[[nemesis]]\nkind = "kill_worker"\naim = "first"\n')
    with pytest.raises(spec_mod.SpecError, match=r"^nemesis kill_worker: aim must be one of "
                       r"'any', 'last_attempt' \(got 'first'\)$"):
        spec_mod.load(str(path))


# --- aimed pauses (until = "reclaimed"), on the fake context --------------------------


def aimed(at: float = 0.0, duration: float = 30.0, seed: int = 1) -> PlannedFault:
    return PlannedFault(kind="pause_worker", at=at, duration=duration, count=1,
                        probability=1.0, external="refuse", seed=seed, until="reclaimed")


def start(faults: list[PlannedFault], ctx: FakeContext) -> tuple[ScheduledNemesis,
                                                                   list[FaultEvent]]:
    events: list[FaultEvent] = []
    lock = threading.Lock()

    def record(event: FaultEvent) -> None:
        with lock:
            events.append(event)

    scheduled = ScheduledNemesis(faults, record)
    scheduled.start(ctx, time.time())
    return scheduled, events


def wait_for(condition: Any, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def until_recorded(faults: list[PlannedFault], ctx: FakeContext) -> list[FaultEvent]:
    """Run the schedule until it has recorded one event; then stop it."""
    scheduled, events = start(faults, ctx)
    try:
        wait_for(lambda: len(events) == 1)
    finally:
        scheduled.stop()
    return events


def test_an_aimed_pause_ends_when_a_reclaim_of_its_job_has_run_long_enough() -> None:
    ctx = FakeContext(holders=["w0"], held=[held("w0", "j1", 1, time.time())])
    scheduled, events = start([aimed()], ctx)
    try:
        wait_for(lambda: ctx.signals == [("w0", signal.SIGSTOP)])
        time.sleep(0.2)
        assert events == []  # nothing re-claimed yet: still paused
        reclaimed_at = time.time()
        with ctx.lock:
            ctx.held = [held("w0", "j1", 1, 0.0), held("w1", "j1", 2, reclaimed_at)]
        wait_for(lambda: len(events) == 1)
    finally:
        scheduled.stop()
    [event] = events
    assert ctx.signals == [("w0", signal.SIGSTOP), ("w0", signal.SIGCONT)]
    assert event.end is not None
    assert reclaimed_at + nemesis_worker.RECLAIM_MIN_AGE_SECONDS <= event.end < reclaimed_at + 2
    assert event.data["resumed"] == "reclaimed"
    assert (event.data["reclaimed_job"], event.data["reclaimed_by"],
            event.data["reclaimed_attempt"]) == ("j1", "w1", 2)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_an_aimed_pause_freezes_a_worker_whose_job_is_redelivered_slowly(
        tmp_path: Path, seed: int) -> None:
    # Once its lease passes on, only a job whose next delivery runs long (slow_then_slower:
    # 0.8 s) keeps a call running that the pause can be woken for; a quick one has ended.
    # A limited account's job is passed over: its re-claim may queue behind the account's
    # backlog past the pause.
    scripts = spec_mod.load("pause-workers").scripts()
    _enqueue_log(tmp_path, {"slow": scripts["slow_then_slower"], "quick": scripts["succeed"],
                            "retry": scripts["fail_then_succeed"]})
    _enqueue_log(tmp_path, {"slow-limited": scripts["slow_then_slower"]}, account="tight")
    now = time.time()
    ctx = FakeContext(run_dir=tmp_path, holders=["w0", "w1", "w2", "w3"],
                      held=[held("w0", "quick", 1, now), held("w1", "slow", 1, now),
                            held("w2", "retry", 1, now), held("w3", "slow-limited", 1, now)],
                      account_limits={"a": None, "tight": 2})
    scheduled, _ = start([aimed(seed=seed)], ctx)
    try:
        wait_for(lambda: len(ctx.signals) == 1)
    finally:
        scheduled.stop()
    assert ctx.signals[0] == ("w1", signal.SIGSTOP)


def test_an_aimed_pause_takes_any_holder_when_none_holds_a_slow_redelivery(
        tmp_path: Path) -> None:
    scripts = spec_mod.load("pause-workers").scripts()
    _enqueue_log(tmp_path, {"quick": scripts["succeed"]})
    ctx = FakeContext(run_dir=tmp_path, holders=["w0"], held=[held("w0", "quick", 1, 0.0)])
    asked = time.time()
    events = until_recorded([aimed(duration=0.2)], ctx)
    assert ctx.signals[0] == ("w0", signal.SIGSTOP)
    # The window starts when the worker was stopped, after the wait for a better one.
    [event] = events
    assert event.start >= asked + nemesis_worker.PREFER_WAIT_SECONDS


def test_an_aimed_pause_with_no_reclaim_ends_after_its_duration() -> None:
    ctx = FakeContext(holders=["w0"], held=[held("w0", "j1", 1, time.time())])
    before = time.time()
    [event] = until_recorded([aimed(duration=0.3)], ctx)
    assert event.data["resumed"] == "duration" and event.end is not None
    assert before + 0.3 <= event.end
    assert ctx.signals == [("w0", signal.SIGSTOP), ("w0", signal.SIGCONT)]


def test_an_aimed_pause_is_healed_when_the_load_ends() -> None:
    ctx = FakeContext(holders=["w0"], held=[held("w0", "j1", 1, time.time())])
    scheduled, events = start([aimed()], ctx)
    wait_for(lambda: len(ctx.signals) == 1)
    scheduled.stop()
    [event] = events
    assert event.data["resumed"] == "load end"
    assert ctx.signals[-1] == ("w0", signal.SIGCONT)


def test_a_second_pause_picks_a_worker_the_first_does_not_hold_stopped() -> None:
    ctx = FakeContext(holders=["w0", "w1"])
    # One seed for both: without the rule they would draw the same worker.
    scheduled, _ = start([aimed(seed=1), aimed(seed=1)], ctx)
    try:
        wait_for(lambda: len(ctx.signals) == 2)
    finally:
        scheduled.stop()
    stopped = [w for w, s in ctx.signals if s == signal.SIGSTOP]
    assert sorted(stopped) == ["w0", "w1"]
    # Healed: both may be chosen again.
    assert not nemesis_worker._STOPPED
