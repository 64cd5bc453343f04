"""Why EAGLE-3 does not pay on a small CPU: AR against EAGLE-3 chains of 1-4 steps with the
shipped drafter, each round split into draft and verify ms (phased rounds), and what a
matmul costs by row count (a verify step of T tokens multiplies T rows). fp32, batch 1, the
last MT-Bench questions (the demo's held-out ones), greedy.

    python bench/cpu_chain_sweep.py [--drafter drafters/smollm2-135m] [--new-tokens 48] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fledge.data import load_conversations
from fledge.engine import SamplingParams, build_engine_target, generate_ar
from fledge.engine.cli import load_drafter
from fledge.engine.drafters import SpecConfig
from fledge.engine.spec import generate_spec
from fledge.target import load_target
from fledge.util import atomic_write_json


def matmul_us(rows: int, out_features: int, in_features: int, iters: int = 100) -> float:
    w, x = torch.randn(out_features, in_features), torch.randn(rows, in_features)
    for _ in range(5):
        F.linear(x, w)
    t = time.perf_counter()
    for _ in range(iters):
        F.linear(x, w)
    return (time.perf_counter() - t) / iters * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", default=str(Path(__file__).parent.parent / "drafters" / "smollm2-135m"))
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "chain_sweep_cpu.json"))
    args = p.parse_args(argv)
    t = load_target("smollm2-135m")
    engine = build_engine_target(t.model, torch.float32, "cpu")
    convs, _ = load_conversations("mtbench")
    prompts = [t.tokenizer.apply_chat_template(c["messages"][:1], add_generation_prompt=True, tokenize=True)
               for c in convs[-args.prompts:]]
    prompts = [q if isinstance(q, list) else q["input_ids"] for q in prompts]
    params = SamplingParams(max_new_tokens=args.new_tokens)
    generate_ar(engine, [prompts[0]], SamplingParams(max_new_tokens=4), [])  # warm-up
    t0 = time.perf_counter()
    n = sum(len(generate_ar(engine, [q], params, [])[0][0]) for q in prompts)
    ar = n / (time.perf_counter() - t0)
    rows = [{"config": "AR", "tok_s": ar}]
    print(f"{'config':>8} {'tok/s':>7} {'vs AR':>6} {'accept':>7} {'draft ms':>9} {'verify ms':>10}")
    print(f"{'AR':>8} {ar:>7.1f} {1:>6.2f}")
    for steps in (1, 2, 3, 4):
        drafter = load_drafter(args.drafter, SpecConfig(steps, 1, steps + 1), t.model, engine, "cpu", torch.float32)
        t0, n, accepted, rounds, draft, verify = time.perf_counter(), 0, 0, 0, [], []
        for q in prompts:
            out, st = generate_spec(engine, drafter, q, params, [], phased=True)
            n, accepted, rounds = n + len(out), accepted + sum(st.accepted), rounds + len(st.accepted)
            draft, verify = draft + st.draft_ms, verify + st.verify_ms
        row = {"config": f"chain {steps}", "tok_s": n / (time.perf_counter() - t0),
               "accept_length": (accepted + rounds) / max(rounds, 1),
               "draft_ms": sum(draft) / len(draft), "verify_ms": sum(verify) / len(verify)}
        rows.append(row)
        print(f"{row['config']:>8} {row['tok_s']:>7.1f} {row['tok_s'] / ar:>6.2f} {row['accept_length']:>7.2f} "
              f"{row['draft_ms']:>9.1f} {row['verify_ms']:>10.1f}")
    H, I = t.hidden_size, t.model.config.intermediate_size
    cost = {r: matmul_us(r, 2 * I, H) for r in (1, 2, 5, 8)}
    print("gate/up matmul us by rows:", {r: round(us) for r, us in cost.items()})
    atomic_write_json(args.out, {"device": "cpu", "threads": torch.get_num_threads(), "dtype": "float32",
                                 "prompts": args.prompts, "new_tokens": args.new_tokens, "rows": rows,
                                 "gate_up_matmul_us_by_rows": cost})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
