"""The DFlash block drafter: the engine's cached block equals the block recomputed from scratch,
greedy speculative output equals AR token for token (fp32), the checkpoint round-trips in vLLM's
layout, and bad shapes are one FledgeError."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import ENGINE_FAMILIES, make_tiny

from fledge.core.errors import FledgeError
from fledge.core.shape import Shape
from fledge.drafter.dflash import DFlashConfig, DFlashDraft
from fledge.drafter.dflash_checkpoint import export_dflash, load_dflash
from fledge.engine import SamplingParams, build_engine_target, generate_ar
from fledge.engine.block import BlockDrafter, load_block_drafter
from fledge.engine.protocols import DraftInput
from fledge.engine.spec import generate_spec

VARIED = dict(vocab_size=32, initializer_range=0.25)
GREEDY_21 = SamplingParams(temperature=0.0, max_new_tokens=21)


def tiny_dflash(family="llama", seed=0, block=6, layers=2, draft_ids=None, aux=None):
    """A tiny target and a random DFlash drafter (mask token 31) whose head is the target's,
    reading the target layers `aux` (default EAGLE-3's three)."""
    hf = make_tiny(family, seed=seed, **VARIED)
    target = build_engine_target(hf, torch.float32, "cpu")
    torch.manual_seed(seed + 1)
    cfg = DFlashConfig.from_target(hf.config, mask_token_id=31, num_layers=layers, block_size=block,
                                   draft_vocab_size=None if draft_ids is None else len(draft_ids), aux_layer_ids=aux)
    return hf, target, DFlashDraft.from_target(cfg, hf, draft_ids).eval()


def block_logits(draft: DFlashDraft, ids, aux, anchor: int, steps: int) -> torch.Tensor:
    """The block at `anchor` of one sequence from scratch: context = the aux states of tokens
    0..anchor-1, the block = ids[anchor] and `steps` masks, plain SDPA without a mask (the
    block sees the whole context and itself). Draft logits [steps, Vd]."""
    kv = draft.context_kv(aux[None, :anchor], torch.arange(anchor)[None])
    blk = torch.cat([ids[anchor:anchor + 1], torch.full((steps,), draft.cfg.mask_token_id)])[None]

    def attend(layer, q, k, v):
        rep = q.shape[1] // k.shape[1]
        keys, values = torch.cat([kv[layer][0], k], 2), torch.cat([kv[layer][1], v], 2)
        return F.scaled_dot_product_attention(q, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1))

    return draft.logits(draft.block(blk, anchor + torch.arange(steps + 1)[None], attend))[0, 1:]


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_block_spec_equals_ar(family):
    hf, target, draft = tiny_dflash(family)
    prompt = torch.randint(0, 30, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    ar = generate_ar(target, [prompt], GREEDY_21, eos_ids=[])[0][0]
    assert len(set(ar)) >= 6, ar
    for k in (1, 3, 5):
        out, stats = generate_spec(target, BlockDrafter(draft, Shape(k, 1, k + 1), target), prompt, GREEDY_21,
                                   eos_ids=[])
        assert out == ar, k
        assert stats.steps == len(stats.accepted) and all(0 <= a <= k for a in stats.accepted)
    eos = [ar[6]]
    ar_eos = generate_ar(target, [prompt], GREEDY_21, eos_ids=eos)[0][0]
    out, _ = generate_spec(target, BlockDrafter(draft, Shape(3, 1, 4), target), prompt, GREEDY_21, eos_ids=eos)
    assert out == ar_eos


@pytest.mark.parametrize("aux", [None, (1, 2, 4, 6, 7)])
def test_engine_block_equals_block_from_scratch(aux):
    """Every round's proposal (the cache filled by observe across rounds, rows at their
    positions) is the argmax of the block recomputed from the whole text so far; with
    EAGLE-3's three target layers and with five (DFlash's reference drafters read more)."""
    hf, target, draft = tiny_dflash(draft_ids=torch.tensor([t for t in range(32) if t % 5]), aux=aux)
    assert len(draft.cfg.aux_layer_ids) == (3 if aux is None else 5)
    prompt = torch.randint(0, 30, (7,), generator=torch.Generator().manual_seed(4)).tolist()
    k = 4
    drafter = BlockDrafter(draft, Shape(k, 1, k + 1), target)
    seen = []
    propose = drafter.propose

    def recording(inp: DraftInput):
        tree = propose(inp)
        seen.append((int(inp.cache_len), int(inp.root), tree.tokens[0, 1:].tolist()))
        return tree

    drafter.propose = recording
    out, _ = generate_spec(target, drafter, prompt, GREEDY_21, eos_ids=[])
    text = prompt + out
    with torch.no_grad():
        hs = hf(torch.tensor([text]), output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i][0] for i in draft.cfg.aux_layer_ids], -1)
        assert len(seen) > 3
        for cache_len, root, proposed in seen:
            assert root == text[cache_len]
            logits = block_logits(draft, torch.tensor(text), aux, cache_len, k)
            assert draft.target_ids()[logits.argmax(-1)].tolist() == proposed


