"""bench/block_gpu.py's command line: which block drafters it trains, their chain lengths and
the deadline, and the one line a wrong method gets. The pipeline itself is what
`bench/block_gpu.py --quick` runs on a CPU (minutes: three trainings of SmolLM2), kept out of
the test command; every stage it calls has its own tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import block_gpu  # noqa: E402


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


def test_train_commands_carry_the_drafter_flags_to_their_method_only():
    args = block_gpu.parse_args(["--answers", "a.jsonl", "--methods", "dflash,peagle", "--aux-layers", "2,8,15,21,28",
                                 "--draft-layers", "5", "--eval-every", "400", "--eagle-steps", "0"])
    cmds = {m: [str(a) for a in c] for m, c in block_gpu.train_commands(args, Path("w")).items()}
    assert list(cmds) == ["dflash", "peagle"]  # --eagle-steps 0: no EAGLE-3 run
    flag = lambda m, name: cmds[m][cmds[m].index(name) + 1]  # noqa: E731
    assert flag("dflash", "--aux-layers") == "2,8,15,21,28" and flag("dflash", "--draft-layers") == "5"
    assert "--aux-layers" not in cmds["peagle"] and "--draft-layers" not in cmds["peagle"]
    assert flag("dflash", "--out") == str(Path("w") / "train_dflash") and flag("peagle", "--method") == "peagle"
    assert flag("dflash", "--eval-every") == flag("peagle", "--eval-every") == "400"
    assert flag("dflash", "--time-budget") == "130.0"
    default = block_gpu.parse_args(["--answers", "a.jsonl"])
    cmd = [str(a) for a in block_gpu.train_commands(default, Path("w"))["dflash"]]
    assert "--aux-layers" not in cmd and cmd[cmd.index("--eval-every") + 1] == str(10 ** 6)


def test_peagle_warm_start_keeps_the_drafters_vocabulary():
    args = block_gpu.parse_args(["--answers", "a.jsonl", "--methods", "dflash,peagle", "--peagle-init", "drafters/x"])
    cmds = {m: [str(a) for a in c] for m, c in block_gpu.train_commands(args, Path("w")).items()}
    peagle, dflash = cmds["peagle"], cmds["dflash"]
    assert peagle[peagle.index("--init") + 1] == "drafters/x" and "--vocab" not in peagle and "--head" not in peagle
    assert dflash[dflash.index("--head") + 1] == "target"
    assert "--init" not in dflash and dflash[dflash.index("--vocab") + 1] == str(Path("w") / "vocab.safetensors")
    assert "--draft-layers" not in peagle
    assert "--cod" not in peagle
    deep = block_gpu.parse_args(["--answers", "a.jsonl", "--methods", "peagle", "--peagle-init", "d", "--peagle-layers", "4",
                                 "--peagle-cod", "0.7"])
    cmd = [str(a) for a in block_gpu.train_commands(deep, Path("w"))["peagle"]]
    assert cmd[cmd.index("--draft-layers") + 1] == "4" and cmd[cmd.index("--cod") + 1] == "0.7"
