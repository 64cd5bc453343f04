"""Batched AR on SmolLM2-135M's shapes with random weights (no download): prefill, graph
capture and decode time of `generate_ar` at regeneration batch sizes, and a continuous-batching
stream, with the prefix kernel and without it (SDPA / matmul attention over spans), in one run.

Random weights never end a row early (no eos), so every row decodes all its tokens: the
worst case for a batch, and the same work for both variants.

    python bench/profile_batched.py [--batch-sizes 256,1024] [--stream 2048] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys

import torch

from fledge.engine.generate import SamplingParams, generate_ar
from fledge.engine.model import LayerFns, build_engine_target
from fledge.engine.stream import generate_stream
from fledge.util import atomic_write_json
from machine import machine_name, result_path
from random_target import smollm2_random


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="256,1024")
    p.add_argument("--stream", type=int, default=2048, help="prompts through a 1,024-row stream (0: none)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_batched: needs CUDA", file=sys.stderr)
        return 2
    dev, dt = torch.device("cuda"), torch.bfloat16
    hf = smollm2_random(dt, dev)
    g = torch.Generator().manual_seed(0)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    n_prompts = max(sizes + [args.stream])
    # ShareGPT first turns are mostly short with a long tail: lengths 16..512, skewed short.
    lens = (16 + 496 * torch.rand(n_prompts, generator=g) ** 2).long().tolist()
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in lens]
    params = SamplingParams(max_new_tokens=args.new_tokens)
    rows = []
    print(f"{'attention':>14} {'run':>12} {'prefill ms':>11} {'capture ms':>11} {'decode ms':>10} {'graphs':>7} "
          f"{'tok/s':>9} {'decode tok/s':>13}")
    for kernel in (True, False):
        target = build_engine_target(hf, dt, dev, fns=LayerFns.compiled(prefix_kernel=kernel))
        name = "prefix kernel" if target.prefix_kernel else "spans"
        generate_ar(target, prompts[:8], SamplingParams(max_new_tokens=8), [])  # compile
        for B in sizes:
            _, st = generate_ar(target, prompts[:B], params, [])
            total = st["prefill_ms"] + st["capture_ms"] + st["decode_ms"]
            row = {"attention": name, "batch": B, **{k: st[k] for k in ("prefill_ms", "capture_ms", "decode_ms", "decode_tok_s")},
                   "graphs": len(st["spans"]), "generated_tokens": st["generated_tokens"],
                   "tok_s_with_capture": st["generated_tokens"] / total * 1e3, "tok_s": st["tok_s"]}
            rows.append(row)
            print(f"{name:>14} {'batch ' + str(B):>12} {st['prefill_ms']:>11.0f} {st['capture_ms']:>11.0f} "
                  f"{st['decode_ms']:>10.0f} {row['graphs']:>7} {row['tok_s_with_capture']:>9.0f} {st['decode_tok_s']:>13.0f}")
        if args.stream:
            _, st = generate_stream(target, prompts[:args.stream], params, [], rows=1024)
            row = {"attention": name, "stream": args.stream, "rows": 1024, "seconds": st["seconds"],
                   "graphs": st["graphs"], "generated_tokens": st["generated_tokens"], "tok_s": st["tok_s"]}
            rows.append(row)
            print(f"{name:>14} {'stream ' + str(args.stream):>12} {'':>11} {'':>11} {1e3 * st['seconds']:>10.0f} "
                  f"{st['graphs']:>7} {st['tok_s']:>9.0f}")
        del target
        torch.cuda.empty_cache()
    name = machine_name(dev)
    out = args.out or result_path("profile_batched", name)
    atomic_write_json(out, {"device": name, "target": "smollm2-135m shapes, random weights", "dtype": "bfloat16",
                            "new_tokens": args.new_tokens, "prompt_lengths": "16 + 496 * u^2", "rows": rows})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
