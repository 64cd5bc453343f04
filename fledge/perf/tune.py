"""`fledge tune`: predict speculative-decoding tok/s before deploying, and pick the flags.

The cost model, per verify round of one request at a given batch size:

    tok/s = E[accept length] / (num_steps * t_draft(topk) + t_verify(num_draft_tokens) + overhead)

against plain decoding at 1 / t_ar. Accept length is SGLang's (fledge.perf.acceptance models it), so
speculation pays iff E[accept length] > t_iter / t_ar — the break-even accept length this module
reports. Where only an accept length is known (`--accept-length`, measured at `--accept-shape`),
the profile is fledge.perf.acceptance's sibling prior fitted to it.

Timings (fledge.perf.hwmodel.Timings) come from the user (`tune what-if`), from the serving
model fitted on published measurements or the roofline calibrated on a live server (`tune model`,
fledge.perf.tune_inputs), or from fledge's engine (`tune engine`, fledge.perf.tune_engine). A
shape "pays" only if its predicted gain exceeds `--margin` (default 5%): below that the difference
is inside what the timings and the model can resolve, and the verdict is to serve without
speculation.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from fledge.core.errors import FledgeError
from fledge.core.files import atomic_write_json
from fledge.core.report import save_figure, subplots
from fledge.core.shape import Shape, max_nodes
from fledge.perf import hwmodel, modelspec, servemodel
from fledge.perf.acceptance import (
    Prediction,
    Profile,
    expected_accept_length,
    profile_from_args,
)
from fledge.perf.calibrate import load_profile
from fledge.perf.hwmodel import Timings
from fledge.perf.serving import parse_levels
from fledge.perf.tune_inputs import cpu_defaults, machine, served_timings


def parse_ms_table(text: str, arg: str) -> dict[int, float]:
    """"1:11.6,8:30" → {1: 11.6, 8: 30.0}; a bare "1.5" means the same time for every key."""
    try:
        if ":" not in text:
            return {1: float(text)}
        return {int(k): float(v) for k, v in (item.split(":") for item in text.split(",") if item.strip())}
    except ValueError:
        raise FledgeError(f"{arg} {text!r}: expected N:MS pairs like '1:11.6,8:30'") from None


# --------------------------------------------------------------------------- predictions
def predict(profile: Profile, timings: Timings, shape: Shape, spread: tuple[float, float] | None = None) -> Prediction:
    """`spread`: log(measured / predicted) quantiles of the timings' source (None: exact timings)."""
    L = expected_accept_length(profile, shape)
    t = timings.round_ms(shape)
    ms = timings.spec_ms(L, t)
    sp = timings.plain_ms / ms
    lo, hi = (sp * math.exp(spread[0]), sp * math.exp(spread[1])) if spread else (None, None)
    return Prediction(shape, L, t, 1e3 / ms, sp, t / timings.ar_ms, lo, hi)


def grid(max_depth: int = 8, topks=(1, 2, 4, 8), draft_tokens=(4, 8, 16, 32, 64)) -> list[Shape]:
    """Chains of 1..max_depth, and trees of every (steps, topk > 1, draft tokens) that fits."""
    return [Shape(s, 1, s + 1) for s in range(1, max_depth + 1)] + [
        Shape(s, k, n) for s in range(2, max_depth + 1) for k in topks for n in draft_tokens
        if k > 1 and s + 1 < n <= max_nodes(s, k)]


def rank_all(profile: Profile, timings: Timings, shapes: list[Shape], spread=None) -> list[Prediction]:
    """Predictions for every shape the profile can speak for, best tok/s first. Trees need
    rank > 0 probabilities: a chain-only profile is evaluated on chains only."""
    usable = [s for s in shapes if s.topk == 1 or profile.width > 1]
    return sorted((predict(profile, timings, s, spread) for s in usable), key=lambda p: -p.tok_s)


