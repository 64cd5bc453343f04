"""`fledge bench`: measure speculative decoding where it runs.

Three sources, one command:
  --url      an OpenAI-compatible server (SGLang, vLLM, ...): tok/s and time to first token per
             concurrency level, the accept length from a speculating vLLM's /metrics counters,
             and with --baseline-url a plain server measured interleaved with it (the ratio);
  --log      a serving log (--baseline-log: a plain server's, for the ratio): fledge.perf.serving
             reads both.
  --target   fledge's engine (with --drafter): plain decoding, then each --shapes shape through
             the engine's speculative decoding, an acceptance profile by depth and sibling rank
             (the input `fledge tune` needs), a table, JSON and PNG plots. A DFlash or
             P-EAGLE drafter runs chains, one drafter forward a round.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from fledge.core.errors import FledgeError
from fledge.core.files import atomic_write_json
from fledge.core.openai_client import Client, ServerError, metrics_url
from fledge.core.report import save_figure, subplots
from fledge.core.shape import Shape, parse_shapes
from fledge.drafter.layout import is_dflash
from fledge.engine.block import BlockDrafter, load_block_rig
from fledge.engine.rig import engine_path, load_rig, probe_profile, run_ar, run_shape
from fledge.perf import serving
from fledge.perf.calibrate import scrape, speculation
from fledge.perf.serving import (
    PROMPTS,
    ServerBench,
    first_user_turns,
    parse_levels,
    run_requests,
    summarize,
)


def load_prompts(source: str | None, n: int, tokenizer) -> list[list[int]]:
    """Token ids of `first_user_turns` in the target's chat template."""
    from fledge.core.target import encode_chat

    return [encode_chat(tokenizer, m) for m in first_user_turns(source, n)]


def plot_engine(results: list[dict], ar_tok_s: float, path) -> None:
    """Two panels: P(reached depth d) per shape, and measured tok/s per shape vs plain decoding."""
    fig, (a, b) = subplots(1, 2, figsize=(11, 4))
    for r in results:
        a.plot(range(1, len(r["depth_acceptance"]) + 1), r["depth_acceptance"], marker="o", label=r["shape"])
    a.set_xlabel("depth")
    a.set_ylabel("P(accepted path reaches depth)")
    a.legend(fontsize=7)
    b.bar(range(len(results)), [r["tok_s"] for r in results], color="#4c78a8")
    b.axhline(ar_tok_s, color="black", linestyle="--", label=f"no speculation {ar_tok_s:.0f}")
    b.set_xticks(range(len(results)), [r["shape"] for r in results], rotation=45, ha="right", fontsize=7)
    b.set_ylabel("decode tok/s (batch 1)")
    b.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


# --------------------------------------------------------------------------- CLI
EAGLE_SHAPES = "3,1,4;7,1,8;5,4,16"
PARALLEL_CHAIN = 7  # a P-EAGLE drafter's longest default chain: its mask slots have no fixed count