def test_checkpoint_round_trip(tmp_path):
    hf, target, draft = tiny_dflash(draft_ids=torch.tensor([t for t in range(32) if t % 3]))
    out = export_dflash(draft, tmp_path / "d", dtype=torch.float32, verifier="some/target")
    cj = json.loads((out / "config.json").read_text())
    assert cj["architectures"] == ["DFlashDraftModel"] and cj["model_type"] == "qwen3"
    assert cj["dflash_config"]["target_layer_ids"] == [i - 1 for i in draft.cfg.aux_layer_ids]
    back = load_dflash(out, embed_from=hf)
    for k, v in draft.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    assert back.cfg == draft.cfg.replace(extra={"verifier": {"name_or_path": "some/target"}})
    # a full-vocabulary drafter carries no d2t (vLLM would refuse the key)
    _, _, full = tiny_dflash()
    from safetensors.torch import load_file
    assert "d2t" not in load_file(export_dflash(full, tmp_path / "f") / "model.safetensors")
    d = load_block_drafter(str(out), Shape(3, 1, 4), hf, target, "cpu", torch.float32)
    prompt = [1, 2, 3, 4, 5]
    ar = generate_ar(target, [prompt], GREEDY_21, eos_ids=[])[0][0]
    assert generate_spec(target, d, prompt, GREEDY_21, eos_ids=[])[0] == ar


