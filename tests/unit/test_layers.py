"""Imports point one way. Each package may import only the packages below it:

    scenarios   commands (cli), one run (run), servers, benchmarks (bench)
    chaos       faults: the echo target and the nemeses
    reports     what reads a run directory: history schema, checker, report
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
            found.update(_part(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(_part(node.module))
    return found & set(LAYERS)


def _part(module: str) -> str:
    """`skiplock.reports.checker` -> `reports`; a top-level name as it is."""
    names = module.split(".")
    return names[1] if names[0] == "skiplock" and len(names) > 1 else names[0]


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
    module.write_text("def f():\n    from skiplock.scenarios.run.spec import load\n"
                      "    import skiplock.chaos.target\n")
    assert _imported_packages(module) == {"scenarios", "chaos"}


def test_every_package_is_placed_in_a_layer() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"skiplock"}
    assert packages == set(LAYERS), packages


def test_the_namespace_links_every_package_and_nothing_else() -> None:
    linked = {p.name: p for p in (ROOT / "skiplock").iterdir() if p.is_symlink()}
    assert set(linked) == set(LAYERS), sorted(linked)
    for name, link in linked.items():
        assert link.resolve() == (ROOT / name).resolve(), f"skiplock/{name} points elsewhere"


def test_nothing_imports_a_package_by_its_folder_name() -> None:
    """From the checkout, `import reports` would load a second copy of the modules that
    `skiplock.reports` already loaded (and a wheel has no such top-level package at all)."""
    tops = set(LAYERS)
    stray = []
    for folder in (*LAYERS, "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                stray += [f"{path.relative_to(ROOT)}: {m}" for m in modules
                          if m.split(".")[0] in tops]
    assert not stray, "imports outside the skiplock namespace:\n" + "\n".join(stray)



def test_scenarios_is_four_subpackages_and_the_pytest_entry_point() -> None:
    """Commands, the run itself, servers and benchmarks each have a folder: a new module goes
    into one of them, not beside them."""
    scenarios = ROOT / "scenarios"
    loose = {p.name for p in scenarios.glob("*.py")} - {"__init__.py", "pytest_plugin.py"}
    folders = {p.parent.name for p in scenarios.glob("*/__init__.py")}
    assert not loose, f"modules outside scenarios' subpackages: {sorted(loose)}"
    assert folders == {"cli", "run", "servers", "bench"}, folders


def _module_imports(folder: Path, package: str) -> dict[str, set[str]]:
    """Each module of `folder` (the package `skiplock.<package>`) -> the modules of the same
    package it imports, at any depth (a lazy import inside a function counts)."""
    prefix = f"skiplock.{package}."
    modules = {p.stem for p in folder.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        found: set[str] = set()
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
                if node.module == f"skiplock.{package}":
                    names = [f"{prefix}{alias.name}" for alias in node.names]
            found.update(n[len(prefix):].split(".")[0] for n in names if n.startswith(prefix))
        graph[path.stem] = (found & modules) - {path.stem}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (its modules in order, the first repeated), or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module):], module]
        if module in done:
            return None
        for imported in sorted(graph.get(module, ())):
            found = visit(imported, [*path, module])
            if found is not None:
                return found
        done.add(module)
        return None

    for module in sorted(graph):
        found = visit(module, [])
        if found is not None:
            return found
    return None


def test_no_import_cycle_inside_queue_impl() -> None:
    """Modules of the systems under test import one way too: shared pieces (events, config,
    failpoints, delivery) live in modules that the dispatcher and the native loops both
    import, never in one of them."""
    graph = _module_imports(ROOT / "queue_impl", "queue_impl")
    assert "dispatcher" in graph and graph["native"], graph
    cycle = _cycle(graph)
    assert cycle is None, "import cycle in queue_impl: " + " -> ".join(cycle or [])


def test_the_rule_sees_an_import_cycle(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from skiplock.queue_impl.b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    import skiplock.queue_impl.c\n")
    (tmp_path / "c.py").write_text("from skiplock.queue_impl import a\n")
    (tmp_path / "d.py").write_text("from skiplock.queue_impl.a import y\n")
    graph = _module_imports(tmp_path, "queue_impl")
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    graph["c"] = set()
    assert _cycle(graph) is None
