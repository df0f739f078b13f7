"""The gate inside a team's own test suite (a pytest plugin, entry point `skiplock`).

Two ways in, both inert unless asked for:

- `pytest --skiplock-sql db/queue.sql` (or `--skiplock-backend NAME`) adds one test per
  gate scenario x seed to the session, each failing with the anomalies it found and the
  run directory to re-check;
- the `skiplock_gate` fixture runs the gate from a test and returns its summary:

      def test_queue_keeps_its_promises(skiplock_gate):
          summary = skiplock_gate(sql="db/queue.sql", only=["noisy-neighbour"])
          assert summary.exit_code == 0, summary.report()
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from skiplock.plumbing.errors import HarnessError, UsageError
from skiplock.scenarios.run.gate import CaseResult, GateSummary, line


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("skiplock", "skiplock correctness gate")
    group.addoption("--skiplock-sql", default=None, metavar="FILE",
                    help="gate the reference queue with these named SQL blocks swapped in")
    group.addoption("--skiplock-backend", default=None, metavar="NAME",
                    help="gate this backend (pg, pg-for-update, ..., package.module:factory)")
    group.addoption("--skiplock-only", action="append", default=[], metavar="SCENARIO",
                    help="gate only these scenarios (default: the whole suite)")
    group.addoption("--skiplock-seed", type=int, default=None,
                    help="first seed (default: random, shown in each test's name)")
    group.addoption("--skiplock-seeds", type=int, default=1, help="seeds per scenario")
    group.addoption("--skiplock-dsn", default=None,
                    help="PostgreSQL for the gate (default: as skiplock provisions it)")
    group.addoption("--skiplock-out", default="gate", metavar="DIR",
                    help="where the gate's runs go (default: ./gate)")


class _Server:
    """One server for every gate test of the session, started at the first."""

    def __init__(self, dsn: str | None) -> None:
        self._dsn = dsn
        self._stack = contextlib.ExitStack()
        self._server: Any = None

    def get(self) -> Any:
        if self._server is None:
            from skiplock.scenarios.run.gate import gate_server

            self._server = self._stack.enter_context(gate_server(self._dsn))
        return self._server

    def close(self) -> None:
        self._stack.close()


class GateFailure(Exception):
    """A gate case that did not pass; its message is the case's line."""


class GateItem(pytest.Item):
    """One scenario x seed of the gate."""

    def __init__(self, *, scenario: str, seed: int, settings: dict[str, Any],
                 server: _Server, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scenario = scenario
        self.seed = seed
        self.settings = settings
        self.server = server
        self.result: CaseResult | None = None

    def runtest(self) -> None:
        from skiplock.scenarios.run.gate import run_case

        out = Path(self.settings["out"]) / "runs"
        out.mkdir(parents=True, exist_ok=True)
        self.result = run_case(self.scenario, self.seed, server=self.server.get(),
                               backend=self.settings["backend"],
                               sql_path=self.settings["sql"], out=out)
        if self.result.not_applicable is not None:
            pytest.skip(self.result.message())
        if self.result.exit_code != 0:
            raise GateFailure(line(self.result))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException],
                     style: Any = None) -> str:
        if isinstance(excinfo.value, GateFailure):
            text = str(excinfo.value)
            if self.result is not None and self.result.run_dir:
                text += f"\nre-check: skiplock check {self.result.run_dir}"
            return text
        if self.config.getoption("fulltrace"):
            return str(super().repr_failure(excinfo))
        # Anything else is skiplock's own failure, not the queue's: one line, as the CLI says
        # it, instead of pytest's internals (`--full-trace` still shows them).
        exc = excinfo.value
        if isinstance(exc, (UsageError, HarnessError)):
            return f"skiplock: {exc}"
        return (f"skiplock: harness failure: {type(exc).__name__}: {exc}"
                " (pytest --full-trace shows the traceback)")

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return Path(self.settings["sql"] or "skiplock"), None, self.name


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    sql = config.getoption("skiplock_sql")
    backend = config.getoption("skiplock_backend")
    if sql is None and backend is None:
        return
    from skiplock.scenarios.cli.run import check_system_under_test
    from skiplock.scenarios.run.gate import resolve_scenarios

    # Bad options are the user's to fix: one line and pytest's usage exit (4), before any
    # server starts, as `skiplock gate` refuses them with exit 2.
    try:
        check_system_under_test(backend or "pg", sql)
        scenarios = resolve_scenarios(config.getoption("skiplock_only"))
    except UsageError as exc:
        raise pytest.UsageError(f"skiplock: {exc}") from None
    base = config.getoption("skiplock_seed")
    if base is None:
        base = random.SystemRandom().randrange(2**31)
    seeds = [base + i for i in range(max(1, int(config.getoption("skiplock_seeds"))))]
    server = _Server(config.getoption("skiplock_dsn"))
    config.add_cleanup(server.close)
    settings = {"sql": sql, "backend": backend or "pg", "out": config.getoption("skiplock_out")}
    from skiplock.scenarios.run.gate import cases

    for scenario, seed in cases(scenarios, seeds):
        items.append(GateItem.from_parent(
            session, name=f"skiplock-gate[{scenario}-seed{seed}]", scenario=scenario,
            seed=seed, settings=settings, server=server))


GateRunner = Callable[..., GateSummary]


@pytest.fixture
def skiplock_gate(tmp_path: Path) -> Iterator[GateRunner]:
    """Run the gate: `skiplock_gate(sql=..., backend="pg", only=[...], seed=..., seeds=1,
    dsn=None, overrides=())` returns a `GateSummary` (`.exit_code`, `.results`,
    `.report()`); its runs, junit.xml and summary.json go under the test's tmp_path."""
    from skiplock.scenarios.run.gate import resolve_scenarios, run_gate

    def gate(*, sql: str | None = None, backend: str = "pg",
             only: Sequence[str] | None = None, seed: int | None = None, seeds: int = 1,
             dsn: str | None = None, overrides: Sequence[str] = ()) -> GateSummary:
        base = seed if seed is not None else random.SystemRandom().randrange(2**31)
        return run_gate(backend=backend, sql_path=sql, dsn=dsn, out=tmp_path / "gate",
                        seeds=[base + i for i in range(seeds)],
                        scenarios=resolve_scenarios(only), overrides=overrides)

    yield gate
