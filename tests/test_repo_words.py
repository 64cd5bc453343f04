"""The repository speaks to its users: no scratch path of one machine in a published figure or a
doc, and no code comment pointing at a commit instead of saying why. Read from git's file list,
so only what ships is checked."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).parent.parent

# A directory under /tmp is one machine's scratch space: a reader cannot follow it.
SCRATCH = re.compile(r"/tmp/[A-Za-z0-9_.-]+/")
# Code says why; the history of a figure lives in git and in docs/performance.md.
COMMIT_IN_CODE = re.compile(r"\bat commit [0-9a-f]{7,40}\b")
# Words about how the team's machines are lent, not about the product.
LEASE_WORDS = re.compile(r"\b(device time|GPU call|device-stage|machine lease)\b", re.IGNORECASE)


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "--", *patterns], cwd=ROOT, capture_output=True, text=True)
    return [ROOT / p for p in out.stdout.split("\0") if p and (ROOT / p).is_file()]


def hits(paths: list[Path], pattern: re.Pattern) -> list[str]:
    found = []
    for p in paths:
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{p.name if not p.is_relative_to(ROOT) else p.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    return found


def test_no_scratch_paths_in_results_or_docs():
    assert hits(tracked("*.json", "*.md"), SCRATCH) == []


def test_code_comments_cite_no_commits():
    assert hits(tracked("fledge/*.py", "bench/*.py", "scripts/*"), COMMIT_IN_CODE) == []


def test_no_words_about_lent_machines():
    this = Path(__file__).resolve()
    assert hits([p for p in tracked("*.py", "*.md", "*.json") if p.resolve() != this], LEASE_WORDS) == []


def test_the_patterns_catch_what_they_are_for(tmp_path):
    bad = tmp_path / "x.md"
    bad.write_text('"data": "/tmp/run_7/train.jsonl"\n# 1.2 ms (bench/x.py at commit d466fab)\nin less device time\n')
    assert len(hits([bad], SCRATCH)) == 1
    assert len(hits([bad], COMMIT_IN_CODE)) == 1
    assert len(hits([bad], LEASE_WORDS)) == 1
    assert hits([bad], re.compile("absent")) == []
