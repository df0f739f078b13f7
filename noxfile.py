"""Developer sessions: `nox -s tests`, `nox -s lint`, `nox -s typecheck`.

The test session needs no server: the suite provisions its own PostgreSQL (the DSN in
SKIPLOCK_PG_DSN if set, else Docker, else the embedded server shipped with the package).
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"
# Files held to `ruff format`; the rest of the tree is held to `ruff check` only.
FORMATTED = [
    "noxfile.py",
    "scenarios/servers/postgres.py",
    "scenarios/bench/queue.py",
    "tests/conftest.py",
    "tests/unit/test_provision.py",
    "tests/integration/test_provision.py",
    "tests/integration/test_bench_queue.py",
]


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The README's test command, in a fresh virtualenv."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session(python=PYTHON)
def gate(session: nox.Session) -> None:
    """The CI correctness gate on the reference queue (pass e.g. `-- --sql my.sql`)."""
    session.install("-e", ".")
    session.run("skiplock", "gate", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check over the tree; ruff format over the files listed in FORMATTED."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", *FORMATTED)


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy strict over the four packages (configured in pyproject.toml)."""
    session.install("-e", ".[test]")
    session.run("mypy")
