"""`fledge adapt`: rows carried by target id, new rows from NEW's head, NEW's vocab, the identity
when nothing changed, refused shapes, and a short fine-tune through the CLI."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from conftest import make_tiny

from fledge.cli import main as cli_main
from fledge.core.config import DraftConfig
from fledge.core.errors import FledgeError
from fledge.core.target import Target
from fledge.drafter.checkpoint import (
    export_checkpoint,
    load_checkpoint,
    validate_checkpoint,
)
from fledge.drafter.eagle3 import Eagle3Draft
from fledge.train.adapt import AdaptConfig, adapt, adapt_draft

V, N = 301, 64  # tiny target vocab, draft vocab


def write_data(path, seed, n=24, length=20):
    """Zipf-distributed tokens over a seed-dependent ranking, so two seeds give two draft vocabs
    that overlap in part."""
    g = torch.Generator().manual_seed(seed)
    rank = torch.randperm(V, generator=g)
    weights = torch.empty(V)
    weights[rank] = 1.0 / torch.arange(1, V + 1).float()
    with open(path, "w") as f:
        for i in range(n):
            ids = torch.multinomial(weights, length, replacement=True, generator=g).tolist()
            f.write(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": [0] * 3 + [1] * (length - 3)}) + "\n")
    return str(path)


def brute_vocab(path, n=N) -> list[int]:
    """Top-n loss-masked tokens, ties to the lower id, unseen ids filling up, ascending."""
    counts = Counter()
    for line in open(path):
        r = json.loads(line)
        counts.update(t for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    return sorted(sorted(range(V), key=lambda t: (-counts[t], t))[:n])


def old_drafter(model, ids, out, aux=None, seed=3, eagle31=False, layers=1) -> Eagle3Draft:
    """A random 'trained' drafter for `model` over `ids`, exported (fp32) to `out`."""
    cfg = DraftConfig.from_target(model.config, draft_vocab_size=len(ids), aux_layer_ids=aux).replace(
        fc_norm=eagle31, norm_output=eagle31, num_hidden_layers=layers)
    draft = Eagle3Draft.from_target(cfg, model, torch.tensor(ids))
    torch.manual_seed(seed)
    for p in draft.parameters():  # norms start at ones; randomise so a misplaced norm would show
        if p.requires_grad:
            p.data.normal_(0, 0.2 if p.ndim > 1 else 1.0)
    export_checkpoint(draft, out, dtype=torch.float32)
    return draft


def predict(draft, seed=0, t=9):
    """Draft-vocab logits of one causal step over random fused aux states, and argmax target ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, t), generator=g)
    aux = torch.randn(2, t, 3 * draft.cfg.target_hidden_size, generator=g)
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        out, _ = draft(ids, aux, torch.arange(t).expand(2, t), mask)
        logits = draft.logits(out)
    return logits, draft.target_ids()[logits.argmax(-1)]


def test_rows_by_target_id_and_new_vocab(tmp_path):
    old_model, new_model = make_tiny("llama", seed=0), make_tiny("llama", seed=1)
    old_ids = brute_vocab(write_data(tmp_path / "old.jsonl", seed=0))
    old = old_drafter(old_model, old_ids, tmp_path / "old", aux=(1, 3, 6))
    data = write_data(tmp_path / "new.jsonl", seed=1)
    report = adapt(AdaptConfig(str(tmp_path / "old"), "new", data, str(tmp_path / "run"), rebuild_vocab=True,
                               train=False), Target(new_model, None, "new", None))
    init = load_checkpoint(tmp_path / "run" / "init", embed_from=new_model)

    # (b) with --rebuild-vocab the adapted drafter's vocab is NEW's, from NEW's data
    new_ids = brute_vocab(data)
    assert init.target_ids().tolist() == new_ids
    shared = [t for t in new_ids if t in old_ids]
    assert 0 < len(shared) < N  # both kinds of rows are exercised
    assert report["lm_head_rows"] == {"carried": len(shared), "initialised": N - len(shared)}
    assert report["vocab"]["overlap"] == len(shared)

    # (a) shared tokens keep OLD's row (matched by target id), new ones get NEW's head row rescaled
    new_head = new_model.get_output_embeddings().weight.detach()
    median = torch.stack([old.lm_head.weight[old_ids.index(t)] for t in shared]).norm(dim=1).median()
    for i, t in enumerate(new_ids):
        row = init.lm_head.weight[i]
        if t in old_ids:
            assert torch.equal(row, old.lm_head.weight[old_ids.index(t)].detach()), t
        else:
            expect = new_head[t] * median / new_head[t].norm()
            torch.testing.assert_close(row, expect, rtol=1e-6, atol=1e-7)
    old_sd, sd = old.state_dict(), init.state_dict()
    carried = [k for k in sd if k.split(".")[0] in ("fc", "midlayer", "norm")]
    assert sorted(carried) == sorted(report["tensors_carried"]) and len(carried) == 12
    assert all(torch.equal(sd[k], old_sd[k]) for k in carried)
    assert torch.equal(init.embed_tokens.weight, new_model.get_input_embeddings().weight.detach())
    assert init.cfg.aux_layer_ids == (1, 3, 6)  # OLD's ids kept: NEW has those layers


