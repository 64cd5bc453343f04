"""`fledge demo`: the whole loop in miniature on the built-in target, on this machine.

prompts (MT-Bench) → the target answers them (regen) → ids + loss masks → draft vocab →
EAGLE-3 training (a few steps) → export → doctor → speculative decoding vs AR on held-out
prompts. Sizes are chosen to finish in minutes on a 2-core CPU: the drafter it trains is far
too small to be useful; what the demo proves is that every step runs and hands the next one
valid files. A shipped drafter (drafters/<target>/), when present, shows the real speed-up in
the last step, twice: as shipped, and as a CPU favours it. On a GPU a draft step is nearly free
beside the target's forward; on a CPU the drafter's head (24K rows for the shipped one) is read
at every step and costs a sizeable share of a target forward, so the demo also runs it with a
head cut to its first rows and a short chain. Every output is checked against plain decoding.

`--method dflash` or `--method peagle` trains the miniature as a DFlash block drafter or a
P-EAGLE one instead (one drafter forward drafts the whole chain) and runs the same checks with
it; neither kind is shipped, so the speed step measures the miniature.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from fledge.core.config import RegenConfig, TrainConfig
from fledge.core.errors import FledgeError
from fledge.core.files import atomic_write_json
from fledge.core.shape import Shape
from fledge.core.target import encode_chat, eos_ids, load_target
from fledge.data.prep import load_conversations
from fledge.data.regen import EngineBackend, regenerate
from fledge.data.tokenize import build_training_set
from fledge.data.vocab import build_vocab, coverage, save_vocab
from fledge.doctor.checks import exit_code, report
from fledge.doctor.doctor import doctor
from fledge.drafter.checkpoint import export_checkpoint, load_checkpoint
from fledge.drafter.dflash_checkpoint import export_dflash, load_dflash
from fledge.engine.block import BlockDrafter
from fledge.engine.decode import generate_ar
from fledge.engine.drafters import Eagle3Drafter
from fledge.engine.hf import build_engine_target
from fledge.engine.parallel import ParallelDrafter
from fledge.engine.sampling import SamplingParams
from fledge.engine.spec import generate_spec
from fledge.train.loop import train

SHIPPED = Path(__file__).resolve().parent.parent / "drafters"
SIZED_FOR = 135e6  # parameters of the built-in target, which the demo's default sizes are set for


def demo_sizes(prompts: int, new_tokens: int, params: int) -> tuple[int, int]:
    """The demo's prompt count and tokens per answer for a target of `params` parameters.

    On a CPU a decode step reads every weight once, so answering and the speed check cost about
    params x prompts x tokens: for a target larger than the built-in one both shrink by the
    square root of the size ratio, which keeps the demo's wall time (0.5B: 8 prompts of 48
    tokens become 4 of 25). Never below 2 prompts and 16 tokens."""
    s = max(1.0, params / SIZED_FOR) ** 0.5
    return max(2, round(prompts / s)), max(16, round(new_tokens / s))


def _step(rows: list, name: str, t0: float, what: str) -> float:
    now = time.perf_counter()
    rows.append([name, f"{now - t0:.1f}", what])
    print(f"[demo] {name:<9} {now - t0:6.1f} s  {what}", flush=True)
    return now


def cpu_head(draft, rows: int, target_model):
    """The drafter with its head cut to its first `rows` rows (the lowest target ids: a BPE
    vocabulary numbers its frequent pieces first). On a CPU the head's 24K rows are most of a
    draft step; verification stays exact, so a smaller head only changes what is drafted."""
    if rows < draft.cfg.draft_vocab_size:
        draft.change_vocab(draft.target_ids()[:rows].cpu(), target_model)
    return draft


def _gpu_figure() -> str:
    """The shipped drafter's (5,4,16) figure on MT-Bench from its bench file, said with where it was measured."""
    path = SHIPPED.parent / "bench" / "results" / "drafter_h200.json"
    try:
        d = json.loads(path.read_text())
        row = next(r for r in d["sets"]["mtbench"]["rows"] if r["drafter"] == "shipped" and r["shape"] == [5, 4, 16])
    except (OSError, ValueError, KeyError, StopIteration):
        return "the GPU figure: see README's current figures"
    return f"on an H200 (bf16, {path.name}, commit {d['commit']}) the same drafter gives {row['speedup']:.2f}x at (5,4,16)"