def test_speculators_layout_round_trips_and_export_converts_both_ways(tmp_path, capsys):
    """The speculators library's dflash type: the Qwen3 fields nested, canonical aux ids, the mask
    token and verifier where vLLM's speculators reader takes them; it loads back the same drafter,
    and `fledge export` converts between the two layouts with the same weights."""
    from safetensors.torch import load_file

    from fledge.cli import main as cli_main
    from fledge.drafter.layout import is_dflash
    hf, target, draft = tiny_dflash(draft_ids=torch.tensor([t for t in range(32) if t % 3]), aux=(1, 2, 4, 6, 7))
    out = export_dflash(draft, tmp_path / "s", dtype=torch.float32, verifier="some/target", layout="speculators")
    cj = json.loads((out / "config.json").read_text())
    assert (cj["speculators_model_type"], cj["architectures"]) == ("dflash", ["DFlashSpeculator"])
    assert cj["aux_hidden_state_layer_ids"] == [1, 2, 4, 6, 7] and cj["mask_token_id"] == 31
    assert cj["transformer_layer_config"]["model_type"] == "qwen3" and cj["block_size"] == 6
    assert cj["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert cj["speculators_config"]["verifier"]["name_or_path"] == "some/target" and is_dflash(out)
    back = load_dflash(out, embed_from=hf)
    assert back.cfg == draft.cfg.replace(extra={"verifier": {"name_or_path": "some/target"}})
    for k, v in draft.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    native = export_dflash(draft, tmp_path / "n", dtype=torch.float32, verifier="some/target")
    assert cli_main(["export", str(out), str(tmp_path / "n2"), "--dtype", "float32"]) == 0  # speculators -> dflash
    assert json.loads((tmp_path / "n2" / "config.json").read_text()) == json.loads((native / "config.json").read_text())
    same = load_file(native / "model.safetensors"), load_file(tmp_path / "n2" / "model.safetensors")
    assert same[0].keys() == same[1].keys() and all(torch.equal(same[0][k], same[1][k]) for k in same[0])
    assert cli_main(["export", str(native), str(tmp_path / "s2"), "--layout", "speculators", "--dtype", "float32"]) == 0
    assert json.loads((tmp_path / "s2" / "config.json").read_text()) == cj
    capsys.readouterr()
    for args, says in [(["--layout", "eagle3"], "is a DFlash drafter"), (["--with-embed"], "without embeddings")]:
        assert cli_main(["export", str(native), str(tmp_path / "x"), *args]) == 2
        assert says in capsys.readouterr().err and not (tmp_path / "x").exists()
    with pytest.raises(FledgeError, match="--verifier"):
        export_dflash(tiny_dflash()[2], tmp_path / "v", layout="speculators")
    from fledge.doctor.checks import FAIL, PASS
    from fledge.doctor.doctor import doctor
    alone = {c.name: c.status for c in doctor(str(out), launch=f"vllm serve {out}")}  # vLLM reads the config
    assert FAIL not in alone.values() and alone["launch.algorithm"] == PASS, alone
    assert {c.name: c.status for c in doctor(str(native), launch=f"vllm serve {native}")}["launch.algorithm"] == FAIL


def test_bad_shapes_are_one_fledge_error(tmp_path):
    hf, target, draft = tiny_dflash(block=4)
    with pytest.raises(FledgeError, match="chain of 1..3"):
        BlockDrafter(draft, Shape(4, 1, 5), target)
    with pytest.raises(FledgeError, match="chain"):
        BlockDrafter(draft, Shape(2, 2, 5), target)
    with pytest.raises(FledgeError, match="mask_token_id"):
        draft.cfg.replace(mask_token_id=99)
    out = export_dflash(draft, tmp_path / "d")
    (out / "config.json").write_text(json.dumps({**json.loads((out / "config.json").read_text()), "block_size": None}))
    with pytest.raises(FledgeError, match="config.json"):
        load_dflash(out)


def test_doctor_checks_a_dflash_drafter_and_its_launch_line(tmp_path):
    from fledge.doctor.checks import FAIL, PASS
    from fledge.doctor.doctor import doctor
    _, _, draft = tiny_dflash(block=4)
    out = export_dflash(draft, tmp_path / "d")
    line = "vllm serve T --speculative-config '{\"method\": \"%s\", \"model\": \"d\", \"num_speculative_tokens\": %d}'"
    checks = {c.name: c.status for c in doctor(out, launch=line % ("dflash", 3))}
    assert checks == {"dflash.checkpoint": PASS, "launch.algorithm": PASS}
    assert {c.name: c.status for c in doctor(out, launch=line % ("eagle3", 3))}["launch.algorithm"] == FAIL
    assert {c.name: c.status for c in doctor(out, launch=line % ("dflash", 4))}["launch.depth"] == FAIL
    (out / "model.safetensors").write_bytes(b"")
    assert [c.status for c in doctor(out)] == [FAIL]


def test_doctor_checks_an_sglang_dflash_line(tmp_path):
    """SGLang's DFlash line: the algorithm, the block (--speculative-num-draft-tokens: the
    anchor and the masks, at most the trained block), and the head SGLang drafts through (the
    target's: a draft-vocabulary head would be dropped)."""
    from fledge.doctor.checks import FAIL, PASS, WARN
    from fledge.doctor.doctor import doctor

    _, _, whole = tiny_dflash(block=4)
    _, _, part = tiny_dflash(block=4, draft_ids=torch.arange(0, 32, 2))
    a, b = export_dflash(whole, tmp_path / "whole"), export_dflash(part, tmp_path / "part")
    line = "python -m sglang.launch_server --model-path T --speculative-algorithm %s --speculative-draft-model-path D%s"

    def status(d, algo="DFLASH", n=" --speculative-num-draft-tokens 4"):
        return {c.name: c.status for c in doctor(d, launch=line % (algo, n))}

    assert status(a) == {"dflash.checkpoint": PASS, "launch.algorithm": PASS, "launch.block": PASS, "launch.head": PASS}
    assert status(a, "EAGLE3")["launch.algorithm"] == FAIL
    assert status(a, n=" --speculative-num-draft-tokens 3")["launch.block"] == WARN
    assert status(a, n=" --speculative-num-draft-tokens 5")["launch.block"] == FAIL
    assert status(a, n="")["launch.block"] == WARN
    assert status(a, n=" --speculative-num-draft-tokens x")["launch.block"] == FAIL
    assert status(b)["launch.head"] == FAIL


def test_tune_predicts_chains_from_one_forward_and_a_verify():
    """`fledge tune`'s block model on the engine: the longest chain's prediction is what was
    measured (accept length exactly, round time as block + verify), shorter chains accept no
    more, and every chain costs the same drafter forward."""
    from fledge.engine.rig import EngineRig
    from fledge.perf.tune_block import chain_predictions, measure_block

    hf, target, draft = tiny_dflash(block=5)
    rig = EngineRig(hf, None, target, draft, [], torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 30, (n,), generator=g).tolist() for n in (6, 9)]
    m = measure_block(rig, lambda shape: BlockDrafter(draft, shape, target), prompts, 4, 16, iters=1)
    assert sorted(m["verify_ms"]) == [2, 3, 4, 5] and len(m["reach"]) == 4
    preds = {p.shape.num_steps: p for p in chain_predictions(m["reach"], m["block_ms"], m["verify_ms"], m["ar_ms"])}
    assert preds[4].accept_length == pytest.approx(m["accept_length"])
    assert preds[4].iter_ms == pytest.approx(m["round_ms"])
    assert [preds[k].accept_length for k in (1, 2, 3, 4)] == sorted(preds[k].accept_length for k in (1, 2, 3, 4))
    for k, p in preds.items():
        assert p.iter_ms - m["verify_ms"][k + 1] == pytest.approx(m["block_ms"])
        assert p.tok_s == pytest.approx(1e3 * p.accept_length / p.iter_ms)


