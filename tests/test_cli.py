"""The front door: every step module imports and registers, and errors come out as one line."""

import json
import subprocess
import sys

import pytest

from fledge import cli


def test_every_subcommand_registers_and_has_help(capsys):
    parser = cli.build_parser()
    names = parser._subparsers._group_actions[0].choices
    assert {"target", "prep", "regen", "vocab", "features", "train", "export", "import", "init-draft", "doctor",
            "generate", "bench", "tune", "demo"} <= set(names)
    for name in names:
        with pytest.raises(SystemExit) as e:
            cli.main([name, "--help"])
        assert e.value.code == 0
    assert "usage" in capsys.readouterr().out


def test_user_error_is_one_line_and_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fledge.cli", "doctor", str(tmp_path / "nope")],
                       capture_output=True, text=True)
    # The doctor reports a missing drafter as a FAIL (exit 2), never a traceback.
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "fledge.cli", "export", str(tmp_path / "nope"), str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("fledge: error: ") and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # the whole loop on SmolLM2, scaled down (~1 minute)
def test_demo_runs_the_loop_and_its_outputs_match_ar(tmp_path):
    """The README's first command, scaled down: every step runs, doctor passes the miniature
    drafter, and both speculative rows write AR's tokens with the shipped drafter."""
    from fledge.cli import main
    assert main(["demo", "--workdir", str(tmp_path), "--prompts", "4", "--eval-prompts", "1",
                 "--new-tokens", "12", "--train-steps", "4"]) == 0
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["identical"] is True and report["doctor_exit"] == 0
    assert report["drafter"].endswith("drafters/smollm2-135m")
    rows = report["compare"]
    assert set(rows) == {"AR", "eagle3 chain 4", "n-gram chain 4"}
    for name in ("eagle3 chain 4", "n-gram chain 4"):
        assert rows[name]["tokens"] == rows["AR"]["tokens"] > 0
        assert 1.0 <= rows[name]["accept_length"] <= 5.0
