"""Every option of `fledge demo`, `fledge adapt` and `fledge train` says what it does, and its
default where it has one (a user reads --help, not the source)."""

import dataclasses

import pytest

from fledge import cli
from fledge.core.config import ADAPT_TRAIN_OPTIONS, TRAIN_OPTIONS, TrainConfig


def _parser(name: str):
    (p,) = [a for a in cli.build_parser()._actions if a.dest == "command"]
    return p.choices[name]


def _options(p):
    return [a for a in p._actions if a.option_strings and a.dest != "help"]


@pytest.mark.parametrize("name", ["demo", "adapt", "train"])
def test_every_option_is_described(name):
    p = _parser(name)
    for a in _options(p):
        if name != "train" or a.dest in {o[0].replace("-", "_") for o in TRAIN_OPTIONS}:
            assert a.help and "as in fledge train" not in a.help, a.option_strings
    assert "as in fledge train" not in p.format_help()


def test_defaults_are_shown():
    p = _parser("demo")
    text = " ".join(p.format_help().split())
    for a in _options(p):
        assert f"(default: {a.default})" in text, a.dest
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for cmd, options in (("adapt", ADAPT_TRAIN_OPTIONS), ("train", TRAIN_OPTIONS)):
        helps = {a.dest: a.help for a in _options(_parser(cmd))}
        for name, _, _ in options:
            default = defaults[name.replace("-", "_")]
            if default is not None:
                assert helps[name.replace("-", "_")].endswith(f"(default: {default})"), (cmd, name)
