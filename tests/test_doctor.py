"""fledge doctor: a healthy export passes; each deliberate breakage FAILs under the right
check name without the doctor raising; launch lines for SGLang and vLLM are linted."""

import json
import random
from pathlib import Path

import pytest
import torch
from conftest import make_tiny
from safetensors.torch import load_file, save_file

from fledge import cli
from fledge.core.config import DraftConfig
from fledge.core.shape import max_nodes
from fledge.doctor import doctor
from fledge.doctor.checks import FAIL, PASS, WARN, Check, exit_code, report
from fledge.doctor.lint import launch_checks, parse_launch
from fledge.drafter import weights
from fledge.drafter.checkpoint import export_checkpoint
from fledge.drafter.eagle3 import Eagle3Draft
from fledge.drafter.layout import canonical_name, draft_config_from_json, draft_facts

DRAFT_VOCAB = 100


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model = make_tiny("llama")
    path = tmp_path_factory.mktemp("target")
    model.save_pretrained(path)
    return model, path


def _draft(model, seed=0, trained=True, eagle31=False, layers=1):
    cfg = DraftConfig.from_target(model.config, draft_vocab_size=DRAFT_VOCAB).replace(
        fc_norm=eagle31, norm_output=eagle31, num_hidden_layers=layers)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(cfg.vocab_size, generator=g)[:DRAFT_VOCAB].sort().values
    d = Eagle3Draft.from_target(cfg, model, ids)
    if trained:  # norms start at ones: move every trainable weight as training would
        for p in d.parameters():
            if p.requires_grad:
                p.data.normal_(0, 0.2 if p.ndim > 1 else 1.0, generator=g)
    return d


def _export(model, out, **kw):
    kw = {"dtype": torch.float32, **kw}
    return export_checkpoint(_draft(model, kw.pop("seed", 0), kw.pop("trained", True), kw.pop("eagle31", False),
                                    kw.pop("layers", 1)), out, **kw)


def _statuses(results):
    return {c.name: c.status for c in results}


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, fn):
    sd = load_file(path / "model.safetensors")
    fn(sd)
    save_file(sd, path / "model.safetensors")


# ---------------------------------------------------------------- healthy drafters
def test_healthy_eagle3_export_passes_everything(target, tmp_path, capsys):
    model, tpath = target
    drafter = _export(model, tmp_path / "d")
    results = doctor.doctor(drafter, str(tpath))
    assert {c.status for c in results} == {PASS}, [c for c in results if c.status != PASS]
    names = _statuses(results)
    for name in ("files", "target", "architecture", "aux_ids", "context", "rope", "hidden", "keys", "fc", "shapes",
                 "vocab", "d2t", "t2d", "dtype", "weights", "norms", "embed"):
        assert name in names
    aux = next(c for c in results if c.name == "aux_ids")
    assert "hidden_states[2, 4, 5]" in aux.why and "[1, 3, 4]" in aux.why  # both engines' spellings
    assert cli.main(["doctor", str(drafter), "--target", str(tpath)]) == 0
    assert "0 fail" in capsys.readouterr().out


def test_healthy_speculators_and_sharded_exports(target, tmp_path):
    model, tpath = target
    spec = _export(model, tmp_path / "spec", layout="speculators", verifier=str(tpath))
    assert exit_code(doctor.doctor(spec, str(tpath))) == 0
    sharded = _export(model, tmp_path / "shards", shard_size_mb=0.01)
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert exit_code(doctor.doctor(sharded, str(tpath))) == 0
    next(iter(sorted(sharded.glob("model-*.safetensors")))).unlink()
    assert _statuses(doctor.doctor(sharded, str(tpath)))["files"] == FAIL


def test_eagle31_export_passes_and_says_what_it_needs(target, tmp_path):
    """An EAGLE-3.1 drafter (fc_norm, norm_output) passes in both layouts, the architecture line
    names both changes, and its untrained fc_norm gains are caught like any other norm's."""
    model, tpath = target
    for layout in ("eagle3", "speculators"):
        results = doctor.doctor(_export(model, tmp_path / layout, layout=layout, eagle31=True, verifier=str(tpath)),
                                str(tpath))
        assert {c.status for c in results} == {PASS}, [c for c in results if c.status != PASS]
        arch = next(c for c in results if c.name == "architecture")
        assert "EAGLE-3.1's fc_norm and norm_output" in arch.why
    fresh = doctor.doctor(_export(model, tmp_path / "fresh", eagle31=True, trained=False), str(tpath))
    assert "fc_norm.0.weight" in next(c for c in fresh if c.name == "norms").why
    bare = tmp_path / "bare"
    _export(model, bare, eagle31=True)
    _edit_tensors(bare, lambda sd: sd.pop("fc_norm.1.weight"))
    keys = next(c for c in doctor.doctor(bare, str(tpath)) if c.name == "keys")
    assert keys.status == FAIL and "fc_norm.1.weight" in keys.why


