"""Helpers for scripts/gpu_adapt.sh: the `fledge adapt` experiment (issue 7) on SmolLM2.

    select PREP_DIR OUT.jsonl.gz     code conversations of a `fledge prep sharegpt` dir, by role
    unpack CODE.jsonl.gz DIR         -> finetune.jsonl, prompts.jsonl, heldout_prompts.jsonl
    shift --old T --new T ...        how far NEW moved from OLD on the held-out code prompts
    engine --target NEW --drafter NAME=DIR ...   accept length of each drafter in fledge's engine
    report DIR OUT.json ...          every figure in one JSON (+ metrics copies, a plot) and a table

What counts as code (`is_code`): a ``` fence, or a line that starts like code (def/class/import,
#include, function, const/let/var, public static, SELECT ... FROM), in the first user turn or
in the first answer. Precise rather than broad: a bare language name ("Ruby", "git") also
matches stories and résumés. On ShareGPT about one conversation in five passes.

Roles (field "source"): "code-finetune" (first user turn + ChatGPT's ORIGINAL first answer:
NEW learns ChatGPT's code answers, so its domain and style move), "code-train" (first user
turns only, disjoint from the finetune ones: NEW answers them to train drafters) and
"code-heldout" (first user turns from prep's held-out split only, which neither OLD's drafter
nor anything here trains on). Train-split code conversations go half to each of the first two
roles (the file holds fewer than the 2 x 2000 the design allows). Only prompts that leave room
for a whole answer are kept: chat-templated prompt <= max_len - max_new_tokens tokens (2048 -
512), so regen never drops one for context.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import sys
from pathlib import Path

from gpu_prepare_data import first_turn

from fledge.util import FledgeError, atomic_write_bytes, atomic_write_json, read_jsonl

CODE_LINE = re.compile(r"^\s*(def \w+\(|class \w+[:({]|import \w+|from [\w.]+ import |#include\s*[<\"]"
                       r"|public (static|class|void) |function \w*\s*\(|(const|let|var) \w+ = |SELECT .+ FROM )", re.M)
ROLES = ("code-finetune", "code-train", "code-heldout")
MEASURES = ("accept_len", "accept_len_no_bonus")  # simulated, from fledge train's eval records


# --------------------------------------------------------------------------- selection
def first_exchange(messages: list[dict]) -> tuple[list[dict], str | None]:
    """(messages up to the first user turn, the first answer or None)."""
    head = first_turn(messages)
    nxt = messages[len(head)] if len(messages) > len(head) else None
    return head, nxt["content"] if nxt and nxt["role"] == "assistant" else None


def is_code(user: str, answer: str) -> bool:
    return "```" in user or "```" in answer or bool(CODE_LINE.search(user) or CODE_LINE.search(answer))


def select(prep_dir: Path, out: Path, tokenizer_spec: str, max_prompt_tokens: int, n_finetune: int,
           n_train: int, n_heldout: int, min_heldout: int, seed: int = 0) -> dict:
    from fledge.data import load_tokenizer
    from fledge.engine.cli import encode_chat

    tok = load_tokenizer(tokenizer_spec)

    def code(path: Path) -> list[tuple[dict, list[dict], str]]:
        if not path.is_file():
            raise FledgeError(f"{path}: missing; run `fledge prep sharegpt -o {prep_dir}` first")
        rows = []
        for _, r in read_jsonl(path):
            head, answer = first_exchange(r["messages"])
            if answer and is_code(head[-1]["content"], answer) and len(encode_chat(tok, head)) <= max_prompt_tokens:
                rows.append((r, head, answer))
        return rows

    train, held = code(prep_dir / "train.jsonl"), code(prep_dir / "heldout.jsonl")
    if len(held) < min_heldout:
        raise FledgeError(f"{prep_dir}/heldout.jsonl: {len(held)} code conversations, need >= {min_heldout}")
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(held)
    k = min(n_finetune, len(train) // 2)
    picks = {"code-finetune": train[:k], "code-train": train[k:k + n_train], "code-heldout": held[:n_heldout]}
    rows = []
    for role, items in picks.items():
        for r, head, answer in items:
            msgs = head + [{"role": "assistant", "content": answer}] if role == "code-finetune" else head
            rows.append({"id": r["id"], "source": role, "messages": msgs})
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    atomic_write_bytes(out, gzip.compress(text.encode(), mtime=0))
    return {"code_in_train_split": len(train), "code_in_heldout_split": len(held),
            **{role: len(items) for role, items in picks.items()},
            "heldout_short_of_target": max(0, n_heldout - len(held)), "bytes": out.stat().st_size}


def unpack(packed: Path, out_dir: Path, caps: dict[str, int | None]) -> dict:
    """finetune.jsonl (code-finetune), prompts.jsonl (held-out first, then code-train: the
    split after regen goes by the -heldout suffix) and heldout_prompts.jsonl (for OLD's answers)."""
    if not packed.is_file():
        raise FledgeError(f"{packed}: missing; carry it (made here by `gpu_adapt.sh prepare`)")
    rows = {role: [] for role in ROLES}
    for line in gzip.decompress(packed.read_bytes()).decode().split("\n"):  # not splitlines(): U+2028
        if not line.strip():
            continue
        r = json.loads(line)
        if r.get("source") not in rows:
            raise FledgeError(f"{packed}: source {r.get('source')!r} is none of {', '.join(ROLES)}")
        rows[r["source"]].append(r)
    rows = {role: items[:caps.get(role)] for role, items in rows.items()}
    if not all(rows.values()):
        raise FledgeError(f"{packed}: a role has no conversation ({ {k: len(v) for k, v in rows.items()} })")
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"finetune.jsonl": rows["code-finetune"], "prompts.jsonl": rows["code-heldout"] + rows["code-train"],
             "heldout_prompts.jsonl": rows["code-heldout"]}
    for name, items in files.items():
        atomic_write_bytes(out_dir / name, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in items).encode())
    return {role: len(items) for role, items in rows.items()}


