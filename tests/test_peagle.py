"""P-EAGLE (parallel drafting): the engine's one-forward chain equals plain decoding token for
token (fp32), training's unrolled mask slots accept exactly what the engine accepts on the same
text, the checkpoint carries what vLLM's parallel drafting reads, and `fledge train --method
peagle` trains and exports one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_engine_spec import tiny_setup
from test_train import V, config, write_data

from fledge.core.conventions import chain_replay
from fledge.core.errors import FledgeError
from fledge.core.shape import Shape
from fledge.core.target import Target
from fledge.drafter.checkpoint import export_checkpoint, load_checkpoint
from fledge.engine import SamplingParams, generate_ar
from fledge.engine.drafters import Eagle3Drafter
from fledge.engine.parallel import ParallelDrafter
from fledge.engine.spec import generate_spec
from fledge.train.features import TargetHead, feature_model, online_features
from fledge.train.ttt import TTT

VOCAB, MASK = 16, 15  # a small vocabulary: random mask slots are right often enough to test


def parallel_setup(seed=0, layers=1):
    """tiny_setup's target and imitating drafter (of `layers` layers), with mask slots whose
    hidden is random."""
    hf, target, draft = tiny_setup("llama", vocab=VOCAB, seed=seed, initializer_range=0.15, draft_layers=layers)
    draft.add_mask_slots(MASK)
    with torch.no_grad():
        draft.mask_hidden.normal_(0, 1)
    return hf, target, draft.eval()


@pytest.mark.parametrize("layers", [1, 2])
def test_parallel_chain_equals_ar_and_training_replays_it(layers):
    """Chains of 1..5 drafted in one forward write AR's tokens; on that text, TTT's unroll with
    mask slots (training) hits exactly where the engine's rounds accepted; for a two-layer
    drafter (the published P-EAGLE drafters are deeper) as for one."""
    hf, target, d = parallel_setup(layers=layers)
    head, feats = TargetHead.from_model(hf, d.target_ids(), "cpu"), feature_model(hf)
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    lengths = set()
    for seed in range(3):
        prompt = torch.randint(0, MASK, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
        ar = generate_ar(target, [prompt], params, eos_ids=[])[0][0]
        for k in (1, 3, 5):
            out, _ = generate_spec(target, ParallelDrafter(d, Shape(k, 1, k + 1), target), prompt, params, eos_ids=[])
            assert out == ar, (seed, k)
        out, st = generate_spec(target, ParallelDrafter(d, Shape(4, 1, 5), target), prompt, params, eos_ids=[])
        ids = torch.tensor([prompt + ar])
        answer = torch.tensor([[i >= len(prompt) for i in range(ids.shape[1])]])
        aux, hidden = online_features(feats, tuple(d.cfg.aux_layer_ids), ids, torch.ones_like(ids))
        probs, top = head.view(hidden)
        with torch.no_grad():
            _, _, hit_map = TTT(d, 4, 0.8)(ids, aux, probs, top, answer, torch.ones(4), hit_map=True)
        walked = chain_replay(hit_map.long().cumprod(0).sum(0)[0].tolist(), answer[0].tolist())
        assert walked[:len(st.accepted) - 1] == st.accepted[:-1], (walked, st.accepted)
        lengths |= set(st.accepted)
    assert max(lengths) >= 2, lengths  # some mask slot's draft was accepted


def test_checkpoint_carries_what_vllm_reads(tmp_path):
    """config.json's ptd_token_id and the `mask_hidden` tensor [1, 3H] (vLLM's names); the
    loaded drafter drafts in parallel and exactly; bad uses are one FledgeError."""
    hf, target, d = parallel_setup()
    out = export_checkpoint(d, tmp_path / "p", dtype=torch.float32)
    cj = json.loads((out / "config.json").read_text())
    assert cj["ptd_token_id"] == MASK and cj["architectures"] == ["LlamaForCausalLMEagle3"]
    assert load_file(out / "model.safetensors")["mask_hidden"].shape == (1, 3 * d.cfg.target_hidden_size)
    back = load_checkpoint(out, embed_from=hf).eval()
    assert back.cfg.ptd_token_id == MASK and torch.equal(back.mask_hidden, d.mask_hidden)
    from fledge.doctor.checks import FAIL
    from fledge.doctor.doctor import doctor
    assert not [c for c in doctor(str(out)) if c.status == FAIL]
    prompt = [3, 1, 4, 1, 5, 9, 2]
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    ar = generate_ar(target, [prompt], params, eos_ids=[])[0][0]
    assert generate_spec(target, ParallelDrafter(back, Shape(3, 1, 4), target), prompt, params, eos_ids=[])[0] == ar
    with pytest.raises(FledgeError, match="chain"):
        ParallelDrafter(back, Shape(3, 2, 6), target)
    _, _, plain = tiny_setup("llama", vocab=VOCAB)
    with pytest.raises(FledgeError, match="P-EAGLE"):
        ParallelDrafter(plain, Shape(3, 1, 4), target)
    with pytest.raises(FledgeError, match="ptd_token_id"):
        d.cfg.replace(ptd_token_id=VOCAB)
    assert isinstance(Eagle3Drafter(plain, Shape(3, 1, 4), target), Eagle3Drafter)


@pytest.mark.parametrize("field", ["mask_token_id", "dspark_noise_token_id", "pard_token"])
def test_mask_token_read_where_vllm_reads_it(tmp_path, field):
    """A drafter trained elsewhere may name its mask token as any field vLLM's parallel drafting
    reads: fledge finds it there, in vLLM's order (`mask_token_id` before `ptd_token_id`), and
    loads, checks and re-exports the drafter as P-EAGLE."""
    from fledge.doctor.checks import FAIL
    from fledge.doctor.doctor import doctor
    from fledge.drafter.layout import is_parallel

    hf, _, d = parallel_setup()
    out = export_checkpoint(d, tmp_path / "p", dtype=torch.float32)
    cj = json.loads((out / "config.json").read_text())
    cj[field] = cj.pop("ptd_token_id")
    (out / "config.json").write_text(json.dumps(cj))
    assert is_parallel(out) and load_checkpoint(out, embed_from=hf).cfg.ptd_token_id == MASK
    assert not [c for c in doctor(str(out)) if c.status == FAIL]
    again = export_checkpoint(load_checkpoint(out, embed_from=hf), tmp_path / "again", dtype=torch.float32)
    assert json.loads((again / "config.json").read_text())["ptd_token_id"] == MASK
    if field == "mask_token_id":  # both spelled, vLLM takes mask_token_id
        cj["ptd_token_id"] = MASK - 1
        (out / "config.json").write_text(json.dumps(cj))
        assert load_checkpoint(out, embed_from=hf).cfg.ptd_token_id == MASK


def test_speculators_layout_is_the_peagle_type_vllm_reads(tmp_path):
    """In the speculators layout a P-EAGLE drafter is speculators' `peagle` type with a top-level
    `mask_token_id` (what vLLM's speculators reader requires, turning parallel drafting on by
    itself); it loads back the same, doctor passes it, and `vllm serve <dir>` drafts in parallel."""
    from fledge.doctor.checks import FAIL, PASS
    from fledge.doctor.doctor import doctor
    from fledge.drafter.layout import is_parallel

    hf, target, d = parallel_setup()
    out = export_checkpoint(d, tmp_path / "p", layout="speculators", dtype=torch.float32, verifier="some/target")
    cj = json.loads((out / "config.json").read_text())
    assert (cj["speculators_model_type"], cj["speculators_config"]["algorithm"]) == ("peagle", "peagle")
    assert cj["mask_token_id"] == MASK and "ptd_token_id" not in cj and cj["architectures"] == ["PEagleSpeculator"]
    assert is_parallel(out)
    back = load_checkpoint(out, embed_from=hf).eval()
    assert back.cfg.ptd_token_id == MASK and torch.equal(back.mask_hidden, d.mask_hidden)
    checks = {c.name: c.status for c in doctor(str(out), launch=f"vllm serve {out}")}
    assert FAIL not in checks.values(), checks
    assert checks["launch.parallel_drafting"] == PASS
    _, _, plain = tiny_setup("llama", vocab=VOCAB)
    seq = export_checkpoint(plain, tmp_path / "s", layout="speculators", verifier="some/target")
    assert json.loads((seq / "config.json").read_text())["speculators_model_type"] == "eagle3" and not is_parallel(seq)


def test_train_method_peagle_trains_mask_slots_and_exports(tmp_path):
    """`--method peagle`: a fresh drafter gains mask slots (the given token) and exports them; a
    run from that drafter (--init) moves its mask_hidden; the result drafts exactly."""
    from conftest import make_tiny

    from fledge.engine import build_engine_target
    from fledge.train.loop import train

    write_data(tmp_path / "data.jsonl", n=24)
    hf = make_tiny("llama")
    target = Target(hf, None, "tiny", None)
    first = train(config(tmp_path, method="peagle", mask_token_id=V - 1, max_steps=2, ttt_steps=3), target)
    d0 = load_checkpoint(first["draft"], embed_from=hf)
    assert d0.cfg.ptd_token_id == V - 1 and len(first["eval"]["acc"]) == 3
    again = train(config(tmp_path, out="again", method="peagle", init=first["draft"], max_steps=3, ttt_steps=3), target)
    d = load_checkpoint(again["draft"], embed_from=hf).eval()
    assert d.cfg.ptd_token_id == V - 1 and not torch.equal(d.mask_hidden, d0.mask_hidden)
    engine = build_engine_target(hf, torch.float32, "cpu")
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    ar = generate_ar(engine, [prompt], params, eos_ids=[])[0][0]
    assert generate_spec(engine, ParallelDrafter(d, Shape(3, 1, 4), engine), prompt, params, eos_ids=[])[0] == ar
    # --draft-layers grows the warm start (Eagle3Draft.add_layers): a run that barely moves it
    # evaluates as the one-layer start does, and exports the deeper drafter, which drafts exactly
    same = train(config(tmp_path, out="same", method="peagle", init=again["draft"], max_steps=1, lr=1e-12,
                        ttt_steps=3, eval_samples=8), target)
    deep = train(config(tmp_path, out="deep", method="peagle", init=again["draft"], draft_layers=3, max_steps=1,
                        lr=1e-12, ttt_steps=3, eval_samples=8), target)
    assert deep["eval"]["objective"] == pytest.approx(same["eval"]["objective"], rel=1e-4)
    assert json.loads((tmp_path / "deep" / "draft" / "config.json").read_text())["num_hidden_layers"] == 3
    d3 = load_checkpoint(deep["draft"], embed_from=hf).eval()
    assert len(d3.stack()) == 3
    assert generate_spec(engine, ParallelDrafter(d3, Shape(3, 1, 4), engine), prompt, params, eos_ids=[])[0] == ar
    with pytest.raises(FledgeError, match="--init .*3 layers.*removed to 2"):
        train(config(tmp_path, out="shallow", method="peagle", init=deep["draft"], draft_layers=2, max_steps=1,
                     ttt_steps=3), target)


def test_train_with_cod_sampling(tmp_path):
    """`--cod R`: a P-EAGLE run trains on COD-sampled rows and learns (its eval, which runs every
    row, improves); the flag is refused for DFlash and outside (0, 1]."""
    from conftest import make_tiny

    from fledge.cli import main
    from fledge.core.config import TrainConfig
    from fledge.train.loop import train

    write_data(tmp_path / "data.jsonl", n=24)
    target = Target(make_tiny("llama"), None, "tiny", None)
    still = train(config(tmp_path, out="still", method="peagle", mask_token_id=V - 1, cod=0.5, max_steps=1,
                         lr=1e-12, ttt_steps=3, eval_samples=8), target)
    cod = train(config(tmp_path, out="cod", method="peagle", mask_token_id=V - 1, cod=0.5, max_steps=30,
                       lr=3e-3, ttt_steps=3, eval_samples=8), target)
    assert cod["eval"]["objective"] < still["eval"]["objective"]
    with pytest.raises(FledgeError, match="--cod samples TTT rows"):
        TrainConfig(data="d", out="o", method="dflash", cod=0.5)
    with pytest.raises(FledgeError, match="--cod 1.5"):
        TrainConfig(data="d", out="o", cod=1.5)
    assert main(["train", "--data", str(tmp_path / "data.jsonl"), "--out", str(tmp_path / "x"), "--cod", "0"]) == 2


def test_doctor_wants_parallel_drafting_on_the_launch_line_of_a_peagle_drafter(tmp_path):
    from fledge.doctor.checks import FAIL, PASS
    from fledge.doctor.doctor import doctor

    _, _, d = parallel_setup()
    out = export_checkpoint(d, tmp_path / "p")
    _, _, plain = tiny_setup("llama", vocab=VOCAB)
    seq = export_checkpoint(plain, tmp_path / "s")
    line = "vllm serve T --speculative-config '{\"method\": \"eagle3\", \"model\": \"%s\", \"num_speculative_tokens\": 3%s}'"

    def status(drafter, extra):
        return {c.name: c.status for c in doctor(str(drafter), launch=line % (drafter, extra))}.get("launch.parallel_drafting")

    assert status(out, ', "parallel_drafting": true') == PASS
    assert status(out, "") == FAIL
    assert status(seq, ', "parallel_drafting": true') == FAIL
    assert status(seq, "") is None
    sglang = ("python -m sglang.launch_server --model-path T --speculative-algorithm EAGLE3 "
              "--speculative-draft-model-path %s --speculative-num-steps 3 --speculative-eagle-topk 1 "
              "--speculative-num-draft-tokens 4")

    def sglang_status(drafter):
        return {c.name: c.status for c in doctor(str(drafter), launch=sglang % drafter)}.get("launch.parallel_drafting")

    assert sglang_status(out) == FAIL and sglang_status(seq) is None


def test_bench_runs_a_peagle_drafter_as_chains_equal_to_plain(tmp_path):
    """`fledge bench --target T --drafter PEAGLE_DIR`: chains (by default 7, 5, 3), every output
    equal to plain decoding's (fp32)."""
    from test_target import tiny_tokenizer

    from fledge.cli import main

    hf, _, d = parallel_setup()
    hf.save_pretrained(tmp_path / "t")
    tiny_tokenizer(VOCAB).save_pretrained(tmp_path / "t")
    out = export_checkpoint(d, tmp_path / "p", dtype=torch.float32)
    assert main(["bench", "--target", str(tmp_path / "t"), "--drafter", str(out), "--num-prompts", "2",
                 "--max-new-tokens", "12", "--device", "cpu", "--dtype", "float32", "--json", str(tmp_path / "b.json")]) == 0
    res = json.loads((tmp_path / "b.json").read_text())
    assert res["method"] == "peagle" and [r["shape"] for r in res["results"]] == ["s7 k1 n8", "s5 k1 n6", "s3 k1 n4"]
    assert all(r["equal_to_plain"] == r["prompts"] == 2 for r in res["results"])


