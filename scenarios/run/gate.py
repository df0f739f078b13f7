"""The CI correctness gate: a fixed suite of chaos scenarios over several seeds.

Each scenario in `SUITE` puts pressure where one class of queue bug lives (its spec file
says which anomalies it can reveal); together they take about two and a half minutes on a
two-core machine one after another, and a minute and a half in two lanes (`gate_lanes`).
Every scenario x seed is one full run, judged by the checker from its history; the gate's
answer is the worst of them:

    1  any run violated a guarantee (a complete history, and an anomaly in it)
    4  the harness itself failed on some run (and none violated)
    3  some run could not be decided (unknown), and none violated or failed
    0  every run valid

Results land in `OUT/junit.xml` (one testcase per scenario x seed, the failure message
naming the anomalies and their first examples), `OUT/summary.json`, and the run
directories under `OUT/runs/`, each re-judgeable with `skiplock check`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skiplock import __version__
from skiplock.plumbing.errors import HarnessError, Terminated, Unhonoured, UsageError
from skiplock.scenarios.run.gate_lanes import LaneCommand, Lanes, lane_count

# The suite, in the order it runs. Each entry is a scenario of scenarios/specs/.
SUITE: tuple[str, ...] = (
    "noisy-neighbour",
    "exhaust-attempts",
    "kill-workers",
    "pause-workers",
    "crash-points",
    "long-calls",
    "target-hangs",
    "db-faults",
    "mixed",
)
DEFAULT_OUT = Path("gate")
# Anomalies a failure message names, with up to this many examples each.
EXAMPLES_IN_MESSAGE = 2
# A JUnit failure body (what a CI page unfolds): this many anomalies, examples of each.
BODY_ANOMALIES = 6
BODY_EXAMPLES = 3


@dataclass(kw_only=True)
class CaseResult:
    """One scenario x seed."""

    scenario: str
    seed: int
    exit_code: int
    valid: Any  # True, False, "unknown"; None when the run did not finish
    seconds: float
    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    unknown_reasons: list[str] = field(default_factory=list)
    run_dir: str | None = None
    error: str | None = None
    # Why the backend cannot run this scenario as written (a promise it does not make):
    # the case is listed, not run, and neither passes nor fails the gate.
    not_applicable: str | None = None

    @property
    def outcome(self) -> str:
        if self.not_applicable is not None:
            return "n/a"
        return {0: "pass", 1: "FAIL", 3: "unknown"}.get(self.exit_code, "ERROR")

    def violations(self) -> dict[str, int]:
        from skiplock.reports.checker import VIOLATION_KEYS

        return {k: v for k, v in self.counts.items() if k in VIOLATION_KEYS and v}

    def message(self) -> str:
        """One line: what broke, with the first examples."""
        if self.not_applicable is not None:
            return f"not applicable: {self.not_applicable}"
        if self.error:
            return self.error
        if self.exit_code == 3:
            return "unknown: " + "; ".join(self.unknown_reasons[:3])
        parts = []
        for kind, count in self.violations().items():
            shown = "; ".join(
                f"{e.get('job_id')}: {e.get('why')}"
                for e in self.examples.get(kind, [])[:EXAMPLES_IN_MESSAGE]
            )
            parts.append(f"{kind}={count}" + (f" ({shown})" if shown else ""))
        return "; ".join(parts)

    def headline(self) -> str:
        """The shortest line that says what broke: counts only, no examples."""
        if self.exit_code == 1:
            return ", ".join(f"{k}={v}" for k, v in self.violations().items())
        return _shortened(self.message(), 100)

    def evidence(self) -> str:
        """A CI page's failure body: the first examples, then where the whole verdict is."""
        lines = []
        for kind, count in list(self.violations().items())[:BODY_ANOMALIES]:
            lines.append(f"{kind}: {count}")
            lines += [f"  {e.get('job_id')}: {_shortened(str(e.get('why')), 300)}"
                      for e in self.examples.get(kind, [])[:BODY_EXAMPLES]]
        if self.exit_code == 3:
            lines += [f"unknown: {reason}" for reason in self.unknown_reasons[:BODY_EXAMPLES]]
        if self.error:
            lines.append(self.error)
        if self.run_dir:
            lines += ["", f"run directory: {self.run_dir}",
                      f"whole verdict: {Path(self.run_dir) / 'verdict.json'}",
                      f"re-check: skiplock check {self.run_dir}"]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "seed": self.seed,
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "valid": self.valid,
            "seconds": round(self.seconds, 2),
            "counts": self.counts,
            "violations": self.violations(),
            "unknown_reasons": self.unknown_reasons,
            "run_dir": self.run_dir,
            "error": self.error,
            "not_applicable": self.not_applicable,
        }


