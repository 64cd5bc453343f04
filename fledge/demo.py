"""`fledge demo`: the whole loop in miniature on the built-in target, on this machine.

prompts (MT-Bench) → the target answers them (regen) → ids + loss masks → draft vocab →
EAGLE-3 training (a few steps) → export → doctor → speculative decoding vs AR on held-out
prompts. Sizes are chosen to finish in minutes on a 2-core CPU: the drafter it trains is far
too small to be useful, and the table says so; what the demo proves is that every step runs
and hands the next one valid files. A shipped drafter (drafters/<target>/), when present,
shows the real speed-up in the last step.
"""

from __future__ import annotations

import json
import shutil
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
from fledge.data.vocab import build_vocab, save_vocab
from fledge.doctor.checks import exit_code, report
from fledge.doctor.doctor import doctor
from fledge.drafter.checkpoint import export_checkpoint, load_checkpoint
from fledge.engine.decode import generate_ar
from fledge.engine.drafters import NgramDrafter, load_drafter
from fledge.engine.hf import build_engine_target
from fledge.engine.sampling import SamplingParams
from fledge.engine.spec import generate_spec
from fledge.train.loop import train

SHIPPED = Path(__file__).resolve().parent.parent / "drafters"


def _step(rows: list, name: str, t0: float, what: str) -> float:
    now = time.perf_counter()
    rows.append([name, f"{now - t0:.1f}", what])
    print(f"[demo] {name:<9} {now - t0:6.1f} s  {what}", flush=True)
    return now


def _compare(drafter_dir, prompts, tok, model, new_tokens) -> tuple[dict, bool]:
    """Greedy AR vs EAGLE-3 chain vs n-gram on the same prompts, one engine, fp32: a row of
    figures per config, and whether every speculative output equals AR's."""
    engine = build_engine_target(model, torch.float32, "cpu")
    params, eos = SamplingParams(max_new_tokens=new_tokens), eos_ids(tok, model.generation_config)
    chain = Shape(num_steps=4, topk=1, num_draft_tokens=5)
    # Drafters reset their state at each generate_spec, so one of each serves every prompt.
    drafters = {"eagle3 chain 4": load_drafter(drafter_dir, chain, model, engine, "cpu", torch.float32),
                "n-gram chain 4": NgramDrafter(chain, 3)}
    tokens, seconds, accepts, same = Counter(), Counter(), {name: [] for name in drafters}, True
    for p in prompts:
        t = time.perf_counter()
        ref = generate_ar(engine, [p], params, eos)[0][0]
        tokens["AR"] += len(ref)
        seconds["AR"] += time.perf_counter() - t
        for name, d in drafters.items():
            t = time.perf_counter()
            out, stats = generate_spec(engine, d, p, params, eos)
            tokens[name] += len(out)
            seconds[name] += time.perf_counter() - t
            accepts[name].append(stats.summary()["accept_length"])
            same &= out == ref
    tok_s = {name: n / seconds[name] for name, n in tokens.items()}
    return {name: {"tokens": n, "seconds": seconds[name], "tok_s": tok_s[name], "speedup": tok_s[name] / tok_s["AR"],
                   "accept_length": sum(accepts[name]) / len(accepts[name]) if name in accepts else None}
            for name, n in tokens.items()}, same


def run_demo(args) -> int:
    torch.manual_seed(0)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.perf_counter()
    target = load_target(args.target)
    t0 = _step(rows, "target", t0, f"{args.target}: {target.num_layers} layers, hidden {target.hidden_size}")

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

    run = work / "train"
    shutil.rmtree(run, ignore_errors=True)
    tcfg = TrainConfig(data=str(tok_path), out=str(run), target=args.target, vocab=str(vocab_path),
                       max_steps=args.train_steps, batch_size=2, ttt_steps=3, eval_data=str(work / "heldout.tok.jsonl"), max_len=1024,
                       lr=1e-3, log_every=5, eval_every=args.train_steps, save_every=args.train_steps, device="cpu")
    result = train(tcfg, target)
    ev = result["eval"] or {}
    acc = f"{ev['acc'][0]:.3f}" if ev else "n/a"
    t0 = _step(rows, "train", t0, f"{args.train_steps} steps; held-out step-0 top-1 accuracy {acc}")

    exported = export_checkpoint(load_checkpoint(result["draft"], embed_from=target.model), work / "export",
                                 layout="eagle3", overwrite=True)
    checks = doctor(str(exported), target=args.target)
    code = exit_code(checks)
    report(checks)
    verdict = {0: "every check passes", 1: "warnings"}.get(code, "failures")
    t0 = _step(rows, "export", t0, f"{exported}: doctor exit {code} ({verdict})")

    shipped = SHIPPED / args.target
    drafter_dir = shipped if (shipped / "config.json").exists() else exported
    prompts = [encode_chat(target.tokenizer, c["messages"]) for c in held]
    summary, same = _compare(str(drafter_dir), prompts, target.tokenizer, target.model, args.new_tokens)
    print(f"\nspeed on this CPU (fp32, batch 1, {len(prompts)} held-out prompts, {args.new_tokens} new tokens, "
          f"drafter: {'shipped ' + str(shipped) if drafter_dir == shipped else 'the miniature one just trained'})")
    print(f"{'config':<16}{'tok/s':>8}{'vs AR':>8}{'accept len':>12}")
    for name, r in summary.items():
        al = r["accept_length"]
        print(f"{name:<16}{r['tok_s']:>8.1f}{r['speedup']:>7.2f}x{al if al is None else round(al, 2)!s:>12}")
    print(f"speculative outputs identical to AR: {same}")
    _step(rows, "compare", t0, "AR vs EAGLE-3 vs n-gram (accept length = SGLang's, incl. the bonus token)")
    atomic_write_json(work / "demo.json", {"steps": rows, "compare": summary, "identical": same,
                                           "drafter": str(drafter_dir), "doctor_exit": code})
    print(f"\nwrote {work / 'demo.json'}")
    return 0 if same and code < 2 else 1
