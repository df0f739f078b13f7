"""No process the harness starts outlives it.

Every child the harness starts (workers, producers, the echo target, the embedded server)
asks Linux to signal it when its parent dies, even by SIGKILL, when nothing is left to clean
up after it. Elsewhere this is a no-op; the harness's own shutdown still stops them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None, signum: int = signal.SIGTERM) -> None:
    """Have the kernel send `signum` to this process when its parent dies. The parent may
    have died before this took effect: then the signal is sent at once. That is known when
    the parent is no longer `parent_pid`, or, without it, when this process was handed to
    init. Safe to call in a child between fork and exec (`preexec_fn`): ctypes is imported
    already, and only prctl, getppid and kill are called."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
        orphaned = os.getppid() != parent_pid if parent_pid is not None else os.getppid() == 1
        if orphaned:
            os.kill(os.getpid(), signum)
