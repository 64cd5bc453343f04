"""fledge's EAGLE-3 trainer beside vLLM's speculators trainer (0.9.0): same samples, same draft
vocabulary, same depth, one epoch each, both drafters then measured in fledge's engine.

    python bench/peer_compare.py all --data A.jsonl.gz [B.jsonl.gz ...] [--quick] [--target T]
        [--peer-python PY] [--workdir runs/peer] [--vllm]

Each step is a subcommand (`all` runs them in order; `vllm` only with --vllm) reading and writing
files under --workdir, so a step can be rerun on its own:
  prepare       a subset of --data fixed by file names and ids (`sharegpt` rows train,
                `sharegpt-heldout` rows are held out), tokenized and cut to the samples fledge's
                loader keeps in whole batches: the one file both trainers read; the draft vocab,
                also as the d2t/t2d .npy speculators reads.
  train-fledge  `fledge train`, one epoch, once per --heads recipe (default `fresh`: `fledge`).
  train-peer    speculators' trainer (bench/peer/train.py in --peer-python), one epoch, fledge's
                drafter layer, the target's features from HF in-process; read back by `fledge import`.
  measure       the drafters in fledge's engine, batch 1, greedy: plain decoding and each of
                --shapes on the MT-Bench first turns and the held-out prompts. `--drafters
                NAME=DIR ...` measures any drafters side by side, with no other step run.
  vllm          bench/bench_vllm_accept.py on each drafter (vLLM's CPU build, a chain of 3).
  report        the tables, and bench/results/peer_compare_<machine>.json (`_quick` with --quick).

A trainer's wall time is its whole command (not `fledge import`); its target tok/s counts its
steps after the first --skip-steps (compilation, warm-up), from its own per-step log. Accept
length is SGLang's: (accepted drafts + 1 bonus) per verify step.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from machine import RESULTS, git_commit, machine_name, result_path, run_logged

from fledge.core.config import HEADS, TrainConfig
from fledge.core.errors import FledgeError
from fledge.core.files import atomic_write_json, atomic_write_text, read_jsonl
from fledge.data.tokenize import read_lines

REPO = Path(__file__).resolve().parents[1]
PEER = Path(__file__).resolve().parent / "peer"
SHAPES = ((7, 1, 8), (5, 4, 16), (8, 8, 64))
# Sizes of a full run, and of --quick (minutes on a 2-core CPU); every one has a flag.
FULL = {"max_convs": None, "max_heldout": 479, "draft_vocab": 16384, "ttt_steps": 7, "max_len": 2048,
        "batch_size": 64, "num_prompts": None, "max_new_tokens": 256, "heldout_new_tokens": 128}
QUICK = {"max_convs": 16, "max_heldout": 4, "draft_vocab": 1024, "ttt_steps": 3, "max_len": 192,
         "batch_size": 4, "num_prompts": 1, "max_new_tokens": 8, "heldout_new_tokens": 8}
STEP_DECAY = 0.8  # loss weight of TTT step j is 0.8**j in both (fledge's default; speculators': --ttt-step-loss-decay)
WARMUP = 0.03     # share of steps warming up, both (fledge's default; speculators': --scheduler-warmup-ratio)


@dataclass
class Plan:
    """What both trainers are given; fixed by `prepare`, read by every later step."""

    target: str
    target_dir: str
    data: list[str]
    max_convs: int | None
    max_heldout: int
    draft_vocab: int
    ttt_steps: int
    max_len: int
    batch_size: int
    lr: float
    seed: int
    quick: bool
    hidden_size: int = 0
    aux_layer_ids: list[int] = dataclasses.field(default_factory=list)
    total_seq_len: int = 0          # speculators packs a step's samples into this many tokens
    train_data_ratio: float = 0.0   # puts speculators' validation split exactly on the held-out rows
    samples: dict = dataclasses.field(default_factory=dict)  # tokenize's summary: train / heldout
    available_convs: int = 0        # training conversations in --data (what --max-convs picks from)

    @classmethod
    def load(cls, workdir: Path) -> "Plan":
        path = workdir / "plan.json"
        if not path.is_file():
            raise FledgeError(f"{path}: missing; run `prepare` first")
        return cls(**json.loads(path.read_text()))


def fledge_env() -> dict:
    """The environment for fledge's own commands: this checkout's fledge first on the path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}


def fledge_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "fledge.cli", *map(str, args)]


