"""`fledge tune --target T --drafter D` for a block drafter (DFlash, or P-EAGLE: an EAGLE-3
drafter drafting in parallel): its round is one drafter forward and one verify, whatever the
chain length, so the cost model is

    tok/s(k) = E[accept length of a chain of k] / (t_block + t_verify(k + 1))

against plain decoding at 1 / t_ar. The engine runs the longest chain the drafter's block
allows (or --max-steps): its accepted paths give P(reached depth d), hence E[accept length]
= 1 + sum over d <= k of P(reached d) for every shorter chain; its rounds, less the verify of
k + 1 tokens timed alone, give t_block (the drafter's forward and the round's bookkeeping).
Shorter chains are predicted from the longest one's drafts: a block of fewer masks drafts
slightly different tokens (the masks attend to each other), which the prediction ignores.
"""

from __future__ import annotations

import json

from fledge.core.shape import Shape
from fledge.drafter.layout import is_dflash
from fledge.engine import rig as engine_rig
from fledge.engine.block import BlockDrafter, load_block_rig
from fledge.perf import bench
from fledge.perf.acceptance import Prediction


def chain_predictions(reach: list[float], block_ms: float, verify_ms: dict[int, float], ar_ms: float) -> list[Prediction]:
    """Chains of 1..len(reach), best first. `reach[d-1]`: P(a round's accepted path reached depth d)."""
    preds = []
    for k in range(1, len(reach) + 1):
        accept, iter_ms = 1.0 + sum(reach[:k]), block_ms + verify_ms[k + 1]
        preds.append(Prediction(Shape(k, 1, k + 1), accept, iter_ms, 1e3 * accept / iter_ms, ar_ms * accept / iter_ms,
                                iter_ms / ar_ms))
    return sorted(preds, key=lambda p: -p.tok_s)


def measure_block(rig, make_drafter, prompts, steps: int, max_new_tokens: int, iters: int) -> dict:
    """Plain decoding, the chain of `steps` (`make_drafter(shape)`) through the engine's fused
    rounds, and the verify of 2..steps+1 tokens alone, on the same rig."""
    ar = engine_rig.run_ar(rig, prompts, max_new_tokens)
    drafter = make_drafter(Shape(steps, 1, steps + 1))
    stats, tok_s = engine_rig.run_shape(rig, drafter, prompts, max_new_tokens, f"chain of {steps}")
    sm = stats.summary()
    context = max(map(len, prompts)) + max_new_tokens // 2
    verify = engine_rig.measure_verify_ms(rig, range(2, steps + 2), context, iters)
    return {"ar_ms": ar["ar_ms"], "ar_tok_s": ar["tok_s"], "steps": steps, "reach": sm["depth_acceptance"],
            "accept_length": sm["accept_length"], "round_ms": sm["round_ms_per_step"], "tok_s": tok_s,
            "verify_ms": verify, "block_ms": sm["round_ms_per_step"] - verify[steps + 1]}


def vllm_flags(drafter: str, k: int, method: str = "dflash") -> str:
    """vLLM's flag for a chain of k: DFlash's method, or P-EAGLE's (eagle3 with parallel_drafting)."""
    spec = {"method": method, "model": drafter, "num_speculative_tokens": k}
    if method == "peagle":
        spec = {**spec, "method": "eagle3", "parallel_drafting": True}
    return f"--speculative-config '{json.dumps(spec)}'"


def _rig(args):
    """(rig, make_drafter, longest chain, method) for the block drafter at --drafter."""
    if is_dflash(args.drafter):
        rig, draft = load_block_rig(args.target, args.drafter, args.device, args.dtype)
        return (rig, lambda shape: BlockDrafter(draft, shape, rig.target, compile=rig.compiled),
                min(args.max_depth, draft.cfg.block_size - 1), "dflash")
    rig = engine_rig.load_rig(args.target, args.drafter, args.device, args.dtype)
    return rig, rig.drafter, args.max_depth, "peagle"


def block_tune(args) -> tuple[str, dict, list[Prediction]]:
    rig, make_drafter, steps, method = _rig(args)
    prompts = bench.load_prompts(args.prompts, args.num_prompts, rig.tokenizer)
    m = measure_block(rig, make_drafter, prompts, steps, args.max_new_tokens, 20 if rig.device.type == "cuda" else 3)
    preds = chain_predictions(m["reach"], m["block_ms"], m["verify_ms"], m["ar_ms"])
    best, ar_tok_s = preds[0], 1e3 / m["ar_ms"]
    lines = [f"timings: measured on fledge's engine ({engine_rig.engine_path(rig)}), batch 1; a {method} round is one "
             f"drafter forward ({m['block_ms']:.2f} ms with the round's bookkeeping) and one verify",
             f"plain decoding: {ar_tok_s:.1f} tok/s ({m['ar_ms']:.2f} ms a step); measured chain of {steps}: accept "
             f"{m['accept_length']:.2f}, {m['round_ms']:.2f} ms a round, {m['tok_s']:.1f} tok/s",
             f"{'steps':>5} {'accept':>7} {'iter ms':>8} {'tok/s':>8} {'speedup':>8} {'break-even':>10}"]
    lines += [f"{p.shape.num_steps:>5} {p.accept_length:>7.2f} {p.iter_ms:>8.2f} {p.tok_s:>8.1f} {p.speedup:>7.2f}x "
              f"{p.break_even:>10.2f}" for p in preds]
    pays = best.speedup > 1 + args.margin
    lines.append(f"WINS: a chain of {best.shape.num_steps}, {best.speedup:.2f}x plain decoding\n  vLLM:   "
                 + vllm_flags(args.drafter, best.shape.num_steps, method) if pays else
                 f"LOSES: no chain beats plain decoding by {100 * args.margin:.0f}%: serve without speculation")
    data = {"method": method, "ar_tok_s": ar_tok_s, "ar_measured_tok_s": m["ar_tok_s"], "measured": m, "pays": pays,
            "best": {"num_steps": best.shape.num_steps, "speedup": best.speedup,
                     "vllm": vllm_flags(args.drafter, best.shape.num_steps, method)},
            "predictions": [{"num_steps": p.shape.num_steps, "accept_length": p.accept_length, "iter_ms": p.iter_ms,
                             "tok_s": p.tok_s, "speedup": p.speedup} for p in preds]}
    return "\n".join(lines), data, preds
