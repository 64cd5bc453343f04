"""`fledge bench`: measure speculative decoding where it runs.

Three sources, one command:
  --url      an OpenAI-compatible server (SGLang, vLLM, ...), and
  --log      a serving log: fledge.perf.serving reads both.
  --target   fledge's engine (with --drafter): plain decoding, then each --shapes shape through
             the engine's speculative decoding, an acceptance profile by depth and sibling rank
             (the input `fledge tune` needs), a table, JSON and PNG plots.
"""

from __future__ import annotations

from fledge.core.errors import FledgeError
from fledge.core.files import atomic_write_json
from fledge.core.report import save_figure, subplots
from fledge.core.shape import parse_shapes
from fledge.engine.rig import engine_path, load_rig, probe_profile, run_ar, run_shape
from fledge.perf import serving


def first_user_turns(source: str | None, n: int) -> list[list[dict]]:
    """The first user turn of the first n conversations of a source (file or built-in name,
    default mtbench), each as a one-message chat."""
    from fledge.data.prep import load_conversations

    records, _ = load_conversations(source or "mtbench")
    firsts = [[m] for r in records for m in r["messages"][:1] if m["role"] == "user"][:n]
    if not firsts:
        raise FledgeError(f"{source}: no conversation starts with a user turn")
    return firsts


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
def _engine_bench(args) -> dict:
    rig = load_rig(args.target, args.drafter, args.device, args.dtype, args.chat_template)
    prompts = load_prompts(args.prompts, args.num_prompts, rig.tokenizer)
    plain: list[list[int]] = []
    ar = run_ar(rig, prompts, args.max_new_tokens, plain)
    results = []
    for shape in parse_shapes(args.shapes):
        outs: list[list[int]] = []
        stats, tok_s = run_shape(rig, rig.drafter(shape), prompts, args.max_new_tokens, f"shape {shape.label}", outs)
        s = stats.summary()
        results.append({"shape": shape.label, "tok_s": tok_s, "speedup": tok_s / ar["tok_s"],
                        "equal_to_plain": sum(a == b for a, b in zip(outs, plain)), "prompts": len(prompts),
                        **{k: s[k] for k in (
            "accept_length", "accept_rate", "round_ms_per_step", "depth_acceptance", "histogram", "ended_outside_vocab")}})
    print(f"plain decoding {ar['tok_s']:.1f} tok/s ({ar['ar_ms']:.2f} ms/step); accept length = SGLang's (bonus incl.); "
          f"{engine_path(rig)}")
    print(f"{'shape':<14}{'accept':>7}{'tok/s':>9}{'speedup':>9}{'round ms':>9}{'= plain':>9}"
          f"  rounds ended outside the draft vocab")
    for r in results:
        print(f"{r['shape']:<14}{r['accept_length']:>7.2f}{r['tok_s']:>9.1f}{r['speedup']:>8.2f}x{r['round_ms_per_step']:>9.2f}"
              f"{str(r['equal_to_plain']) + '/' + str(r['prompts']):>9}  {100 * r['ended_outside_vocab']:.1f}%")
    print("= plain: outputs equal to plain decoding's, token for token (greedy; fp32 keeps them equal, bf16 may "
          "differ where two logits tie within rounding)")
    out = {"ar": ar, "results": results}
    if args.probe:
        out["profile"] = probe_profile(rig, prompts, args.probe_steps, args.probe_topk, args.max_new_tokens)
        for name, key in (("on the spine", "spine"), ("off it", "ranks")):
            print(f"acceptance by depth/rank, {name}: " + "  ".join("/".join(f"{x:.2f}" for x in row)
                                                                    for row in out["profile"][key]))
    if args.png:
        plot_engine(results, ar["tok_s"], args.png)
    return out


def run_bench(args) -> int:
    if args.log:
        out = serving.parse_log(args.log)
        for k, v in out.items():
            print(f"{k:<24} {v}")
    elif args.url:
        out = serving.bench_url(args)
    elif args.target and args.drafter:
        out = _engine_bench(args)
    else:
        raise FledgeError("bench needs --url (a server), --log (a serving log) or --target with --drafter (the engine)")
    if args.json:
        atomic_write_json(args.json, out)
    return 0