def pick_subset(files: list[Path], max_convs: int | None, max_heldout: int) -> tuple[list[dict], list[dict], int]:
    """(train, held-out, training rows available): each set ordered by sha256 of "<file
    name>:<id>", so the subset draws from every file and is the same on every machine; the
    first `max_*` of each."""
    rows = {"sharegpt": [], "sharegpt-heldout": []}
    for path in files:
        for _, rec in read_lines(path):
            if rec.get("source") in rows:
                key = hashlib.sha256(f"{path.name}:{rec['id']}".encode()).hexdigest()
                rows[rec["source"]].append((key, {**rec, "id": f"{path.name.split('.')[0]}:{rec['id']}"}))
    train, held = (sorted(rows[s], key=lambda kv: kv[0]) for s in ("sharegpt", "sharegpt-heldout"))
    if not train or not held:
        raise FledgeError(f"{', '.join(map(str, files))}: needs rows with source 'sharegpt' and 'sharegpt-heldout'")
    return [r for _, r in train[:max_convs]], [r for _, r in held[:max_heldout]], len(train)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def write_vocab_npy(vocab: Path, out: Path, size: int) -> tuple[Path, Path]:
    """d2t-<size>.npy and t2d-<size>.npy from fledge's vocab file: speculators reads the same
    convention (target = i + d2t[i]; t2d a bool mask over the target vocab)."""
    import numpy as np
    from safetensors.numpy import load_file

    tensors = load_file(str(vocab))
    d2t, t2d = out / f"d2t-{size}.npy", out / f"t2d-{size}.npy"
    np.save(d2t, tensors["d2t"].astype(np.int64))
    np.save(t2d, tensors["t2d"].astype(bool))
    return d2t, t2d