# --------------------------------------------------------------------------- how far NEW moved
def shift(old_spec: str, new_spec: str, heldout_tok: Path, new_answers: Path, old_answers: Path,
          device: str, dtype: str) -> dict:
    """Teacher-forced: on NEW's greedy answers (tokenized held-out set), the share of answer
    positions where OLD's argmax next token differs from NEW's (one forward each); NEW's own
    disagreement with its generated tokens is the numeric noise floor (HF forward vs engine
    decode, bf16, re-tokenized text). An answer cut at max tokens loses its last masked
    position: the end-of-turn token the template appends there is not one NEW said.
    Free-running: OLD's and NEW's greedy answers to the same prompts, compared token by token."""
    import torch

    from fledge.engine.cli import pick_device, pick_dtype
    from fledge.target import load_target

    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    old, new = load_target(old_spec, dtype=dt, device=dev), load_target(new_spec, dtype=dt, device=dev)
    cut = {r["id"] for _, r in read_jsonl(new_answers) if r.get("finish") == "length"}
    counts = dict.fromkeys(("positions", "old_vs_new", "new_vs_tokens", "old_vs_tokens"), 0)
    with torch.no_grad():
        for _, rec in read_jsonl(heldout_tok):
            ids = torch.tensor([rec["input_ids"]], device=dev)
            mask = rec["loss_mask"][1:]  # logits at t predict x_{t+1}
            if rec["id"] in cut and any(mask):
                mask[len(mask) - 1 - mask[::-1].index(1)] = 0
            keep = torch.tensor(mask, dtype=torch.bool, device=dev)
            a_old = old.model(input_ids=ids).logits[0, :-1].argmax(-1)[keep]
            a_new = new.model(input_ids=ids).logits[0, :-1].argmax(-1)[keep]
            truth = ids[0, 1:][keep]
            counts["positions"] += int(keep.sum())
            counts["old_vs_new"] += int((a_old != a_new).sum())
            counts["new_vs_tokens"] += int((a_new != truth).sum())
            counts["old_vs_tokens"] += int((a_old != truth).sum())
    if not counts["positions"]:
        raise FledgeError(f"{heldout_tok}: no answer tokens to compare")
    n = counts["positions"]
    tf = {"positions": n, "share_argmax_differs": counts["old_vs_new"] / n,
          "share_new_differs_from_its_tokens": counts["new_vs_tokens"] / n,
          "share_old_differs_from_new_tokens": counts["old_vs_tokens"] / n}
    return {"teacher_forced": tf, "free_running": compare_answers(new.tokenizer, new_answers, old_answers)}


