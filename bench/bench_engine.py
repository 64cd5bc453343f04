"""Engine bench: MT-Bench first turns, batch 1, greedy, every decoding method on one target.

    python bench/bench_engine.py --target smollm2-135m [--drafter DIR [--tree S,K,N ...]] [--compile]

Rows: engine AR, EAGLE-3 chain 7 and one per --tree (with --drafter), the oracle chain 7 (the
engine's ceiling), n-gram, then the references: AR and oracle with an eager prefill per request,
HF generate eager and with a compiled static cache (GPU; --skip-hf leaves them out), and with
--compile AR uncompiled, through SDPA over spans and through cuBLAS (what each part buys).
Ratios are against engine AR of the same run, HF rows on the prompts HF ran (--hf-prompts);
`match_ar` counts outputs equal to engine AR's token for token (exact in fp32; in bf16 a verify
over many tokens rounds differently from a 1-token step, so near-ties may flip).
Writes one variant (--variant, default the dtype) of bench/results/engine_<machine>.json,
keeping the others; the variant is rewritten after each row, so a run cut short keeps its rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from machine import machine_name, result_path
from tqdm import tqdm
from transformers import StaticCache

from fledge.core.devices import pick_device, pick_dtype
from fledge.core.errors import FledgeError
from fledge.core.files import atomic_write_json
from fledge.core.report import print_table
from fledge.core.shape import Shape, parse_shape
from fledge.core.target import eos_ids, load_target
from fledge.engine.decode import generate_ar
from fledge.engine.drafters import NgramDrafter, OracleDrafter, load_drafter
from fledge.engine.graphs import now
from fledge.engine.hf import build_engine_target
from fledge.engine.layers import GEMV_ROWS, LayerFns
from fledge.engine.resident import Resident
from fledge.engine.sampling import SamplingParams
from fledge.engine.spec import generate_spec, oracle_text
from fledge.engine.stats import SpecStats
from fledge.perf.bench import load_prompts
from fledge.train.features import padded_length

SPEC_KEYS = ("accept_length", "accept_rate", "round_ms_per_step", "draft_ms_per_step", "verify_ms_per_step",
             "other_ms_per_step", "depth_acceptance", "histogram")


# Each runner: run(prompt, params, AR's output) -> (output, seconds, SpecStats or None, prefill ms or None).
def hf_runner(hf, eos, device, static_len: int | None = None):
    """HF generate; with `static_len`, one StaticCache reused (reset) for every prompt, so the
    auto-compiled decode step (CUDA) never sees a new shape."""
    cache = StaticCache(config=hf.config, max_cache_len=static_len) if static_len else None

    def run(prompt, params, _ar):
        ids = torch.tensor([prompt], device=device)
        if cache is not None:
            cache.reset()
        t0 = now(device)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_new_tokens,
                          do_sample=False, eos_token_id=eos, pad_token_id=eos[0], past_key_values=cache)
        return out[0, len(prompt):].tolist(), now(device) - t0, None, None
    return run


def ar_runner(target, eos, graphs: bool, resident=None):
    def run(prompt, params, _ar):
        rows, st = generate_ar(target, [prompt], params, eos, use_cuda_graph=graphs, resident=resident)
        return rows[0], (st["prefill_ms"] + st["decode_ms"]) / 1e3, None, st["prefill_ms"]
    return run


def spec_runner(target, eos, graphs: bool, drafter, resident=None):
    def run(prompt, params, _ar):  # the timing path fledge tune validates with
        out, st = generate_spec(target, drafter, prompt, params, eos, use_cuda_graph=graphs, resident=resident)
        return out, st.wall_ms / 1e3, st, st.prefill_ms
    return run


def oracle_runner(target, eos, graphs: bool, spec, resident=None):
    """The oracle drafts the greedy text the verify step itself computes (spec.oracle_text,
    untimed): fed AR's text it would draft wrong after a bf16 near-tie; in fp32 the two agree."""
    device = next(target.parameters()).device

    def run(prompt, params, ar):
        own, passes = oracle_text(target, spec, prompt, ar, params, eos, use_cuda_graph=graphs, resident=resident)
        out, st = generate_spec(target, OracleDrafter(spec, [prompt + own], device), prompt, params, eos,
                                use_cuda_graph=graphs, resident=resident)
        if out != own:
            print(f"oracle: no fixed point after {passes} passes; this request accepts less than every draft",
                  file=sys.stderr)
        return out, st.wall_ms / 1e3, st, st.prefill_ms
    return run


