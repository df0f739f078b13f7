"""The wheel carries the whole tree under one `skiplock` namespace, and nothing else.

Package lists written by hand once left every subpackage out of the wheel (the checkout
worked, an installed skiplock did not); this test builds the wheel and holds its file list
equal to the source tree, so a new subpackage or data file can never be left out again.
`.ci/installed-wheel` then installs that wheel outside the checkout and runs it."""

from __future__ import annotations

import configparser
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
PARTS = ("plumbing", "queue_impl", "scenarios", "chaos", "reports")
# Files of the source tree that the wheel carries: code and the data a run reads.
SHIPPED_SUFFIXES = {".py", ".sql", ".toml"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    # A clean copy of the tracked tree: a `build/` left by an earlier build would otherwise be
    # reused, and the wheel could carry files the configuration no longer ships.
    source = tmp_path_factory.mktemp("source")
    subprocess.run(f"git ls-files -z | xargs -0 cp -P --parents -t {shlex.quote(str(source))}",
                   shell=True,
                   cwd=REPO, check=True)
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=280, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [built] = out.glob("skiplock-*.whl")
    return zipfile.ZipFile(built)


def _source_files() -> set[str]:
    tracked = subprocess.run(["git", "ls-files", *PARTS], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    return {f"skiplock/{path}" for path in tracked if Path(path).suffix in SHIPPED_SUFFIXES}


def test_the_wheel_holds_every_source_file_under_skiplock(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    packaged = {n for n in names if not n.split("/")[0].endswith(".dist-info")}
    expected = _source_files() | {"skiplock/__init__.py", "skiplock/__main__.py",
                                   "skiplock/py.typed"}
    assert expected - packaged == set(), "left out of the wheel"
    assert packaged - expected == set(), "in the wheel but not in the source tree"
    # Every top-level name is `skiplock`: nothing generic lands in a user's site-packages.
    assert {n.split("/")[0] for n in packaged} == {"skiplock"}


def test_the_wheel_entry_points_name_skiplock_modules(wheel: zipfile.ZipFile) -> None:
    [entry_points] = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parsed = configparser.ConfigParser()
    parsed.read_string(wheel.read(entry_points).decode())
    assert parsed["console_scripts"]["skiplock"] == "skiplock.scenarios.cli.main:main"
    assert parsed["pytest11"]["skiplock"] == "skiplock.scenarios.pytest_plugin"
