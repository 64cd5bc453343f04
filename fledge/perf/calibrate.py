"""`fledge tune calibrate`: fit the hardware model's free constants to a live server.

For each server (`--url`, repeatable: a plain one, one that speculates, or both) and each
concurrency level, fledge's server bench (fledge.perf.serving.run_level) measures the decode time per
token of each request; a speculating vLLM's Prometheus counters, read before and after the level,
give the drafts, the draft tokens per draft (k, a chain) and the tokens accepted at each
position. A point then predicts, with fledge.perf.hwmodel at batch = concurrency,

    plain:       ms per token = host + forward(target, 1 row)
    speculating: ms per token = (round of a k-chain, as `fledge tune` counts it) / accept length

and scipy's least squares fits, on log time so every point weighs the same, the effective memory
bandwidth, the effective FLOP/s, the host time per step, the fixed time per forward, the time per
kernel launch and, when a server speculates, the extra host time per round. The profile written
(`--out`) holds them as hardware overrides (`fledge tune --profile`), the points with the fit's
error on each, and the measured chain acceptance as `ranks` (`fledge tune --profile-json`).

`--merge PROFILE` adds the points of an earlier profile to the fit: servers that take minutes to
start can be measured one at a time (plain, then a chain of 1, then of 5) into one profile.

Assumptions: the server runs one model replica on the GPUs named (`--gpu`, `--tp`); the levels are
steady (every request generates `--max-new-tokens`, ignore_eos); a level's accept length is the
server's over that level alone (counter deltas), which holds while nothing else uses the server.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict
from pathlib import Path

from fledge.core.errors import FledgeError
from fledge.core.files import atomic_write_json
from fledge.core.openai_client import Client, metrics_url
from fledge.core.shape import Shape
from fledge.perf import hwmodel
from fledge.perf.acceptance import chain_profile
from fledge.perf.serving import PROMPTS, ServerBench, parse_levels, run_level

_SAMPLE = re.compile(r"^(vllm:spec_decode_num_(?:drafts|draft_tokens|accepted_tokens|accepted_tokens_per_pos)_total)"
                     r"(\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)


def scrape(text: str) -> dict:
    """vLLM's speculative-decoding counters in a Prometheus text, summed over engines; zeros
    when it holds none (no speculation yet, or another server)."""
    found = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
    samples = _SAMPLE.findall(text)
    for name, labels, value in samples:
        key = name.removeprefix("vllm:spec_decode_num_").removesuffix("_total")
        if key == "accepted_tokens_per_pos":
            pos = int(re.search(r'position="(\d+)"', labels or "").group(1))
            found["per_pos"][pos] = found["per_pos"].get(pos, 0.0) + float(value)
        else:
            found[{"accepted_tokens": "accepted"}.get(key, key)] += float(value)
    return found


def speculation(before: dict, after: dict) -> dict:
    """k, accept length and accepted tokens by position between two scrapes; {} if nothing
    was drafted in between."""
    drafts = after["drafts"] - before["drafts"]
    if drafts <= 0:
        return {}
    k = round((after["draft_tokens"] - before["draft_tokens"]) / drafts)
    return {"k": k, "accept_length": 1 + (after["accepted"] - before["accepted"]) / drafts, "drafts": drafts,
            "accepted_per_pos": [after["per_pos"].get(i, 0) - before["per_pos"].get(i, 0) for i in range(k)]}


def measure(url: str, metrics: str, levels, requests: int, max_tokens: int, timeout: float) -> list[dict]:
    """One point per concurrency level: decode ms per token per request, and the level's
    speculation (k, accept length, accepted at each position) from the counter deltas."""
    client = Client(url, timeout)
    try:
        model = client.models()[0]
    except FledgeError as e:
        raise FledgeError(f"{e}; pass --url of an OpenAI-compatible server (e.g. http://127.0.0.1:8000/v1)") from None
    cfg = ServerBench(url, PROMPTS, model, max_tokens, tuple(levels), requests, 600.0, timeout, ignore_eos=True)
    points = []
    for c in levels:
        before = scrape(client.metrics(metrics))
        row = run_level(cfg, model, c)
        after = scrape(client.metrics(metrics))
        point = {"url": url, "concurrency": c, "ms_per_token": 1e3 / row["per_request_tok_s"], "k": 0,
                 "accept_length": 1.0, "requests": row["requests"], "total_tok_s": row["total_tok_s"],
                 "per_request_tok_s": row["per_request_tok_s"]}
        points.append({**point, **speculation(before, after)})
    return points


FREE = ("hbm_gbs", "tflops", "host_ms", "forward_ms", "launch_us", "round_host_ms")


def _overrides(x: dict) -> dict:
    """The fitted constants as `hwmodel.hardware` overrides: effective figures, efficiencies 1."""
    tf = x["tflops"]
    return {"hbm_gbs": x["hbm_gbs"], "tflops": {"bf16": tf, "fp16": tf, "fp8": tf, "fp32": tf},
            "host_ms": x["host_ms"], "forward_ms": x["forward_ms"], "launch_us": x["launch_us"],
            "graph_launch_us": x["launch_us"], "round_host_ms": x["round_host_ms"],
            "bw_efficiency": 1.0, "flops_efficiency": 1.0}


def _hardware(base: str, tp: int, link: str, graphs: bool, x: dict) -> hwmodel.Hardware:
    return hwmodel.hardware(base, tp, link, cuda_graphs=graphs, **_overrides(x))


def predict_point(p: dict, target, drafter, hw: hwmodel.Hardware, context: int) -> float:
    """Predicted decode ms per token per request at the point's concurrency and speculation."""
    k = p["k"]
    t = hwmodel.step_times(target, drafter, hw, p["concurrency"], context, verify_sizes=(k + 1,), topks=(1,))
    return t.round_ms(Shape(k, 1, k + 1)) / p["accept_length"] if k else t.ar_ms


