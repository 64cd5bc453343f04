"""`fledge tune`: predict speculative-decoding tok/s before deploying, and pick the flags.

The cost model, per verify round of one request at a given batch size:

    tok/s = E[accept length] / (num_steps * t_draft(topk) + t_verify(num_draft_tokens) + overhead)

against plain decoding at 1 / t_ar. Accept length is SGLang's (fledge.perf.acceptance models it), so
speculation pays iff E[accept length] > t_iter / t_ar — the break-even accept length this module
reports. Where only an accept length is known (`--accept-length`, measured at `--accept-shape`),
the profile is fledge.perf.acceptance's sibling prior fitted to it.

Timings (fledge.perf.hwmodel.Timings) come from the user (--what-if), from the hardware model
(--model: the configs and the hardware, optionally calibrated on a live server), or from the
engine (--target). A shape "pays" only if its predicted gain exceeds `--margin` (default 5%):
below that the difference is inside what the timings and the model can resolve, and the verdict
is to serve without speculation.
"""

from __future__ import annotations

import itertools
import statistics
import sys
from dataclasses import asdict, dataclass

from fledge.core.errors import FledgeError
from fledge.core.files import atomic_write_json
from fledge.core.report import save_figure, subplots
from fledge.core.shape import Shape, max_nodes, parse_shapes
from fledge.engine import rig as engine_rig
from fledge.perf import bench, hwmodel
from fledge.perf.acceptance import (
    Profile,
    expected_accept_length,
    profile_from_args,
    profile_from_json,
)
from fledge.perf.calibrate import cmd_calibrate, load_profile
from fledge.perf.hwmodel import Timings
from fledge.perf.serving import parse_levels


def parse_ms_table(text: str, arg: str) -> dict[int, float]:
    """"1:11.6,8:30" → {1: 11.6, 8: 30.0}; a bare "1.5" means the same time for every key."""
    try:
        if ":" not in text:
            return {1: float(text)}
        return {int(k): float(v) for k, v in (item.split(":") for item in text.split(",") if item.strip())}
    except ValueError:
        raise FledgeError(f"{arg} {text!r}: expected N:MS pairs like '1:11.6,8:30'") from None


# --------------------------------------------------------------------------- predictions
@dataclass
class Prediction:
    shape: Shape
    accept_length: float  # SGLang definition, bonus included
    iter_ms: float
    tok_s: float  # per request
    speedup: float  # vs plain decoding at the same batch size
    break_even: float  # accept length at which this shape only matches plain decoding


def predict(profile: Profile, timings: Timings, shape: Shape) -> Prediction:
    L = expected_accept_length(profile, shape)
    t = timings.round_ms(shape)
    ms = timings.spec_ms(L, t)
    return Prediction(shape, L, t, 1e3 / ms, timings.plain_ms / ms, t / timings.ar_ms)


def grid(max_steps: int = 8, topks=(1, 2, 4, 8), draft_tokens=(4, 8, 16, 32, 64)) -> list[Shape]:
    """Chains of 1..max_steps, and trees of every (steps, topk > 1, draft tokens) that fits."""
    return [Shape(s, 1, s + 1) for s in range(1, max_steps + 1)] + [
        Shape(s, k, n) for s in range(2, max_steps + 1) for k in topks for n in draft_tokens
        if k > 1 and s + 1 < n <= max_nodes(s, k)]


def rank_all(profile: Profile, timings: Timings, shapes: list[Shape]) -> list[Prediction]:
    """Predictions for every shape the profile can speak for, best tok/s first. Trees need
    rank > 0 probabilities: a chain-only profile is evaluated on chains only."""
    usable = [s for s in shapes if s.topk == 1 or profile.width > 1]
    return sorted((predict(profile, timings, s) for s in usable), key=lambda p: -p.tok_s)


def sweep(profile: Profile, timings_at, shapes: list[Shape], levels, margin: float) -> list[dict]:
    """Best shape and speed-up at each concurrency; `timings_at(c)` gives the Timings of batch c."""
    rows = []
    for c in levels:
        t = timings_at(c)
        best = rank_all(profile, t, shapes)[0]
        rows.append({"concurrency": c, "ar_tok_s_per_request": 1e3 / t.ar_ms, "ar_tok_s_total": c * 1e3 / t.ar_ms,
                     "best": asdict(best.shape), "label": best.shape.label, "speedup": best.speedup,
                     "pays": best.speedup > 1 + margin})
    return rows