def sweep(profile: Profile, timings_at, shapes: list[Shape], levels, margin: float, spread=None) -> list[dict]:
    """Best shape and speed-up at each concurrency; `timings_at(c)` gives the Timings of batch c."""
    rows = []
    for c in levels:
        t = timings_at(c)
        best = rank_all(profile, t, shapes, spread)[0]
        rows.append({"concurrency": c, "ar_tok_s_per_request": 1e3 / t.ar_ms, "ar_tok_s_total": c * 1e3 / t.ar_ms,
                     "best": asdict(best.shape), "label": best.shape.label, "speedup": best.speedup,
                     "low": best.low, "high": best.high, "call": best.call(margin), "pays": best.call(margin) == "pays"})
    return rows


def stops_paying(rows: list[dict]) -> int | None:
    """The first concurrency at which speculation no longer surely pays (None: it pays at every level shown)."""
    return next((r["concurrency"] for r in rows if not r["pays"]), None)


def surely_loses(rows: list[dict]) -> int | None:
    """The first concurrency at which even the top of the range loses (None: no level shown)."""
    return next((r["concurrency"] for r in rows if r["call"] == "loses"), None)


# --------------------------------------------------------------------------- verdict and report
@dataclass
class Verdict:
    pays: bool
    line: str
    change: str  # what would make the reference shape pay (or keep paying), one line


def verdict(preds: list[Prediction], timings: Timings, margin: float, ref: Prediction | None = None) -> Verdict:
    """One line: speculate with the best shape only if it (its whole range, where it has one)
    beats plain decoding by more than `margin`; "too close to call" where its range holds both;
    and for `ref` (default the best shape) the verify time or the accept length at which it
    would clear that bar."""
    best, ar_tok_s, need = preds[0], 1e3 / timings.plain_ms, 1 + margin
    gain = 100 * (best.speedup - 1)
    rng = f" (range {best.low:.2f}-{best.high:.2f}x)" if best.low is not None else ""
    call = best.call(margin)
    if call == "pays":
        line = (f"VERDICT: speculate with {best.shape.label}: {best.tok_s:.1f} tok/s per request against "
                f"{ar_tok_s:.1f} without ({gain:+.1f}%{rng})")
    elif call == "too close to call" and best.low is not None:
        line = (f"VERDICT: too close to call — the best, {best.shape.label}, predicts {best.speedup:.2f}x{rng}: measure "
                f"it (`fledge tune calibrate` on your plain server, then `fledge bench --url`); plain decoding "
                f"{ar_tok_s:.1f} tok/s per request")
    else:
        why = ("every shape loses" + (f", the best {best.shape.label} {best.speedup:.2f}x{rng}" if rng else "")
               if best.speedup <= 1 else
               f"the best gain, {gain:+.1f}% ({best.shape.label}), is inside the {100 * margin:.0f}% margin")
        line = f"VERDICT: serve without speculation — {why}; plain decoding {ar_tok_s:.1f} tok/s per request"
    ref = ref or best
    s = ref.shape
    rest = (s.num_steps + timings.extra_drafts) * timings.draft(s.topk) + timings.overhead_ms + (
        timings.tree_ms if s.topk > 1 else 0.0)
    round_ms_per_token = timings.plain_ms / need - timings.per_token_ms  # what beats plain by `margin`
    verify_max = ref.accept_length * round_ms_per_token - rest
    accept_min = ref.iter_ms / round_ms_per_token if round_ms_per_token > 0 else float("inf")
    v = (f"verify <= {verify_max:.2f} ms (predicted {timings.verify(s.num_draft_tokens):.2f})" if verify_max > 0 else
         f"no verify time is enough (drafting and the rest of a round take {rest:.2f} ms)")
    a = (f"accept length >= {accept_min:.2f} (now {ref.accept_length:.2f})"
         + (f", more than {s.label} can accept ({s.path_len})" if accept_min > s.path_len else ""))
    return Verdict(call == "pays", line, f"{s.label} beats plain decoding by {100 * margin:.0f}% at: {v}, or {a}")


