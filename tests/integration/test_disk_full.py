"""A run whose disk fills stops at once with one line, instead of writing a history cut short
(and failing every write of every process until the drain times out)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 20 MiB file system of its own (tmpfs), so the run fills it after about 4 MiB."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20M", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_run_stops_when_its_disk_is_full(small_disk: Path, pg_dsn: str) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "skiplock", "run", "steady", "--rate", "400",
         "--duration", "120", "--quiet", "--dsn", pg_dsn, "--out", str(small_disk / "runs")],
        cwd=REPO, capture_output=True, text=True, timeout=220, check=False)
    took = time.monotonic() - started
    assert done.returncode == 4, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("skiplock: ")]
    assert len(errors) == 1 and "is full" in errors[0] and "free space and run again" \
        in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    # Well before the 120 s load it was asked for, let alone its drain.
    assert took < 100, took
