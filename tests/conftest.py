"""Shared fixtures: tiny random targets of every family fledge must handle.

Sizes are chosen so a forward pass takes milliseconds on the CPU, while keeping what
matters: GQA (heads != kv heads), 8 layers (default aux ids (2, 4, 5) are distinct), odd vocab.
"""

from __future__ import annotations

import os
from pathlib import Path

# The prefix attention kernel is Triton: on this GPU-less machine its tests run it under Triton's
# interpreter, which must be chosen before the first import of triton (kernels are decorated then).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

# One thread: on the 2-core CI machine, tiny ops (CPU SDPA with a mask above all) spend
# milliseconds per call synchronising two threads; one thread is several times faster here.
torch.set_num_threads(1)

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3", "deepseek_v3"]
ENGINE_FAMILIES = ["llama", "qwen2", "qwen3"]  # families with a compact engine implementation


def tiny_config(family: str, **overrides):
    common = dict(vocab_size=301, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=16, **common)
    elif family == "gemma3":
        cfg = transformers.Gemma3TextConfig(head_dim=16, sliding_window=8, **common)
    elif family == "deepseek_v3":
        # MLA + MoE as in Kimi-K2: first layer dense, the rest routed experts.
        cfg = transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
            topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16)
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def make_tiny(family: str, seed: int = 0, **overrides):
    """A tiny random HF causal LM in fp32, eval mode, eager attention."""
    torch.manual_seed(seed)
    cfg = tiny_config(family, **overrides)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.eval()


@pytest.fixture(params=FAMILIES)
def tiny_any(request):
    return make_tiny(request.param)


@pytest.fixture(params=ENGINE_FAMILIES)
def tiny_engine_family(request):
    return make_tiny(request.param)


@pytest.fixture(scope="session")
def vllm_venv():
    """(python, env) of the vLLM CPU venv. Without it the test skips, unless
    FLEDGE_REQUIRE_VLLM is set (CI), where it fails instead."""
    import os

    from fledge.core.vllm_cpu import venv_dir, venv_env, venv_python, venv_ready

    if not venv_ready():
        if os.environ.get("FLEDGE_REQUIRE_VLLM"):
            pytest.fail(f"{venv_dir()}: no vLLM venv but FLEDGE_REQUIRE_VLLM is set; run scripts/setup_vllm.sh")
        pytest.skip(f"{venv_dir()}: no vLLM venv; run scripts/setup_vllm.sh (or set FLEDGE_REQUIRE_VLLM to fail)")
    return venv_python(), venv_env()


def session_processes(sid: int) -> list[str]:
    """Live (not zombie) processes of session `sid`, read from /proc: a killed run's workers
    keep its session after they lose their parent."""
    found = []
    for d in os.listdir("/proc"):
        try:
            name, fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)
        except (OSError, ValueError):
            continue
        state, session = fields.split()[0], int(fields.split()[3])
        if session == sid and state not in "ZX":
            found.append(f"{d}{name})")
    return found


@pytest.mark.slow  # six CLI runs, each starting two worker processes (~2 min on 2 loaded cores)


def kill_at(cmd: list, env: dict, points, settle: float = 0.0) -> int:
    """Start `cmd` once per point, kill -9 it when that point is `reached()` (or let it end),
    and check that nothing of its session lives `settle` seconds later: how many kills landed
    on a running process."""
    import subprocess
    import time

    landed = 0
    for reached in points:
        p = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        while p.poll() is None and not reached():
            time.sleep(0.01)
        landed += p.poll() is None
        p.kill()
        p.wait()
        time.sleep(settle)
        assert session_processes(p.pid) == [], "processes of the killed run still alive"
    return landed