def compare_answers(tok, new_answers: Path, old_answers: Path) -> dict:
    """Per held-out prompt answered by both: identical or not, common-prefix tokens."""
    answer = lambda path: {r["id"]: r["messages"][-1]["content"] for _, r in read_jsonl(path)}  # noqa: E731
    new, old = answer(new_answers), answer(old_answers)
    ids = [i for i in new if i in old]
    if not ids:
        raise FledgeError(f"{new_answers} and {old_answers}: no prompt answered by both")
    prefix, differ, lengths = [], 0, {"new": 0, "old": 0}
    for i in ids:
        a, b = (tok(t, add_special_tokens=False)["input_ids"] for t in (new[i], old[i]))
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(k)
        differ += a != b
        lengths["new"] += len(a)
        lengths["old"] += len(b)
    n = len(ids)
    examples = [{"id": i, "new": new[i][:300], "old": old[i][:300]} for i in ids[:2]]
    return {"prompts": n, "share_answers_differ": differ / n, "mean_common_prefix_tokens": sum(prefix) / n,
            "median_common_prefix_tokens": sorted(prefix)[n // 2],
            "mean_answer_tokens": {k: v / n for k, v in lengths.items()}, "examples": examples}


# --------------------------------------------------------------------------- the engine
def engine(target: str, drafters: dict[str, str], prompts_file: str, n: int, max_new: int, device: str,
           dtype: str, cache: Path) -> dict:
    """Accept length (SGLang's: accepted drafts + 1 bonus per verify step) of each drafter on
    NEW, chain 7 = SpecConfig(7, 1, 8), greedy. The target loads once; each drafter's result
    is saved as it completes, so a rerun with the same settings measures only the rest."""
    from fledge.bench import EngineRig, load_prompts, run_shape
    from fledge.checkpoint import load_checkpoint
    from fledge.engine.cli import eos_ids, pick_device, pick_dtype
    from fledge.engine.drafters import SpecConfig
    from fledge.engine.model import build_engine_target
    from fledge.target import load_target

    spec = SpecConfig(7, 1, 8)
    settings = {"target": target, "prompts": prompts_file, "num_prompts": n, "max_new_tokens": max_new,
                "device": device, "dtype": dtype, "spec": [spec.num_steps, spec.topk, spec.num_draft_tokens],
                "drafters": drafters}
    done = json.loads(cache.read_text()) if cache.exists() else {}
    if done.get("settings") != settings:
        done = {"settings": settings, "results": {}}
    todo = [k for k in drafters if k not in done["results"]]
    if todo:
        dev = pick_device(device)
        dt = pick_dtype(dtype, dev)
        t = load_target(target, dtype=dt, device=dev)
        engine_target = build_engine_target(t.model, dt, dev)
        ids = load_prompts(prompts_file, n, t.tokenizer)
        for name in todo:
            draft = load_checkpoint(drafters[name], embed_from=t.model).eval().cast(dev, dt)
            rig = EngineRig(t.model, t.tokenizer, engine_target, draft, eos_ids(t.model, t.tokenizer), dev)
            stats, tok_s = run_shape(rig, rig.drafter(spec), ids, max_new, name)
            s = stats.summary()
            done["results"][name] = {"prompts": len(ids), "decode_tok_s": tok_s, **{k: s[k] for k in (
                "accept_length", "accept_rate", "verify_steps", "generated_tokens", "depth_acceptance", "histogram")}}
            atomic_write_json(cache, done)
            print(f"{name}: accept length {s['accept_length']:.3f} on {len(ids)} prompts")
    else:
        print(f"{cache}: every drafter measured already")
    return done


# --------------------------------------------------------------------------- the report
def evals(metrics: Path) -> list[dict]:
    if not metrics.is_file():
        raise FledgeError(f"{metrics}: missing; that training run has not finished")
    rows = [{k: r[k] for k in ("step", *MEASURES)} for _, r in read_jsonl(metrics) if r["kind"] == "eval"]
    if not rows:
        raise FledgeError(f"{metrics}: no eval records")
    return rows


def same_vocab(vocab: Path, drafters: list[Path]) -> bool:
    """Whether every drafter drafts over the vocab file's tokens (`fledge adapt` builds its own
    from the same data and size, so the comparison is only fair if they agree)."""
    import torch

    from fledge.vocab import load_vocab_ids

    ids = load_vocab_ids(vocab)[0]
    return all(torch.equal(ids, load_vocab_ids(d)[0]) for d in drafters)


def steps_to_90(curves: dict[str, list[dict]], measure: str) -> dict:
    """The level (90% of scratch_full's final eval) and the first eval step of each run at or
    above it (None: not reached)."""
    level = 0.9 * curves["scratch_full"][-1][measure]
    return {"level": level, **{k: next((r["step"] for r in rows if r[measure] >= level), None)
                               for k, rows in curves.items()}}


def report(a: Path, out: Path, knobs: dict, full_steps: int, budget_steps: int) -> dict:
    read = lambda p: json.loads((a / p).read_text()) if (a / p).exists() else None  # noqa: E731
    engine_res = read("engine.json")
    if not engine_res:
        raise FledgeError(f"{a}/engine.json: missing; the engine measurement has not run")
    runs = {"adapted": a / "adapted/train/metrics.jsonl", "scratch_budget": a / "scratch_budget/metrics.jsonl",
            "scratch_full": a / "scratch_full/metrics.jsonl"}
    curves = {k: evals(p) for k, p in runs.items()}
    reach = {m: steps_to_90(curves, m) for m in MEASURES}
    within = {m: r["adapted"] is not None and r["adapted"] <= full_steps / 4 for m, r in reach.items()}
    acc = {k: v["accept_length"] for k, v in engine_res["results"].items()}
    rep = {
        "definitions": {
            "engine_accept_length": "SGLang's: (accepted draft tokens + 1 bonus) per verify step; fledge engine, "
                                    "target NEW, greedy, chain 7 = SpecConfig(7, 1, 8), held-out code prompts",
            "simulated_accept_length": "train eval records' accept_len: 1 + sum_j prod_{i<=j} acc_i over TTT steps "
                                       "(with the bonus) on the held-out code set (NEW's answers)",
            "simulated_accept_len_no_bonus": "the same without the bonus (SpecForge's): accepted drafts per "
                                             "verify step, the stricter bar for 90%",
            "steps_to_90": "first eval step whose simulated accept length >= 0.9 x scratch_full's final eval; "
                           "resolution = that run's eval interval; the goal uses accept_len (with the bonus)",
            "shift": "teacher-forced on NEW's greedy held-out answers: share of answer positions where OLD's argmax "
                     "next token differs from NEW's"},
        "shift": read("shift.json"), "finetune": read("new/finetune.json"),
        "selection": read("unpack.json"), "vocab": read("vocab.json"),
        "adapt": {k: v for k, v in (read("adapted/adapt.json") or {}).items() if k != "train"},
        "same_draft_vocab": same_vocab(a / "vocab.safetensors", [a / "adapted/train/draft", a / "scratch_full/draft"]),
        "engine": engine_res,
        "simulated": {"scratch_full_final": curves["scratch_full"][-1],
                      "scratch_full_best": {m: max(r[m] for r in curves["scratch_full"]) for m in MEASURES},
                      "curves": curves},
        "steps_to_90": {**reach, "quarter_of_full": full_steps / 4},
        "goals": {"adapted_beats_scratch_at_equal_budget": acc.get("adapted", 0) > acc.get("scratch_budget", 0),
                  "adapted_beats_scratch_at_equal_budget_simulated":
                      curves["adapted"][-1]["accept_len"] > curves["scratch_budget"][-1]["accept_len"],
                  "adapted_reaches_90_within_quarter": within["accept_len"],
                  "adapted_reaches_90_within_quarter_no_bonus": within["accept_len_no_bonus"]},
        "knobs": knobs, "full_steps": full_steps, "budget_steps": budget_steps,
        "commands": (a / "commands.log").read_text().splitlines() if (a / "commands.log").exists() else []}
    atomic_write_json(out, rep)
    for k, p in runs.items():
        atomic_write_bytes(out.parent / f"adapt_metrics_{k}.jsonl", p.read_bytes())
    plot(curves, reach["accept_len"]["level"], out.parent / "adapt_curves.png")
    return rep


def plot(curves: dict, level: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fledge.util import save_figure

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in curves.items():
        ax.plot([r["step"] for r in rows], [r["accept_len"] for r in rows], "o-", label=name)
    ax.axhline(level, color="black", linestyle="--", label="90% of scratch_full (final)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("simulated accept length (with bonus)")
    ax.set_title("drafters on NEW, held-out code set")
    ax.legend()
    save_figure(fig, path)


def print_table(rep: dict) -> None:
    sh, eng = rep["shift"] or {}, rep["engine"]["results"]
    tf, fr = sh.get("teacher_forced", {}), sh.get("free_running", {})
    n = rep["engine"]["settings"]
    lines = ["== fledge adapt experiment: OLD = SmolLM2-135M-Instruct, NEW = OLD fine-tuned on ChatGPT code answers"]
    if tf:
        floor = tf["share_new_differs_from_its_tokens"]
        lines += [f"shift, teacher-forced on NEW's answers ({tf['positions']} positions): OLD argmax differs "
                  f"{tf['share_argmax_differs']:.3f} (NEW vs its own tokens {floor:.3f})",
                  f"shift, greedy answers ({fr['prompts']} prompts): differ {fr['share_answers_differ']:.3f}, "
                  f"common prefix mean {fr['mean_common_prefix_tokens']:.1f} tokens"]
    lines.append(f"engine accept length (SGLang's, incl. bonus), NEW, chain 7, "
                 f"{next(iter(eng.values()))['prompts']} prompts x {n['max_new_tokens']} tokens:")
    budget, full = rep["budget_steps"], rep["full_steps"]
    labels = {"old": "OLD drafter as-is", "adapted": f"adapted, {budget} steps",
              "scratch_budget": f"scratch, {budget} steps", "scratch_full": f"scratch, {full} steps"}
    for k, label in labels.items():
        if k in eng:
            lines.append(f"  {label:<28} {eng[k]['accept_length']:.3f}")
    final, reach = rep["simulated"]["scratch_full_final"], rep["steps_to_90"]
    show = lambda s: "not reached" if s is None else str(s)  # noqa: E731
    for m, label in (("accept_len", "with bonus"), ("accept_len_no_bonus", "no bonus")):
        r = reach[m]
        lines.append(f"simulated accept ({label}): scratch_full final {final[m]:.3f}, 90% = {r['level']:.3f}; "
                     f"first step there: adapted {show(r['adapted'])}, scratch_budget {show(r['scratch_budget'])}, "
                     f"scratch_full {show(r['scratch_full'])} (goal <= {reach['quarter_of_full']:g})")
    g = rep["goals"]
    lines.append(f"goals: adapted beats scratch at equal budget (engine): "
                 f"{g['adapted_beats_scratch_at_equal_budget']}; "
                 f"adapted reaches 90% within a quarter of the steps: {g['adapted_reaches_90_within_quarter']} "
                 f"(no-bonus bar: {g['adapted_reaches_90_within_quarter_no_bonus']})")
    print("\n".join(lines))


# --------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("select")
    a.add_argument("prep_dir", type=Path)
    a.add_argument("out", type=Path)
    a.add_argument("--tokenizer", default="smollm2-135m")
    a.add_argument("--max-prompt-tokens", type=int, default=2048 - 512)
    a.add_argument("--finetune", type=int, default=2000)
    a.add_argument("--train", type=int, default=2000)
    a.add_argument("--heldout", type=int, default=64)
    a.add_argument("--min-heldout", type=int, default=24)
    a = sub.add_parser("unpack")
    a.add_argument("packed", type=Path)
    a.add_argument("out_dir", type=Path)
    for role in ROLES:
        a.add_argument(f"--{role.removeprefix('code-')}", type=int, help=f"at most this many {role} conversations")
    a = sub.add_parser("shift")
    for name in ("old", "new", "heldout-tok", "new-answers", "old-answers", "out"):
        a.add_argument(f"--{name}", required=True)
    a.add_argument("--device")
    a.add_argument("--dtype")
    a = sub.add_parser("engine")
    a.add_argument("--target", required=True)
    a.add_argument("--drafter", action="append", required=True, help="NAME=DIR, repeatable")
    a.add_argument("--prompts", required=True)
    a.add_argument("--num-prompts", type=int, default=32)
    a.add_argument("--max-new-tokens", type=int, default=256)
    a.add_argument("--cache", type=Path, required=True, help="results JSON, resumed per drafter")
    a.add_argument("--device")
    a.add_argument("--dtype")
    a = sub.add_parser("report")
    a.add_argument("dir", type=Path, help="the experiment's state dir ($WORK/adapt)")
    a.add_argument("out", type=Path)
    a.add_argument("--knobs", default="", help="'NAME=VALUE ...' as the shell ran them")
    a.add_argument("--full-steps", type=int, required=True)
    a.add_argument("--budget-steps", type=int, required=True)
    args = p.parse_args(argv)
    try:
        if args.cmd == "select":
            result = select(args.prep_dir, args.out, args.tokenizer, args.max_prompt_tokens, args.finetune,
                            args.train, args.heldout, args.min_heldout)
        elif args.cmd == "unpack":
            caps = {role: getattr(args, role.removeprefix("code-")) for role in ROLES}
            result = unpack(args.packed, args.out_dir, caps)
            atomic_write_json(args.out_dir / "unpack.json", result)
        elif args.cmd == "shift":
            for name in ("heldout_tok", "new_answers", "old_answers"):
                if not Path(getattr(args, name)).is_file():
                    raise FledgeError(f"--{name.replace('_', '-')} {getattr(args, name)}: missing")
            result = shift(args.old, args.new, Path(args.heldout_tok), Path(args.new_answers),
                           Path(args.old_answers), args.device, args.dtype)
            atomic_write_json(args.out, result)
        elif args.cmd == "engine":
            pairs = [d.split("=", 1) for d in args.drafter]
            for pair in pairs:
                if len(pair) != 2 or not (Path(pair[1]) / "config.json").is_file():
                    raise FledgeError(f"--drafter {'='.join(pair)}: expected NAME=DIR of an exported drafter")
            engine(args.target, dict(pairs), args.prompts, args.num_prompts, args.max_new_tokens,
                   args.device, args.dtype, args.cache)
            return 0
        else:
            knobs = dict(kv.split("=", 1) for kv in args.knobs.split())
            rep = report(args.dir, args.out, knobs, args.full_steps, args.budget_steps)
            print_table(rep)
            print(f"wrote {args.out}")
            return 0
    except FledgeError as e:
        print(f"adapt_experiment: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
