"""Where a bench script writes its results: one file per benchmark and machine,
bench/results/<bench>_<machine>.json, rewritten by each run (history lives in git); and how it
runs a step of the pipeline as a command (`run_logged`)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parents[1]


def machine_name(device: torch.device | str, gpus: int = 1) -> str:
    """'cpu', or the GPU's model without its vendor ('NVIDIA H200' -> 'h200'), 'x2' for two."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    name = re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(device).lower()).strip("_")
    return name.removeprefix("nvidia_") + (f"x{gpus}" if gpus > 1 else "")


def git_commit(where: Path = REPO) -> str | None:
    """The short commit checked out at `where` (default this checkout), or None where there is
    no git (a copy without history): the JSON then says so instead of naming a wrong commit."""
    try:
        res = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=False)
    except OSError:
        return None
    return res.stdout.strip() or None


def result_path(bench: str, machine: str, variant: str = "") -> Path:
    """bench/results/<bench>_<machine>[_<variant>].json (machine: from machine_name)."""
    return RESULTS / f"{bench}_{machine}{'_' + variant if variant else ''}.json"


def run_logged(cmd: list, log: Path, env: dict | None = None) -> float:
    """Run `cmd` with its output shown and kept in `log`; its wall seconds. A failure raises
    with the log's tail."""
    from fledge.core.errors import FledgeError

    cmd = [str(c) for c in cmd]
    log.parent.mkdir(parents=True, exist_ok=True)
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        while chunk := proc.stdout.read1(1 << 14):
            f.write(chunk)
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
        rc = proc.wait()
    if rc:
        tail = log.read_text(errors="replace")[-3000:]
        raise FledgeError(f"{cmd[0]} {' '.join(cmd[1:4])} ... exited {rc} (full log: {log}):\n{tail}")
    return time.perf_counter() - t0