def report(preds: list[Prediction], timings: Timings, drafter: str, margin: float = 0.05, ref: Prediction | None = None,
           notes: tuple[str, ...] = (), conc: list[dict] | None = None, engine: str = "sglang") -> tuple[str, dict]:
    """One screen: where the figures come from, the table, the verdict (for `engine`: vLLM serves
    chains only, so its verdict reads the chains), flags only if it pays, the break-even accept
    length, what would have to change; and the same as a JSON-able dict."""
    ar = 1e3 / timings.plain_ms  # the verdict's baseline: with --output-len, prefill shared over the answer
    prefill = timings.prefill_per_token_ms
    mine = [p for p in preds if p.shape.topk == 1] if engine == "vllm" else preds
    best = (mine or preds)[0]
    ranged = best.low is not None
    v = verdict(mine or preds, timings, margin, ref)
    lines = [*notes, f"plain decoding: {ar:.1f} tok/s per request ({timings.ar_ms:.2f} ms a step"
             + (f" + {prefill:.2f} ms of prefill a token" if prefill else "")
             + (f" + {timings.token_host_ms:.2f} ms of host work a token" if timings.token_host_ms else "")
             + f", batch {timings.batch}); "
             "accept length = SGLang's (accepted + bonus per verify step)",
             f"{'steps':>5} {'topk':>4} {'tokens':>6} {'accept':>7} {'iter ms':>8} {'tok/s':>8} {'speedup':>8} "
             f"{'break-even':>10}" + (f" {'range':>11}" if ranged else "")]
    for p in preds[:12]:
        s = p.shape
        lines.append(f"{s.num_steps:>5} {s.topk:>4} {s.num_draft_tokens:>6} {p.accept_length:>7.2f} {p.iter_ms:>8.2f} "
                     f"{p.tok_s:>8.1f} {p.speedup:>7.2f}x {p.break_even:>10.2f}"
                     + (f" {p.low:>5.2f}-{p.high:.2f}x" if ranged else ""))
    lines.append(v.line)
    if v.pays:
        lines += _flags(best, preds, drafter, margin, engine)
    ref = ref or best
    lines.append(f"break-even accept length at {ref.shape.label}: {ref.break_even:.2f} (predicted {ref.accept_length:.2f})"
                 + (f"; at {ref.shape.label}: {ref.call(margin)} ({ref.speedup:.2f}x, range {ref.low:.2f}-{ref.high:.2f}x)"
                    if ranged else ""))
    lines.append(("to keep paying" if ref.speedup > 1 + margin else "to pay") + f": {v.change}")
    call = best.call(margin)
    data = {"ar_tok_s": ar, "timings": asdict(timings), "margin": margin, "engine": engine, "pays": v.pays,
            "verdict": v.line, "verdict_short": {"pays": "WINS", "loses": "LOSES"}.get(call, "TOO CLOSE TO CALL"),
            "call": call, "gain_percent": 100 * (best.speedup - 1), "change": v.change,
            "best": _pred_dict(best, drafter, margin), "reference": _pred_dict(ref, drafter, margin), "notes": list(notes),
            "predictions": [_pred_dict(p, drafter, margin) for p in preds]}
    if conc:
        stop, lost = stops_paying(conc), surely_loses(conc)
        lines.append(f"{'concurrency':>11} {'plain tok/s':>11} {'best shape':>12} {'speedup':>8}"
                     + (f" {'range':>11} {'verdict':>17}" if ranged else ""))
        lines += [f"{r['concurrency']:>11} {r['ar_tok_s_total']:>11.1f} {r['label']:>12} {r['speedup']:>7.2f}x"
                  + (f" {r['low']:>5.2f}-{r['high']:.2f}x {r['call']:>17}" if ranged else "") for r in conc]
        paying = [str(r["concurrency"]) for r in conc if r["pays"]]
        where = ("at every level shown" if not stop else f"it stops paying surely at {stop}" if paying
                 else "it surely pays at no level shown")
        if ranged and stop:
            where += f"; it loses even at the top of its range from {lost}" if lost else "; it never surely loses"
        lines.append("speculation pays at concurrency " + (", ".join(paying) or "none") + "; " + where)
        data.update(concurrency=conc, stops_paying_at=stop, surely_loses_at=lost)
    return "\n".join(line for line in lines if line), data