@pytest.mark.parametrize("eagle31,layers", [(False, 1), (True, 1), (False, 2)])
def test_identity_when_nothing_changed(tmp_path, eagle31, layers):
    """(c) Same target, same data: the adapted, untrained drafter predicts exactly as OLD does
    (an EAGLE-3.1 OLD keeps its layer: fc_norm's weights and norm_output; a two-layer OLD both
    layers)."""
    model = make_tiny("llama", seed=0)
    data = write_data(tmp_path / "d.jsonl", seed=0)
    old_drafter(model, brute_vocab(data), tmp_path / "old", eagle31=eagle31, layers=layers)
    report = adapt(AdaptConfig(str(tmp_path / "old"), "same", data, str(tmp_path / "run"), train=False),
                   Target(model, None, "same", None))
    assert report["lm_head_rows"]["initialised"] == 0 and report["vocab"]["entries_differ"] == 0
    old = load_checkpoint(tmp_path / "old", embed_from=model)
    new = load_checkpoint(tmp_path / "run" / "init", embed_from=model)
    (lo, to), (ln, tn) = predict(old), predict(new)
    assert torch.equal(lo, ln) and torch.equal(to, tn)
    assert (new.cfg.fc_norm, new.cfg.norm_output, new.cfg.num_hidden_layers) == (eagle31, eagle31, layers)


def test_peagle_drafter_refused():
    model = make_tiny("llama")
    ids = torch.arange(0, V, 5)
    old = Eagle3Draft.from_target(DraftConfig.from_target(model.config, ids.numel()), model, ids)
    old.add_mask_slots(3)
    with pytest.raises(FledgeError, match="P-EAGLE drafter.*EAGLE-3 drafter it started from"):
        adapt_draft(old, model, ids)


def test_aux_ids_fall_back_when_new_lacks_the_layers():
    old_model, new_model = make_tiny("llama"), make_tiny("llama", seed=1, num_hidden_layers=7)
    ids = torch.arange(0, V, 5)
    old = Eagle3Draft.from_target(DraftConfig.from_target(old_model.config, ids.numel(), (3, 5, 7)), old_model, ids)
    draft, report = adapt_draft(old, new_model, ids)
    assert draft.cfg.aux_layer_ids == (2, 3, 4) and not report["aux_layer_ids"]["kept"]
    assert report["lm_head_rows"]["initialised"] == 0


def _hf_dir(path, model):
    from test_target import tiny_tokenizer
    model.save_pretrained(path)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    return str(path)