def test_multi_layer_drafter_passes_for_vllm_and_warns_of_sglang(target, tmp_path):
    """A drafter of three layers: every file check passes in both layouts (layers.1.* and layers.2.*
    are served names, H wide); the eagle3 layout, which claims SGLang too, WARNs that SGLang
    would drop those layers' weights; a missing one FAILs keys."""
    model, tpath = target
    for layout in ("eagle3", "speculators"):
        results = doctor.doctor(_export(model, tmp_path / layout, layout=layout, layers=3, verifier=str(tpath)),
                                str(tpath))
        bad = {c.name: c.status for c in results if c.status != PASS}
        assert bad == ({"architecture": WARN} if layout == "eagle3" else {}), bad
    arch = next(c for c in doctor.doctor(tmp_path / "eagle3", str(tpath)) if c.name == "architecture")
    assert "num_hidden_layers=3" in arch.why and "SGLang" in arch.why
    _edit_tensors(tmp_path / "eagle3", lambda sd: sd.pop("layers.2.mlp.up_proj.weight"))
    keys = next(c for c in doctor.doctor(tmp_path / "eagle3", str(tpath)) if c.name == "keys")
    assert keys.status == FAIL and "layers.2.mlp.up_proj.weight" in keys.why


def test_untrained_drafter_is_flagged_without_a_probe(target, tmp_path):
    """A drafter at its random init, or a few optimizer steps from it, WARNs `trained` from the
    files alone (it drafts noise); the norms say "never trained" beside it. The shipped drafter
    passes."""
    model, tpath = target
    results = doctor.doctor(_export(model, tmp_path / "d", trained=False), str(tpath))
    assert {c.name for c in results if c.status != PASS} == {"norms", "trained"}
    assert _statuses(results)["norms"] == WARN and _statuses(results)["trained"] == WARN and exit_code(results) == 1
    assert "never trained" in next(c for c in results if c.name == "norms").why
    draft, g = _draft(model, trained=False), torch.Generator().manual_seed(1)
    for p in draft.parameters():  # eight Adam steps of lr 3e-4 move each weight by at most ~2.4e-3
        if p.requires_grad:
            p.data += 2.4e-3 * torch.sign(torch.randn(p.shape, generator=g))
    few = export_checkpoint(draft, tmp_path / "few", dtype=torch.float32)
    assert _statuses(doctor.doctor(few, str(tpath)))["trained"] == WARN
    shipped = Path(__file__).resolve().parents[1] / "drafters" / "smollm2-135m"
    assert _statuses(doctor.doctor(shipped))["trained"] == PASS


def test_norms_rounded_back_to_one_by_bf16(target, tmp_path):
    """A short run moves the norms ~0.0016: bf16 stores exactly 1.0 and the doctor must say
    that rounding, not a bad export, may be why; the float32 export keeps the move."""
    model, tpath = target
    draft = _draft(model)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0016)
    bf16 = export_checkpoint(draft, tmp_path / "bf16", dtype=torch.bfloat16)
    check = next(c for c in doctor.doctor(bf16, str(tpath)) if c.name == "norms")
    assert check.status == WARN and "bfloat16" in check.why and "(0.9980, 1.0039)" in check.why
    assert "--dtype float32" in check.fix
    assert torch.tensor(1.0016).to(torch.bfloat16).item() == 1.0  # the rounding the warning describes
    fp32 = export_checkpoint(draft, tmp_path / "fp32", dtype=torch.float32)
    assert _statuses(doctor.doctor(fp32, str(tpath)))["norms"] == PASS


def test_embeddings_compared_with_the_target(target, tmp_path):
    model, tpath = target
    drafter = _export(model, tmp_path / "d", with_embed=True)
    assert _statuses(doctor.doctor(drafter, str(tpath)))["embed"] == PASS
    _edit_tensors(drafter, lambda sd: sd["embed_tokens.weight"].add_(torch.randn_like(sd["embed_tokens.weight"])))
    assert _statuses(doctor.doctor(drafter, str(tpath)))["embed"] == WARN