def _flags(best: Prediction, preds: list[Prediction], drafter: str, margin: float, engine: str) -> list[str]:
    """The launch flags, the engine the user runs first."""
    chains = [p for p in preds if p.shape.topk == 1]
    if engine == "vllm":
        out = [f"  vLLM:   {best.shape.vllm_flags(drafter)}"]
        if preds[0].shape.topk > 1 and preds[0].speedup > best.speedup:
            out.append(f"  (SGLang could serve the tree {preds[0].shape.label} at {preds[0].speedup:.2f}x: "
                       f"{preds[0].shape.sglang_flags()})")
        return out
    out = [f"  SGLang: {best.shape.sglang_flags()}"]
    vllm = best.shape.vllm_flags(drafter)
    if vllm:
        out.append(f"  vLLM:   {vllm}")
    elif chains and chains[0].call(margin) == "pays":
        out.append(f"  vLLM:   drafts chains only; its best chain {chains[0].shape.label} ({chains[0].speedup:.2f}x): "
                   + chains[0].shape.vllm_flags(drafter))
    else:
        out.append("  vLLM:   drafts chains only, and no chain surely pays: serve it without speculation")
    return out


def _pred_dict(p: Prediction, drafter: str, margin: float = 0.05) -> dict:
    return {**asdict(p.shape), "accept_length": p.accept_length, "iter_ms": p.iter_ms, "tok_s": p.tok_s,
            "speedup": p.speedup, "low": p.low, "high": p.high, "call": p.call(margin),
            "break_even_accept_length": p.break_even, "sglang": p.shape.sglang_flags(), "vllm": p.shape.vllm_flags(drafter)}


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


# --------------------------------------------------------------------------- modes
def finish(args, result) -> int:
    text, data, preds = result
    print(text)
    if args.json:
        atomic_write_json(args.json, data)
    if args.png:
        plot(preds, data["ar_tok_s"], args.png, data.get("validation"), data.get("concurrency"))
    return 0


def check_args(args) -> None:
    if args.max_depth < 1 or args.max_depth > 16:
        raise FledgeError(f"--max-depth {args.max_depth}: draft steps from 1 to 16")
    if not 0 <= args.margin < 1:
        raise FledgeError(f"--margin {args.margin}: a fraction in [0, 1), e.g. 0.05")


def ranked(args, profile: Profile, timings: Timings, shapes, ref_shape: Shape | None, notes, conc=None, spread=None,
            engine: str = "sglang"):
    preds = rank_all(profile, timings, shapes, spread)
    ref = predict(profile, timings, ref_shape, spread) if ref_shape else None
    text, data = report(preds, timings, args.drafter or "<drafter dir>", args.margin, ref, notes, conc, engine)
    data["profile"] = profile.tables()
    return text, data, preds


def run_what_if(args) -> int:
    """`fledge tune what-if`: your own timings and acceptance."""
    check_args(args)
    notes = ["timings: as given (what-if)"]
    if args.draft_ms is not None:
        draft = parse_ms_table(args.draft_ms, "--draft-ms")
    elif args.model:
        cpu_defaults(args)
        target, drafter = modelspec.load_specs(args.model, args.drafter, args.dtype, args.quant, args.draft_vocab)
        draft = hwmodel.step_times(target, drafter, machine(args)[0], args.batch, args.context).draft_ms
        notes.append("draft step predicted from the drafter's config (--model/--drafter, --gpu): "
                     + ", ".join(f"topk {k}: {v:.3f} ms" for k, v in draft.items()))
    else:
        raise FledgeError("tune what-if needs --draft-ms (ms per draft step, by topk '1:0.4,4:0.5'), or --model CONFIG "
                          "--gpu NAME to predict it from the drafter's size (one decoder layer and its LM head)")
    timings = Timings(args.ar_ms, parse_ms_table(args.verify_ms, "--verify-ms"), draft, args.overhead_ms, args.batch)
    profile, ref_shape, note = profile_from_args(args)
    return finish(args, ranked(args, profile, timings, grid(args.max_depth), ref_shape, (*notes, note),
                                 engine=args.engine or "sglang"))


