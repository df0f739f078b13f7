"""Nemeses: the faults a run injects, each a small object with an explicit start and stop.

A scenario's `[[nemesis]]` entries (`NemesisSpec`) become a seeded, replayable schedule of
planned faults (`plan`): the same seed and spec give the same kinds, times and choices of
probability. While the load runs, `ScheduledNemesis` applies each planned fault at its time
on its own thread: `Fault.start()` applies it and names what it hit, `Fault.stop()` heals it
(idempotent; also called for every fault still active when the load phase ends). Each fault
becomes one `skiplock.reports.history.FaultEvent` per thing it hit, with its window, in
`nemesis.jsonl`: the checker explains redeliveries with exactly these events, so a fault is
recorded with a window that covers everything it may have caused (start before the fault is
applied, end after it is healed).

This module imports nothing from `scenarios`: the runner hands each fault a
`NemesisContext`, which is all a fault may act on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import pkgutil
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

from skiplock.reports.fault_kinds import BY_NAME, NAMES, names_where
from skiplock.reports.history import FaultEvent

# The kinds a scenario may name: the one table of fault kinds (skiplock.reports.fault_kinds).
NEMESIS_KINDS: tuple[str, ...] = NAMES

# What to do with a fault that needs a server the harness started when the DSN is external.
ExternalPolicy = Literal["refuse", "skip"]
# Where pause_worker freezes a worker: while it holds leases (SIGSTOP), or inside its claim
# transaction, after the claim's UPDATE and before its COMMIT, where the lease clock already
# runs and the account and job rows stay locked. Where terminate_backends cuts: every session
# at once ("lease", the default), or sessions caught inside a COMMIT ("commit"), which may
# have committed when the client hears of it: a claim's then commits unseen (a ghost claim).
PausePhase = Literal["lease", "claim", "commit"]
# The kinds each phase but the default applies to.
_PHASE_KINDS = {"claim": "pause_worker", "commit": "terminate_backends"}
# Which lease holder kill_worker picks: any worker holding a lease ("any", the default), or
# one holding the last allowed attempt of a job whose script fails every attempt
# ("last_attempt"), so that recovery meets an exhausted job in every run, not by luck.
Aim = Literal["any", "last_attempt"]
AIMS: tuple[str, ...] = Aim.__args__  # type: ignore[attr-defined]
# The kinds each aim but the default applies to.
_AIM_KINDS = {"last_attempt": "kill_worker"}
# When a lease-phase pause_worker ends: after its `duration` ("duration", the default), or
# aimed ("reclaimed"): as soon as another worker has claimed one of the paused worker's jobs
# again and that delivery is still in flight, so the paused worker's stale result reaches the
# queue while the job is PROCESSING under the new lease (`duration` is then the longest wait).
PauseUntil = Literal["duration", "reclaimed"]


class NemesisError(ValueError):
    """A nemesis entry that cannot run as written: one line saying what to fix."""


class FaultSkipped(Exception):
    """Raised by `Fault.start()` when the fault cannot apply now (no worker holds a lease,
    the server is external): recorded as skipped with this reason, never as applied."""


# The shortest repeat a schedule may ask for: a fault takes tens of milliseconds to apply and
# heal, and a tiny interval would plan millions of faults (and run out of memory planning).
MIN_INTERVAL = 0.1


@dataclass(frozen=True, kw_only=True)
class NemesisSpec:
    """One `[[nemesis]]` entry.

    `at` counts seconds from the start of the load phase; `interval` > 0 repeats the fault
    every `interval` seconds until the load phase ends; `duration` is how long a lasting
    fault (pause, hang, pin, exhaust, kill_target, a failpoint window) is held before it is
    healed (0: the kind's default); `count` is how many workers or targets one firing hits;
    `probability` is the chance that a firing happens at all (seeded), and for the failpoint
    kinds the chance per job while the window is open; `external` says what a fault needing
    an owned server does against an external DSN: refuse the run (exit 2), or record itself
    as skipped; `until` says when a lease-phase pause ends (`PauseUntil`)."""

    kind: str
    at: float = 1.0
    interval: float = 0.0
    duration: float = 0.0
    count: int = 1
    probability: float = 1.0
    external: ExternalPolicy = "refuse"
    phase: PausePhase = "lease"
    aim: Aim = "any"
    until: PauseUntil = "duration"

    def validate(self) -> NemesisSpec:
        if self.kind not in NEMESIS_KINDS:
            raise NemesisError(
                f"unknown nemesis kind {self.kind!r}; valid: {', '.join(NEMESIS_KINDS)}"
            )
        for name in ("at", "interval", "duration", "probability"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value != value \
                    or value in (float("inf"), float("-inf")):
                raise NemesisError(f"nemesis {self.kind}: {name} must be a finite number "
                                   f"(got {value!r})")
            if value < 0:
                raise NemesisError(f"nemesis {self.kind}: {name} must not be negative "
                                   f"(got {value})")
        if 0 < self.interval < MIN_INTERVAL:
            raise NemesisError(f"nemesis {self.kind}: interval must be 0 (once) or at least "
                               f"{MIN_INTERVAL} s (got {self.interval})")
        if self.probability > 1:
            raise NemesisError(f"nemesis {self.kind}: probability must be between 0 and 1 "
                               f"(got {self.probability})")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise NemesisError(f"nemesis {self.kind}: count must be a positive whole number "
                               f"(got {self.count!r})")
        if self.external not in ("refuse", "skip"):
            raise NemesisError(f"nemesis {self.kind}: external must be 'refuse' or 'skip' "
                               f"(got {self.external!r})")
        if self.phase not in ("lease", "claim", "commit"):
            raise NemesisError(f"nemesis {self.kind}: phase must be 'lease', 'claim' or "
                               f"'commit' (got {self.phase!r})")
        if self.phase != "lease" and self.kind != _PHASE_KINDS[self.phase]:
            raise NemesisError(f"nemesis {self.kind}: phase {self.phase!r} applies to "
                               f"{_PHASE_KINDS[self.phase]} only")
        if self.aim not in AIMS:
            raise NemesisError(f"nemesis {self.kind}: aim must be one of "
                               f"{', '.join(repr(a) for a in AIMS)} (got {self.aim!r})")
        if self.aim != "any" and self.kind != _AIM_KINDS[self.aim]:
            raise NemesisError(f"nemesis {self.kind}: aim {self.aim!r} applies to "
                               f"{_AIM_KINDS[self.aim]} only")
        if self.until not in ("duration", "reclaimed"):
            raise NemesisError(f"nemesis {self.kind}: until must be 'duration' or 'reclaimed' "
                               f"(got {self.until!r})")
        if self.until == "reclaimed" and (self.kind, self.phase) != ("pause_worker", "lease"):
            raise NemesisError(f"nemesis {self.kind}: until = 'reclaimed' applies to "
                               "pause_worker in the lease phase only")
        return self

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SPEC_FIELDS = {f.name: f for f in dataclasses.fields(NemesisSpec)}


def spec_from_mapping(raw: Mapping[str, Any], where: str = "nemesis") -> NemesisSpec:
    """A `[[nemesis]]` table as a validated spec; unknown keys and wrong types refused."""
    if not isinstance(raw, Mapping):
        raise NemesisError(f"{where} must be a table with at least kind = \"...\"")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in _SPEC_FIELDS:
            raise NemesisError(f"unknown key {key!r} in {where}; valid keys: "
                               f"{', '.join(_SPEC_FIELDS)}")
        values[key] = _coerce(where, key, value)
    if "kind" not in values:
        raise NemesisError(f"{where} needs kind = one of {', '.join(NEMESIS_KINDS)}")
    return NemesisSpec(**values).validate()


def _coerce(where: str, key: str, value: Any) -> Any:
    if key in ("kind", "external", "phase", "aim", "until"):
        if not isinstance(value, str):
            raise NemesisError(f"{where}.{key} must be a string (got {value!r})")
        return value
    # A TOML value has the key's own type: "1" is not a number (nor true a count).
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise NemesisError(f"{where}.{key} must be a number (got {value!r})")
    if key == "count":
        if isinstance(value, float) and not value.is_integer():
            raise NemesisError(f"{where}.count must be a whole number (got {value!r})")
        return int(value)
    return float(value)


def shortcut(kinds: str) -> tuple[NemesisSpec, ...]:
    """`--nemesis KIND[,KIND]`: each kind once a second into the load, then every few
    seconds (its default window), on one worker or target."""
    specs = []
    for index, kind in enumerate(k.strip() for k in kinds.split(",")):
        if not kind:
            raise NemesisError("--nemesis expects KIND[,KIND...], e.g. kill_worker,pause_worker")
        # Staggered, so that two kinds do not strike the same worker at the same moment.
        specs.append(NemesisSpec(kind=kind, at=1.0 + 0.7 * index,
                                 interval=DEFAULT_INTERVAL.get(kind, 4.0),
                                 external="skip").validate())
    return tuple(specs)


# Repeat interval of the --nemesis shortcut, per kind (seconds).
DEFAULT_INTERVAL: dict[str, float] = {k.name: k.shortcut_interval for k in BY_NAME.values()}


# --------------------------------------------------------------------------------------------
# The schedule.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PlannedFault:
    """One firing: `kind` at `at` seconds into the load, held `duration` seconds (0 for
    an instantaneous fault), hitting `count` things; `seed` seeds its choices at run time."""

    kind: str
    at: float
    duration: float
    count: int
    probability: float
    external: ExternalPolicy
    seed: int
    phase: PausePhase = "lease"
    aim: Aim = "any"
    until: PauseUntil = "duration"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plan(specs: Sequence[NemesisSpec], *, seed: int, load_seconds: float,
         lease_seconds: float, http_timeout_seconds: float) -> list[PlannedFault]:
    """The schedule: every firing of every spec inside the load phase, in time order.
    Deterministic in (specs, seed, settings). A firing whose coin (its probability) comes up
    tails is left out; the failpoint kinds always fire and use `probability` per job."""
    rng = random.Random(f"nemesis:{seed}")
    planned: list[PlannedFault] = []
    for spec in specs:
        duration = spec.duration or default_duration(spec.kind, lease_seconds=lease_seconds,
                                                      http_timeout_seconds=http_timeout_seconds)
        if spec.phase == "commit" and not spec.duration:
            duration = COMMIT_WINDOW_SECONDS
        at = spec.at
        while at < load_seconds:
            coin = rng.random()
            fault_seed = rng.randrange(2**31)
            if spec.kind in FAILPOINT_KINDS or coin < spec.probability:
                planned.append(PlannedFault(
                    kind=spec.kind, at=round(at, 3), duration=duration, count=spec.count,
                    probability=spec.probability, external=spec.external, seed=fault_seed,
                    phase=spec.phase, aim=spec.aim, until=spec.until,
                ))
            if spec.interval <= 0:
                break
            at += spec.interval
    planned.sort(key=lambda p: (p.at, p.kind))
    return planned


FAILPOINT_KINDS = names_where(lambda k: k.failpoint)
# The window of a commit-phase terminate_backends whose spec gives no duration.
COMMIT_WINDOW_SECONDS = 1.0
# Kinds that need a server the harness started.
OWNED_SERVER_KINDS = names_where(lambda k: k.owned_server)


def default_duration(kind: str, *, lease_seconds: float, http_timeout_seconds: float) -> float:
    """How long a lasting fault is held when the spec does not say: long enough to reach
    the bug it is for (a pause outlives the lease; a hang outlives the HTTP timeout)."""
    found = BY_NAME.get(kind)
    return 0.0 if found is None else found.default_duration(lease_seconds, http_timeout_seconds)


def check_schedule(specs: Sequence[NemesisSpec], *, load_seconds: float,
                   server_owned: bool | None = None) -> None:
    """Refuse a schedule that cannot run as written (NemesisError, one line): a fault that
    starts after the load phase ends, or one needing an owned server on an external DSN
    (when `server_owned` is known and the spec says refuse)."""
    for spec in specs:
        if spec.at >= load_seconds:
            raise NemesisError(
                f"nemesis {spec.kind} starts at {spec.at:g} s but the load phase lasts "
                f"{load_seconds:g} s: lower its 'at' or raise duration"
            )
        if (server_owned is False and spec.kind in OWNED_SERVER_KINDS
                and spec.external == "refuse"):
            raise NemesisError(
                f"nemesis {spec.kind} needs a PostgreSQL the harness starts, but the DSN is "
                "external: drop --dsn (and SKIPLOCK_PG_DSN), or set external = \"skip\""
            )


# --------------------------------------------------------------------------------------------
# What a fault may act on, and what a fault is.
# --------------------------------------------------------------------------------------------


class TargetHandle(Protocol):
    """An echo target as a fault sees it."""

    name: str

    def hang(self, seconds: float) -> None:
        """Hold every request that arrives in the next `seconds`, answering it after."""

    def kill(self) -> None:
        """SIGKILL the target process (connections refused until `restart`)."""

    def restart(self) -> None:
        """Start it again on the same address, resuming from its log."""


@dataclass(frozen=True, kw_only=True)
class HeldLease:
    """An attempt a worker holds now, by its event log: claimed (`claimed_at`, when the claim
    was logged), not yet written or released; `answered` once its HTTP call has ended."""

    worker: str
    job_id: str
    attempt: int
    claimed_at: float
    answered: bool = False


class NemesisContext(Protocol):
    """Everything a fault may act on during a run."""

    run_dir: Path
    # The server's DSN: never print or record it (it may carry a password).
    dsn: str
    schema: str
    # application_name prefix of every connection the system under test's workers open
    # (`LIKE prefix || '%'` finds exactly them, never the harness's own connections).
    app_prefix: str
    server_owned: bool
    lease_seconds: float
    http_timeout_seconds: float
    # The queue's claim is a transaction of its own, ended by a COMMIT statement
    # (`Guarantees.claim_transaction`): where a commit-phase terminate_backends looks.
    claim_transaction: bool

    @property
    def account_limits(self) -> Mapping[str, int | None]:
        """Each account's concurrency limit (None: unlimited), as the scenario declares."""

    def restart_server(self) -> None:
        """Immediate stop and start of the owned server (crash recovery runs)."""

    def targets(self) -> Sequence[TargetHandle]: ...

    def workers_alive(self) -> list[str]:
        """Worker ids of the processes running now."""

    def workers_holding_leases(self) -> list[str]:
        """Worker ids that hold a lease now (claimed, not yet written or released), by their
        event logs; running processes only."""

    def leases_held(self) -> list[HeldLease]:
        """Every attempt held now, as `workers_holding_leases` sees them, one by one."""

    def signal_worker(self, worker_id: str, signum: int) -> None:
        """Send `signum` to that worker's process (no-op if it has exited)."""

    def set_failpoint(self, name: str, probability: float) -> None:
        """Make every worker (and every replacement) fire failpoint `name` with this
        probability per job, from now on."""


class Fault:
    """One fault, applied once. Subclasses set `kind` and implement `apply` (and `heal` for
    lasting ones). `start` returns what was hit (worker ids, target names, "postgres"); one
    FaultEvent is recorded per thing hit."""

    kind: ClassVar[str]

    def __init__(self, ctx: NemesisContext, planned: PlannedFault) -> None:
        self.ctx = ctx
        self.planned = planned
        self.rng = random.Random(planned.seed)
        self.data: dict[str, Any] = {}
        # Set by `apply` when the fault took hold later than it was asked to (a stall found
        # after its failpoint opened): the event's window then starts here.
        self.started_at: float | None = None

    def apply(self) -> list[str | None]:
        raise NotImplementedError

    def heal(self) -> None:
        return None

    def hold(self, stop: threading.Event, seconds: float) -> None:
        """Keep a lasting fault applied: `seconds`, or less when `stop` is set (the load
        ended). A fault whose end is aimed returns as soon as its moment comes."""
        stop.wait(seconds)


FaultFactory = Callable[[NemesisContext, PlannedFault], Fault]
# kind -> class; filled by the modules that define faults (see `registry()`).
_REGISTRY: dict[str, FaultFactory] = {}


def register(cls: type[Fault]) -> type[Fault]:
    _REGISTRY[cls.kind] = cls
    return cls


def registry() -> dict[str, FaultFactory]:
    """Every fault kind with its class: each module of `skiplock.chaos.faults` registers its
    own, so a new kind is a new module there (and its row in `reports/fault_kinds.py`)."""
    # Imported here: they register themselves, and importing them at module level would be
    # circular (they import this module for `Fault` and `register`).
    from skiplock.chaos import faults

    for module in pkgutil.iter_modules(faults.__path__):
        importlib.import_module(f"{faults.__name__}.{module.name}")
    return dict(_REGISTRY)


# --------------------------------------------------------------------------------------------
# Running a schedule.
# --------------------------------------------------------------------------------------------


Recorder = Callable[[FaultEvent], None]


@dataclass(kw_only=True)
class _Active:
    fault: Fault
    hit: list[str | None]
    start: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    healed: bool = False


class ScheduledNemesis:
    """Applies a planned schedule while the load runs (runner's `Nemesis` protocol).

    `start(ctx, load_start)` launches one timer thread; each firing runs on its own thread
    so windows may overlap. `stop()` cancels what has not fired, heals everything active and
    records each event; a fault that raises while applying is recorded as skipped with the
    error, never lost."""

    def __init__(self, planned: Sequence[PlannedFault], record: Recorder,
                 say: Callable[[str], None] | None = None) -> None:
        self.planned = list(planned)
        self._record = record
        self._say = say or (lambda _m: None)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._active: list[_Active] = []
        self._lock = threading.Lock()
        self.applied = 0
        self.skipped = 0

    def start(self, ctx: NemesisContext, load_start: float) -> None:
        factories = registry()
        self._ctx = ctx
        self._factories = factories
        timer = threading.Thread(target=self._timer, args=(load_start,),
                                 name="skiplock-nemesis", daemon=True)
        self._threads.append(timer)
        timer.start()

    def _timer(self, load_start: float) -> None:
        for planned in self.planned:
            if self._stop.wait(max(0.0, load_start + planned.at - time.time())):
                return
            thread = threading.Thread(target=self._fire, args=(planned,),
                                      name=f"skiplock-nemesis-{planned.kind}", daemon=True)
            with self._lock:
                if self._stop.is_set():
                    return
                self._threads.append(thread)
            thread.start()

    def _fire(self, planned: PlannedFault) -> None:
        fault = self._factories[planned.kind](self._ctx, planned)
        start = time.time()
        try:
            hit = fault.apply()
        except FaultSkipped as exc:
            self._skip(fault, start, str(exc))
            return
        except Exception as exc:
            # Healing what may be half-applied comes first; the event still covers it.
            with contextlib.suppress(Exception):
                fault.heal()
            self._skip(fault, start, f"failed: {type(exc).__name__}: {exc}", end=time.time())
            return
        active = _Active(fault=fault, hit=hit,
                         start=start if fault.started_at is None else fault.started_at)
        self._say(f"fault: {planned.kind} on {', '.join(str(h or 'the run') for h in hit)}")
        if planned.duration <= 0:
            with contextlib.suppress(Exception):
                self._close(active)
            return
        with self._lock:
            self._active.append(active)
        try:
            fault.hold(self._stop, planned.duration)
        except Exception as exc:
            # Healed at once (below); the window still covers what it held.
            self._say(f"fault: holding {planned.kind} failed: {type(exc).__name__}: {exc}")
        try:
            self._close(active)
        except Exception as exc:
            # Recorded all the same (see _close); say why the heal failed, once.
            self._say(f"fault: healing {planned.kind} failed: {type(exc).__name__}: {exc}")

    def _skip(self, fault: Fault, start: float, reason: str, end: float | None = None) -> None:
        self.skipped += 1
        self._record(FaultEvent(fault=fault.kind, start=start,
                                end=end if end is not None else start,
                                skipped=reason, data=dict(fault.data)))

    def _close(self, active: _Active) -> None:
        with active.lock:
            if active.healed:
                return
            active.healed = True
            try:
                active.fault.heal()
            finally:
                end = time.time()
                self.applied += 1
                for target in active.hit:
                    self._record(FaultEvent(
                        fault=active.fault.kind,
                        start=active.start, end=end, target=target,
                        data=dict(active.fault.data),
                    ))
        with self._lock, contextlib.suppress(ValueError):
            self._active.remove(active)

    def stop(self) -> None:
        """Heal everything now; nothing fires after this returns."""
        with self._lock:
            self._stop.set()
            active = list(self._active)
        for item in active:
            with contextlib.suppress(Exception):
                self._close(item)
        for thread in list(self._threads):
            thread.join(timeout=30.0)
