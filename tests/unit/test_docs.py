"""The docs say what the code does, and hold together: the anomalies they list are the
checker's, every relative link and anchor resolves, every YAML block parses (a GitHub
workflow with what GitHub needs to run it), and the README stays a two-minute read."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from skiplock.reports.checker import COUNT_KEYS, MEANINGS, VIOLATION_KEYS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
RUNNABLE = "<!-- runnable -->"
# The two fresh-machine commands, byte for byte (CI runs the second; users paste both).
FRESH_MACHINE = (
    "python3 -m venv .venv && . .venv/bin/activate && python -m pip install -e . "
    "&& skiplock demo",
    "python3 -m venv .venv && . .venv/bin/activate && python -m pip install -e '.[test]' "
    "&& python -m pytest",
)


@dataclass(frozen=True, kw_only=True)
class Block:
    page: Path
    line: int  # of the opening fence, from 1
    info: str
    marker: str  # the line before the fence
    text: str


def blocks(page: Path) -> Iterator[Block]:
    """The fenced code blocks of a Markdown page (``` or ````, as CommonMark nests them)."""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(`{3,})(.*)$", lines[i])
        if not m:
            i += 1
            continue
        fence, start = m.group(1), i
        i += 1
        while i < len(lines) and not re.match(rf"^{fence}\s*$", lines[i]):
            i += 1
        yield Block(page=page, line=start + 1, info=m.group(2).strip(),
                    marker=lines[start - 1].strip() if start else "",
                    text="\n".join(lines[start + 1:i]))
        i += 1


def unfenced(page: Path) -> list[str]:
    """The page's lines outside its fenced blocks."""
    lines = page.read_text().splitlines()
    fenced: set[int] = set()
    for b in blocks(page):
        fenced.update(range(b.line - 1, b.line + b.text.count("\n") + 2))
    return [line for i, line in enumerate(lines) if i not in fenced]


def prose(page: Path) -> str:
    """The page outside its fenced blocks and its inline code (where `](` is no link)."""
    return re.sub(r"`[^`\n]*`", "", "\n".join(unfenced(page)))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than `-` and `_` dropped,
    spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    kept = "".join(c for c in text
                   if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in unfenced(page):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> Iterator[str]:
    for m in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose(page)):
        yield m.group(1)


# --------------------------------------------------------------------------------------------


def test_the_anomaly_table_names_every_anomaly_the_checker_counts() -> None:
    """The anomaly table in docs/reference/anomalies.md and the checker's one-line meanings
    (shown in the report) name the same anomalies."""
    page = (DOCS / "reference" / "anomalies.md").read_text()
    start = page.index("| anomaly | meaning |")
    rows = page[start:page.index("\n\n", start)].splitlines()[2:]
    in_docs = {row.split("|")[1].strip() for row in rows}
    assert in_docs == set(MEANINGS) == {*VIOLATION_KEYS, "duplicate_explained"}
    assert set(MEANINGS) <= set(COUNT_KEYS)


def test_the_readme_is_short_and_starts_with_the_fresh_machine_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines; move detail into docs/"
    first_section = next(i for i, line in enumerate(lines) if line.startswith("## "))
    top = [b.text for b in blocks(README) if b.line <= first_section]
    for command in FRESH_MACHINE:
        assert command in top, f"not a block of its own before the first section: {command}"


def test_the_docs_index_lists_every_page() -> None:
    index = DOCS / "README.md"
    listed = {(index.parent / link.split("#")[0]).resolve() for link in links(index)}
    pages = {p.resolve() for p in DOCS.rglob("*.md")} - {index.resolve()}
    assert pages - listed == set()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for link in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and (target.suffix != ".md" or anchor not in anchors(target)):
            broken.append(f"{link}: no heading #{anchor} in {target.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_link_checker_sees_a_broken_anchor(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A page\n\n## Exit codes: `gate`\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#exit-codes-gate) [`x`](a.md#nope)\n```\n[no](c.md)\n```\n")
    assert list(links(page)) == ["a.md#exit-codes-gate", "a.md#nope"]
    assert anchors(tmp_path / "a.md") == {"a-page", "exit-codes-gate"}


def yaml_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.info in ("yaml", "yml")]


@pytest.mark.parametrize("block", yaml_blocks(),
                         ids=lambda b: f"{b.page.relative_to(ROOT)}:{b.line}")
def test_every_yaml_block_parses_and_every_workflow_would_run(block: Block) -> None:
    doc = yaml.safe_load(block.text)
    assert isinstance(doc, dict | list), "a YAML block that is not a mapping or a list"
    assert "OWNER" not in block.text, "a placeholder GitHub would take literally"
    if not (isinstance(doc, dict) and "jobs" in doc):
        return
    # YAML 1.1 reads a bare `on` key as the boolean true, as PyYAML does; GitHub reads it
    # as `on`. Either spelling is a trigger.
    assert "on" in doc or True in doc, "a workflow with no `on:` trigger is rejected"
    permissions: dict[str, Any] = doc.get("permissions") or {}
    assert permissions, "a workflow without `permissions:` runs with the default token"
    assert permissions.get("contents") == "read"
    steps = [s for job in doc["jobs"].values() for s in job["steps"]]
    assert all(("uses" in s) != ("run" in s) for s in steps), steps
    uses = [s["uses"] for s in steps if "uses" in s]
    if any(u.startswith("mikepenz/action-junit-report") for u in uses):
        assert permissions.get("checks") == "write", "the JUnit reporter writes a check run"
    for u in uses:
        assert (u.startswith(("actions/", "mikepenz/")) or u == "./"
                or re.fullmatch(r"YOUR-ORG/skiplock@v\d+\.\d+\.\d+", u)), u
    for s in steps:
        if s.get("uses") in ("./",) or str(s.get("uses", "")).startswith("YOUR-ORG/"):
            assert set(s.get("with", {})) <= {"sql", "backend", "seeds", "seed", "only", "dsn",
                                              "out", "python-version"}, s


def test_the_docs_show_complete_workflows() -> None:
    workflows = [b for b in yaml_blocks()
                 if isinstance(doc := yaml.safe_load(b.text), dict) and "jobs" in doc]
    assert len(workflows) >= 3
    assert any("uses: ./" in b.text for b in workflows)


def test_the_action_takes_the_inputs_the_docs_pass() -> None:
    action = yaml.safe_load((ROOT / "action.yml").read_text())
    assert set(action["inputs"]) >= {"sql", "backend", "seeds", "seed", "only", "dsn", "out",
                                     "python-version"}
    assert action["inputs"]["out"]["default"] == "skiplock-gate"


def test_every_runnable_marker_opens_a_shell_block() -> None:
    lines = [(p, i) for p in PAGES for i, line in enumerate(p.read_text().splitlines())
             if line.strip() == RUNNABLE]
    marked = [b for page in PAGES for b in blocks(page) if b.marker == RUNNABLE]
    assert all(b.info == "sh" for b in marked), [(b.page.name, b.line) for b in marked
                                                 if b.info != "sh"]
    # A marker in a nested example (development.md shows one) sits inside a block.
    assert len(marked) >= 10
    assert len(lines) == len(marked) + 1
