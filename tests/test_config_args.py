"""The one path from flags to a config: from_args by keyword, help defaults from the dataclass."""

import argparse

import pytest

from fledge.cli import main
from fledge.core.config import RegenConfig, TrainConfig, config_help, from_args
from fledge.core.errors import FledgeError


def test_from_args_takes_given_flags_and_keeps_defaults_for_none():
    args = argparse.Namespace(max_new_tokens=32, temperature=None, n=None, unrelated="x", batch_size=3)
    cfg = from_args(RegenConfig, args, seed=5)
    assert (cfg.max_new_tokens, cfg.batch_size, cfg.seed) == (32, 3, 5)
    assert cfg.temperature == RegenConfig().temperature and cfg.n == RegenConfig().n


def test_from_args_checks_in_post_init():
    with pytest.raises(FledgeError, match="--batch-size 0: must be an integer >= 1"):
        from_args(RegenConfig, argparse.Namespace(batch_size=0))


def test_help_reads_each_default_from_its_dataclass():
    assert config_help(RegenConfig, "max-new-tokens", "x") == f"x (default: {RegenConfig().max_new_tokens})"
    assert config_help(RegenConfig, "max_turns", "x") == "x"  # None: no default to show
    assert config_help(TrainConfig, "lr", "x").endswith(f"(default: {TrainConfig.__dataclass_fields__['lr'].default})")


def test_regen_flag_out_of_range_is_one_line(tmp_path, capsys):
    convs = tmp_path / "c.jsonl"
    convs.write_text('{"id": "a", "conversations": [{"role": "user", "content": "hi"}]}\n')
    assert main(["regen", str(convs), str(tmp_path / "o.jsonl"), "--batch-size", "0"]) == 2
    assert capsys.readouterr().err.strip() .startswith("fledge: error: argument --batch-size: 0: must be an integer >= 1")
    assert not (tmp_path / "o.jsonl").exists()
