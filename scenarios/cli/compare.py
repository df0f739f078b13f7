"""`skiplock compare BASE.json NEW.json [--threshold 10%]`: a performance gate.

Both files are results of the same benchmark (`skiplock sweep`, `bench e2e`, `bench queue`,
`bench claim`, `bench target`, `bench checker`). It prints each headline figure of both,
the change, and whether it is a regression (worse by more than the threshold, in the
figure's own direction: a rate that fell, a latency that rose). Exit 1 when any figure
regressed beyond the threshold, 0 otherwise; 2 for files it cannot compare.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from skiplock.plumbing.errors import UsageError

# A figure: (name, value, True when higher is better).
Figure = tuple[str, float, bool]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("base", type=Path, help="the result to compare against")
    parser.add_argument("new", type=Path, help="the result to judge")
    parser.add_argument("--threshold", default="10%",
                        help="largest change for the worse that passes (default 10%%)")
    parser.add_argument("--strict", action="store_true",
                        help="refuse (exit 2) two results measured with different settings,"
                             " instead of warning")


def parse_threshold(text: str) -> float:
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise UsageError(f"--threshold must be a share like 10% or 0.1, got {text!r}") \
            from None
    if not (math.isfinite(value) and 0 <= value < 10):
        raise UsageError(f"--threshold must be between 0% and 1000%, got {text!r}")
    return value


def _figure(value: object, *, finite: bool = True) -> float:
    """A figure as a number; ValueError for anything a result file should not hold there
    (`true` is not 1.0, NaN is no measurement, a 400-digit number no figure of ours)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{value!r} is not a number")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"{str(value)[:20]}... is too large a number") from None
    if finite and not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number")
    return number


def _sweep(doc: dict[str, Any]) -> Iterator[Figure]:
    if doc.get("knee_rate") is not None:
        yield "knee rate (jobs/s)", _figure(doc["knee_rate"]), True
    for step in doc.get("steps", []):
        rate = f"{_figure(step['rate']):g}/s"
        yield f"delivered at {rate} (jobs/s)", _figure(step["delivered_per_second"]), True
        p99 = step.get("p99_seconds")
        if p99 is not None and math.isfinite(_figure(p99, finite=False)):
            yield f"p99 at {rate} (s)", _figure(p99), False


def _others(doc: dict[str, Any]) -> Iterator[Figure]:
    """Every other system a result measured beside the reference (`--against`)."""
    for system in ("pgqueuer", "bullmq"):
        if isinstance(doc.get(system), dict):
            yield f"{system} (jobs/s)", _figure(doc[system]["jobs_per_second"]), True
            if doc.get(f"ratio_to_{system}") is not None:
                yield (f"ratio reference / {system}", _figure(doc[f"ratio_to_{system}"]),
                       True)


def _e2e(doc: dict[str, Any]) -> Iterator[Figure]:
    yield "queue only (jobs/s)", _figure(doc["queue"]["jobs_per_second"]), True
    yield "end to end (jobs/s)", _figure(doc["e2e"]["jobs_per_second"]), True
    yield from _others(doc)
    if doc.get("ratio") is not None:
        yield "ratio end to end / queue only", _figure(doc["ratio"]), True
    if doc["e2e"].get("job_p99_ms") is not None:
        yield "end to end p99 (ms)", _figure(doc["e2e"]["job_p99_ms"]), False


def _queue(doc: dict[str, Any]) -> Iterator[Figure]:
    yield "PgQueue (jobs/s)", _figure(doc["queue"]["jobs_per_second"]), True
    yield "raw SQL ceiling (jobs/s)", _figure(doc["ceiling"]["jobs_per_second"]), True
    yield from _others(doc)
    if doc.get("ratio") is not None:
        yield "ratio queue / ceiling", _figure(doc["ratio"]), True


def _claim(doc: dict[str, Any]) -> Iterator[Figure]:
    for size in doc["sizes"]:
        yield f"claim p50 at {int(size['backlog']):,} (ms)", _figure(size["p50_ms"]), False


def _target(doc: dict[str, Any]) -> Iterator[Figure]:
    yield "requests/s", _figure(doc["results"]["requests_per_second"]), True
    if doc["results"]["latency_ms"].get("p99") is not None:
        yield "p99 (ms)", _figure(doc["results"]["latency_ms"]["p99"]), False


def _checker(doc: dict[str, Any]) -> Iterator[Figure]:
    for check in ("cold", "warm"):
        yield f"{check} check (s)", _figure(doc["seconds"][check]["total_seconds"]), False


EXTRACTORS: dict[str, Callable[[dict[str, Any]], Iterator[Figure]]] = {
    "sweep": _sweep, "e2e": _e2e, "queue": _queue, "claim": _claim, "target": _target,
    "checker": _checker,
}


# What must be equal for two results' figures to differ only by the code measured: the
# benchmark's parameters, durability, the scenario and its overrides, the machine, and the
# PostgreSQL major version.
_SETTINGS = ("params", "durability", "durable", "scenario", "overrides",
             "objective_p99_seconds", "machine.cpu", "machine.cpu_count",
             "postgres.server_version")


