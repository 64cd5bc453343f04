"""The first call of SDPA at a new shape, per backend set: cuDNN's kernel builds an execution
plan per shape. One layer's attention as the engine runs it for a prompt of L tokens (3 query
rows per kv head): masked over a 2,096-slot draft cache, and causal over itself (prefill).

    python bench/sdpa_first_call.py [--out FILE]

Prints first- and second-call milliseconds per prompt length; writes JSON.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fledge.util import atomic_write_json

SETS = {"default (cuDNN first)": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                  SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
        "without cuDNN": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]}


def calls_ms(backends, L: int, masked: bool) -> tuple[float, float]:
    S = 2096 if masked else 3 * L
    q = torch.randn(1, 3, 3 * L, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 3, S, 64, device="cuda", dtype=torch.bfloat16)
    mask = (torch.arange(S, device="cuda") <= torch.arange(3 * L, device="cuda")[:, None])[None, None] if masked else None
    out = []
    for _ in range(2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with sdpa_kernel(backends):
            F.scaled_dot_product_attention(q, k, k, attn_mask=mask, is_causal=not masked)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return out[0], out[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="57,83,121,166,203,251")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sdpa_first_call: needs CUDA", file=sys.stderr)
        return 2
    F.scaled_dot_product_attention(*(torch.randn(1, 3, 8, 64, device="cuda"),) * 3)  # CUDA context, not a plan
    rows = []
    for name, backends in SETS.items():
        for masked in (True, False):
            for L in (int(x) for x in args.lengths.split(",")):
                first, second = calls_ms(backends, L, masked)
                rows.append({"backends": name, "attention": "masked" if masked else "causal", "prompt_len": L,
                             "first_ms": first, "second_ms": second})
                print(f"{name:22s} {rows[-1]['attention']:7s} L={L:4d}  first {first:7.1f} ms  second {second:6.2f} ms")
    name = re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name().lower())
    out = args.out or Path(__file__).parent / "results" / f"sdpa_first_call_{name}.json"
    atomic_write_json(out, {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
