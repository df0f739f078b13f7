"""Children started under `children_deaf_to_ctrl_c` ignore SIGINT; the parent loses none."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from plumbing.orphans import children_deaf_to_ctrl_c

_REPORT_SIGINT = (
    "import signal; h = signal.getsignal(signal.SIGINT);"
    " print('ignored' if h is signal.SIG_IGN else 'handled')"
)


def test_a_python_child_started_in_the_block_ignores_sigint() -> None:
    with children_deaf_to_ctrl_c():
        child = subprocess.Popen([sys.executable, "-c", _REPORT_SIGINT],
                                 stdout=subprocess.PIPE, text=True)
    out, _ = child.communicate(timeout=30)
    assert out.strip() == "ignored"


def test_a_child_started_after_the_block_handles_sigint_again() -> None:
    with children_deaf_to_ctrl_c():
        pass
    out = subprocess.run([sys.executable, "-c", _REPORT_SIGINT], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    assert out.strip() == "handled"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_during_the_block_reaches_the_parent_after_it() -> None:
    reached_inside = False
    with pytest.raises(KeyboardInterrupt), children_deaf_to_ctrl_c():
        os.kill(os.getpid(), signal.SIGINT)
        reached_inside = True
    assert reached_inside
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
