"""Torch devices and dtypes from flag values, each refused in one line when this machine lacks it."""

from __future__ import annotations

from fledge.core.catalog import FLOAT_DTYPES, SHORT_DTYPES
from fledge.core.errors import FledgeError


def pick_device(name: str | None):
    """The torch device for a `--device` value: None → cuda if available, else cpu. A device
    this machine does not have is a FledgeError saying what to pass instead."""
    import torch

    if not name:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise FledgeError(f"--device {name}: not a device name (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise FledgeError(f"--device {name}: this machine has no CUDA device; pass --device cpu (or leave it out)")
        if dev.index is not None and dev.index >= n:
            raise FledgeError(f"--device {name}: this machine has {n} CUDA device(s): cuda:0 to cuda:{n - 1}")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise FledgeError(f"--device {name}: MPS is not available here; pass --device cpu (or leave it out)")
    return dev


def short_dtype(name: str) -> str:
    """The short spelling (bf16, fp16, fp32) of a float dtype name, as feature directories and
    the hardware model write it; a name with no short spelling (fp8, int4) is returned as given."""
    short = {v: k for k, v in SHORT_DTYPES.items()}
    return short.get(name, name)


def parse_dtype(name: str, flag: str = "--dtype"):
    """The torch dtype of a float dtype spelled as torch does (bfloat16) or short (bf16); any
    other name is a FledgeError naming `flag` and the names it takes."""
    import torch

    if name not in FLOAT_DTYPES and name not in SHORT_DTYPES:
        raise FledgeError(f"{flag} {name}: choose one of {', '.join([*FLOAT_DTYPES, *SHORT_DTYPES])}")
    return getattr(torch, SHORT_DTYPES.get(name, name))


def pick_dtype(name: str | None, device):
    """The torch dtype for a `--dtype` value: None → bfloat16 on cuda, float32 elsewhere."""
    return parse_dtype(name or ("bfloat16" if device.type == "cuda" else "float32"))
