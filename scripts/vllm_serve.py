"""Serve a target with vLLM's OpenAI-compatible server on this CPU, for `fledge regen --server`.

    python scripts/vllm_serve.py [--target smollm2-135m] [--port 0] [--max-model-len 1024]

Runs in fledge's Python, vLLM from scripts/setup_vllm.sh's venv, bound to 127.0.0.1. Prints the
base URL once /health answers; serves until Ctrl-C or SIGTERM. The server gets a process group
of its own, so stopping it leaves no orphaned engine, and a parent-death signal, so a killed
launcher (kill -9 included) stops it too. Tests import `start` from here.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from fledge.core.target import resolve_target
from fledge.core.errors import FledgeError
from fledge.core.procs import ends_with_parent
from fledge.core.vllm_cpu import venv_env, venv_python

HOST = "127.0.0.1"


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    start_s: float  # seconds until /health answered

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        """Signal the whole group (API server, engine core, worker); SIGKILL what outlives `timeout`."""
        for s in (sig, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, s)
                self.proc.wait(timeout)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                pass


def free_port() -> int:
    # Another process could take it before vLLM binds; start() then fails with vLLM's log.
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        return False


def start(target: Path, name: str, port: int = 0, max_model_len: int = 1024, dtype: str = "float32",
          log: Path | None = None, timeout: float = 300.0, extra: tuple = ()) -> Server:
    """Start the server, wait at most `timeout` s for /health. `log`: vLLM's output (None: this
    terminal); `extra`: more vLLM arguments (e.g. --speculative-config JSON)."""
    env = venv_env()
    port = port or free_port()
    # `python -m` on the module, not `vllm serve`: the CLI looks up package metadata named
    # `vllm`, but the CPU build is installed as `vllm-cpu`.
    cmd = [str(venv_python()), "-W", "ignore::DeprecationWarning", "-m",
           "vllm.entrypoints.openai.api_server", "--model", str(target), "--served-model-name", name,
           "--host", HOST, "--port", str(port), "--max-model-len", str(max_model_len), "--dtype", dtype,
           "--enforce-eager", "--seed", "0", *extra]
    t0 = time.monotonic()
    with open(log, "ab") if log else contextlib.nullcontext() as out:  # the child holds its own descriptor
        # SIGTERM on the launcher's death: vLLM's API server then stops its engine processes itself.
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None, process_group=0,
                                preexec_fn=ends_with_parent(signal.SIGTERM))
    server = Server(proc, f"http://{HOST}:{port}", 0.0)
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            server.stop(signal.SIGKILL)
            raise FledgeError(f"vLLM exited with {proc.returncode} while starting; see {log or 'its output'}")
        if healthy(server.url):
            server.start_s = round(time.monotonic() - t0, 1)
            return server
        time.sleep(1.0)
    server.stop(signal.SIGKILL)
    raise FledgeError(f"vLLM did not answer {server.url}/health within {timeout:.0f} s; see {log or 'its output'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m", help="built-in name, GGUF file or HF directory")
    ap.add_argument("--name", help="served model name (default: --target, what `fledge regen` requests)")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--log", type=Path, help="write vLLM's output here instead of the terminal")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for /health")
    args = ap.parse_args()
    try:
        server = start(resolve_target(args.target), args.name or args.target, args.port, args.max_model_len,
                       args.dtype, args.log, args.timeout)
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
