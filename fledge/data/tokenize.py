"""`fledge tokenize`: regenerated conversations → training samples (ids + loss mask).

Reads conversations JSONL (plain or .gz; what `fledge regen` writes) and writes, into one
output directory, `train.tok.jsonl` and `heldout.tok.jsonl` — the format `fledge vocab build`,
`fledge train --data/--eval-data` and `fledge adapt` read — and `summary.json`.

The held-out set: every conversation of a `--heldout` file, and every conversation whose
`source` ends in `-heldout` (regen keeps `source`, so prompts marked held-out before regen,
like `sharegpt-heldout` in a shared answer set, need no side file).

Ids and masks come from `build_training_set`, run by worker processes on interleaved shards
(`fledge prep --tokenizer` runs it in-process). Shards resume on their own after a kill; the
output directory appears only when every shard is done.

Tokenization takes ids and the loss mask from the target's own chat template, never from a
regex over rendered text. Where the template marks assistant text with `{% generation %}`
the tokenizer's assistant mask is used; otherwise each assistant turn k is located by
rendering messages[:k] with the generation prompt and messages[:k+1], and diffing token ids
(after checking that both are prefixes of the full rendering — templates that rewrite
earlier turns are not prefix-stable, and such conversations are skipped and counted).

Trained tokens: everything the target generates for an assistant turn — from after the
generation prompt up to and including the turn's last special token, its end-of-turn marker
(<|im_end|>, <|eot_id|>, <end_of_turn>, ...). The drafter must predict the stop token or
drafts run past the end of every answer; special tokens the model itself writes before the
content (harmony-style channel headers) are trained too. Template scaffolding after the
marker (ChatML's trailing newline) is not trained: the target never generates it.

Every sample records the tokenizer that made it (`tokenizer_record`: its name and a hash of its
vocabulary and chat template); `vocab build`, `train`, `features` and `adapt` refuse samples
another tokenizer made than their target's (`check_tokenized`).

Truncation to max_len keeps whole leading turns: the sequence is cut after the last
assistant turn that fits. If not even the first assistant turn fits, it is cut at max_len
(the trained tokens kept are still valid next-token targets); if no trained token fits, the
conversation is dropped. Sequences always end with an assistant turn's end-of-turn token:
trailing user turns and scaffolding after the last trained token are not kept.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import jinja2
from tqdm import tqdm

from fledge.core.catalog import HELDOUT_SUFFIX
from fledge.core.conversations import read_conversations
from fledge.core.errors import FledgeError
from fledge.core.files import (
    atomic_dir,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    check_no_overlap,
    keeping,
    read_jsonl,
)
from fledge.core.procs import die_with_parent
from fledge.core.report import print_table

# The two sets of every split: prep writes <set>.jsonl, tokenize and prep --tokenizer <set>.tok.jsonl.
SETS = ("train", "heldout")


# --------------------------------------------------------------------------- one conversation
class NotPrefixStable(Exception):
    """The template renders an earlier turn differently once later turns follow."""


def _end_of_turn_ids(tokenizer) -> set[int]:
    """Special added tokens: a turn's end-of-turn marker is the last of these it renders."""
    return {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}


def _has_generation_block(tokenizer) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and re.search(r"{%-?\s*generation\s*-?%}", template) is not None


def _mask_by_generation(tokenizer, messages, eot: set[int]):
    """The template's assistant mask, extended over an end-of-turn token the template left
    outside its generation block, so both paths train the same tokens."""
    enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
    for i in range(len(ids) - 1):
        if mask[i] and not mask[i + 1] and ids[i] not in eot and ids[i + 1] in eot:
            mask[i + 1] = 1
    ends = [i + 1 for i in range(len(ids)) if mask[i] and (i + 1 == len(ids) or not mask[i + 1])]
    return ids, mask, ends


