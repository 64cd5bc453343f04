"""Draft vocab: top-N loss-masked tokens against brute force; coverage; diff; the CLI."""

from __future__ import annotations

import collections
import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from fledge import cli
from fledge.core.conventions import target_ids_from_d2t
from fledge.core.errors import FledgeError
from fledge.data.vocab import build_vocab, coverage, diff_vocab, load_vocab_ids


def brute_top(counts: dict, target_vocab: int, n: int) -> list[int]:
    return sorted(sorted(range(target_vocab), key=lambda t: (-counts.get(t, 0), t))[:n])


def write_dataset(path, rng, target_vocab, n=40, masked_only_token=None):
    """Random tokenized samples; `masked_only_token` appears often but only at loss_mask 0."""
    recs = []
    for i in range(n):
        length = rng.randint(5, 60)
        ids = [min(int(rng.paretovariate(1.2)) - 1, target_vocab - 1) * 7 % target_vocab for _ in range(length)]
        mask = [int(rng.random() < 0.6) for _ in range(length)]
        if masked_only_token is not None:
            ids += [masked_only_token] * 30
            mask += [0] * 30
        recs.append({"id": f"s{i}", "input_ids": ids, "loss_mask": mask})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs


def masked_counter(recs):
    return collections.Counter(t for r in recs for t, m in zip(r["input_ids"], r["loss_mask"]) if m)


