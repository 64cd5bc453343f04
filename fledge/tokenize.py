"""`fledge tokenize`: regenerated conversations → training samples (ids + loss mask).

Reads conversations JSONL (plain or .gz; what `fledge regen` writes) and writes, into one
output directory, `train.tok.jsonl` and `heldout.tok.jsonl` — the format `fledge vocab build`,
`fledge train --data/--eval-data` and `fledge adapt` read — and `summary.json`.

The held-out set: every conversation of a `--heldout` file, and every conversation whose
`source` ends in `-heldout` (regen keeps `source`, so prompts marked held-out before regen,
like `sharegpt-heldout` in a shared answer set, need no side file).

Ids and masks come from `fledge.data.build_training_set` (the target's own chat template),
run by worker processes on interleaved shards. Shards resume on their own after a kill; the
output directory appears only when every shard is done.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from fledge.catalog import HELDOUT_SUFFIX
from fledge.util import FledgeError, atomic_dir, atomic_write_json, check_no_overlap

SETS = ("train", "heldout")


def is_heldout(record: dict) -> bool:
    """The held-out convention by source: `<source>-heldout` (e.g. `sharegpt-heldout`)."""
    return str(record.get("source", "")).endswith(HELDOUT_SUFFIX)


def read_lines(path: Path) -> list[tuple[str, dict]]:
    """(line, record) of a conversations JSONL, .gz or plain. Lines are split at "\\n" only:
    JSON strings may hold U+2028 and other breaks that str.splitlines() would cut at."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8", newline="\n") as f:
            text = f.read()
    except (OSError, EOFError) as e:
        raise FledgeError(f"{path}: cannot read ({e})") from None
    rows = []
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise FledgeError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict) or "id" not in rec or "messages" not in rec:
            raise FledgeError(f"{path}:{lineno}: not a conversation (needs `id` and `messages`)")
        rows.append((line + "\n", rec))
    return rows


def split_sets(inputs: list[Path], heldout: list[Path]) -> dict[str, list[str]]:
    """Conversation lines of each set, in input order."""
    sets = {name: [] for name in SETS}
    for path in inputs:
        for line, rec in read_lines(path):
            sets["heldout" if is_heldout(rec) else "train"].append(line)
    for path in heldout:
        sets["heldout"] += [line for line, _ in read_lines(path)]
    return sets


def _quiet_worker() -> None:
    # Each shard's own progress bar would interleave with the others'; the parent draws one.
    os.environ["TQDM_DISABLE"] = "1"


def _tokenize_shard(tokenizer_dir: str, conv: str, out: str, max_len: int) -> dict:
    from fledge.data import build_training_set, load_tokenizer
    return build_training_set(load_tokenizer(tokenizer_dir), conv, out, max_len)


def _plan_shards(sets: dict[str, list[str]], work: Path, key: dict, shards_per_set: int) -> list[dict]:
    """Write each set's shards (lines k, k+n, ...) under `work`, reusing a finished shard only
    when the inputs, the split and the settings are the same: a shard of another split would
    duplicate some conversations and drop others."""
    old = work / "key.json"
    if work.exists() and (not old.exists() or json.loads(old.read_text()) != key):
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    atomic_write_json(old, key)
    shards = []
    for name, lines in sets.items():
        n = max(1, min(shards_per_set, len(lines)))
        for k in range(n):
            src, dst = work / f"{name}.{k}.jsonl", work / f"{name}.{k}.tok.jsonl"
            if not Path(f"{dst}.stats.json").exists():
                src.write_text("".join(lines[k::n]), encoding="utf-8")
            shards.append({"set": name, "src": src, "dst": dst, "size": len(lines[k::n])})
    return shards


def _run_shards(shards: list[dict], tokenizer_dir: str, max_len: int, workers: int) -> None:
    todo = [s for s in shards if not Path(f"{s['dst']}.stats.json").exists()]
    # One process: build_training_set's own bar shows; workers: theirs are off, this one shows.
    bar = tqdm(total=sum(s["size"] for s in shards), initial=sum(s["size"] for s in shards if s not in todo),
               desc="tokenize", unit="conv", disable=workers == 1)

    def done(shard, stats):
        atomic_write_json(f"{shard['dst']}.stats.json", stats)
        bar.update(shard["size"])

    with bar:
        if workers == 1:  # no process start-up for a small job
            for s in todo:
                done(s, _tokenize_shard(tokenizer_dir, str(s["src"]), str(s["dst"]), max_len))
            return
        # spawn: each worker loads its own tokenizer, no fork of a used Rust tokenizer
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_quiet_worker) as pool:
            futures = {pool.submit(_tokenize_shard, tokenizer_dir, str(s["src"]), str(s["dst"]), max_len): s
                       for s in todo}
            for f in concurrent.futures.as_completed(futures):
                done(futures[f], f.result())