def _compare(drafters: dict, prompts, engine, eos, new_tokens: int, repeats: int) -> tuple[dict, int]:
    """Plain decoding and each drafter on the same prompts, interleaved prompt by prompt and
    repeated (a load change on a shared machine hits every config alike): per config the decode
    tok/s of each repeat, the speed-up's median and spread, accept length; and how many
    speculative outputs equal plain decoding's."""
    params = SamplingParams(max_new_tokens=new_tokens)
    runs = {name: [] for name in ("AR", *drafters)}
    accepts, round_ms, equal = {n: [] for n in drafters}, {n: [] for n in drafters}, 0
    for _ in range(repeats):
        tokens, seconds = Counter(), Counter()
        for p in prompts:
            t = time.perf_counter()
            ref = generate_ar(engine, [p], params, eos)[0][0]
            tokens["AR"], seconds["AR"] = tokens["AR"] + len(ref), seconds["AR"] + time.perf_counter() - t
            for name, d in drafters.items():
                t = time.perf_counter()
                out, stats = generate_spec(engine, d, p, params, eos)
                tokens[name], seconds[name] = tokens[name] + len(out), seconds[name] + time.perf_counter() - t
                accepts[name].append(stats.summary()["accept_length"])
                round_ms[name].append(stats.summary()["round_ms_per_step"])
                equal += out == ref
        for name, tok_s in runs.items():
            tok_s.append(tokens[name] / seconds[name])
    out = {"AR": {"tok_s": runs["AR"], "ms_per_token": 1e3 / statistics.median(runs["AR"])}}
    for name in drafters:
        ratios = [a / b for a, b in zip(runs[name], runs["AR"])]
        out[name] = {"tok_s": runs[name], "speedups": ratios, "speedup": statistics.median(ratios),
                     "accept_length": statistics.mean(accepts[name]), "round_ms": statistics.median(round_ms[name])}
    return out, equal


def speed_drafters(method: str, drafter_dir: Path, target_model, engine, steps: int, head_rows: int) -> dict:
    """The drafters the speed step runs, by name, each drafting a chain of `steps`: EAGLE-3 as
    it is and with its head cut to `head_rows` (`cpu_head`); DFlash as it is (one forward a
    round; its head is the miniature's draft vocabulary); P-EAGLE as EAGLE-3, each chain in one
    forward."""
    chain = Shape(steps, 1, steps + 1)
    if method == "dflash":
        draft = load_dflash(drafter_dir, embed_from=target_model).eval().cast("cpu", torch.float32)
        return {f"dflash chain {steps}, head {draft.cfg.draft_vocab_size}": BlockDrafter(draft, chain, engine)}

    def draft():
        return load_checkpoint(str(drafter_dir), embed_from=target_model).eval().cast("cpu", torch.float32)

    full, small = draft(), cpu_head(draft(), head_rows, target_model)
    kind = ParallelDrafter if method == "peagle" else Eagle3Drafter
    return {f"{method} chain {steps}, head {d.cfg.draft_vocab_size}": kind(d, chain, engine) for d in (full, small)}


