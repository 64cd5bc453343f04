"""The front door: every subcommand's help without loading a model library, and errors as one line."""

import argparse
import functools
import importlib
import inspect
import json
import subprocess
import sys

import pytest

from fledge import cli


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every (sub)subcommand's parser by its command line: "vocab build" → its parser."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, p in action.choices.items():
                out[name] = p
                out.update({f"{name} {k}": v for k, v in subparsers(p).items()})
    return out


# Runs every `fledge ... --help` in one fresh interpreter and reports what each printed and
# which model libraries got imported: help must never load torch or transformers.
HELP_PROBE = """
import contextlib, io, json, sys
from fledge import cli
out = {}
for line in json.loads(sys.argv[1]):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            cli.main([*line.split(), "--help"])
        except SystemExit as e:
            assert e.code == 0, (line, e.code)
    out[line] = buf.getvalue()
print(json.dumps({"help": out, "loaded": [m for m in ("torch", "transformers") if m in sys.modules]}))
"""


def test_help_lists_every_option_and_loads_no_model_library():
    names = subparsers(cli.build_parser())
    assert {"target", "prep", "regen", "vocab build", "features", "train", "export", "import", "init-draft",
            "doctor", "generate", "bench", "tune", "demo", "adapt"} <= set(names)
    r = subprocess.run([sys.executable, "-c", HELP_PROBE, json.dumps(["", *names])], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["loaded"] == []
    assert "{" + ",".join(k for k in names if " " not in k) + "}" in got["help"][""]
    for line, p in names.items():
        text = got["help"][line]
        assert text.startswith(f"usage: fledge {line}")
        for action in p._actions:
            for flag in action.option_strings:
                assert flag in text, (line, flag)


def test_python_m_fledge_cli_help():
    r = subprocess.run([sys.executable, "-m", "fledge.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("usage: fledge") and "generate" in r.stdout


def test_every_handler_names_a_function_taking_args():
    """Each subcommand's "module:function" resolves (a typo would only show when run)."""
    for line, p in subparsers(cli.build_parser()).items():
        func = p.get_default("func")
        if func is None:  # a group of subcommands ("vocab"): its members carry the handlers
            assert any(k.startswith(f"{line} ") for k in subparsers(cli.build_parser())), line
            continue
        if isinstance(func, functools.partial):
            module, name = func.args[0].split(":")
            target = getattr(importlib.import_module(module), name)
            assert list(inspect.signature(target).parameters) == ["args"], line


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
    """The README's first command, scaled down: every step runs, doctor finds nothing broken in the
    miniature drafter, and the shipped drafter, as shipped and with the CPU's smaller head, writes AR's
    tokens on every prompt."""
    from fledge.cli import main
    assert main(["demo", "--workdir", str(tmp_path), "--prompts", "4", "--eval-prompts", "1",
                 "--new-tokens", "12", "--train-steps", "4", "--repeats", "1", "--cpu-head-rows", "1024"]) == 0
    report = json.loads((tmp_path / "demo.json").read_text())
    # doctor: a 4-step miniature passes every check but WARNs 'trained' (it is near its init)
    assert report["equal_to_plain"] == report["outputs"] == 2 and report["doctor_exit"] == 1
    assert report["drafter"].endswith("drafters/smollm2-135m")
    rows = report["compare"]
    assert set(rows) == {"AR", "eagle3 chain 3, head 24576", "eagle3 chain 3, head 1024"}
    for name in ("eagle3 chain 3, head 24576", "eagle3 chain 3, head 1024"):
        assert 1.0 <= rows[name]["accept_length"] <= 4.0 and 0 < rows[name]["heldout_coverage"] <= 1


def test_a_step_runs_through_its_lazy_handler(tmp_path):
    """`fledge features` on a tiny target: the handler named in cli_args imports the step and
    runs it (no --device: the step picks one), writing the features `fledge train` reads."""
    from test_target import save_tiny_dir
    from test_train import write_data

    from fledge.train.features import FeatureStore
    save_tiny_dir(tmp_path / "target")
    write_data(tmp_path / "data.jsonl", n=3)
    assert cli.main(["features", "--target", str(tmp_path / "target"), "--data", str(tmp_path / "data.jsonl"),
                     "--out", str(tmp_path / "f"), "--dtype", "fp32", "--shard-size", "2"]) == 0
    hidden = json.loads((tmp_path / "target" / "config.json").read_text())["hidden_size"]
    store = FeatureStore(tmp_path / "f", {"max_len": 2048}, hidden)
    assert store.meta["num_samples"] == 3
    aux, h = store.get(2)
    assert aux.shape[-1] == 3 * hidden and h.shape[-1] == hidden and len(aux) == len(h) > 0


def test_demo_sizes_shrink_with_the_target_and_keep_its_cost():
    """The built-in target keeps the given sizes; a larger one gets fewer prompts and tokens, so
    params x prompts x tokens (a CPU's decode cost) stays within rounding of the built-in's."""
    from fledge.demo import SIZED_FOR, demo_sizes

    assert demo_sizes(8, 48, int(SIZED_FOR)) == (8, 48)
    assert demo_sizes(8, 48, 1000) == (8, 48)  # a tiny test model
    for params in (5e8, 1.5e9, 7e9):
        p, t = demo_sizes(8, 48, int(params))
        assert p < 8 and t < 48 and p >= 2 and t >= 16
        if p > 2 and t > 16:
            assert 0.7 < params * p * t / (SIZED_FOR * 8 * 48) < 1.4
    assert demo_sizes(8, 48, int(5e8)) == (4, 25)
