"""Shared fixtures: tiny random targets of every family fledge must handle.

Sizes are chosen so a forward pass takes milliseconds on the CPU, while keeping what
matters: GQA (heads != kv heads), 8 layers (default aux ids (2, 4, 5) are distinct), odd vocab.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

# The prefix attention kernel is Triton: on this GPU-less machine its tests run it under Triton's
# interpreter, which must be chosen before the first import of triton (kernels are decorated then).
os.environ.setdefault("TRITON_INTERPRET", "1")
# The CLI runs and engine servers the tests start get one thread too (see below): two of them,
# each spinning two threads on two cores beside the other test process, slow every one of them.
os.environ.setdefault("OMP_NUM_THREADS", "1")

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


ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "drafters" / "smollm2-135m"
SPEC_K = 3  # the shared speculating server's chain


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """vLLM tests first, and on one xdist worker (--dist loadgroup): they share the session's
    servers, which start once there, and the longest unit of work starts first while the other
    worker takes the rest."""
    first = [item for item in items if item.get_closest_marker("vllm")]
    for item in first:
        item.add_marker(pytest.mark.xdist_group("vllm"))
    items[:] = first + [item for item in items if not item.get_closest_marker("vllm")]


SHARED = pytest.StashKey[list]()  # the session's shared servers and vLLM runner, stopped after the last vLLM test


def pytest_runtest_teardown(item, nextitem):
    """Stop the shared servers and runner once no vLLM test follows (they run first, together),
    so their memory is free for the rest of the session."""
    if item.get_closest_marker("vllm") and not (nextitem and nextitem.get_closest_marker("vllm")):
        for server in item.config.stash.get(SHARED, []):
            server.stop()


def load_script(name: str):
    """scripts/<name>.py as a module (registered, so its dataclasses resolve their module)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def vllm_logs(tmp_path_factory) -> Path:
    """The shared servers' logs (plain.log, spec.log) and the vLLM runner's (vllm_run.log)."""
    return tmp_path_factory.mktemp("vllm_logs")


def _smollm2_server(config, logs: Path, log: str, extra: tuple = ()):
    from fledge.core.target import resolve_target
    server = load_script("vllm_serve").start(resolve_target("smollm2-135m"), "smollm2-135m", log=logs / log,
                                             timeout=900, extra=extra)
    config.stash.setdefault(SHARED, []).append(server)
    return server


@pytest.fixture(scope="session")
def vllm_plain(vllm_venv, vllm_logs, pytestconfig):
    """SmolLM2 served plain by scripts/vllm_serve.py (its defaults: fp32, max-model-len 1024),
    shared by every module that needs one: starting a server costs about a minute here."""
    server = _smollm2_server(pytestconfig, vllm_logs, "plain.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_spec(vllm_venv, vllm_logs, pytestconfig):
    """SmolLM2 speculating with the shipped EAGLE-3 drafter, a chain of SPEC_K, otherwise as
    vllm_plain; shared like it."""
    from fledge.perf.launch import speculative_config
    server = _smollm2_server(pytestconfig, vllm_logs, "spec.log",
                             ("--speculative-config", json.dumps(speculative_config(str(SHIPPED), SPEC_K))))
    yield server
    server.stop()


VLLM_RUNNER = ROOT / "scripts" / "vllm_run.py"


class VllmJobs:
    """scripts/vllm_run.py --jobs: the session's vLLM engines, one after another in one process
    of the vLLM venv, which imports vLLM once for all of them."""

    def __init__(self, python: Path, env: dict, log: Path):
        self.log = log
        with open(log, "ab") as err:  # the child holds its own descriptor
            self.proc = subprocess.Popen([str(python), str(VLLM_RUNNER), "--jobs"], env=env, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)

    def run(self, argv: list) -> dict:
        """vllm_run.py's result for these arguments (the JSON it writes to --out)."""
        argv = [str(a) for a in argv]
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        status = ""
        while status not in ("ok", "failed"):  # vLLM itself may print to stdout
            line = self.proc.stdout.readline()
            assert line, f"vllm_run.py --jobs exited:\n{self.log.read_text()[-4000:]}"
            status = line.strip()
        assert status == "ok", f"vLLM failed:\n{self.log.read_text()[-4000:]}"
        return json.loads(Path(argv[argv.index("--out") + 1]).read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def vllm_jobs(vllm_venv, vllm_logs, pytestconfig) -> VllmJobs:
    """The session's vllm_run.py process (its log: vllm_run.log), stopped with the shared servers."""
    jobs = VllmJobs(*vllm_venv, vllm_logs / "vllm_run.log")
    pytestconfig.stash.setdefault(SHARED, []).append(jobs)
    yield jobs
    jobs.stop()


@pytest.fixture(scope="session")
def vllm_greedy(vllm_jobs, tmp_path_factory):
    """run(prompts, max_tokens) -> scripts/vllm_run.py's result for SmolLM2 without a drafter
    (greedy, ignore_eos): the plain reference several modules compare speculation with, run
    once per distinct request."""
    from fledge.core.target import resolve_target
    done = {}

    def run(prompts: list[str], max_tokens: int) -> dict:
        key = (tuple(prompts), max_tokens)
        if key not in done:
            tmp = tmp_path_factory.mktemp("vllm_greedy")
            (tmp / "prompts.json").write_text(json.dumps(list(prompts)))
            done[key] = vllm_jobs.run(["--target", resolve_target("smollm2-135m"), "--prompts", tmp / "prompts.json",
                                       "--out", tmp / "base.json", "--max-tokens", max_tokens])
        return done[key]
    return run