def test_mismatched_width_refused(tmp_path, capsys):
    """(d) A target of another hidden size: one error line, nothing written."""
    old_drafter(make_tiny("llama"), list(range(N)), tmp_path / "old")
    narrow = _hf_dir(tmp_path / "narrow", make_tiny("llama", hidden_size=32))
    data = write_data(tmp_path / "d.jsonl", seed=1)
    rc = cli_main(["adapt", "--drafter", str(tmp_path / "old"), "--target", narrow, "--data", data,
                   "--out", str(tmp_path / "run"), "--no-train"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fledge")]
    assert rc == 2 and len(err) == 1 and "hidden_size 32" in err[0] and "64" in err[0], err
    assert not (tmp_path / "run").exists()
    try:
        adapt_draft(load_checkpoint(tmp_path / "old"), make_tiny("llama", hidden_size=32), torch.arange(N))
        raise AssertionError("adapt_draft accepted a narrower target")
    except FledgeError as e:
        assert "\n" not in str(e)


def test_an_input_inside_what_adapt_writes_is_refused(tmp_path, capsys):
    """OLD given as the init/ of the same run directory would be replaced by NEW's init."""
    old = tmp_path / "run" / "init"
    old_drafter(make_tiny("llama"), list(range(N)), old)
    before = {p: p.read_bytes() for p in old.rglob("*") if p.is_file()}
    data = write_data(tmp_path / "d.jsonl", seed=1)
    rc = cli_main(["adapt", "--drafter", str(old), "--target", _hf_dir(tmp_path / "t", make_tiny("llama")),
                   "--data", data, "--out", str(tmp_path / "run"), "--no-train"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fledge")]
    assert rc == 2 and len(err) == 1 and "the input --drafter" in err[0], err
    assert {p: p.read_bytes() for p in old.rglob("*") if p.is_file()} == before


def test_cli_fine_tune_writes_a_valid_drafter(tmp_path, capsys):
    """(e) adapt + a two-step fine-tune through the CLI; a rerun resumes, other inputs are refused."""
    from test_target import save_tiny_dir
    target_dir = tmp_path / "target"
    new_model = save_tiny_dir(target_dir)
    old_drafter(make_tiny("llama", seed=1), list(range(0, 2 * N, 2)), tmp_path / "old")
    data = write_data(tmp_path / "d.jsonl", seed=2)
    args = ["adapt", "--drafter", str(tmp_path / "old"), "--target", str(target_dir), "--data", data,
            "--out", str(tmp_path / "run"), "--max-steps", "2", "--batch-size", "2", "--ttt-steps", "2",
            "--eval-samples", "2", "--pad-multiple", "1", "--loop-cut", "4", "--rebuild-vocab", "--draft-vocab", "48"]
    assert cli_main(args) == 0
    printed = capsys.readouterr()
    assert "fledge train: --loop-cut 4 cut" in printed.err  # a data option, passed to the fine-tune
    final = tmp_path / "run" / "train" / "draft"
    assert validate_checkpoint(final) == []
    draft = load_checkpoint(final, embed_from=new_model)
    assert draft.target_ids().tolist() == brute_vocab(data, 48)
    report = json.loads((tmp_path / "run" / "adapt.json").read_text())
    assert report["train"]["steps"] == 2 and report["train"]["draft"] == str(final)
    out = printed.out
    assert "lm_head rows carried / initialised" in out and "held-out accept length" in out
    before, after = report["heldout"]["before"], report["heldout"]["after"]
    assert after["accept_len"] == report["train"]["eval"]["accept_len"]
    assert after["loss0"] == report["train"]["eval"]["loss"][0]
    assert 1.0 <= before["accept_len"] <= 3.0  # ttt-steps 2: at most 2 drafts + the bonus
    assert before["loss0"] != after["loss0"]  # measured on the drafter before the fine-tune moved it
    assert cli_main(args) == 0  # resumes: training is already done, the drafter is re-exported
    assert cli_main(args[:-1] + ["40"]) == 2
    assert "other arguments" in capsys.readouterr().err


def test_vocab_kept_unless_rebuild_asked(tmp_path, capsys):
    """By default adapt keeps OLD's vocab (data too small to rebuild one is the usual case); with
    --rebuild-vocab it says how many tokens changed and warns when --data shows fewer distinct
    tokens than the vocab holds."""
    old_model, new_model = make_tiny("llama", seed=0), make_tiny("llama", seed=1)
    old_ids = brute_vocab(write_data(tmp_path / "old.jsonl", seed=0))
    old_drafter(old_model, old_ids, tmp_path / "old")
    small = write_data(tmp_path / "small.jsonl", seed=1, n=2, length=12)  # 18 masked tokens < 64 slots
    new = Target(new_model, None, "new", None)
    kept = adapt(AdaptConfig(str(tmp_path / "old"), "new", small, str(tmp_path / "keep"), train=False), new)
    assert load_checkpoint(tmp_path / "keep" / "init", embed_from=new_model).target_ids().tolist() == old_ids
    assert kept["vocab"]["entries_differ"] == 0 and not kept["vocab"]["rebuilt"] and kept["warnings"] == []
    assert kept["lm_head_rows"] == {"carried": N, "initialised": 0}

    rebuilt = adapt(AdaptConfig(str(tmp_path / "old"), "new", small, str(tmp_path / "rebuild"), rebuild_vocab=True,
                                train=False), new)
    seen = len({t for r in map(json.loads, open(small)) for t, m in zip(r["input_ids"], r["loss_mask"]) if m})
    assert rebuilt["vocab"]["distinct_data_tokens"] == seen < N
    assert rebuilt["vocab"]["only_b"] == len(set(brute_vocab(small)) - set(old_ids)) > 0
    assert len(rebuilt["warnings"]) == 1 and f"{seen:,} distinct" in rebuilt["warnings"][0]
    assert "warning" in capsys.readouterr().err
    try:
        AdaptConfig(str(tmp_path / "old"), "new", small, str(tmp_path / "x"), draft_vocab=32)
        raise AssertionError("--draft-vocab without --rebuild-vocab accepted")
    except FledgeError as e:
        assert "--rebuild-vocab" in str(e)
