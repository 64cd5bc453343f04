"""Checks of the command line made before any handler runs: numbers in range where a flag is
read (`number` and its shorthands, argparse types), and side outputs (--json, --png, --out)
that would overwrite an input of the same command (`check_side_outputs`). Torch-free."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from fledge.core.errors import FledgeError
from fledge.core.files import check_no_overlap

# For the handlers that write a side file: the flags naming what they write, and the flags
# naming what they read. An output that is, holds or lies inside an input is refused before
# the handler runs: `tune --json` onto its `--model` config.json would replace it.
SIDE_OUTPUTS = {
    "fledge.core.target:run_target": (("json",), ("spec",)),
    "fledge.engine.generate:run_generate": (("json",), ("messages", "target", "drafter")),
    "fledge.perf.bench:run_bench": (("json", "png"), ("log", "prompt_file", "prompts", "target", "drafter")),
    "fledge.perf.tune:run_model": (("json", "png"), ("model", "drafter", "accept_json", "hardware_profile")),
    "fledge.perf.tune:run_what_if": (("json", "png"), ("model", "drafter", "accept_json")),
    "fledge.perf.tune_engine:run_engine": (("json", "png"), ("target", "drafter", "prompts", "accept_json")),
    "fledge.perf.calibrate:cmd_calibrate": (("json", "png", "out"), ("model", "drafter", "accept_json", "merge")),
}


def _names_a_file(value: str) -> bool:
    try:
        return Path(value).exists()
    except (OSError, ValueError):  # inline JSON too long for a file name
        return False


def check_side_outputs(name: str, args) -> None:
    """Refuse an output flag of `name`'s handler that names one of its inputs (`SIDE_OUTPUTS`);
    inputs that are not paths here (built-in names, inline JSON) are skipped."""
    outs, ins = SIDE_OUTPUTS.get(name, ((), ()))
    inputs = {(k if k == "spec" else f"--{k.replace('_', '-')}"): v
              for k in ins if (v := vars(args).get(k)) and _names_a_file(v)}
    written = [vars(args).get(k) for k in outs]
    for out in filter(None, written):
        check_no_overlap(out, inputs)
    if len(set(filter(None, written))) < len(list(filter(None, written))):
        raise FledgeError(f"{', '.join(filter(None, written))}: two outputs name the same file; give each its own")


def number(kind: type, low: float, high: float = math.inf, low_open: bool = False):
    """An argparse `type` for a finite number of `kind` in [low, high] ((low, high] if
    `low_open`): zero, negative, inf and NaN are refused where the flag is read, in one line
    naming the flag, before any model loads or any file is touched."""
    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not {'an integer' if kind is int else 'a number'}") from None
        above = v > low if low_open else v >= low
        if not (math.isfinite(v) and above and v <= high):
            span = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
            raise argparse.ArgumentTypeError(f"{s}: must be {'an integer' if kind is int else 'a finite number'} {span}")
        return v
    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


positive_int = number(int, 1)
nonneg_int = number(int, 0)
positive_float = number(float, 0, low_open=True)
nonneg_float = number(float, 0)
fraction = number(float, 0, 1, low_open=True)  # a share in (0, 1]
