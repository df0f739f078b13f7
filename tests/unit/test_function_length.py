"""No function is longer than a screen: a longer one is split by what its parts do (the
in-memory claim's two steps, the dispatcher's loop and its policies, a command's arguments by
group). Every package of the project is held to it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LONGEST = 60


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{path.relative_to(path.parents[1])}:{node.lineno} {node.name}: "
            f"{node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > LONGEST]


PACKAGES = ("plumbing", "queue_impl", "reports", "chaos", "scenarios")


def test_no_function_is_over_60_lines() -> None:
    long = [found for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
            for found in _long_functions(path)]
    assert not long, "split these functions:\n" + "\n".join(long)


def test_the_rule_finds_a_function_one_line_over(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(LONGEST - 1))
    module.write_text(f"def fits():\n{body}\n\nasync def over():\n{body}    return x0\n")
    assert [line.split(" ")[1] for line in _long_functions(module)] == ["over:"]