def _mask_by_prefix(tokenizer, messages, eot: set[int], max_len: int):
    """Render up to each assistant turn with and without it; each rendering must extend the
    previous one token for token, so the ids are the template's own for the whole prefix."""
    from fledge.core.target import (
        encode_chat,  # torch and transformers: only once a tokenizer is at hand
    )

    ids, mask, ends = [], [], []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = encode_chat(tokenizer, messages[:k], add_generation_prompt=True)
        upto = encode_chat(tokenizer, messages[: k + 1], add_generation_prompt=False)
        if before[: len(ids)] != ids or upto[: len(before)] != before:
            raise NotPrefixStable(k)
        stop = max((i + 1 for i in range(len(before), len(upto)) if upto[i] in eot), default=len(upto))
        mask += [0] * (len(before) - len(ids)) + [1] * (stop - len(before)) + [0] * (len(upto) - stop)
        ids = upto
        ends.append(stop)
        if len(upto) > max_len:  # later turns would be cut off anyway
            break
    return ids, mask, ends


def tokenize_with_status(tokenizer, messages, max_len: int) -> tuple[dict | None, str]:
    """({"input_ids", "loss_mask"} or None, status): ok, truncated_turns, truncated_hard,
    too_long, no_assistant, not_prefix_stable or template_error (see the module doc)."""
    if not any(m["role"] == "assistant" for m in messages):
        return None, "no_assistant"
    eot = _end_of_turn_ids(tokenizer)
    try:
        if _has_generation_block(tokenizer):
            ids, mask, ends = _mask_by_generation(tokenizer, messages, eot)
        else:
            ids, mask, ends = _mask_by_prefix(tokenizer, messages, eot, max_len)
    except NotPrefixStable:
        return None, "not_prefix_stable"
    except jinja2.TemplateError:  # e.g. a template that insists roles alternate
        return None, "template_error"
    fitting = [e for e in ends if e <= max_len]
    if fitting:
        cut, status = fitting[-1], "ok" if fitting[-1] == ends[-1] else "truncated_turns"
    elif any(mask[:max_len]):
        cut, status = max_len, "truncated_hard"
    else:
        return None, "too_long"
    return {"input_ids": ids[:cut], "loss_mask": mask[:cut]}, status