def parse_tree(text: str) -> Shape:
    return parse_shape(text, "--tree")


def results_writer(path: Path, variant: str):
    """A function that rewrites `variant` of the results file at `path`, keeping the others; the
    file is read now, so a bad one stops the run first."""
    try:
        variants = json.loads(path.read_text())["variants"] if path.exists() else {}
        if not isinstance(variants, dict):
            raise TypeError("'variants' is not an object")
    except (ValueError, KeyError, TypeError) as e:
        raise FledgeError(f"{path}: not a bench_engine results file ({type(e).__name__}: {e})") from None
    return lambda report: atomic_write_json(path, {"variants": {**variants, variant: report}})


def row_names(args, device) -> list[str]:
    """The rows this run measures, in run order: the baseline and the drafters first, then the
    references and the AR variants, so that a run cut short loses the least. Known from the
    arguments alone, so a bad --only stops the run before any model loads."""
    names = ["engine AR"]
    if args.drafter:
        names += ["eagle3 chain 7"] + [f"eagle3 tree {text}" for text in args.tree or ["5,4,16"]]
    names += ["oracle chain 7", f"ngram {args.ngram} chain {args.ngram_steps}"]
    if not args.eager_prefill:
        names += ["engine AR (eager prefill)", "oracle chain 7 (eager prefill)"]
    if not args.skip_hf:
        names += ["hf eager"] + (["hf static (compiled)"] if device.type == "cuda" else [])
    if args.compile:
        names += [f"engine AR ({n})" for n in ("not compiled", "SDPA over spans")]
        names += ["engine AR (cuBLAS matmuls)"] if args.gemv_rows else []
    if not args.only:
        return names
    # a re-measure of some rows against the baseline, in less GPU time
    want = [n.strip() for n in args.only.split(";") if n.strip()]
    unknown = [n for n in want if n not in names]
    if unknown:
        raise FledgeError(f"--only {unknown}: not a row of this run; rows: {'; '.join(names)}")
    return [n for n in names if n == "engine AR" or n in want]


def engine_configs(args, t, target, device, dtype, prompts, graphs, rows) -> tuple[dict, Resident | None]:
    """A runner for each of `rows` (row_names)."""
    def drafter(spec):
        return load_drafter(args.drafter, spec, t.model, target, device, dtype, args.compile, args.fast_topk)
    eos, chain7 = eos_ids(t.tokenizer, t.model.generation_config), Shape(7, 1, 8)
    trees = args.tree or ["5,4,16"]
    eagle_chain = drafter(chain7) if args.drafter else None
    # One cache per engine target for every request, the prefill captured per bucket before any
    # clock (engine.resident), with room past the answer for the widest verify (a round's tree
    # is written before acceptance); --eager-prefill: a fresh cache and prefill per request.
    room = max([64] + [parse_tree(x).num_draft_tokens for x in trees])
    longest = max(map(len, prompts)) + args.max_new_tokens
    aux_sets = [None] + ([eagle_chain.aux_ids] if eagle_chain else [])

    def resident(model):
        return None if args.eager_prefill else Resident(model, padded_length(longest + room, 64), aux_sets, graphs)
    res = resident(target)
    configs = {"engine AR": ar_runner(target, eos, graphs, res)}
    if eagle_chain:
        configs["eagle3 chain 7"] = spec_runner(target, eos, graphs, eagle_chain, res)
        for text in trees:
            configs[f"eagle3 tree {text}"] = spec_runner(target, eos, graphs, drafter(parse_tree(text)), res)
    configs["oracle chain 7"] = oracle_runner(target, eos, graphs, chain7, res)
    ngram = NgramDrafter(Shape(args.ngram_steps, 1, args.ngram_steps + 1), args.ngram)
    configs[f"ngram {args.ngram} chain {args.ngram_steps}"] = spec_runner(target, eos, graphs, ngram, res)
    if res is not None:
        configs["engine AR (eager prefill)"] = ar_runner(target, eos, graphs)
        configs["oracle chain 7 (eager prefill)"] = oracle_runner(target, eos, graphs, chain7)
    if not args.skip_hf:
        configs["hf eager"] = hf_runner(t.model, eos, device)
        if device.type == "cuda":
            configs["hf static (compiled)"] = hf_runner(t.model, eos, device, padded_length(longest, 64))
    if args.compile:
        fast = {"gemv_rows": args.gemv_rows, "few_rows": args.few_rows}
        variants = {"not compiled": LayerFns(), "SDPA over spans": LayerFns.compiled(**fast, prefix_kernel=False)}
        if args.gemv_rows:
            variants["cuBLAS matmuls"] = LayerFns.compiled(gemv_rows=0, few_rows=0)
        for name, fns in variants.items():
            model = build_engine_target(t.model, dtype, device, fns=fns)
            configs[f"engine AR ({name})"] = ar_runner(model, eos, graphs, resident(model))
    configs = {n: configs[n] for n in rows}
    return configs, res


