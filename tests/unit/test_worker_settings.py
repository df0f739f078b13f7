"""The workers' settings are declared once, as `WorkerSettings` (queue_impl/config.py): the
dispatcher's config extends it, and a scenario names each setting by the field's scenario
key. The scenario spec still declares those keys (with a short scenario's defaults), so this
holds them, their types and the docs' table equal to the dataclass."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from skiplock.queue_impl.config import DispatcherConfig, WorkerSettings
from skiplock.scenarios.run.runner import dispatcher_config
from skiplock.scenarios.run.spec import SCALAR_KEYS, ScenarioSpec, apply_overrides

ROOT = Path(__file__).resolve().parents[2]
SPEC_FIELDS = {f.name: f for f in dataclasses.fields(ScenarioSpec)}


def test_every_setting_is_a_scenario_key_of_the_same_type() -> None:
    keys = WorkerSettings.scenario_keys()
    assert len(keys) == len(dataclasses.fields(WorkerSettings))
    for field in dataclasses.fields(WorkerSettings):
        key = field.metadata["scenario_key"]
        assert key in SPEC_FIELDS and key in SCALAR_KEYS, f"{field.name}: no scenario key {key}"
        assert SPEC_FIELDS[key].type == field.type, (key, SPEC_FIELDS[key].type, field.type)


def test_the_config_is_the_settings_and_the_runs_own_fields() -> None:
    settings = {f.name for f in dataclasses.fields(WorkerSettings)}
    config = {f.name for f in dataclasses.fields(DispatcherConfig)}
    assert settings < config
    assert config - settings == {"allow_targets", "failpoints", "failpoint_file", "seed"}


def test_a_scenarios_settings_reach_the_dispatcher_config_unchanged() -> None:
    spec = apply_overrides(ScenarioSpec(name="t"), [
        "batch=7", "lease=9", "http_timeout=3", "write_margin=1.5", "poll=0.25",
        "recovery=false", "recovery_interval=0.75", "renew_leases=false", "refill=false",
        "write_gather=0.5", "claim_ahead=3",
        "retry_base=0.5", "retry_cap=4", "retry_jitter=0.25", "unsafe_timing=true",
    ]).validate()
    config = dispatcher_config(spec, ("127.0.0.1:9",))
    for key, name in WorkerSettings.scenario_keys().items():
        assert getattr(config, name) == getattr(spec, key), key
    # Every value differs from the dataclass's default: none was dropped on the way.
    defaults = WorkerSettings()
    assert all(getattr(config, f.name) != getattr(defaults, f.name)
               for f in dataclasses.fields(WorkerSettings))
    assert config.allow_targets == ("127.0.0.1:9",)


def test_the_docs_list_the_scenario_keys_of_the_settings() -> None:
    """The scenario files' reference lists the settings in the dispatcher's and the retry
    policy's rows, beside `workers` and `max_attempts` (which are not worker settings)."""
    text = (ROOT / "docs" / "reference" / "scenario-files.md").read_text()
    rows = [line for line in text.splitlines()
            if line.startswith("| `") and ("the dispatcher's settings" in line
                                            or "retry policy" in line)]
    assert len(rows) == 2, rows
    listed = {key for row in rows for key in re.findall(r"`([a-z_]+)`", row.split(" | ")[0])}
    assert listed == {*WorkerSettings.scenario_keys(), "workers", "max_attempts"}
