"""Block drafters (DFlash; P-EAGLE, parallel drafting) trained for the target and measured beside
the shipped EAGLE-3 drafter.

    python bench/block_gpu.py --target T --answers A.jsonl.gz [B.jsonl.gz ...] [--prompts mtbench]
        [--methods dflash,peagle] [--workdir runs/block_gpu] [--train-seconds 130]
        [--num-prompts 40 --max-new-tokens 256] [--quick]

Steps, each skipped when its output is already in --workdir (a rerun continues where one stopped):
  tokenize  `fledge tokenize` the answer sets (rows of source `sharegpt-heldout` are held out).
  vocab     `fledge vocab build`, --draft-vocab tokens.
  train     `fledge train --method M --head target` for each of --methods (default dflash) in
            WORKDIR/train_M, --train-seconds of time budget each (the target's loading counts):
            dflash (--ttt-steps masks a block, --draft-layers layers) and peagle (EAGLE-3's layer
            drafting a chain of --peagle-ttt-steps in one forward, train's --ttt-steps). And
            `fledge train` (EAGLE-3) from scratch on the same data for --eagle-steps steps. Every
            run's target tok/s (training throughput) goes in the JSON.
  measure   one process, batch 1, greedy, the target in --dtype: plain decoding, the EAGLE-3
            drafter --eagle at --eagle-shape, then each method's drafter as a chain of each
            --block-steps (dflash) or --peagle-steps (peagle), rows named by method, on the first
            turns of --prompts (built-in name or file, e.g. MT-Bench's question.jsonl) x
            --max-new-tokens; accept length (SGLang's: accepted + 1 per verify step) and by
            position, ms a round, the verify forward alone at each round's size (the rest of a
            round is drafting), decode tok/s, speedups in the same process, and how many prompts'
            outputs equal plain decoding's (all of them in fp32; bf16 may differ at near-ties). A
            drafter that fails is recorded with its error and the next one runs; no row starts
            after --deadline seconds from the start (none with --quick).
Writes bench/results/block_gpu_<machine>[_<variant>].json (`_quick` with --quick) and, when $OUT is set,
$OUT/block_gpu.json, after every measured row; prints a table at the end. --quick: tiny sizes
for a CPU (a few minutes), the pipeline end to end.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

from machine import git_commit, machine_name, result_path, run_logged

from fledge.core.errors import FledgeError
from fledge.core.files import atomic_write_json, atomic_write_text, read_jsonl

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "drafters" / "smollm2-135m"
EVAL_SAMPLES = 32
FULL = {"max_convs": None, "max_len": 1024, "draft_vocab": 16384, "batch_size": 32, "num_prompts": 80,
        "max_new_tokens": 256, "draft_layers": 3, "ttt_steps": 7, "blocks_per_sample": 64, "workers": os.cpu_count(),
        "peagle_ttt_steps": 7}
QUICK = {"max_convs": 24, "max_len": 128, "draft_vocab": 2048, "batch_size": 2, "num_prompts": 2,
         "max_new_tokens": 16, "draft_layers": 1, "ttt_steps": 3, "blocks_per_sample": 8, "workers": 2,
         "peagle_ttt_steps": 3}
METHODS = ("dflash", "peagle")


def run(cmd: list, log: Path) -> float:
    """`cmd` with this checkout's fledge first on the path (`run_logged`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return run_logged(cmd, log, env)


def fledge(*args) -> list:
    return [sys.executable, "-m", "fledge.cli", *args]


