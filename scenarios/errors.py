"""Errors the CLI turns into exit codes without a traceback."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input or usage: exit code 2 and this one line, which says what to fix."""

    exit_code = 2


class HarnessError(Exception):
    """The harness itself failed (a server would not start, a child died): exit code 4."""

    exit_code = 4
