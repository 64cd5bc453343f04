"""The README's quick start, run as written at tiny sizes on a tiny random target, so the README
cannot drift from the code: a flag it uses that a command lost, or a file one step writes that
the next does not find, fails here.

The block between `<!-- quick-start` and `<!-- /quick-start -->` is read from README.md; the
overrides below are the only changes: the target and prompt set become tiny local files, sizes
shrink, and tokenize runs in-process. Each override must match, so a README edit that drops one
fails here too, instead of silently running at full size.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import tokenizers
import transformers
from conftest import make_tiny

from fledge.cli import main as cli_main
from fledge.core.files import read_jsonl

README = Path(__file__).resolve().parent.parent / "README.md"
TEMPLATE = ("{% for m in messages %} <{{ m['role'] }}> {{ m['content'] }} w1{% endfor %}"
            "{% if add_generation_prompt %} <assistant>{% endif %}")
# (README text, tiny replacement, occurrences)
OVERRIDES = [
    ("smollm2-135m", "{target}", 9),
    ("fledge prep mtbench", "fledge prep {prompts}", 1),
    ("--heldout 16", "--heldout 2", 1),
    ("--max-new-tokens 128", "--max-new-tokens 6", 2),
    ("-o data/mt/tok", "-o data/mt/tok --workers 1", 1),
    ("--size 4096", "--size 64", 1),
    ("--max-steps 40 --batch-size 4 --eval-every 20", "--max-steps 2 --batch-size 2 --eval-every 2 --max-len 64", 1),
    ("--num-prompts 4 --max-new-tokens 64", "--num-prompts 1 --max-new-tokens 6", 2),
    ("--max-steps 20 --batch-size 4", "--max-steps 1 --batch-size 2 --max-len 64", 1),
]


def quick_start() -> list[str]:
    text = README.read_text()
    m = re.search(r"<!-- quick-start[^>]*-->\s*```sh\n(.*?)```\s*<!-- /quick-start -->", text, re.S)
    assert m, "README.md: no quick-start block"
    return [line for line in m.group(1).splitlines() if line.strip() and not line.startswith("#")]


def tiny_target(path: Path) -> str:
    model = make_tiny("llama")
    model.save_pretrained(path)
    vocab = {f"w{i}": i for i in range(model.config.vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1",
                                         chat_template=TEMPLATE).save_pretrained(path)
    return str(path)


def test_readme_quick_start_runs_as_written(tmp_path, monkeypatch):
    lines = quick_start()
    steps = [shlex.split(line)[1] for line in lines]
    assert steps == ["prep", "regen", "regen", "tokenize", "vocab", "train", "export", "doctor", "bench", "tune",
                     "adapt"]
    script = "\n".join(lines)
    for old, new, n in OVERRIDES:
        assert script.count(old) == n, f"README quick start: expected {n}x {old!r}"
        script = script.replace(old, new)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [f"w{5 + i} w{40 + 3 * i} w{7 * i + 2}",
                                                                     f"w{9 + i} w{60 - i}"]}) + "\n"
                               for i in range(6)))
    script = script.format(target=tiny_target(tmp_path / "target"), prompts=prompts)
    monkeypatch.chdir(tmp_path)
    for line in script.splitlines():
        argv = shlex.split(line)
        rc = cli_main(argv[1:])
        # doctor: 1 is WARN (a 2-step drafter accepts little); only a FAIL (2) is wrong.
        assert rc in ((0, 1) if argv[1] == "doctor" else (0,)), f"{line}: exit {rc}"
        if argv[1] == "bench":  # every speculative output checked against plain decoding, and equal (fp32)
            rows = json.loads((tmp_path / "runs/mt/bench.json").read_text())["results"]
            assert rows and all(r["equal_to_plain"] == r["prompts"] == 1 for r in rows)
    for _, row in read_jsonl(tmp_path / "data/mt/regen.jsonl"):  # MT-Bench's two turns, --max-turns 1: turn 1 only
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"] and row["messages"][0]["content"].startswith("w")
    tok = json.loads((tmp_path / "data/mt/tok/summary.json").read_text())
    assert tok["train"]["samples"] == 4 and tok["heldout"]["samples"] == 2
    assert (tmp_path / "drafters/mt/config.json").is_file()
    bench = json.loads((tmp_path / "runs/mt/bench.json").read_text())
    assert len(bench["results"]) == 3 and all(r["accept_length"] >= 1.0 for r in bench["results"])  # 3 default shapes
    assert json.loads((tmp_path / "runs/mt/tune.json").read_text())["predictions"]
    assert (tmp_path / "runs/mt-adapt/train/draft/config.json").is_file()


def test_links_in_the_docs_name_files_that_exist():
    root = README.parent
    for doc in [README, *sorted((root / "docs").glob("*.md")), root / "drafters/smollm2-135m/README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.name}: link to {target}"
        # bench/results/ files named in the text (not only links) must exist too, or, named with
        # a commit ("NAME at REV", "git show REV:bench/results/NAME"), exist in that commit
        text = doc.read_text()
        past = {(m[1] or m[2], m[0] or m[3]) for m in re.findall(
            r"git show ([0-9a-f]{7,}):bench/results/(\w+\.json)|(\w+\.json)`? at (?:commit )?([0-9a-f]{7,})", text)}
        for name, rev in past:
            if subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{rev}^{{commit}}"]).returncode == 0:  # not in a shallow clone
                got = subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{rev}:bench/results/{name}"])
                assert got.returncode == 0, f"{doc.name}: names {name} at {rev}, which that commit does not hold"
        for name in re.findall(r"\b(\w+_(?:h200\w*|cpu)\.json)\b", text):
            assert (root / "bench/results" / name).exists() or name in {n for n, _ in past}, f"{doc.name}: names {name}"
