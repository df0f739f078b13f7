"""run.json and spec.json: the configuration the oracle is built from (`RunConfig`), refused
when a setting is missing, of the wrong type or not finite."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast, get_args

from skiplock.queue_impl.interface import REFERENCE_GUARANTEES, Guarantees, LeaseKind
from skiplock.queue_impl.retry import RetryPolicy
from skiplock.reports.history import (
    SPEC_FILE,
    HistoryError,
    read_json,
)
from skiplock.reports.objectives import ObjectiveError, Objectives


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What the checker takes from run.json: the configuration the oracle is built from."""

    drained: bool
    exit_reason: str
    http_timeout_seconds: float
    lease_seconds: float
    retry: RetryPolicy
    account_limits: dict[str, int | None]
    # Rows the runner's final snapshot had (None: not recorded, completeness unknown).
    final_jobs: int | None = None
    # Whether the queue's server was durable (fsync, full page writes, synchronous commit);
    # None when neither run.json nor spec.json says, which is judged as durable.
    durable: bool | None = None
    # The system under test's name (run.json `backend`), "" when not recorded.
    backend: str = ""
    # What the queue promises (spec.json `guarantees`; the reference's when not recorded).
    guarantees: Guarantees = REFERENCE_GUARANTEES
    # When the load started (epoch seconds): the warm-up's start in spec.json, else run.json
    # `started`; the origin of every time the verdict says. None when neither is recorded.
    time_origin: float | None = None
    # The scenario's objectives (spec.json `scenario.objectives`, or `check --set`).
    objectives: Objectives = field(default_factory=Objectives)
    # The load phase (warm-up start to load end, epoch seconds); None when not recorded.
    load_window: tuple[float, float] | None = None
    # How the queue's lease runs (spec.json `lease`): "renewal" (from the claim or renewal
    # as recorded), or "heartbeat" (`HeartbeatLease`: from when each was sent).
    lease_kind: LeaseKind = "renewal"


def _durability(raw: dict[str, Any], spec: dict[str, Any], path: Path) -> bool | None:
    """run.json's `durable`, else spec.json's `postgres.harness.durable`, else None. A value
    there that is not true, false or null is bad input: guessed, it would change what a
    server restart explains."""
    if raw.get("durable") is not None:
        if not isinstance(raw["durable"], bool):
            raise HistoryError(f"{path}: durable must be true, false or null")
        return bool(raw["durable"])
    postgres = spec.get("postgres")
    harness = postgres.get("harness") if isinstance(postgres, dict) else None
    if isinstance(harness, dict) and harness.get("durable") is not None:
        if not isinstance(harness["durable"], bool):
            raise HistoryError(f"{path.with_name(SPEC_FILE)}: postgres.harness.durable must be "
                               "true, false or null")
        return bool(harness["durable"])
    return None


def _seconds(path: Path, raw: dict[str, Any], key: str) -> float:
    """A setting of run.json that is a number of seconds (or a fraction): a JSON number
    that is finite, else bad input."""
    value = raw[key]
    number = math.nan
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer too large for a float
            number = math.inf
    if not math.isfinite(number):
        raise HistoryError(f"{path}: {key} must be a finite number, not {value!r:.40}")
    return number


# A limit no account reaches (float64 holds every integer up to it exactly).
_MAX_LIMIT = 2**53