# ---------------------------------------------------------------- broken drafters
def _dup_d2t(sd):
    ids = torch.arange(DRAFT_VOCAB) + sd["d2t"]
    ids[1] = ids[0]  # two draft ids onto one target id
    sd["d2t"] = ids - torch.arange(DRAFT_VOCAB)


def _truncate(p):
    data = (p / "model.safetensors").read_bytes()
    (p / "model.safetensors").write_bytes(data[: len(data) // 2])


def _swap(sd, old, new):
    sd[new] = sd.pop(old)


BROKEN = {
    "missing config": ("files", lambda p: (p / "config.json").unlink()),
    "config not json": ("files", lambda p: (p / "config.json").write_text("{oops")),
    "truncated safetensors": ("files", _truncate),
    "missing d2t": ("d2t", lambda p: _edit_tensors(p, lambda sd: sd.pop("d2t"))),
    "d2t duplicate": ("d2t", lambda p: _edit_tensors(p, _dup_d2t)),
    "d2t out of range": ("d2t", lambda p: _edit_tensors(p, lambda sd: sd["d2t"].__setitem__(-1, 10_000))),
    "d2t float": ("d2t", lambda p: _edit_tensors(p, lambda sd: sd.__setitem__("d2t", sd["d2t"].float()))),
    "NaN weight": ("weights", lambda p: _edit_tensors(p, lambda sd: sd["fc.weight"].__setitem__((0, 0), float("nan")))),
    "all-zero lm_head": ("weights", lambda p: _edit_tensors(p, lambda sd: sd["lm_head.weight"].zero_())),
    "fc wrong width": ("fc", lambda p: _edit_tensors(p, lambda sd: sd.__setitem__("fc.weight", sd["fc.weight"][:, :128].contiguous()))),
    "aux ids out of range": ("aux_ids", lambda p: _edit_config(
        p, eagle_aux_hidden_state_layer_ids=[2, 4, 9], eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 8]})),
    # eagle_config is SGLang's spelling (canonical - 1): [2, 4, 5] there names streams 3, 5, 6.
    "aux ids disagree": ("aux_ids", lambda p: _edit_config(p, eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 5]})),
    "max_position too small": ("context", lambda p: _edit_config(p, max_position_embeddings=256)),
    "extra unknown key": ("keys", lambda p: _edit_tensors(p, lambda sd: sd.__setitem__("foo.weight", torch.ones(3)))),
    "missing hidden_norm": ("keys", lambda p: _edit_tensors(p, lambda sd: sd.pop("midlayer.hidden_norm.weight"))),
    "layers.0 names in eagle3 layout": ("keys", lambda p: _edit_tensors(
        p, lambda sd: _swap(sd, "midlayer.mlp.up_proj.weight", "layers.0.mlp.up_proj.weight"))),
    "draft_vocab mismatch": ("vocab", lambda p: _edit_config(p, draft_vocab_size=DRAFT_VOCAB - 1)),
    "tied embeddings": ("vocab", lambda p: _edit_config(p, tie_word_embeddings=True)),
    "not eagle3": ("architecture", lambda p: _edit_config(p, architectures=["LlamaForCausalLM"])),
    "aux capture off": ("architecture", lambda p: _edit_config(p, eagle_config={"use_aux_hidden_state": False})),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_drafter_fails_the_right_check(target, tmp_path, case):
    model, tpath = target
    check, breakage = BROKEN[case]
    drafter = _export(model, tmp_path / "d")
    breakage(drafter)
    results = doctor.doctor(drafter, str(tpath))
    assert _statuses(results).get(check) == FAIL, [(c.name, c.status, c.why) for c in results]
    assert exit_code(results) == 2
    payload = json.loads("\n".join(_collect(lambda out: report(results, as_json=True, out=out))))
    assert payload["exit_code"] == 2 and any(c["name"] == check and c["status"] == "FAIL" for c in payload["checks"])


def _collect(fn):
    lines = []
    fn(lines.append)
    return lines


