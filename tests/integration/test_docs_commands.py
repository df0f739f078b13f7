"""The commands the README and docs/ mark runnable run, and exit as their page says.

A block is runnable when the line before its ```sh fence is `<!-- runnable -->`. Each command
(a line, or lines joined by a trailing backslash) runs on its own with bash, in a temporary
directory the page's commands share in order; `# exit N` at its end says it must exit N,
else it must exit 0. The rule for what to mark is in docs/development.md."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- runnable -->"
EXPECT = re.compile(r"#\s*exit\s+(\d+)\s*$")
# One command of a page may take this long; the docs test as a whole should stay near three
# minutes (docs/development.md), so a command near this limit belongs in an unmarked block.
COMMAND_TIMEOUT = 150


@dataclass(frozen=True, kw_only=True)
class Command:
    line: int  # where it starts in its page, from 1
    text: str
    expect: int


def runnable(markdown: str) -> list[Command]:
    """The runnable commands of a page, in order. A marker inside another fenced block (an
    example of the marker itself) is not one."""
    lines = markdown.splitlines()
    commands: list[Command] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"^(`{3,})", lines[i])
        if not fence:
            i += 1
            continue
        marked = i > 0 and lines[i - 1].strip() == MARKER and lines[i].strip() == "```sh"
        end = i + 1
        while end < len(lines) and lines[end].rstrip() != fence.group(1):
            end += 1
        if marked:
            commands += _commands(lines, i + 1, end)
        i = end + 1
    return commands


def _commands(lines: list[str], start: int, end: int) -> list[Command]:
    out: list[Command] = []
    pending: list[str] = []
    first = start
    for n in range(start, end):
        if not pending:
            first = n
        line = lines[n].rstrip()
        if line.endswith("\\"):
            pending.append(line[:-1])
            continue
        text = " ".join([*pending, line]).strip()
        pending = []
        if text and not text.startswith("#"):
            m = EXPECT.search(text)
            out.append(Command(line=first + 1, text=text, expect=int(m.group(1)) if m else 0))
    assert not pending, f"line {first + 1}: a runnable block ends inside a command"
    return out


def pages() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in found if runnable(p.read_text())]


def test_the_extractor_reads_commands_exit_codes_and_continuations() -> None:
    page = "\n".join([
        "<!-- runnable -->", "```sh", "skiplock --version", "# a comment, not a command",
        "skiplock run nope   # exit 2", "skiplock bench queue \\", "  --duration 2", "```",
        "```sh", "skiplock gate   # shown, not run", "```",
        "````markdown", "<!-- runnable -->", "```sh", "skiplock demo", "```", "````",
    ])
    assert runnable(page) == [
        Command(line=3, text="skiplock --version", expect=0),
        Command(line=5, text="skiplock run nope   # exit 2", expect=2),
        Command(line=6, text="skiplock bench queue    --duration 2", expect=0),
    ]


def test_the_docs_mark_the_commands_a_reader_runs_first() -> None:
    texts = [c.text for p in pages() for c in runnable(p.read_text())]
    for wanted in ("skiplock --version", "skiplock run steady", "skiplock check",
                   "skiplock report", "skiplock gate --only steady", "skiplock bench queue"):
        assert any(t.startswith(wanted) for t in texts), wanted


@pytest.mark.timeout(400)
@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_runnable_commands_of_a_page_exit_as_it_says(
    page: Path, pg_dsn: str, tmp_path: Path
) -> None:
    bin_dir = str(Path(sys.executable).parent)  # skiplock and python of this environment
    env = {**os.environ, "SKIPLOCK_PG_DSN": pg_dsn,
           "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")])}
    rel = page.relative_to(ROOT)
    for command in runnable(page.read_text()):
        started = time.monotonic()
        done = subprocess.run(["bash", "-c", command.text], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
                              check=False)
        took = time.monotonic() - started
        print(f"{rel}:{command.line}: {took:5.1f} s  exit {done.returncode}  {command.text}")
        assert done.returncode == command.expect, (
            f"{rel}:{command.line}: `{command.text}` exited {done.returncode}, expected "
            f"{command.expect}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n"
            f"{done.stderr[-3000:]}")