def _speed_step(args, target, held, work) -> tuple[dict, bool]:
    """The last step: the shipped drafter (or the miniature one) against plain decoding on
    held-out prompts, as shipped and as the CPU favours (a head of `--cpu-head-rows` rows and a
    chain of `--cpu-steps`), with every output checked against plain decoding."""
    shipped = SHIPPED / args.target
    use_shipped = args.method == "eagle3" and (shipped / "config.json").exists()
    drafter_dir = shipped if use_shipped else work / "export"
    engine = build_engine_target(target.model, torch.float32, "cpu")
    eos = eos_ids(target.tokenizer, target.model.generation_config)
    drafters = speed_drafters(args.method, drafter_dir, target.model, engine, args.cpu_steps, args.cpu_head_rows)
    cover = {n: coverage(d.draft.target_ids().cpu(), work / "heldout.tok.jsonl") for n, d in drafters.items()}
    prompts = [encode_chat(target.tokenizer, c["messages"]) for c in held]
    summary, equal = _compare(drafters, prompts, engine, eos, args.new_tokens, args.repeats)
    n_out = len(prompts) * len(drafters) * args.repeats
    print(f"\nspeed on this CPU (fp32, batch 1, {torch.get_num_threads()} threads, {len(prompts)} held-out prompts x "
          f"{args.new_tokens} new tokens, {args.repeats} interleaved repeats; drafter {drafter_dir})")
    print(f"{'config':<28}{'tok/s':>8}{'vs AR (spread)':>20}{'accept len':>12}{'held-out cover':>16}")
    ar = summary["AR"]
    print(f"{'plain decoding (AR)':<28}{statistics.median(ar['tok_s']):>8.1f}")
    for name in drafters:
        r = summary[name]
        spread = f"{r['speedup']:.2f}x ({min(r['speedups']):.2f}-{max(r['speedups']):.2f})"
        print(f"{name:<28}{statistics.median(r['tok_s']):>8.1f}{spread:>20}{r['accept_length']:>12.2f}{cover[name]:>16.3f}")
    print(f"speculative outputs equal to plain decoding: {equal}/{n_out}")
    best = max(drafters, key=lambda n: summary[n]["speedup"])
    if summary[best]["speedup"] < 1.3:
        r = summary[best]
        drafting = f"{args.cpu_steps} draft steps" if args.method == "eagle3" else "one drafter forward"
        gpu = _gpu_figure() if args.method == "eagle3" else "a miniature trained for seconds drafts little"
        print(f"below 1.3x here: a round ({drafting} + a verify of {args.cpu_steps + 1} tokens) took "
              f"{r['round_ms']:.0f} ms against {ar['ms_per_token']:.0f} ms a plain token, for {r['accept_length']:.2f} "
              f"tokens a round; {gpu}")
    for name in drafters:
        summary[name]["heldout_coverage"] = cover[name]
    return {"drafter": str(drafter_dir), "compare": summary, "equal_to_plain": equal, "outputs": n_out}, equal == n_out


def train_miniature(method: str, target, data: Path, held: Path, vocab: Path, work: Path, steps: int) -> tuple[Path, dict]:
    """The miniature drafter of `method` trained on `data` (batch 2, chains of 3) and exported
    to `work`/export in the layout its server reads: (that directory, the held-out eval)."""
    run = work / "train"
    shutil.rmtree(run, ignore_errors=True)
    tcfg = TrainConfig(data=str(data), out=str(run), target=target.name, vocab=str(vocab), method=method,
                       max_steps=steps, batch_size=2, ttt_steps=3, eval_data=str(held), max_len=1024, lr=1e-3,
                       log_every=5, eval_every=steps, save_every=steps, device="cpu")
    result = train(tcfg, target)
    if method == "dflash":
        out = export_dflash(load_dflash(result["draft"], embed_from=target.model), work / "export", overwrite=True)
    else:
        out = export_checkpoint(load_checkpoint(result["draft"], embed_from=target.model), work / "export",
                                layout="eagle3", overwrite=True)
    return out, result["eval"] or {}


