"""`fledge tokenize` on real SmolLM2 tokenization: every conversation once, the held-out split by
source, shards of another split never reused, the same samples as one serial build_training_set."""

from __future__ import annotations

import gzip
import json
import os
import random
from pathlib import Path

import forked
import pytest

from fledge import cli
from fledge.core.errors import FledgeError
from fledge.data import tokenize as tk


def conversations(n: int, rng: random.Random, source: str = "sharegpt", start: int = 0) -> str:
    words = ["alpha", "beta", "gamma", "line\u2028break", "para\u2029graph", "tab\x0bhere", "x\x1cy", "€uro"]
    rows = [{"id": f"c{i}", "source": source,
             "messages": [{"role": "user", "content": " ".join(rng.choices(words, k=5))},
                          {"role": "assistant", "content": " ".join(rng.choices(words, k=9))}]}
            for i in range(start, start + n)]
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


@pytest.fixture(scope="module")
def tokenizer_dir():
    from fledge.core.target import resolve_target
    return str(resolve_target("smollm2-135m"))


def run(argv: list[str]) -> int:
    args = cli.build_parser().parse_args(["tokenize", *argv])
    return args.func(args)


def ids_of(path: Path) -> list[str]:
    return sorted(json.loads(line)["id"] for line in path.read_text().splitlines())


def test_tokenize_keeps_every_conversation_once(tmp_path, tokenizer_dir):
    # Unicode line breaks inside JSON strings must not split records (str.splitlines would).
    rng = random.Random()
    conv = tmp_path / "c.jsonl"
    conv.write_text(conversations(9, rng), encoding="utf-8")
    out = tmp_path / "tok"
    assert run([str(conv), "-o", str(out), "--tokenizer", tokenizer_dir, "--max-len", "256", "--workers", "2"]) == 0
    stats = json.loads((out / "summary.json").read_text())["train"]
    assert stats["conversations"] == 9 and ids_of(out / "train.tok.jsonl") == sorted(f"c{i}" for i in range(9))
    assert not list(tmp_path.glob(".tok.shards"))  # the work directory goes once the output is whole


def test_tokenize_shards_of_another_split_are_not_reused(tmp_path, tokenizer_dir):
    rng = random.Random()
    conv = tmp_path / "c.jsonl"
    conv.write_text(conversations(6, rng), encoding="utf-8")
    out = tmp_path / "tok"
    tk.tokenize([conv], out, tokenizer_dir, 256, workers=1)
    conv.write_text(conversations(7, rng), encoding="utf-8")  # same path, new content
    with pytest.raises(FledgeError, match="already exists"):
        tk.tokenize([conv], out, tokenizer_dir, 256, workers=1)
    # A kill after the shards were written leaves them behind; a run on other input must not use them.
    tk._plan_shards({"train": ["x\n"] * 3, "heldout": []}, tmp_path / ".tok.shards", {"other": 1}, 2)
    tk.tokenize([conv], out, tokenizer_dir, 256, workers=1, overwrite=True)
    assert len((out / "train.tok.jsonl").read_text().splitlines()) == 7


def test_heldout_by_source_and_by_file_equal_a_serial_build(tmp_path, tokenizer_dir):
    rng = random.Random(0)
    conv = tmp_path / "regen.jsonl.gz"
    text = conversations(5, rng) + conversations(3, rng, source="sharegpt-heldout", start=5)
    conv.write_bytes(gzip.compress(text.encode()))
    extra = tmp_path / "extra.jsonl"
    extra.write_text(conversations(2, rng, start=8), encoding="utf-8")
    out = tmp_path / "tok"
    summary = tk.tokenize([conv], out, tokenizer_dir, 64, workers=2, heldout=[extra])
    assert ids_of(out / "train.tok.jsonl") == [f"c{i}" for i in range(5)]
    assert ids_of(out / "heldout.tok.jsonl") == sorted(f"c{i}" for i in range(5, 10))
    assert summary["heldout"]["conversations"] == 5
    # Brute force: one build_training_set over the same conversations in one process.
    serial_in = tmp_path / "serial.jsonl"
    serial_in.write_text(text.split("\n", 5)[-1] + extra.read_text(), encoding="utf-8")
    ref = tk.build_training_set(tk.load_tokenizer(tokenizer_dir), serial_in, tmp_path / "serial.tok.jsonl", 64)
    got = {json.loads(x)["id"]: x for x in (out / "heldout.tok.jsonl").read_text().splitlines()}
    want = {json.loads(x)["id"]: x for x in (tmp_path / "serial.tok.jsonl").read_text().splitlines()}
    assert got == want
    for k in ("samples", "tokens", "trained_tokens", "share_truncated"):
        assert summary["heldout"][k] == ref[k], k