def measure(name: str, run, todo, params) -> tuple[dict, list[tuple[int, float]]]:
    """A row: each (prompt, AR's output) of `todo` through `run`; and each prompt's (tokens, seconds)."""
    timed, matches, stats, prefill = [], 0, [], []
    for p, ar in tqdm(todo, desc=name, leave=False):
        out, seconds, st, pre = run(p, params, ar)
        timed.append((len(out), seconds))
        prefill += [] if pre is None else [pre]
        stats += [] if st is None else [st]
        matches += out == ar
    tokens, seconds = sum(n for n, _ in timed), sum(s for _, s in timed)
    row = {"prompts": len(todo), "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "match_ar": matches}
    if prefill:  # the request's time before its first decode step or round (prefill, drafter's first look)
        row["prefill_ms_per_prompt"] = sum(prefill) / len(prefill)
    if stats:
        row |= {k: v for k, v in SpecStats.merge(stats).summary().items() if k in SPEC_KEYS}
    return row, timed


def bench(args, device, write, rows) -> dict:
    dtype = pick_dtype(args.dtype, device)
    t = load_target(args.target, dtype=dtype, device=device)
    fns = LayerFns.compiled(gemv_rows=args.gemv_rows, few_rows=args.few_rows) if args.compile else LayerFns()
    target = build_engine_target(t.model, dtype, device, fns=fns)
    prompts = load_prompts(args.prompts, args.num_prompts, t.tokenizer)
    graphs = not args.no_cuda_graph
    configs, res = engine_configs(args, t, target, device, dtype, prompts, graphs, rows)
    hf_names = {n for n in configs if n.startswith("hf ")}
    n_hf = min(args.hf_prompts or len(prompts), len(prompts))  # HF eager costs ~7.5 s a prompt on the H200
    header = {"device": machine_name(device), "target": args.target, "dtype": str(dtype).removeprefix("torch."),
              "cuda_graphs": graphs, "compiled_layers": args.compile, "gemv_rows": args.gemv_rows,
              "fast_topk": args.fast_topk, "few_rows": args.few_rows, "resident_prefill": res is not None,
              "hf_prompts": n_hf if hf_names else 0, "prompts": len(prompts), "only": args.only,
              "max_new_tokens": args.max_new_tokens, "repeats": 1,
              "accept_length_definition": "SGLang: (accepted draft tokens + 1 bonus) per verify step"}
    params = SamplingParams(0.0, 1.0, args.max_new_tokens, 0)
    # Engine AR's outputs feed the oracle and are what every other output must match.
    ar_out = [configs["engine AR"](p, params, None)[0] for p in tqdm(prompts, desc="engine AR outputs", leave=False)]
    results = {}
    for name, run in configs.items():  # engine AR first: every ratio's base
        run(prompts[0], SamplingParams(0.0, 1.0, min(16, args.max_new_tokens), 0), ar_out[0][:16])  # untimed warm-up
        hf = name in hf_names
        row, timed = measure(name, run, list(zip(prompts, ar_out))[:n_hf if hf else None], params)
        if name == "engine AR":  # HF rows are compared with its rate on the prompts HF ran
            ar_tok_s = row["tok_s"]
            ar_on_hf = sum(n for n, _ in timed[:n_hf]) / sum(s for _, s in timed[:n_hf])
        row["vs_engine_ar"] = row["tok_s"] / (ar_on_hf if hf else ar_tok_s)
        if hf:
            row["engine_ar_same_prompts_tok_s"] = ar_on_hf
        results[name] = row
        write({**header, "partial": True, "results": results})
    return {**header, "results": results}


def show(report: dict) -> None:
    print(f"{report['device']}  {report['target']}  {report['dtype']}  {report['prompts']} prompts x "
          f"{report['max_new_tokens']} new tokens, batch 1, greedy (HF rows: vs engine AR on the same prompts)")
    rows = [["config", "prompts", "tok/s", "vs AR", "match AR", "accept len", "round ms", "prefill ms"]]
    for name, r in report["results"].items():
        rows.append([name, r["prompts"], f"{r['tok_s']:.1f}", f"{r['vs_engine_ar']:.2f}x", f"{r['match_ar']}/{r['prompts']}",
                     *(f"{r[k]:{f}}" if k in r else "-" for k, f in (("accept_length", ".2f"), ("round_ms_per_step", ".3f"),
                                                                  ("prefill_ms_per_prompt", ".1f")))])
    print_table(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--drafter", help="EAGLE-3 checkpoint directory (adds the eagle3 chain and tree rows)")
    p.add_argument("--tree", action="append", help="EAGLE-3 tree as STEPS,TOPK,NUM_DRAFT_TOKENS (repeatable; default 5,4,16)")
    p.add_argument("--ngram", type=int, default=3, help="longest n-gram prompt lookup matches")
    p.add_argument("--ngram-steps", type=int, default=4, help="tokens the n-gram drafter proposes per round")
    p.add_argument("--prompts", default="mtbench", help="built-in data set or conversations file")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--skip-hf", action="store_true", help="leave out the HF generate baselines")
    p.add_argument("--only", help="run these rows alone (names as printed, ';'-separated), engine AR always")
    p.add_argument("--hf-prompts", type=int, help="run the HF baselines on the first N prompts only (default all)")
    p.add_argument("--no-cuda-graph", action="store_true", help="run the engine eagerly on CUDA too")
    p.add_argument("--eager-prefill", action="store_true",
                   help="a fresh cache and an eager prefill per request (no engine.resident; no eager-prefill rows)")
    p.add_argument("--torch-topk", dest="fast_topk", action="store_false",
                   help="the drafter's tree bookkeeping through torch.topk (Eagle3Drafter fast_topk off)")
    p.add_argument("--few-rows", type=int, default=16, help="with --compile: forwards of more than --gemv-rows and "
                   "at most this many rows through engine.few_rows' Triton kernels (verify steps)")
    p.add_argument("--gemv-rows", type=int, default=GEMV_ROWS,
                   help="with --compile: matmuls of at most this many rows as fused reductions (engine.model.linear)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the engine's layer functions and the drafter; adds the AR variant rows")
    p.add_argument("--device")
    p.add_argument("--dtype")
    p.add_argument("--variant", help="key of this run in the results file (default: the dtype, e.g. bfloat16)")
    p.add_argument("--out", type=Path, help="results file (default bench/results/engine_<machine>.json)")
    args = p.parse_args(argv)
    try:
        device = pick_device(args.device)
        out = args.out or result_path("engine", machine_name(device))
        write = results_writer(out, args.variant or str(pick_dtype(args.dtype, device)).removeprefix("torch."))
        rows = row_names(args, device)
        report = bench(args, device, write, rows)
    except FledgeError as e:
        print(f"bench_engine: error: {e}", file=sys.stderr)
        return 2
    show(report)
    write(report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
