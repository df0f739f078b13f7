"""`skiplock bench ...`: benchmarks, kept out of the test suite (speed is measured, not
asserted). Each benchmark lives beside what it measures and registers here."""

from __future__ import annotations

import argparse
import importlib

# name -> (module under `skiplock` exposing configure(parser) and run(args) -> int, help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "queue": ("scenarios.bench.queue", "queue-only throughput against the raw-SQL ceiling"),
    "claim": ("scenarios.bench.claim", "one claim's cost as a full account's backlog grows"),
    "e2e": ("scenarios.bench.e2e", "the queue alone, then the full path, and their ratio"),
    "checker": ("scenarios.bench.checker", "seconds to check a synthetic history"),
    "target": ("scenarios.bench.target", "the echo target's capacity on its own"),
    "dispatcher": ("scenarios.bench.dispatcher",
                   "the dispatcher's event-loop CPU per job, without a database"),
    "http": ("scenarios.bench.http", "one HTTP call's client CPU, aiohttp against the lean client"),
    "recovery": ("scenarios.bench.recovery", "time back to the pre-fault rate after each fault"),
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