def test_sglang_spelled_ids_alone_are_in_range_without_a_target(target, tmp_path):
    """SpecForge writes only eagle_config's ids (SGLang's spelling, canonical - 1) and no layer
    count: without --target, doctor checks their order and never calls them out of range."""
    model, _ = target
    cfg = json.loads((_export(model, tmp_path / "d") / "config.json").read_text())
    nested = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    del cfg["eagle_aux_hidden_state_layer_ids"], cfg["fledge"]
    check = doctor.check_aux_ids(draft_facts(cfg), None)
    assert check.status == PASS and str([i + 1 for i in nested]) in check.why, check
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = nested[::-1]  # out of order: still refused
    assert doctor.check_aux_ids(draft_facts(cfg), None).status == FAIL


def test_doctor_and_loading_read_one_dtype(target, tmp_path):
    """A config with both transformers' spellings, disagreeing: the facts doctor prints and the
    config a load builds name the same dtype (the newer `dtype`)."""
    model, _ = target
    cfg = json.loads((_export(model, tmp_path / "d") / "config.json").read_text())
    cfg.update(dtype="float32", torch_dtype="bfloat16")
    assert draft_facts(cfg).dtype == draft_config_from_json(cfg).torch_dtype == "float32"


def test_unreadable_target_only_warns(target, tmp_path):
    model, _ = target
    results = doctor.doctor(_export(model, tmp_path / "d"), str(tmp_path / "nowhere"))
    assert _statuses(results)["target"] == WARN and exit_code(results) == 1


def test_not_a_directory(tmp_path):
    assert _statuses(doctor.doctor(tmp_path / "missing"))["files"] == FAIL


# ---------------------------------------------------------------- --against
def test_against_counts_differing_d2t_entries(target, tmp_path):
    model, _ = target
    a, b = _export(model, tmp_path / "a", seed=1), _export(model, tmp_path / "b", seed=2)
    ta = torch.arange(DRAFT_VOCAB) + load_file(a / "model.safetensors")["d2t"]
    tb = torch.arange(DRAFT_VOCAB) + load_file(b / "model.safetensors")["d2t"]
    c = doctor.against_check(a, b)
    assert c.status == WARN
    assert f"{int((ta != tb).sum()):,} of {DRAFT_VOCAB}" in c.why
    assert f"share {len(set(ta.tolist()) & set(tb.tolist())):,}" in c.why
    assert doctor.against_check(a, a).status == PASS


# ---------------------------------------------------------------- launch lines
def _lint(drafter, cmd, target=None):
    return _statuses(launch_checks(cmd, drafter, None, target))


SGL = "python -m sglang.launch_server --model-path {t} --speculative-draft-model-path {d} --tp 8 "


def test_sglang_eagle_vs_eagle3(target, tmp_path):
    model, tpath = target
    d = _export(model, tmp_path / "d")
    good = _lint(d, SGL.format(t=tpath, d=d) + "--speculative-algorithm EAGLE3 --speculative-num-steps 3 "
                 "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4", str(tpath))
    assert set(good.values()) == {PASS} and "launch.model" in good
    bad = _lint(d, SGL.format(t=tpath, d=d) + "--speculative-algorithm EAGLE")
    assert bad["launch.algorithm"] == FAIL
    # argparse prefixes and the short draft flag, spread over continuation lines
    abbrev = _lint(d, f"CUDA_VISIBLE_DEVICES=0 python3 -m sglang.launch_server --model {tpath} \\\n"
                      f"  --speculative-algo EAGLE3 \\\n  --speculative-draft={d}")
    assert abbrev["launch.algorithm"] == PASS and abbrev["launch.draft_path"] == PASS


@pytest.mark.parametrize("steps,topk,ndt,status", [
    (3, 1, 4, "PASS"), (3, 1, 8, "WARN"), (5, 4, 8, "PASS"), (3, 4, 37, "PASS"), (3, 4, 38, "FAIL"),
    (2, 2, 7, "PASS"), (2, 2, 8, "FAIL"), (6, 4, 4, "WARN"), (0, 1, 1, "FAIL"), ("x", 1, 2, "FAIL")])
def test_sglang_tree_bounds(tmp_path, steps, topk, ndt, status):
    cmd = (f"python -m sglang.launch_server --speculative-algorithm EAGLE3 --speculative-num-steps {steps} "
           f"--speculative-eagle-topk {topk} --speculative-num-draft-tokens {ndt}")
    assert _lint(tmp_path, cmd)["launch.tree"] == status


def test_tree_bound_matches_candidate_count():
    """The bound is the number of scored candidates SGLang's draft loop produces, plus the root."""
    for steps in range(1, 6):
        for topk in range(1, 6):
            candidates = [topk] + [topk * topk] * (steps - 1)  # per-step score tensors, flattened
            assert max_nodes(steps, topk) == 1 + sum(candidates)


