"""`fledge tune engine`: time fledge's own engine, measure the drafter's acceptance, predict
every shape with fledge.perf.tune's cost model, and with --validate run shapes for real and
compare (predicted against measured tok/s, split into accept length and round time)."""

from __future__ import annotations

import itertools
import statistics
import sys
from dataclasses import asdict

from fledge.core.shape import Shape, parse_shapes
from fledge.drafter.layout import is_dflash, is_parallel
from fledge.engine import rig as engine_rig
from fledge.perf import bench
from fledge.perf.acceptance import Profile, profile_from_json
from fledge.perf.hwmodel import Timings
from fledge.perf.tune import Prediction, check_args, finish, grid, predict, ranked
from fledge.perf.tune_block import block_tune


def run_engine(args) -> int:
    """`fledge tune engine`: time the engine as `fledge generate` runs it, measure acceptance,
    predict every shape; with --validate, also run shapes for real and compare. A block
    drafter's chains (DFlash, P-EAGLE) are predicted by fledge.perf.tune_block."""
    check_args(args)
    if is_dflash(args.drafter) or is_parallel(args.drafter):
        return finish(args, block_tune(args))
    rig = engine_rig.load_rig(args.target, args.drafter, args.device, args.dtype)
    prompts = bench.load_prompts(args.prompts, args.num_prompts, rig.tokenizer)
    ar = engine_rig.run_ar(rig, prompts, args.max_new_tokens)
    topks = sorted({1, *[k for k in (2, 4, 8) if k <= args.probe_topk]})
    context = max(len(p) for p in prompts) + args.max_new_tokens // 2
    shapes = grid(args.max_depth, tuple(topks))
    # Every width a shape verifies, timed rather than interpolated: the engine's matmul path
    # changes with the row count (reductions up to model.GEMV_ROWS, then the few-rows kernel),
    # so verify time is not smooth in n.
    sizes = sorted({s.num_draft_tokens for s in shapes})
    iters = 20 if rig.device.type == "cuda" else 3  # CPU forwards are slow and steady
    draft_tokens = min(64, args.max_new_tokens)
    print(time_left(args, ar["ar_ms"], len(prompts), len(topks), draft_tokens), file=sys.stderr, flush=True)
    verify_ms = engine_rig.measure_verify_ms(rig, sizes, context, iters)
    draft_ms, overhead = engine_rig.measure_draft_ms(rig, prompts[:2], topks, draft_tokens, context, iters)
    timings = Timings(ar["ar_ms"], verify_ms, draft_ms, overhead, batch=1)
    if args.accept_json:
        profile = profile_from_json(args.accept_json)
    else:
        probed = engine_rig.probe_profile(rig, prompts, args.max_depth, args.probe_topk, args.max_new_tokens)
        profile = Profile(probed["ranks"], probed["spine"])
    note = f"timings: measured on fledge's engine ({engine_rig.engine_path(rig)}), batch 1"
    text, data, preds = ranked(args, profile, timings, shapes, None, (note,))
    data["ar_measured_tok_s"] = ar["tok_s"]
    if args.validate:
        picks = parse_shapes(args.shapes) if args.shapes else validation_shapes(preds)
        data["validation"] = validate(rig, prompts, [predict(profile, timings, s) for s in picks], args.max_new_tokens,
                                      ar["tok_s"])
        text += "\n" + validation_table(data["validation"])
    return finish(args, (text, data, preds))


def time_left(args, ar_ms: float, n_prompts: int, n_topks: int, draft_tokens: int) -> str:
    """What comes next and how long, in one line, before minutes without a result: the tokens
    run_engine's runs decode (each run also decodes 8 to warm up), at plain decoding's pace."""
    per_run = n_prompts * args.max_new_tokens + 8
    tokens = 2 * n_topks * (min(n_prompts, 2) * draft_tokens + 8) + (0 if args.accept_json else per_run)
    if args.validate:
        tokens += (len(parse_shapes(args.shapes)) if args.shapes else 8) * per_run  # 8: validation_shapes' count
    return (f"tune: plain decoding takes {ar_ms:.1f} ms a token on this target; the timing runs and the acceptance "
            f"probe decode {tokens} tokens next: about {tokens * ar_ms / 60e3:.1f} min at that pace (more while the "
            "drafter misses, less while it hits)")


