"""`fledge generate`: one prompt through the engine, plain AR or speculative, with stats."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fledge.engine.drafters import Eagle3Drafter, NgramDrafter, OracleDrafter, SpecConfig
from fledge.engine.generate import SamplingParams, generate_ar
from fledge.engine.model import build_engine_target
from fledge.engine.spec import generate_spec, oracle_text
from fledge.util import FledgeError, atomic_write_json, pick_device, pick_dtype


def eos_ids(hf_model, tokenizer) -> list[int]:
    """Every id that ends a turn: the generation config's (often a list) and the tokenizer's."""
    ids = getattr(hf_model.generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` in the target's chat template, ready for the assistant turn."""
    if not tokenizer.chat_template:
        return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
    enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True)
    return list(enc["input_ids"])


def spec_config(num_steps: int, topk: int, num_draft_tokens: int | None) -> SpecConfig:
    if num_draft_tokens is None:
        if topk > 1:
            raise FledgeError("--num-draft-tokens is required for a tree (--topk > 1)")
        num_draft_tokens = num_steps + 1
    return SpecConfig(num_steps, topk, num_draft_tokens)


def load_drafter(path: str, spec: SpecConfig, hf_model, engine_target, device, dtype,
                 compile: bool = False, fast_topk: bool = True) -> Eagle3Drafter:
    """`compile`, `fast_topk`: see Eagle3Drafter."""
    from fledge.checkpoint import load_checkpoint

    draft = load_checkpoint(path, embed_from=hf_model).eval().cast(device, dtype)
    return Eagle3Drafter(draft, spec, engine_target, compile, fast_topk)


def _messages(args) -> list[dict]:
    if args.prompt is not None:
        return [{"role": "user", "content": args.prompt}]
    text = Path(args.messages).read_text() if Path(args.messages).is_file() else args.messages
    try:
        msgs = json.loads(text)
    except json.JSONDecodeError as e:
        raise FledgeError(f"--messages: not valid JSON ({e.msg})") from None
    if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in msgs)):
        raise FledgeError('--messages: expected a JSON list of {"role": ..., "content": ...}')
    return msgs


def run_generate(args) -> int:
    from fledge.target import load_target

    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    spec = spec_config(args.num_steps, args.topk, args.num_draft_tokens)
    params = SamplingParams(args.temperature, args.top_p, args.max_new_tokens, args.seed)
    t = load_target(args.target, dtype=dtype, device=device)
    target = build_engine_target(t.model, dtype, device, compile=args.compile)
    prompt = encode_chat(t.tokenizer, _messages(args))
    eos = eos_ids(t.model, t.tokenizer)
    if args.drafter:
        drafter = load_drafter(args.drafter, spec, t.model, target, device, dtype, args.compile)
    elif args.oracle:
        greedy = SamplingParams(0.0, 1.0, args.max_new_tokens, args.seed)
        own, _ = oracle_text(target, spec, prompt, generate_ar(target, [prompt], greedy, eos)[0][0], greedy, eos)
        drafter = OracleDrafter(spec, [prompt + own])
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
    print(t.tokenizer.decode(out, skip_special_tokens=False))
    print("-" * 60)
    print(report)
    if args.json:
        atomic_write_json(args.json, {"prompt_tokens": len(prompt), "output_ids": out, **summary})
    return 0