def test_sglang_other_flags(target, tmp_path):
    model, tpath = target
    d = _export(model, tmp_path / "d")
    other = _export(model, tmp_path / "other")
    facts = draft_facts(json.loads((d / "config.json").read_text()))
    base = SGL.format(t=tpath, d=d) + "--speculative-algorithm EAGLE3 "
    r = _statuses(launch_checks(base + "--disable-cuda-graph --context-length 100000", d, facts))
    assert r["launch.cuda_graph"] == WARN and r["launch.context"] == FAIL
    assert _lint(d, SGL.format(t=tpath, d=other) + "--speculative-algorithm EAGLE3")["launch.draft_path"] == FAIL
    assert _lint(d, SGL.format(t=tpath, d="org/remote") + "--speculative-algorithm EAGLE3")["launch.draft_path"] == WARN
    assert _lint(d, base + "--speculative-eagle-topk 4")["launch.tree"] == FAIL  # SGLang asserts
    assert _lint(d, base.replace(str(tpath), str(other)), str(tpath))["launch.model"] == FAIL  # a drafter as target


def test_vllm_lines(target, tmp_path):
    model, tpath = target
    d = _export(model, tmp_path / "d")
    facts = draft_facts(json.loads((d / "config.json").read_text()))

    def vllm(spec, extra=""):
        return _statuses(launch_checks(f"vllm serve {tpath} {extra} --speculative-config '{json.dumps(spec)}'",
                                              d, facts, str(tpath)))

    good = vllm({"method": "eagle3", "model": str(d), "num_speculative_tokens": 3})
    assert set(good.values()) == {PASS}
    assert vllm({"method": "eagle", "model": str(d), "num_speculative_tokens": 3})["launch.algorithm"] == FAIL
    assert vllm({"model": str(d), "num_speculative_tokens": 3})["launch.algorithm"] == FAIL
    assert vllm({"method": "eagle3", "model": str(d), "num_speculative_tokens": 0})["launch.num_tokens"] == FAIL
    assert vllm({"method": "eagle3", "model": str(d), "num_speculative_tokens": 12})["launch.num_tokens"] == WARN
    r = vllm({"method": "eagle3", "model": str(d), "num_speculative_tokens": 3}, "--enforce-eager --max-model-len 4096")
    assert r["launch.cuda_graph"] == WARN and r["launch.context"] == FAIL
    assert _lint(d, f"vllm serve {tpath} --speculative-config '{{bad'")["launch.spec_config"] == FAIL
    assert _lint(d, f"vllm serve {tpath}")["launch.spec_config"] == FAIL
    assert _lint(d, f"vllm serve {tpath} --speculative-model {d}")["launch.legacy"] == FAIL
    dotted = _lint(d, f"vllm serve {tpath} --speculative-config.method eagle3 --speculative-config.model {d} "
                      "--speculative-config.num_speculative_tokens 2")
    assert set(dotted.values()) == {PASS}


SHIPPED = Path(__file__).resolve().parents[1] / "drafters" / "smollm2-135m"
SPEC = '--speculative-config \'{{"method": "eagle3", "model": "{d}", "num_speculative_tokens": 3}}\''


def test_launch_model_must_be_the_drafters_target(target, tmp_path):
    """The served model is compared with the drafter's target by config (layers, hidden size,
    vocab), or by the name the drafter records where no config is here; without --target a local
    --model directory is the target the other checks use."""
    model, tpath = target
    d = _export(model, tmp_path / "d", verifier=str(tpath))
    facts = draft_facts(json.loads((d / "config.json").read_text()))
    other = tmp_path / "shallow"
    make_tiny("llama", num_hidden_layers=4).save_pretrained(other)

    def lint(served, drafter=d, f=facts):
        return next(c for c in launch_checks(f"vllm serve {served} {SPEC.format(d=drafter)}", drafter, f)
                    if c.name == "launch.model")

    assert lint(tpath).status == PASS and "layers 8, hidden size 64, vocab 301" in lint(tpath).why
    shallow = lint(other)
    assert shallow.status == FAIL and "layers 4 (drafter's target: 8)" in shallow.why
    assert lint(d).status == FAIL and "a drafter" in lint(d).why
    shipped = draft_facts(json.loads((SHIPPED / "config.json").read_text()))
    qwen = lint("Qwen/Qwen3-8B", SHIPPED, shipped)  # not here to read: the recorded name decides
    assert qwen.status == FAIL and "smollm2-135m" in qwen.why
    assert lint("HuggingFaceTB/SmolLM2-135M-Instruct", SHIPPED, shipped).status in (WARN, PASS)
    # No --target: the line's directory is the target, so the shallow one fails the static checks too.
    line = f"vllm serve {other} {SPEC.format(d=d)}"
    results = _statuses(doctor.doctor(d, None, line))
    assert results["target"] == PASS and results["launch.model"] == FAIL and exit_code(doctor.doctor(d, None, line)) == 2
    assert set(_statuses(doctor.doctor(d, None, f"vllm serve {tpath} {SPEC.format(d=d)}")).values()) == {PASS}


