"""The repo's bench scripts: scale-out arithmetic against hand-built metrics, and the regen
bench end to end on a tiny target (engine vs HF generate, same prompts)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import bench_scale  # noqa: E402


def write_run(path: Path, tok_s: list[float], objective: list[float]) -> None:
    path.mkdir()
    rows = [{"kind": "train", "step": 5 * (i + 1), "objective": o, "target_tok_s": t}
            for i, (t, o) in enumerate(zip(tok_s, objective))]
    rows.insert(2, {"kind": "eval", "step": 10, "objective": 99.0})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_scale_efficiency_and_loss_agreement(tmp_path):
    rng = random.Random()
    one = [rng.uniform(1e4, 2e4) for _ in range(6)]
    two = [rng.uniform(2e4, 4e4) for _ in range(6)]
    loss = [rng.uniform(1, 5) for _ in range(6)]
    bumped = [x * (1 + 0.01 * (i == 4)) for i, x in enumerate(loss)]
    write_run(tmp_path / "gpu1", one, loss)
    write_run(tmp_path / "ddp2", two, bumped)
    runs = {p: bench_scale.load_run(tmp_path / p) for p in ("gpu1", "ddp2")}
    s = bench_scale.summarize(runs, {"gpu1": 1, "ddp2": 2}, skip=2)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert s["gpu1"]["tok_s"] == pytest.approx(mean(one[2:]))
    assert s["ddp2"]["tok_s_per_gpu"] == pytest.approx(mean(two[2:]) / 2)
    assert s["ddp2"]["scaling_efficiency"] == pytest.approx(mean(two[2:]) / 2 / mean(one[2:]))
    assert s["ddp2"]["max_rel_loss_diff_vs_1gpu"] == pytest.approx(0.01)
    assert s["gpu1"]["max_rel_loss_diff_vs_1gpu"] == 0


def test_scale_cli_reports_missing_run(tmp_path, capsys):
    assert bench_scale.main([str(tmp_path / "nope"), str(tmp_path / "nope2"), "--ranks", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench_scale: error:") and "nope" in err and "\n" not in err


@pytest.mark.slow  # loads SmolLM2 and runs HF generate next to the engine
def test_regen_bench_engine_matches_hf_in_fp32(tmp_path):
    import bench_regen
    out = tmp_path / "regen.json"
    assert bench_regen.main(["--batch-sizes", "3", "--max-new-tokens", "6", "--device", "cpu",
                             "--dtype", "float32", "--compare-one-group", "--stream", "5", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    assert row["same_rows_one_group"] == 3  # grouping is an optimisation: same answers
    # fp32 on the CPU: right-padded engine and left-padded HF compute the same greedy answers.
    assert row["batch"] == 3 and row["same_rows"] == 3
    assert row["engine"]["tokens"] == row["hf"]["tokens"] > 0
    assert row["engine_vs_hf"] == pytest.approx(row["engine"]["tok_s"] / row["hf"]["tok_s"])
    assert row["engine_stream"]["prompts"] == 5 and row["engine_stream"]["tokens"] > row["engine"]["tokens"]


def test_engine_bench_rows_equal_ar_in_fp32(tmp_path, monkeypatch):
    """bench_engine end to end on the CPU with the shipped drafter: in fp32 every row's text is
    AR's (resident rows and the eager-prefill rows alike), the oracle accepts every draft (17
    tokens = the prefill's + two full rounds of 8), and every engine row reports its
    per-request time before the first step. The JSON written after each row (what a run cut
    short by a time limit leaves) already says what ran where, with ratios, under the run's
    variant (the dtype by default)."""
    import bench_engine
    out = tmp_path / "engine.json"
    writes = []
    write = bench_engine.atomic_write_json
    monkeypatch.setattr(bench_engine, "atomic_write_json", lambda path, obj: (writes.append(json.loads(json.dumps(obj))),
                                                                             write(path, obj)))
    drafter = Path(__file__).resolve().parent.parent / "drafters" / "smollm2-135m"
    assert bench_engine.main(["--drafter", str(drafter), "--tree", "3,2,6", "--num-prompts", "2",
                              "--max-new-tokens", "17", "--device", "cpu", "--dtype", "float32",
                              "--skip-hf", "--out", str(out)]) == 0
    final = json.loads(out.read_text())["variants"]["float32"]
    rows = final["results"]
    assert set(rows) == {"engine AR", "eagle3 chain 7", "eagle3 tree 3,2,6", "oracle chain 7", "ngram 3 chain 4",
                         "engine AR (eager prefill)", "oracle chain 7 (eager prefill)"}
    for name, row in rows.items():
        assert row["match_ar"] == row["prompts"] == 2, name
        assert row["tokens"] == rows["engine AR"]["tokens"], name
        assert row["prefill_ms_per_prompt"] > 0, name
        assert row["vs_engine_ar"] == pytest.approx(row["tok_s"] / rows["engine AR"]["tok_s"])
    assert rows["oracle chain 7"]["accept_length"] == 8.0
    assert rows["oracle chain 7"]["histogram"] == [0] * 7 + [4]
    assert 1.0 <= rows["eagle3 chain 7"]["accept_length"] <= 8.0
    first = writes[0]["variants"]["float32"]
    assert first["partial"] and "partial" not in final and len(writes) == len(rows) + 1
    assert {k: v for k, v in first.items() if k not in ("partial", "results")} == \
        {k: v for k, v in final.items() if k != "results"}
    assert final["device"] == "cpu" and final["dtype"] == "float32" and final["hf_prompts"] == 0
    assert list(first["results"]) == ["engine AR"] and first["results"]["engine AR"]["vs_engine_ar"] == 1.0


def test_engine_bench_only_rows_and_a_tree_wider_than_the_default_room(tmp_path, capsys):
    """--only keeps the named rows beside the engine AR baseline, written as its --variant
    beside the file's other variants; a name that is no row, or a results file of another
    layout, is one clear error. A 200-token tree fits the resident cache (a 256-token tree
    once stopped at 'cache of 512 slots < ... + 256')."""
    import bench_engine
    drafter = Path(__file__).resolve().parent.parent / "drafters" / "smollm2-135m"
    common = ["--drafter", str(drafter), "--tree", "3,60,200", "--num-prompts", "1", "--max-new-tokens", "6",
              "--device", "cpu", "--dtype", "float32", "--skip-hf"]
    out = tmp_path / "only.json"
    out.write_text(json.dumps({"variants": {"kept": {"results": {}}}}))
    assert bench_engine.main(common + ["--only", "eagle3 tree 3,60,200", "--variant", "only", "--out", str(out)]) == 0
    variants = json.loads(out.read_text())["variants"]
    report = variants["only"]
    assert list(variants) == ["kept", "only"] and variants["kept"] == {"results": {}}
    assert set(report["results"]) == {"engine AR", "eagle3 tree 3,60,200"}
    assert report["only"] == "eagle3 tree 3,60,200" and report["results"]["eagle3 tree 3,60,200"]["match_ar"] == 1
    capsys.readouterr()
    # refused from the arguments alone, before any load (a target that does not exist)
    assert bench_engine.main(common + ["--target", "no-such-target", "--only", "oracle chain 8",
                                       "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench_engine: error: --only ['oracle chain 8']: not a row") and "\n" not in err
    assert "oracle chain 7" in err
    assert not (tmp_path / "x.json").exists()
    (tmp_path / "old.json").write_text(json.dumps({"results": {}}))
    assert bench_engine.main(common + ["--out", str(tmp_path / "old.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench_engine: error:") and "old.json" in err and "\n" not in err


def test_profile_train_splits_a_step_on_a_tiny_target():
    """profile_train on the CPU: the three phases are timed and add up to about the step, the
    rate follows from the batch, and kernel names fall into the categories the report uses."""
    import profile_train
    from conftest import make_tiny
    r = profile_train.profile(make_tiny("llama"), batch=2, seq=24, ttt_steps=3, draft_vocab=64, steps=3, warmup=1)
    parts = r["features_ms"] + r["ttt_fwd_bwd_ms"] + r["optimizer_ms"]
    assert min(r["features_ms"], r["ttt_fwd_bwd_ms"], r["optimizer_ms"]) > 0
    assert 0.5 * r["step_ms"] <= parts <= 2 * r["step_ms"]
    assert r["target_tok_s"] == pytest.approx(2 * 24 / r["step_ms"] * 1e3)
    assert "kernel_ms" not in r  # kernels are profiled on CUDA only
    # --compare's reference step starts from the same loss on the same inputs
    before = profile_train.profile(make_tiny("llama"), batch=2, seq=24, ttt_steps=3, draft_vocab=64, steps=1, warmup=1,
                                   before=True)
    assert before["variant"].startswith("reference") and r["variant"].startswith("now")
    assert before["first_loss"] == pytest.approx(r["first_loss"], rel=1e-5)
    names = {"fmha_cutlassF_bf16_aligned_64x64_rf_sm80": "attention", "nvjet_tst_64x8_64x16_1x1_v_bz_TNT": "matmul",
             "sm90_xmma_gemm_bf16bf16_bf16f32": "matmul", "cunn_SoftMaxForward<4, float>": "softmax",
             "vectorized_elementwise_kernel": "other", "pytorch_flash::flash_fwd_kernel": "attention"}
    assert {n: profile_train.category(n) for n in names} == names


def test_result_files_are_named_by_benchmark_and_machine(monkeypatch):
    """One results file per benchmark and machine: the GPU's model without its vendor."""
    import torch
    from machine import RESULTS, machine_name, result_path
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert machine_name("cpu") == "cpu" and machine_name("cuda:0") == "h200" and machine_name("cuda", 2) == "h200x2"
    assert result_path("engine", "h200") == RESULTS / "engine_h200.json"
    assert result_path("peer_compare", "h200", "quick") == RESULTS / "peer_compare_h200_quick.json"
    # Every kept result matches the pattern the scripts write: <bench>_<machine>[_<variant>].
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    machines = {"cpu", "h200", "h200x2", machine_name("cuda")}
    assert machine_name("cuda") == "h100_80gb_hbm3"
    files = list(RESULTS.iterdir())
    assert files and all(p.suffix in (".json", ".png") and any(
        p.stem.endswith(f"_{m}") or f"_{m}_" in p.stem for m in machines) for p in files), files


