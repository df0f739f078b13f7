"""Scenario specs: a small declarative TOML file, resolved, overridden and validated.

A spec names the load (rate, producers, duration), the system under test's settings (workers,
batch, lease, HTTP timeout, retry policy), the accounts with their concurrency limits, and the
mix of job scripts. Every scalar is a top-level key; `accounts` and `mix` are tables. The same
keys are overridable from the command line (`--set key=value`, `--set mix.slow=2`), so a
scenario file and a command line mean the same thing.

A TOML file's values must have their key's own type (`recovery = "yes"` is a string, not a
boolean; `name = 5` is a number, not a name); `--set` values are text and are converted
("true"/"false", numbers). Bad input (unknown keys, impossible values, a file that is empty or
not UTF-8) raises `SpecError` with one line saying what to fix; the CLI turns it into exit
code 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import re
import shlex
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skiplock.chaos.nemesis import NemesisError, NemesisSpec, check_schedule, spec_from_mapping
from skiplock.queue_impl.config import WorkerSettings
from skiplock.reports.history import Behaviour, JobScript, Step
from skiplock.reports.objectives import ObjectiveError, Objectives, split_overrides

SPECS_DIR = Path(__file__).parent.parent / "specs"


class SpecError(ValueError):
    """A scenario that cannot run as written: one line that says what to fix."""


# Script names a mix may use, and what each means (docs/reference/scenario-files.md).
SCRIPT_NAMES: tuple[str, ...] = (
    "succeed",
    "fail_then_succeed",
    "always_400",
    "always_fail",
    "slow",
    "slow_then_slower",
    "hang_then_late",
    "hang_forever",
    "reset",
    "always_hang",
)
FAILPOINT_NAMES: tuple[str, ...] = ("crash_after_claim", "crash_after_http")

# A scenario's name is part of its run directory's name: one plain file-name part.
NAME_MAX = 64
_NAME = re.compile(rf"^[A-Za-z0-9_-][A-Za-z0-9._-]{{0,{NAME_MAX - 1}}}$")


@dataclass(frozen=True, kw_only=True)
class ScenarioSpec:
    """A resolved scenario. Times are seconds; `rate` 0 means closed loop (each producer user
    enqueues again as soon as its last enqueue returned)."""

    name: str
    description: str = ""
    # Phases: warm-up (producers ramp up), load (full rate), drain (no new jobs; wait until
    # every job is terminal, bounded by drain_timeout).
    warmup: float = 1.0
    duration: float = 10.0
    drain_timeout: float = 30.0
    # Producers.
    rate: float = 50.0
    producers: int = 1
    users: int = 4
    enqueue_batch: int = 1
    distributed: bool = False
    # Workers (the system under test): how many, then their settings, each the scenario key
    # of a `WorkerSettings` field (`worker_settings`; a test holds the two equal). The
    # defaults are a short scenario's, not a production worker's.
    workers: int = 2
    batch: int = 10
    lease: float = 10.0
    http_timeout: float = 2.0
    write_margin: float = 2.0
    poll: float = 0.5
    recovery: bool = True
    recovery_interval: float = 0.5
    renew_leases: bool = True
    # Refill freed slots while other calls run; false: the batch barrier (docs/reference/cli.md).
    refill: bool = True
    # Refill, busy: how long results may gather before they are written (0: each at once).
    write_gather: float = 0.01
    # Refill: leases a worker may hold beyond its batch of calls, claimed ahead (0: none).
    claim_ahead: int = 10
    unsafe_timing: bool = False
    # Retry policy and the oracle's max_attempts.
    retry_base: float = 0.2
    retry_cap: float = 2.0
    retry_jitter: float = 0.5
    max_attempts: int = 4
    # Script parameters.
    fail_times: int = 2
    fail_status: int = 503
    slow_seconds: float = 0.2
    # 0 means "the HTTP timeout plus half a second": late, but not by much.
    hang_seconds: float = 0.0
    # account id -> concurrency limit; None (written "unlimited") means no limit, so only the
    # row locks keep two workers off one of its jobs.
    accounts: Mapping[str, int | None] = field(default_factory=lambda: {"acme": 4})
    # script name -> weight
    mix: Mapping[str, float] = field(default_factory=lambda: {"succeed": 1.0})
    # account id -> share of the jobs (default: every account alike); a noisy neighbour is
    # one account with most of the weight.
    account_mix: Mapping[str, float] = field(default_factory=dict)
    # dispatcher failpoint name -> probability per attempt (the worker dies when one fires)
    failpoints: Mapping[str, float] = field(default_factory=dict)
    # The fault schedule: `[[nemesis]]` entries (skiplock.chaos.nemesis.NemesisSpec), seeded by the
    # run's seed, applied during the load phase and healed before the drain.
    nemesis: tuple[NemesisSpec, ...] = ()
    # Latency, throughput and fairness objectives the checker judges (`[objectives]`,
    # skiplock.reports.objectives).
    objectives: Objectives = field(default_factory=Objectives)
    # Seconds between healing the last fault and the drain, with the load stopped, so that
    # recovery (leases expiring, workers replaced) happens before the drain is timed.
    quiesce: float = 0.0
    # Replace a worker process that dies (killed, crashed at a failpoint), as a supervisor
    # would in production; the replacement's `start` event names the worker it replaces.
    supervise: bool = True
    restart_delay: float = 0.5

    # ---------------------------------------------------------------------------------------

    def validate(self) -> ScenarioSpec:
        """Refuse values that cannot run; returns self so calls chain.

        The checks run in a fixed order, so when several values are wrong the same one is
        reported first every time (the first problem found is the one the message names)."""
        self._check_name()
        self._check_finite()
        self._check_signs()
        self._check_retry_policy()
        self._check_timing()
        if not 100 <= self.fail_status <= 599:
            raise SpecError(f"fail_status must be an HTTP status (got {self.fail_status})")
        self._check_accounts()
        self._check_mix_scripts()
        self._check_account_mix()
        self._check_failpoints()
        self._check_nemesis()
        self._check_objectives()
        if sum(self.mix.values()) <= 0:
            raise SpecError("mix weights sum to 0: give at least one script a positive weight")
        return self

    def _check_name(self) -> None:
        """The name becomes part of the run directory's name: one plain file-name part."""
        if not _NAME.match(self.name):
            raise SpecError(
                f"name {self.name!r} cannot name a run directory: use letters, digits, '-',"
                f" '_' and '.' (not first), at most {NAME_MAX} characters (name = \"...\" in"
                " the scenario file, or --set name=...)"
            )

    def _check_finite(self) -> None:
        """Refuse NaN and infinities anywhere, scalars first, then each table's values."""
        # NaN passes every comparison in the later checks (all of them are False), and an
        # infinite duration or lease never ends: refuse both before anything else.
        numbers: list[tuple[str, object]] = [
            (f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
            if f.name not in _TABLES
        ]
        for table in _TABLES:
            numbers += [(f"{table}.{k}", v) for k, v in getattr(self, table).items()]
        for key, value in numbers:
            if (isinstance(value, float | int) and not isinstance(value, bool)
                    and not math.isfinite(value)):
                raise SpecError(f"{key} must be a finite number (got {value})")

    def _check_signs(self) -> None:
        """Counts and intervals that must be positive, then those that may also be zero."""
        positive = {
            "duration": self.duration,
            "drain_timeout": self.drain_timeout,
            "producers": self.producers,
            "users": self.users,
            "enqueue_batch": self.enqueue_batch,
            "workers": self.workers,
            "batch": self.batch,
            "lease": self.lease,
            "http_timeout": self.http_timeout,
            "poll": self.poll,
            "recovery_interval": self.recovery_interval,
            "max_attempts": self.max_attempts,
            "fail_times": self.fail_times,
        }
        for key, value in positive.items():
            if value <= 0:
                raise SpecError(f"{key} must be positive (got {value})")
        non_negative = {
            "warmup": self.warmup,
            "rate": self.rate,
            "write_margin": self.write_margin,
            "write_gather": self.write_gather,
            "claim_ahead": self.claim_ahead,
            "retry_base": self.retry_base,
            "slow_seconds": self.slow_seconds,
            "hang_seconds": self.hang_seconds,
            "quiesce": self.quiesce,
            "restart_delay": self.restart_delay,
        }
        for key, value in non_negative.items():
            if value < 0:
                raise SpecError(f"{key} must not be negative (got {value})")

    def _check_retry_policy(self) -> None:
        if self.retry_cap < self.retry_base:
            raise SpecError(
                f"retry_cap ({self.retry_cap}) must be at least retry_base ({self.retry_base})"
            )
        if not 0.0 <= self.retry_jitter <= 1.0:
            raise SpecError(f"retry_jitter must be between 0 and 1 (got {self.retry_jitter})")

    def _check_timing(self) -> None:
        """A call plus its result write must fit in the lease, or a second worker may claim a
        job whose first call is still running (allowed only with unsafe_timing)."""
        if not self.unsafe_timing and self.http_timeout + self.write_margin >= self.lease:
            raise SpecError(
                f"http_timeout + write_margin ({self.http_timeout} + {self.write_margin}) must be"
                f" shorter than lease ({self.lease}): raise lease, or set unsafe_timing=true"
            )

    def _check_accounts(self) -> None:
        if not self.accounts:
            raise SpecError("accounts is empty: give at least one, e.g. --set accounts.acme=4")
        for account, limit in self.accounts.items():
            if limit is not None and limit <= 0:
                raise SpecError(f"accounts.{account} limit must be positive (got {limit})")

    def _check_mix_scripts(self) -> None:
        """Each mix entry names a known script with a weight of at least 0 (the weights'
        sum is checked last, in `validate`)."""
        for script, weight in self.mix.items():
            if script not in SCRIPT_NAMES:
                raise SpecError(
                    f"unknown script {script!r} in mix; valid: {', '.join(SCRIPT_NAMES)}"
                )
            if weight < 0:
                raise SpecError(f"mix.{script} weight must not be negative (got {weight})")

    def _check_account_mix(self) -> None:
        for account, weight in self.account_mix.items():
            if account not in self.accounts:
                raise SpecError(f"account_mix.{account}: no such account in [accounts]")
            if weight < 0:
                raise SpecError(f"account_mix.{account} weight must not be negative "
                                f"(got {weight})")
        if self.account_mix and sum(self.account_weights()) <= 0:
            raise SpecError("account_mix weights sum to 0: give an account a positive weight")

    def _check_failpoints(self) -> None:
        for point, probability in self.failpoints.items():
            if point not in FAILPOINT_NAMES:
                raise SpecError(
                    f"unknown failpoint {point!r}; valid: {', '.join(FAILPOINT_NAMES)}"
                )
            if not 0.0 <= probability <= 1.0:
                raise SpecError(f"failpoints.{point} must be between 0 and 1 (got {probability})")

    def _check_nemesis(self) -> None:
        """Each `[[nemesis]]` entry on its own, then that crash failpoints are not given both
        ways at once."""
        for entry in self.nemesis:
            try:
                entry.validate()
                check_schedule([entry], load_seconds=self.duration)
            except NemesisError as exc:
                raise SpecError(str(exc)) from None
        if self.failpoints and self.nemesis and any(
                n.kind in FAILPOINT_NAMES for n in self.nemesis):
            raise SpecError("give crash failpoints either as [failpoints] or as [[nemesis]]"
                            " entries, not both")

    # ---------------------------------------------------------------------------------------

    def _check_objectives(self) -> None:
        for account in self.objectives.accounts:
            if account not in self.accounts:
                raise SpecError(f"objectives.account.{account}: no such account in [accounts]")

    def worker_settings(self) -> WorkerSettings:
        """The workers' settings this scenario gives, read by their scenario keys."""
        return WorkerSettings.from_scenario(lambda key: getattr(self, key))

    def account_limits(self) -> dict[str, int | None]:
        return {account: limit for account, limit in self.accounts.items()}

    def account_weights(self) -> list[float]:
        """Each account's share, in sorted account order (unnamed accounts weigh 1)."""
        return [float(self.account_mix.get(a, 1.0)) for a in sorted(self.accounts)]

    def account_shares(self) -> dict[str, float]:
        """Each account's fraction of the jobs (its weight over all of them)."""
        weights = self.account_weights()
        total = sum(weights)  # positive in a valid spec (`_check_account_mix`)
        return {a: w / total if total > 0 else 0.0
                for a, w in zip(sorted(self.accounts), weights, strict=True)}

    def effective_hang_seconds(self) -> float:
        return self.hang_seconds if self.hang_seconds > 0 else self.http_timeout + 0.5

    def scripts(self) -> dict[str, JobScript]:
        """The named scripts of the mix, built with this spec's parameters."""
        ok = Step(behaviour=Behaviour.OK)
        built = {
            "succeed": JobScript(name="succeed", first=ok),
            "fail_then_succeed": JobScript(
                name="fail_then_succeed",
                first=Step(behaviour=Behaviour.STATUS, status=self.fail_status),
                times=self.fail_times,
            ),
            "always_400": JobScript(
                name="always_400", first=Step(behaviour=Behaviour.STATUS, status=400)
            ),
            "always_fail": JobScript(
                name="always_fail",
                first=Step(behaviour=Behaviour.STATUS, status=self.fail_status),
            ),
            "slow": JobScript(
                name="slow", first=Step(behaviour=Behaviour.SLOW, seconds=self.slow_seconds)
            ),
            # A job delivered again (its lease passed on) answers twice as slowly, so the new
            # holder's call is still running when the worker that lost the lease writes.
            "slow_then_slower": JobScript(
                name="slow_then_slower",
                first=Step(behaviour=Behaviour.SLOW, seconds=self.slow_seconds), times=1,
                then=Step(behaviour=Behaviour.SLOW, seconds=2 * self.slow_seconds),
            ),
            "hang_then_late": JobScript(
                name="hang_then_late",
                first=Step(behaviour=Behaviour.HANG, seconds=self.effective_hang_seconds()),
                times=1,
            ),
            "hang_forever": JobScript(
                name="hang_forever", first=Step(behaviour=Behaviour.HANG_FOREVER), times=1
            ),
            "reset": JobScript(name="reset", first=Step(behaviour=Behaviour.RESET), times=1),
            # Every attempt held for the whole HTTP timeout, then dead-lettered: a last
            # attempt a fault can find in flight (exhaust-attempts' aimed kill).
            "always_hang": JobScript(
                name="always_hang", first=Step(behaviour=Behaviour.HANG_FOREVER)
            ),
        }
        return {name: built[name] for name in self.mix if self.mix[name] > 0}

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["accounts"] = dict(self.accounts)
        out["mix"] = dict(self.mix)
        out["failpoints"] = dict(self.failpoints)
        out["account_mix"] = dict(self.account_mix)
        out["nemesis"] = [entry.to_json() for entry in self.nemesis]
        out["objectives"] = self.objectives.to_json()
        return out


@dataclass(frozen=True, kw_only=True)
class Chooser:
    """Seeded choice of script and account for each job: a run with the same seed draws the
    same sequence in each producer user."""

    scripts: Sequence[JobScript]
    weights: Sequence[float]
    accounts: Sequence[str]
    account_weights: Sequence[float]
    rng: random.Random

    @classmethod
    def for_spec(cls, spec: ScenarioSpec, seed: int, stream: str) -> Chooser:
        scripts = spec.scripts()
        return cls(
            scripts=list(scripts.values()),
            weights=[spec.mix[name] for name in scripts],
            accounts=sorted(spec.accounts),
            account_weights=spec.account_weights(),
            # A string seed is hashed deterministically (sha512), unlike hash().
            rng=random.Random(f"{seed}:{stream}"),
        )

    def next(self) -> tuple[JobScript, str]:
        script = self.rng.choices(self.scripts, weights=self.weights, k=1)[0]
        account = self.rng.choices(self.accounts, weights=self.account_weights, k=1)[0]
        return script, account


# --------------------------------------------------------------------------------------------
# Loading, overriding.
# --------------------------------------------------------------------------------------------

_FIELDS = {f.name: f for f in dataclasses.fields(ScenarioSpec)}
_TABLES = ("accounts", "mix", "failpoints", "account_mix")
SCALAR_KEYS: tuple[str, ...] = tuple(k for k in _FIELDS
                                     if k not in (*_TABLES, "nemesis", "objectives"))
UNLIMITED = "unlimited"


def _valid_keys() -> str:
    return ", ".join([*SCALAR_KEYS, "accounts.<id>", "account_mix.<id>", "mix.<script>",
                      "failpoints.<name>", "[[nemesis]]", "objectives.<key>"])


def available() -> list[str]:
    return sorted(p.stem for p in SPECS_DIR.glob("*.toml"))


def _not_a_file(path: Path) -> str:
    """Why a path is not a scenario file, as the user should hear it."""
    if not path.exists() and not path.is_symlink():
        return "not found"
    if path.is_dir():
        return "is a directory; give a .toml file"
    if path.is_symlink() and not path.exists():
        return "is a broken symlink"
    return "is not a regular file (a FIFO or a device); give a .toml file"


def resolve_path(scenario: str) -> Path:
    """A name in scenarios/specs, or a path to a .toml file."""
    candidate = Path(scenario)
    if candidate.suffix == ".toml" or "/" in scenario:
        try:
            found = candidate.is_file()
            what = None if found else _not_a_file(candidate)
        except OSError as exc:  # a name too long to look up, a folder it may not enter
            raise SpecError(f"scenario file {scenario}: {exc.strerror or exc}") from None
        if not found:
            raise SpecError(f"scenario file {scenario} {what}")
        return candidate
    named = SPECS_DIR / f"{scenario}.toml"
    try:
        found = named.is_file()
    except OSError:  # no shipped scenario has a name too long to look up
        found = False
    if not found:
        raise SpecError(
            f"unknown scenario {scenario!r}; available: {', '.join(available())},"
            " or a path to a .toml file"
        )
    return named


def _type_name(kind: Any) -> str:
    return kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))