def test_launch_drafter_path_and_cpu_lines(target, tmp_path):
    """A drafter path that does not exist FAILs; --enforce-eager is a WARN on a GPU line only:
    the CPU build has no CUDA graphs to lose."""
    model, tpath = target
    d = _export(model, tmp_path / "d")
    assert _lint(d, f"vllm serve {tpath} {SPEC.format(d=tmp_path / 'gone')}")["launch.draft_path"] == FAIL
    gpu = f"python -m vllm.entrypoints.openai.api_server --model {tpath} --enforce-eager {SPEC.format(d=d)}"
    assert _lint(d, gpu)["launch.cuda_graph"] == WARN
    for cpu in ("VLLM_TARGET_DEVICE=cpu " + gpu, "env VLLM_TARGET_DEVICE=cpu " + gpu, gpu + " --device cpu"):
        assert "launch.cuda_graph" not in _lint(d, cpu), cpu


def test_vllm_serves_a_speculators_dir_alone(target, tmp_path):
    """`vllm serve <speculators dir>` speculates with no --speculative-config (tests/test_vllm.py
    shows it on real vLLM): the lint passes it and names the verifier vLLM loads."""
    model, tpath = target
    d = _export(model, tmp_path / "spec", layout="speculators", verifier=str(tpath))
    results = doctor.doctor(d, str(tpath), f"vllm serve {d}")
    assert {c.status for c in results} == {PASS}, [c for c in results if c.status != PASS]
    spec = next(c for c in results if c.name == "launch.spec_config")
    assert str(tpath) in spec.why
    assert _statuses(doctor.doctor(d, str(tpath), f"vllm serve {d} --speculative-config.num_speculative_tokens 12")
                     )["launch.num_tokens"] == WARN  # user additions still linted
    eagle3 = _export(model, tmp_path / "eagle3")  # the eagle3 layout served alone does not speculate
    assert _statuses(doctor.doctor(eagle3, str(tpath), f"vllm serve {eagle3}"))["launch.spec_config"] == FAIL


@pytest.mark.parametrize("verifier, status", [("smollm2-135m", FAIL), ("org/model", PASS), ("/no/such/dir", WARN),
                                              ("justaname", WARN)])
def test_speculators_verifier_must_be_loadable(target, tmp_path, verifier, status):
    """vLLM loads the verifier by HF id or path; a fledge built-in alias is neither."""
    model, tpath = target
    d = _export(model, tmp_path / "spec", layout="speculators", verifier="org/placeholder")
    # fledge's export refuses an alias; doctor must still catch one written by other tools.
    cj = json.loads((d / "config.json").read_text())
    cj["speculators_config"]["verifier"]["name_or_path"] = verifier
    (d / "config.json").write_text(json.dumps(cj))
    check = next(c for c in doctor.doctor(d, str(tpath)) if c.name == "verifier")
    assert check.status == status, check
    if status != PASS:
        assert f"--verifier {tpath}" in check.fix
    bare = _export(model, tmp_path / "bare", layout="speculators", verifier=str(tmp_path))  # a dir, no config
    assert _statuses(doctor.doctor(bare))["verifier"] == FAIL


@pytest.mark.parametrize("cmd,engine,model", [
    ("/opt/vllm-venv/bin/python -m sglang.launch_server --model-path M", "sglang", "M"),
    ("python -m sglang.launch_server --model-path /models/vllm-tuned", "sglang", "/models/vllm-tuned"),
    ("docker run --gpus all vllm/vllm-openai:v0.11 --model M", "vllm", "M"),
    ("CUDA_VISIBLE_DEVICES=0 /env/bin/vllm serve M", "vllm", "M"),
    ("python -m vllm.entrypoints.openai.api_server --model M", "vllm", "M"),
])
def test_the_engine_is_read_from_its_command_not_a_path(cmd, engine, model):
    launch = parse_launch(cmd)
    assert (launch.engine, launch.model) == (engine, model)