def test_build_vocab_matches_brute_force_with_ties():
    rng = random.Random()
    target_vocab, n = rng.randint(50, 400), rng.randint(5, 40)
    counts = {t: rng.randint(0, 6) for t in rng.sample(range(target_vocab), target_vocab // 2)}  # many ties
    d2t, t2d = build_vocab(counts, target_vocab, n)
    ids = target_ids_from_d2t(d2t, target_vocab)
    assert ids.tolist() == brute_top(counts, target_vocab, n)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.numel() == target_vocab
    assert t2d.nonzero().flatten().tolist() == ids.tolist()
    dense = torch.zeros(target_vocab, dtype=torch.int64)
    for t, c in counts.items():
        dense[t] = c
    assert torch.equal(build_vocab(dense, target_vocab, n)[0], d2t)


def test_shortfall_is_filled_with_lowest_unseen_ids():
    d2t, _ = build_vocab({9: 5, 3: 5, 7: 1}, 20, 6)
    assert target_ids_from_d2t(d2t, 20).tolist() == [0, 1, 2, 3, 7, 9]


def test_dataset_counts_only_loss_masked_tokens(tmp_path):
    rng = random.Random()
    target_vocab = 97
    recs = write_dataset(tmp_path / "t.jsonl", rng, target_vocab, masked_only_token=96)
    counts = masked_counter(recs)
    d2t, _ = build_vocab(tmp_path / "t.jsonl", target_vocab, 12)
    ids = target_ids_from_d2t(d2t, target_vocab).tolist()
    assert ids == brute_top(counts, target_vocab, 12) and 96 not in ids
    with pytest.raises(FledgeError, match="outside"):
        build_vocab(tmp_path / "t.jsonl", 50, 12)


def test_coverage_matches_brute_force(tmp_path):
    rng = random.Random()
    recs = write_dataset(tmp_path / "h.jsonl", rng, 97)
    vocab = sorted(rng.sample(range(97), 20))
    masked = [t for r in recs for t, m in zip(r["input_ids"], r["loss_mask"]) if m]
    assert coverage(torch.tensor(vocab), tmp_path / "h.jsonl") == pytest.approx(
        sum(t in set(vocab) for t in masked) / len(masked))


def test_diff_vocab_counts_positions_and_overlap():
    rng = random.Random()
    a = sorted(rng.sample(range(1000), 100))
    swap_out = set(rng.sample(a, 7))
    b = sorted([t for t in a if t not in swap_out] + rng.sample([t for t in range(1000) if t not in a], 7))
    d = diff_vocab(torch.tensor(a), torch.tensor(b))
    assert d["overlap"] == 93 and d["only_a"] == d["only_b"] == 7
    assert d["entries_differ"] == sum(x != y for x, y in zip(a, b)) and d["entries_differ"] >= 1
    assert diff_vocab(torch.tensor(a), torch.tensor(a))["entries_differ"] == 0
    assert d["jaccard"] == pytest.approx(93 / 107)


def test_cli_build_coverage_and_diff_against_a_checkpoint(tmp_path, capsys):
    rng = random.Random()
    recs = write_dataset(tmp_path / "train.jsonl", rng, 97)
    write_dataset(tmp_path / "held.jsonl", rng, 97)
    out = tmp_path / "vocab.safetensors"
    assert cli.main(["vocab", "build", str(tmp_path / "train.jsonl"), "--size", "16", "--target-vocab", "97",
                     "--heldout", str(tmp_path / "held.jsonl"), "-o", str(out)]) == 0
    tensors = load_file(out)
    assert set(tensors) == {"d2t", "t2d"}
    ids = target_ids_from_d2t(tensors["d2t"], 97)
    assert ids.tolist() == brute_top(masked_counter(recs), 97, 16)
    stats = json.loads(out.with_suffix(".json").read_text())
    assert stats["heldout_coverage"] == pytest.approx(coverage(ids, tmp_path / "held.jsonl"))
    # A drafter checkpoint dir: d2t inside model.safetensors next to other weights, no t2d.
    ckpt = tmp_path / "drafter"
    ckpt.mkdir()
    extra = next(t for t in range(97) if t not in ids.tolist())
    other = torch.tensor(sorted(ids.tolist()[:-1] + [extra]))
    save_file({"d2t": other - torch.arange(16), "fc.weight": torch.zeros(2, 2)}, ckpt / "model.safetensors")
    (ckpt / "config.json").write_text(json.dumps({"vocab_size": 97, "draft_vocab_size": 16}))
    assert load_vocab_ids(ckpt)[0].tolist() == other.tolist()
    capsys.readouterr()
    assert cli.main(["vocab", "diff", str(out), str(ckpt)]) == 0
    printed = capsys.readouterr().out
    assert any(line.split()[:2] == ["overlap", "15"] for line in printed.splitlines())
    assert cli.main(["vocab", "coverage", str(ckpt), str(tmp_path / "held.jsonl")]) == 0


def test_build_warns_when_slots_hold_unseen_ids(tmp_path, capsys):
    rng = random.Random(3)
    recs = write_dataset(tmp_path / "t.jsonl", rng, 97, n=10)
    distinct = len(masked_counter(recs))
    out = tmp_path / "v.safetensors"
    assert cli.main(["vocab", "build", str(tmp_path / "t.jsonl"), "--size", "90", "--target-vocab", "97",
                     "-o", str(out)]) == 0
    err = capsys.readouterr().err
    stats = json.loads(out.with_suffix(".json").read_text())
    unseen = 90 - distinct
    assert stats["unseen_in_vocab"] == unseen and stats["distinct_tokens"] == distinct
    assert f"{unseen} of the 90 vocab slots hold ids never seen" in stats["warning"]
    assert err.count(f"warning: {unseen} of the 90 vocab slots") == 1
    assert cli.main(["vocab", "build", str(tmp_path / "t.jsonl"), "--size", str(distinct), "--target-vocab", "97",
                     "-o", str(out)]) == 0
    assert "warning" not in json.loads(out.with_suffix(".json").read_text())
    assert "never seen" not in capsys.readouterr().err


@pytest.mark.parametrize("shard", ["../elsewhere.safetensors", "absolute"])
def test_index_shard_outside_the_checkpoint_is_refused(tmp_path, shard):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"d2t": torch.zeros(4, dtype=torch.int64), "t2d": torch.ones(4, dtype=torch.bool)},
              str(tmp_path / "elsewhere.safetensors"))
    shard = str(tmp_path / "elsewhere.safetensors") if shard == "absolute" else shard
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"d2t": shard}}))
    with pytest.raises(FledgeError, match="is not a file name inside|leads outside"):
        load_vocab_ids(ckpt)
