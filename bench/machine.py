"""Where a bench script writes its results: one file per benchmark and machine,
bench/results/<bench>_<machine>.json, rewritten by each run (history lives in git)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine_name(device: torch.device | str, gpus: int = 1) -> str:
    """'cpu', or the GPU's model without its vendor ('NVIDIA H200' -> 'h200'), 'x2' for two."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    name = re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(device).lower()).strip("_")
    return name.removeprefix("nvidia_") + (f"x{gpus}" if gpus > 1 else "")


def result_path(bench: str, machine: str, variant: str = "") -> Path:
    """bench/results/<bench>_<machine>[_<variant>].json (machine: from machine_name)."""
    return RESULTS / f"{bench}_{machine}{'_' + variant if variant else ''}.json"
