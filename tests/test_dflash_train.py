"""DFlash training: the batched block forward equals each block recomputed from scratch (and
so the engine's proposals), the loss falls and the drafter learns, the exported drafter drafts
exactly in the engine, kill -9 resumes to the same curve, and refused inputs."""

from __future__ import annotations

import signal

import pytest
import torch
from conftest import make_tiny
from test_dflash import block_logits
from test_train import (
    V,
    config,
    curve,
    interrupt_then_resume,
    saved_step,
    tiny_target,
    write_data,
)

from fledge.core.errors import FledgeError
from fledge.core.shape import Shape
from fledge.drafter.dflash import DFlashConfig, DFlashDraft
from fledge.engine import SamplingParams, build_engine_target, generate_ar
from fledge.engine.block import load_block_drafter
from fledge.engine.spec import generate_spec
from fledge.train.dflash import (
    BlockTrain,
    default_mask_token,
    sample_anchors,
    valid_anchors,
)
from fledge.train.features import load_samples
from fledge.train.loop import train

MASK = V - 1


def test_batched_blocks_equal_blocks_from_scratch():
    hf = make_tiny("llama")
    torch.manual_seed(1)
    cfg = DFlashConfig.from_target(hf.config, mask_token_id=MASK, num_layers=2, block_size=5)
    draft = DFlashDraft.from_target(cfg, hf)
    for p in draft.parameters():  # norms start at ones; randomise so a misplaced one would show
        if p.requires_grad:
            p.data.normal_(0, 0.2 if p.ndim > 1 else 1.0)
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i] for i in cfg.aux_layer_ids], -1)
        anchors = torch.tensor([[1, 6, 7, 15], [3, 4, 12, 18]])  # blocks overlap and run past the end
        out = BlockTrain(draft, 4, 0.8, 8).block_states(ids, aux, anchors)
        for b in range(2):
            for n, a in enumerate(anchors[b].tolist()):
                want = block_logits(draft, ids[b], aux[b], a, 4)
                torch.testing.assert_close(draft.logits(out[b, n, 1:]), want, atol=1e-5, rtol=1e-5)


def test_anchors_are_trained_positions():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    ok = valid_anchors(mask)
    assert ok[0].nonzero().flatten().tolist() == [1, 2, 3, 5, 6]  # x_{a+1} trained, a >= 1, a+1 < T
    for n in (2, 3, 50):
        a, present = sample_anchors(mask, n, torch.Generator().manual_seed(n))
        assert a.shape[1] == min(n, 6) and bool(ok.gather(1, a)[present].all())
        assert all(len(set(r)) == len(r) and r == sorted(r) for r in a.tolist())
        assert present.sum(1).tolist() == [min(n, 5), min(n, 6)]


@pytest.mark.slow
def test_loss_falls_and_block_drafter_learns(tmp_path):
    data = write_data(tmp_path / "data.jsonl", n=64)
    target = tiny_target()
    with torch.no_grad():  # a random head is near-uniform; sharpen it so there is something to learn
        target.model.lm_head.weight.mul_(50)
        tops = torch.cat([target.model(s.input_ids[None]).logits[0].argmax(-1) for s in load_samples(data, 2048, V)])
    majority = tops.bincount().max().item() / tops.numel()
    result = train(config(tmp_path, method="dflash", mask_token_id=MASK, max_steps=120, eval_samples=8,
                          eval_every=120, blocks_per_sample=32, head="target"), target)
    c = curve(tmp_path / "run")
    assert sum(c[-5:]) / 5 < sum(c[:5]) / 5 - 1.0
    ev = result["eval"]
    assert len(ev["acc"]) == 4 and ev["acc"][0] > 1.5 * majority
    assert ev["replay_accept_len"] > 1.0
    # the exported drafter in the engine: greedy output is AR's, and some drafts are accepted
    engine = build_engine_target(target.model, torch.float32, "cpu")
    d = load_block_drafter(result["draft"], Shape(4, 1, 5), target.model, engine, "cpu", torch.float32)
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    prompts = [s.input_ids[:6].tolist() for s in load_samples(data, 2048, V)[:3]]
    accepted = 0
    for prompt in prompts:
        out, stats = generate_spec(engine, d, prompt, params, eos_ids=[])
        assert out == generate_ar(engine, [prompt], params, eos_ids=[])[0][0]
        accepted += sum(stats.accepted)
    assert accepted > 0


@pytest.mark.slow
def test_dflash_kill9_then_resume_gives_the_same_curve(tmp_path):
    rc, step = interrupt_then_resume(tmp_path, signal.SIGKILL, lambda d: saved_step(d) >= 3, max_steps=10,
                                     save_every=3, method="dflash", mask_token_id=MASK, blocks_per_sample=4)
    assert rc == -signal.SIGKILL and step in (3, 6, 9)


def test_refused_inputs(tmp_path):
    write_data(tmp_path / "data.jsonl")
    with pytest.raises(FledgeError, match="method"):
        config(tmp_path, method="medusa")
    with pytest.raises(FledgeError, match="EAGLE-3.1"):
        config(tmp_path, method="dflash", fc_norm=True)
    with pytest.raises(FledgeError, match="mask_token_id"):
        train(config(tmp_path, method="dflash", mask_token_id=V), tiny_target())


def test_default_mask_token_is_an_unused_added_token():
    from transformers import AutoTokenizer

    from fledge.core.target import resolve_target
    tok = AutoTokenizer.from_pretrained(resolve_target("smollm2-135m"))
    assert default_mask_token(tok, 49152) == 16 and 16 not in tok.all_special_ids


def test_demo_trains_a_dflash_miniature_that_drafts_exactly(tmp_path):
    """`fledge demo --method dflash`'s steps at toy sizes: the miniature trains and exports in
    vLLM's DFlash layout, doctor passes it, and the speed step's drafter writes plain decoding's
    tokens on every prompt."""
    from test_target import tiny_tokenizer

    from fledge.core.target import Target
    from fledge.data.vocab import build_vocab, save_vocab
    from fledge.demo import _compare, speed_drafters, train_miniature
    from fledge.doctor.checks import exit_code
    from fledge.doctor.doctor import doctor
    from fledge.drafter.layout import is_dflash

    target = Target(make_tiny("llama"), tiny_tokenizer(V - 1), "tiny", None)  # one id left for the mask
    data, held = write_data(tmp_path / "d.jsonl", n=8), write_data(tmp_path / "h.jsonl", n=2, seed=1)
    _, t2d = build_vocab(data, V, 64)
    save_vocab(tmp_path / "v.safetensors", t2d.nonzero().flatten(), V, {})
    out, ev = train_miniature("dflash", target, data, held, tmp_path / "v.safetensors", tmp_path, 2)
    assert is_dflash(out) and len(ev["acc"]) == 3
    assert exit_code(doctor(str(out))) < 2
    engine = build_engine_target(target.model, torch.float32, "cpu")
    drafters = speed_drafters("dflash", out, target.model, engine, 3, 0)
    prompts = [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9)]
    summary, equal = _compare(drafters, prompts, engine, [], 10, 1)
    assert list(summary) == ["AR", "dflash chain 3, head 64"] and equal == len(prompts)
    assert summary["dflash chain 3, head 64"]["accept_length"] >= 1
