"""What a speculative round costs, apart from acceptance: the AR step against fused rounds and
phased ones (draft / verify / other), with the drafter eager and compiled.

SmolLM2-135M's shapes with random weights for the target and a random EAGLE-3 drafter
(bench/random_target.py), so no download: a random drafter is almost never accepted, and that
does not matter here — a round's cost does not depend on what it accepts, only its yield does.
From these, the speed-up a drafter would give is accept_length * AR ms / round ms.

    python bench/profile_round.py [--tree 5,4,16 ...] [--compile] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch

from fledge.config import DraftConfig
from fledge.draft import Eagle3Draft
from fledge.engine.attention import Prefix
from fledge.engine.drafters import DraftInput, Eagle3Drafter, OracleDrafter, SpecConfig
from fledge.engine.generate import SamplingParams, generate_ar
from fledge.engine.model import GEMV_ROWS, LayerFns, build_engine_target
from fledge.engine.resident import Resident
from fledge.engine.spec import RoundState, fused_round, generate_spec, oracle_text, verify_forward
from fledge.util import atomic_write_json
from machine import machine_name, result_path
from profile_decode import kernels_us
from random_target import smollm2_random


@torch.no_grad()
def round_kernels(target, drafter, prompt) -> dict:
    """Per-kernel GPU time of one propose and one verify at the prompt's length (eager calls of
    the compiled functions: what a round's graph replays)."""
    dev = drafter.kv.device
    root, cache_len = torch.tensor([prompt[-1]], device=dev), torch.tensor([len(prompt)], device=dev)
    cache = target.new_cache(1, drafter.max_len)
    tree = drafter.propose(DraftInput(root, cache_len, []))
    parts = {"propose": lambda: drafter.propose(DraftInput(root, cache_len, [])),
             "verify": lambda: verify_forward(target, cache, tree, cache_len, drafter.aux_ids)}
    out = {}
    for name, fn in parts.items():
        kern = kernels_us(fn, 10)
        out[name] = {"kernel_us": sum(us for _, us in kern.values()), "launches": sum(n for n, _ in kern.values()),
                     "top": sorted(([k[:120], n, us] for k, (n, us) in kern.items()), key=lambda r: -r[2])[:15]}
        print(f"  {name}: {out[name]['kernel_us']:.0f} us of kernels in {out[name]['launches']} launches")
        for k, n, us in out[name]["top"][:8]:
            print(f"    {us:8.1f} us {n:4d}x  {k[:90]}")
    return out


@torch.no_grad()
def prefill_profile(target, prompt, aux_ids, iters: int = 5) -> dict:
    """Where a request's time before its first step goes: one batch-1 prefill into a fresh
    cache, as generate_ar runs it without a resident, timed on the host (synchronised) and
    interleaved with the same prompt replayed from its bucket's graph over a resident cache
    (engine.resident; with and without aux states); then the eager one under torch.profiler:
    the GPU time of its kernels and the host ops that took the most time themselves. Kernels
    far below the wall time mean host work (dispatch, guards, allocation).
    The profiler goes last: on an H200 an eager prefill timed after it took 25.9 ms against
    12.0 ms timed before it."""
    from torch.profiler import ProfilerActivity, profile

    dev = next(target.parameters()).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    ids, last = torch.tensor([prompt], device=dev), torch.tensor([[len(prompt) - 1]], device=dev)
    res = Resident(target, 2 * len(prompt) + 64, aux_sets=[None, aux_ids])  # a bucket holds the prompt

    def eager():
        target.prefill(ids, target.new_cache(1, len(prompt) + 64), logits_idx=last)
    runs = {"wall_ms": eager, "resident_wall_ms": lambda: res.prefill(ids),
            "resident_aux_wall_ms": lambda: res.prefill(ids, aux_ids)}
    times = {k: [] for k in runs}
    for rep in range(4):  # interleaved, so that a drift in host speed shows in all three alike
        for key, fn in runs.items():
            for _ in range(2 if rep == 0 else 0):
                fn()
            sync()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            sync()
            times[key].append((time.perf_counter() - t0) * 1e3 / iters)
    out = {k: statistics.median(v[1:]) for k, v in times.items()}
    out["all_ms"] = times
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(iters):
            eager()
        sync()
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    out.update({"kernel_ms": sum(e.time_range.elapsed_us() for e in gpu) / iters / 1e3,
                "launches": round(len(gpu) / iters),
                "top_host_ops": [[e.key[:80], round(e.count / iters), e.self_cpu_time_total / iters / 1e3] for e in host]})
    print(f"  prefill of {len(prompt)} tokens: {out['wall_ms']:.2f} ms wall eager, resident (its bucket's graph) "
          f"{out['resident_wall_ms']:.2f} ms, with aux {out['resident_aux_wall_ms']:.2f}; eager: {out['kernel_ms']:.2f} ms "
          f"of kernels in {out['launches']} launches; host ops by self time (ms/prefill):")
    for name, n, ms in out["top_host_ops"][:8]:
        print(f"    {ms:7.3f} {n:5d}x  {name}")
    return out


