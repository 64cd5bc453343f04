"""`fledge <subcommand>`: one subcommand per pipeline step.

Every subcommand's arguments are defined in `fledge.cli_args` from torch-free modules only,
and its handler is named "module:function" and imported when that subcommand runs: `fledge
--help` and `fledge SUB --help` never load torch or transformers. Exit codes (`exit_code`
holds the scheme):
  0    success
  1    runtime failure: the disk is full, an I/O error (one line naming the file), or a bug
       (a traceback)
  2    bad input: a `FledgeError`, a missing file, a directory where a file belongs, a
       folder without write permission (one line naming the file); also argparse's usage errors
  75   `fledge train --time-budget`: the budget ran out before the planned steps did; the
       checkpoint is saved and the same command resumes the run (EX_TEMPFAIL: try again)
  130  interrupted (Ctrl-C / SIGTERM; `fledge train` saves its checkpoint first)
`--debug` or FLEDGE_DEBUG=1 shows the traceback instead of the one line.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

from fledge import cli_args, cli_perf
from fledge.core.errors import FledgeError

# Subcommands in pipeline order, each a function adding its parser(s).
COMMANDS = [cli_args.add_target, cli_args.add_prep, cli_args.add_prompts, cli_args.add_regen, cli_args.add_tokenize,
            cli_args.add_vocab, cli_args.add_features, cli_args.add_train, cli_args.add_checkpoint, cli_args.add_doctor,
            cli_args.add_demo, cli_args.add_generate, cli_perf.add_bench, cli_perf.add_serve_sweep, cli_perf.add_tune,
            cli_args.add_adapt]

class Parser(argparse.ArgumentParser):
    """argparse with its usage errors (a missing argument, a number out of range) raised as a
    FledgeError: one line and exit 2, like every other bad input; --help shows the usage."""

    def error(self, message):
        raise FledgeError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="fledge", description=__doc__.splitlines()[0])
    p.add_argument("--debug", action="store_true", help="show tracebacks (also FLEDGE_DEBUG=1)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let a model directory's own Python files run when it loads (its config's auto_map; also "
                        "FLEDGE_TRUST_REMOTE_CODE=1); off, such a target is refused")
    sub = p.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return p


# OS errors that are the machine's state rather than the input: exit 1.
RUNTIME_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ENOMEM}


def exit_code(e: BaseException) -> int | None:
    """The exit code for an expected failure, None for one that is a bug (a traceback)."""
    if isinstance(e, KeyboardInterrupt):
        return 130
    if isinstance(e, FledgeError):
        return 2
    if isinstance(e, OSError) and (e.filename is not None or e.errno in RUNTIME_ERRNOS):
        return 1 if e.errno in RUNTIME_ERRNOS else 2
    return None


def message(e: BaseException) -> str:
    if isinstance(e, KeyboardInterrupt):
        return "fledge: interrupted"
    if isinstance(e, OSError):
        hint = {errno.ENOSPC: " (free some space, or write elsewhere)", errno.EDQUOT: " (free some space, or write "
                "elsewhere)", errno.EROFS: " (the file system is mounted read-only: write elsewhere)"}.get(e.errno, "")
        where = f"{e.filename}: " if e.filename is not None else ""  # a full disk found where no file was named
        return f"fledge: error: {where}{e.strerror or type(e).__name__}{hint}"
    return f"fledge: error: {e}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = None
    try:
        args = build_parser().parse_args(argv)
        if args.trust_remote_code:  # the environment carries it to worker processes and torchrun's ranks
            os.environ["FLEDGE_TRUST_REMOTE_CODE"] = "1"
        rc = args.func(args)
    except (Exception, KeyboardInterrupt) as e:
        code = exit_code(e)
        debug = (args.debug if args else "--debug" in argv) or os.environ.get("FLEDGE_DEBUG", "") not in ("", "0")
        if debug or code is None:
            raise
        print(message(e), file=sys.stderr)
        return code
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