def test_tune_prices_a_peagle_chain_as_one_forward_and_a_verify():
    """tune's block model on a P-EAGLE drafter: the longest chain's prediction is what was
    measured, and vLLM's flag serves it with parallel_drafting."""
    from fledge.engine.rig import EngineRig
    from fledge.perf.tune_block import chain_predictions, measure_block, vllm_flags

    hf, target, d = parallel_setup()
    rig = EngineRig(hf, None, target, d, [], torch.device("cpu"))
    prompts = [torch.randint(0, MASK, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 9)]
    m = measure_block(rig, rig.drafter, prompts, 4, 16, iters=1)
    preds = {p.shape.num_steps: p for p in chain_predictions(m["reach"], m["block_ms"], m["verify_ms"], m["ar_ms"])}
    assert sorted(preds) == [1, 2, 3, 4] and preds[4].accept_length == pytest.approx(m["accept_length"])
    spec = json.loads(vllm_flags("D", 4, "peagle").split("'")[1])
    assert spec == {"method": "eagle3", "model": "D", "num_speculative_tokens": 4, "parallel_drafting": True}


def test_demo_trains_a_peagle_miniature_that_drafts_exactly(tmp_path):
    """`fledge demo --method peagle`'s steps at toy sizes: the miniature trains and exports with
    its mask slots, and the speed step's drafters (whole head and cut head, one forward a
    chain) write plain decoding's tokens on every prompt."""
    from conftest import make_tiny
    from test_target import tiny_tokenizer

    from fledge.data.vocab import build_vocab, save_vocab
    from fledge.demo import _compare, speed_drafters, train_miniature
    from fledge.engine import build_engine_target

    target = Target(make_tiny("llama"), tiny_tokenizer(V - 1), "tiny", None)  # one id left for the mask
    data, held = write_data(tmp_path / "d.jsonl", n=8), write_data(tmp_path / "h.jsonl", n=2, seed=1)
    _, t2d = build_vocab(data, V, 64)
    save_vocab(tmp_path / "v.safetensors", t2d.nonzero().flatten(), V, {})
    out, ev = train_miniature("peagle", target, data, held, tmp_path / "v.safetensors", tmp_path, 2)
    assert json.loads((out / "config.json").read_text())["ptd_token_id"] == V - 1 and len(ev["acc"]) == 3
    engine = build_engine_target(target.model, torch.float32, "cpu")
    drafters = speed_drafters("peagle", out, target.model, engine, 3, 32)
    assert all(isinstance(d, ParallelDrafter) for d in drafters.values())
    prompts = [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9)]
    summary, equal = _compare(drafters, prompts, engine, [], 10, 1)
    assert list(summary) == ["AR", "peagle chain 3, head 64", "peagle chain 3, head 32"]
    assert equal == len(prompts) * 2


def test_generate_drafts_a_peagle_chain_in_one_forward(tmp_path, capsys):
    """`fledge generate --drafter PEAGLE_DIR`: the chain equals plain decoding (fp32); a tree
    shape is refused in one line, since the drafter runs as P-EAGLE, not step by step."""
    from test_target import tiny_tokenizer

    from fledge.cli import main

    hf, _, d = parallel_setup()
    hf.save_pretrained(tmp_path / "t")
    tiny_tokenizer(VOCAB).save_pretrained(tmp_path / "t")
    out = export_checkpoint(d, tmp_path / "p", dtype=torch.float32)
    args = ["generate", "--target", str(tmp_path / "t"), "--drafter", str(out), "--prompt", "w3 w4 w5",
            "--max-new-tokens", "16", "--device", "cpu", "--dtype", "float32"]
    assert main([*args, "--num-steps", "3", "--json", str(tmp_path / "g.json")]) == 0
    assert json.loads((tmp_path / "g.json").read_text())["equal_to_plain"] is True
    assert main([*args, "--num-steps", "3", "--topk", "2", "--num-draft-tokens", "6"]) == 2
    assert "P-EAGLE drafter proposes a chain" in capsys.readouterr().err
