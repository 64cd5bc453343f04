"""`fledge prompts`: the target writes user prompts itself (Magpie: Xu et al., 2024).

An instruction-tuned model given its chat template only up to where a user's text begins
writes a user message: the kinds of requests it was tuned on. A drafter is trained on the
target's answers to prompts, and no single prompt set covers every kind of question it will
serve. Prompts the target writes add the kinds its own tuning data held; `fledge regen` then
has the target answer them like any other conversations.

A prompt is kept when the target ended its turn (one cut off at `--max-new-tokens` is an
unfinished request) and its text, whitespace and case aside, is new. Output: conversation
records (`fledge.core.conversations`) of one user turn, source "self", appended a round of
`--chunk` samples at a time. Round r samples with a seed that is a function of `--seed` and
r alone, so a rerun redoes the last round it finds and writes only what is missing: what an
uninterrupted run would have written (on a device whose sampling is deterministic).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from fledge.core.config import RegenConfig
from fledge.core.conversations import read_conversations
from fledge.core.devices import parse_dtype
from fledge.core.errors import FledgeError
from fledge.core.files import (
    append_jsonl,
    appending,
    atomic_write_json,
    check_jsonl_output,
    keeping,
    output_lock,
)
from fledge.data.regen import EngineBackend, answer_seed, repair_tail

SOURCE = "self"
_KEPT = "the prompts already written are kept: rerun the same command to resume"


def prompt_key(text: str) -> str:
    """What two prompts must differ in to both be kept: their words, whitespace and case aside."""
    return " ".join(text.split()).lower()


def _round_of(record: dict, out: Path) -> int:
    """The round that wrote `record` (its id is self-ROUND-ROW), checking it is one of ours."""
    head, r, k = (str(record["id"]).rsplit("-", 2) + ["", ""])[:3]
    if head != SOURCE or not (r.isdigit() and k.isdigit()) or [m["role"] for m in record["messages"]] != ["user"]:
        raise FledgeError(f"{out}: record {record['id']!r} is not a `fledge prompts` output; give a new output file")
    return int(r)


def write_prompts(backend: EngineBackend, out: str | Path, n: int, chunk: int, seed: int = 0) -> dict:
    """Sample rounds of `chunk` user turns from `backend`'s target until `out` holds `n`
    distinct finished prompts, or a round adds none (the target repeats itself)."""
    from fledge.core.target import user_turn_prefix
    out = Path(out)
    if n < 1 or chunk < 1:
        raise FledgeError(f"-n {n}, --chunk {chunk}: must be >= 1")
    if out.is_dir():
        raise FledgeError(f"{out}: is a directory; the output is a JSONL file")
    check_jsonl_output(out, "prompts")  # before repair_tail cuts anything of it
    prefix = user_turn_prefix(backend.tok)
    with keeping(out, _KEPT):
        if out.exists():
            repair_tail(out)
        old = read_conversations(out) if out.exists() else []
    have = {r["id"]: _round_of(r, out) for r in old}  # refuses a foreign file before opening it
    start = max(have.values(), default=0)  # the last round found may be partly written: it is redone
    seen = {prompt_key(r["messages"][0]["content"]) for r in old if have[r["id"]] < start}
    counts = {"wanted": n, "already_done": len(seen), "written": 0, "unfinished": 0, "empty": 0, "duplicate": 0}
    t0, r = time.time(), start
    with appending(out, _KEPT) as f, tqdm(total=n, initial=len(seen), desc="prompts", unit="prompt") as bar:
        while len(seen) < n:
            before = len(seen)
            for k, tokens in enumerate(backend.complete([prefix] * chunk, answer_seed(seed, SOURCE, r))):
                a = backend.text(tokens)
                key = prompt_key(a.text)
                if a.finish != "stop":
                    counts["unfinished"] += 1
                elif not key:
                    counts["empty"] += 1
                elif key in seen:
                    counts["duplicate"] += 1
                else:
                    seen.add(key)
                    if (rid := f"{SOURCE}-{r}-{k}") not in have:
                        with keeping(out, _KEPT):
                            append_jsonl(f, {"id": rid, "source": SOURCE,
                                             "messages": [{"role": "user", "content": a.text}]})
                        counts["written"] += 1
                    bar.update(1)
                    if len(seen) == n:
                        break
            r += 1
            if len(seen) == before:
                break
    counts.update(kept=len(seen), rounds=r - start, seconds=round(time.time() - t0, 1))
    summary = out.with_suffix(".summary.json")
    with keeping(summary, _KEPT):
        atomic_write_json(summary, counts)
    return counts


def run_prompts(args) -> int:
    from fledge.core.target import load_target
    # by keyword, not from_args: prompts' --n and --chunk count prompts, not answers per conversation
    cfg = RegenConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                      seed=args.seed, batch_size=args.batch_size)
    if cfg.temperature == 0:
        raise FledgeError("--temperature 0 writes one prompt over and over; sample (the default is 1.0)")
    check_jsonl_output(args.out, "prompts")  # before a target load of minutes
    with output_lock(args.out):  # held from reading what is done to the summary: one writer
        dtype = parse_dtype(args.dtype)
        target = load_target(args.target, dtype=dtype, device=args.device)
        backend = EngineBackend(target, cfg, args.device, dtype, args.compile)
        counts = write_prompts(backend, args.out, args.n, args.chunk, args.seed)
    print(json.dumps(counts, indent=2))
    if counts["kept"] < args.n:
        print(f"fledge: {args.out}: only {counts['kept']} distinct finished prompts of {args.n}: the last round "
              f"added none (raise --temperature or --max-new-tokens)", file=sys.stderr)
        return 1
    return 0