def fit(points: list[dict], target, drafter, base: str, tp: int, link: str, graphs: bool, context: int) -> dict:
    """Least squares on log(predicted / measured) over the free constants, in log space (all > 0).
    The roofline's max has no gradient on its losing side, so the fit starts from several
    bandwidth / FLOP/s pairs around the table's and keeps the best."""
    from scipy.optimize import least_squares

    gpu = hwmodel.GPUS[base]
    start = {"hbm_gbs": gpu.hbm_gbs * 0.8, "tflops": gpu.tflops[target.dtype] * 0.6, "host_ms": 0.3, "forward_ms": 0.05,
             "launch_us": gpu.graph_launch_us if graphs else gpu.launch_us, "round_host_ms": 0.6}
    free = [k for k in FREE if k != "round_host_ms" or any(p["k"] for p in points)]

    def unpack(z):
        return {**start, **{k: math.exp(v) for k, v in zip(free, z)}}

    def residuals(z):
        hw = _hardware(base, tp, link, graphs, unpack(z))
        return [math.log(predict_point(p, target, drafter, hw, context) / p["ms_per_token"]) for p in points]

    best = None
    for bw_scale in (0.3, 1.0, 3.0):
        for flops_scale in (0.03, 0.3, 1.0):
            x0 = {**start, "hbm_gbs": start["hbm_gbs"] * bw_scale, "tflops": start["tflops"] * flops_scale}
            res = least_squares(residuals, [math.log(x0[k]) for k in free], method="trf")
            if best is None or res.cost < best.cost:
                best = res
    return unpack(best.x)


def chain_ranks(points: list[dict]) -> list[list[float]] | None:
    """Conditional acceptance per depth of the longest chain measured, its levels pooled:
    accepted at position i per draft is P(the accepted path reached depth i + 1)."""
    spec = [p for p in points if p["k"]]
    if not spec:
        return None
    k = max(p["k"] for p in spec)
    drafts = sum(p["drafts"] for p in spec if p["k"] == k)
    return chain_profile([sum(p["accepted_per_pos"][i] for p in spec if p["k"] == k) / drafts for i in range(k)])


