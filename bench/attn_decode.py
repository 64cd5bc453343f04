"""Decode attention at regeneration batch sizes: which kernel reads the KV cache fastest.

One layer's attention for one new token per row (SmolLM2: 9 query heads over 3 kv heads of 64),
rows of random lengths in one cache of S slots. Variants:
  sdpa_bias  what the engine runs: SDPA over the first S slots with an additive mask (G query
             rows per kv head), every row reading all S slots
  flex       FlexAttention (compiled) with a block mask built from the lengths: a row reads only
             the 128-slot blocks it uses
  bmm        scores by matmul, softmax, matmul: the plain formulation, compiled
Each is a CUDA graph timed over many replays; GB/s counts the K/V bytes a variant must read
(all S slots for sdpa/bmm, the used blocks for flex). Outputs are checked against sdpa_bias.

    python bench/attn_decode.py --shapes 256x2048,1024x512,1024x1024 [--out FILE]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from fledge.util import atomic_write_json
from profile_decode import graph_ms

BLOCK = 128


def flex_parts(lengths, S: int):
    """A BlockMask over S slots from per-row lengths (slot len_b holds this step's token), built
    with tensor ops only, so it can be rebuilt inside a captured step."""
    from torch.nn.attention.flex_attention import BlockMask

    B = lengths.shape[0]
    nblk = S // BLOCK
    num = (lengths // BLOCK + 1).to(torch.int32).view(B, 1, 1)
    idx = torch.arange(nblk, device=lengths.device, dtype=torch.int32).expand(B, 1, 1, nblk).contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= lengths[b]

    return BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(1, S))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="256x2048,1024x512,1024x1024")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("attn_decode: needs CUDA", file=sys.stderr)
        return 2
    from torch.nn.attention.flex_attention import flex_attention

    dev, dt = torch.device("cuda"), torch.bfloat16
    H, KV, D = 9, 3, 64
    G = H // KV
    flex = torch.compile(flex_attention, fullgraph=True, dynamic=False)

    @torch.compile(fullgraph=True, dynamic=False)
    def bmm(q, k, v, bias):
        s = (q @ k.transpose(-1, -2)).float() * D ** -0.5 + bias
        return (s.softmax(-1).to(v.dtype)) @ v

    rows = []
    print(f"{'batch':>5} {'slots':>5} {'variant':>10} {'us':>9} {'GB/s':>7} {'max err':>8}")
    for shape in args.shapes.split(","):
        B, S = (int(x) for x in shape.split("x"))
        g = torch.Generator(device=dev).manual_seed(0)
        k = torch.randn(B, KV, S, D, device=dev, dtype=dt, generator=g)
        v = torch.randn(B, KV, S, D, device=dev, dtype=dt, generator=g)
        q = torch.randn(B, H, 1, D, device=dev, dtype=dt, generator=g)
        lengths = torch.randint(S // 4, S, (B,), device=dev, generator=g)
        keep = torch.arange(S, device=dev) <= lengths[:, None]
        bias = torch.zeros(B, 1, G, S, device=dev, dtype=dt).masked_fill_(~keep[:, None, None], float("-inf"))
        qg = q.view(B, KV, G, D)
        variants = {
            "sdpa_bias": (lambda: F.scaled_dot_product_attention(qg, k, v, attn_mask=bias).view(B, H, 1, D), B * S),
            "flex": (lambda: flex(q, k, v, block_mask=flex_parts(lengths, S), enable_gqa=True),
                     int(((lengths // BLOCK + 1) * BLOCK).sum())),
            "bmm": (lambda: bmm(qg, k, v, bias.float()).view(B, H, 1, D), B * S),
        }
        ref = variants["sdpa_bias"][0]().float()
        for name, (fn, slots_read) in variants.items():
            try:
                err = (fn().float() - ref).abs().max().item()
                us = 1e3 * graph_ms(fn, args.iters)
            except Exception as e:  # a variant the installed torch cannot run is reported, not fatal
                print(f"{B:>5} {S:>5} {name:>10}  failed: {type(e).__name__}: {str(e)[:160]}")
                rows.append({"batch": B, "slots": S, "variant": name, "error": f"{type(e).__name__}: {e}"[:400]})
                continue
            gbs = slots_read * KV * D * 2 * 2 / (us * 1e-6) / 1e9
            rows.append({"batch": B, "slots": S, "variant": name, "us": us, "kv_gb_s": gbs, "max_abs_err": err,
                         "mean_len": float(lengths.float().mean())})
            print(f"{B:>5} {S:>5} {name:>10} {us:>9.1f} {gbs:>7.0f} {err:>8.4f}")
    name = re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(dev).lower())
    out = args.out or Path(__file__).parent / "results" / f"attn_decode_{name}.json"
    atomic_write_json(out, {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                            "heads": [H, KV, D], "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
