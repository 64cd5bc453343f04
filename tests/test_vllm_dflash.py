"""A DFlash drafter exported by fledge, served by real vLLM (CPU build) beside SmolLM2 (a Llama
target), unchanged: greedy output equals plain vLLM's, and vLLM accepts the same drafts at every
position as fledge's engine does on the same prompts (fp32, a chain of 3, no EOS). The drafter
reads five target layers (EAGLE-3 reads three; vLLM captures what `target_layer_ids` names), and
is served in both export layouts: vLLM's DFlashDraftModel one and the speculators library's.

The drafter is random but its head covers only the target's four most frequent output tokens:
its drafts are accepted now and then, and which of the four it picks depends on every weight
(context keys from the aux states, the block's attention, the mask embedding, d2t), so equal
counts at every position check the whole forward, not only the loading."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import VllmJobs

from fledge.core.conventions import accept_length
from fledge.core.shape import Shape
from fledge.core.target import load_target, resolve_target
from fledge.drafter.dflash import DFlashConfig, DFlashDraft
from fledge.drafter.dflash_checkpoint import export_dflash
from fledge.engine import SamplingParams, build_engine_target
from fledge.engine.block import load_block_drafter
from fledge.engine.spec import generate_spec
from fledge.engine.stats import SpecStats

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
           "List three colors: red,"]
MAX_TOKENS = 32
K = 3
AUX = (2, 8, 15, 21, 28)  # five of SmolLM2's 30 layers, spread as DFlash's reference drafters read theirs


def run_vllm(jobs: VllmJobs, tmp: Path, target: Path, drafter: Path | None = None, method: str = "dflash",
             extra: tuple = ()) -> dict:
    (tmp / "prompts.json").write_text(json.dumps(PROMPTS))
    out = tmp / ("spec.json" if drafter else "base.json")
    argv = ["--target", target, "--prompts", tmp / "prompts.json", "--out", out, "--max-tokens", MAX_TOKENS,
            "--num-spec-tokens", K]
    return jobs.run(argv + (["--drafter", drafter, "--method", method, *extra] if drafter else []))


def frequent_token_drafter(hf, tokens: list[int]) -> DFlashDraft:
    cfg = DFlashConfig.from_target(hf.config, mask_token_id=16, num_layers=2, block_size=K + 1,
                                   draft_vocab_size=len(tokens), aux_layer_ids=AUX)
    torch.manual_seed(0)
    draft = DFlashDraft.from_target(cfg, hf, torch.tensor(sorted(tokens)))
    with torch.no_grad():
        for name, p in draft.named_parameters():  # norms start at ones: randomise so a misplaced one shows
            if p.requires_grad and p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return draft


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dflash", "speculators"])
def test_vllm_serves_dflash_as_fledge_drafts(vllm_jobs, vllm_greedy, tmp_path, layout):
    target_dir = resolve_target("smollm2-135m")
    base = vllm_greedy(PROMPTS, MAX_TOKENS)
    frequent = [t for t, _ in Counter(t for ids in base["outputs"] for t in ids).most_common(4)]
    target = load_target(str(target_dir))
    out = export_dflash(frequent_token_drafter(target.model, frequent), tmp_path / "dflash", dtype=torch.float32,
                        verifier=str(target_dir), layout=layout)

    engine = build_engine_target(target.model, torch.float32, "cpu")
    drafter = load_block_drafter(str(out), Shape(K, 1, K + 1), target.model, engine, "cpu", torch.float32)
    params = SamplingParams(max_new_tokens=MAX_TOKENS)
    runs = [generate_spec(engine, drafter, target.tokenizer(p)["input_ids"], params, eos_ids=[]) for p in PROMPTS]
    stats = SpecStats.merge([s for _, s in runs])
    ours = [sum(a >= p for a in stats.accepted) for p in range(1, K + 1)]
    assert ours[0] > 0, "the frequent-token drafter never got a draft accepted: the test would prove little"

    spec = run_vllm(vllm_jobs, tmp_path, target_dir, out)
    sd = spec["spec_decode"]
    assert spec["outputs"] == base["outputs"], "speculation changed vLLM's greedy output"
    assert spec["outputs"] == [o for o, _ in runs], "vLLM's greedy output differs from fledge's"
    assert spec["aux_layer_ids"] == list(drafter.aux_ids), "vLLM captured other layers than the ones exported"
    assert (sd["num_accepted_tokens_per_pos"], sd["num_drafts"]) == (ours, stats.steps), (sd, ours, stats.steps)
    v_al, f_al = accept_length(sd["num_accepted_tokens"], sd["num_drafts"]), stats.accept_length()
    print(f"\naccept length: vLLM {v_al:.3f}, fledge {f_al:.3f}; per position {ours}")