def test_bad_line_names_file_and_line(tmp_path, tokenizer_dir):
    conv = tmp_path / "c.jsonl"
    conv.write_text(conversations(2, random.Random()) + "{not json\n", encoding="utf-8")
    with pytest.raises(FledgeError, match=r"c\.jsonl:3: not valid JSON"):
        tk.tokenize([conv], tmp_path / "tok", tokenizer_dir, 64)
    assert not (tmp_path / "tok").exists()
    with pytest.raises(FledgeError, match="the output is the input conversations"):
        tk.tokenize([conv], conv, tokenizer_dir, 64, overwrite=True)
    assert conv.is_file()


def test_wrong_files_are_named_without_other_commands(tmp_path, tokenizer_dir):
    """A tokenized file given back to tokenize, and a cut-off .gz: one line each, naming the
    file and what it is, not the command that shares the reader."""
    tok = tmp_path / "train.tok.jsonl"
    tok.write_text(json.dumps({"id": "s0", "input_ids": [1, 2], "loss_mask": [0, 1]}) + "\n")
    with pytest.raises(FledgeError, match=r"train\.tok\.jsonl:1: a tokenized sample, not a conversation") as e:
        tk.tokenize([tok], tmp_path / "tok", tokenizer_dir, 64)
    assert "regen" not in str(e.value)
    cut = tmp_path / "c.jsonl.gz"
    cut.write_bytes(gzip.compress(conversations(50, random.Random(0)).encode())[:200])
    with pytest.raises(FledgeError, match=r"c\.jsonl\.gz: cannot read"):
        tk.tokenize([cut], tmp_path / "tok", tokenizer_dir, 64)
    assert not (tmp_path / "tok").exists()


def test_kill9_at_five_points_then_rerun_loses_and_duplicates_nothing(tmp_path, tokenizer_dir):
    """`fledge tokenize --workers 2` killed with SIGKILL at five points (shards planned, a shard
    begun, one shard done, half done, all but one done), the same command run again after each:
    2 s after each kill no process of the killed run is alive, and the final output equals an
    uninterrupted in-process build, line for line (nothing torn, lost or twice)."""
    conv = tmp_path / "c.jsonl"
    conv.write_text(conversations(120, random.Random(0)), encoding="utf-8")
    out, work = tmp_path / "tok", tmp_path / ".tok.shards"
    argv = ["tokenize", conv, "-o", out, "--tokenizer", tokenizer_dir, "--workers", "2", "--max-len", "64"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def stats():
        return len(list(work.glob("*.stats.json")))
    points = [lambda: (work / "key.json").exists(), lambda: bool(list(work.glob("*.partial"))),
              lambda: stats() >= 1, lambda: stats() >= 4, lambda: stats() >= 8]
    # workers may take up to the 2 s to follow their parent
    assert forked.kill_at(argv, env, points, settle=2.0) >= 1
    assert forked.wait(forked.fledge(argv, env=env)) == 0
    tk.tokenize([conv], tmp_path / "ref", tokenizer_dir, 64, workers=1)
    for name in ("train", "heldout"):
        got = (out / f"{name}.tok.jsonl").read_text().splitlines()
        assert sorted(got) == sorted((tmp_path / "ref" / f"{name}.tok.jsonl").read_text().splitlines())
    assert ids_of(out / "train.tok.jsonl") == sorted(f"c{i}" for i in range(120))
    assert not work.exists() and not list(tmp_path.glob(".tok.*"))
