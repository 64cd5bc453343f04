"""Processes of their own for the kill -9 / SIGINT / resume tests, without an interpreter start each.

Each start of `python -m fledge.cli` spends 5-20 s of a 2-core CPU importing torch and
transformers before the run begins. Here a process is forked from one server (multiprocessing's
forkserver) that imported them and fledge's step modules once per test process, and never ran
an op: the forked run is still a separate process in a session of its own, so kill -9, SIGINT,
its exit code and what it leaves on disk are those of a `fledge` command run from the shell.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import time
from pathlib import Path

from conftest import session_processes

TESTS = Path(__file__).resolve().parent
# What the runs would import: the server imports it once (a module it lacks is imported by the run).
PRELOAD = ["torch", "transformers", "transformers.models.auto.tokenization_auto", "conftest", "forked", "fledge.cli",
           "fledge.core.target", "fledge.engine.hf", "fledge.train.capture_run", "fledge.train.loop",
           "fledge.data.regen", "fledge.drafter.export"]


def server():
    """The forkserver context, its server started with this process's fledge and tests first on
    its path (it is a fresh interpreter: otherwise it could import an installed fledge)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), *([old] if old else [])])
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    return ctx


def _child(fn, args, env, log):
    """In the forked process: a session of its own (as `start_new_session`), the caller's
    environment, output to `log` (or nowhere), Ctrl-C as a fresh interpreter has it, and the
    thread count OMP_NUM_THREADS would give (1 unless set, as the tests' own process runs)."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    out = os.open(log or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import torch
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.exit(fn(*args))


def start(fn, *args, env: dict | None = None, log: Path | None = None) -> multiprocessing.Process:
    """`fn(*args)` (a module-level function; its return value is the exit code) in a forked process."""
    p = server().Process(target=_child, args=(fn, args, dict(os.environ if env is None else env), log and str(log)))
    p.start()
    return p


def fledge(argv, **kw) -> multiprocessing.Process:
    """`fledge ARGV` in a forked process: `python -m fledge.cli ARGV`'s code path and exit code."""
    from fledge import cli
    return start(cli.main, [str(a) for a in argv], **kw)


def wait(p: multiprocessing.Process, timeout: float | None = None) -> int:
    """The exit code, or minus the signal that ended it (as subprocess's returncode)."""
    p.join(timeout)
    return p.exitcode


def kill_at(argv, env: dict, points, settle: float = 0.0) -> int:
    """`fledge ARGV` run in a forked process once per point, killed -9 when that point is
    `reached()` (or let to end); nothing of its session may be alive `settle` seconds later. How
    many kills landed on a running process."""
    landed = 0
    for reached in points:
        p = fledge(argv, env=env)
        while p.is_alive() and not reached():
            time.sleep(0.01)
        landed += p.is_alive()
        p.kill()
        p.join()
        time.sleep(settle)
        assert session_processes(p.pid) == [], "processes of the killed run still alive"
    return landed