def stops_paying(rows: list[dict]) -> int | None:
    """The first concurrency at which speculation no longer pays (None: it pays at every level shown)."""
    return next((r["concurrency"] for r in rows if not r["pays"]), None)


# --------------------------------------------------------------------------- verdict and report
@dataclass
class Verdict:
    pays: bool
    line: str
    change: str  # what would make the reference shape pay (or keep paying), one line


def verdict(preds: list[Prediction], timings: Timings, margin: float, ref: Prediction | None = None) -> Verdict:
    """One line: speculate with the best shape only if it beats plain decoding by more than
    `margin`; and for `ref` (default the best shape) the verify time or the accept length at
    which it would clear that bar."""
    best, ar_tok_s, need = preds[0], 1e3 / timings.plain_ms, 1 + margin
    gain = 100 * (best.speedup - 1)
    if best.speedup > need:
        line = (f"VERDICT: speculate with {best.shape.label}: {best.tok_s:.1f} tok/s per request against "
                f"{ar_tok_s:.1f} without ({gain:+.1f}%)")
    else:
        why = ("every shape loses" if best.speedup <= 1 else
               f"the best gain, {gain:+.1f}% ({best.shape.label}), is inside the {100 * margin:.0f}% margin")
        line = f"VERDICT: serve without speculation — {why}; plain decoding {ar_tok_s:.1f} tok/s per request"
    ref = ref or best
    s = ref.shape
    rest = s.num_steps * timings.draft(s.topk) + timings.overhead_ms
    round_ms_per_token = timings.plain_ms / need - timings.prefill_per_token_ms  # what beats plain by `margin`
    verify_max = ref.accept_length * round_ms_per_token - rest
    accept_min = ref.iter_ms / round_ms_per_token if round_ms_per_token > 0 else float("inf")
    v = (f"verify <= {verify_max:.2f} ms (predicted {timings.verify(s.num_draft_tokens):.2f})" if verify_max > 0 else
         f"no verify time is enough (drafting and the rest of a round take {rest:.2f} ms)")
    a = (f"accept length >= {accept_min:.2f} (now {ref.accept_length:.2f})"
         + (f", more than {s.label} can accept ({s.path_len})" if accept_min > s.path_len else ""))
    return Verdict(best.speedup > need, line, f"{s.label} beats plain decoding by {100 * margin:.0f}% at: {v}, or {a}")


