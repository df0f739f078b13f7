"""Imports point one way. Each package may import only the packages below it:

    scenarios   workload and orchestration: spec, producers, workers, runner, CLI, provisioning
    chaos       faults: the echo target and the nemeses
    reports     what reads a run directory: history schema, checker, report, compare
    queue_impl  the systems under test
    plumbing    errors that become exit codes, argument types, process plumbing

Every import statement counts, those inside functions too (a lazy import is still a
dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("plumbing", "queue_impl", "reports", "chaos", "scenarios")


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & set(LAYERS)


def test_each_package_imports_only_the_packages_below_it() -> None:
    upward = []
    for rank, package in enumerate(LAYERS):
        for path in sorted((ROOT / package).rglob("*.py")):
            for imported in _imported_packages(path):
                if LAYERS.index(imported) > rank:
                    upward.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert not upward, "imports pointing up the layers:\n" + "\n".join(upward)


def test_the_rule_sees_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from scenarios.spec import load\n    import chaos.target\n")
    assert _imported_packages(module) == {"scenarios", "chaos"}


def test_every_package_is_placed_in_a_layer() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages == set(LAYERS), packages

