"""Deliberately broken queues: the gate must fail each one, naming the anomaly that matches
its bug, and pass the reference on the same scenarios.

Each `tests/mutants/*.sql` replaces a few named blocks of the reference queue and says in
its header which anomalies it must cause (`-- expect:`) and which gate scenario catches it
(`-- scenario:`). A race, which needs two claims at the same instant, may say how many
seeds it gets (`-- seeds: N`, as the gate's `--seeds`), and must be caught in one of them. A
mutant whose bug no scenario can see yet says `-- expect: (none ...)` and is skipped with
its reason, so the gap stays visible. `-- set: KEY=VALUE, ...` overrides scenario keys for
this mutant only (a shorter drain where the bug shows during the load and its jobs never
end).

The seed is fixed for a reproducible suite (SKIPLOCK_TEST_SEED overrides it); the reference
is held to every seed by the gate's own sweeps, which tests/mutants/README.md reports.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from skiplock.reports.checker import COUNT_KEYS
from skiplock.scenarios.run.gate import gate_server, line, run_case

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.timeout(180)]

MUTANTS_DIR = Path(__file__).resolve().parents[1] / "mutants"
SEED = int(os.environ.get("SKIPLOCK_TEST_SEED", "1"))


@dataclass(frozen=True)
class Mutant:
    path: Path
    expect: tuple[str, ...]
    scenario: str
    gap: str | None  # why no scenario can catch it yet
    seeds: int = 1
    overrides: tuple[str, ...] = ()  # `-- set: KEY=VALUE, ...`


def read_mutant(path: Path) -> Mutant:
    text = path.read_text()
    expect = re.search(r"^-- expect: (.+)$", text, re.M)
    scenario = re.search(r"^-- scenario: (\S+)", text, re.M)
    assert expect and scenario, f"{path.name}: needs '-- expect:' and '-- scenario:' lines"
    raw = expect.group(1).strip()
    if raw.startswith("("):
        return Mutant(path, (), scenario.group(1), raw.strip("()"))
    kinds = tuple(k.strip() for k in raw.split(","))
    unknown = set(kinds) - set(COUNT_KEYS)
    assert not unknown, f"{path.name}: unknown anomalies {unknown}"
    seeds = re.search(r"^-- seeds: (\d+)$", text, re.M)
    overrides = re.search(r"^-- set: (.+)$", text, re.M)
    return Mutant(path, kinds, scenario.group(1), None, int(seeds.group(1)) if seeds else 1,
                  tuple(o.strip() for o in overrides.group(1).split(",")) if overrides else ())


MUTANTS = [read_mutant(p) for p in sorted(MUTANTS_DIR.glob("*.sql"))]


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    with gate_server(os.environ.get("SKIPLOCK_PG_DSN")) as found:
        yield found


def test_there_is_a_mutant_for_every_class_of_bug() -> None:
    assert len(MUTANTS) >= 12
    caught = {kind for m in MUTANTS for kind in m.expect}
    # Every anomaly a queue's SQL can cause has a mutant that causes it.
    assert caught >= {"lost", "duplicate_unexplained", "concurrent_delivery",
                      "attempts_exceeded", "early_retry", "limit_exceeded",
                      "state_mismatch", "stale_write", "starvation", "objective_missed"}


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.path.stem for m in MUTANTS])
def test_the_gate_catches_the_mutant_with_the_anomaly_of_its_bug(
        mutant: Mutant, server: Any, tmp_path: Path) -> None:
    if mutant.gap:
        pytest.skip(f"not caught yet: {mutant.gap}")
    tried = []
    for seed in range(SEED, SEED + mutant.seeds):
        # The verdict is what is tested here; report.html has its own tests.
        result = run_case(mutant.scenario, seed, server=server, backend="pg",
                          sql_path=str(mutant.path), out=tmp_path, overrides=mutant.overrides,
                          report=False)
        missing = [kind for kind in mutant.expect if not result.counts.get(kind)]
        if result.exit_code == 1 and not missing:
            return
        tried.append(f"{line(result)} (missing {missing})")
    pytest.fail(f"{mutant.path.name} not caught with {list(mutant.expect)}:\n"
                + "\n".join(tried))


@pytest.mark.parametrize("scenario", sorted({m.scenario for m in MUTANTS}))
def test_the_reference_passes_every_scenario_that_catches_a_mutant(
        scenario: str, server: Any, tmp_path: Path) -> None:
    result = run_case(scenario, SEED, server=server, backend="pg", sql_path=None,
                      out=tmp_path)
    assert result.exit_code == 0, line(result)
    assert result.run_dir is not None and (Path(result.run_dir) / "report.html").is_file()