def run_model(args) -> int:
    """`fledge tune model`: the serving model fitted on published measurements (each prediction
    with its cross-validated range); with --hardware-profile or a hardware override, the roofline
    as given or calibrated on your server (no range)."""
    check_args(args)
    cpu_defaults(args)
    target, drafter = modelspec.load_specs(args.model, args.drafter, args.dtype, args.quant, args.draft_vocab)
    profile, ref_shape, note = profile_from_args(args)
    # The engine the user serves leads the verdict: named, or the one the calibrated server ran.
    engine = (args.engine or (load_profile(args.hardware_profile, "--hardware-profile")["engine"] if args.hardware_profile
                              else None) or "sglang")
    overrides = {"hbm_gbs": args.hbm_gbs, "latency_us": args.allreduce_us, "bus_gbs": args.allreduce_gbs,
                 "host_ms": args.host_ms, "bw_efficiency": args.bw_efficiency, "flops_efficiency": args.flops_efficiency,
                 "tflops": {k: args.tflops for k in ("bf16", "fp16", "fp8", "fp32")} if args.tflops else None}
    # The published measurements are of GPU servers: a CPU server gets the roofline (calibrate it).
    if args.hardware_profile or any(v is not None for v in overrides.values()) or args.gpu in (None, "cpu"):
        hw, label = machine(args, args.hardware_profile, overrides)
        spread = None

        def timings_at(batch: int) -> Timings:
            return hwmodel.step_times(target, drafter, hw, batch, args.context, args.output_len or 0)
        how = f"roofline on {label} (as given or calibrated: no cross-validated range; on a CPU, run `tune calibrate`)"
    else:
        fit = servemodel.fitted(engine)
        spread = fit.spread
        timings_at = served_timings(target, drafter, args, fit)
        tp = args.tp or 1
        how = (f"serving model for {engine} on {tp} x {args.gpu}" + (f" over {args.interconnect or 'nvlink'}" if tp > 1
                                                                      else "") + f" ({fit.note})")
    timings = timings_at(args.batch)
    shapes = grid(args.max_depth)  # with vLLM, trees stay in the table for comparison; the verdict reads chains
    moe = f", MoE {target.active}/{target.experts} experts" if target.experts else ""
    src = (f"{how}: {args.model} ({target.layers} layers{moe}, {target.quant} weights), batch {args.batch}, context "
           f"{args.context}, CUDA graphs {'off' if args.no_cuda_graphs else 'on'}"
           + (f"; whole requests: a {args.context}-token prompt's prefill ({timings.prefill_ms:.1f} ms, the batch waits) "
              f"and {args.output_len} new tokens" if args.output_len else "; decode rounds only"))
    chains = [s for s in shapes if s.topk == 1] if engine == "vllm" else shapes
    conc = sweep(profile, timings_at, chains, parse_levels(args.concurrency, "--concurrency"), args.margin, spread)
    text, data, preds = ranked(args, profile, timings, shapes, ref_shape, (src, note), conc, spread, engine)
    if spread is not None:  # where the roofline puts the time (the table's device, unfitted)
        hw = hwmodel.hardware(args.gpu, args.tp or 1, args.interconnect or "nvlink", cuda_graphs=not args.no_cuda_graphs)
        data.update(constants=fit.constants, range_coverage=servemodel.COVERAGE, range_log=list(spread))
    data.update(hardware=asdict(hw), breakdown=hwmodel.breakdown(target, drafter, hw, args.batch, args.context))
    return finish(args, (text, data, preds))