def validation_shapes(preds: list[Prediction], want: int = 8) -> list[Shape]:
    """The predicted best chain and tree, the fixed reference shapes the grid holds, then the
    next best of each kind in turn: `want` shapes (chains and trees both present when the grid
    has trees)."""
    chains = [p.shape for p in preds if p.shape.topk == 1]
    trees = [p.shape for p in preds if p.shape.topk > 1]
    fixed = [s for s in (Shape(2, 1, 3), Shape(4, 1, 5), Shape(6, 1, 7), Shape(4, 2, 8), Shape(5, 4, 16), Shape(6, 4, 32))
             if s in chains or s in trees]
    turns = [s for pair in itertools.zip_longest(chains, trees) for s in pair if s is not None]
    return list(dict.fromkeys(chains[:1] + trees[:1] + fixed + turns))[:want]


def validate(rig, prompts, preds: list[Prediction], max_new_tokens: int, ar_tok_s: float) -> list[dict]:
    """Run each predicted shape on the engine: measured against predicted tok/s, and its two
    factors apart — accept length (the profile) and round time (the timings)."""
    def err(predicted, measured):
        return 100 * (predicted - measured) / measured

    rows = []
    for p in preds:
        stats, tok_s = engine_rig.run_shape(rig, rig.drafter(p.shape), prompts, max_new_tokens, f"validate {p.shape.label}")
        accept, round_ms = stats.accept_length(), stats.summary()["round_ms_per_step"]
        rows.append({**asdict(p.shape), "label": p.shape.label,
                     "accept_predicted": p.accept_length, "accept_measured": accept,
                     "accept_error_percent": err(p.accept_length, accept),
                     "round_ms_predicted": p.iter_ms, "round_ms_measured": round_ms,
                     "round_error_percent": err(p.iter_ms, round_ms),
                     "tok_s_predicted": p.tok_s, "tok_s_measured": tok_s, "speedup_measured": tok_s / ar_tok_s,
                     "error_percent": err(p.tok_s, tok_s)})
    return rows


def validation_table(rows: list[dict]) -> str:
    lines = [f"{'steps':>5} {'topk':>4} {'tokens':>6} {'accept pred':>11} {'meas':>6} {'error':>7} "
             f"{'round ms pred':>13} {'meas':>6} {'error':>7} {'tok/s pred':>10} {'meas':>8} {'error':>7}"]
    for r in rows:
        lines.append(f"{r['num_steps']:>5} {r['topk']:>4} {r['num_draft_tokens']:>6} {r['accept_predicted']:>11.2f} "
                     f"{r['accept_measured']:>6.2f} {r['accept_error_percent']:>+6.1f}% {r['round_ms_predicted']:>13.3f} "
                     f"{r['round_ms_measured']:>6.3f} {r['round_error_percent']:>+6.1f}% {r['tok_s_predicted']:>10.1f} "
                     f"{r['tok_s_measured']:>8.1f} {r['error_percent']:>+6.1f}%")

    def spread(key):
        errs = [abs(r[key]) for r in rows]
        return f"{statistics.mean(errs):.1f}%  max {max(errs):.1f}%"

    pred, meas = (max(rows, key=lambda r: r[key])["label"] for key in ("tok_s_predicted", "tok_s_measured"))
    lines.append(f"tok/s mean |error| {spread('error_percent')} over {len(rows)} shapes; best shape "
                 f"{'the same' if pred == meas else 'differs'} (predicted {pred}, measured {meas})")
    lines.append(f"accept length mean |error| {spread('accept_error_percent')}; round time mean |error| "
                 f"{spread('round_error_percent')}")
    return "\n".join(lines)
