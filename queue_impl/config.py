"""A worker's configuration: its settings (declared once, here) and the dispatcher's config.

`WorkerSettings` is what an operator tunes about how each worker runs: slots, lease, timeout,
polls, recovery, renewal, the gather policy, the retry policy. The dispatcher's config extends
it with what a run adds (the targets it may call, failpoints, the seed); a scenario file names
the same settings by shorter keys (`lease` for `lease_seconds`), each field's `SCENARIO_KEY`,
and `skiplock.scenarios.run.spec.ScenarioSpec.worker_settings` reads them through this table.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from skiplock.queue_impl.failpoints import FAILPOINT_NAMES, FailpointName
from skiplock.queue_impl.retry import RetryPolicy
from skiplock.queue_impl.ssrf import AllowedTarget

# The metadata key of each setting's name in a scenario file.
SCENARIO_KEY = "scenario_key"


def _setting(default: Any, key: str) -> Any:
    return field(default=default, metadata={SCENARIO_KEY: key})


class ConfigError(ValueError):
    """A dispatcher setting that cannot work; the message is one line saying what to fix."""


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """How each worker runs. The defaults are a production worker's (`skiplock worker`); a
    scenario has its own, shorter ones."""

    batch: int = _setting(10, "batch")
    lease_seconds: float = _setting(30.0, "lease")
    http_timeout_seconds: float = _setting(10.0, "http_timeout")
    # Time reserved, inside the lease, for writing the result after the HTTP call ends.
    write_margin_seconds: float = _setting(5.0, "write_margin")
    # Slow poll when no notification arrives (LISTEN/NOTIFY is the fast path).
    poll_seconds: float = _setting(1.0, "poll")
    recovery_enabled: bool = _setting(True, "recovery")
    recovery_interval_seconds: float = _setting(1.0, "recovery_interval")
    renew_leases: bool = _setting(True, "renew_leases")
    # The gather policy: refill freed slots while other calls run (True), or the batch
    # barrier: claim a batch, wait for its slowest call, write all its results, claim again
    # (False; also used for a backend whose claim stays open until its results are written,
    # as pg-long-tx's does).
    refill: bool = _setting(True, "refill")
    # Refill, busy (calls still in flight, fewer than half a batch of results waiting): how
    # long the writer lets more results gather before writing, so that a busy worker writes in
    # batches, not one by one (each write is a round trip and a commit: the dearest call per
    # job). 0 writes each result as it comes. The price: each lease, and so a limited
    # account's slot, is held up to this much longer. The wait comes out of the write margin,
    # so it is never longer than the margin (`gather_seconds`).
    write_gather_seconds: float = _setting(0.01, "write_gather")
    # Refill: how many leases a worker may hold beyond its `batch` calls in flight, claimed
    # before slots free, so that a slot whose call ends starts the next one at once instead of
    # waiting out a claim and its receipt (two commits, each longer than a loopback call). The
    # price: a job claimed ahead waits for a slot with its lease running (renewed as any held
    # lease), and a limited account's claimed-ahead job holds one of its account's slots while
    # it waits. 0 claims only for free slots. Each claim still takes at most `batch`. Only
    # with renewal on and refill (a lease left unrenewed would run out waiting).
    claim_ahead: int = _setting(10, "claim_ahead")
    retry_base_seconds: float = _setting(1.0, "retry_base")
    retry_cap_seconds: float = _setting(60.0, "retry_cap")
    retry_jitter: float = _setting(0.5, "retry_jitter")
    # Skip the lease/timeout rule, for experiments that want to show what breaking it does.
    unsafe_timing: bool = _setting(False, "unsafe_timing")

    @classmethod
    def scenario_keys(cls) -> dict[str, str]:
        """Each setting's scenario key -> its field name here."""
        return {f.metadata[SCENARIO_KEY]: f.name for f in dataclasses.fields(WorkerSettings)}

    @classmethod
    def from_scenario(cls, value_of: Callable[[str], Any]) -> WorkerSettings:
        """The settings a scenario gives, `value_of(key)` for each scenario key."""
        return WorkerSettings(**{name: value_of(key)
                                 for key, name in cls.scenario_keys().items()})

    def settings(self) -> Mapping[str, Any]:
        """The settings alone (a config's extra fields left out), by field name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(WorkerSettings)}

    def validate(self) -> None:
        """Raise ConfigError for a setting that cannot work."""
        self._check_values()
        self._check_timing()

    def _check_values(self) -> None:
        _positive_int("batch", self.batch)
        _positive("lease", self.lease_seconds)
        _positive("HTTP timeout", self.http_timeout_seconds)
        _positive("poll interval", self.poll_seconds)
        _positive("recovery interval", self.recovery_interval_seconds)
        if not math.isfinite(self.write_margin_seconds) or self.write_margin_seconds < 0:
            raise ConfigError(
                f"write margin must be 0 or more seconds (got {self.write_margin_seconds})"
            )
        _whole_number("claim ahead", self.claim_ahead)
        if not math.isfinite(self.write_gather_seconds) or self.write_gather_seconds < 0:
            raise ConfigError(
                f"write gather must be 0 or more seconds (got {self.write_gather_seconds})"
            )
        try:
            self.retry_policy()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def _check_timing(self) -> None:
        needed = self.http_timeout_seconds + self.write_margin_seconds
        if not self.unsafe_timing and needed >= self.lease_seconds:
            raise ConfigError(
                f"HTTP timeout {self.http_timeout_seconds:g}s + write margin "
                f"{self.write_margin_seconds:g}s must be shorter than the lease "
                f"{self.lease_seconds:g}s: the call and the result write must finish inside "
                "the lease, or another worker may take the job while this one still runs it "
                "(raise the lease, lower the timeout, or pass --unsafe-timing for experiments)"
            )

    def gather_seconds(self) -> float:
        """How long results may gather: the write gather, within the write margin."""
        return min(self.write_gather_seconds, self.write_margin_seconds)

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(
            base_seconds=self.retry_base_seconds,
            cap_seconds=self.retry_cap_seconds,
            jitter=self.retry_jitter,
        )


@dataclass(frozen=True, kw_only=True)
class DispatcherConfig(WorkerSettings):
    """The worker settings and what a run adds to them; one config is shared by every
    worker process of a pool (picklable)."""

    allow_targets: tuple[str, ...] = ()  # "HOST:PORT"
    failpoints: tuple[tuple[str, float], ...] = ()  # (name, probability per job)
    # A JSON file {name: probability} that a fault schedule rewrites while the worker runs
    # (a failpoint window); read again whenever it changes, and added to `failpoints`.
    failpoint_file: str | None = None
    # Seeds failpoint decisions and retry jitter (with the worker id); None: unseeded.
    seed: int | None = None

    @classmethod
    def of(cls, settings: WorkerSettings, **run: Any) -> DispatcherConfig:
        """The config of workers with `settings`, plus the run's own fields (`run`)."""
        return cls(**settings.settings(), **run)

    def validate(self) -> None:
        """Raise ConfigError for a setting that cannot work."""
        self._check_values()
        for text in self.allow_targets:
            try:
                AllowedTarget.parse(text)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        for name, probability in self.failpoints:
            if name not in FAILPOINT_NAMES:
                raise ConfigError(
                    f"unknown failpoint {name!r} (known: {', '.join(FAILPOINT_NAMES)})"
                )
            if not 0.0 <= probability <= 1.0:
                raise ConfigError(
                    f"failpoint {name} probability must be between 0 and 1 (got {probability})"
                )
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ConfigError(f"seed must be a whole number (got {self.seed!r})")
        self._check_timing()

    def failpoint_probability(self, name: FailpointName) -> float:
        return max((p for n, p in self.failpoints if n == name), default=0.0)


def validate_worker_count(count: int) -> None:
    """Worker counts live outside the config (one config is shared by all processes)."""
    _positive_int("worker count", count)


def _positive_int(what: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what} must be a positive whole number (got {value!r})")


def _whole_number(what: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{what} must be a whole number, 0 or more (got {value!r})")


def _positive(what: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{what} must be a positive number of seconds (got {value!r})")


__all__ = ["SCENARIO_KEY", "ConfigError", "DispatcherConfig", "WorkerSettings",
           "validate_worker_count"]