# How a wrong TOML type is described: the value's own TOML type, by Python type.
_TOML_TYPES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
               list: "an array", dict: "a table"}
_EXPECTED = {"bool": "true or false (a TOML boolean)", "int": "a whole number",
             "float": "a number", "str": "a string"}


def _check_toml_type(key: str, value: Any, kind: Any) -> None:
    """A TOML value must already have the key's type: no string for a boolean or a number,
    no number for a name. (A float key takes an integer: `duration = 10` means 10.0.)"""
    name = _type_name(kind)
    ok = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, int | float) and not isinstance(value, bool),
        "str": isinstance(value, str),
    }.get(name, True)
    if not ok:
        given = _TOML_TYPES.get(type(value), type(value).__name__)
        hint = f" (write {key} = {value})" if name != "str" and isinstance(value, str) \
            and _looks_like(name, value) else ""
        raise SpecError(f"{key} must be {_EXPECTED.get(name, name)}, not {given}"
                        f" ({value!r}){hint}")


def _looks_like(name: str, text: str) -> bool:
    """Whether a quoted TOML string is the value unquoted (`"true"`, `"4"`): the fix to say."""
    if name == "bool":
        return text in ("true", "false")
    try:
        float(text)
    except ValueError:
        return False
    return name == "float" or text.strip().lstrip("+-").isdigit()


