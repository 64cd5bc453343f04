"""Decode and verify attention: which kernel reads the KV cache fastest, from batch 1 to
regeneration batch sizes.

One layer's attention for T new tokens per row (SmolLM2: 9 query heads over 3 kv heads of 64),
rows of random lengths in one cache of S slots; T > 1 is a verify step over a random tree.
Variants:
  sdpa_bias  the dense path: SDPA over the first S slots with an additive mask (G query rows
             per kv head), every row reading all S slots
  prefix     fledge.engine.attention.prefix_attention (Triton): a row reads only its own slots,
             split over the slots when the batch is small
  flex       FlexAttention (compiled) with a block mask built from the lengths: a row reads only
             the 128-slot blocks it uses (T = 1 only)
  bmm        scores by matmul, softmax, matmul: the plain formulation, compiled
Each is a CUDA graph timed over many replays; GB/s counts the K/V bytes a variant must read
(all S slots for sdpa/bmm, the used slots for prefix, the used blocks for flex). Outputs are
checked against sdpa_bias.

    python bench/attn_decode.py --shapes 1x384,1x384x16,256x2048,1024x512,1024x1024 [--out FILE]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from fledge.engine.attention import Prefix, prefix_attention
from fledge.engine.tree import ancestors
from fledge.util import atomic_write_json
from machine import machine_name, result_path
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
    p.add_argument("--shapes", default="1x384,1x1024,1x384x16,1x384x64,256x2048,1024x512,1024x1024",
                   help="BATCHxSLOTS[xNEW_TOKENS], comma-separated")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--device", default="cuda", help="cpu: check outputs only (the kernel interpreted), no timing")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("attn_decode: needs CUDA", file=sys.stderr)
        return 2
    from torch.nn.attention.flex_attention import flex_attention

    dev = torch.device(args.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    H, KV, D = 9, 3, 64
    G = H // KV
    flex = torch.compile(flex_attention, fullgraph=True, dynamic=False)

    @torch.compile(fullgraph=True, dynamic=False)
    def bmm(q, k, v, bias):
        s = (q @ k.transpose(-1, -2)).float() * D ** -0.5 + bias
        return (s.softmax(-1).to(v.dtype)) @ v

    rows = []
    print(f"{'batch':>5} {'slots':>5} {'new':>4} {'variant':>10} {'us':>9} {'GB/s':>7} {'max err':>8}")
    for shape in args.shapes.split(","):
        B, S, T = ([int(x) for x in shape.split("x")] + [1])[:3]
        g = torch.Generator(device=dev).manual_seed(0)
        k = torch.randn(B, KV, S, D, device=dev, dtype=dt, generator=g)
        v = torch.randn(B, KV, S, D, device=dev, dtype=dt, generator=g)
        q = torch.randn(B, KV, G * T, D, device=dev, dtype=dt, generator=g)
        lengths = torch.randint(S // 4, S - T + 1, (B,), device=dev, generator=g)
        parents = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev)] +
                            [torch.randint(0, i, (B, 1), device=dev, generator=g) for i in range(1, T)], 1)
        prefix = Prefix(lengths, ancestors(parents))
        bias = torch.zeros(B, 1, G * T, S, device=dev, dtype=dt).masked_fill_(
            ~prefix.dense(S).repeat(1, 1, G, 1), float("-inf"))
        used = int((lengths + T).sum())
        # this step's K/V as the cache already holds them, so the kernel's own write changes nothing
        new = (lengths[:, None] + torch.arange(T, device=dev))[:, None, :, None].expand(B, KV, T, D)
        k_new, v_new = k.gather(2, new), v.gather(2, new)
        variants = {
            "sdpa_bias": (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias), B * S),
            "prefix": (lambda: prefix_attention(q, k_new, v_new, k, v, prefix), used),
            "bmm": (lambda: bmm(q, k, v, bias.float()), B * S),
        }
        if T == 1 and dev.type == "cuda":
            variants["flex"] = (lambda: flex(q.view(B, H, 1, D), k, v, block_mask=flex_parts(lengths, S),
                                             enable_gqa=True).view(B, KV, G, D),
                                int(((lengths // BLOCK + 1) * BLOCK).sum()))
        ref = variants["sdpa_bias"][0]().float()
        for name, (fn, slots_read) in variants.items():
            try:
                err = (fn().float() - ref).abs().max().item()
                us = 1e3 * graph_ms(fn, args.iters) if dev.type == "cuda" else float("nan")
            except Exception as e:  # a variant the installed torch cannot run is reported, not fatal
                print(f"{B:>5} {S:>5} {T:>4} {name:>10}  failed: {type(e).__name__}: {str(e)[:160]}")
                rows.append({"batch": B, "slots": S, "new_tokens": T, "variant": name, "error": f"{type(e).__name__}: {e}"[:400]})
                continue
            gbs = slots_read * KV * D * 2 * 2 / (us * 1e-6) / 1e9
            rows.append({"batch": B, "slots": S, "new_tokens": T, "variant": name, "us": us, "kv_gb_s": gbs, "max_abs_err": err,
                         "mean_len": float(lengths.float().mean())})
            print(f"{B:>5} {S:>5} {T:>4} {name:>10} {us:>9.1f} {gbs:>7.0f} {err:>8.4f}")
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    out = args.out or result_path("attn_decode", machine_name(dev))
    atomic_write_json(out, {"device": device, "torch": torch.__version__,
                            "heads": [H, KV, D], "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
