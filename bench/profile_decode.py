"""Where a decode step's time goes: the engine's one-token forward at several (batch, span)
shapes, as a CUDA graph (wall ms per step, from events over many replays) and eagerly under
torch.profiler (GPU time per kernel name, summed per step). Graph wall time minus the kernels'
sum is what launching and gaps cost.

    python bench/profile_decode.py --shapes 1x512,256x512,256x2048 [--compile]

Prints a table per shape and writes JSON (default bench/results/profile_decode_<machine>.json).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from fledge.engine.generate import capture_cuda_graph, decode_logits, decode_spans
from fledge.engine.model import GEMV_ROWS, LayerFns, build_engine_target
from fledge.target import load_target
from fledge.util import FledgeError, atomic_write_json, pick_dtype
from machine import machine_name, result_path


def decode_step(model, batch: int, span: int):
    """A decode step at `batch` rows, each with span - 1 slots already written (random ids), as
    generate_ar runs it: one span, or none with the prefix kernel."""
    dev = model.output.weight.device
    cache = model.new_cache(batch, span)
    lengths = torch.full((batch,), span - 1, device=dev)
    tokens = torch.randint(0, model.args.vocab_size, (batch, 1), device=dev)
    spans = decode_spans(model, [span], span)

    def step():
        return decode_logits(model, tokens, lengths, [(0, batch)], spans, cache)
    return step


def graph_ms(step, iters: int) -> float:
    replay = capture_cuda_graph(step)
    for _ in range(5):
        replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kernels_us(step, iters: int) -> dict[str, tuple[int, float]]:
    """Per kernel name: (launches per step, GPU microseconds per step), eager."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    acc = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            acc[e.name][0] += 1
            acc[e.name][1] += e.time_range.elapsed_us()  # a kernel event's range is its GPU interval
    return {k: (round(n / iters), us / iters) for k, (n, us) in acc.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--shapes", default="1x512,256x512,256x2048,1024x512", help="BATCHxSPAN, comma-separated")
    p.add_argument("--compile", action="store_true", help="torch.compile the engine's layer functions")
    p.add_argument("--mode", help="torch.compile mode for --compile (e.g. max-autotune-no-cudagraphs)")
    p.add_argument("--gemv-rows", type=int, default=GEMV_ROWS, help="with --compile: matmuls of at most this many rows "
                                                               "as reductions (model.linear)")
    p.add_argument("--no-prefix-kernel", action="store_true", help="with --compile: decode attention through SDPA "
                                                                   "over a span, not the prefix kernel")
    p.add_argument("--random", action="store_true",
                   help="SmolLM2-135M's shapes with random weights (bench/random_target.py): no model download")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_decode: needs CUDA", file=sys.stderr)
        return 2
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        dev = torch.device("cuda")
        dtype = pick_dtype(args.dtype, dev)
        if args.random:
            from random_target import smollm2_random
            hf = smollm2_random(dtype, dev)
        else:
            hf = load_target(args.target, dtype=dtype, device=dev).model
        fns = LayerFns.compiled(args.mode, prefix_kernel=not args.no_prefix_kernel, gemv_rows=args.gemv_rows) \
            if args.compile else LayerFns()
        model = build_engine_target(hf, dtype, dev, fns=fns)
    except (FledgeError, ValueError) as e:
        print(f"profile_decode: error: {e}", file=sys.stderr)
        return 2
    report = {"device": machine_name(dev),
              "target": "smollm2-135m shapes, random weights" if args.random else args.target,
              "dtype": args.dtype, "compiled_layers": args.compile, "compile_mode": args.mode,
              "prefix_kernel": getattr(model, "prefix_kernel", False), "gemv_rows": args.gemv_rows, "shapes": []}
    with torch.no_grad():
        for batch, span in shapes:
            step = decode_step(model, batch, span)
            kern = kernels_us(step, max(5, args.iters // 5))
            row = {"batch": batch, "span": span, "graph_ms_per_step": graph_ms(step, args.iters),
                   "kernel_ms_per_step": sum(us for _, us in kern.values()) / 1e3,
                   "launches_per_step": sum(n for n, _ in kern.values()),
                   "kernels": sorted(([k, n, us] for k, (n, us) in kern.items()), key=lambda r: -r[2])}
            report["shapes"].append(row)
            print(f"\nbatch {batch} span {span}: graph {row['graph_ms_per_step']:.3f} ms/step, kernels "
                  f"{row['kernel_ms_per_step']:.3f} ms in {row['launches_per_step']} launches (eager profile)")
            for name, n, us in row["kernels"][:args.top]:
                print(f"  {us:9.1f} us {n:5d}x  {name[:90]}")
    out = args.out or result_path("profile_decode", report["device"])
    atomic_write_json(out, report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
