"""One matmul of a verify step, alone: SmolLM2-135M's four layer matmuls through cuBLAS
(F.linear, nothing fused; o_proj with its copy of the attention's output into rows), and
o_proj as engine.few_rows' kernel (residual add included) at each tile config, at 8 and 16
rows. Each is timed in a CUDA graph that runs it over 30 different weights in turn, as a
forward's 30 layers do, so the weights come from memory, not L2. (Session 7's first run,
bench/results/few_rows_micro_session7_nvidia_h200.json, also timed fused forms of the other
three; `git show dc260ee:bench/few_rows_micro.py` is that script.)

    python bench/few_rows_micro.py [--out FILE]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import fledge.engine.few_rows as fr
from fledge.util import atomic_write_json

DIM, INTER, HEADS, KV, D, LAYERS = 576, 1536, 9, 3, 64, 30
CONFIGS = [(n, w) for n in (16, 32, 64) for w in (2, 4, 8)]


def graph_us(fn, reps: int = 20) -> float:
    """us per layer of fn (which runs all LAYERS) replayed as a CUDA graph."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1000 / reps / LAYERS


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/few_rows_micro_nvidia_h200.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("few_rows_micro: needs CUDA", file=sys.stderr)
        return 2
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    ws = {"qkv": [torch.randn((HEADS + 2 * KV) * D, DIM, device=dev, dtype=dt) / 24 for _ in range(LAYERS)],
          "o": [torch.randn(DIM, HEADS * D, device=dev, dtype=dt) / 24 for _ in range(LAYERS)],
          "w13": [torch.randn(2 * INTER, DIM, device=dev, dtype=dt) / 24 for _ in range(LAYERS)],
          "w2": [torch.randn(DIM, INTER, device=dev, dtype=dt) / 40 for _ in range(LAYERS)]}
    rows_out = []
    for M in (8, 16):
        x = torch.randn(1, M, DIM, device=dev, dtype=dt)
        act = torch.randn(1, M, INTER, device=dev, dtype=dt)
        o = torch.randn(1, KV, (HEADS // KV) * M, D, device=dev, dtype=dt)
        heads = o.reshape(1, HEADS, M, D).transpose(1, 2)
        cublas = {"qkv": lambda w: F.linear(x, w), "o": lambda w: F.linear(heads.reshape(1, M, -1), w),
                  "w13": lambda w: F.linear(x, w), "w2": lambda w: F.linear(act, w)}
        for name in ws:
            row = {"rows": M, "matmul": name, "cublas_us": graph_us(lambda: [cublas[name](w) for w in ws[name]])}
            if name == "o":
                row["kernel_us"] = {}
                for c in CONFIGS:
                    row["kernel_us"]["%dx%d" % c] = graph_us(lambda: [fr.o_proj(x, o, w, config=c) for w in ws[name]])
            rows_out.append(row)
            extra = " ".join(f"{k}:{v:.2f}" for k, v in row.get("kernel_us", {}).items())
            print(f"M={M:2d} {name:>4}: cuBLAS {row['cublas_us']:5.2f} us  {extra}")
    atomic_write_json(args.out, {"device": torch.cuda.get_device_name(dev), "dtype": "bfloat16", "layers": LAYERS,
                                 "rows": rows_out})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