def test_bench_runs_a_dflash_drafter_as_chains_equal_to_plain(tmp_path, capsys):
    """`fledge bench --target T --drafter DFLASH_DIR` on a tiny target: the default chains are
    the block's longest, 3/4 and 1/2 of it; every output equals plain decoding's (fp32); --probe
    (ranks) is refused in one line before anything loads."""
    from test_target import tiny_tokenizer

    from fledge.cli import main
    from fledge.perf.bench import block_shapes

    assert [s.num_steps for s in block_shapes(7)] == [7, 5, 3] and [s.num_steps for s in block_shapes(1)] == [1]
    hf, _, draft = tiny_dflash(block=5)
    hf.save_pretrained(tmp_path / "t")
    tiny_tokenizer(hf.config.vocab_size).save_pretrained(tmp_path / "t")
    out = export_dflash(draft, tmp_path / "d", dtype=torch.float32)
    args = ["bench", "--target", str(tmp_path / "t"), "--drafter", str(out), "--num-prompts", "3",
            "--max-new-tokens", "12", "--device", "cpu", "--dtype", "float32"]
    assert main([*args, "--json", str(tmp_path / "b.json")]) == 0
    res = json.loads((tmp_path / "b.json").read_text())
    assert res["method"] == "dflash" and [r["shape"] for r in res["results"]] == ["s4 k1 n5", "s3 k1 n4", "s2 k1 n3"]
    for r in res["results"]:
        assert r["equal_to_plain"] == r["prompts"] == 3 and r["accept_length"] >= 1 and r["tok_s"] > 0
    assert main([*args, "--shapes", "5,1,6"]) == 2
    assert "chain of 1..4" in capsys.readouterr().err
    assert main([*args, "--probe"]) == 2
    assert "DFlash drafter" in capsys.readouterr().err