def subset(answers: list[str], n: int | None, out: Path) -> Path:
    """The answer sets, or with `n` the first n training and n/8 held-out rows of each (--quick)."""
    if n is None:
        return None
    rows = []
    for path in answers:
        with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
            recs = [json.loads(line) for line in f]
        rows += [r for r in recs if r.get("source") != "sharegpt-heldout"][:n]
        rows += [r for r in recs if r.get("source") == "sharegpt-heldout"][:max(1, n // 8)]
    atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return out


def prepare(args, w: Path) -> None:
    tok = w / "tok"
    if not (tok / "train.tok.jsonl").exists():
        small = subset(args.answers, args.max_convs, w / "subset.jsonl")
        run(fledge("tokenize", *([small] if small else args.answers), "-o", tok, "--tokenizer", args.target,
                   "--max-len", args.max_len, "--workers", args.workers, "--overwrite"), w / "logs" / "tokenize.log")
    if not (tok / "heldout.eval.jsonl").exists():  # the runs' final eval: a few held-out samples
        lines = (tok / "heldout.tok.jsonl").read_text().splitlines(keepends=True)
        atomic_write_text(tok / "heldout.eval.jsonl", "".join(lines[:EVAL_SAMPLES]))
    if not (w / "vocab.safetensors").exists():
        run(fledge("vocab", "build", tok / "train.tok.jsonl", "--size", args.draft_vocab, "--target", args.target,
                   "--heldout", tok / "heldout.tok.jsonl", "-o", w / "vocab.safetensors"), w / "logs" / "vocab.log")


def train_rate(run_dir: Path) -> float | None:
    """Target tok/s of a run's training log lines, weighted by their tokens (warm-up line dropped)."""
    rows = [r for _, r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"][1:]
    secs = sum(r["seconds"] for r in rows)
    return sum(r["target_tokens"] for r in rows) / secs if secs else None


def eval_curve(run_dir: Path) -> list[dict]:
    """The run's held-out evals in order (--eval-every): step, top-1 by slot, replayed accept length."""
    return [{"step": r["step"], "acc": r["acc"], "replay_accept_len": r.get("replay_accept_len")}
            for _, r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "eval"]


def train_commands(args, w: Path) -> dict[str, list]:
    """The `fledge train` command of each run, by method (eagle3 last), each in WORKDIR/train_M."""
    common = ["--data", w / "tok" / "train.tok.jsonl", "--eval-data", w / "tok" / "heldout.eval.jsonl",
              "--target", args.target, "--batch-size", args.batch_size, "--lr", args.lr, "--max-len", args.max_len,
              "--log-every", 5]
    vocab = ["--vocab", w / "vocab.safetensors"]
    budget = ["--max-steps", args.quick_steps] if args.quick else ["--time-budget", args.train_seconds]
    aux = ["--aux-layers", ",".join(map(str, args.aux_layers))] if args.aux_layers else []
    flags = {"dflash": ["--ttt-steps", args.ttt_steps, "--draft-layers", args.draft_layers,
                        "--blocks-per-sample", args.blocks_per_sample, *aux],
             "peagle": ["--ttt-steps", args.peagle_ttt_steps,
                        *(["--draft-layers", args.peagle_layers] if args.peagle_layers else []),
                        *(["--cod", args.peagle_cod] if args.peagle_cod else [])]}
    # a fresh drafter's head is the target's rows of the built vocabulary; a warm start keeps its own
    start = {m: [*vocab, "--head", "target"] for m in args.methods}
    if args.peagle_init and "peagle" in start:
        start["peagle"] = ["--init", args.peagle_init]
    runs = {m: ["--method", m, *flags[m], *start[m], *budget] for m in args.methods}
    if args.eagle_steps:
        runs["eagle3"] = [*vocab, "--ttt-steps", 7, "--max-steps", args.eagle_steps]
    return {m: fledge("train", *common, "--out", w / f"train_{m}", *flags, "--eval-every", args.eval_every,
                      "--save-every", 10 ** 6) for m, flags in runs.items()}


def train(args, w: Path) -> dict:
    out = {}
    for method, cmd in train_commands(args, w).items():
        d = w / f"train_{method}"
        if not (d / "result.json").exists():
            try:
                run(cmd, w / "logs" / f"train_{method}.log")
            except FledgeError:
                if not (d / "checkpoint").exists():
                    raise
                # Behind its plan, the run paused at the budget (checkpoint saved): the same
                # command resumes it for its last steps.
                run(cmd, w / "logs" / f"finish_{method}.log")
        result = json.loads((d / "result.json").read_text())
        out[method] = {"draft": result["draft"], "steps": result["steps"], "target_tok_s": train_rate(d),
                       "eval": result.get("eval"), "curve": eval_curve(d)}
    return out


def measure_rows(args, rig, drafts: dict, prompts, ar: dict, plain: list, save, t0: float) -> list[dict]:
    """One row per drafter and shape, each saved as it comes; a drafter that fails is a row
    with its error (a compiled block drafter that fails is retried eager)."""
    import torch

    from fledge.core.shape import Shape
    from fledge.engine.block import BlockDrafter
    from fledge.engine.parallel import ParallelDrafter
    from fledge.engine.rig import run_shape

    kinds = {"dflash": BlockDrafter, "peagle": ParallelDrafter}
    shapes = [("eagle3", tuple(args.eagle_shape))] + [(m, (k, 1, k + 1)) for m in drafts for k in args.chains[m]]
    rows = []
    for who, shape in shapes:
        row = {"drafter": who, "shape": list(shape)}
        if time.perf_counter() - t0 > args.deadline:
            rows.append(row | {"skipped": f"past the {args.deadline:.0f} s deadline"})
            continue
        tries = [rig.compiled, False] if who != "eagle3" and rig.compiled else [rig.compiled]
        for compiled in tries:
            try:
                d = (rig.drafter(Shape(*shape)) if who == "eagle3"
                     else kinds[who](drafts[who], Shape(*shape), rig.target, compile=compiled))
                outs = []
                with torch.no_grad():
                    stats, tok_s = run_shape(rig, d, prompts, args.max_new_tokens, f"{who} {shape}", outs)
            except Exception as e:  # noqa: BLE001 -- recorded in the row; the other drafters still run
                row["error" if compiled == tries[-1] else "compiled_error"] = f"{type(e).__name__}: {e}"[:2000]
                print(f"{who} {shape} failed ({'compiled' if compiled else 'eager'}): {e}", flush=True)
                continue
            sm = stats.summary()
            row |= {"compiled": compiled, "accept_length": sm["accept_length"],
                    "depth_acceptance": sm["depth_acceptance"], "round_ms": sm["round_ms_per_step"],
                    "tok_s": tok_s, "speedup": tok_s / ar["tok_s"], "verify_steps": sm["verify_steps"],
                    "equal_to_plain": sum(o == p for o, p in zip(outs, plain)), "prompts": len(prompts)}
            row.pop("error", None)
            print(f"{who:<7} {shape!s:<12} accept {sm['accept_length']:.3f}  {sm['round_ms_per_step']:.3f} ms a "
                  f"round  {tok_s:8.1f} tok/s ({tok_s / ar['tok_s']:.2f}x plain)", flush=True)
            break
        rows.append(row)
        eagle = rows[0].get("tok_s")
        for r in rows:
            if eagle and "tok_s" in r:
                r["vs_eagle3"] = r["tok_s"] / eagle
        save(rows)
    return rows


def verify_split(rig, rows: list[dict], context: int) -> dict | None:
    """The verify forward alone at each measured round's size (tokens a round verifies): a
    round's time minus it is drafting and bookkeeping."""
    from fledge.engine.rig import measure_verify_ms

    sizes = sorted({r["shape"][2] for r in rows if "tok_s" in r})
    try:
        return {str(n): ms for n, ms in measure_verify_ms(rig, sizes, context).items()} if sizes else None
    except Exception as e:  # noqa: BLE001 -- a missing split leaves the measured rows intact
        return {"error": f"{type(e).__name__}: {e}"[:2000]}


def measure(args, draft_dirs: dict, save, t0: float) -> dict:
    from fledge.core.devices import pick_dtype
    from fledge.drafter.checkpoint import load_checkpoint
    from fledge.drafter.dflash_checkpoint import load_dflash
    from fledge.engine.rig import engine_path, load_rig, run_ar
    from fledge.perf.bench import load_prompts

    rig = load_rig(args.target, args.eagle, args.device, args.dtype)
    dtype = pick_dtype(args.dtype, rig.device)
    loaders = {"dflash": load_dflash, "peagle": load_checkpoint}
    drafts = {m: loaders[m](d, embed_from=rig.hf).eval().cast(rig.device, dtype) for m, d in draft_dirs.items()}
    prompts = load_prompts(args.prompts, args.num_prompts, rig.tokenizer)
    head = {"machine": machine_name(rig.device), "device": str(rig.device), "dtype": str(dtype).removeprefix("torch."),
            "engine": engine_path(rig), "prompts": f"{shown(args.prompts, Path(args.workdir))} first turns x {len(prompts)}",
            "max_new_tokens": args.max_new_tokens}
    plain = []
    ar = run_ar(rig, prompts, args.max_new_tokens, plain)
    print(f"plain decoding {ar['tok_s']:8.1f} tok/s ({ar['ar_ms']:.3f} ms a token)", flush=True)
    rows = measure_rows(args, rig, drafts, prompts, ar, plain, lambda rows: save(head | {"ar": ar, "rows": rows}), t0)
    context = sum(map(len, prompts)) // len(prompts) + args.max_new_tokens // 2
    late = time.perf_counter() - t0 > args.deadline
    verify = {"skipped": f"past the {args.deadline:.0f} s deadline"} if late else verify_split(rig, rows, context)
    return head | {"ar": ar, "rows": rows, "verify_ms": verify, "verify_context": context}


def print_report(report: dict) -> None:
    from fledge.core.report import print_table

    ar = report["ar"]
    table = [["drafter", "shape", "accept", "ms/round", "verify ms", "tok/s", "x plain", "x eagle3", "= plain",
              "by position"],
             ["plain", "-", "1.000", f"{ar['ar_ms']:.3f}", "-", f"{ar['tok_s']:.1f}", "1.00", "-", "-", "-"]]
    verify = report.get("verify_ms") or {}
    for r in report["rows"]:
        if "tok_s" not in r:
            table.append([r["drafter"], str(tuple(r["shape"])), r.get("skipped") or r.get("error", "")[:60]]
                         + [""] * 7)
            continue
        v = verify.get(str(r["shape"][2]))
        table.append([r["drafter"], str(tuple(r["shape"])), f"{r['accept_length']:.3f}", f"{r['round_ms']:.3f}",
                      f"{v:.3f}" if isinstance(v, float) else "-", f"{r['tok_s']:.1f}", f"{r['speedup']:.2f}",
                      f"{r.get('vs_eagle3', 0):.2f}", f"{r['equal_to_plain']}/{r['prompts']}",
                      " ".join(f"{p:.2f}" for p in r["depth_acceptance"])])
    print_table(table)
    for method, t in report["train"].items():
        rate = t["target_tok_s"]
        print(f"train {method}: {t['steps']} steps, {rate:.0f} target tok/s" if rate else f"train {method}: {t['steps']} steps")


def shown(path, workdir: Path) -> str:
    """A path as the JSON records it: under the work directory as WORKDIR/..., a file elsewhere
    by its name (scratch directories of one machine mean nothing to a reader)."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        try:
            return str(Path("WORKDIR") / p.resolve().relative_to(workdir.resolve()))
        except ValueError:
            return p.name if p.is_file() else str(path)
    return str(path)


def method_list(text: str) -> list[str]:
    methods = list(dict.fromkeys(filter(None, text.split(","))))
    if not methods or set(methods) - set(METHODS):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of {', '.join(METHODS)}")
    return methods


def default_chains(k: int) -> list[int]:
    """A block drafter's chain lengths: the K it was trained for, then 5 and 3 where shorter."""
    return list(dict.fromkeys(n for n in (k, 5, 3) if n <= k))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m", help="the target: built-in name, HF dir or GGUF file")
    p.add_argument("--answers", nargs="+", required=True, help="the target's answer sets (conversations JSONL[.gz])")
    p.add_argument("--prompts", default="mtbench", help="prompt set measured: built-in name or file (MT-Bench's "
                                                         "question.jsonl, conversations JSONL, ...)")
    p.add_argument("--workdir", default="runs/block_gpu")
    p.add_argument("--variant", default="", help="suffix of the result file, one per prompt set measured "
                                                "(e.g. sharegpt_heldout; default: none, MT-Bench)")
    p.add_argument("--eagle", default=str(SHIPPED), help="the EAGLE-3 drafter to measure beside (default: shipped)")
    p.add_argument("--eagle-shape", type=int, nargs=3, default=[5, 4, 16], metavar=("STEPS", "TOPK", "TOKENS"))
    p.add_argument("--methods", type=method_list, default=["dflash"],
                   help=f"block drafters to train and measure, comma-separated: {', '.join(METHODS)} (default dflash)")
    p.add_argument("--block-steps", type=int, nargs="+",
                   help="chain lengths for the DFlash drafter (default: its K masks, then 5 and 3 where shorter)")
    p.add_argument("--peagle-steps", type=int, nargs="+",
                   help="chain lengths for the P-EAGLE drafter (default: the K it was trained for, "
                        "--peagle-ttt-steps, then 5 and 3 where shorter)")
    p.add_argument("--train-seconds", type=float, default=130.0,
                   help="fledge train --time-budget for each block drafter's run")
    p.add_argument("--eagle-steps", type=int, help="EAGLE-3 steps from scratch on the same data, for its training "
                                                   "tok/s (default 20; --quick: --quick-steps; 0: skip)")
    p.add_argument("--deadline", type=float, help="seconds from the start after which no measured row starts (it "
                                                  "is recorded as skipped; default 360, none with --quick)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--aux-layers", type=lambda t: [int(i) for i in t.split(",")],
                   help="dflash: the target layers the drafter reads, canonical ids (default train's: EAGLE-3's three)")
    p.add_argument("--peagle-init", help="peagle: start from this EAGLE-3 drafter (e.g. drafters/smollm2-135m), "
                                         "its vocabulary kept: training adds and teaches the mask slots")
    p.add_argument("--peagle-cod", type=float, help="peagle: train with COD sampling at this ratio (fledge train --cod)")
    p.add_argument("--peagle-layers", type=int, help="peagle: draft layers (default: 1, or --peagle-init's; more "
                                                     "grow the warm start, the new layers adding nothing at first)")
    p.add_argument("--eval-every", type=int, default=10 ** 6,
                   help="training steps between held-out evals in metrics.jsonl (default: only the final one)")
    p.add_argument("--device")
    p.add_argument("--dtype", help="engine dtype for measuring (default: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--quick", action="store_true", help="tiny sizes for a CPU run of the whole pipeline")
    p.add_argument("--quick-steps", type=int, default=6, help="--quick: training steps (no time budget)")
    for k, v in FULL.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, help=f"default {v} (--quick: {QUICK[k]})")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The command line with every size filled in (FULL, or QUICK with --quick) and each
    method's chain lengths in `chains`."""
    args = build_parser().parse_args(argv)
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.eagle_steps is None:
        args.eagle_steps = args.quick_steps if args.quick else 20
    if args.deadline is None:  # bounds a long run's measuring; a check of the pipeline runs whole
        args.deadline = float("inf") if args.quick else 360.0
    args.block_steps = args.block_steps or default_chains(args.ttt_steps)
    args.peagle_steps = args.peagle_steps or default_chains(args.peagle_ttt_steps)
    args.chains = {"dflash": args.block_steps, "peagle": args.peagle_steps}
    return args


def main(argv=None) -> int:
    t0 = time.perf_counter()
    args = parse_args(argv)
    w = Path(args.workdir)
    prepare(args, w)
    trained = train(args, w)
    t1 = time.perf_counter()
    draft_dirs = {m: trained[m]["draft"] for m in args.methods}
    for t in trained.values():
        t["draft"] = shown(t["draft"], w)
    report = {"bench": "block_gpu", "commit": git_commit(), "target": shown(args.target, w),
              "answers": [shown(a, w) for a in args.answers],
              "settings": {k: getattr(args, k) for k in FULL} | {
                  "lr": args.lr, "aux_layers": args.aux_layers, "eval_every": args.eval_every,
                  "peagle_init": args.peagle_init and shown(args.peagle_init, w),
                  "peagle_layers": args.peagle_layers, "peagle_cod": args.peagle_cod,
                  "train_seconds": args.train_seconds, "eagle_steps": args.eagle_steps,
                  "methods": args.methods, "block_steps": args.block_steps, "peagle_steps": args.peagle_steps,
                  "quick": args.quick},
              "train": trained, "prepare_and_train_s": round(t1 - t0, 1), "complete": False}

    def save(part: dict) -> list[Path]:
        report.update(part)
        report["measure_s"] = round(time.perf_counter() - t1, 1)
        variant = "_".join(filter(None, ["quick" if args.quick else "", args.variant]))
        paths = [result_path("block_gpu", report["machine"], variant)]
        if os.environ.get("OUT"):
            paths.append(Path(os.environ["OUT"]) / "block_gpu.json")
        for path in paths:
            atomic_write_json(path, report)
        return paths

    measured = measure(args, draft_dirs, save, t0)
    report["complete"] = True
    for path in save(measured):
        print(f"wrote {path}")
    print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
