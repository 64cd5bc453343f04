"""Children fledge starts end with it: a launcher killed with SIGKILL leaves no child running."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

LAUNCHER = """
import subprocess, sys, time
from fledge.core.procs import ends_with_parent
child = subprocess.Popen(["sleep", "60"], preexec_fn=ends_with_parent(), process_group=0)
print(child.pid, flush=True)
time.sleep(60)
"""


def alive(pid: int) -> bool:
    """`pid` runs (a zombie, dead but not yet reaped by its new parent, does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError):
        return False


def test_a_child_ends_when_its_launcher_is_killed():
    """The child sits in a process group of its own (a server's engine processes do), so only
    the parent-death signal can reach it: 2 s after the launcher's SIGKILL it is gone."""
    import fledge
    env = {**os.environ, "PYTHONPATH": str(Path(fledge.__file__).parents[1])}
    p = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True, env=env)
    child = int(p.stdout.readline())
    assert alive(child)
    p.kill()
    p.wait()
    deadline = time.monotonic() + 2
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)