def test_peer_compare_subset_and_vocab_files(tmp_path):
    """The comparison's subset is fixed by file names and ids, not by the order the files are
    given; held-out rows never train; and speculators' d2t/t2d .npy files map the draft vocab to
    the same target ids as fledge's vocab file."""
    import gzip

    import numpy as np
    import peer_compare
    import torch

    from fledge.core.conventions import target_ids_from_d2t
    from fledge.data.vocab import load_vocab_ids, save_vocab

    files = []
    for s in range(3):
        rows = [{"id": f"c{i}", "source": "sharegpt-heldout" if i % 4 == 0 else "sharegpt",
                 "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{s}.{i}"}]}
                for i in range(20)]
        files.append(tmp_path / f"regen_s{s}.jsonl.gz")
        with gzip.open(files[-1], "wt") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
    train, held, available = peer_compare.pick_subset(files, 10, 4)
    again = peer_compare.pick_subset(files[::-1], 10, 4)
    assert (train, held, available) == again
    assert len(train) == 10 and len(held) == 4 and len({r["id"] for r in train + held}) == 14
    assert {r["source"] for r in train} == {"sharegpt"} and {r["source"] for r in held} == {"sharegpt-heldout"}
    assert len({r["id"].split(":")[0] for r in train}) > 1  # drawn from more than one set
    assert available == 45 and len(peer_compare.pick_subset(files, None, 1)[0]) == 45  # 15 training rows a set

    ids = torch.tensor(sorted(random.sample(range(500), 37)))
    save_vocab(tmp_path / "v.safetensors", ids, 500, {})
    d2t, t2d = peer_compare.write_vocab_npy(tmp_path / "v.safetensors", tmp_path, 37)
    assert torch.equal(torch.from_numpy(target_ids_from_d2t(np.load(d2t), 500)), load_vocab_ids(tmp_path / "v.safetensors")[0])
    assert np.load(t2d).dtype == bool and np.flatnonzero(np.load(t2d)).tolist() == ids.tolist()


