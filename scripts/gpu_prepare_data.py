"""Data helpers for scripts/gpu_headline.sh (the headline SmolLM2 drafter on one offline H200).

    firsts PREP_DIR OUT.jsonl.gz     first user turns of a `fledge prep` dir; held-out ones first
    split REGEN.jsonl TRAIN HELDOUT  regenerated conversations -> train / held-out, by source
    regen-stats REGEN.jsonl OUT.json samples, answer tokens, mean length, share cut at max tokens
    tokenize CONV OUT --workers N    fledge.data.build_training_set over N processes
    plan-steps PROBE_METRICS ...     optimizer steps that fit a time budget, from a probe run

Held-out prompts carry source "<source>-heldout" through regen (which keeps `source`), so the
split after regen needs no side file, and they go first in the prompt file so a time-bounded
regen always answers them.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import multiprocessing as mp
import os
import random
import resource
import shutil
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from fledge.util import FledgeError, atomic_write_bytes, atomic_write_json, read_jsonl

HELDOUT_SUFFIX = "-heldout"


def first_turn(messages: list[dict]) -> list[dict]:
    """Messages up to and including the first user turn (a leading system prompt stays)."""
    k = next(i for i, m in enumerate(messages) if m["role"] == "user")
    return messages[:k + 1]


def write_firsts(prep_dir: Path, out: Path, seed: int = 0) -> dict:
    train = [r for _, r in read_jsonl(prep_dir / "train.jsonl")]
    held = [r for _, r in read_jsonl(prep_dir / "heldout.jsonl")]
    random.Random(seed).shuffle(train)  # a time-cut regen then answers a random sample, not a prefix
    rows = [{**r, "source": r["source"] + HELDOUT_SUFFIX, "messages": first_turn(r["messages"])} for r in held]
    rows += [{**r, "messages": first_turn(r["messages"])} for r in train]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    atomic_write_bytes(out, gzip.compress(text.encode(), mtime=0))
    return {"train": len(train), "heldout": len(held), "bytes": out.stat().st_size}


def split(regen: Path, train: Path, heldout: Path) -> dict:
    parts = {True: [], False: []}
    for _, r in read_jsonl(regen):
        parts[r["source"].endswith(HELDOUT_SUFFIX)].append(json.dumps(r, ensure_ascii=False) + "\n")
    for path, lines in ((train, parts[False]), (heldout, parts[True])):
        atomic_write_bytes(path, "".join(lines).encode())
    return {"train": len(parts[False]), "heldout": len(parts[True])}


def regen_stats(regen: Path, tokenizer_dir: str, previous: Path | None, seconds: float | None) -> dict:
    """Counted from the output file itself: a regen stopped by its time limit writes no summary.
    With the stats from before this call and its wall time, also this call's tokens/s."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    texts, finish = [], Counter()
    for _, r in read_jsonl(regen):
        texts.append(r["messages"][-1]["content"])
        finish[r.get("finish", "stop")] += 1
    lengths = [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]] if texts else []
    n = max(len(lengths), 1)
    stats = {"samples": len(lengths), "answer_tokens": sum(lengths), "mean_answer_tokens": round(sum(lengths) / n, 1),
             "share_truncated": round(finish["length"] / n, 4), "finish": dict(finish)}
    if seconds:
        before = json.loads(previous.read_text()) if previous and previous.exists() else {}
        new = {k: stats[k] - before.get(k, 0) for k in ("samples", "answer_tokens")}
        stats["this_call"] = {**new, "seconds": seconds, "tok_s": round(new["answer_tokens"] / seconds, 1)}
    return stats


# --------------------------------------------------------------------------- tokenization
def _tokenize_shard(tokenizer_dir: str, conv: str, out: str, max_len: int) -> dict:
    from fledge.data import build_training_set, load_tokenizer
    return build_training_set(load_tokenizer(tokenizer_dir), conv, out, max_len)


