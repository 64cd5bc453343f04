"""`fledge tune calibrate`: measure the user's own plain server, predict the speculating one.

For each server (`--url`, repeatable: the plain one, and any that speculates) and each
concurrency level, fledge's server bench (fledge.perf.serving.run_level) measures the decode time per
token of each request (the inter-token latency); a speculating vLLM's Prometheus counters, read
before and after the level, give the drafts, the draft tokens per draft (k, a chain) and the
tokens accepted at each position.

From the plain server alone it predicts a chain of k draft tokens at batch B:

    round(k, B) = plain step at concurrency (k + 1) x B      (the verify)
                  + k draft forwards at batch B               (vLLM: K - 1 draft steps and the pass
                  + the round's extra host time                over the accepted tokens that drafts the first)
    tok/s per request = accept length / round

The assumption: a verify of n tokens for each of B sequences costs about one plain step of
n x B sequences — the same rows through the same weights. It breaks where the two differ:
attention (a plain step of n x B sequences reads n x B KV caches, the verify B of them, so the
assumption over-prices the verify at long contexts), chunked prefill (a plain step at high
concurrency also carries other requests' prefill chunks), and beyond the highest level measured
(extended along the last segment). The draft forwards and the round's host time come from the
roofline (fledge.perf.hwmodel) whose constants are fitted to the same plain points, by bounded
least squares (every constant kept in a physical range; a constant pinned at a bound is said,
with the points the fit cannot explain). Acceptance is the drafter's, not the server's timing:
`--accept-json` (`fledge bench --probe`, a vLLM log), `--accept-length`, or the counters of a
speculating server measured here.

The profile written (`--out`) holds the points, the fitted constants as hardware overrides
(`fledge tune model --hardware-profile`), the predictions, and the measured chain acceptance as
`ranks` (`--accept-json`). `--merge PROFILE` adds an earlier profile's points (servers that take
minutes to start can be measured one at a time).

Assumptions: the server runs one model replica on the GPUs named (`--gpu`, `--tp`); the levels are
steady (every request generates `--max-new-tokens`, ignore_eos); a level's accept length is the
server's over that level alone (counter deltas), which holds while nothing else uses the server.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import urllib.parse
import urllib.request
from dataclasses import asdict
from pathlib import Path

from fledge.core.catalog import BUILTINS
from fledge.core.errors import FledgeError
from fledge.core.files import atomic_write_json
from fledge.core.openai_client import Client, api_url, metrics_url
from fledge.core.shape import Shape
from fledge.perf import hwmodel, modelspec
from fledge.perf.acceptance import chain_profile
from fledge.perf.serving import PROMPTS, ServerBench, parse_levels, run_level

_SAMPLE = re.compile(r"^(vllm:spec_decode_num_(?:drafts|draft_tokens|accepted_tokens|accepted_tokens_per_pos)_total)"
                     r"(\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.MULTILINE)


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


def served_model(url: str, timeout: float = 30.0) -> tuple[str, str | None]:
    """The first model a server lists: its id and, where the server says (vLLM's `root`), the
    path it was loaded from."""
    where = api_url(url, "models")
    try:
        with urllib.request.urlopen(where, timeout=timeout) as r:
            first = json.loads(r.read())["data"][0]
        return str(first["id"]), first.get("root")
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise FledgeError(f"{where}: no model list ({e}); pass --url of an OpenAI-compatible server "
                          "(e.g. http://127.0.0.1:8000/v1)") from None


def measure(url: str, metrics: str, levels, requests: int, max_tokens: int, timeout: float) -> list[dict]:
    """One point per concurrency level: decode ms per token per request, and the level's
    speculation (k, accept length, accepted at each position) from the counter deltas."""
    client = Client(url, timeout)
    model = served_model(url, timeout)[0]
    points = []
    for c in levels:
        # At least one request per worker, or the level never reaches its concurrency.
        cfg = ServerBench(url, PROMPTS, model, max_tokens, (c,), max(requests, c), 600.0, timeout, ignore_eos=True)
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


def hardware(base: str, tp: int, link: str, graphs: bool, x: dict) -> hwmodel.Hardware:
    return hwmodel.hardware(base, tp, link, cuda_graphs=graphs, **_overrides(x))


def predict_point(p: dict, target, drafter, hw: hwmodel.Hardware, context: int) -> float:
    """Predicted decode ms per token per request at the point's concurrency and speculation."""
    k = p["k"]
    t = hwmodel.step_times(target, drafter, hw, p["concurrency"], context, verify_sizes=(k + 1,), topks=(1,))
    return t.round_ms(Shape(k, 1, k + 1)) / p["accept_length"] if k else t.ar_ms


# Physical ranges of the fitted constants: effective bandwidth and FLOP/s at most the device's
# peak (and not below a small fraction of it), host and per-forward times below 30 ms, launches
# between 0.1 and 200 us.
def bounds(gpu: hwmodel.Gpu, dtype: str) -> dict:
    return {"hbm_gbs": (0.02 * gpu.hbm_gbs, gpu.hbm_gbs), "tflops": (1e-3 * gpu.tflops[dtype], gpu.tflops[dtype]),
            "host_ms": (1e-3, 30.0), "forward_ms": (1e-3, 30.0), "launch_us": (0.1, 200.0), "round_host_ms": (1e-3, 30.0)}


def fit(points: list[dict], target, drafter, base: str, tp: int, link: str, graphs: bool, context: int) -> dict:
    """Bounded least squares on log(predicted / measured) over the free constants, in log space.
    The roofline's max has no gradient on its losing side, so the fit starts from several
    bandwidth / FLOP/s pairs inside the ranges and keeps the best."""
    from scipy.optimize import least_squares

    gpu = hwmodel.GPUS[base]
    box = bounds(gpu, target.dtype)
    start = {"hbm_gbs": gpu.hbm_gbs * 0.8, "tflops": gpu.tflops[target.dtype] * 0.6, "host_ms": 0.3, "forward_ms": 0.05,
             "launch_us": gpu.graph_launch_us if graphs else gpu.launch_us, "round_host_ms": 0.6}
    free = [k for k in FREE if k != "round_host_ms" or any(p["k"] for p in points)]
    lo, hi = [math.log(box[k][0]) for k in free], [math.log(box[k][1]) for k in free]

    def unpack(z):
        return {**start, **{k: math.exp(v) for k, v in zip(free, z)}}

    def residuals(z):
        hw = hardware(base, tp, link, graphs, unpack(z))
        return [math.log(predict_point(p, target, drafter, hw, context) / p["ms_per_token"]) for p in points]

    best = None
    for bw_scale in (0.1, 0.4, 1.0):
        for flops_scale in (0.01, 0.1, 1.0):
            x0 = {**start, "hbm_gbs": gpu.hbm_gbs * bw_scale * 0.99, "tflops": gpu.tflops[target.dtype] * flops_scale * 0.99}
            z0 = [min(max(math.log(x0[k]), a + 1e-9), b - 1e-9) for k, a, b in zip(free, lo, hi)]
            res = least_squares(residuals, z0, bounds=(lo, hi), method="trf")
            if best is None or res.cost < best.cost:
                best = res
    return unpack(best.x)


def pinned(x: dict, gpu: hwmodel.Gpu, dtype: str) -> list[str]:
    """The constants the fit left at a bound of their range: the points asked for more."""
    return [f"{k} at its {'lower' if x[k] <= lo * 1.001 else 'upper'} bound {x[k]:.4g}"
            for k, (lo, hi) in bounds(gpu, dtype).items() if k in x and (x[k] <= lo * 1.001 or x[k] >= hi * 0.999)]


def plain_table(points: list[dict]) -> dict[int, float]:
    """ms per step (= per token of a request) of the plain server by concurrency."""
    plain = [p for p in points if not p["k"]]
    return {c: sum(p["ms_per_token"] for p in plain if p["concurrency"] == c) /
            sum(1 for p in plain if p["concurrency"] == c) for c in sorted({p["concurrency"] for p in plain})}


def predict_chains(table: dict[int, float], target, drafter, hw: hwmodel.Hardware, context: int, ks, accept,
                   batch: int = 1) -> list[dict]:
    """Each chain of k at `batch` from the plain server's steps (module doc): the verify is the
    plain step at (k + 1) x batch, the drafts and the round's host time the fitted roofline's.
    `accept(k)` is the accept length of a chain of k."""
    t = hwmodel.step_times(target, drafter, hw, batch, context, verify_sizes=(1,), topks=(1,))
    draft_ms, extra_ms = t.draft(1), hw.round_host_ms
    plain = hwmodel.Timings(table[min(table)], table, {1: 1.0}).verify(batch)
    rows = []
    for k in ks:
        verify = hwmodel.Timings(table[min(table)], table, {1: 1.0}).verify((k + 1) * batch)
        round_ms = verify + k * draft_ms + extra_ms
        L = accept(k)
        rows.append({"k": k, "batch": batch, "accept_length": L, "verify_ms": verify, "draft_ms": draft_ms,
                     "round_ms": round_ms, "tok_s_predicted": 1e3 * L / round_ms,
                     "plain_tok_s": 1e3 / plain, "speedup_predicted": L * plain / round_ms,
                     "beyond_measured": (k + 1) * batch > max(table)})
    return rows


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
        return {"hardware": profile["hardware"], "points": profile["points"], "engine": profile.get("engine")}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FledgeError(f"{flag} {path}: not a `fledge tune calibrate` profile ({e})") from None


def resolve_inputs(args) -> list[str]:
    """Fill --model from the server (vLLM names the directory it loaded as `root`), --gpu from
    the machine (a server on this host without an NVIDIA driver is a CPU server), and a CPU
    server's defaults (short contexts, fp32, eager, a few low levels); the lines saying so."""
    notes = []
    if not args.model:
        name, root = served_model(args.url[0])
        if root and (Path(root) / "config.json").is_file():
            args.model = root
        elif name in BUILTINS:
            args.model = name
        else:
            raise FledgeError(f"--model: the server serves {name!r}" + (f" from {root}" if root else "")
                              + ", which is not a local model directory here; pass --model CONFIG (its config.json)")
        notes.append(f"model: {args.model}, as the server names it")
    if not args.gpu:
        host = urllib.parse.urlsplit(args.url[0]).hostname or ""
        if host in ("127.0.0.1", "localhost", "::1") and shutil.which("nvidia-smi") is None:
            args.gpu = "cpu"
            notes.append("gpu: cpu (a server on this host, and no NVIDIA driver here)")
        else:
            raise FledgeError(f"--gpu: pass the closest table entry to the server's GPUs ({', '.join(hwmodel.GPUS)})")
    if args.gpu not in hwmodel.GPUS:
        raise FledgeError(f"--gpu {args.gpu!r}: unknown; pass one of {', '.join(hwmodel.GPUS)}")
    on_cpu = args.gpu == "cpu"
    args.context = args.context if args.context is not None else 128 if on_cpu else 2048
    args.no_cuda_graphs = args.no_cuda_graphs or on_cpu
    args.dtype = args.dtype or ("fp32" if on_cpu else None)
    args.levels = args.levels or ("1,2,4" if on_cpu else "1,2,4,8,16,32,64,128,256")
    return notes


def _accept(args, points):
    """accept(k) for a chain of k, and a line saying where it comes from (None: no acceptance)."""
    from fledge.perf.acceptance import Profile, chain_accept_length, profile_from_args

    if args.accept_json or args.accept_length or args.accept_profile:
        prof, _, note = profile_from_args(args)
    elif chain_ranks(points):
        prof, note = Profile(chain_ranks(points)), "acceptance: the speculating server's counters measured here"
    else:
        return None, "no acceptance given: pass --accept-json (`fledge bench --probe`, a vLLM log) or --accept-length"
    return (lambda k: chain_accept_length([prof.at(d, 0, True) for d in range(1, k + 1)])), note


def cmd_calibrate(args) -> int:
    notes = resolve_inputs(args)
    metrics = args.metrics_url or [metrics_url(u) for u in args.url]
    if len(metrics) != len(args.url):
        raise FledgeError("--metrics-url: give one per --url, in the same order (or none)")
    target, drafter = modelspec.load_specs(args.model, args.drafter, args.dtype, args.quant, args.draft_vocab)
    levels = parse_levels(args.levels, "--levels")
    ks = parse_levels(args.predict_ks, "--predict-ks")
    points = load_profile(args.merge, "--merge")["points"] if args.merge else []  # servers measured one at a time
    for url, metrics_at in zip(args.url, metrics):
        points += measure(url, metrics_at, levels, args.requests, args.max_new_tokens, 120.0)
    tp, link, graphs = args.tp or 1, args.interconnect or "nvlink", not args.no_cuda_graphs
    x = fit(points, target, drafter, args.gpu, tp, link, graphs, args.context)
    hw = hardware(args.gpu, tp, link, graphs, x)
    for p in points:
        p["predicted_ms_per_token"] = predict_point(p, target, drafter, hw, args.context)
        p["error_percent"] = 100 * (p["predicted_ms_per_token"] / p["ms_per_token"] - 1)
    errs = [abs(p["error_percent"]) for p in points]
    stuck = pinned(x, hwmodel.GPUS[args.gpu], target.dtype)
    worst = sorted(points, key=lambda p: -abs(p["error_percent"]))[:3]
    # Only vLLM lists the directory it loaded (`root`) and exports spec-decode counters under `vllm:`.
    engine = args.engine or ("vllm" if served_model(args.url[0])[1] or any(p["k"] for p in points) else None)
    profile = {"kind": "fledge tune calibrate profile", "model": args.model, "context": args.context, "points": points,
               "engine": engine,
               "hardware": {"gpu": args.gpu, "tp": tp, "interconnect": link, "cuda_graphs": graphs,
                            "overrides": _overrides(x)},
               "fit": {"mean_abs_error_percent": sum(errs) / len(errs), "max_abs_error_percent": max(errs),
                       "constants": x, "pinned": stuck, "hardware": asdict(hw)}}
    accept, accept_note = _accept(args, points)
    table = plain_table(points)
    if accept and table:
        profile["predictions"] = predict_chains(table, target, drafter, hw, args.context, ks, accept)
    ranks = chain_ranks(points)
    if ranks:
        profile["ranks"] = ranks
    out = args.out or "fledge-profile.json"
    atomic_write_json(out, profile)
    for line in notes:
        print(line)
    print(f"{'server':<32}{'conc':>5}{'k':>3}{'accept':>8}{'ms/token':>10}{'fit':>9}{'error':>8}")
    for p in points:
        print(f"{p['url'][:31]:<32}{p['concurrency']:>5}{p['k']:>3}{p['accept_length']:>8.2f}{p['ms_per_token']:>10.2f}"
              f"{p['predicted_ms_per_token']:>9.2f}{p['error_percent']:>+7.1f}%")
    print(f"fitted: {x['hbm_gbs']:.1f} GB/s, {x['tflops']:.3f} TFLOP/s, host {x['host_ms']:.2f} ms a step, "
          f"{x['forward_ms']:.2f} ms a forward, {x['launch_us']:.1f} us a kernel, round extra {x['round_host_ms']:.2f} ms; "
          f"mean |error| {profile['fit']['mean_abs_error_percent']:.1f}%, max {profile['fit']['max_abs_error_percent']:.1f}%")
    if stuck:
        print("the fit pins " + "; ".join(stuck) + ": the points it explains least are "
              + ", ".join(f"concurrency {p['concurrency']} k {p['k']} ({p['error_percent']:+.0f}%)" for p in worst))
    print(accept_note)
    for r in profile.get("predictions", []):
        print(f"  vLLM chain k={r['k']} at batch {r['batch']}: accept {r['accept_length']:.2f}, round {r['round_ms']:.1f} ms "
              f"(verify = plain step at concurrency {(r['k'] + 1) * r['batch']}{', extrapolated' if r['beyond_measured'] else ''}"
              f"), {r['tok_s_predicted']:.1f} tok/s per request, {r['speedup_predicted']:.2f}x plain")
    print(f"wrote {out}: `fledge tune model --model {args.model} --hardware-profile {out} ...` reads it"
          + (f" (engine {engine}: its verdict reads {'chains' if engine == 'vllm' else 'every shape'})" if engine else "")
          + (f"; `--accept-json {out}` its measured acceptance" if ranks else ""))
    return 0