def block_shapes(max_steps: int) -> list[Shape]:
    """A block drafter's default chains: the longest its block allows, about three quarters and half of it."""
    return [Shape(k, 1, k + 1) for k in sorted({max_steps, max(1, 3 * max_steps // 4), max(1, max_steps // 2)},
                                                 reverse=True)]


def engine_rows(rig, make_drafter, prompts, shapes, max_new_tokens: int) -> tuple[dict, list[dict]]:
    """Plain decoding, then each shape's drafter (`make_drafter(shape)`) on the same prompts in
    this process: one row per shape with its speed-up over plain decoding and how many outputs
    equal plain decoding's."""
    plain: list[list[int]] = []
    ar = run_ar(rig, prompts, max_new_tokens, plain)
    results = []
    for shape in shapes:
        outs: list[list[int]] = []
        stats, tok_s = run_shape(rig, make_drafter(shape), prompts, max_new_tokens, f"shape {shape.label}", outs)
        s = stats.summary()
        results.append({"shape": shape.label, "tok_s": tok_s, "speedup": tok_s / ar["tok_s"],
                        "equal_to_plain": sum(a == b for a, b in zip(outs, plain)), "prompts": len(prompts),
                        **{k: s[k] for k in (
            "accept_length", "accept_rate", "round_ms_per_step", "depth_acceptance", "histogram", "ended_outside_vocab")}})
    return ar, results


def _load_engine(args):
    """(rig, shapes, make_drafter, method key, method label) for the drafter at --drafter, every
    shape checked against it before anything runs."""
    if not is_dflash(args.drafter):
        rig = load_rig(args.target, args.drafter, args.device, args.dtype, args.chat_template)
        if not rig.draft.cfg.parallel:
            return rig, parse_shapes(args.shapes or EAGLE_SHAPES), rig.drafter, "eagle3", "EAGLE-3"
        if args.probe:
            raise FledgeError(f"--probe: {args.drafter} is a P-EAGLE drafter, which drafts chains only (no ranks to probe)")
        shapes = parse_shapes(args.shapes) if args.shapes else block_shapes(PARALLEL_CHAIN)
        for shape in shapes:
            rig.drafter(shape)
        return rig, shapes, rig.drafter, "peagle", "P-EAGLE (parallel drafting)"
    if args.probe:
        raise FledgeError(f"--probe: {args.drafter} is a DFlash drafter, which drafts chains only (no ranks to probe)")
    rig, draft = load_block_rig(args.target, args.drafter, args.device, args.dtype, args.chat_template)
    shapes = parse_shapes(args.shapes) if args.shapes else block_shapes(draft.cfg.block_size - 1)
    for shape in shapes:
        BlockDrafter(draft, shape, rig.target)

    def make_drafter(shape):
        return BlockDrafter(draft, shape, rig.target, compile=rig.compiled)
    return rig, shapes, make_drafter, "dflash", f"DFlash, block {draft.cfg.block_size}"


def _engine_bench(args) -> dict:
    rig, shapes, make_drafter, kind, method = _load_engine(args)
    prompts = load_prompts(args.prompts, args.num_prompts, rig.tokenizer)
    ar, results = engine_rows(rig, make_drafter, prompts, shapes, args.max_new_tokens)
    print(f"plain decoding {ar['tok_s']:.1f} tok/s ({ar['ar_ms']:.2f} ms/step); {method}; accept length = SGLang's "
          f"(bonus incl.); {engine_path(rig)}")
    print(f"{'shape':<14}{'accept':>7}{'tok/s':>9}{'speedup':>9}{'round ms':>9}{'= plain':>9}"
          f"  rounds ended outside the draft vocab")
    for r in results:
        print(f"{r['shape']:<14}{r['accept_length']:>7.2f}{r['tok_s']:>9.1f}{r['speedup']:>8.2f}x{r['round_ms_per_step']:>9.2f}"
              f"{str(r['equal_to_plain']) + '/' + str(r['prompts']):>9}  {100 * r['ended_outside_vocab']:.1f}%")
    print("= plain: outputs equal to plain decoding's, token for token (greedy; fp32 keeps them equal, bf16 may "
          "differ where two logits tie within rounding)")
    out = {"method": kind, "ar": ar, "results": results}
    if args.probe:
        out["profile"] = probe_profile(rig, prompts, args.probe_steps, args.probe_topk, args.max_new_tokens)
        for name, key in (("on the spine", "spine"), ("off it", "ranks")):
            print(f"acceptance by depth/rank, {name}: " + "  ".join("/".join(f"{x:.2f}" for x in row)
                                                                    for row in out["profile"][key]))
    if args.png:
        plot_engine(results, ar["tok_s"], args.png)
    return out


# --------------------------------------------------------------------------- servers
@dataclass
class Served:
    """One server under test: a label for the table, its API URL, the model name it serves and
    its Prometheus URL (None: not read)."""
    label: str
    url: str
    model: str
    metrics: str | None


def served(label: str, url: str, model: str | None, timeout: float) -> Served:
    """`url`'s server: `model`, else the first it lists; its /metrics if it answers."""
    client = Client(url, timeout)
    model = model or client.models()[0]
    try:
        scrape(client.metrics())
        at = metrics_url(url)
    except ServerError:  # SGLang without --enable-metrics, a proxy: no accept length, the rest stands
        at = None
    return Served(label, url, model, at)


def _counters(s: Served, timeout: float) -> dict | None:
    return scrape(Client(s.url, timeout).metrics(s.metrics)) if s.metrics else None


def _add(total: dict, before: dict, after: dict) -> None:
    for key in ("drafts", "draft_tokens", "accepted"):
        total[key] += after[key] - before[key]
    for pos, v in after["per_pos"].items():
        total["per_pos"][pos] = total["per_pos"].get(pos, 0.0) + v - before["per_pos"].get(pos, 0.0)


def measure_interleaved(servers: list[Served], cfg: ServerBench, conc: int, rounds: int) -> list[dict]:
    """One concurrency level on each server, its requests cut into `rounds` turns that the
    servers take in turn (plain, speculative, plain, ...), so a machine's drift lands on both
    alike; each server gets the same prompts in the same order. A speculating vLLM's row adds
    k and the accept length from its counters over its turns alone (nothing else may use it)."""
    cuts = [round(cfg.requests * i / rounds) for i in range(rounds + 1)]
    samples = {s.label: [] for s in servers}
    totals = {s.label: scrape("") for s in servers}
    for a, b in itertools.pairwise(cuts):
        for s in servers:
            before = _counters(s, cfg.timeout_s)
            samples[s.label].append(run_requests(replace(cfg, url=s.url), s.model, conc, range(a, b)))
            if before is not None:
                _add(totals[s.label], before, _counters(s, cfg.timeout_s))
    rows = []
    for s in servers:
        row = summarize(replace(cfg, url=s.url), conc, samples[s.label])
        spec = speculation(scrape(""), totals[s.label])
        rows.append({"server": s.label, **row, "k": spec.get("k", 0), "accept_length": spec.get("accept_length"),
                     **({"accepted_per_pos": spec["accepted_per_pos"], "drafts": spec["drafts"]} if spec else {})})
    return rows


def plot_servers(rows: list[dict], path) -> None:
    """Per-request and total tok/s by concurrency, a line per server, accept lengths in the legend."""
    fig, (a, b) = subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["server"] for r in rows):
        mine = [r for r in rows if r["server"] == name]
        accept = [r["accept_length"] for r in mine if r["accept_length"]]
        label = name + (f" (accept {sum(accept) / len(accept):.2f})" if accept else "")
        conc = [r["concurrency"] for r in mine]
        a.plot(conc, [r["per_request_tok_s"] for r in mine], marker="o", label=label)
        b.plot(conc, [r["total_tok_s"] for r in mine], marker="o", label=label)
    for ax, what in ((a, "decode tok/s per request"), (b, "total tok/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(what)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def print_server_rows(rows: list[dict]) -> None:
    print(f"{'conc':>5} {'server':<12}{'reqs':>5}{'fail':>5}{'total tok/s':>12}{'per-req tok/s':>14}{'TTFT p50 ms':>12}"
          f"{'p90 ms':>9}{'k':>3}{'accept':>8}{'vs plain':>9}")
    for r in rows:
        accept = f"{r['accept_length']:>8.2f}" if r.get("accept_length") else f"{'-':>8}"
        ratio = f"{r['speedup']:>8.2f}x" if "speedup" in r else f"{'':>9}"
        print(f"{r['concurrency']:>5} {r['server']:<12}{r['requests']:>5}{r['errors']:>5}{r['total_tok_s']:>12.1f}"
              f"{r['per_request_tok_s']:>14.1f}{r['ttft_ms_median']:>12.1f}{r['ttft_ms_p90']:>9.1f}{r.get('k', 0):>3}"
              f"{accept}{ratio}")


def with_speedups(rows: list[dict], baseline: str) -> list[dict]:
    """Each row's per-request tok/s over the baseline server's at the same concurrency."""
    base = {r["concurrency"]: r["per_request_tok_s"] for r in rows if r["server"] == baseline}
    return [{**r, "speedup": r["per_request_tok_s"] / base[r["concurrency"]]}
            if r["server"] != baseline and base.get(r["concurrency"]) and not math.isnan(r["per_request_tok_s"]) else r
            for r in rows]


def bench_url(args) -> dict:
    """`fledge bench --url` (and `--baseline-url`): every level, a table, a JSON-able dict."""
    levels = parse_levels(args.concurrency, "--concurrency")  # the flags before any server is asked
    prompts = first_user_turns(args.prompt_file, args.num_prompts) if args.prompt_file else PROMPTS[:2]
    servers = [served("speculative" if args.baseline_url else "server", args.url, args.model, args.timeout)]
    if args.baseline_url:
        servers.insert(0, served("plain", args.baseline_url, args.model, args.timeout))
    cfg = ServerBench(args.url, prompts, None, args.max_new_tokens, tuple(levels), args.requests, args.duration,
                      args.timeout)
    rounds = max(1, min(args.rounds, args.requests)) if args.baseline_url else 1
    rows = [r for c in levels for r in measure_interleaved(servers, cfg, c, rounds)]
    rows = with_speedups(rows, "plain") if args.baseline_url else rows
    print_server_rows(rows)
    if args.png:
        plot_servers(rows, args.png)
    return {"url": args.url, "baseline_url": args.baseline_url, "model": servers[-1].model,
            "baseline_model": servers[0].model if args.baseline_url else None, "max_tokens": args.max_new_tokens,
            "prompt_source": args.prompt_file or "built-in", "prompts": prompts, "requests": args.requests,
            "rounds": rounds, "levels": [r for r in rows if r["server"] != "plain"],
            "baseline_levels": [r for r in rows if r["server"] == "plain"]}


def bench_log(args) -> dict:
    out = serving.parse_log(args.log)
    if args.baseline_log:
        base = serving.parse_log(args.baseline_log)
        out = {**out, "baseline_gen_throughput_mean": base["gen_throughput_mean"],
               "speedup": out.get("gen_throughput_mean", float("nan")) / base["gen_throughput_mean"]}
    for k, v in out.items():
        print(f"{k:<30} {v}")
    return out


def run_bench(args) -> int:
    if args.png and args.log:
        raise FledgeError("--png: a log has no figure; use it with --url or --target")
    if args.baseline_url and not args.url:
        raise FledgeError("--baseline-url compares with the server at --url: give both")
    if args.baseline_log and not args.log:
        raise FledgeError("--baseline-log compares with the log at --log: give both")
    if args.log:
        out = bench_log(args)
    elif args.url:
        out = bench_url(args)
    elif args.target and args.drafter:
        out = _engine_bench(args)
    else:
        raise FledgeError("bench needs --url (a server), --log (a serving log) or --target with --drafter (the engine)")
    if args.json:
        atomic_write_json(args.json, out)
    return 0
