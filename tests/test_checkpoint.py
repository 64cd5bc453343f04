"""Export/import of drafter checkpoints: exact round trips across layouts, foreign (SpecForge)
drafters, and one refusal per kind of bad input — each a FledgeError naming the file, with
nothing written."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from conftest import make_tiny
from safetensors.torch import load_file, save_file

from fledge import cli
from fledge.core.config import DraftConfig
from fledge.core.conventions import (
    aux_ids_from_sglang,
    aux_ids_to_sglang,
    default_aux_layer_ids,
)
from fledge.core.errors import FledgeError
from fledge.drafter.checkpoint import (
    export_checkpoint,
    load_checkpoint,
    validate_checkpoint,
)
from fledge.drafter.eagle3 import Eagle3Draft
from fledge.drafter.layout import checkpoint_keys

N_DRAFT = 100


def tiny_draft(family="llama", seed=0, eagle31=False, layers=1):
    target = make_tiny(family, seed=seed)
    cfg = DraftConfig.from_target(target.config, draft_vocab_size=N_DRAFT).replace(
        fc_norm=eagle31, norm_output=eagle31, num_hidden_layers=layers)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(cfg.vocab_size, generator=g)[:N_DRAFT].sort().values
    draft = Eagle3Draft.from_target(cfg, target, ids)
    with torch.no_grad():  # norms off their all-ones init, so a default-filled norm cannot pass for them
        for name, p in draft.named_parameters():
            if "norm." in name:
                p.normal_(generator=g)
    return draft, target


def read_dir(path: Path):
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return json.loads((path / "config.json").read_text()), tensors


def assert_same_dir(a: Path, b: Path):
    (ca, ta), (cb, tb) = read_dir(a), read_dir(b)
    assert ca == cb
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


def assert_same_weights(draft: Eagle3Draft, loaded: Eagle3Draft, with_embed=False):
    a, b = draft.state_dict(), loaded.state_dict()
    for k in a:
        if k != "embed_tokens.weight" or with_embed:
            assert torch.equal(a[k], b[k]), k


# --------------------------------------------------------------------------- good paths
@pytest.mark.parametrize("family,draft_vocab,intermediate,head_dim,fc_norm,layers",
                         [("llama", N_DRAFT, None, None, False, 1), ("llama", N_DRAFT, None, None, True, 1),
                          ("qwen3", None, 40, 32, False, 1), ("gemma3", 7, None, 8, False, 1),
                          ("qwen3", N_DRAFT, None, 32, False, 3)])
def test_checkpoint_keys_are_the_drafts_state_dict(family, draft_vocab, intermediate, head_dim, fc_norm, layers):
    """fledge.drafter.layout lists the served tensors without torch; Eagle3Draft's state dict is what
    export writes, so the two must agree in names, order and shapes (a full vocab drops d2t;
    EAGLE-3.1's fc_norm adds its three norms; layers after the first are `layers.{i}.*`, H wide)."""
    tcfg = make_tiny(family, **({"head_dim": head_dim} if head_dim else {})).config
    cfg = DraftConfig.from_target(tcfg, draft_vocab_size=draft_vocab, intermediate_size=intermediate).replace(
        fc_norm=fc_norm, num_hidden_layers=layers)
    assert head_dim is None or cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size
    with torch.device("meta"):
        sd = Eagle3Draft(cfg).state_dict()
    if cfg.draft_vocab_size == cfg.vocab_size:
        del sd["d2t"]
    keys = checkpoint_keys(cfg)
    assert list(keys) == list(sd)
    assert {k: shape for k, (shape, _) in keys.items()} == {k: tuple(v.shape) for k, v in sd.items()}
    assert {k for k, (_, required) in keys.items() if not required} == {"embed_tokens.weight", "t2d"}
    assert ("d2t" in keys) == (cfg.draft_vocab_size != cfg.vocab_size)
    assert sum(k.startswith("fc_norm.") for k in keys) == 3 * fc_norm
    assert {k.split(".")[1] for k in keys if k.startswith("layers.")} == {str(i) for i in range(1, layers)}


def test_eagle3_layout_fields(tmp_path):
    draft, _ = tiny_draft()
    out = export_checkpoint(draft, tmp_path / "d", verifier="org/tiny")
    cj, t = read_dir(out)
    assert cj["architectures"] == ["LlamaForCausalLMEagle3"] and cj["model_type"] == "llama"
    assert (cj["num_hidden_layers"], cj["vocab_size"], cj["draft_vocab_size"]) == (1, 301, N_DRAFT)
    assert (cj["target_hidden_size"], cj["max_position_embeddings"], cj["head_dim"]) == (64, 512, 16)
    assert cj["tie_word_embeddings"] is False and cj["torch_dtype"] == "bfloat16"
    assert cj["eagle_aux_hidden_state_layer_ids"] == list(default_aux_layer_ids(8)) == [2, 4, 5]
    # SGLang reads only eagle_config and adds 1: "output of layer k" = the same streams as vLLM's [2, 4, 5].
    assert cj["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    want = {k for k, (_, _) in checkpoint_keys(draft.cfg).items()} - {"embed_tokens.weight"}
    assert set(t) == want
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool
    assert t["fc.weight"].dtype == torch.bfloat16 and validate_checkpoint(out) == []


@pytest.mark.parametrize("family,eagle31,layers", [("llama", False, 1), ("qwen3", False, 1), ("llama", True, 1),
                                                   ("llama", False, 2)])
@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
def test_round_trip_exact(tmp_path, family, eagle31, layout, layers):
    draft, _ = tiny_draft(family, eagle31=eagle31, layers=layers)
    a = export_checkpoint(draft, tmp_path / "a", layout=layout, dtype=torch.float32, verifier="org/tiny")
    loaded = load_checkpoint(a)
    assert_same_weights(draft, loaded)
    assert loaded.cfg.aux_layer_ids == draft.cfg.aux_layer_ids
    assert (loaded.cfg.fc_norm, loaded.cfg.norm_output, loaded.cfg.num_hidden_layers) == (eagle31, eagle31, layers)
    cj = json.loads((a / "config.json").read_text())
    assert [k for k in ("fc_norm", "norm_output") if cj.get(k) is True] == ["fc_norm", "norm_output"] * eagle31
    b = export_checkpoint(loaded, tmp_path / "b", layout=layout, dtype=torch.float32)
    assert_same_dir(a, b)
    c = export_checkpoint(draft, tmp_path / "c", layout=layout, verifier="org/tiny")  # bf16 survives fp32 and back
    assert_same_dir(c, export_checkpoint(load_checkpoint(c), tmp_path / "d", layout=layout))


def test_cross_layout_round_trip(tmp_path):
    draft, _ = tiny_draft()
    e = export_checkpoint(draft, tmp_path / "e", verifier="org/tiny")
    s = export_checkpoint(load_checkpoint(e), tmp_path / "s", layout="speculators")
    cj, t = read_dir(s)
    assert cj["speculators_model_type"] == "eagle3" and cj["norm_before_residual"] is False
    assert cj["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    assert cj["transformer_layer_config"]["vocab_size"] == 301 and cj["draft_vocab_size"] == N_DRAFT
    assert "layers.0.hidden_norm.weight" in t and not any(k.startswith("midlayer.") for k in t)
    assert_same_dir(e, export_checkpoint(load_checkpoint(s), tmp_path / "e2"))
    assert_same_dir(s, export_checkpoint(load_checkpoint(tmp_path / "e2"), tmp_path / "s2", layout="speculators"))


def test_sharded(tmp_path):
    draft, _ = tiny_draft()
    one = export_checkpoint(draft, tmp_path / "one")
    many = export_checkpoint(draft, tmp_path / "many", shard_size_mb=0.02)
    shards = sorted(many.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (many / "model.safetensors").exists()
    index = json.loads((many / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(read_dir(one)[1]) and set(index["weight_map"].values()) == {
        f.name for f in shards}
    assert_same_weights(load_checkpoint(one), load_checkpoint(many))
    shards[-1].unlink()
    assert any(shards[-1].name in p and "missing" in p for p in validate_checkpoint(many))


def test_embeddings(tmp_path):
    draft, target = tiny_draft()
    emb = target.get_input_embeddings().weight
    full = export_checkpoint(draft, tmp_path / "full", with_embed=True, dtype=torch.float32)
    assert torch.equal(read_dir(full)[1]["embed_tokens.weight"], emb)
    assert torch.equal(load_checkpoint(full).embed_tokens.weight, emb)
    bare = export_checkpoint(draft, tmp_path / "bare")
    assert torch.equal(load_checkpoint(bare, embed_from=target).embed_tokens.weight, emb)
    loaded = load_checkpoint(bare)
    assert torch.isnan(loaded.embed_tokens.weight).all()  # unusable until given the target's
    with pytest.raises(FledgeError, match="no embeddings"):
        export_checkpoint(loaded, tmp_path / "x", with_embed=True)
    assert not (tmp_path / "x").exists()


def test_full_vocab_drafter_has_no_d2t(tmp_path):
    """vLLM registers no d2t parameter when draft vocab == target vocab, and raises on the key."""
    target = make_tiny("llama")
    draft = Eagle3Draft.from_target(DraftConfig.from_target(target.config), target)
    out = export_checkpoint(draft, tmp_path / "full")
    cj, t = read_dir(out)
    assert cj["draft_vocab_size"] == cj["vocab_size"] == 301 and "d2t" not in t and t["t2d"].all()
    loaded = load_checkpoint(out)
    assert torch.equal(loaded.target_ids(), torch.arange(301))
    assert_same_dir(out, export_checkpoint(loaded, tmp_path / "again"))
    edit_weights(lambda w: _set(w, "d2t", torch.zeros(301, dtype=torch.int64)))(out)
    assert any("d2t in a full-vocabulary drafter" in p for p in validate_checkpoint(out))


def specforge_dir(tmp_path: Path, draft: Eagle3Draft, ids=None, fmt="safetensors") -> Path:
    """A SpecForge/AQ-MedAI-style drafter: bare llama config (no eagle_config, no
    target_hidden_size/head_dim), embed_tokens kept, t2d dropped."""
    c = draft.cfg
    cj = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
          "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
          "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "vocab_size": c.vocab_size,
          "draft_vocab_size": c.draft_vocab_size, "max_position_embeddings": c.max_position_embeddings,
          "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "hidden_act": "silu",
          "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    if ids is not None:
        cj["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    d = tmp_path / "specforge"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cj))
    sd = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in draft.state_dict().items() if k != "t2d"}
    if fmt == "bin":
        torch.save(sd, d / "pytorch_model.bin")
    else:
        save_file(sd, d / "model.safetensors")
    return d


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_specforge_import(tmp_path, fmt):
    draft, _ = tiny_draft()
    src = specforge_dir(tmp_path, draft, fmt=fmt)
    with pytest.raises(FledgeError, match="target-layers"):
        load_checkpoint(src)
    loaded = load_checkpoint(src, target_layers=8)
    # No ids written → SpecForge's default, "outputs of layers [1, N//2-1, N-4]" = canonical (2, 4, 5).
    assert loaded.cfg.aux_layer_ids == aux_ids_from_sglang([1, 3, 4], 8) == (2, 4, 5)
    assert torch.equal(loaded.t2d, draft.t2d) and torch.equal(loaded.d2t, draft.d2t)
    assert torch.equal(loaded.embed_tokens.weight, draft.embed_tokens.weight.to(torch.bfloat16).float())
    out = tmp_path / "imported"
    assert cli.main(["import", str(src), str(out), "--target-layers", "8"]) == 0
    cj, t = read_dir(out)
    assert cj["fledge"]["target_num_hidden_layers"] == 8 and "embed_tokens.weight" in t and "t2d" in t


def test_specforge_ids_in_eagle_config(tmp_path):
    draft, target = tiny_draft()
    src = specforge_dir(tmp_path, draft, ids=[1, 3, 6])
    loaded = load_checkpoint(src, embed_from=target)  # the target supplies the layer count
    assert loaded.cfg.aux_layer_ids == aux_ids_from_sglang([1, 3, 6], 8)


@pytest.mark.parametrize("n", range(8, 96, 7))
def test_serving_aux_ids_invert(n):
    ids = default_aux_layer_ids(n)
    assert aux_ids_from_sglang(aux_ids_to_sglang(ids, n), n) == ids


def test_export_is_atomic(tmp_path):
    draft, _ = tiny_draft()
    out = export_checkpoint(draft, tmp_path / "d")
    before = read_dir(out)
    with pytest.raises(FledgeError, match="already exists"):
        export_checkpoint(draft, out)
    with pytest.raises(FledgeError, match="--verifier"):
        export_checkpoint(draft, out, layout="speculators", overwrite=True)
    # A built-in alias is a name only fledge resolves: vLLM would fail to load it as the verifier.
    with pytest.raises(FledgeError, match="built-in name"):
        export_checkpoint(draft, out, layout="speculators", verifier="smollm2-135m", overwrite=True)
    assert read_dir(out)[0] == before[0] and sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    export_checkpoint(draft, out, layout="speculators", verifier="v", overwrite=True)
    assert read_dir(out)[0]["speculators_model_type"] == "eagle3"


def test_cli_export(tmp_path):
    draft, _ = tiny_draft()
    src = export_checkpoint(draft, tmp_path / "src", verifier="org/tiny")
    out = tmp_path / "out"
    rc = cli.main(["export", str(src), str(out), "--layout", "speculators", "--dtype", "float16",
                   "--shard-size-mb", "0.02", "--with-embed"])
    assert rc == 2 and not out.exists()  # src has no embeddings to keep
    rc = cli.main(["export", str(src), str(out), "--layout", "speculators", "--dtype", "float16",
                   "--shard-size-mb", "0.02"])
    assert rc == 0 and (out / "model.safetensors.index.json").exists()
    cj, t = read_dir(out)
    assert t["fc.weight"].dtype == torch.float16 and cj["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    assert torch.equal(load_checkpoint(out).fc.weight, draft.fc.weight.to(torch.bfloat16).to(torch.float16).float())
    back, again = tmp_path / "back", tmp_path / "again"  # speculators → import → speculators, by the CLI
    assert cli.main(["import", str(out), str(back)]) == 0
    assert cli.main(["export", str(back), str(again), "--layout", "speculators", "--dtype", "float16"]) == 0
    assert_same_dir(out, again)


@pytest.mark.parametrize("command", ["export", "import"])
def test_unreadable_source_refused_before_torch_loads(tmp_path, command):
    """`fledge export|import SRC OUT` with SRC missing or without weights: one line naming the
    file, exit 2, nothing written, and torch never imported (its start-up would be most of the
    wait for that line)."""
    import subprocess
    import sys

    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text("{}")
    probe = ("import json, sys\nfrom fledge.cli import main\nrc = main([sys.argv[1], sys.argv[2], sys.argv[3]])\n"
             "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules}))\n")
    root = Path(__file__).parent.parent
    for src, problem in (("missing", "missing/config.json: missing"), ("bare", "bare/")):
        out = subprocess.run([sys.executable, "-c", probe, command, str(tmp_path / src), str(tmp_path / "out")],
                             env={**os.environ, "PYTHONPATH": str(root)}, cwd=tmp_path, capture_output=True,
                             text=True, timeout=120)
        seen = json.loads(out.stdout.splitlines()[-1])
        assert seen == {"rc": 2, "torch": False}, (seen, out.stderr)
        errors = [line for line in out.stderr.splitlines() if line.startswith("fledge: error:")]
        assert len(errors) == 1 and problem in errors[0], out.stderr
        assert not (tmp_path / "out").exists()


def test_init_draft(tmp_path, monkeypatch):
    import fledge.core.target as ft
    target = make_tiny("llama")
    target.config.architectures = ["LlamaForCausalLM"]
    monkeypatch.setattr(ft, "load_target", lambda spec: ft.Target(target, None, spec, tmp_path / "tgt"))
    out = tmp_path / "draft"
    assert cli.main(["init-draft", "--target", "tiny", str(out), "--draft-vocab", "50"]) == 0
    cj = json.loads((out / "config.json").read_text())
    assert cj["fledge"]["verifier"] == {"name_or_path": str(tmp_path / "tgt"), "architectures": ["LlamaForCausalLM"]}
    draft = load_checkpoint(out, embed_from=target)
    assert draft.cfg.draft_vocab_size == 50 and torch.equal(draft.target_ids(), torch.arange(50))
    assert torch.equal(draft.embed_tokens.weight, target.get_input_embeddings().weight)
    full = tmp_path / "full"  # a drafter saved without embeddings gets the target's on request
    assert cli.main(["export", str(out), str(full), "--with-embed", "--target", "tiny", "--dtype", "fp32"]) == 0
    assert torch.equal(read_dir(full)[1]["embed_tokens.weight"], target.get_input_embeddings().weight)


# --------------------------------------------------------------------------- bad inputs
def edit_weights(fn):
    def apply(d: Path):
        t = load_file(d / "model.safetensors")
        fn(t)
        save_file(t, d / "model.safetensors")
    return apply


def edit_config(fn):
    def apply(d: Path):
        cj = json.loads((d / "config.json").read_text())
        fn(cj)
        (d / "config.json").write_text(json.dumps(cj))
    return apply


def _set(t, key, value):
    t[key] = value


def _poke(key, idx, value):
    def fn(t):
        t[key] = t[key].clone()
        t[key].view(-1)[idx] = value
    return fn


def _both_ids(ids):
    def fn(cj):
        cj["eagle_aux_hidden_state_layer_ids"] = ids
        cj["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in ids]  # SGLang's spelling
    return fn


def _truncate(d):
    b = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(b[: len(b) // 2])


BAD = {
    "corrupt": (lambda d: (d / "model.safetensors").write_bytes(b"not safetensors" * 9),
                r"model\.safetensors: not a readable weights file"),
    "truncated": (_truncate, r"model\.safetensors: not a readable weights file"),
    "no_config": (lambda d: (d / "config.json").unlink(), r"config\.json: missing"),
    "bad_json": (lambda d: (d / "config.json").write_text("{"), r"config\.json: not valid JSON"),
    "extra_key": (edit_weights(lambda t: _set(t, "foo.weight", torch.zeros(3))),
                  r"model\.safetensors: unexpected tensor foo\.weight"),
    "missing_fc": (edit_weights(lambda t: t.pop("fc.weight")), r"missing tensor fc\.weight"),
    "missing_d2t": (edit_weights(lambda t: t.pop("d2t")),
                    r"model\.safetensors: missing tensor d2t .*silently use all-zero"),
    "missing_hidden_norm": (edit_weights(lambda t: t.pop("midlayer.hidden_norm.weight")),
                            r"model\.safetensors: missing tensor midlayer\.hidden_norm\.weight .*silently use ones"),
    "wrong_shape": (edit_weights(lambda t: _set(t, "midlayer.self_attn.q_proj.weight", torch.zeros(64, 64))),
                    r"q_proj\.weight has shape \[64, 64\] but config\.json implies \[64, 128\]"),
    "fc_width": (edit_weights(lambda t: _set(t, "fc.weight", torch.zeros(64, 128))),
                 r"fc\.weight has shape \[64, 128\] but config\.json implies \[64, 192\]"),
    "nan": (edit_weights(_poke("lm_head.weight", 7, float("nan"))), r"lm_head\.weight contains NaN or inf"),
    "inf": (edit_weights(_poke("fc.weight", 3, float("inf"))), r"fc\.weight contains NaN or inf"),
    "d2t_range": (edit_weights(_poke("d2t", -1, 10**6)), r"model\.safetensors: d2t maps .* outside"),
    "d2t_collision": (edit_weights(lambda t: _poke("d2t", 1, int(t["d2t"][0]) - 1)(t)),
                      r"d2t maps two draft ids to one target id"),
    "d2t_float": (edit_weights(lambda t: _set(t, "d2t", t["d2t"].float())), r"d2t has dtype .*integer"),
    "t2d_mismatch": (edit_weights(lambda t: _set(t, "t2d", ~t["t2d"])), r"t2d does not mark"),
    "draft_vocab_cfg": (edit_config(lambda cj: _set(cj, "draft_vocab_size", 90)),
                        r"lm_head\.weight has shape \[100, 64\] but config\.json implies \[90, 64\]"),
    "aux_range": (edit_config(_both_ids([2, 4, 9])), r"config\.json: aux layer ids \[2, 4, 9\] out of range"),
    "aux_disagree": (edit_config(lambda cj: _set(cj, "eagle_aux_hidden_state_layer_ids", [3, 4, 5])),
                     r"config\.json: aux ids disagree"),
    "two_layers": (edit_config(lambda cj: _set(cj, "num_hidden_layers", 2)), r"missing tensor layers\.1\."),
    "unknown_target_layers": (edit_config(lambda cj: cj["fledge"].pop("target_num_hidden_layers")),
                            r"config\.json: .*--target-layers"),
    "duplicate_key": (lambda d: save_file({"fc.weight": torch.zeros(64, 192)}, d / "extra.safetensors"),
                      r"fc\.weight appears twice"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_refused(tmp_path, case):
    mutate, pattern = BAD[case]
    draft, _ = tiny_draft()
    src = export_checkpoint(draft, tmp_path / "src")
    mutate(src)
    problems = validate_checkpoint(src)
    assert problems and any(re.search(pattern, p) for p in problems), problems
    assert all(str(src) in p for p in problems)  # every problem names its file
    with pytest.raises(FledgeError):
        load_checkpoint(src)
    out = tmp_path / "out"
    assert cli.main(["import", str(src), str(out)]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # nothing written, no temp dir left


def test_speculators_norm_before_residual_default_refused(tmp_path):
    draft, _ = tiny_draft()
    src = export_checkpoint(draft, tmp_path / "s", layout="speculators", verifier="v")
    edit_config(lambda cj: cj.pop("norm_before_residual"))(src)  # vLLM then defaults it to true
    assert any("norm_before_residual" in p for p in validate_checkpoint(src))
    edit_config(lambda cj: cj.update(norm_before_residual=False, fc_norm=True))(src)
    assert any("fc_norm" in p for p in validate_checkpoint(src))
    edit_config(lambda cj: cj.update(fc_norm=False, transformer_layer_config={
        **cj["transformer_layer_config"], "model_type": "qwen3"}))(src)
    assert any("model_type 'qwen3'" in p for p in validate_checkpoint(src))
