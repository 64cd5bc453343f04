"""Regeneration speed: fledge's batched engine against HF batched `generate`, same batch.

    python bench/bench_regen.py --target smollm2-135m --prompts FIRSTS.jsonl [--batch-sizes 64,256]

Each batch: the first B prompts, length-sorted as `fledge regen` batches them, answered greedily
by both (HF left-padded, eager, dynamic cache: the way a data pipeline calls it). tok/s counts
tokens up to the first end of turn over the whole call, prefill included; `decode_tok_s` is the
rate a refilled batch approaches, which `--stream N` measures. `same_rows` is shown, not
required: batched bf16 on two code paths need not agree exactly.
"""

from __future__ import annotations

import argparse
import sys

import torch
from machine import machine_name, result_path

from fledge.core.devices import pick_device, pick_dtype
from fledge.core.errors import FledgeError
from fledge.core.files import atomic_write_json
from fledge.core.report import print_table as print_rows
from fledge.core.target import eos_ids, load_target
from fledge.engine.decode import ROW_GROUP, cut_at_eos, generate_ar
from fledge.engine.graphs import now
from fledge.engine.hf import build_engine_target
from fledge.engine.sampling import SamplingParams
from fledge.engine.stream import generate_stream
from fledge.perf.bench import load_prompts


def hf_run(hf, prompts: list[list[int]], max_new: int, eos: list[int], pad: int, device) -> tuple[list, dict]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], attn[b, width - len(p):] = torch.tensor(p), 1
    t0 = now(device)
    out = hf.generate(ids.to(device), attention_mask=attn.to(device), max_new_tokens=max_new, do_sample=False,
                      eos_token_id=eos, pad_token_id=pad, disable_compile=True)
    seconds = now(device) - t0
    rows = [cut_at_eos(r, eos) for r in out[:, width:].tolist()]
    n = sum(map(len, rows))
    return rows, {"tokens": n, "seconds": seconds, "tok_s": n / seconds}


def engine_run(engine, prompts, max_new: int, eos: list[int], device, row_group: int = ROW_GROUP) -> tuple[list, dict]:
    t0 = now(device)
    rows, st = generate_ar(engine, prompts, SamplingParams(max_new_tokens=max_new), eos, row_group=row_group)
    seconds, n = now(device) - t0, sum(map(len, rows))
    return rows, {"tokens": n, "seconds": seconds, "tok_s": n / seconds,
                  **{k: st[k] for k in ("decode_tok_s", "decode_steps", "prefill_ms", "row_groups", "spans")}}


def stream_run(engine, prompts, rows: int, max_new: int, eos: list[int], device) -> dict:
    """A stream of prompts through `rows` rows, each refilled when it ends (regen's way)."""
    t0 = now(device)
    _, st = generate_stream(engine, prompts, SamplingParams(max_new_tokens=max_new), eos, rows=rows)
    seconds, n = now(device) - t0, st["generated_tokens"]
    return {"prompts": len(prompts), "tokens": n, "seconds": seconds, "tok_s": n / seconds,
            "decode_steps": st["decode_steps"], "graphs": st["graphs"]}


