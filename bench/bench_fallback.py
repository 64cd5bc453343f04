"""The engine's fallback path (HFTarget: any transformers causal LM without a compact
implementation) against HF's own cached decoding, by context length.

A random Gemma3 text model (sliding-window and full layers) decodes greedy tokens after prompts
of several lengths, through fledge's engine (`generate_ar` over HFTarget) and through
transformers' own cache (a prefill, then one forward per token with its DynamicCache), the two
interleaved and repeated in one process. The figure is decode milliseconds per token (prefill
excluded): constant in the context length, up to attention's share, where a path that
recomputed every written slot would grow with it. Prints a table and rewrites
bench/results/fallback_<machine>.json.

    python bench/bench_fallback.py            # contexts 64 256 1024, 3 repeats
    python bench/bench_fallback.py --quick    # a smaller model and shorter contexts
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from machine import git_commit, machine_name, result_path

from fledge.core.files import atomic_write_json
from fledge.core.report import print_table
from fledge.engine.decode import generate_ar
from fledge.engine.hf import build_engine_target
from fledge.engine.sampling import SamplingParams


def make_model(quick: bool):
    size = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "vocab_size": 4096} if quick else \
        {"hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 12, "vocab_size": 32768}
    cfg = transformers.Gemma3TextConfig(**size, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                                        sliding_window=128, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval(), cfg


@torch.no_grad()
def hf_ms_per_token(model, prompt: list[int], new: int) -> tuple[float, list[int]]:
    """Transformers' own greedy decoding with its DynamicCache: ms per decode step, and the tokens."""
    out = model(torch.tensor([prompt]), use_cache=True)
    cache, tok, toks = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True), []
    t0 = time.perf_counter()
    for _ in range(new - 1):
        toks.append(tok.item())
        out = model(tok, past_key_values=cache, use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    toks.append(tok.item())
    return 1e3 * (time.perf_counter() - t0) / (new - 1), toks


def fledge_ms_per_token(target, prompt: list[int], new: int) -> tuple[float, list[int]]:
    rows, st = generate_ar(target, [prompt], SamplingParams(max_new_tokens=new), [])
    return st["decode_ms"] / max(st["decode_steps"], 1), rows[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", help="prompt lengths (default 64 256 1024; --quick 32 128)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="a small model and short contexts (a smoke run)")
    p.add_argument("--out", type=Path, help="results file (default bench/results/fallback_<machine>.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    contexts = args.contexts or ([32, 128] if args.quick else [64, 256, 1024])
    model, cfg = make_model(args.quick)
    target = build_engine_target(model, torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)
    prompts = {c: torch.randint(0, cfg.vocab_size, (c,), generator=g).tolist() for c in contexts}
    fledge_ms_per_token(target, prompts[contexts[0]], 4)  # warm-up
    times = {c: {"fledge": [], "hf": []} for c in contexts}
    same = {}
    for _ in range(args.repeats):  # interleaved, so a load change on a shared machine hits both
        for c in contexts:
            f_ms, f_toks = fledge_ms_per_token(target, prompts[c], args.new_tokens)
            h_ms, h_toks = hf_ms_per_token(model, prompts[c], args.new_tokens)
            times[c]["fledge"].append(f_ms)
            times[c]["hf"].append(h_ms)
            same[c] = f_toks == h_toks
    rows = []
    for c in contexts:
        f, h = statistics.median(times[c]["fledge"]), statistics.median(times[c]["hf"])
        rows.append({"context": c, "fledge_ms_per_token": round(f, 3), "hf_ms_per_token": round(h, 3),
                     "hf_over_fledge": round(h / f, 3), "fledge_runs_ms": [round(x, 3) for x in times[c]["fledge"]],
                     "hf_runs_ms": [round(x, 3) for x in times[c]["hf"]], "same_tokens": same[c]})
    growth = rows[-1]["fledge_ms_per_token"] / rows[0]["fledge_ms_per_token"]
    print_table([["context", "fledge ms/token", "HF cached ms/token", "HF / fledge", "same tokens"],
                 *([r["context"], r["fledge_ms_per_token"], r["hf_ms_per_token"], r["hf_over_fledge"], r["same_tokens"]]
                   for r in rows)])
    print(f"fledge's ms/token at {contexts[-1]} tokens of context / at {contexts[0]}: {growth:.2f}")
    commit = git_commit()
    out = args.out or result_path("fallback", machine_name("cpu"))
    atomic_write_json(out, {
        "what": "decode ms per token on the fallback path (HFTarget) vs transformers' DynamicCache, greedy, batch 1, "
                "fp32, medians of interleaved repeats; a random Gemma3 text model",
        "commit": commit, "machine": machine_name("cpu"), "threads": args.threads, "quick": args.quick,
        "model": {k: getattr(cfg, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size",
                                                 "num_attention_heads", "num_key_value_heads", "head_dim",
                                                 "sliding_window")},
        "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows,
        "growth_longest_over_shortest": round(growth, 3), "argv": sys.argv[1:]})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
