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
    module.write_text("def f():\n    from skiplock.scenarios.spec import load\n"
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



# --------------------------------------------------------------------------------------------
# Inside a package: no import cycle among the checker's modules, no long function in reports.
# --------------------------------------------------------------------------------------------

CHECKER = ROOT / "reports" / "checker"
MAX_FUNCTION_LINES = 60


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("skiplock", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def _import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules under `root` it imports (every import statement, those inside
    functions and under TYPE_CHECKING too). `from package import module` counts as an import
    of the module when the name is one."""
    modules = {_module_name(p): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (as the modules around it), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def _package_edges_removed(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's `__init__` importing its own submodules (as the anomalies' registry does)
    and a submodule importing a sibling through the package are one direction, not a cycle:
    only the edges from a package to the modules inside it are dropped."""
    return {name: {t for t in targets if not t.startswith(name + ".")}
            for name, targets in graph.items()}


def test_the_checker_has_no_import_cycle() -> None:
    cycle = _cycle(_package_edges_removed(_import_graph(CHECKER)))
    assert cycle is None, "import cycle in reports/checker: " + " -> ".join(cycle or [])


def test_the_cycle_rule_sees_a_cycle(tmp_path: Path) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_import_graph_sees_a_type_checking_import(tmp_path: Path) -> None:
    """The frame and slots once imported each other, one side under TYPE_CHECKING."""
    graph = _import_graph(CHECKER)
    assert "skiplock.reports.checker.frame" in graph["skiplock.reports.checker.slots"]
    assert "skiplock.reports.checker.slots" not in graph["skiplock.reports.checker.frame"]


def _long_functions(root: Path, limit: int) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} "
                                 f"({lines} lines)")
    return found


def test_no_function_in_reports_is_longer_than_60_lines() -> None:
    long = _long_functions(ROOT / "reports", MAX_FUNCTION_LINES)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_the_length_rule_sees_a_long_function(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\ndef g():\n    return 1\n")
    assert _long_functions(tmp_path, MAX_FUNCTION_LINES) == [
        "m.py:1 f (61 lines)"]
