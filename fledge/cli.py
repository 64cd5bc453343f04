"""`fledge <subcommand>`: one subcommand per pipeline step.

Each step module exposes `add_cli(subparsers)` registering its subcommand(s) with a
`func(args)` default. Errors the user can fix are `FledgeError`s: printed as one line,
exit 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from fledge.util import FledgeError

# Modules that register subcommands, in pipeline order.
STEP_MODULES = [
    "fledge.target",
    "fledge.data",
    "fledge.regen",
    "fledge.tokenize",
    "fledge.vocab",
    "fledge.features",
    "fledge.train",
    "fledge.checkpoint",
    "fledge.doctor",
    "fledge.demo",
    "fledge.engine.cli",
    "fledge.bench",
    "fledge.tune",
    "fledge.adapt",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fledge", description=__doc__.splitlines()[0])
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)
    for name in STEP_MODULES:
        importlib.import_module(name).add_cli(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
    except FledgeError as e:
        if args.debug:
            raise
        print(f"fledge: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fledge: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