def settings(doc: dict[str, Any]) -> dict[str, Any]:
    """The settings of a result, flattened to dotted keys."""
    found: dict[str, Any] = {}
    for key in _SETTINGS:
        value: Any = doc
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if key == "postgres.server_version" and isinstance(value, str):
            value = value.split(".")[0]  # "15.20 (Debian ...)": the major version decides
        if isinstance(value, dict):
            found.update({f"{key}.{k}": v for k, v in value.items()})
        elif value is not None:
            found[key] = value
    return found


def setting_differences(base: dict[str, Any], new: dict[str, Any]) -> list[str]:
    a, b = settings(base), settings(new)
    return [f"{key} {a.get(key, '(none)')} -> {b.get(key, '(none)')}"
            for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"{path}: cannot read a JSON result ({exc})") from None
    except RecursionError:
        raise UsageError(f"{path}: cannot read a JSON result (nested too deeply)") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: not a result of {', '.join(sorted(EXTRACTORS))} "
                         "(no known \"benchmark\")")
    return doc


def spread(path: Path, doc: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """{figure: (lowest, highest)} over the rounds a result kept (`bench queue`, `bench e2e`
    or `bench claim` with `--rounds`),
    for figures every round has; empty for a result of one round."""
    rounds = doc.get("rounds")
    if not isinstance(rounds, list) or len(rounds) < 2:
        return {}
    kind = str(doc.get("benchmark"))
    values: dict[str, list[float]] = {}
    for number, one in enumerate(rounds):
        if not isinstance(one, dict):
            raise UsageError(f"{path}: round {number + 1} is not an object")
        _, found = figures(path, {**one, "benchmark": kind})
        for name, (value, _higher) in found.items():
            values.setdefault(name, []).append(value)
    return {name: (min(v), max(v)) for name, v in values.items() if len(v) == len(rounds)}


def _overlap(a: tuple[float, float] | None, b: tuple[float, float] | None) -> bool:
    return a is not None and b is not None and a[0] <= b[1] and b[0] <= a[1]


def figures(path: Path, doc: dict[str, Any]) -> tuple[str, dict[str, tuple[float, bool]]]:
    """(benchmark, {figure: (value, higher is better)}) of a result file read from `path`;
    UsageError for a file that is not a result skiplock can compare."""
    kind = doc.get("benchmark")
    extract = EXTRACTORS.get(kind) if isinstance(kind, str) else None
    if extract is None:
        raise UsageError(f"{path}: not a result of {', '.join(sorted(EXTRACTORS))} "
                         "(no known \"benchmark\")")
    try:
        found = {name: (value, higher) for name, value, higher in extract(doc)}
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"{path}: a {kind} result without its figures ({exc!r})") from None
    return str(kind), found


def change(base: float, new: float, higher_is_better: bool) -> float:
    """How much worse `new` is than `base`, as a share (negative: better)."""
    if base == 0:
        return 0.0 if new == 0 else (-math.inf if (new > 0) == higher_is_better else math.inf)
    worse = (base - new) / abs(base)
    return worse if higher_is_better else -worse


def run(args: argparse.Namespace) -> int:
    threshold = parse_threshold(args.threshold)
    base_doc, new_doc = _read(args.base), _read(args.new)
    base_kind, base = figures(args.base, base_doc)
    new_kind, new = figures(args.new, new_doc)
    if base_kind != new_kind:
        raise UsageError(f"cannot compare a {base_kind} result with a {new_kind} result")
    noise = (spread(args.base, base_doc), spread(args.new, new_doc))
    differences = [d for d in setting_differences(base_doc, new_doc)
                   if not d.startswith("params.rounds ")]
    if differences:
        said = "; ".join(differences)
        if args.strict:
            raise UsageError(f"the two results were measured with different settings ({said});"
                             " compare like with like, or leave out --strict")
        print(f"WARNING: measured with different settings, so a change may be theirs, not the"
              f" code's: {said}", file=sys.stderr)
    common = [name for name in base if name in new]
    if not common:
        raise UsageError("the two results share no figure (different steps or sizes?)")
    width = max(len(name) for name in common)
    print(f"{'figure':<{width}}  {'base':>12}  {'new':>12}  {'change':>8}")
    regressions = []
    for name in common:
        (b, higher), (n, _) = base[name], new[name]
        worse = change(b, n, higher)
        verdict = ""
        if _overlap(noise[0].get(name), noise[1].get(name)):
            # The rounds of the two results overlap: whatever the median moved, it is noise.
            verdict = "within noise"
        elif worse > threshold:
            verdict = "REGRESSION"
            regressions.append(name)
        elif worse < -threshold:
            verdict = "better"
        shown = f"{(n - b) / abs(b):+.1%}" if b else "n/a"
        print(f"{name:<{width}}  {b:>12,.4g}  {n:>12,.4g}  {shown:>8}  {verdict}")
    for name in sorted(set(base) ^ set(new)):
        print(f"{name:<{width}}  only in {'base' if name in base else 'new'}")
    if regressions:
        print(f"{len(regressions)} figure(s) worse by more than {threshold:.0%}: "
              f"{', '.join(regressions)}")
        return 1
    if any(noise):
        print(f"no figure worse by more than {threshold:.0%} beyond the spread of the rounds"
              " measured")
    else:
        print(f"no figure worse by more than {threshold:.0%} (one round each: the noise is"
              " unknown; `--rounds 3` on the bench measures it)")
    return 0