@dataclass(kw_only=True)
class GateSummary:
    backend: str
    sql_path: str | None
    seeds: list[int]
    scenarios: list[str]
    results: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0
    interrupted: bool = False
    # The case under way when the gate was cut short, reported as an error testcase, and the
    # exit code the command ends with then (130 Ctrl-C, 143 SIGTERM, 2 bad input, 4 ...).
    running: tuple[str, int] | None = None
    stop_code: int = 130

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return self.stop_code  # however the finished cases went, the gate did not finish
        if self.results and all(r.not_applicable is not None for r in self.results):
            return 2  # nothing was judged: no case applies to this backend
        codes = {r.exit_code for r in self.results}
        if 1 in codes:
            return 1
        if codes - {0, 1, 3}:
            return 4
        if 3 in codes:
            return 3
        return 0

    def report(self) -> str:
        """Every case's line: what a failed assertion shows."""
        return "\n".join(line(r) for r in self.results)

    def to_json(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "skiplock_version": __version__,
            "backend": self.backend,
            "sql_path": self.sql_path,
            "seeds": self.seeds,
            "scenarios": self.scenarios,
            "seconds": round(self.seconds, 1),
            "interrupted": self.interrupted,
            "counts": {
                "runs": len(self.results),
                "pass": sum(r.outcome == "pass" for r in self.results),
                "not_applicable": sum(r.not_applicable is not None for r in self.results),
                "fail": sum(r.exit_code == 1 for r in self.results),
                "unknown": sum(r.exit_code == 3 for r in self.results),
                "error": sum(r.exit_code not in (0, 1, 3) for r in self.results),
            },
            "results": [r.to_json() for r in self.results],
        }


def resolve_scenarios(only: Sequence[str] | None) -> list[str]:
    """The suite, or the named part of it; any scenario name or .toml path is accepted."""
    from skiplock.scenarios.run.spec import SpecError, resolve_path

    if not only:
        return list(SUITE)
    names = [name.strip() for item in only for name in item.split(",") if name.strip()]
    if not names:
        # `--only "$SCENARIOS"` with the variable unset must not pass a gate that ran nothing.
        raise UsageError(f"--only names no scenario (got {','.join(only)!r}): give one or more"
                         f" of {', '.join(SUITE)}, or leave --only out for the whole suite")
    for name in names:
        try:
            resolve_path(name)
        except SpecError as exc:
            raise UsageError(str(exc)) from None
    return names


def cases(scenarios: Sequence[str], seeds: Sequence[int]) -> list[tuple[str, int]]:
    """Every scenario x seed, seed by seed: a gate cut short has tried every scenario."""
    return [(scenario, seed) for seed in seeds for scenario in scenarios]


@contextlib.contextmanager
def gate_server(dsn: str | None) -> Iterator[Any]:
    """One durable server for the whole gate (each run still gets its own schema)."""
    from skiplock.scenarios.servers.postgres import postgres

    with postgres(dsn, durable=True) as server:
        yield server


