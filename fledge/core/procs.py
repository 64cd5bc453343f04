"""Worker processes that end with the process that started them, kill -9 included."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int) -> None:
    """Run first in a worker started by `parent_pid`: the kernel kills the worker when its
    parent dies (Linux's parent-death signal), so a killed run leaves no worker writing
    beside its rerun. A parent already gone before the signal was armed ends the worker now.
    Elsewhere (no prctl) workers still end when their task queue closes."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)