def load_profile(path: str, flag: str) -> dict:
    """A profile `cmd_calibrate` wrote, with the keys `fledge tune` reads."""
    try:
        profile = json.loads(Path(path).read_text())
        return {"hardware": profile["hardware"], "points": profile["points"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FledgeError(f"{flag} {path}: not a `fledge tune calibrate` profile ({e})") from None


def cmd_calibrate(args) -> int:
    if not args.url:
        raise FledgeError("tune calibrate needs --url URL (an OpenAI-compatible server; repeat for several)")
    if not args.model or not args.gpu:
        raise FledgeError("tune calibrate needs --model CONFIG (the served target) and --gpu NAME (the closest "
                          f"table entry: {', '.join(hwmodel.GPUS)})")
    if args.gpu not in hwmodel.GPUS:
        raise FledgeError(f"--gpu {args.gpu!r}: unknown; pass one of {', '.join(hwmodel.GPUS)}")
    metrics = args.metrics_url or [metrics_url(u) for u in args.url]
    if len(metrics) != len(args.url):
        raise FledgeError("--metrics-url: give one per --url, in the same order (or none)")
    target, drafter = hwmodel.load_specs(args.model, args.drafter, args.dtype, args.quant, args.draft_vocab)
    levels = parse_levels(args.levels, "--levels")
    points = load_profile(args.merge, "--merge")["points"] if args.merge else []  # servers measured one at a time
    for url, metrics_at in zip(args.url, metrics):
        points += measure(url, metrics_at, levels, args.requests, args.max_new_tokens, 120.0)
    tp, link, graphs = args.tp or 1, args.interconnect or "nvlink", not args.no_cuda_graphs
    x = fit(points, target, drafter, args.gpu, tp, link, graphs, args.context)
    hw = _hardware(args.gpu, tp, link, graphs, x)
    for p in points:
        p["predicted_ms_per_token"] = predict_point(p, target, drafter, hw, args.context)
        p["error_percent"] = 100 * (p["predicted_ms_per_token"] / p["ms_per_token"] - 1)
    errs = [abs(p["error_percent"]) for p in points]
    profile = {"kind": "fledge tune calibrate profile", "model": args.model, "context": args.context, "points": points,
               "hardware": {"gpu": args.gpu, "tp": tp, "interconnect": link, "cuda_graphs": graphs,
                            "overrides": _overrides(x)},
               "fit": {"mean_abs_error_percent": sum(errs) / len(errs), "max_abs_error_percent": max(errs),
                       "constants": x, "hardware": asdict(hw)}}
    ranks = chain_ranks(points)
    if ranks:
        profile["ranks"] = ranks
    out = args.out or "fledge-profile.json"
    atomic_write_json(out, profile)
    print(f"{'server':<32}{'conc':>5}{'k':>3}{'accept':>8}{'ms/token':>10}{'fit':>9}{'error':>8}")
    for p in points:
        print(f"{p['url'][:31]:<32}{p['concurrency']:>5}{p['k']:>3}{p['accept_length']:>8.2f}{p['ms_per_token']:>10.2f}"
              f"{p['predicted_ms_per_token']:>9.2f}{p['error_percent']:>+7.1f}%")
    print(f"fitted: {x['hbm_gbs']:.1f} GB/s, {x['tflops']:.3f} TFLOP/s, host {x['host_ms']:.2f} ms a step, "
          f"{x['forward_ms']:.2f} ms a forward, {x['launch_us']:.1f} us a kernel, round extra {x['round_host_ms']:.2f} ms; "
          f"mean |error| {profile['fit']['mean_abs_error_percent']:.1f}%, max {profile['fit']['max_abs_error_percent']:.1f}%")
    print(f"wrote {out}: `fledge tune --model {args.model} --profile {out} ...` reads it"
          + (f"; `--profile-json {out}` its measured acceptance" if ranks else ""))
    return 0
