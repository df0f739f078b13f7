"""Service-level objectives a scenario declares in its `[objectives]` table, and the fairness
bound the checker's `starvation` uses: the one place their names, units and checks live.

The scenario file, `--set objectives.KEY=VALUE` on `run`, `gate` and `check`, spec.json and
the checker all read them through `Objectives.from_mapping` and `with_overrides`, so a key is
spelled and validated once:

    [objectives]
    first_delivery_p99 = 2.0          # seconds, enqueue -> first delivery, every account
    starvation_wait = 3.0             # seconds a due job may wait while later jobs are taken

    [objectives.account.small-a]      # the same latency keys, for one account
    first_delivery_p99 = 1.0

    [objectives.during_faults]        # bounds for the windows a fault covers (else unjudged)
    first_delivery_p99 = 10.0

Every objective is judged from the recorded history, like every other property: a miss is
the anomaly `objective_missed`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class ObjectiveError(ValueError):
    """An objective that cannot be judged as written: one line saying what to fix."""


@dataclass(frozen=True)
class Metric:
    key: str
    meaning: str
    # "max": the measured value must not exceed the bound; "min": must not fall below it.
    sense: str
    unit: str  # "s" or "" (a ratio)


# What an objective may bound, in the order the verdict reports them.
METRICS: tuple[Metric, ...] = (
    Metric("first_delivery_p50", "median wait from enqueue to first delivery", "max", "s"),
    Metric("first_delivery_p99", "99th percentile wait from enqueue to first delivery",
           "max", "s"),
    Metric("oldest_due_age", "the longest a due job waited for its first delivery "
           "(the oldest due job's age at its worst)", "max", "s"),
    Metric("delivered_ratio", "first deliveries ÷ jobs offered over the load "
           "(below 1: the queue fell behind)", "min", ""),
)
BY_KEY: dict[str, Metric] = {m.key: m for m in METRICS}
# The starvation bound is a setting of its own (not a measured objective): seconds.
STARVATION_KEY = "starvation_wait"
# Unset: twice the lease. A job whose claim was lost with its worker or its connection waits
# out one lease before recovery hands it on; twice that is never the reference's doing.
STARVATION_LEASES = 2.0

Bounds = Mapping[str, float]


@dataclass(frozen=True)
class Objectives:
    """`overall`: bounds over every account; `accounts`: per account; `during_faults`:
    bounds for jobs whose wait a fault's window covers (they are left out of the others).
    `starvation_wait`: None means STARVATION_LEASES leases."""

    overall: Bounds = field(default_factory=dict)
    accounts: Mapping[str, Bounds] = field(default_factory=dict)
    during_faults: Bounds = field(default_factory=dict)
    starvation_wait: float | None = None

    def __bool__(self) -> bool:
        return bool(self.overall or self.accounts or self.during_faults
                    or self.starvation_wait is not None)

    def starvation_bound(self, lease_seconds: float) -> float:
        return (self.starvation_wait if self.starvation_wait is not None
                else STARVATION_LEASES * lease_seconds)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.overall)
        if self.starvation_wait is not None:
            out[STARVATION_KEY] = self.starvation_wait
        if self.accounts:
            out["account"] = {name: dict(b) for name, b in self.accounts.items()}
        if self.during_faults:
            out["during_faults"] = dict(self.during_faults)
        return out

    def flat(self) -> dict[str, float]:
        """Every bound as `--set objectives.KEY=VALUE` names its KEY."""
        out = dict(self.overall)
        if self.starvation_wait is not None:
            out[STARVATION_KEY] = self.starvation_wait
        for name, bounds in self.accounts.items():
            out.update({f"account.{name}.{k}": v for k, v in bounds.items()})
        out.update({f"during_faults.{k}": v for k, v in self.during_faults.items()})
        return out

    @classmethod
    def from_mapping(cls, raw: Any, where: str = "objectives") -> Objectives:
        """From a TOML table or spec.json; ObjectiveError names the key to fix."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise ObjectiveError(f"{where} must be a table, e.g. [objectives] "
                                 "first_delivery_p99 = 2.0")
        overall: dict[str, float] = {}
        accounts: dict[str, dict[str, float]] = {}
        during: dict[str, float] = {}
        starvation: float | None = None
        for key, value in raw.items():
            if key == "account":
                if not isinstance(value, Mapping):
                    raise ObjectiveError(f"{where}.account must be a table of accounts, e.g. "
                                         "[objectives.account.acme]")
                for name, bounds in value.items():
                    accounts[str(name)] = _bounds(bounds, f"{where}.account.{name}")
            elif key == "during_faults":
                during = _bounds(value, f"{where}.during_faults")
            elif key == STARVATION_KEY:
                starvation = _number(value, f"{where}.{key}", "s")
            else:
                overall.update(_bounds({key: value}, where))
        return cls(overall, accounts, during, starvation)

    def with_overrides(self, overrides: Sequence[tuple[str, str]]) -> Objectives:
        """Apply `(key, text)` pairs, key as after `objectives.`: `first_delivery_p99`,
        `account.NAME.first_delivery_p99`, `during_faults.oldest_due_age`,
        `starvation_wait`."""
        raw = self.to_json()
        for key, text in overrides:
            value = _text_number(text, f"objectives.{key}")
            head, _, rest = key.partition(".")
            if head == "account":
                name, dot, metric = rest.rpartition(".")
                if not dot or not name:
                    raise ObjectiveError(f"objectives.{key}: write objectives.account.NAME."
                                         f"METRIC (metrics: {', '.join(BY_KEY)})")
                raw.setdefault("account", {}).setdefault(name, {})[metric] = value
            elif head == "during_faults" and rest:
                raw.setdefault("during_faults", {})[rest] = value
            else:
                raw[key] = value
        return Objectives.from_mapping(raw)


def _bounds(raw: Any, where: str) -> dict[str, float]:
    if not isinstance(raw, Mapping):
        raise ObjectiveError(f"{where} must be a table of metric = bound")
    out: dict[str, float] = {}
    for key, value in raw.items():
        metric = BY_KEY.get(str(key))
        if metric is None:
            valid = ", ".join([*BY_KEY, STARVATION_KEY, "account.NAME", "during_faults"])
            raise ObjectiveError(f"unknown objective {where}.{key}; valid: {valid}")
        out[metric.key] = _number(value, f"{where}.{key}", metric.unit)
    return out


def _number(value: Any, where: str, unit: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ObjectiveError(f"{where} must be a finite number (got {value!r:.40})")
    number = float(value)
    if unit == "s" and number <= 0:
        raise ObjectiveError(f"{where} must be a positive number of seconds (got {number:g})")
    if unit == "" and not 0 < number <= 1:
        raise ObjectiveError(f"{where} must be a ratio above 0 and at most 1 (got {number:g})")
    return number


def _text_number(text: str, where: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ObjectiveError(f"{where} must be a number (got {text.strip()!r:.40})") from None


def split_overrides(overrides: Sequence[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """`--set` items that name an objective (`objectives.KEY=VALUE`, as `(KEY, VALUE)`), and
    the others, in order."""
    mine: list[tuple[str, str]] = []
    rest: list[str] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        head, dot, sub = key.strip().partition(".")
        if sep and dot and head == "objectives" and sub:
            mine.append((sub, value))
        else:
            rest.append(item)
    return mine, rest