# --------------------------------------------------------------------------- which tokenizer
def tokenizer_record(tokenizer) -> str:
    """`name#vocab.template`, what every tokenized record carries: the tokenizer's directory name,
    16 hex digits of a sha256 over its vocabulary (token → id) and 8 over the chat template it
    rendered with. Two tokenizers that give the same ids have the same vocabulary hash, wherever
    they live."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    v = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]
    t = hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest()[:8]
    return f"{Path(str(tokenizer.name_or_path)).name}#{v}.{t}"


def check_tokenized(path, tokenizer, what: str) -> None:
    """Refuse tokenized data (`path`, its first record) whose ids another vocabulary made than
    the target's (`what` names the target), or that another chat template rendered than the
    target's own (a target without one, a base model given `--chat-template`, is not held to
    it). A file tokenized before fledge recorded the tokenizer passes with a warning; a target
    without a tokenizer at hand (an in-memory model) is not checked."""
    if tokenizer is None:
        return
    first = next((r for _, r in read_jsonl(path)), {})
    theirs = first.get("tokenizer") if isinstance(first, dict) else None
    if not isinstance(theirs, str):
        print(f"warning: {path}: records no tokenizer; not checked against {what}'s", file=sys.stderr)
        return
    mine = tokenizer_record(tokenizer)
    (v, _, t), (mv, _, mt) = theirs.split("#")[-1].partition("."), mine.split("#")[-1].partition(".")
    if v != mv or (tokenizer.chat_template and t != mt):
        part = "vocabulary" if v != mv else "chat template"
        raise FledgeError(f"{path}: tokenized with {theirs}, but {what}'s tokenizer is {mine} (another {part}); "
                          f"tokenize again with --tokenizer {what}")


def resolve_tokenizer(spec: str) -> str:
    """A directory holding a tokenizer, as given, or the converted directory of any target spec
    (built-in name, GGUF)."""
    from fledge.core.target import resolve_target

    return spec if Path(spec).is_dir() else str(resolve_target(spec))


def load_tokenizer(spec: str, chat_template: str | None = None, template_needed: bool = True):
    """The tokenizer of a target spec, rendering with `chat_template` (a file or "plain") when
    given, else with its own; one without any is refused when `template_needed`, before a GGUF
    is converted."""
    from transformers import AutoTokenizer

    from fledge.core.target import (
        check_chat_template,
        check_remote_code,
        read_chat_template,
        remote_code_allowed,
    )

    template = read_chat_template(chat_template)
    if template_needed:
        check_chat_template(spec, chat_template)
    path = resolve_tokenizer(spec)
    check_remote_code(Path(path))
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=remote_code_allowed())
    except (OSError, ValueError) as e:
        raise FledgeError(f"{spec}: no tokenizer could be loaded ({str(e).splitlines()[0][:200]})") from None
    if template is not None:
        tok.chat_template = template
    if template_needed and not tok.chat_template:
        raise FledgeError(f"{spec}: the tokenizer has no chat template; pass --chat-template FILE (Jinja), "
                          f"or --chat-template plain for a base model")
    return tok


def build_training_set(tokenizer, conversations_path, out_path, max_len) -> dict:
    """Tokenize a conversations JSONL into a training-set JSONL; returns stats.

    Resumable: progress goes to `<out>.partial` (one line per conversation, dropped ones as
    {"id", "dropped"}); a rerun continues after the last complete line, and the final file
    is written only when every conversation is done.
    """
    out_path = Path(out_path)
    with keeping(out_path, f"the finished part is kept in {out_path.name}.partial: rerun the same command to resume"):
        return _build_training_set(tokenizer, conversations_path, out_path, max_len)


def _build_training_set(tokenizer, conversations_path, out_path: Path, max_len) -> dict:
    partial = out_path.with_name(out_path.name + ".partial")
    done = [rec for _, rec in read_jsonl(partial, on_bad=lambda *_: None)] if partial.exists() else []
    # rewrite without a torn last line before appending to it
    atomic_write_text(partial, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in done))
    done_ids = {r["id"] for r in done}
    convs = [rec for _, rec in read_jsonl(conversations_path)]
    todo = [c for c in convs if c["id"] not in done_ids]
    with open(partial, "a", encoding="utf-8") as f:
        for conv in tqdm(todo, desc=f"tokenize {Path(conversations_path).name}", unit="conv"):
            rec, status = tokenize_with_status(tokenizer, conv["messages"], max_len)
            line = {"id": conv["id"], **rec} if rec else {"id": conv["id"], "dropped": status}
            if status.startswith("truncated"):
                line["truncated"] = status
            f.write(json.dumps(line, ensure_ascii=False) + "\n")  # no fsync per line: a torn tail is redone
    stats, sizes = Counter(conversations=len(convs)), Counter(samples=0, tokens=0, trained_tokens=0)
    made_by = tokenizer_record(tokenizer)

    def samples():
        for _, r in read_jsonl(partial):
            stats[r.get("dropped") or r.get("truncated") or "ok"] += 1
            if "dropped" not in r:
                sizes.update(samples=1, tokens=len(r["input_ids"]), trained_tokens=sum(r["loss_mask"]))
                yield (json.dumps({"id": r["id"], "input_ids": r["input_ids"], "loss_mask": r["loss_mask"],
                                   "tokenizer": made_by}) + "\n").encode()

    atomic_write_bytes(out_path, samples())
    partial.unlink()
    stats.update(sizes)
    return _merge_stats([stats], max_len)


def render_sample(tokenizer, record: dict, color: bool) -> str:
    """The sample's text with trained tokens highlighted (ANSI green) or marked [[...]]."""
    parts = []
    for trained, run in itertools.groupby(zip(record["input_ids"], record["loss_mask"]), key=lambda p: p[1]):
        text = tokenizer.decode([t for t, _ in run], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        parts.append((f"\033[42;30m{text}\033[0m" if color else f"[[{text}]]") if trained else text)
    return "".join(parts)


# --------------------------------------------------------------------------- conversation files
def is_heldout(record: dict) -> bool:
    """The held-out convention by source: `<source>-heldout` (e.g. `sharegpt-heldout`)."""
    return str(record.get("source", "")).endswith(HELDOUT_SUFFIX)


def read_lines(path: Path) -> list[tuple[str, dict]]:
    """(line, record) of a conversations file, each record checked."""
    return [(json.dumps(rec, ensure_ascii=False) + "\n", rec) for rec in read_conversations(path)]


def split_sets(inputs: list[Path], heldout: list[Path]) -> dict[str, list[str]]:
    """Conversation lines of each set, in input order."""
    sets = {name: [] for name in SETS}
    for path in inputs:
        for line, rec in read_lines(path):
            sets["heldout" if is_heldout(rec) else "train"].append(line)
    for path in heldout:
        sets["heldout"] += [line for line, _ in read_lines(path)]
    return sets


def _start_worker(parent_pid: int) -> None:
    die_with_parent(parent_pid)  # a worker outliving a killed run would write beside its rerun
    # Each shard's own progress bar would interleave with the others'; the parent draws one.
    os.environ["TQDM_DISABLE"] = "1"


def _tokenize_shard(tokenizer_dir: str, conv: str, out: str, max_len: int, chat_template: str | None) -> dict:
    return build_training_set(load_tokenizer(tokenizer_dir, chat_template), conv, out, max_len)


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


def _run_shards(shards: list[dict], tokenizer_dir: str, max_len: int, workers: int, chat_template: str | None) -> None:
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
                done(s, _tokenize_shard(tokenizer_dir, str(s["src"]), str(s["dst"]), max_len, chat_template))
            return
        # fork: this process has imported transformers already (~10 s a spawned worker would
        # pay again). Each worker still loads its own tokenizer, and the Rust library turns its
        # thread pool off in a forked child, so nothing of ours is shared across the fork.
        ctx = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_start_worker,
                                                    initargs=(os.getpid(),)) as pool:
            futures = {pool.submit(_tokenize_shard, tokenizer_dir, str(s["src"]), str(s["dst"]), max_len, chat_template): s
                       for s in todo}
            for f in concurrent.futures.as_completed(futures):
                done(futures[f], f.result())


