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


def _module_graph() -> dict[str, set[str]]:
    """Every module of the five packages and the modules it imports (any import statement,
    inside functions and `if TYPE_CHECKING:` too: a lazy import is still a dependency)."""
    modules: dict[str, Path] = {}
    for package in LAYERS:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            modules[".".join(["skiplock", *parts[:-1 if parts[-1] == "__init__" else None]])] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            graph[name].update(m for m in found if m in modules and m != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = [stack.pop()]
            while component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others() -> None:
    """A circle of imports is two modules that are really one: split what both need into a
    third, lower one."""
    assert _cycles(_module_graph()) == []


def test_the_cycle_rule_sees_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