def test_peer_compare_samples_are_fledges_kept_ones_in_whole_batches(tmp_path):
    """Both trainers read one file of samples: those fledge's loader keeps (a sample with no
    trained token after position 1 is left out), cut to whole batches of fledge's epoch."""
    import peer_compare

    from fledge.train.features import load_samples

    rows = [{"id": f"s{i}", "input_ids": list(range(i + 3)), "loss_mask": [0, 1] + [int(i % 3 != 0)] * (i + 1)}
            for i in range(11)]  # s0, s3, s6, s9 train nothing after position 1
    (tmp_path / "t.tok.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = peer_compare.write_samples(tmp_path / "t.tok.jsonl", tmp_path / "used.jsonl", 64, 100, multiple=3)
    used = load_samples(tmp_path / "used.jsonl", 64, 100)
    assert [s.id for s in used] == ["s1", "s2", "s4", "s5", "s7", "s8"]  # 7 kept, 6 = two batches of 3
    assert got == {"samples": 6, "tokens": sum(len(s.input_ids) for s in used),
                   "trained_tokens": sum(int(s.loss_mask.sum()) for s in used), "left_out": 1}


def test_peer_compare_report_spells_paths_portably():
    """The results file names where things were, not the measuring machine's paths."""
    import peer_compare

    got = peer_compare.portable({"a": ["/srv/run/tok/t.jsonl"], "g": "/tmp/x/M.Q4_1.gguf", "p": "/opt/v/bin/python3",
                                 "me": sys.executable, "peer": "/opt/w/bin/python", "n": 3}, "/opt/w/bin/python", "/srv/run")
    assert got == {"a": ["WORKDIR/tok/t.jsonl"], "g": "M.Q4_1.gguf", "p": "python", "me": "python",
                   "peer": "PEER_PYTHON", "n": 3}


def test_peer_compare_measures_named_drafter_directories(tmp_path):
    """measure --drafters: NAME=DIR is taken as given, a bare NAME must be a drafter trained in
    the workdir, and an empty workdir with no --drafters is refused in one line."""
    import peer_compare

    from fledge.core.errors import FledgeError

    (tmp_path / "train-fledge.json").write_text(json.dumps({"name": "fledge", "trainer": "fledge", "drafter": "/w/d"}))
    assert peer_compare.drafter_dirs(["old=/x/a", "fledge"], tmp_path) == {"old": "/x/a", "fledge": "/w/d"}
    assert peer_compare.drafter_dirs(None, tmp_path) == {"fledge": "/w/d"}
    with pytest.raises(FledgeError, match="not trained in"):
        peer_compare.drafter_dirs(["speculators"], tmp_path)
    with pytest.raises(FledgeError, match="NAME=DIR"):
        peer_compare.drafter_dirs(None, tmp_path / "empty")