@torch.no_grad()
def round_gap(target, drafter, prompt, rounds: int = 64) -> dict:
    """A fused round's graph replayed `rounds` times back to back with one sync at the end, and
    the same replays each followed by the host read generate_spec makes (`.tolist()`). The
    difference is host time per round the GPU waits for: what running rounds ahead of the host
    could save."""
    spec, dev = drafter.spec, next(target.parameters()).device
    size = -(-(len(prompt) + rounds * spec.path_len + spec.num_draft_tokens) // 64) * 64
    cache = target.new_cache(1, size)
    drafter.start(1, size)
    aux_width = None if drafter.aux_ids is None else 3 * target.args.dim
    state = RoundState.allocate(spec, dev, aux_width, next(target.parameters()).dtype)
    run = fused_round(target, cache, drafter, state, dev.type == "cuda")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    ids = torch.tensor([prompt], device=dev)
    L = torch.tensor([len(prompt)], device=dev)

    def start():  # generate_spec's prefill and first propose
        drafter.start(1, size)
        logits, aux = target.prefill(ids, cache, aux_ids=drafter.aux_ids, logits_idx=(L - 1)[:, None])
        root = logits[:, 0].argmax(-1)
        drafter.observe(ids, aux, L, root, torch.zeros_like(L))
        state.cache_len.copy_(L)
        state.set_tree(drafter.propose(DraftInput(root, state.cache_len, [])))
    out = {}
    for synced in (False, True):
        start()
        sync()
        t0 = time.perf_counter()
        for _ in range(rounds):
            result = run()
            if synced:
                result.tolist()
        sync()
        out["synced_ms" if synced else "back_to_back_ms"] = (time.perf_counter() - t0) * 1e3 / rounds
    out["host_gap_ms"] = out["synced_ms"] - out["back_to_back_ms"]
    print(f"  {rounds} rounds: {out['back_to_back_ms']:.3f} ms a round back to back, {out['synced_ms']:.3f} with a "
          f"host read after each")
    return out


@torch.no_grad()
def few_rows_check(hf, target, dt, dev, prompt, widths=(2, 8, 16)) -> dict:
    """The few-rows kernel against the same compiled layers without it, on one forward of each
    verify width after the prompt (widths above few_rows.MAX_ROWS would compare a path with
    itself): max |logit difference| and the share of equal argmaxes."""
    ref = build_engine_target(hf, dt, dev, fns=dataclasses.replace(target.fns, few_rows=0))
    out = {}
    for T in widths:
        logits = []
        for model in (target, ref):
            cache = model.new_cache(1, len(prompt) + T)
            ids = torch.tensor([prompt + (prompt * T)[:T]], device=dev)
            model.prefill(ids[:, :len(prompt)], cache)
            pos = torch.arange(len(prompt), len(prompt) + T, device=dev)[None]
            mask = Prefix(torch.tensor([len(prompt)], device=dev), torch.ones(1, T, T, dtype=torch.bool, device=dev).tril())
            logits.append(model(ids[:, len(prompt):], pos, pos, mask, cache)[0][0])
        out[T] = {"max_abs_diff": (logits[0] - logits[1]).abs().max().item(),
                  "argmax_agree": (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean().item()}
        print(f"  few rows at {T} new tokens: max |logit diff| {out[T]['max_abs_diff']:.4f}, "
              f"argmax agree {out[T]['argmax_agree']:.3f}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", help="STEPS,TOPK,NUM_DRAFT_TOKENS (default: chain 7, 5,4,16, 8,8,64)")
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--prompt-lens", help="comma-separated: also time requests at these new prompt lengths "
                                         "(prefill per request, where a kernel's per-shape setup shows)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--compile", action="store_true", help="also the target's layers and the drafter compiled")
    p.add_argument("--mode", help="torch.compile mode of the target's layers")
    p.add_argument("--no-prefix-kernel", action="store_true", help="with --compile: decode and verify attention "
                                                                   "through SDPA's dense masks, not the prefix kernel")
    p.add_argument("--gemv-rows", type=int, default=GEMV_ROWS, help="with --compile: matmuls of at most this many rows "
                                                               "as reductions (model.linear)")
    p.add_argument("--few-rows", type=int, default=16, help="with --compile: forwards of more than --gemv-rows and at "
                                                           "most this many rows through engine.few_rows' kernels")
    p.add_argument("--torch-topk", dest="fast_topk", action="store_false",
                   help="drafter bookkeeping through torch.topk (Eagle3Drafter fast_topk off)")
    p.add_argument("--kernels", action="store_true", help="also a prefill's host and GPU time, and each config's propose and verify kernels "
                                                          "(torch.profiler, compiled drafter, eager calls)")
    p.add_argument("--device", default="cuda", help="cpu only to check the script runs")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("profile_round: needs CUDA", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hf = smollm2_random(dt, dev)
    fns = LayerFns.compiled(args.mode, prefix_kernel=not args.no_prefix_kernel, gemv_rows=args.gemv_rows,
                            few_rows=args.few_rows) \
        if args.compile else LayerFns()
    target = build_engine_target(hf, dt, dev, fns=fns)
    torch.manual_seed(1)
    draft = Eagle3Draft.from_target(DraftConfig.from_target(hf.config, draft_vocab_size=16384), hf,
                                    torch.randperm(hf.config.vocab_size)[:16384].sort().values).eval().cast(dev, dt)
    prompt = torch.randint(0, hf.config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens)
    generate_ar(target, [prompt], SamplingParams(max_new_tokens=8), [])
    _, ar = generate_ar(target, [prompt], params, [])
    ar_ms = ar["decode_ms"] / ar["decode_steps"]
    check = few_rows_check(hf, target, dt, dev, prompt) if args.few_rows else {}
    profiled = []
    shapes = [tuple(int(x) for x in t.split(",")) for t in (args.tree or ["7,1,8", "5,4,16", "8,8,64"])]
    rows = [{"config": "AR", "ms": ar_ms}]
    print(f"AR: {ar_ms:.3f} ms/step ({'compiled' if args.compile else 'eager'} layers)")
    # The oracle's chain 7 (the engine's ceiling): rounds fed the verify's own greedy text, and
    # requests against AR's, prefill included, as bench_engine measures them (one prompt here).
    res = Resident(target, -(-(len(prompt) + params.max_new_tokens + 64) // 64) * 64)  # bench_engine's captured prefill
    ar_tokens = generate_ar(target, [prompt], params, [], resident=res)[0][0]
    chain7 = SpecConfig(7, 1, 8)
    oracle_of = lambda seq: OracleDrafter(chain7, [prompt + seq], dev)  # noqa: E731
    generate_spec(target, oracle_of(ar_tokens), prompt, SamplingParams(max_new_tokens=16), [], resident=res)
    own, _ = oracle_text(target, chain7, prompt, ar_tokens, params, [], resident=res)
    walls = []
    for _ in range(3):
        _, o = generate_spec(target, oracle_of(own), prompt, params, [], resident=res)
        walls.append(o.wall_ms)
    ar_walls = [sum(generate_ar(target, [prompt], params, [], resident=res)[1][k] for k in ("prefill_ms", "decode_ms"))
                for _ in range(3)]
    oracle = {"config": "oracle 7,1,8", "round_ms": statistics.median(o.round_ms), "accept_length": o.summary()["accept_length"],
              "wall_ms": statistics.median(walls), "ar_wall_ms": statistics.median(ar_walls), "prefill_ms": o.prefill_ms,
              "rounds": o.steps, "tokens": o.generated_tokens}
    oracle["vs_ar"] = (o.generated_tokens / oracle["wall_ms"]) / (params.max_new_tokens / oracle["ar_wall_ms"])
    rows.append(oracle)
    print(f"oracle chain 7: {oracle['round_ms']:.3f} ms a round, accept {oracle['accept_length']:.2f}, {oracle['rounds']} rounds, "
          f"request {oracle['wall_ms']:.1f} ms against AR's {oracle['ar_wall_ms']:.1f}: {oracle['vs_ar']:.2f}x")
    print(f"{'config':>10} {'drafter':>9} {'round ms':>9} {'draft':>7} {'verify':>7} {'other':>7} {'break-even accept':>18}"
          f" {'prefill ms':>11} (AR {ar['prefill_ms']:.1f})")
    for steps, topk, n in shapes:
        spec = SpecConfig(steps, topk, n)
        variants = [(False, False)] + ([(True, False), (True, True)] if args.compile else [])
        for compiled, fresh in variants:
            drafter = Eagle3Drafter(draft, spec, target, compile=compiled, fast_topk=args.fast_topk)
            generate_spec(target, drafter, prompt, SamplingParams(max_new_tokens=16), [])  # compile, capture
            if fresh:  # new cache buffers for the request, as without a resident cache: do guards fail on them?
                drafter.kv = None
            _, fused = generate_spec(target, drafter, prompt, params, [])
            generate_spec(target, drafter, prompt, SamplingParams(max_new_tokens=16), [], phased=True)
            _, ph = generate_spec(target, drafter, prompt, params, [], phased=True)
            med = lambda xs: statistics.median(xs)  # noqa: E731
            row = {"config": f"{steps},{topk},{n}", "drafter_compiled": compiled, "fresh_cache": fresh, "round_ms": med(fused.round_ms),
                   "prefill_ms": fused.prefill_ms, "ar_prefill_ms": ar["prefill_ms"],
                   "phased_round_ms": med(ph.round_ms), "draft_ms": med(ph.draft_ms), "verify_ms": med(ph.verify_ms),
                   "other_ms": med(ph.other_ms)}
            row["break_even_accept"] = row["round_ms"] / ar_ms  # accept length at which the round pays
            if args.kernels and compiled and not fresh and dev.type == "cuda":
                row["round_gap"] = round_gap(target, drafter, prompt)
                profiled.append((row, drafter))  # torch.profiler after every timing: see prefill_profile
            rows.append(row)
            print(f"{row['config']:>10} {('fresh' if fresh else 'compiled') if compiled else 'eager':>9} {row['round_ms']:>9.3f} {row['draft_ms']:>7.3f} "
                  f"{row['verify_ms']:>7.3f} {row['other_ms']:>7.3f} {row['break_even_accept']:>18.2f} {row['prefill_ms']:>11.1f}")
    for row, drafter in profiled:
        print(f"kernels of {row['config']}:")
        row["kernels"] = round_kernels(target, drafter, prompt)
    prefill = prefill_profile(target, prompt, tuple(draft.cfg.aux_layer_ids)) if args.kernels and dev.type == "cuda" else {}
    fresh_prompts = {}
    if args.prompt_lens:  # one request per new length: mean prefill ms, AR and each drafter config
        g = torch.Generator().manual_seed(3)
        lens = [int(x) for x in args.prompt_lens.split(",")]
        new = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in lens]
        short = SamplingParams(max_new_tokens=8)
        fresh_prompts["lengths"] = lens
        fresh_prompts["ar_prefill_ms"] = statistics.mean(generate_ar(target, [q], short, [])[1]["prefill_ms"] for q in new)
        for steps, topk, n in shapes:
            drafter = Eagle3Drafter(draft, SpecConfig(steps, topk, n), target, compile=args.compile,
                                    fast_topk=args.fast_topk)
            fresh_prompts[f"{steps},{topk},{n}_prefill_ms"] = statistics.mean(
                generate_spec(target, drafter, q, short, [])[1].prefill_ms for q in new)
        print("mean prefill ms per request at new prompt lengths", lens, {k: round(v, 1) for k, v in fresh_prompts.items()
                                                                         if k != "lengths"})
    out = args.out or result_path("profile_round", machine_name(dev))
    atomic_write_json(out, {"device": name, "target": "smollm2-135m shapes, random weights", "dtype": str(dt).removeprefix("torch."),
                            "compiled_layers": args.compile, "compile_mode": args.mode,
                            "prefix_kernel": getattr(target, "prefix_kernel", False), "gemv_rows": args.gemv_rows, "fast_topk": args.fast_topk,
                            "few_rows": args.few_rows,
                            "prompt_len": args.prompt_len,
                            "new_tokens": args.new_tokens, "ar_ms_per_step": ar_ms, "rows": rows,
                            "new_prompt_lengths": fresh_prompts, "few_rows_check": check,
                            "prefill_profile": prefill})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
