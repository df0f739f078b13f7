"""Children started under `children_deaf_to_ctrl_c` never receive SIGINT; the parent loses
none."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from skiplock.plumbing.orphans import children_deaf_to_ctrl_c

# The child sends itself SIGINT: it says whether it survived, blocked, with the signal pending.
_SURVIVES_SIGINT = (
    "import os, signal, time; os.kill(os.getpid(), signal.SIGINT); time.sleep(0.05);"
    " print('deaf' if signal.SIGINT in signal.sigpending() else 'not blocked')"
)


@pytest.fixture(autouse=True)
def python_handles_sigint() -> Iterator[None]:
    """Python's own SIGINT handling, whatever this test process was started with (a job put
    in the background by a shell starts with SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_child_started_in_the_block_survives_sigint() -> None:
    with children_deaf_to_ctrl_c():
        child = subprocess.Popen([sys.executable, "-c", _SURVIVES_SIGINT],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = child.communicate(timeout=30)
    assert (child.returncode, out.strip()) == (0, "deaf"), err


def test_a_child_started_after_the_block_is_interrupted() -> None:
    with children_deaf_to_ctrl_c():
        pass
    child = subprocess.run([sys.executable, "-c", _SURVIVES_SIGINT], capture_output=True,
                           text=True, timeout=30, check=False)
    assert "KeyboardInterrupt" in child.stderr
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())


@pytest.mark.parametrize("other_thread", [False, True], ids=["alone", "beside-a-thread"])
def test_a_ctrl_c_during_the_block_still_reaches_this_process(other_thread: bool) -> None:
    # With another thread running, the kernel hands it the signal at once (SIGINT is blocked
    # only in this one); alone, the signal waits for the block to end.
    done = threading.Event()
    helper = threading.Thread(target=done.wait, daemon=True)
    if other_thread:
        helper.start()
    with pytest.raises(KeyboardInterrupt):
        with children_deaf_to_ctrl_c():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # another thread may take it at once: Python raises it here
        time.sleep(0.05)  # or it waited for the block to end
    done.set()
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