def bench(args) -> dict:
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    t = load_target(args.target, dtype=dtype, device=device)
    engine = build_engine_target(t.model, dtype, device, compile=args.compile)
    eos = eos_ids(t.tokenizer, t.model.generation_config)
    pad = t.tokenizer.pad_token_id if t.tokenizer.pad_token_id is not None else eos[0]
    sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    every = sorted(set(sizes + [int(b) for b in (args.engine_only or "").split(",") if b]))
    # As `fledge regen` does: a prompt with no room for the answer in --max-len is left out.
    need = max(every + [args.stream])
    prompts = [p for p in load_prompts(args.prompts, 2 * need, t.tokenizer)
               if len(p) + args.max_new_tokens <= args.max_len][:need]
    if len(prompts) < need:
        raise FledgeError(f"{args.prompts}: {len(prompts)} prompts, fewer than the {need} asked for")
    # Untimed warm-up of both paths (CUDA graph capture, allocator, kernel selection, compiles).
    for b in every:
        engine_run(engine, sorted(prompts[:b], key=len), 8, eos, device)
        if args.compare_one_group:
            engine_run(engine, sorted(prompts[:b], key=len), 8, eos, device, row_group=b)
        if args.stream:
            stream_run(engine, prompts[:args.stream], b, 8, eos, device)
    if sizes:
        hf_run(t.model, prompts[:2], 8, eos, pad, device)
    results = []
    for b in every:
        batch = sorted(prompts[:b], key=len)
        rows, timed = engine_run(engine, batch, args.max_new_tokens, eos, device)
        row = {"batch": b, "prompt_tokens": sum(map(len, batch)), "engine": timed}
        if args.compare_one_group:  # the same engine with the whole batch as one group (one span)
            one_rows, row["engine_one_group"] = engine_run(engine, batch, args.max_new_tokens, eos, device, row_group=b)
            row["grouped_vs_one_group"] = timed["tok_s"] / row["engine_one_group"]["tok_s"]
            row["same_rows_one_group"] = sum(x == y for x, y in zip(rows, one_rows))
        if args.stream:
            row["engine_stream"] = stream_run(engine, prompts[:args.stream], b, args.max_new_tokens, eos, device)
        if b in sizes:
            hf_rows, row["hf"] = hf_run(t.model, batch, args.max_new_tokens, eos, pad, device)
            row["engine_vs_hf"] = timed["tok_s"] / row["hf"]["tok_s"]
            if args.stream:
                row["stream_vs_hf"] = row["engine_stream"]["tok_s"] / row["hf"]["tok_s"]
            row["same_rows"] = sum(x == y for x, y in zip(rows, hf_rows))
        results.append(row)
    return {"device": machine_name(device), "target": args.target, "dtype": str(dtype).removeprefix("torch."),
            "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "greedy": True,
            "hf": "generate, eager, dynamic cache, left padding", "compiled_layers": args.compile, "results": results,
            "engine": f"generate_ar, right padding, length-sorted row groups of {ROW_GROUP}, CUDA graph per span tuple"}


def print_table(report: dict) -> None:
    print(f"{report['device']}  {report['target']}  {report['dtype']}  greedy, up to {report['max_new_tokens']} new tokens"
          f"{'  (engine compiled)' if report.get('compiled_layers') else ''}")
    rows = [["batch", "HF tok/s", "engine tok/s", "engine/HF", "same rows", "decode tok/s", "1-group tok/s", "stream tok/s"]]
    for r in report["results"]:
        hf, one, st = r.get("hf"), r.get("engine_one_group"), r.get("engine_stream")
        rows.append([r["batch"], f"{hf['tok_s']:.1f}" if hf else "-", f"{r['engine']['tok_s']:.1f}",
                     f"{r['engine_vs_hf']:.2f}x" if hf else "-", f"{r['same_rows']}/{r['batch']}" if hf else "-",
                     f"{r['engine']['decode_tok_s']:.1f}", f"{one['tok_s']:.1f}" if one else "-",
                     f"{st['tok_s']:.1f}" if st else "-"])
    print_rows(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--prompts", default="mtbench", help="built-in data set or conversations JSONL")
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--engine-only", help="further batch sizes run on the engine alone (HF at 512+ costs minutes)")
    p.add_argument("--compile", action="store_true", help="torch.compile the engine's layer functions")
    p.add_argument("--compare-one-group", action="store_true",
                   help="also run each batch as one row group (one attention span, one prefill): what grouping buys")
    p.add_argument("--stream", type=int, default=0, metavar="N",
                   help="also stream N prompts through each batch size's rows, refilling rows as they end")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--max-len", type=int, default=2048, help="prompt + answer must fit (as fledge regen's --max-len)")
    p.add_argument("--device")
    p.add_argument("--dtype")
    p.add_argument("--out", help="JSON path (default bench/results/regen_<machine>.json)")
    args = p.parse_args(argv)
    try:
        report = bench(args)
    except FledgeError as e:
        print(f"bench_regen: error: {e}", file=sys.stderr)
        return 2
    print_table(report)
    out = args.out or result_path("regen", report["device"])
    atomic_write_json(out, report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