def write_samples(src: Path, dst: Path, max_len: int, vocab: int, multiple: int = 1) -> dict:
    """The samples of `src` that fledge's loader keeps, the first multiple of `multiple` of them,
    to `dst`: both trainers then read every sample of one file, and with `multiple` = fledge's
    batch, fledge's epoch drops none (it drops a last partial batch; speculators packs them all)."""
    from fledge.train.features import load_samples

    kept = load_samples(src, max_len, vocab)
    used = kept[:len(kept) // multiple * multiple]
    if not used:
        raise FledgeError(f"{src}: {len(kept)} samples, fewer than one batch of {multiple}")
    write_jsonl(dst, [{"id": x.id, "input_ids": x.input_ids.tolist(), "loss_mask": x.loss_mask.int().tolist()}
                      for x in used])
    return {"samples": len(used), "tokens": sum(len(x.input_ids) for x in used),
            "trained_tokens": int(sum(x.loss_mask.sum() for x in used)), "left_out": len(kept) - len(used)}


def prepare(args, w: Path) -> Plan:
    from transformers import AutoConfig

    from fledge.core.conventions import default_aux_layer_ids
    from fledge.core.target import resolve_target

    pick = {k: vars(args)[k] for k in ("max_convs", "max_heldout", "draft_vocab", "ttt_steps", "max_len", "batch_size")}
    target_dir = resolve_target(args.target)
    tcfg = AutoConfig.from_pretrained(target_dir).get_text_config()
    plan = Plan(args.target, str(target_dir), [str(p) for p in args.data], lr=args.lr, seed=args.seed, quick=args.quick,
                hidden_size=tcfg.hidden_size, aux_layer_ids=list(default_aux_layer_ids(tcfg.num_hidden_layers)), **pick)
    for d in ("data", "tok", "vocab", "spec_data"):
        shutil.rmtree(w / d, ignore_errors=True)
    train, held, plan.available_convs = pick_subset([Path(p) for p in args.data], plan.max_convs, plan.max_heldout)
    write_jsonl(w / "data" / "subset.jsonl", train + held)
    first = Path(args.data[0])  # prompts for `measure`: the held-out first turns of one set, in its order
    write_jsonl(w / "data" / "heldout_prompts.jsonl",
                [r for _, r in read_lines(first) if r.get("source") == "sharegpt-heldout"])
    run_logged(fledge_cmd("tokenize", w / "data" / "subset.jsonl", "-o", w / "tok", "--tokenizer", target_dir,
                   "--max-len", plan.max_len, "--workers", args.workers), w / "logs" / "tokenize.log", fledge_env())
    plan.samples = {name: write_samples(w / "tok" / f"{name}.tok.jsonl", w / "tok" / f"{name}.used.jsonl", plan.max_len,
                                        tcfg.vocab_size, plan.batch_size if name == "train" else 1)
                    for name in ("train", "heldout")}
    train_file, held_file = w / "tok" / "train.used.jsonl", w / "tok" / "heldout.used.jsonl"
    run_logged(fledge_cmd("vocab", "build", train_file, "--size", plan.draft_vocab, "--target", target_dir,
                   "--heldout", held_file, "-o", w / "vocab" / "vocab.safetensors"), w / "logs" / "vocab.log", fledge_env())
    write_vocab_npy(w / "vocab" / "vocab.safetensors", w / "vocab", plan.draft_vocab)
    run_logged([args.peer_python, str(PEER / "dataset.py"), str(train_file), str(held_file), str(w / "spec_data")],
        w / "logs" / "dataset.log")
    counts = json.loads((w / "logs" / "dataset.log").read_text().strip().splitlines()[-1])
    if (counts["train"], counts["heldout"]) != (plan.samples["train"]["samples"], plan.samples["heldout"]["samples"]):
        raise FledgeError(f"{w / 'spec_data'}: {counts} rows, not the samples written ({plan.samples})")
    plan.train_data_ratio = counts["train_data_ratio"]
    # As many tokens a step as fledge's batch holds on average, and never fewer than one sample.
    mean = plan.samples["train"]["tokens"] / plan.samples["train"]["samples"]
    plan.total_seq_len = max(plan.max_len, 64 * math.ceil(plan.batch_size * mean / 64))
    atomic_write_json(w / "plan.json", dataclasses.asdict(plan))
    print(f"plan: {plan.samples['train']['samples']} training samples ({plan.samples['train']['tokens']:,} tokens), "
          f"{plan.samples['heldout']['samples']} held out; speculators packs {plan.total_seq_len} tokens a step "
          f"(fledge: {plan.batch_size} samples)")
    return plan


def step_times(steps: list[tuple[float, float]], skip: int, wall: float) -> dict:
    """From per-step (tokens, seconds): target tokens/s with the first `skip` steps left out
    (fewer if the run is that short), and the seconds of the command that were not training
    steps (start-up, loading, the held-out evaluation, saving)."""
    kept = steps[min(skip, max(len(steps) - 1, 0)):]
    tokens, seconds = sum(t for t, _ in kept), sum(s for _, s in kept)
    return {"steps_timed": len(kept), "target_tok_s": tokens / seconds if seconds else float("nan"),
            "steps_s": sum(s for _, s in steps), "outside_steps_s": wall - sum(s for _, s in steps)}


def train_fledge(args, plan: Plan, w: Path) -> None:
    never = 10 ** 9  # eval and save only at the end (every run evaluates and saves its last step)
    for head in args.heads:
        name = "fledge" if head == "fresh" else f"fledge-{head}-head"
        out = w / name
        shutil.rmtree(out, ignore_errors=True)  # a fresh run: `fledge train` would resume a checkpoint
        cmd = fledge_cmd("train", "--data", w / "tok" / "train.used.jsonl",
                         "--eval-data", w / "tok" / "heldout.used.jsonl", "--vocab", w / "vocab" / "vocab.safetensors",
                         "--target", plan.target_dir, "--out", out, "--epochs", 1, "--batch-size", plan.batch_size,
                         "--ttt-steps", plan.ttt_steps, "--step-decay", STEP_DECAY, "--warmup", WARMUP,
                         "--max-len", plan.max_len, "--lr", plan.lr, "--seed", plan.seed, "--log-every", 1,
                         "--eval-every", never, "--save-every", never,
                         "--head", head, *(["--device", args.device] if args.device else []))
        wall = run_logged(cmd, w / "logs" / f"train-{name}.log", fledge_env())
        recs = [r for _, r in read_jsonl(out / "metrics.jsonl")]
        steps = [(r["target_tokens"], r["seconds"]) for r in recs if r["kind"] == "train"]
        ev = [r for r in recs if r["kind"] == "eval"][-1]
        res = {"trainer": "fledge", "name": name, "head": head, "wall_s": wall, "steps": len(steps),
               "target_tokens": sum(t for t, _ in steps), **step_times(steps, args.skip_steps, wall),
               "drafter": str(out / "draft"),
               "heldout": {"acc": ev["acc"], "loss": ev["loss"], "accept_len_simulated": ev["accept_len"],
                           "replay_accept_len": ev.get("replay_accept_len")},
               "command": cmd}
        atomic_write_json(w / f"train-{name}.json", res)


def trained(w: Path) -> dict[str, dict]:
    """Every drafter trained in `w`, by name: fledge's recipes first, then speculators'."""
    runs = [json.loads(p.read_text()) for p in sorted(w.glob("train-*.json"))]
    return {r["name"]: r for r in sorted(runs, key=lambda r: (r["trainer"] != "fledge", r["name"] != "fledge", r["name"]))}


def peer_flags(plan: Plan, w: Path, workers: int, accelerator: bool) -> list[str]:
    """speculators' flags for a drafter fledge's layer can be, and fledge's recipe where it has a
    flag for it (the rest is in DIFFERENCES)."""
    v = plan.draft_vocab
    flags = ["--verifier-name-or-path", plan.target_dir, "--data-path", w / "spec_data",
             "--save-path", w / "peer" / "checkpoints", "--log-dir", w / "peer" / "logs",
             "--hidden-states-backend", "hf", "--draft-vocab-size", v,
             "--d2t-path", w / "vocab" / f"d2t-{v}.npy", "--t2d-path", w / "vocab" / f"t2d-{v}.npy",
             "--target-layer-ids", *plan.aux_layer_ids,
             "--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output", "--full-attention-indices", 0,
             "--ttt-steps", plan.ttt_steps, "--ttt-step-loss-decay", STEP_DECAY,
             "--optimizer", "adamw", "--lr", plan.lr, "--weight-decay", TrainConfig.weight_decay,
             "--scheduler-type", "cosine", "--scheduler-warmup-ratio", WARMUP,
             "--epochs", 1, "--total-seq-len", plan.total_seq_len, "--train-data-ratio", plan.train_data_ratio,
             "--num-workers", workers, "--seed", plan.seed, "--log-freq", 1, "--no-resume-from-checkpoint",
             # its fused (Triton) loss fails under torch.compile with torch 2.11 (dynamo: "ListVariable
             # ... already tracked for mutation"); the eager loss computes the same KL divergence
             "--loss-implementation", "eager"]
    if not accelerator:  # flex attention and bf16 autocast need one
        flags += ["--draft-attn-impl", "sdpa", "--hidden-states-dtype", "float32"]
    return [str(f) for f in flags]


def train_peer(args, plan: Plan, w: Path) -> None:
    out = w / "peer"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    metrics = out / "metrics.jsonl"
    cmd = [args.peer_python, str(PEER / "train.py"), "--metrics", str(metrics),
           *peer_flags(plan, w, args.peer_workers, torch.cuda.is_available())]
    wall = run_logged(cmd, w / "logs" / "train-peer.log")
    recs = [r for _, r in read_jsonl(metrics)]
    steps = [(r["profile"]["tokens_per_s"] * r["profile"]["step_ms"] / 1e3, r["profile"]["step_ms"] / 1e3)
             for r in recs if "train" in r]
    val = [r["val"] for r in recs if "val" in r][-1]
    k = plan.ttt_steps
    cond = [val[f"cond_acc_{j}_epoch"] for j in range(k)]
    draft = out / "draft"
    run_logged(fledge_cmd("import", out / "checkpoints" / "0", draft, "--target", plan.target_dir),
        w / "logs" / "import-peer.log", fledge_env())
    res = {"trainer": "speculators", "name": "speculators", "wall_s": wall, "steps": len(steps), "target_tokens": round(sum(t for t, _ in steps)),
           **step_times(steps, args.skip_steps, wall), "drafter": str(draft),
           "heldout": {"acc": [val[f"full_acc_{j}_epoch"] for j in range(k)], "cond_acc": cond,
                       "loss": [val[f"loss_{j}_epoch"] for j in range(k)],
                       "accept_len_simulated": 1 + sum(math.prod(cond[:j + 1]) for j in range(k))},
           "command": cmd}
    atomic_write_json(w / "train-speculators.json", res)


def measure(args, plan: Plan | None, w: Path) -> None:
    """Every drafter in --drafters (default: all trained here) at every --shapes, shape by shape,
    on both prompt sets, against the engine's plain decoding in the same process. measure.json
    is rewritten after each row, so a run cut short keeps the rows it finished."""
    from fledge.core.devices import pick_dtype
    from fledge.core.shape import Shape
    from fledge.drafter.checkpoint import load_checkpoint
    from fledge.engine.rig import engine_path, load_rig, run_ar, run_shape
    from fledge.perf.bench import load_prompts

    dirs = drafter_dirs(args.drafters, w)
    names = list(dirs)
    rig = load_rig(plan.target_dir if plan else args.target, dirs[names[0]], args.device, args.dtype)
    dtype = pick_dtype(args.dtype, rig.device)
    rigs = {n: dataclasses.replace(rig, draft=load_checkpoint(d, embed_from=rig.hf).eval().cast(rig.device, dtype))
            for n, d in dirs.items()}
    heldout = args.heldout_prompts or str(w / "data" / "heldout_prompts.jsonl")
    sets = {"mtbench": ("mtbench", args.num_prompts, args.max_new_tokens),
            "heldout": (heldout, args.num_prompts, args.heldout_new_tokens)}
    sets = {name: sets[name] for name in args.sets}
    out = {"machine": machine_name(rig.device), "device": str(rig.device), "dtype": str(dtype).removeprefix("torch."),
           "engine": engine_path(rig), "drafters": names, "sets": {}}
    prompts = {}
    for name, (source, n, m) in sets.items():
        prompts[name] = load_prompts(source, n or 10 ** 9, rig.tokenizer)
        out["sets"][name] = {"prompts": len(prompts[name]), "max_new_tokens": m,
                             "ar": run_ar(rig, prompts[name], m), "rows": []}
        print(f"{name:<8} plain decoding  {out['sets'][name]['ar']['tok_s']:8.1f} tok/s", flush=True)
    for shape in args.shapes:
        for who in names:
            for name, s in out["sets"].items():
                r = rigs[who]
                stats, tok_s = run_shape(r, r.drafter(Shape(*shape)), prompts[name], s["max_new_tokens"],
                                         f"{name} {who} {shape}")
                sm = stats.summary()
                s["rows"].append({"drafter": who, "shape": list(shape), "accept_length": sm["accept_length"],
                                  "tok_s": tok_s, "speedup": tok_s / s["ar"]["tok_s"],
                                  "depth_acceptance": sm["depth_acceptance"], "verify_steps": sm["verify_steps"],
                                  "generated_tokens": sm["generated_tokens"],
                                  "ended_outside_vocab": sm["ended_outside_vocab"]})
                print(f"{name:<8} {who:<20} {str(shape):<12} accept {sm['accept_length']:.3f}  {tok_s:8.1f} tok/s "
                      f"({tok_s / s['ar']['tok_s']:.2f}x plain)", flush=True)
                atomic_write_json(args.out or w / "measure.json", out)


def drafter_dirs(drafters: list[str] | None, w: Path) -> dict[str, str]:
    """--drafters as name -> checkpoint directory: NAME=DIR as given, a bare NAME trained in `w`
    (default: every drafter trained there)."""
    runs = trained(w)
    dirs = {}
    for d in drafters or list(runs):
        name, _, path = d.partition("=")
        if not path and name not in runs:
            raise FledgeError(f"--drafters {name}: not trained in {w} (trained: {', '.join(runs) or 'none'}); "
                              "NAME=DIR measures any drafter directory")
        dirs[name] = path or runs[name]["drafter"]
    if not dirs:
        raise FledgeError(f"measure: no drafter trained in {w}; pass --drafters NAME=DIR ...")
    return dirs


def vllm(args, plan: Plan, w: Path) -> None:
    """bench/bench_vllm_accept.py on each drafter: vLLM's CPU build against fledge's engine."""
    out = {}
    for who, r in trained(w).items():
        d = r["drafter"]
        res = w / f"vllm-{who}.json"
        run_logged([sys.executable, str(REPO / "bench" / "bench_vllm_accept.py"), "--drafter", str(d), "--target",
             plan.target_dir, "--num-prompts", str(args.num_prompts or 80), "--max-tokens", str(args.max_new_tokens),
             "--k", "3", "--out", str(res)], w / "logs" / f"vllm-{who}.log", fledge_env())
        r = json.loads(res.read_text())
        out[who] = {"vllm_accept_length": r["vllm"]["accept_length"], "engine_accept_length": r["fledge"]["accept_length"],
                    "identical_outputs": r["identical_outputs"], "prompts": r["prompts"], "k": r["k"]}
    atomic_write_json(w / "vllm.json", out)


# What differs between the two runs beyond the flags they share; the values are each trainer's
# own (fledge's from TrainConfig, speculators' fixed in its code).
DIFFERENCES = [
    f"gradient clip: fledge {TrainConfig.clip} (--clip), speculators 1.0 (fixed in its trainer)",
    "AdamW betas: fledge (0.9, 0.95), speculators (0.9, 0.999) (torch's default; no flag)",
    "batches: fledge --batch-size padded sequences of similar length; speculators packs whole samples "
    "into --total-seq-len tokens with per-document attention, padding the rest",
    "LR schedule: both linear warm-up over 3% of the steps, then cosine to 0; speculators' warm-up starts at 0, "
    "fledge's at 1/warm-up steps",
    "LM head: fledge's default trains a fresh head (`fledge` rows; `--head target` / `--head frozen` rows start "
    "from the target's head rows for the draft vocab); speculators copies those rows and freezes them",
    "loss: fledge soft cross-entropy against the target's draft-vocab distribution, speculators KL "
    "divergence (the same gradient: they differ by the target's entropy)",
    "features: fledge runs the target in its own compact engine, batched; speculators here runs it with HF "
    "transformers per sample in its data loader (its own route is vLLM's extraction or files)",
    "held-out metrics: fledge's acc = top-1 hit of the target's full-vocab argmax, its simulated accept length "
    "multiplies per-step accuracies; speculators' full_acc compares argmaxes within the draft vocab, its "
    "cond_acc is conditioned on earlier steps right (accept_len_simulated here = 1 + sum of their running products)",
]


def feature_bytes(plan: Plan) -> dict:
    """Bytes of target features a token needs when stored (offline training), bf16 as each
    writes them: fledge's shards aux [T, 3H] + final normed state [T, H]; speculators' (vLLM's
    extraction) [T, len(aux)+1, H]. fledge trains online without them."""
    h, k, bf16 = plan.hidden_size, len(plan.aux_layer_ids), 2
    tokens = plan.samples["train"]["tokens"]
    per = {"fledge": (k + 1) * h * bf16, "speculators": (k + 1) * h * bf16}
    return {"hidden_size": h, "aux_layers": k, "dtype": "bfloat16", "bytes_per_token": per,
            "gib_for_training_set": {w: b * tokens / 2**30 for w, b in per.items()},
            "fledge_online_default": "no features stored: the target runs in each training step"}


def sizing(train: dict, plan: Plan, machine: str, seconds: float) -> dict | None:
    """The target tokens, and --max-convs (not for --quick, whose samples are cut short), that
    the slower trainer's steps get through in `seconds` on one H200. On the CPU this is an
    estimate: profile_train_h200.json's step rate scaled by the speculators/fledge ratio
    measured here (speculators' per-sample HF forwards cost a GPU relatively more)."""
    if not {"fledge", "speculators"} <= train.keys():
        return None
    rates = {who: r["target_tok_s"] for who, r in train.items()}
    out = {"seconds": seconds, "measured_here": dict(rates)}
    if machine == "cpu":
        prof = RESULTS / "profile_train_h200.json"
        if not prof.is_file():
            return None
        h200 = json.loads(prof.read_text())["variants"][-1]["target_tok_s"]
        ratio = rates["speculators"] / rates["fledge"]
        rates = {"fledge": h200, "speculators": h200 * ratio}
        out |= {"basis": f"{prof.name} scaled by the speculators/fledge ratio measured here ({ratio:.3f})"}
    else:
        out["basis"] = f"rates measured on {machine}"
    tokens = seconds * min(rates.values())
    out |= {"h200_target_tok_s": rates, "target_tokens": tokens, "available_convs": plan.available_convs}
    if plan.quick:  # its samples are cut short: their length says nothing of a full run's
        return {**out, "max_convs": None}
    per_conv = plan.samples["train"]["tokens"] / plan.samples["train"]["samples"]
    return {**out, "tokens_per_conversation": per_conv, "max_convs": min(int(tokens / per_conv), plan.available_convs)}


def portable(obj, peer_python: str, workdir: str):
    """`obj` with the measuring machine's paths spelled as on any other: this checkout's
    relative, `$FLEDGE_CACHE/...`, `WORKDIR/...` (the --workdir the steps ran in), a GGUF by its
    file name, `python` and `PEER_PYTHON` for the two interpreters."""
    from fledge.core.files import cache_dir

    if isinstance(obj, dict):
        return {k: portable(v, peer_python, workdir) for k, v in obj.items()}
    if isinstance(obj, list):
        return [portable(v, peer_python, workdir) for v in obj]
    if isinstance(obj, str):
        if obj == peer_python and obj != sys.executable:
            return "PEER_PYTHON"
        if obj == sys.executable or Path(obj).name.startswith("python") and os.sep in obj:
            return "python"
        if obj.endswith(".gguf"):
            return Path(obj).name
        return obj.replace(workdir, "WORKDIR").replace(f"{REPO}{os.sep}", "").replace(str(cache_dir()), "$FLEDGE_CACHE")
    return obj


def report(args, plan: Plan, w: Path) -> None:
    def load(name):
        p = w / name
        return json.loads(p.read_text()) if p.is_file() else None

    train = trained(w)
    meas, vl = load("measure.json"), load("vllm.json")
    machine = meas["machine"] if meas else machine_name("cuda" if torch.cuda.is_available() else "cpu")
    out = {"machine": machine, "commit": args.commit or git_commit(), "quick": plan.quick, "plan": dataclasses.asdict(plan), "training": train,
           "measure": meas, "vllm": vl, "feature_bytes": feature_bytes(plan), "differences": DIFFERENCES,
           "sizing": sizing(train, plan, machine, args.train_seconds),
           "accept_length_definition": "SGLang: (accepted draft tokens + 1 bonus) per verify step"}
    print(f"\n{plan.samples['train']['samples']} training samples, {plan.samples['heldout']['samples']} held out; "
          f"draft vocab {plan.draft_vocab}, TTT {plan.ttt_steps}, lr {plan.lr}; machine {machine}")
    print(f"{'drafter':<20}{'steps':>7}{'target tok':>12}{'wall s':>9}{'tok/s':>10}{'acc0':>7}{'sim. accept':>12}")
    for r in train.values():
        print(f"{r['name']:<20}{r['steps']:>7}{r['target_tokens']:>12,}{r['wall_s']:>9.1f}{r['target_tok_s']:>10.0f}"
              f"{r['heldout']['acc'][0]:>7.3f}{r['heldout']['accept_len_simulated']:>12.3f}")
    if meas:
        print(f"\nengine, {meas['device']} {meas['dtype']} (accept length SGLang's)")
        print(f"{'prompts':<26}{'shape':<12}{'drafter':<20}{'accept':>8}{'tok/s':>9}{'x plain':>8}")
        for name, s in meas["sets"].items():
            print(f"{name + ' ' + str(s['prompts']) + ' x ' + str(s['max_new_tokens']):<26}{'plain':<12}{'':<20}"
                  f"{'':>8}{s['ar']['tok_s']:>9.1f}")
            for r in s["rows"]:
                print(f"{'':<26}{str(tuple(r['shape'])):<12}{r['drafter']:<20}{r['accept_length']:>8.3f}"
                      f"{r['tok_s']:>9.1f}{r['speedup']:>8.2f}")
    if vl:
        for who, r in vl.items():
            print(f"vLLM chain {r['k']}, {who}: accept {r['vllm_accept_length']:.3f} (engine {r['engine_accept_length']:.3f}), "
                  f"identical outputs {r['identical_outputs']}/{r['prompts']}")
    fb = out["feature_bytes"]
    print(f"\nstored features a token (bf16): fledge {fb['bytes_per_token']['fledge']} B, "
          f"speculators {fb['bytes_per_token']['speculators']} B; fledge trains online by default")
    if out["sizing"]:
        s = out["sizing"]
        convs = f" = --max-convs {s['max_convs']}" if s["max_convs"] else ""
        print(f"one H200 ({s['basis']}): fledge {s['h200_target_tok_s']['fledge']:,.0f}, speculators "
              f"{s['h200_target_tok_s']['speculators']:,.0f} target tok/s: {s['seconds']:.0f} s of the slower "
              f"trainer's steps hold {s['target_tokens']:,.0f} target tokens{convs}")
    path = result_path("peer_compare", machine, "quick" if plan.quick else "")
    out["plan"]["data"] = [Path(p).name for p in plan.data]  # where the files lie is this machine's business
    ran_in = str(Path(train["fledge"]["drafter"]).parents[1]) if "fledge" in train else str(w)  # where training ran
    atomic_write_json(path, portable(out, args.peer_python, ran_in))
    print(f"wrote {path}")


def shape_arg(text: str) -> tuple[int, int, int]:
    try:
        s, k, n = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected STEPS,TOPK,TOKENS, e.g. 5,4,16") from None
    return s, k, n


def sized(group, flags) -> None:
    """Integer flags whose default is FULL's or QUICK's size (applied in main)."""
    for name, what in flags:
        key = name.replace("-", "_")
        group.add_argument(f"--{name}", type=int, help=f"{what} (default full {FULL[key] or 'all'}, quick {QUICK[key]})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=["prepare", "train-fledge", "train-peer", "measure", "vllm", "report", "all"])
    p.add_argument("--workdir", default=str(REPO / "runs" / "peer"), help="where every step reads and writes")
    p.add_argument("--quick", action="store_true", help="tiny sizes: the whole comparison in minutes on a CPU")
    g = p.add_argument_group("prepare (fixed for the later steps in plan.json)")
    g.add_argument("--data", nargs="+", help="conversation files (.jsonl or .jsonl.gz), e.g. fledge regen's output")
    g.add_argument("--target", default="smollm2-135m", help="built-in name, GGUF file or HF directory")
    sized(g, (("max-convs", "training conversations"), ("max-heldout", "held-out conversations"),
              ("draft-vocab", "draft vocabulary size"), ("ttt-steps", "training-time-test depth"),
              ("max-len", "tokens a sample is cut to"), ("batch-size", "fledge's sequences a step")))
    g.add_argument("--lr", type=float, default=5e-4, help="peak learning rate, both trainers (the shipped drafter's)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenize processes")
    t = p.add_argument_group("training")
    t.add_argument("--heads", nargs="+", choices=HEADS, default=["fresh"],
                   help="train-fledge: one fledge drafter per head recipe (fledge train --head)")
    t.add_argument("--peer-python", default=sys.executable,
                   help="the python that imports speculators 0.9.0 (default: this one)")
    t.add_argument("--peer-workers", type=int, default=0, help="speculators' data loader workers (each loads the target)")
    t.add_argument("--skip-steps", type=int, default=2, help="first steps left out of each trainer's tok/s")
    t.add_argument("--train-seconds", type=float, default=240.0,
                   help="report: size --max-convs for this many seconds of the slower trainer's steps on an H200")
    t.add_argument("--device", help="fledge's device (default cuda if available); speculators takes the accelerator")
    m = p.add_argument_group("measure, vllm")
    sized(m, (("num-prompts", "prompts a set"), ("max-new-tokens", "a MT-Bench answer's tokens"),
              ("heldout-new-tokens", "a held-out answer's tokens")))
    m.add_argument("--drafters", nargs="+", help="measure, vllm: which trained drafters (default: all); measure "
                                                 "also takes NAME=DIR, any drafter directory (no `prepare` needed)")
    m.add_argument("--heldout-prompts", help="measure: held-out conversations (default: prepare's)")
    m.add_argument("--sets", nargs="+", choices=["mtbench", "heldout"], default=["mtbench", "heldout"],
                   help="measure: the prompt sets, in order (default both)")
    m.add_argument("--out", type=Path, help="measure: where measure.json goes (default: in --workdir)")
    m.add_argument("--shapes", nargs="+", type=shape_arg, default=list(SHAPES),
                   help="measure: (steps,topk,tokens) as S,K,N, in order (default 7,1,8 5,4,16 8,8,64)")
    m.add_argument("--dtype", help="engine dtype (default bfloat16 on cuda, float32 on cpu)")
    m.add_argument("--vllm", action="store_true", help="`all` also runs the vllm step")
    p.add_argument("--commit", help="report: the commit the figures were measured at (default: this checkout's)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    vars(args).update({k: v for k, v in (QUICK if args.quick else FULL).items() if vars(args)[k] is None})
    w = Path(args.workdir).resolve()
    w.mkdir(parents=True, exist_ok=True)
    try:
        if args.step in ("prepare", "all"):
            if not args.data:
                raise FledgeError("prepare needs --data FILE ...")
            plan = prepare(args, w)
        elif args.step == "measure" and not (w / "plan.json").is_file():
            plan = None  # drafters given as NAME=DIR, the target as --target
        else:
            plan = Plan.load(w)
        steps = {"train-fledge": train_fledge, "train-peer": train_peer, "measure": measure, "vllm": vllm, "report": report}
        order = [s for s in steps if s != "vllm" or args.vllm] if args.step == "all" else \
            [args.step] if args.step in steps else []
        for s in order:
            steps[s](args, plan, w)
    except FledgeError as e:
        print(f"peer_compare: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