def run_demo(args) -> int:
    torch.manual_seed(0)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.perf_counter()
    target = load_target(args.target, chat_template=args.chat_template, chat=True)
    params = sum(p.numel() for p in target.model.parameters())
    prompts, new_tokens = demo_sizes(args.prompts, args.new_tokens, params)
    if (prompts, new_tokens) != (args.prompts, args.new_tokens):
        print(f"[demo] a {params / 1e9:.2f}B target: {prompts} prompts x {new_tokens} tokens instead of "
              f"{args.prompts} x {args.new_tokens}, to keep the demo's minutes (fledge.demo.demo_sizes)")
        args = argparse.Namespace(**{**vars(args), "prompts": prompts, "new_tokens": new_tokens})
    t0 = _step(rows, "target", t0, f"{args.target}: {target.num_layers} layers, hidden {target.hidden_size}, "
                                   f"{params / 1e6:.0f}M parameters")

    convs, _ = load_conversations("mtbench")
    if len(convs) < args.prompts + args.eval_prompts:
        raise FledgeError(f"mtbench: {len(convs)} questions, demo needs {args.prompts + args.eval_prompts}")
    first_turn = [{**c, "messages": c["messages"][:1]} for c in convs]
    train_convs, held = first_turn[: args.prompts], first_turn[-args.eval_prompts:]
    for name, part in (("prompts", train_convs), ("heldout", held)):
        (work / f"{name}.jsonl").write_text("".join(json.dumps(c) + "\n" for c in part))
    t0 = _step(rows, "prep", t0, f"{len(train_convs)} MT-Bench first turns (+{len(held)} held out for eval and speed)")

    cfg = RegenConfig(max_new_tokens=args.new_tokens, max_turns=1, max_len=1024, batch_size=args.prompts)
    backend = EngineBackend(target, cfg, device="cpu", dtype=torch.float32)
    stats = {}
    for name in ("prompts", "heldout"):
        (work / f"{name}.regen.jsonl").unlink(missing_ok=True)
        regenerate(work / f"{name}.jsonl", work / f"{name}.regen.jsonl", backend, cfg)
        stats[name] = build_training_set(target.tokenizer, work / f"{name}.regen.jsonl", work / f"{name}.tok.jsonl", 1024)
    t0 = _step(rows, "regen", t0, f"{args.prompts}+{args.eval_prompts} answers written by the target, tokenized")

    tok_path = work / "prompts.tok.jsonl"
    vocab_path = work / "vocab.safetensors"
    d2t, t2d = build_vocab(tok_path, target.model.config.vocab_size, args.draft_vocab)
    save_vocab(vocab_path, t2d.nonzero().flatten(), target.model.config.vocab_size, {"source": str(tok_path)})
    t0 = _step(rows, "data", t0, f"{stats['prompts']['samples']} samples, {stats['prompts']['trained_tokens']} trained tokens; draft vocab {args.draft_vocab}")

    exported, ev = train_miniature(args.method, target, tok_path, work / "heldout.tok.jsonl", vocab_path, work,
                                   args.train_steps)
    acc = f"{ev['acc'][0]:.3f}" if ev else "n/a"
    t0 = _step(rows, "train", t0, f"{args.method}, {args.train_steps} steps; held-out step-0 top-1 accuracy {acc}")

    checks = doctor(str(exported), target=args.target)
    code = exit_code(checks)
    report(checks)
    verdict = {0: "every check passes", 1: "warnings"}.get(code, "failures")
    t0 = _step(rows, "export", t0, f"{exported}: doctor exit {code} ({verdict})")

    speed, same = _speed_step(args, target, held, work)
    _step(rows, "compare", t0, f"AR vs {args.method} (accept length = SGLang's, incl. the bonus token)")
    atomic_write_json(work / "demo.json", {"steps": rows, **speed, "doctor_exit": code,
                                           "wall_s": round(sum(float(r[1]) for r in rows), 1)})
    print(f"\nwrote {work / 'demo.json'}; the whole demo took {sum(float(r[1]) for r in rows):.0f} s")
    return 0 if same and code < 2 else 1
