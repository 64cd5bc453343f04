"""EAGLE-3 on a small CPU: AR against EAGLE-3 chains of 1-4 steps with the shipped drafter,
each round split into draft and verify ms (phased rounds); what a target forward of T new
tokens costs (a verify step of a chain of k drafts is T = k + 1); and what a matmul costs by
row count in the two forms the engine could use (`F.linear`, x @ w.T, and w @ x.T, which
`engine.model.linear` takes on the CPU for 2-64 rows), with weights cycled so they come from
memory, as in a forward. fp32, batch 1, the last MT-Bench questions (the demo's held-out ones),
greedy.

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
from fledge.engine.attention import Prefix
from fledge.engine.drafters import SpecConfig
from fledge.engine.spec import generate_spec
from fledge.target import load_target
from fledge.util import atomic_write_json


def matmul_us(rows: int, out_features: int, in_features: int, form: str, copies: int, reps: int = 3) -> float:
    """Mean us of one product, cycling over `copies` distinct weights (more bytes than the caches
    hold, so each product reads its weight from memory, as a forward does)."""
    ws = [torch.randn(out_features, in_features) for _ in range(copies)]
    x = torch.randn(rows, in_features)
    fn = (lambda w: F.linear(x, w)) if form == "x @ w.T" else (lambda w: torch.mm(w, x.t()).t().contiguous())
    for w in ws:
        fn(w)
    t = time.perf_counter()
    for _ in range(reps):
        for w in ws:
            fn(w)
    return (time.perf_counter() - t) / (reps * copies) * 1e6


@torch.no_grad()
def forward_ms(engine, prompt: list[int], T: int, reps: int = 4) -> float:
    """One target forward of T new tokens (a chain's verify shape) after the prompt."""
    cache = engine.new_cache(1, len(prompt) + 64)
    engine.prefill(torch.tensor([prompt]), cache)
    L = len(prompt)
    toks, pos = torch.full((1, T), 100), L + torch.arange(T)[None]
    mask = Prefix(torch.tensor([L]), torch.tril(torch.ones(1, T, T, dtype=torch.bool)))
    engine(toks, pos, pos, mask, cache)
    t = time.perf_counter()
    for _ in range(reps):
        engine(toks, pos, pos, mask, cache)
    return (time.perf_counter() - t) / reps * 1e3


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
    fwd = {T: forward_ms(engine, prompts[0], T) for T in (1, 2, 5, 8)}
    print("target forward ms by new tokens:", {T: round(ms, 1) for T, ms in fwd.items()})
    H, I, V = t.hidden_size, t.model.config.intermediate_size, t.model.config.vocab_size
    cost = {name: {form: {r: matmul_us(r, n, H, form, copies) for r in (1, 2, 5, 8)} for form in ("x @ w.T", "w @ x.T")}
            for name, n, copies in (("gate_up", 2 * I, 30), ("lm_head", V, 2))}
    for name, forms in cost.items():
        print(f"{name} matmul us by rows:", {f: {r: round(us) for r, us in c.items()} for f, c in forms.items()})
    atomic_write_json(args.out, {"device": "cpu", "threads": torch.get_num_threads(), "dtype": "float32",
                                 "prompts": args.prompts, "new_tokens": args.new_tokens, "rows": rows,
                                 "forward_ms_by_new_tokens": fwd, "matmul_us_by_rows": cost})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