def test_odd_launch_lines_never_raise(tmp_path):
    for cmd in ["", "   ", "'unbalanced", "ls -la", "--speculative-algorithm EAGLE3", "sglang", "vllm serve"]:
        results = launch_checks(cmd, tmp_path, None)
        assert results and all(c.status in (PASS, WARN, FAIL) for c in results)
    assert _lint(tmp_path, "ls -la")["launch.parse"] == FAIL
    rng = random.Random(0)
    words = ["python", "-m", "sglang.launch_server", "vllm", "serve", "--speculative-algorithm", "EAGLE3", "EAGLE",
             "--speculative-num-steps", "-1", "3", "--speculative-eagle-topk", "--speculative-config", "{}", "[1]",
             '{"method": 3}', "--context-length", "nan", "=", "--x=", "'", "\\\n", "--speculative-num-draft-tokens"]
    for _ in range(300):
        launch_checks(" ".join(rng.choices(words, k=rng.randint(1, 12))), tmp_path, None)


def test_exit_codes():
    mk = lambda s: Check("x", s, "")  # noqa: E731
    assert exit_code([]) == 0
    assert exit_code([mk("PASS"), mk("PASS")]) == 0
    assert exit_code([mk("PASS"), mk("WARN")]) == 1
    assert exit_code([mk("WARN"), mk("FAIL"), mk("PASS")]) == 2


def test_index_and_shards_disagree(target, tmp_path):
    model, tpath = target
    drafter = _export(model, tmp_path / "d", shard_size_mb=0.01)
    index = json.loads((drafter / "model.safetensors.index.json").read_text())
    name = "midlayer.hidden_norm.weight"
    shard = index["weight_map"].pop(name)  # the tensor is in a shard, but engines go by the index
    (drafter / "model.safetensors.index.json").write_text(json.dumps(index))
    r = _statuses(doctor.doctor(drafter, str(tpath)))
    assert r["files"] == WARN and r["keys"] == FAIL
    index["weight_map"]["ghost.weight"] = shard
    (drafter / "model.safetensors.index.json").write_text(json.dumps(index))
    assert _statuses(doctor.doctor(drafter, str(tpath)))["files"] == FAIL


def test_odd_config_values_never_raise(target, tmp_path):
    model, tpath = target
    for changes in [{"eagle_config": [1, 2]}, {"hidden_size": "wide"}, {"eagle_aux_hidden_state_layer_ids": "abc"},
                    {"max_position_embeddings": None}, {"draft_vocab_size": -5}, {"vocab_size": "big"}]:
        drafter = _export(model, tmp_path / str(len(list(tmp_path.iterdir()))))
        _edit_config(drafter, **changes)
        results = doctor.doctor(drafter, str(tpath))
        assert exit_code(results) == 2, (changes, results)


def test_rope_mismatch_warns(target, tmp_path):
    model, tpath = target
    drafter = _export(model, tmp_path / "d")
    _edit_config(drafter, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})
    results = doctor.doctor(drafter, str(tpath))
    assert {c.name: c.status for c in results if c.status != PASS} == {"rope": WARN}


