"""The corpus of published measurements in bench/published: every file valid, the counts met,
and the checker catches the defects it exists for."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

FOLDER = Path(__file__).resolve().parent.parent / "bench" / "published"
spec = importlib.util.spec_from_file_location("published_check", FOLDER / "check.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)


def test_corpus_is_valid_and_large_enough(capsys):
    rows, problems = check.load_corpus(FOLDER)
    assert problems == []
    s = check.summarize(rows)
    print(s)
    assert s["rows"] >= 60
    assert s["sources"] >= 10
    assert {"vllm", "sglang", "tensorrt-llm"} <= set(s["engines"])
    assert s["dense_rows"] > 0 and s["moe_rows"] > 0
    assert s["batch_min"] == 1 and s["batch_max"] >= 64


def test_checker_catches_bad_rows(tmp_path):
    rows, _ = check.load_corpus(FOLDER)
    good = next(r for r in rows if r["plain_tok_s"] is not None)
    sid = good["source"]
    wrong_speedup = copy.deepcopy(good)
    wrong_speedup["speedup"] = round(good["speedup"] * 1.1, 3)
    missing_key = copy.deepcopy(good)
    del missing_key["quote"]
    bad_chain = copy.deepcopy(good)
    bad_chain["shape"] = {"num_steps": 3, "topk": 1, "num_draft_tokens": 3}
    low_accept = copy.deepcopy(good)
    low_accept["accept_length"] = 0.7
    for i, r in enumerate((wrong_speedup, missing_key, bad_chain, low_accept)):
        assert len(check.check_row(r, sid, f"case {i}")) == 1
    assert check.check_row(good, sid, "good") == []
    (tmp_path / f"{sid}.json").write_text(json.dumps([good]))
    (tmp_path / "README.md").write_text("no index here")
    _, problems = check.load_corpus(tmp_path)
    assert problems == [f"README.md: source {sid!r} is not in the index"]
    (tmp_path / "README.md").write_text(f"| `{sid}` | a title | 2 |\n")
    _, problems = check.load_corpus(tmp_path)
    assert problems == [f"README.md: source {sid!r} lists 2 rows, its file has 1"]
    (tmp_path / "README.md").write_text(f"| `{sid}` | a title | 1 |\n")
    assert check.load_corpus(tmp_path)[1] == []
    (tmp_path / "broken.json").write_text("[{")
    _, problems = check.load_corpus(tmp_path)
    assert any(p.startswith("broken.json: not valid JSON") for p in problems)
