"""`skiplock bench ...`: benchmarks, kept out of the test suite (speed is measured, not
asserted). Each benchmark lives beside what it measures and registers here."""

from __future__ import annotations

import argparse
import importlib

# name -> (module under `skiplock` exposing configure(parser) and run(args) -> int, help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "queue": ("scenarios.bench_queue", "queue-only throughput against the raw-SQL ceiling"),
    "claim": ("scenarios.bench_claim", "one claim's cost as a full account's backlog grows"),
    "e2e": ("scenarios.bench_e2e", "the queue alone, then the full path, and their ratio"),
    "checker": ("reports.bench_checker", "seconds to check a synthetic history"),
    "target": ("chaos.bench_target", "the echo target's capacity on its own"),
    "recovery": ("scenarios.bench_recovery", "time back to the pre-fault rate after each fault"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    sub.required = True
    for name, (module_name, help_text) in BENCHMARKS.items():
        bench_parser = sub.add_parser(name, help=help_text, description=help_text)
        module = f"skiplock.{module_name}"
        importlib.import_module(module).configure(bench_parser)
        bench_parser.set_defaults(_bench_module=module)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(args._bench_module).run(args))
