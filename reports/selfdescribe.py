"""Self-description for result files: machine, Python, package versions, PostgreSQL version
and settings, git sha and dirty flag. A number without these cannot be compared with another.

One module for every writer (run directories and all benchmarks), in `reports` because that is
the layer `scenarios`, `chaos` and `reports` itself may all import.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg

from skiplock import __version__

PACKAGES = (
    "skiplock",
    "psycopg",
    "psycopg-pool",
    "locust",
    "gevent",
    "multiprocess",
    "aiohttp",
    "pandas",
    "numpy",
    "pyarrow",
    "pgserver",
    # The queues measured beside the reference, and their clients (None: not installed).
    "bullmq",
    "redis",
    "pgqueuer",
    "asyncpg",
)

# Settings that change what a run measures or whether a crash can lose commits.
PG_SETTINGS = (
    "fsync",
    "synchronous_commit",
    "full_page_writes",
    "wal_level",
    "shared_buffers",
    "max_connections",
    "work_mem",
    "default_transaction_isolation",
    "jit",
)

# The checkout this module was loaded from; an installed wheel has none (site-packages may sit
# inside somebody else's repository, whose commit would say nothing about skiplock).
REPO_ROOT = Path(__file__).resolve().parent.parent


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine() -> dict[str, Any]:
    """The machine now, load average included: a figure taken on a busy machine says so."""
    return {
        "hostname": platform.node(),
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def python() -> dict[str, Any]:
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
    }


def packages() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_info(root: Path = REPO_ROOT) -> dict[str, Any]:
    """The commit and whether the tree had uncommitted changes (None when not a checkout)."""
    if not (root / ".git").exists():
        return {"sha": None, "dirty": None, "branch": None}

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if sha is None:
        return {"sha": None, "dirty": None, "branch": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "sha": sha,
        "dirty": None if status is None else bool(status),
        "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
    }


def postgres(dsn: str) -> dict[str, Any]:
    """Server version and the settings that matter for durability and speed."""
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        version = conn.execute("SELECT version()").fetchone()
        rows = conn.execute(
            "SELECT name, current_setting(name) FROM pg_settings WHERE name = ANY(%s)",
            [list(PG_SETTINGS)],
        ).fetchall()
        version_num = conn.info.server_version
    settings = {str(name): str(value) for name, value in rows}
    return {
        "version": version[0] if version else None,
        "server_version_num": version_num,
        "settings": settings,
    }


def describe(dsn: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "skiplock": {"version": __version__},
        "machine": machine(),
        "python": python(),
        "packages": packages(),
        "git": git_info(),
    }
    if dsn is not None:
        out["postgres"] = postgres(dsn)
    return out
