"""A P-EAGLE drafter exported by fledge, served by real vLLM (CPU build) with
`parallel_drafting` beside SmolLM2, unchanged: vLLM's greedy output is fledge's (fledge's
equals plain decoding: tests/test_peagle.py), and vLLM accepts the same drafts at every
position as fledge's engine does on the same prompts (fp32, a chain of 3, no EOS), in both export
layouts (eagle3 and speculators), and for a drafter of two layers (vLLM's `layers.1.*` after
the first). One vLLM start each: the plain run is fledge's engine.

The drafter's head covers only the four tokens the target writes most on these prompts and its
first draft imitates the target, so rounds reach the mask slots; which of the four a slot picks
depends on every weight it has (fc, the layer, mask_hidden, the mask token, d2t): equal counts
at every position check the one-forward chain, not only the loading."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_vllm_dflash import PROMPTS, run_vllm

from fledge.core.config import DraftConfig
from fledge.core.conventions import accept_length
from fledge.core.shape import Shape
from fledge.core.target import load_target, resolve_target
from fledge.drafter.checkpoint import export_checkpoint, load_checkpoint
from fledge.drafter.eagle3 import Eagle3Draft
from fledge.engine import SamplingParams, build_engine_target, generate_ar
from fledge.engine.parallel import ParallelDrafter
from fledge.engine.spec import generate_spec
from fledge.engine.stats import SpecStats

K, MAX_TOKENS, MASK = 3, 32, 16  # 16: SmolLM2's <empty_output>, what `fledge train` picks


def frequent_token_drafter(hf, tokens: list[int], layers: int = 1) -> Eagle3Draft:
    """Random, but its first draft imitates the target (fc passes the highest aux state through,
    the head is the target's rows of `tokens`, its norm the target's, the layers' outputs scaled
    down), so rounds reach the mask slots, whose drafts (random mask_hidden) are then right now
    and then."""
    ids = torch.tensor(sorted(tokens))
    cfg = DraftConfig.from_target(hf.config, draft_vocab_size=len(tokens)).replace(ptd_token_id=MASK,
                                                                                    num_hidden_layers=layers)
    torch.manual_seed(0)
    draft = Eagle3Draft.from_target(cfg, hf, ids)
    H = cfg.hidden_size
    with torch.no_grad():
        for p in draft.parameters():  # norms start at ones: randomise so a misplaced one shows
            if p.requires_grad and p.ndim == 1:
                p.uniform_(0.5, 1.5)
        draft.fc.weight.zero_()[:, 2 * H:] = torch.eye(H)
        for layer in draft.stack():
            layer.self_attn.o_proj.weight.mul_(0.3)
            if layer is not draft.midlayer:
                layer.mlp.down_proj.weight.mul_(0.3)
        draft.lm_head.weight.copy_(hf.lm_head.weight[ids])
        draft.norm.weight.copy_(hf.model.norm.weight)
        draft.mask_hidden.normal_(0, 1)
    return draft


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("layout,layers", [("eagle3", 1), ("speculators", 1), ("eagle3", 2)])
def test_vllm_serves_peagle_as_fledge_drafts(vllm_jobs, tmp_path, layout, layers):
    target_dir = resolve_target("smollm2-135m")
    target = load_target(str(target_dir))
    engine = build_engine_target(target.model, torch.float32, "cpu")
    params = SamplingParams(max_new_tokens=MAX_TOKENS)
    prompts = [target.tokenizer(p)["input_ids"] for p in PROMPTS]
    plain = [generate_ar(engine, [p], params, eos_ids=[])[0][0] for p in prompts]
    frequent = [t for t, _ in Counter(t for ids in plain for t in ids).most_common(4)]
    out = export_checkpoint(frequent_token_drafter(target.model, frequent, layers), tmp_path / "peagle", layout=layout,
                            dtype=torch.float32, verifier=str(target_dir))

    draft = load_checkpoint(out, embed_from=target.model).eval()
    assert len(draft.stack()) == layers
    runs = [generate_spec(engine, ParallelDrafter(draft, Shape(K, 1, K + 1), engine), p, params, eos_ids=[])
            for p in prompts]
    assert [o for o, _ in runs] == plain
    stats = SpecStats.merge([s for _, s in runs])
    ours = [sum(a >= p for a in stats.accepted) for p in range(1, K + 1)]
    assert ours[1] > 0, f"no mask slot's draft was accepted ({ours}): the test would prove little"

    spec = run_vllm(vllm_jobs, tmp_path, target_dir, out, method="eagle3", extra=["--parallel-drafting"])
    sd = spec["spec_decode"]
    assert spec["outputs"] == plain, "vLLM's greedy output with the P-EAGLE drafter differs from plain decoding"
    assert spec["aux_layer_ids"] == list(draft.cfg.aux_layer_ids), "vLLM captured other layers than the ones exported"
    v_al, f_al = accept_length(sd["num_accepted_tokens"], sd["num_drafts"]), stats.accept_length()
    print(f"\naccept length: vLLM {v_al:.3f}, fledge {f_al:.3f}; per position vLLM "
          f"{sd['num_accepted_tokens_per_pos']}, fledge {ours}")
    assert (sd["num_accepted_tokens_per_pos"], sd["num_drafts"]) == (ours, stats.steps), (sd, ours, stats.steps)