def check_backend_on(server: Any, backend: str, sql_path: str | None,
                     options: tuple[tuple[str, str], ...] = ()) -> None:
    """Refuse a plug-in the gate could not use (its factory raises, returns no queue, or
    builds a one-process queue) before any case runs: bad input, exit 2."""
    import secrets

    from skiplock.queue_impl.plugins import check_backend

    try:
        check_backend(backend, dsn=server.dsn, schema=f"skiplock_{secrets.token_hex(4)}",
                      sql_path=sql_path, options=options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def run_case(scenario: str, seed: int, *, server: Any, backend: str, sql_path: str | None,
             out: Path, overrides: Sequence[str] = (), report: bool = True,
             backend_options: tuple[tuple[str, str], ...] = ()) -> CaseResult:
    """One scenario x seed, judged (and its report.html written, unless `report` is off).
    Bad input raises UsageError (it would fail every case alike); a harness failure is this
    case's result (exit 4)."""
    from skiplock.scenarios.run.options import RunOptions
    from skiplock.scenarios.run.runner import run_scenario
    from skiplock.scenarios.run.spec import SpecError, load

    try:
        spec = load(scenario, list(overrides))
    except SpecError as exc:
        raise UsageError(str(exc)) from None
    options = RunOptions(backend=backend, backend_options=backend_options, seed=seed, out=out,
                         sql_path=sql_path, server=server, worker_logs_to_files=True,
                         report=report)
    started = time.monotonic()
    try:
        result = run_scenario(spec, options)
    except Unhonoured as exc:
        return CaseResult(scenario=spec.name, seed=seed, exit_code=0, valid=None,
                          seconds=time.monotonic() - started, not_applicable=str(exc))
    except HarnessError as exc:
        return CaseResult(scenario=spec.name, seed=seed, exit_code=exc.exit_code, valid=None,
                          seconds=time.monotonic() - started,
                          error=f"harness failure: {exc}")
    verdict = result.verdict
    return CaseResult(
        scenario=spec.name,
        seed=seed,
        exit_code=result.exit_code,
        valid=verdict.valid,
        seconds=time.monotonic() - started,
        counts=dict(verdict.counts),
        examples={k: list(v) for k, v in verdict.examples.items()},
        unknown_reasons=list(getattr(verdict, "unknown_reasons", []) or []),
        run_dir=str(result.run_dir),
    )


def run_gate(*, backend: str = "pg", sql_path: str | None = None, dsn: str | None = None,
             backend_options: tuple[tuple[str, str], ...] = (),
             out: Path = DEFAULT_OUT, seeds: Sequence[int], scenarios: Sequence[str],
             overrides: Sequence[str] = (),
             report: Callable[[CaseResult], None] | None = None,
             accepted: Callable[[], None] | None = None,
             html: bool = True, lanes: int | None = 1) -> GateSummary:
    """Run every case and write junit.xml and summary.json, also when interrupted; `lanes`
    cases at a time (None: one per core, up to two), each lane on a server of its own
    (`gate_lanes`).

    A gate refused as bad input (a plug-in the gate cannot use) is refused before
    `accepted` is called (the caller's header) and before any file is written, so no
    artifact of a refused gate can read as green."""
    summary = GateSummary(backend=backend, sql_path=sql_path, seeds=list(seeds),
                          scenarios=list(scenarios))
    todo = cases(scenarios, seeds)
    tally = _Tally(summary, todo, report)
    count = lane_count(lanes, len(todo))
    command = LaneCommand(backend=backend, sql_path=sql_path, dsn=dsn,
                          backend_options=backend_options, overrides=overrides, out=out,
                          html=html)
    judge: contextlib.AbstractContextManager[Any] = (
        Lanes(command, count) if count > 1 else _InProcess(command))
    started = time.monotonic()
    entered = False
    try:
        with judge as cases_runner:
            entered = True
            if accepted is not None:
                accepted()
            (out / "runs").mkdir(parents=True, exist_ok=True)
            cases_runner.run(todo, tally.started, tally.finished)
    except BaseException as exc:
        # Ctrl-C, SIGTERM, or bad input only a run could find: what was judged is kept,
        # and the JUnit file says the gate did not finish.
        if entered:
            summary.interrupted = True
            summary.stop_code = _exit_code_of(exc)
        raise
    finally:
        if entered:
            summary.seconds = time.monotonic() - started
            tally.sort()
            write_results(out, summary)
    return summary


class _Tally:
    """The summary kept as cases start and end, in any order: `running` is the earliest case
    under way (what an interrupted gate's JUnit names), results end in the gate's order."""

    def __init__(self, summary: GateSummary, todo: Sequence[tuple[str, int]],
                 report: Callable[[CaseResult], None] | None) -> None:
        self._summary = summary
        self._order = {case: index for index, case in enumerate(todo)}
        self._in_flight: list[tuple[str, int]] = []
        self._report = report

    def started(self, case: tuple[str, int]) -> None:
        self._in_flight.append(case)
        self._summary.running = min(self._in_flight, key=self._order.__getitem__)

    def finished(self, wired: dict[str, Any]) -> None:
        result = CaseResult(**wired)
        with contextlib.suppress(ValueError):
            self._in_flight.remove((result.scenario, result.seed))
        self._summary.running = (min(self._in_flight, key=self._order.__getitem__)
                                 if self._in_flight else None)
        self._summary.results.append(result)
        if self._report is not None:
            self._report(result)

    def sort(self) -> None:
        last = len(self._order)
        self._summary.results.sort(key=lambda r: self._order.get((r.scenario, r.seed), last))


class _InProcess:
    """The cases one at a time in this process, on one server for the whole gate."""

    def __init__(self, command: LaneCommand) -> None:
        self._command = command
        self._stack = contextlib.ExitStack()
        self._server: Any = None

    def __enter__(self) -> _InProcess:
        c = self._command
        with self._stack:
            self._server = self._stack.enter_context(gate_server(c.dsn))
            check_backend_on(self._server, c.backend, c.sql_path, c.backend_options)
            self._stack = self._stack.pop_all()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stack.__exit__(*exc_info)

    def run(self, todo: Sequence[tuple[str, int]],
            on_start: Callable[[tuple[str, int]], None],
            on_result: Callable[[dict[str, Any]], None]) -> None:
        for scenario, seed in todo:
            on_start((scenario, seed))
            on_result(dataclasses.asdict(self.judge(scenario, seed)))

    def judge(self, scenario: str, seed: int) -> CaseResult:
        c = self._command
        return run_case(scenario, seed, server=self._server, backend=c.backend,
                        sql_path=c.sql_path, out=c.out / "runs", overrides=c.overrides,
                        report=c.html, backend_options=c.backend_options)


def serve_lane(command: LaneCommand) -> int:
    """`skiplock gate --lane`: judge the cases read from standard input on a server of this
    lane's own, one result line each on standard output (`gate_lanes`)."""
    from skiplock.scenarios.run.gate_lanes import cases_from, say, wire

    with _InProcess(command) as lane:
        say({"accepted": True})
        (command.out / "runs").mkdir(parents=True, exist_ok=True)
        for scenario, seed in cases_from(sys.stdin):
            say(wire(lane.judge(scenario, seed)))
    return 0


def write_results(out: Path, summary: GateSummary) -> None:
    """summary.json, junit.xml and report.html (each case linked to its run's report)."""
    from skiplock.reports.report import REPORT_FILE, write_index

    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "summary.json.partial"
    tmp.write_text(json.dumps(summary.to_json(), indent=2, default=str) + "\n")
    os.replace(tmp, out / "summary.json")
    tree = junit(summary)
    ET.indent(tree)
    tmp = out / "junit.xml.partial"
    tree.write(tmp, encoding="utf-8", xml_declaration=True)
    os.replace(tmp, out / "junit.xml")
    write_index(f"skiplock gate: backend {summary.backend}"
                + (f", sql {summary.sql_path}" if summary.sql_path else ""),
                [{"case": f"{r.scenario} seed {r.seed}", "outcome": r.outcome,
                  "seconds": r.seconds,
                  "message": "" if r.outcome == "pass" else r.headline(),
                  "replay": None if r.outcome == "pass" else replay(summary, r),
                  "details": None if r.outcome == "pass" else r.evidence(),
                  "run_dir": r.run_dir} for r in summary.results], out / REPORT_FILE)


def junit(summary: GateSummary) -> ET.ElementTree:
    """JUnit XML as GitLab, GitHub and Jenkins read it: a violation is a <failure>, an
    unknown or a harness failure an <error>."""
    results = summary.results
    suite = ET.Element("testsuite", {
        "name": "skiplock gate",
        "tests": str(len(results)),
        "failures": str(sum(r.exit_code == 1 for r in results)),
        "errors": str(sum(r.exit_code not in (0, 1) for r in results)),
        "skipped": str(sum(r.not_applicable is not None for r in results)),
        "time": f"{summary.seconds:.1f}",
    })
    props = ET.SubElement(suite, "properties")
    for name, value in (("backend", summary.backend), ("sql", summary.sql_path or ""),
                        ("seeds", ",".join(map(str, summary.seeds)))):
        ET.SubElement(props, "property", {"name": name, "value": value})
    if summary.interrupted:
        _cut_case(suite, summary)
    for r in results:
        case = ET.SubElement(suite, "testcase", {
            "classname": f"skiplock.gate.{r.scenario}",
            "name": f"{r.scenario}[seed={r.seed}]",
            "time": f"{r.seconds:.1f}",
        })
        # The message is one short line a CI page shows whole; the body the first examples;
        # the whole verdict stays in the run directory.
        message = f"{r.headline()}; replay: {replay(summary, r)}"
        body = r.evidence()
        if r.not_applicable is not None:
            ET.SubElement(case, "skipped", {"message": r.message()})
        elif r.exit_code == 1:
            ET.SubElement(case, "failure", {"message": message,
                                            "type": "guarantee violated"}).text = body
        elif r.exit_code != 0:
            kind = "unknown" if r.exit_code == 3 else "harness failure"
            ET.SubElement(case, "error", {"message": message, "type": kind}).text = body
        if r.run_dir:
            ET.SubElement(case, "system-out").text = f"run directory: {r.run_dir}"
    return ET.ElementTree(suite)


def replay(summary: GateSummary, result: CaseResult) -> str:
    """The command that runs this one case again, as the gate ran it."""
    words = ["skiplock", "gate", "--only", result.scenario, "--seed", str(result.seed)]
    if summary.backend != "pg":
        words += ["--backend", summary.backend]
    if summary.sql_path:
        words += ["--sql", summary.sql_path]
    return " ".join(shlex.quote(w) for w in words)


def _shortened(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _exit_code_of(exc: BaseException) -> int:
    if isinstance(exc, (UsageError, HarnessError, Terminated)):
        return exc.exit_code
    return 130 if isinstance(exc, KeyboardInterrupt) else HarnessError.exit_code


def _cut_case(suite: ET.Element, summary: GateSummary) -> None:
    """An interrupted gate's JUnit file must not read as green: one error testcase says which
    case was cut short, or that the gate stopped before its first case."""
    scenario, seed = summary.running or ("gate", summary.seeds[0] if summary.seeds else 0)
    ran = {(r.scenario, r.seed) for r in summary.results}
    name = f"{scenario}[seed={seed}]" if (scenario, seed) not in ran else "gate[interrupted]"
    case = ET.SubElement(suite, "testcase", {"classname": f"skiplock.gate.{scenario}",
                                             "name": name, "time": "0.0"})
    ET.SubElement(case, "error", {
        "message": f"the gate stopped (exit {summary.stop_code}) during {name}, after"
                   f" {len(ran)} finished case(s); it did not judge the rest",
        "type": "interrupted"})
    suite.set("tests", str(int(suite.get("tests", "0")) + 1))
    suite.set("errors", str(int(suite.get("errors", "0")) + 1))


def line(result: CaseResult) -> str:
    """The gate's one line for a case."""
    head = f"{result.outcome:<7} {result.scenario:<17} seed={result.seed:<11} " \
           f"{result.seconds:5.1f}s"
    if result.exit_code == 0 and result.not_applicable is None:
        c = result.counts
        return (f"{head}  enqueued={c.get('enqueued', 0)} "
                f"duplicates explained={c.get('duplicate_explained', 0)} "
                f"dead letters={c.get('failed', 0)}")
    return f"{head}  {result.message()}"
