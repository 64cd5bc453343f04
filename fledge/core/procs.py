"""Child processes that end with the process that started them, kill -9 included."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _arm(sig: int) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux only; a no-op
    elsewhere). The setting survives exec, so a child armed between fork and exec keeps it."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def die_with_parent(parent_pid: int) -> None:
    """Run first in a worker started by `parent_pid`: the kernel kills the worker when its
    parent dies (Linux's parent-death signal), so a killed run leaves no worker writing
    beside its rerun. A parent already gone before the signal was armed ends the worker now.
    Elsewhere (no prctl) workers still end when their task queue closes."""
    _arm(signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)


def ends_with_parent(sig: int = signal.SIGTERM):
    """A `preexec_fn` for `subprocess.Popen`: the child gets `sig` when the thread that started
    it dies, kill -9 included, and one whose parent died before it was armed gets it at once.
    SIGTERM, not SIGKILL, for a server that must stop processes of its own (vLLM's engine)."""
    parent = os.getpid()

    def arm() -> None:
        _arm(sig)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)
    return arm