def report(preds: list[Prediction], timings: Timings, drafter: str, margin: float = 0.05, ref: Prediction | None = None,
           notes: tuple[str, ...] = (), conc: list[dict] | None = None) -> tuple[str, dict]:
    """One screen: where the figures come from, the table, the verdict, flags only if it pays,
    the break-even accept length, what would have to change; and the same as a JSON-able dict."""
    ar = 1e3 / timings.plain_ms  # the verdict's baseline: with --output-len, prefill shared over the answer
    prefill = timings.prefill_per_token_ms
    best = preds[0]
    v = verdict(preds, timings, margin, ref)
    lines = [*notes, f"plain decoding: {ar:.1f} tok/s per request ({timings.ar_ms:.2f} ms a step"
             + (f" + {prefill:.2f} ms of prefill a token" if prefill else "") + f", batch {timings.batch}); "
             "accept length = SGLang's (accepted + bonus per verify step)",
             f"{'steps':>5} {'topk':>4} {'tokens':>6} {'accept':>7} {'iter ms':>8} {'tok/s':>8} {'speedup':>8} "
             f"{'break-even':>10}"]
    for p in preds[:12]:
        s = p.shape
        lines.append(f"{s.num_steps:>5} {s.topk:>4} {s.num_draft_tokens:>6} {p.accept_length:>7.2f} {p.iter_ms:>8.2f} "
                     f"{p.tok_s:>8.1f} {p.speedup:>7.2f}x {p.break_even:>10.2f}")
    lines.append(v.line)
    if v.pays:
        vllm = best.shape.vllm_flags(drafter)
        chains = [p for p in preds if p.shape.topk == 1]
        lines.append(f"  SGLang: {best.shape.sglang_flags()}")
        if vllm:
            lines.append(f"  vLLM:   {vllm}")
        elif chains and chains[0].speedup > 1 + margin:
            lines.append(f"  vLLM:   drafts chains only; its best chain {chains[0].shape.label} ({chains[0].speedup:.2f}x): "
                         + chains[0].shape.vllm_flags(drafter))
        else:
            lines.append("  vLLM:   drafts chains only, and no chain pays: serve it without speculation")
    ref = ref or best
    lines.append(f"break-even accept length at {ref.shape.label}: {ref.break_even:.2f} (predicted {ref.accept_length:.2f})")
    lines.append(("to keep paying" if ref.speedup > 1 + margin else "to pay") + f": {v.change}")
    data = {"ar_tok_s": ar, "timings": asdict(timings), "margin": margin, "pays": v.pays, "verdict": v.line,
            "verdict_short": "WINS" if v.pays else "LOSES", "gain_percent": 100 * (best.speedup - 1), "change": v.change,
            "best": _pred_dict(best, drafter), "reference": _pred_dict(ref, drafter), "notes": list(notes),
            "predictions": [_pred_dict(p, drafter) for p in preds]}
    if conc:
        stop = stops_paying(conc)
        lines.append(f"{'concurrency':>11} {'plain tok/s':>11} {'best shape':>12} {'speedup':>8}")
        lines += [f"{r['concurrency']:>11} {r['ar_tok_s_total']:>11.1f} {r['label']:>12} {r['speedup']:>7.2f}x" for r in conc]
        lines.append("speculation pays at concurrency " + (", ".join(str(r["concurrency"]) for r in conc if r["pays"]) or "none")
                     + "; " + (f"it stops paying at {stop}" if stop else "at every level shown"))
        data.update(concurrency=conc, stops_paying_at=stop)
    return "\n".join(line for line in lines if line), data


def _pred_dict(p: Prediction, drafter: str) -> dict:
    return {**asdict(p.shape), "accept_length": p.accept_length, "iter_ms": p.iter_ms, "tok_s": p.tok_s,
            "speedup": p.speedup, "break_even_accept_length": p.break_even,
            "sglang": p.shape.sglang_flags(), "vllm": p.shape.vllm_flags(drafter)}


