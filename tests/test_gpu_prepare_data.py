"""scripts/gpu_prepare_data.py: the headline run's data helpers, on real SmolLM2 tokenization."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import gpu_prepare_data as gpd  # noqa: E402


def conversations(n: int, rng: random.Random) -> str:
    words = ["alpha", "beta", "gamma", "line\u2028break", "para\u2029graph", "tab\x0bhere", "x\x1cy", "€uro"]
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": " ".join(rng.choices(words, k=5))},
                                         {"role": "assistant", "content": " ".join(rng.choices(words, k=9))}]}
            for i in range(n)]
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


@pytest.fixture(scope="module")
def tokenizer_dir():
    from fledge.target import resolve_target
    return str(resolve_target("smollm2-135m"))


def test_tokenize_keeps_every_conversation_once(tmp_path, tokenizer_dir):
    # Unicode line breaks inside JSON strings must not split records (str.splitlines would).
    rng = random.Random()
    conv = tmp_path / "c.jsonl"
    conv.write_text(conversations(9, rng), encoding="utf-8")
    out = tmp_path / "c.tok.jsonl"
    stats = gpd.tokenize(conv, out, tokenizer_dir, 256, workers=2)
    ids = sorted(json.loads(line)["id"] for line in out.read_text().splitlines())
    assert stats["conversations"] == 9 and ids == sorted(f"c{i}" for i in range(9))


def test_tokenize_shards_of_another_split_are_not_reused(tmp_path, tokenizer_dir):
    rng = random.Random()
    conv = tmp_path / "c.jsonl"
    conv.write_text(conversations(6, rng), encoding="utf-8")
    out = tmp_path / "c.tok.jsonl"
    gpd.tokenize(conv, out, tokenizer_dir, 256, workers=2)
    conv.write_text(conversations(7, rng), encoding="utf-8")  # same path, new content
    gpd.tokenize(conv, out, tokenizer_dir, 256, workers=2)
    assert len(out.read_text().splitlines()) == 7


def test_plan_steps_uses_the_median_of_the_later_windows(tmp_path):
    probe = tmp_path / "metrics.jsonl"
    rates = [1000.0, 2000.0, 9000.0, 3000.0, 4000.0, 6000.0]  # warm-up: the first half is left out
    probe.write_text("".join(json.dumps({"kind": "train", "step": i, "target_tok_s": r}) + "\n"
                             for i, r in enumerate(rates)))
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [1] * 100}) + "\n" for _ in range(40)))
    plan = gpd.plan_steps(probe, data, batch=4, seconds=10, epochs=100, safety=1.0)
    assert plan["probe_target_tok_s"] == 4000 and plan["max_steps"] == int(10 * 4000 / 400)