def _coerce(key: str, value: Any, kind: Any, *, strict: bool = False) -> Any:
    """A value as the field's type. `strict` (TOML, JSON): it must have that type already;
    otherwise (a command-line string) it is converted."""
    name = _type_name(kind)
    if strict:
        _check_toml_type(key, value, kind)
    try:
        if name == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("true", "1", "yes", "on"):
                return True
            if text in ("false", "0", "no", "off"):
                return False
            raise ValueError(value)
        if isinstance(value, bool):
            raise ValueError(value)
        if name == "int":
            number = float(value)
            if not math.isfinite(number):
                raise SpecError(f"{key} must be a finite number (got {value!r})")
            if number != int(number):
                raise ValueError(value)
            return int(number)
        if name == "float":
            return float(value)
        if name == "str":
            return str(value)
    except SpecError:
        raise
    except (TypeError, ValueError, OverflowError):
        raise SpecError(f"{key} must be a {name} (got {value!r})") from None
    raise SpecError(f"{key} has an unsupported type {name}")


def from_mapping(raw: Mapping[str, Any], *, default_name: str = "custom") -> ScenarioSpec:
    """Build a spec from a parsed TOML (or spec.json) document; unknown keys are refused, and
    every value must have its key's type."""
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _TABLES:
            if not isinstance(value, Mapping):
                raise SpecError(f"{key} must be a table of name = number")
            values[key] = {str(k): _table_value(key, str(k), v, strict=True)
                           for k, v in value.items()}
        elif key == "nemesis":
            values[key] = _nemesis_entries(value)
        elif key == "objectives":
            try:
                values[key] = Objectives.from_mapping(value)
            except ObjectiveError as exc:
                raise SpecError(str(exc)) from None
        elif key in _FIELDS:
            values[key] = _coerce(key, value, _FIELDS[key].type, strict=True)
        else:
            raise SpecError(f"unknown key {key!r} in scenario; valid keys: {_valid_keys()}")
    values.setdefault("name", default_name)
    return ScenarioSpec(**values)


