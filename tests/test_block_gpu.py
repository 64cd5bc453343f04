"""bench/block_gpu.py: the --quick pipeline end to end on the CPU with both block drafters
(DFlash and P-EAGLE) trained, measured beside plain decoding and the shipped EAGLE-3 drafter,
every speculative output equal to plain decoding's (fp32); and its command line."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import block_gpu  # noqa: E402

WORDS = ("the model drafts tokens and the target checks them in one forward so a good draft saves "
         "time while a bad one costs a little more than plain decoding").split()


def answers(path: Path, n: int, heldout: int) -> Path:
    rng = random.Random(0)
    rows = [{"id": f"c{i}", "source": "sharegpt-heldout" if i >= n else "sharegpt",
             "messages": [{"role": "user", "content": " ".join(rng.choices(WORDS, k=8))},
                          {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=40))}]}
            for i in range(n + heldout)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_methods_and_chain_lengths_on_the_command_line(capsys):
    args = block_gpu.parse_args(["--answers", "a.jsonl", "--methods", "peagle,dflash,peagle", "--peagle-ttt-steps", "4"])
    assert args.methods == ["peagle", "dflash"]
    assert args.chains == {"dflash": [7, 5, 3], "peagle": [4, 3]}  # FULL: DFlash's K is 7
    quick = block_gpu.parse_args(["--answers", "a.jsonl", "--quick", "--block-steps", "2", "--peagle-steps", "3", "1"])
    assert quick.methods == ["dflash"] and quick.chains == {"dflash": [2], "peagle": [3, 1]}
    assert quick.peagle_ttt_steps == block_gpu.QUICK["peagle_ttt_steps"]
    assert args.deadline == 360 and quick.deadline == float("inf")  # --quick measures every row, however slow
    with pytest.raises(SystemExit):
        block_gpu.parse_args(["--answers", "a.jsonl", "--methods", "dflash,medusa"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--methods" in err and "'dflash,medusa'" in err and "dflash, peagle" in err


@pytest.mark.slow  # three fledge train runs of SmolLM2 and four drafters measured on it
def test_quick_run_trains_and_measures_dflash_and_peagle(tmp_path, monkeypatch):
    """--methods dflash,peagle: each method trained in its own run directory, its training
    rate in the JSON, its chains measured after plain decoding and EAGLE-3 with the method
    named; every drafter writes plain decoding's tokens on every prompt; a rerun of the train
    step starts nothing (each method's result is already there)."""
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(block_gpu, "result_path", lambda bench, machine, variant="": tmp_path / f"{bench}_{variant}.json")
    data = answers(tmp_path / "answers.jsonl", 16, 3)
    argv = ["--quick", "--answers", str(data), "--prompts", str(data), "--workdir", str(tmp_path / "w"),
            "--methods", "dflash,peagle", "--peagle-steps", "3", "2", "--eagle-steps", "0", "--eagle-shape", "3", "1", "4",
            "--draft-vocab", "512", "--max-new-tokens", "12", "--device", "cpu"]
    assert block_gpu.main(argv) == 0
    report = json.loads((tmp_path / "block_gpu_quick.json").read_text())
    assert report["complete"] and report["dtype"] == "float32"
    assert report["settings"]["methods"] == ["dflash", "peagle"] and report["settings"]["peagle_ttt_steps"] == 3
    assert set(report["train"]) == {"dflash", "peagle"}
    for method, t in report["train"].items():
        assert t["draft"] == f"WORKDIR/train_{method}/draft" and t["steps"] == 6 and t["target_tok_s"] > 0, method
    rows = report["rows"]
    assert [(r["drafter"], r["shape"]) for r in rows] == [("eagle3", [3, 1, 4]), ("dflash", [3, 1, 4]),
                                                          ("peagle", [3, 1, 4]), ("peagle", [2, 1, 3])]
    for r in rows:
        assert "error" not in r and "skipped" not in r, r
        assert r["equal_to_plain"] == r["prompts"] == 2, r
        assert 1 <= r["accept_length"] <= r["shape"][0] + 1 and len(r["depth_acceptance"]) == r["shape"][0], r
        assert r["verify_steps"] >= 2 and r["vs_eagle3"] == pytest.approx(r["tok_s"] / rows[0]["tok_s"])
    assert set(report["verify_ms"]) == {"4", "3"}

    def no_run(cmd, log):
        raise AssertionError(f"resumed train step ran {cmd}")

    monkeypatch.setattr(block_gpu, "run", no_run)
    again = block_gpu.train(block_gpu.parse_args(argv), tmp_path / "w")
    assert {m: t["steps"] for m, t in again.items()} == {"dflash": 6, "peagle": 6}