def plot(preds: list[Prediction], ar_tok_s: float, path, validation: list[dict] | None = None,
         conc: list[dict] | None = None):
    """Speed-up by shape (`validate`'s measured points on top) and, given a sweep, the best
    speed-up by concurrency."""
    shown = preds[:24]
    measured = {r["label"]: r["tok_s_measured"] for r in validation or []}
    fig, axes = subplots(1, 2 if conc else 1, figsize=(max(6, 0.45 * len(shown)) + (5 if conc else 0), 4), squeeze=False)
    ax = axes[0][0]
    ax.bar(range(len(shown)), [p.speedup for p in shown], color="#4c78a8", label="predicted")
    if measured:
        xs = [i for i, p in enumerate(shown) if p.shape.label in measured]
        ax.scatter(xs, [measured[shown[i].shape.label] / ar_tok_s for i in xs], color="#e45756", zorder=3,
                   label="measured")
    ax.axhline(1.0, color="black", linestyle="--", label=f"no speculation ({ar_tok_s:.0f} tok/s)")
    ax.set_xticks(range(len(shown)), [p.shape.label for p in shown], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("speed-up per request")
    ax.legend(fontsize=8)
    if conc:
        bx = axes[0][1]
        bx.plot([r["concurrency"] for r in conc], [r["speedup"] for r in conc], marker="o", color="#4c78a8")
        for r in conc:
            bx.annotate(r["label"], (r["concurrency"], r["speedup"]), fontsize=6, rotation=30)
        bx.axhline(1.0, color="black", linestyle="--")
        bx.set_xscale("log", base=2)
        bx.set(xlabel="concurrency", ylabel="best speed-up")
    fig.tight_layout()
    save_figure(fig, path)


# --------------------------------------------------------------------------- inputs from the CLI
def machine(args) -> tuple[hwmodel.Hardware, str]:
    """Hardware from --profile (a `tune calibrate` output), then the CLI's table names and overrides."""
    base = load_profile(args.profile, "--profile")["hardware"] if args.profile else {}
    gpu = args.gpu or base.get("gpu")
    if not gpu:
        raise FledgeError(f"--model needs --gpu NAME (one of {', '.join(hwmodel.GPUS)}) or --profile FROM_CALIBRATE")
    cli = {"hbm_gbs": args.hbm_gbs, "latency_us": args.allreduce_us, "bus_gbs": args.allreduce_gbs,
           "host_ms": args.host_ms, "bw_efficiency": args.bw_efficiency, "flops_efficiency": args.flops_efficiency}
    if args.tflops:
        cli["tflops"] = {k: args.tflops for k in ("bf16", "fp16", "fp8", "fp32")}
    over = {**base.get("overrides", {}), **{k: v for k, v in cli.items() if v is not None}}
    tp, link = args.tp or base.get("tp", 1), args.interconnect or base.get("interconnect", "nvlink")
    hw = hwmodel.hardware(gpu, tp, link, cuda_graphs=not args.no_cuda_graphs and base.get("cuda_graphs", True), **over)
    label = f"{tp} x {gpu}" + (f" over {link}" if tp > 1 else "") + (f", calibrated by {args.profile}" if args.profile else "")
    return hw, label


# --------------------------------------------------------------------------- modes
def run_tune(args) -> int:
    if args.action == "calibrate":
        return cmd_calibrate(args)
    mode = (_what_if if args.what_if else _hardware_model if args.model else
            measured_tune if args.target and args.drafter else None)
    if mode is None:
        raise FledgeError("tune needs --model CONFIG --gpu NAME (hardware model), --target T --drafter D (measure the engine), "
                          "--what-if with your own timings, or `tune calibrate --url URL`")
    if args.max_steps < 1:
        raise FledgeError(f"--max-steps {args.max_steps}: must be >= 1")
    if not 0 <= args.margin < 1:
        raise FledgeError(f"--margin {args.margin}: a fraction in [0, 1), e.g. 0.05")
    text, data, preds = mode(args)
    print(text)
    if args.json:
        atomic_write_json(args.json, data)
    if args.png:
        plot(preds, data["ar_tok_s"], args.png, data.get("validation"), data.get("concurrency"))
    return 0


def _ranked(args, profile: Profile, timings: Timings, shapes, ref_shape: Shape | None, notes, conc=None):
    preds = rank_all(profile, timings, shapes)
    ref = predict(profile, timings, ref_shape) if ref_shape else None
    text, data = report(preds, timings, args.drafter or "<drafter dir>", args.margin, ref, notes, conc)
    data["profile"] = profile.tables()
    return text, data, preds


def _what_if(args):
    if args.ar_ms is None or args.verify_ms is None:
        raise FledgeError(f"--what-if needs --{'ar-ms' if args.ar_ms is None else 'verify-ms'}")
    notes = ["timings: as given (--what-if)"]
    if args.draft_ms is not None:
        draft = parse_ms_table(args.draft_ms, "--draft-ms")
    elif args.model:
        target, drafter = hwmodel.load_specs(args.model, args.drafter, args.dtype, args.quant, args.draft_vocab)
        draft = hwmodel.step_times(target, drafter, machine(args)[0], args.batch, args.context).draft_ms
        notes.append("draft step predicted from the drafter's config (--model/--drafter, --gpu): "
                     + ", ".join(f"topk {k}: {v:.3f} ms" for k, v in draft.items()))
    else:
        raise FledgeError("--what-if needs --draft-ms (ms per draft step, by topk '1:0.4,4:0.5'), or --model CONFIG "
                          "--gpu NAME to predict it from the drafter's size (one decoder layer and its LM head)")
    timings = Timings(args.ar_ms, parse_ms_table(args.verify_ms, "--verify-ms"), draft, args.overhead_ms, args.batch)
    profile, ref_shape, note = profile_from_args(args)
    return _ranked(args, profile, timings, grid(args.max_steps), ref_shape, (*notes, note))


def _hardware_model(args):
    target, drafter = hwmodel.load_specs(args.model, args.drafter, args.dtype, args.quant, args.draft_vocab)
    hw, label = machine(args)
    profile, ref_shape, note = profile_from_args(args)

    def timings_at(batch: int) -> Timings:
        return hwmodel.step_times(target, drafter, hw, batch, args.context, args.output_len or 0)

    timings, shapes = timings_at(args.batch), grid(args.max_steps)
    moe = f", MoE {target.active}/{target.experts} experts" if target.experts else ""
    src = (f"hardware model: {args.model} ({target.layers} layers{moe}, {target.quant} weights) on {label}, "
           f"batch {args.batch}, context {args.context}, CUDA graphs {'on' if hw.cuda_graphs else 'off'}"
           + (f"; whole requests: a {args.context}-token prompt's prefill ({timings.prefill_ms:.1f} ms, the batch waits) "
              f"and {args.output_len} new tokens" if args.output_len else "; decode rounds only"))
    conc = sweep(profile, timings_at, shapes, parse_levels(args.concurrency, "--concurrency"), args.margin)
    text, data, preds = _ranked(args, profile, timings, shapes, ref_shape, (src, note), conc)
    data.update(hardware=asdict(hw), breakdown=hwmodel.breakdown(target, drafter, hw, args.batch, args.context))
    return text, data, preds


def measured_tune(args):
    """`fledge tune --target T --drafter D`: time the engine as `fledge generate` runs it, measure
    acceptance, predict every shape; with --validate, also run shapes for real and compare."""
    rig = engine_rig.load_rig(args.target, args.drafter, args.device, args.dtype)
    prompts = bench.load_prompts(args.prompts, args.num_prompts, rig.tokenizer)
    ar = engine_rig.run_ar(rig, prompts, args.max_new_tokens)
    topks = sorted({1, *[k for k in (2, 4, 8) if k <= args.probe_topk]})
    context = max(len(p) for p in prompts) + args.max_new_tokens // 2
    shapes = grid(args.max_steps, tuple(topks))
    # Every width a shape verifies, timed rather than interpolated: the engine's matmul path
    # changes with the row count (reductions up to model.GEMV_ROWS, then the few-rows kernel),
    # so verify time is not smooth in n.
    sizes = sorted({s.num_draft_tokens for s in shapes})
    iters = 20 if rig.device.type == "cuda" else 3  # CPU forwards are slow and steady
    draft_tokens = min(64, args.max_new_tokens)
    print(_time_left(args, ar["ar_ms"], len(prompts), len(topks), draft_tokens), file=sys.stderr, flush=True)
    verify_ms = engine_rig.measure_verify_ms(rig, sizes, context, iters)
    draft_ms, overhead = engine_rig.measure_draft_ms(rig, prompts[:2], topks, draft_tokens, context, iters)
    timings = Timings(ar["ar_ms"], verify_ms, draft_ms, overhead, batch=1)
    if args.profile_json:
        profile = profile_from_json(args.profile_json)
    else:
        probed = engine_rig.probe_profile(rig, prompts, args.max_steps, args.probe_topk, args.max_new_tokens)
        profile = Profile(probed["ranks"], probed["spine"])
    note = f"timings: measured on fledge's engine ({engine_rig.engine_path(rig)}), batch 1"
    text, data, preds = _ranked(args, profile, timings, shapes, None, (note,))
    data["ar_measured_tok_s"] = ar["tok_s"]
    if args.validate:
        picks = parse_shapes(args.shapes) if args.shapes else validation_shapes(preds)
        data["validation"] = validate(rig, prompts, [predict(profile, timings, s) for s in picks], args.max_new_tokens,
                                      ar["tok_s"])
        text += "\n" + validation_table(data["validation"])
    return text, data, preds


def _time_left(args, ar_ms: float, n_prompts: int, n_topks: int, draft_tokens: int) -> str:
    """What comes next and how long, in one line, before minutes without a result: the tokens
    measured_tune's runs decode (each run also decodes 8 to warm up), at plain decoding's pace."""
    per_run = n_prompts * args.max_new_tokens + 8
    tokens = 2 * n_topks * (min(n_prompts, 2) * draft_tokens + 8) + (0 if args.profile_json else per_run)
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