def _table_value(table: str, key: str, value: Any, *, strict: bool = False) -> Any:
    """One entry of `accounts`, `mix` or `failpoints`; an account may be "unlimited"."""
    if table == "accounts":
        # None: the same spec read back from spec.json (JSON null).
        if value is None or (isinstance(value, str) and value.strip().lower() == UNLIMITED):
            return None
        if strict and (isinstance(value, bool) or not isinstance(value, int)):
            raise SpecError(f"{table}.{key} must be a whole number or \"{UNLIMITED}\","
                            f" not {_TOML_TYPES.get(type(value), type(value).__name__)}"
                            f" ({value!r})")
        try:
            return _coerce(f"{table}.{key}", value, "int")
        except SpecError:
            raise SpecError(f"{table}.{key} must be a positive whole number or "
                            f"\"{UNLIMITED}\" (got {value!r})") from None
    return _coerce(f"{table}.{key}", value, "float", strict=strict)


def _nemesis_entries(value: Any) -> tuple[NemesisSpec, ...]:
    if not isinstance(value, list):
        raise SpecError("nemesis must be an array of tables: [[nemesis]] kind = \"...\"")
    try:
        return tuple(spec_from_mapping(entry, f"nemesis[{i}]") for i, entry in enumerate(value))
    except NemesisError as exc:
        raise SpecError(str(exc)) from None


