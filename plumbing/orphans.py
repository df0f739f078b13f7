"""No process the harness starts outlives it, and no folder of an embedded server either.

Every child the harness starts (workers, producers, the echo target, the embedded server)
asks Linux to signal it when its parent dies, even by SIGKILL, when nothing is left to clean
up after it. Elsewhere this is a no-op; the harness's own shutdown still stops them.

A signal cannot remove a folder, and the server cannot remove its own data folder while it
runs in it, so an embedded server also gets a *remover*: a tiny process started beside it
(this file run as a script, standard library only) that waits, doing nothing, until the
harness closes its end of a pipe or dies. Then it stops whatever is left of the server and
deletes the folder. It runs in its own session and ignores SIGINT, SIGTERM and SIGHUP, so a
Ctrl-C in the terminal or a signal to the harness's process group cannot take it down
before the harness has died; a SIGKILL of the remover itself leaves the folder to the next
start's sweep, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

_PR_SET_PDEATHSIG = 1
# How often the remover checks that its parent is still the harness (the pipe's end-of-file
# usually says so first).
_POLL_SECONDS = 0.5
# How long the remover gives what is left of a server to exit before SIGKILL.
_SERVER_EXIT_SECONDS = 10.0
# How long the harness waits for the remover to finish once it has closed the pipe.
_REMOVER_EXIT_SECONDS = 15.0


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


@contextlib.contextmanager
def children_deaf_to_ctrl_c() -> Iterator[None]:
    """Processes started inside this block never receive SIGINT.

    A Ctrl-C in a terminal goes to the whole process group. A child that the harness stops
    itself (with SIGTERM, once it has taken the final snapshot) must not also take that
    SIGINT: caught half-way through its start-up imports it would print a traceback before
    any handler of its own exists. SIGINT is blocked in this thread for the block, and a
    child inherits its parent's signal mask through fork and exec, so the child starts, and
    stays, with SIGINT blocked. This process's own handling is unchanged: a SIGINT that
    arrives meanwhile is taken by another thread (Python still runs the handler in the main
    thread) or waits until the block ends; it is not lost."""
    if threading.current_thread() is not threading.main_thread():
        yield  # children forked from another thread get that thread's mask; leave it alone
        return
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)


def name_this_process(name: str) -> None:
    """Set this process's name as `ps`, `top` and /proc/PID/stat show it (Linux: at most 15
    bytes), so a person, and `skiplock sweep`'s CPU accounting, can tell a worker from a
    producer or a target among processes whose command lines are all Python's."""
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(name[:15])


class FolderRemover:
    """The harness's end of a remover process (see the module's docstring)."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    def close(self) -> None:
        """Tell the remover the harness is done (it removes whatever is left, which after an
        orderly stop is nothing) and reap it, so no process is left behind."""
        process = self.process
        if process.stdin is not None:
            # A byte, not only end-of-file: a process forked from the harness may still hold
            # a copy of the pipe's end, and would delay end-of-file until it exits.
            with contextlib.suppress(OSError, ValueError):
                process.stdin.write(b"x")
                process.stdin.flush()
            with contextlib.suppress(OSError, ValueError):
                process.stdin.close()
        try:
            process.wait(timeout=_REMOVER_EXIT_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def start_folder_remover(root: Path, server_pid_file: Path) -> FolderRemover | None:
    """Start a remover for `root`: once this process closes the remover's pipe or dies, any
    server whose command line names `server_pid_file`'s folder is stopped, then `root` is
    deleted. None where it cannot be started (then the next start's sweep removes `root`)."""
    argv = [
        sys.executable,
        "-I",  # isolated: no PYTHON* variables, no user site, no script folder on sys.path
        "-S",  # no site: the remover needs the standard library only
        str(Path(__file__).resolve()),
        str(root),
        str(server_pid_file),
        str(os.getpid()),
    ]
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
            start_new_session=True,
        )
    except OSError:
        return None
    return FolderRemover(process)


def _recorded_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _server_pid(pid: int, data: Path) -> int | None:
    """`pid`, if that process runs the server of `data` (Linux: by its command line)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    # A recycled pid runs something else: its command line does not name this data folder.
    return pid if str(data).encode() in cmdline else None


def _alive(pid: int) -> bool:
    """Running, not a zombie: an exited server whose new parent (init, or a container's
    first process) is slow to reap it has stopped all the same."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _stop_server(pid_file: Path) -> bool:
    """Stop what is left of the server; True when none of it runs any more."""
    recorded = _recorded_pid(pid_file)
    if recorded is None or not _alive(recorded):
        return True
    if not Path("/proc/self").exists():
        # Not Linux: the process cannot be told apart from a stranger that got the same pid,
        # so leave both it and the folder alone (the next start's sweep decides).
        return False
    pid = _server_pid(recorded, pid_file.parent)
    if pid is None:
        return True  # that pid runs something else now: the server is gone
    # SIGQUIT is PostgreSQL's immediate shutdown (the parent-death signal may have sent it
    # already); the server runs in its own session, so its process group is its pid.
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGQUIT)
    deadline = time.monotonic() + _SERVER_EXIT_SECONDS
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    # Backends exit with the postmaster; make sure none of its group lingers.
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + _SERVER_EXIT_SECONDS
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _remove_when_released(root: Path, pid_file: Path, harness: int) -> int:
    """The remover's life: wait for a byte or end-of-file on stdin, or for the harness to
    die, then clean up."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    stdin = sys.stdin.fileno()
    while os.getppid() == harness:
        ready, _, _ = select.select([stdin], [], [], _POLL_SECONDS)
        if ready:
            break
    if _stop_server(pid_file):
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(_remove_when_released(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])))
