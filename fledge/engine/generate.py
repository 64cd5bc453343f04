"""`fledge generate`: one prompt through the engine, plain AR or speculative, with stats."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fledge.core.devices import pick_device, pick_dtype
from fledge.core.errors import FledgeError
from fledge.core.files import atomic_write_json
from fledge.core.shape import Shape, shape_problem
from fledge.core.target import encode_chat, eos_ids, load_target
from fledge.engine.decode import generate_ar
from fledge.engine.drafters import NgramDrafter, OracleDrafter, load_drafter
from fledge.engine.hf import build_engine_target
from fledge.engine.parallel import ParallelDrafter
from fledge.engine.sampling import SamplingParams
from fledge.engine.spec import generate_spec, oracle_text


def spec_config(num_steps: int, topk: int, num_draft_tokens: int | None) -> Shape:
    if num_draft_tokens is None:
        if topk > 1:
            raise FledgeError("--num-draft-tokens is required for a tree (--topk > 1)")
        num_draft_tokens = num_steps + 1
    problem = shape_problem(num_steps, topk, num_draft_tokens)
    if problem:
        raise FledgeError(f"--num-steps {num_steps} --topk {topk} --num-draft-tokens {num_draft_tokens}: {problem}")
    return Shape(num_steps, topk, num_draft_tokens)


def _messages(args) -> list[dict]:
    if args.prompt is not None:
        return [{"role": "user", "content": args.prompt}]
    # os.path.isfile, not Path.is_file: inline JSON longer than a file name makes the latter raise.
    is_file = os.path.isfile(args.messages)
    where = f"--messages {args.messages}" if is_file else "--messages"
    try:
        msgs = json.loads(Path(args.messages).read_text() if is_file else args.messages)
    except json.JSONDecodeError as e:
        raise FledgeError(f"{where}: not valid JSON ({e.msg})") from None
    if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in msgs)):
        raise FledgeError(f'{where}: expected a JSON list of {{"role": ..., "content": ...}}')
    return msgs


def run_generate(args) -> int:
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    spec = spec_config(args.num_steps, args.topk, args.num_draft_tokens)
    if args.oracle:
        OracleDrafter.check(spec)  # before the target loads and its AR run
    params = SamplingParams(args.temperature, args.top_p, args.max_new_tokens, args.seed)
    t = load_target(args.target, dtype=dtype, device=device, chat_template=args.chat_template, chat=True)
    target = build_engine_target(t.model, dtype, device, compile=args.compile)
    prompt = encode_chat(t.tokenizer, _messages(args))
    eos = eos_ids(t.tokenizer, t.model.generation_config)
    if args.drafter:
        drafter = load_drafter(args.drafter, spec, t.model, target, device, dtype, args.compile)
        if drafter.draft.cfg.parallel:  # P-EAGLE: its chain in one forward, as it was trained
            drafter = ParallelDrafter(drafter.draft, spec, target, args.compile)
    elif args.oracle:
        greedy = SamplingParams(0.0, 1.0, args.max_new_tokens, args.seed)
        own, _ = oracle_text(target, spec, prompt, generate_ar(target, [prompt], greedy, eos)[0][0], greedy, eos)
        drafter = OracleDrafter(spec, [prompt + own], device)
    elif args.ngram:
        drafter = NgramDrafter(spec, args.ngram)
    else:
        drafter = None
    if drafter is None:
        rows, ar = generate_ar(target, [prompt], params, eos)
        out, summary = rows[0], ar
        report = f"AR: {ar['generated_tokens']} tokens  {ar['tok_s']:.1f} tok/s  (prefill {ar['prefill_ms']:.1f} ms)"
    else:
        out, stats = generate_spec(target, drafter, prompt, params, eos, phased=args.phased)
        summary, report = stats.summary(), stats.report()
        if params.temperature == 0:  # greedy: speculation must give plain decoding's tokens exactly
            summary["equal_to_plain"] = out == generate_ar(target, [prompt], params, eos)[0][0]
            report += (f"\noutput equal to plain decoding: {int(summary['equal_to_plain'])}/1"
                       + ("" if summary["equal_to_plain"] else " (fp32 keeps them equal; bf16 may differ at ties)"))
    print(t.tokenizer.decode(out, skip_special_tokens=False))
    print("-" * 60)
    print(report)
    if args.json:
        atomic_write_json(args.json, {"prompt_tokens": len(prompt), "output_ids": out, **summary})
    return 0
