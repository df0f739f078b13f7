"""Errors the CLI turns into exit codes without a traceback, and SIGTERM as one of them.

`main()` in `skiplock.scenarios.cli.main` is the one place that maps them: `UsageError` 2,
`HarnessError` 4, `Terminated` 143, any other `KeyboardInterrupt` 130, anything unexpected 4.
Exit code 1 is left to verdicts alone.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class UsageError(Exception):
    """Bad input or usage: exit code 2 and this one line, which says what to fix."""

    exit_code = 2


class Unhonoured(UsageError):
    """A scenario setting the system under test cannot honour (a promise it does not make):
    bad input for one run, exit 2; the gate lists such a case as not applicable."""


class HarnessError(Exception):
    """The harness itself failed (a server would not start, a child died): exit code 4."""

    exit_code = 4


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be, so every cleanup that runs for Ctrl-C (stopping
    processes, the final snapshot of a run, removing an embedded server) runs for both."""

    exit_code = 128 + signal.SIGTERM


class _OnSigterm:
    """The SIGTERM handler `sigterm_as_interrupt` installs; a class so that a nested use can
    recognise it and leave it in place."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.seen = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.owner:
            # A process forked from this one inherited the handler: behave as if it had none,
            # rather than raise in a copy of this program.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.seen:
            return
        self.seen = True
        raise Terminated()


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM raises `Terminated` in the main thread of this process.

    Only the first SIGTERM raises: later ones (a supervisor repeating itself) are ignored so
    that they cannot cut the cleanup short; SIGKILL remains for an impatient caller, and the
    child processes die with this one (they ask Linux for a parent-death signal).

    Nested uses share the outermost handler, so an inner one (an embedded server's lifetime
    inside a command) neither replaces how the command unwinds nor resets its "first SIGTERM
    only" state. Off the main thread, where Python cannot install handlers, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    current = signal.getsignal(signal.SIGTERM)
    if isinstance(current, _OnSigterm) and current.owner == os.getpid():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _OnSigterm())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