def _merge_stats(parts: list[dict], max_len: int) -> dict:
    """One set's stats from its shards' (build_training_set's keys)."""
    total = Counter()
    for p in parts:
        total.update({k: v for k, v in p.items() if isinstance(v, int) and k != "max_len"})
    n = max(total["samples"], 1)
    return {**total, "max_len": max_len, "mean_len": round(total["tokens"] / n, 1),
            "share_truncated": round((total["truncated_turns"] + total["truncated_hard"])
                                     / max(total["conversations"], 1), 4)}


def tokenize(inputs: list[Path], out: Path, tokenizer: str, max_len: int = 2048, workers: int = 1,
             heldout: list[Path] = (), overwrite: bool = False) -> dict:
    """Tokenize `inputs` (+ `heldout` files) into `out`/{train,heldout}.tok.jsonl; returns the summary."""
    from fledge.data import load_tokenizer
    from fledge.target import resolve_target

    for path in [*inputs, *heldout]:  # --overwrite would delete an input inside the output
        check_no_overlap(out, {"conversations": path})
    if out.exists() and not overwrite:
        raise FledgeError(f"{out}: already exists (pass --overwrite to replace it)")
    if workers < 1:
        raise FledgeError(f"--workers {workers}: must be >= 1")
    sets = split_sets(list(inputs), list(heldout))
    if not any(sets.values()):
        raise FledgeError(f"{', '.join(map(str, inputs))}: no conversations to tokenize")
    tokenizer_dir = tokenizer if Path(tokenizer).is_dir() else str(resolve_target(tokenizer))
    load_tokenizer(tokenizer_dir)  # fail here, once, rather than in every worker
    t0 = time.time()
    key = {"sha256": hashlib.sha256(json.dumps(sets).encode()).hexdigest(), "workers": workers,
           "max_len": max_len, "tokenizer": tokenizer_dir}
    work = out.with_name(f".{out.name}.shards")
    # A few shards per worker, so the progress bar moves and a slow shard does not hold the rest.
    shards = _plan_shards(sets, work, key, shards_per_set=1 if workers == 1 else 4 * workers)
    _run_shards(shards, tokenizer_dir, max_len, workers)
    summary = {"inputs": [str(p) for p in inputs], "heldout_inputs": [str(p) for p in heldout],
               "tokenizer": tokenizer_dir, "workers": workers}
    with atomic_dir(out, overwrite=overwrite) as tmp:
        for name in SETS:
            mine = [s for s in shards if s["set"] == name]
            with open(tmp / f"{name}.tok.jsonl", "wb") as dst:  # shard order is fine: training shuffles
                for s in mine:
                    with open(s["dst"], "rb") as src:
                        shutil.copyfileobj(src, dst)
                dst.flush()
                os.fsync(dst.fileno())
            summary[name] = _merge_stats([json.loads(Path(f"{s['dst']}.stats.json").read_text()) for s in mine],
                                         max_len)
        summary["wall_s"] = round(time.time() - t0, 1)
        atomic_write_json(tmp / "summary.json", summary)
    shutil.rmtree(work)
    return summary


def run_tokenize(args) -> int:
    summary = tokenize([Path(p) for p in args.conversations], Path(args.out), args.tokenizer, args.max_len,
                       args.workers, [Path(p) for p in args.heldout], args.overwrite)
    keys = ("conversations", "samples", "tokens", "trained_tokens", "mean_len", "share_truncated")
    width = max(map(len, keys))
    print(f"{'':{width}}  {'train':>10}  {'heldout':>10}")
    for k in keys:
        print(f"{k:{width}}  {summary['train'].get(k, 0):>10}  {summary['heldout'].get(k, 0):>10}")
    print(f"wrote {args.out}/train.tok.jsonl, heldout.tok.jsonl in {summary['wall_s']} s", file=sys.stderr)
    return 0