def apply_overrides(spec: ScenarioSpec, overrides: Sequence[str]) -> ScenarioSpec:
    """Apply `key=value` strings (`mix.slow=2`, `accounts.acme=4`, `workers=3`)."""
    changes: dict[str, Any] = {}
    tables = {t: dict(getattr(spec, t)) for t in _TABLES}
    objective_overrides, overrides = split_overrides(overrides)
    if objective_overrides:
        try:
            changes["objectives"] = spec.objectives.with_overrides(objective_overrides)
        except ObjectiveError as exc:
            raise SpecError(str(exc)) from None
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SpecError(f"--set expects key=value (got {item!r})")
        table, dot, sub = key.partition(".")
        if dot and table in _TABLES and sub:
            tables[table][sub] = _table_value(table, sub, value.strip())
            changes[table] = tables[table]
        elif key in SCALAR_KEYS:
            changes[key] = _coerce(key, value.strip(), _FIELDS[key].type)
        else:
            raise SpecError(f"unknown key {key!r}; valid keys: {_valid_keys()}")
    return dataclasses.replace(spec, **changes)


def read_document(path: Path) -> dict[str, Any]:
    """A scenario file's TOML document; SpecError if it cannot be read, is not UTF-8 text,
    is not TOML, or holds no key at all (it would silently run every default)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SpecError(f"cannot read scenario file {path}: {exc.strerror}") from None
    try:
        # TOML is UTF-8; a leading byte-order mark is tolerated.
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise SpecError(
            f"scenario file {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} on line"
            f" {line}): save it as UTF-8"
        ) from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path} is not valid TOML ({exc})") from None
    if not raw:
        raise SpecError(
            f"scenario file {path} is empty: give the keys to change from the defaults"
            f" (e.g. duration = 10), or name a shipped scenario ({', '.join(available())})"
        )
    return raw


def load(scenario: str, overrides: Sequence[str] = ()) -> ScenarioSpec:
    """Resolve, parse, override and validate a scenario."""
    path = resolve_path(scenario)
    spec = from_mapping(read_document(path), default_name=path.stem)
    return apply_overrides(spec, overrides).validate()


def replay_command(spec: ScenarioSpec, *, seed: int, backend: str, sql_path: str | None,
                   command: Sequence[str] | None = None,
                   base: ScenarioSpec | None = None,
                   backend_options: Sequence[tuple[str, str]] = (),
                   dsn: str | None = None) -> str:
    """The command line that runs `spec` again with the same seed: `command` (by default
    `skiplock run` and the shipped scenario `spec` is named after) plus `--set` for every key
    that differs from `base` (by default that shipped scenario). A fault schedule that
    differs cannot be written as `--set`: the command says so. A `dsn` given on the command
    line is named too, its password shown as `***` (type it again to replay)."""
    shipped = spec.name in available()
    words = list(command or ["skiplock", "run",
                             spec.name if shipped else f"{spec.name}.toml"])
    words += ["--seed", str(seed)]
    if backend != "pg":
        words += ["--backend", backend]
    if sql_path:
        words += ["--sql", sql_path]
    from skiplock.queue_impl.plugins import redact, shown_options

    for key, value in shown_options(tuple(backend_options)).items():
        words += ["--backend-opt", f"{key}={value}"]
    if base is None and shipped:
        with contextlib.suppress(SpecError):
            base = load(spec.name)
    note = "" if base is None else _set_differences(spec, base, words)
    if dsn:
        words += ["--dsn", redact(dsn)]
    return shlex.join(words) + note


def _set_differences(spec: ScenarioSpec, base: ScenarioSpec, words: list[str]) -> str:
    """Append `--set` for every key of `spec` that differs from `base`; returns a note for
    what `--set` cannot say (a table's key removed, another fault schedule)."""
    for key in SCALAR_KEYS:
        value = getattr(spec, key)
        if value != getattr(base, key) and key not in ("name", "description"):
            text = str(value).lower() if isinstance(value, bool) else str(value)
            words += ["--set", f"{key}={text}"]
    for table in _TABLES:
        ours, theirs = dict(getattr(spec, table)), dict(getattr(base, table))
        for sub, value in ours.items():
            if theirs.get(sub, object()) != value:
                shown = "unlimited" if value is None else value
                words += ["--set", f"{table}.{sub}={shown}"]
        if set(theirs) - set(ours):
            return f"  # and without {table} {sorted(set(theirs) - set(ours))}"
    theirs_objectives = base.objectives.flat()
    for sub, bound in spec.objectives.flat().items():
        if theirs_objectives.get(sub) != bound:
            words += ["--set", f"objectives.{sub}={bound:g}"]
    if set(theirs_objectives) - set(spec.objectives.flat()):
        return "  # with the objectives recorded in spec.json"
    if spec.nemesis != base.nemesis:
        return "  # with the fault schedule recorded in spec.json (nemesis)"
    return ""