def run_config(path: Path, spec: dict[str, Any] | None = None) -> RunConfig:
    raw = read_json(path)
    need = ("drained", "http_timeout_seconds", "lease_seconds", "retry_base_seconds",
            "retry_cap_seconds", "retry_jitter", "account_limits")
    missing = [k for k in need if k not in raw]
    if missing:
        raise HistoryError(f"{path} lacks {', '.join(missing)}")
    if not isinstance(raw["drained"], bool):
        raise HistoryError(f"{path}: drained must be true or false")
    timeout = _seconds(path, raw, "http_timeout_seconds")
    lease = _seconds(path, raw, "lease_seconds")
    try:
        retry = RetryPolicy(
            base_seconds=_seconds(path, raw, "retry_base_seconds"),
            cap_seconds=_seconds(path, raw, "retry_cap_seconds"),
            jitter=_seconds(path, raw, "retry_jitter"),
        )
    except (TypeError, ValueError) as exc:
        raise HistoryError(f"{path}: bad retry or timing setting ({exc})") from None
    if not (timeout > 0 and lease > 0):
        raise HistoryError(f"{path}: http_timeout_seconds and lease_seconds must be positive")
    limits = raw["account_limits"]
    if not isinstance(limits, dict) or not all(
        v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_LIMIT)
        for v in limits.values()
    ):
        raise HistoryError(f"{path}: account_limits must map accounts to an integer "
                           f"(0 to 2**53) or null")
    exit_reason = raw.get("exit_reason", "completed")
    if not isinstance(exit_reason, str):
        raise HistoryError(f"{path}: exit_reason must be a string")
    final_jobs = raw.get("final_jobs")
    if final_jobs is not None and (not isinstance(final_jobs, int) or isinstance(final_jobs, bool)
                                   or final_jobs < 0):
        raise HistoryError(f"{path}: final_jobs must be a row count or null")
    return RunConfig(
        drained=raw["drained"],
        exit_reason=exit_reason,
        http_timeout_seconds=timeout,
        lease_seconds=lease,
        retry=retry,
        account_limits={str(k): v for k, v in limits.items()},
        final_jobs=final_jobs,
        durable=_durability(raw, spec or {}, path),
        backend=raw["backend"] if isinstance(raw.get("backend"), str) else "",
        guarantees=_guarantees(spec or {}, path),
        time_origin=_time_origin(raw, spec or {}),
        objectives=_objectives(spec or {}, path),
        load_window=_load_window(spec or {}),
        lease_kind=_lease_kind(spec or {}, path),
    )


def _lease_kind(spec: dict[str, Any], path: Path) -> LeaseKind:
    """spec.json's `lease`, else "renewal"; any other value is bad input."""
    kind = spec.get("lease", "renewal")
    if kind not in get_args(LeaseKind):
        raise HistoryError(f"{path.with_name(SPEC_FILE)}: lease must be \"renewal\" or "
                           f"\"heartbeat\", not {kind!r:.40}")
    return cast(LeaseKind, kind)


def _objectives(spec: dict[str, Any], path: Path) -> Objectives:
    """spec.json's `scenario.objectives`; a malformed one is bad input."""
    scenario = spec.get("scenario")
    raw = scenario.get("objectives") if isinstance(scenario, dict) else None
    try:
        return Objectives.from_mapping(raw, "scenario.objectives")
    except ObjectiveError as exc:
        raise HistoryError(f"{path.with_name(SPEC_FILE)}: {exc}") from None


def _load_window(spec: dict[str, Any]) -> tuple[float, float] | None:
    """From the warm-up's start to the load phase's end, as spec.json's phases say."""
    phases = spec.get("phases")
    spans = {p.get("name"): p for p in phases if isinstance(p, dict)} if isinstance(
        phases, list) else {}
    first, last = spans.get("warmup") or spans.get("load"), spans.get("load")
    if first and last and _finite(first.get("start")) and _finite(last.get("end")):
        return float(first["start"]), float(last["end"])
    return None


def _time_origin(raw: dict[str, Any], spec: dict[str, Any]) -> float | None:
    """The load's start, as the report's time axis counts it (`report_data.RunData.t0`)."""
    phases = spec.get("phases")
    for phase in phases if isinstance(phases, list) else []:
        if isinstance(phase, dict) and phase.get("name") == "warmup" and _finite(
                phase.get("start")):
            return float(phase["start"])
    return float(raw["started"]) if _finite(raw.get("started")) else None


def _finite(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def _guarantees(spec: dict[str, Any], path: Path) -> Guarantees:
    """spec.json's `guarantees`, else the reference's; a malformed one is bad input (judged
    against promises guessed, a queue could be called invalid by design or valid unjudged)."""
    raw = spec.get("guarantees")
    if raw is None:
        return REFERENCE_GUARANTEES
    if not isinstance(raw, dict):
        raise HistoryError(f"{path.with_name(SPEC_FILE)}: guarantees must be an object")
    try:
        return Guarantees.from_json(raw)
    except ValueError as exc:
        raise HistoryError(f"{path.with_name(SPEC_FILE)}: {exc}") from None
