"""Every option of `fledge demo` and `fledge adapt` says what it does, and its default where
it has one (a user reads --help, not the source)."""

import argparse

import pytest

from fledge import adapt, demo
from fledge.train import TrainConfig


def _parser(add_cli) -> argparse.ArgumentParser:
    sub = argparse.ArgumentParser().add_subparsers()
    add_cli(sub)
    (p,) = sub.choices.values()
    return p


def _options(p):
    return [a for a in p._actions if a.option_strings and a.dest != "help"]


@pytest.mark.parametrize("add_cli", [demo.add_cli, adapt.add_cli])
def test_every_option_is_described(add_cli):
    p = _parser(add_cli)
    for a in _options(p):
        assert a.help and "as in fledge train" not in a.help, a.option_strings
    assert "as in fledge train" not in p.format_help()


def test_defaults_are_shown():
    p = _parser(demo.add_cli)
    text = " ".join(p.format_help().split())
    for a in _options(p):
        assert f"(default: {a.default})" in text, a.dest
    helps = {a.dest: a.help for a in _options(_parser(adapt.add_cli))}
    for name, _, _ in adapt.TRAIN_OPTIONS:
        default = getattr(TrainConfig, name.replace("-", "_"))
        if default is not None:
            assert helps[name.replace("-", "_")].endswith(f"(default {default})"), name