def _merge_stats(parts: list[dict], max_len: int) -> dict:
    """One set's stats from its shards' counts: sums, and the mean length and truncated share."""
    total = Counter()
    for p in parts:
        total.update({k: v for k, v in p.items() if isinstance(v, int) and k != "max_len"})
    n = max(total["samples"], 1)
    return {**total, "max_len": max_len, "mean_len": round(total["tokens"] / n, 1),
            "share_truncated": round((total["truncated_turns"] + total["truncated_hard"])
                                     / max(total["conversations"], 1), 4)}


def tokenize(inputs: list[Path], out: Path, tokenizer: str, max_len: int = 2048, workers: int = 1,
             heldout: list[Path] = (), overwrite: bool = False, chat_template: str | None = None) -> dict:
    """Tokenize `inputs` (+ `heldout` files) into `out`/{train,heldout}.tok.jsonl; returns the summary."""
    for path in [*inputs, *heldout]:  # --overwrite would delete an input inside the output
        check_no_overlap(out, {"conversations": path})
    if workers < 1:
        raise FledgeError(f"--workers {workers}: must be >= 1")
    kept = f"the finished shards are kept in {out.with_name(f'.{out.name}.shards')}: rerun the same command to resume"
    with keeping(out, kept, own_name=True), atomic_dir(out, overwrite=overwrite) as tmp:
        sets = split_sets(list(inputs), list(heldout))
        if not any(sets.values()):
            raise FledgeError(f"{', '.join(map(str, inputs))}: no conversations to tokenize")
        made_by = tokenizer_record(load_tokenizer(tokenizer, chat_template))  # fail here, once, not in every worker
        tokenizer_dir = resolve_tokenizer(tokenizer)
        t0 = time.time()
        key = {"sha256": hashlib.sha256(json.dumps(sets).encode()).hexdigest(), "workers": workers,
               "max_len": max_len, "tokenizer": made_by}
        work = out.with_name(f".{out.name}.shards")
        # A few shards per worker, so the progress bar moves and a slow shard does not hold the rest.
        shards = _plan_shards(sets, work, key, shards_per_set=1 if workers == 1 else 4 * workers)
        _run_shards(shards, tokenizer_dir, max_len, workers, chat_template)
        summary = {"inputs": [str(p) for p in inputs], "heldout_inputs": [str(p) for p in heldout],
                   "tokenizer": tokenizer_dir, "tokenizer_record": made_by,
                   "workers": workers}
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
                       args.workers, [Path(p) for p in args.heldout], args.overwrite, args.chat_template)
    keys = ("conversations", "samples", "tokens", "trained_tokens", "mean_len", "share_truncated")
    print_table([["", *SETS], *([k, *(summary[name].get(k, 0) for name in SETS)] for k in keys)])
    print(f"wrote {args.out}/train.tok.jsonl, heldout.tok.jsonl in {summary['wall_s']} s", file=sys.stderr)
    return 0