def tokenize(conv: Path, out: Path, tokenizer_dir: str, max_len: int, workers: int) -> dict:
    """build_training_set on `workers` interleaved shards, concatenated. Each shard resumes on
    its own (build_training_set keeps a .partial); the result is written once, at the end."""
    # split("\n"), not splitlines(): JSON strings may hold U+2028 and other breaks splitlines() cuts at.
    lines = [line + "\n" for line in conv.read_text(encoding="utf-8").split("\n") if line.strip()]
    if not lines:
        raise FledgeError(f"{conv}: no conversations to tokenize")
    workers = max(1, min(workers, len(lines)))
    shard_dir = out.with_name(out.name + ".shards")
    # Shards resume only for the same input split the same way: a finished shard of another
    # split would duplicate some conversations and drop others.
    key = {"input_sha": hashlib.sha256("".join(lines).encode()).hexdigest(), "workers": workers,
           "max_len": max_len, "tokenizer": tokenizer_dir}
    old = shard_dir / "key.json"
    if shard_dir.exists() and (not old.exists() or json.loads(old.read_text()) != key):
        shutil.rmtree(shard_dir)
    shard_dir.mkdir(exist_ok=True)
    atomic_write_json(shard_dir / "key.json", key)
    jobs = []
    for w in range(workers):
        src, dst = shard_dir / f"{w}.jsonl", shard_dir / f"{w}.tok.jsonl"
        if not dst.exists():
            src.write_text("".join(lines[w::workers]), encoding="utf-8")
        jobs.append((tokenizer_dir, str(src), str(dst), max_len))
    t0 = time.time()
    todo = [j for j in jobs if not Path(j[2] + ".stats.json").exists()]
    if todo:  # spawn: each worker loads its own tokenizer, no fork of a used Rust tokenizer
        with mp.get_context("spawn").Pool(len(todo)) as pool:
            for job, stats in zip(todo, pool.starmap(_tokenize_shard, todo)):
                atomic_write_json(job[2] + ".stats.json", stats)
    # Shard order is fine: training shuffles (fledge.train.epoch_batches).
    atomic_write_bytes(out, b"".join(Path(j[2]).read_bytes() for j in jobs))
    stats = Counter()
    for j in jobs:
        stats.update({k: v for k, v in json.loads(Path(j[2] + ".stats.json").read_text()).items()
                      if isinstance(v, int) and k != "max_len"})
    usage = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    n = max(stats["samples"], 1)
    return {**stats, "max_len": max_len, "mean_len": round(stats["tokens"] / n, 1),
            "share_truncated": round((stats["truncated_turns"] + stats["truncated_hard"]) / max(len(lines), 1), 4),
            "workers": workers, "wall_s": round(time.time() - t0, 1),
            "cpu_s": round(sum(u.ru_utime + u.ru_stime for u in usage), 1)}


# --------------------------------------------------------------------------- training budget
def plan_steps(probe_metrics: Path, train_tok: Path, batch: int, seconds: float, epochs: int,
               safety: float) -> dict:
    """Steps = budget x measured target tokens/s / tokens per step, capped at `epochs` passes.
    Throughput is the median over the later half of the probe's windows. On the H200 the first
    ~100 steps ran at a third to a half of the later rate (session 2: 16-38K, then 55-92K
    target tok/s), so a short probe's last window planned half the steps the budget held."""
    rows = [r for _, r in read_jsonl(probe_metrics) if r["kind"] == "train"]
    if not rows:
        raise FledgeError(f"{probe_metrics}: no train records; the probe logged nothing")
    tok_s = statistics.median(r["target_tok_s"] for r in rows[len(rows) // 2:])
    lengths = [len(r["input_ids"]) for _, r in read_jsonl(train_tok)]
    per_step = batch * sum(lengths) / len(lengths)
    per_epoch = len(lengths) // batch
    fit = int(safety * seconds * tok_s / per_step)
    steps = max(1, min(fit, epochs * per_epoch))
    return {"probe": str(probe_metrics), "probe_target_tok_s": round(tok_s), "tokens_per_step": round(per_step), "steps_per_epoch": per_epoch,
            "budget_s": seconds, "safety": safety, "steps_fitting": fit, "max_steps": steps,
            "epochs": round(steps / max(per_epoch, 1), 2), "expected_s": round(steps * per_step / tok_s)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("firsts")
    a.add_argument("prep_dir", type=Path)
    a.add_argument("out", type=Path)
    a = sub.add_parser("split")
    a.add_argument("regen", type=Path)
    a.add_argument("train", type=Path)
    a.add_argument("heldout", type=Path)
    a = sub.add_parser("regen-stats")
    a.add_argument("regen", type=Path)
    a.add_argument("out", type=Path)
    a.add_argument("--tokenizer", required=True)
    a.add_argument("--previous", type=Path, help="stats JSON from before this regen call")
    a.add_argument("--seconds", type=float, help="this regen call's wall time (model load included)")
    a = sub.add_parser("tokenize")
    a.add_argument("conv", type=Path)
    a.add_argument("out", type=Path)
    a.add_argument("--tokenizer", required=True)
    a.add_argument("--max-len", type=int, default=2048)
    a.add_argument("--workers", type=int, default=os.cpu_count())
    a = sub.add_parser("plan-steps")
    a.add_argument("probe_metrics", type=Path)
    a.add_argument("train_tok", type=Path)
    a.add_argument("out", type=Path)
    a.add_argument("--batch", type=int, required=True)
    a.add_argument("--seconds", type=float, required=True)
    a.add_argument("--epochs", type=int, default=3)
    a.add_argument("--safety", type=float, default=0.85, help="share of the budget planned for (eval, saves)")
    args = p.parse_args(argv)
    try:
        if args.cmd == "firsts":
            result = write_firsts(args.prep_dir, args.out)
        elif args.cmd == "split":
            result = split(args.regen, args.train, args.heldout)
        elif args.cmd == "regen-stats":
            result = regen_stats(args.regen, args.tokenizer, args.previous, args.seconds)
            atomic_write_json(args.out, result)
        elif args.cmd == "tokenize":
            result = tokenize(args.conv, args.out, args.tokenizer, args.max_len, args.workers)
            atomic_write_json(str(args.out) + ".stats.json", result)
        else:
            result = plan_steps(args.probe_metrics, args.train_tok, args.batch, args.seconds, args.epochs, args.safety)
            atomic_write_json(args.out, result)
    except FledgeError as e:
        print(f"gpu_prepare_data: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