def test_lint_and_checks_do_not_import_doctor():
    """doctor uses lint and checks; neither may import doctor back (not even for a type)."""
    import ast
    from pathlib import Path

    root = Path(doctor.__file__).parent
    for name in ("lint", "checks"):
        tree = ast.parse((root / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert "fledge.doctor.doctor" not in imported, name


# ---------------------------------------------------------------- torch-free reading
def test_numpy_reader_matches_the_torch_reader(target, tmp_path):
    """The doctor reads weights with numpy (bf16 widened from its bits); fledge.drafter.checkpoint reads
    them with torch. Same tensors, bit for bit, whole and by rows, in every dtype a file holds."""
    from safetensors.torch import load_file as torch_load

    model, _ = target
    edge = torch.tensor([[0.0, -0.0, float("inf"), float("-inf")], [float("nan"), 1e-40, -3.0e38, 1.0 + 2**-7]])
    mixed = {"bf16": torch.cat([edge, torch.randn(6, 4)]).bfloat16(), "f16": torch.randn(5, 3).half(),
             "f32": torch.randn(4, 2, 3), "i64": torch.arange(-3, 9), "bool": torch.rand(7) > 0.5,
             "scalar": torch.tensor(2.5).bfloat16(), "empty": torch.zeros(0, 4).bfloat16()}
    save_file(mixed, tmp_path / "mixed.safetensors")
    drafters = [_export(model, tmp_path / "bf16", dtype=torch.bfloat16, with_embed=True),
                _export(model, tmp_path / "spec", layout="speculators", verifier="org/tiny", shard_size_mb=0.01)]

    def bits(t):
        t = t.float() if t.dtype == torch.bfloat16 else t
        return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16) if t.dtype == torch.half else t

    def same(a, b, k):
        assert a.dtype == (torch.float32 if b.dtype == torch.bfloat16 else b.dtype) and a.shape == b.shape, k
        assert torch.equal(bits(a), bits(b)), k

    ref = torch_load(tmp_path / "mixed.safetensors")
    torch.save(mixed, tmp_path / "pytorch_model.bin")
    from_bin, problems = weights.scan_files([tmp_path / "pytorch_model.bin"])
    assert not problems
    for k, t in ref.items():
        same(torch.from_numpy(weights.read_safetensor(tmp_path / "mixed.safetensors", k)), t, k)
        same(torch.from_numpy(from_bin.read(k)), t, k)
        # rows past the end are clamped, as in Python; an open start or stop reads as a slice does
        for a, b in ((1, 3), (3, 10**6), (None, 2), (2, None)) if t.dim() else ():
            same(torch.from_numpy(weights.read_safetensor(tmp_path / "mixed.safetensors", k, a, b)), t[a:b], k)
            same(torch.from_numpy(from_bin.read(k, a, b)), t[a:b], k)
    for d in drafters:
        w = weights.open_checkpoint(d).weights
        tensors = {canonical_name(k): t for k, t in w.torch_tensors().items()}
        assert {canonical_name(k) for k in w.files} == set(tensors)
        for k in w.files:
            t = tensors[canonical_name(k)]
            same(torch.from_numpy(w.read(k)), t, k)
            same(torch.from_numpy(w.read(k, 2, 10**6)), t[2:], k)


def test_doctor_without_target_loads_neither_torch_nor_transformers(target, tmp_path):
    """`fledge doctor DRAFTER` runs in its own process and must not import torch or transformers
    (their start-up is most of its time); its verdicts are those of the doctor run here."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    model, _ = target
    drafter = _export(model, tmp_path / "d", dtype=torch.bfloat16)
    _edit_tensors(drafter, lambda sd: sd.pop("midlayer.hidden_norm.weight"))  # a FAIL as well as PASSes
    probe = ("import json, sys\nfrom fledge.cli import main\nrc = main(['doctor', sys.argv[1], '--json'])\n"
             "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
             "open(sys.argv[2], 'w').write(json.dumps({'rc': rc, 'heavy': heavy}))\n")
    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", probe, str(drafter), str(tmp_path / "seen.json")], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["heavy"] == [], seen["heavy"][:10]
    here = doctor.doctor(drafter)
    assert seen["rc"] == exit_code(here) == 2
    assert {c["name"]: c["status"] for c in json.loads(out.stdout)["checks"]} == _statuses(here)


def test_sweep_dry_run_lines_pass_the_lint(target, tmp_path, capsys):
    """`serve-sweep --dry-run` prints a line per server for engines fledge does not start; each
    speculating line passes every launch check against the drafter and its target."""
    model, tpath = target
    d = _export(model, tmp_path / "d", verifier=str(tpath))
    for engine, extra in (("sglang", ["--extra", "--tp 8"]), ("vllm", ["--python", "/opt/venv/bin/python"])):
        capsys.readouterr()
        assert cli.main(["serve-sweep", "--target", str(tpath), "--drafter", str(d), "--engine", engine, "--ks", "1,3",
                         "--dry-run", *extra]) == 0
        lines = [x for x in capsys.readouterr().out.splitlines() if x and not x.startswith("#")]
        assert len(lines) == 3 and all(engine in x for x in lines)
        for line in lines[1:]:
            checks = _statuses(doctor.doctor(d, None, line))
            assert set(checks.values()) == {PASS}, (line, checks)
    assert cli.main(["serve-sweep", "--target", str(tpath), "--drafter", str(d), "--engine", "sglang"]) == 2
    assert "--dry-run" in capsys.readouterr().err
