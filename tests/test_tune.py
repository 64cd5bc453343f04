"""The cost model against brute force: chains against Bernoulli simulation, trees against an
independent Monte Carlo walk, the Kimi-K2.5 what-if against the formula, bad input."""

from __future__ import annotations

import importlib.util
import json
import math
import random
from pathlib import Path

import pytest

from fledge.cli import main
from fledge.core.errors import FledgeError
from fledge.core.shape import Shape
from fledge.perf.acceptance import (
    Profile,
    build_tree,
    chain_accept_length,
    expected_accept_length,
    profile_from_json,
)
from fledge.perf.tune import (
    Timings,
    grid,
    parse_ms_table,
    predict,
    rank_all,
    report,
    stops_paying,
    sweep,
    verdict,
)


def _mc_tolerance(samples: list[float]) -> float:
    """Five standard errors of the sample mean: a false failure is ~1 in 10^6."""
    m = sum(samples) / len(samples)
    var = sum((x - m) ** 2 for x in samples) / (len(samples) - 1)
    return 5 * math.sqrt(var / len(samples)) + 1e-9


def test_chain_formula_matches_bernoulli_simulation():
    rng = random.Random()
    for _ in range(3):
        p = [rng.uniform(0.2, 0.95) for _ in range(rng.randint(1, 8))]
        lengths = []
        for _ in range(20000):
            n = 1  # the bonus token
            for x in p:
                if rng.random() >= x:
                    break
                n += 1
            lengths.append(n)
        mean = sum(lengths) / len(lengths)
        want = chain_accept_length(p)
        assert abs(mean - want) < _mc_tolerance(lengths), (p, mean, want)
        assert expected_accept_length(Profile([[x] for x in p]), Shape(len(p), 1, len(p) + 1)) == pytest.approx(want)


def random_table(rng, depth: int, width: int) -> list[list[float]]:
    rows = []
    for _ in range(depth):
        w = [rng.random() ** 2 for _ in range(width)]
        total = rng.uniform(0.5, 0.97) / sum(w)
        rows.append(sorted((x * total for x in w), reverse=True))
    return rows


def random_profile(rng, depth: int, width: int) -> Profile:
    """Two unrelated tables, so a walk that reads the wrong one for a node shows."""
    return Profile(random_table(rng, depth, width), random_table(rng, depth, width))


def rank_paths(profile: Profile, shape: Shape) -> set[tuple[int, ...]]:
    """Each kept node as the tuple of sibling ranks from the root."""
    tree, out = build_tree(profile, shape), []
    for n in tree:
        out.append((out[n.parent] if n.parent >= 0 else ()) + (n.rank,))
    return set(out)


def test_tree_expectation_matches_independent_monte_carlo():
    rng = random.Random()
    for shape in [Shape(3, 2, 6), Shape(4, 4, 16), Shape(5, 3, 12), Shape(2, 8, 20)]:
        prof = random_profile(rng, shape.num_steps, shape.topk)
        kept = rank_paths(prof, shape)
        lengths = []
        for _ in range(20000):
            ranks, n = (), 1
            for d in range(1, shape.num_steps + 1):  # the target's choice at each depth, then look it up
                u, acc, pick = rng.random(), 0.0, None
                table = prof.spine if all(x == 0 for x in ranks) else prof.ranks
                for r in range(shape.topk):
                    acc += table[d - 1][r]
                    if u < acc:
                        pick = r
                        break
                if pick is None or ranks + (pick,) not in kept:
                    break
                ranks, n = ranks + (pick,), n + 1
            lengths.append(n)
        mean = sum(lengths) / len(lengths)
        exact = expected_accept_length(prof, shape)
        assert abs(mean - exact) < _mc_tolerance(lengths), (shape, mean, exact)


def test_a_chain_reads_the_spine_and_one_table_serves_both(tmp_path):
    rng = random.Random()
    prof = random_profile(rng, 6, 4)
    for s in range(1, 7):
        want = chain_accept_length([row[0] for row in prof.spine[:s]])
        assert expected_accept_length(prof, Shape(s, 1, s + 1)) == pytest.approx(want)
    # Each node's probability: the spine's table while its parent is on the spine, the other after.
    tree, paths = build_tree(prof, Shape(3, 2, 11)), []
    for n in tree:
        paths.append((paths[n.parent] if n.parent >= 0 else ()) + (n.rank,))
        path = paths[-1]
        want = math.prod((prof.spine if not any(path[:i]) else prof.ranks)[i][r] for i, r in enumerate(path))
        assert n.prob == pytest.approx(want) and n.spine == (not any(path))
    # A one-table JSON (an older probe, a vLLM log) serves the spine and the rest alike.
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"profile": {"ranks": prof.ranks}}))
    loaded = profile_from_json(old)
    assert loaded.spine == loaded.ranks == prof.ranks
    new = tmp_path / "new.json"
    new.write_text(json.dumps({"profile": prof.tables()}))
    assert profile_from_json(new) == prof


def test_tree_shape_follows_the_engine_rule():
    rng = random.Random()
    prof = random_profile(rng, 4, 3)
    full = Shape(4, 3, 1 + 3 + 3 * 9)
    tree = build_tree(prof, full)
    assert len(tree) == full.num_draft_tokens - 1  # every candidate kept
    assert sum(n.depth == 1 for n in tree) == 3 and all(sum(n.depth == d for n in tree) == 9 for d in (2, 3, 4))
    previous = 1.0
    for n_tokens in range(2, full.num_draft_tokens + 1):
        t = build_tree(prof, Shape(4, 3, n_tokens))
        assert all(n.parent < i for i, n in enumerate(t))  # parents kept, and before children
        e = expected_accept_length(prof, Shape(4, 3, n_tokens))
        assert e >= previous - 1e-12  # one more node never lowers the expectation
        previous = e
    # A bigger tree of the same shape keeps what the smaller one kept (best-first selection).
    assert rank_paths(prof, Shape(4, 3, 8)) <= rank_paths(prof, Shape(4, 3, 12))


def test_geometric_fit_and_interpolation():
    for L, s in [(2.1, 3), (1.5, 7), (3.9, 4)]:
        p = Profile.fit(L, Shape(s, 1, s + 1)).ranks[0][0]
        assert chain_accept_length([p] * s) == pytest.approx(L, abs=1e-9)
    t = Timings(10, {1: 10, 8: 24, 16: 40}, {1: 1.0, 4: 2.5})
    assert [t.verify(n) for n in (1, 8, 16)] == [10, 24, 40]
    assert t.verify(4) == pytest.approx(10 + 14 * 3 / 7)
    assert t.verify(32) == pytest.approx(72)  # the last segment, extended
    assert t.draft(2) == pytest.approx(1.5)


def test_kimi_k25_what_if_says_speculation_loses(tmp_path):
    """DESIGN.md: no-spec 82-90 tok/s (t_ar = 1000/86 ms), verify ~30 ms, accept ~2.1 measured
    at 3 steps, 54-57 tok/s observed. The prediction is derived here from the formula."""
    ar_ms, verify_ms, draft_ms, L = 1000 / 86, 30.0, 1.5, 2.1
    out = tmp_path / "kimi.json"
    rc = main(["tune", "what-if", "--ar-ms", str(ar_ms), "--verify-ms", f"4:{verify_ms}", "--draft-ms", str(draft_ms),
               "--accept-length", str(L), "--accept-steps", "3", "--json", str(out), "--png", str(tmp_path / "k.png")])
    assert rc == 0 and (tmp_path / "k.png").stat().st_size > 1000
    data = json.loads(out.read_text())
    at_theirs = next(p for p in data["predictions"] if (p["num_steps"], p["topk"]) == (3, 1))
    iter_ms = 3 * draft_ms + verify_ms
    assert at_theirs["accept_length"] == pytest.approx(L, abs=1e-6)
    assert at_theirs["tok_s"] == pytest.approx(1e3 * L / iter_ms)
    assert at_theirs["tok_s"] < 1e3 / ar_ms  # ~61 < 86: speculation loses on their hardware
    assert at_theirs["break_even_accept_length"] == pytest.approx(iter_ms / ar_ms)  # ~2.97: needs 3+
    assert not data["pays"] and data["best"]["tok_s"] < 1e3 / ar_ms
    assert data["verdict"].startswith("VERDICT: serve without speculation")
    assert data["gain_percent"] == pytest.approx(100 * (data["best"]["tok_s"] * ar_ms / 1e3 - 1))
    assert any(p["topk"] > 1 for p in data["predictions"])  # an accept length alone ranks trees too


def test_predictions_rank_and_flags():
    prof = random_profile(random.Random(0), 8, 4)
    t = Timings(8, {1: 8, 16: 10, 64: 20}, {1: 0.5, 4: 0.7})
    preds = rank_all(prof, t, grid(6, (1, 2, 4)))
    assert [p.tok_s for p in preds] == sorted((p.tok_s for p in preds), reverse=True)
    best = preds[0]
    assert best.tok_s == pytest.approx(1e3 * best.accept_length / best.iter_ms)
    assert predict(prof, t, best.shape).speedup == pytest.approx(best.tok_s * 8 / 1e3)
    flags = Shape(5, 4, 16).sglang_flags()
    assert flags.split() == ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "5",
                             "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16"]
    assert Shape(5, 4, 16).vllm_flags("d") is None
    assert json.loads(Shape(3, 1, 4).vllm_flags("d").split("'")[1]) == {"method": "eagle3", "model": "d",
                                                                        "num_speculative_tokens": 3}


def test_bad_input(capsys):
    for bad in ["1:2,x", "", "8-30"]:
        with pytest.raises(FledgeError):
            parse_ms_table(bad, "--verify-ms")
    with pytest.raises(FledgeError):
        Profile([[0.8, 0.3]])  # sums past 1
    with pytest.raises(FledgeError):
        Shape(3, 1, 6)  # a chain verifies steps + 1
    rc = main(["tune", "what-if", "--ar-ms", "10", "--verify-ms", "1:ten", "--draft-ms", "1", "--accept-length", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--verify-ms" in err and len(err.splitlines()) == 1
    rc = main(["tune", "what-if", "--ar-ms", "10", "--verify-ms", "1:10", "--draft-ms", "1", "--accept-length", "9"])
    assert rc == 2 and "--accept-length" in capsys.readouterr().err


def test_verdict_needs_a_margin_and_flags_only_when_it_pays(tmp_path):
    """A 3% gain on these timings is inside the 5% margin: serve without speculation, no flags;
    the same timings with --margin 0 speculate and print the flags."""
    prof = Profile([[0.5]] * 3)
    L = chain_accept_length([0.5])  # the 1-step chain: 1.5
    ar = 10.0
    verify = L * ar / 1.03 - 0.5  # the 1-step chain gains exactly 3%
    t = Timings(ar, {1: ar, 2: verify, 3: 10 * ar}, {1: 0.5})
    preds = rank_all(prof, t, grid(3, (1,)))
    assert preds[0].shape == Shape(1, 1, 2) and preds[0].speedup == pytest.approx(1.03)
    text, data = report(preds, t, "d", margin=0.05)
    assert "serve without speculation" in text and "inside the 5% margin" in text and "SGLang:" not in text
    assert not data["pays"]
    text, data = report(preds, t, "d", margin=0.0)
    assert data["pays"] and "VERDICT: speculate with s1 k1 n2" in text and "--speculative-num-steps 1" in text


def test_what_would_have_to_change_is_the_break_even_point():
    """Plugging the printed verify bound (or accept length) back in gives exactly 1 + margin."""
    prof = Profile.fit(2.1, Shape(3, 1, 4))
    t = Timings(1000 / 86, {1: 11.6, 4: 30.0, 8: 34.0}, {1: 1.5}, 0.4)
    preds = rank_all(prof, t, grid(4, (1,)))
    ref = predict(prof, t, Shape(3, 1, 4))
    v = verdict(preds, t, 0.1, ref)
    x = float(v.change.split("verify <= ")[1].split(" ms")[0])
    y = float(v.change.split("accept length >= ")[1].split(" ")[0])
    faster = Timings(t.ar_ms, {**t.verify_ms, 4: x}, t.draft_ms, t.overhead_ms)
    assert predict(prof, faster, ref.shape).speedup == pytest.approx(1.1, abs=2e-3)  # printed to 0.01 ms
    assert y * t.ar_ms / ref.iter_ms == pytest.approx(1.1, abs=2e-3)


def test_accept_length_fit_at_the_shape_it_was_measured_at():
    for L, shape in [(2.1, Shape(3, 4, 16)), (3.2, Shape(5, 4, 16)), (1.8, Shape(3, 1, 4))]:
        prof = Profile.fit(L, shape)
        assert expected_accept_length(prof, shape) == pytest.approx(L, abs=1e-6)
        assert prof.width > 1  # trees can be ranked from it
        row = prof.ranks[0]
        assert all(a > b for a, b in zip(row, row[1:])) and sum(row) <= 1
    with pytest.raises(FledgeError, match="--accept-shape"):
        Profile.fit(4.5, Shape(3, 4, 16))  # more than a 3-step tree can accept


def test_draft_ms_is_predicted_when_absent(tmp_path, capsys):
    argv = ["tune", "what-if", "--ar-ms", "6", "--verify-ms", "1:6,8:6.5", "--accept-length", "2.5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--draft-ms" in err and "--model" in err and len(err.strip().splitlines()) == 1
    out = tmp_path / "w.json"
    fixture = str(Path(__file__).parent / "fixtures" / "tune" / "llama31_8b_config.json")
    assert main([*argv, "--model", fixture, "--gpu", "h100", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["timings"]["draft_ms"]) == {"1", "2", "4", "8"} and 0 < data["timings"]["draft_ms"]["1"] < 6
    assert any("draft step predicted" in n for n in data["notes"])


def test_concurrency_sweep_against_ranking_each_level():
    prof = Profile.fit(2.5, Shape(3, 1, 4))
    shapes = grid(4, (1, 2))

    def at(c):  # verify grows with the rows a batch adds: speculation pays less as c grows
        return Timings(10 + 0.02 * c, {1: 10 + 0.02 * c, 8: 10 + 0.5 * c, 64: 10 + 4 * c}, {1: 0.4, 2: 0.45}, 0.3, c)

    rows = sweep(prof, at, shapes, [1, 4, 16, 64, 256], 0.05)
    for r in rows:
        best = rank_all(prof, at(r["concurrency"]), shapes)[0]
        assert r["speedup"] == pytest.approx(best.speedup) and r["label"] == best.shape.label
        assert r["pays"] == (best.speedup > 1.05)
    assert rows[0]["pays"] and not rows[-1]["pays"]
    assert stops_paying(rows) == next(r["concurrency"] for r in rows if not r["pays"])


def test_hardware_model_cli_writes_table_json_png(tmp_path):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    fixture = str(Path(__file__).parent / "fixtures" / "tune" / "llama31_8b_config.json")
    assert main(["tune", "model", "--model", fixture, "--gpu", "h200", "--accept-length", "3.0", "--accept-shape", "3,1,4",
                 "--concurrency", "1,8,64", "--json", str(out), "--png", str(png)]) == 0
    data = json.loads(out.read_text())
    assert [r["concurrency"] for r in data["concurrency"]] == [1, 8, 64]
    assert data["breakdown"]["ar"]["memory_ms"] > data["breakdown"]["ar"]["compute_ms"]  # batch 1 is memory-bound
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plain_decoding_reads_the_same_in_header_and_verdict(tmp_path):
    """With --output-len the baseline is whole requests (prefill shared over the answer): the
    header's plain tok/s is the one the verdict compares against."""
    out = tmp_path / "t.json"
    fixture = str(Path(__file__).parent / "fixtures" / "tune" / "llama31_8b_config.json")
    assert main(["tune", "model", "--model", fixture, "--gpu", "h200", "--accept-length", "3.0", "--accept-shape", "3,1,4",
                 "--context", "4096", "--output-len", "64", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    timings = data["timings"]
    plain = 1e3 / (timings["ar_ms"] + timings["token_host_ms"] + timings["batch"] * timings["prefill_ms"] / 64)
    assert data["ar_tok_s"] == pytest.approx(plain) and plain < 1e3 / timings["ar_ms"]
    assert f"{plain:.1f}" in data["verdict"]


def test_no_import_cycle_between_bench_and_tune():
    """bench, serving, calibrate, the acceptance and hardware models sit below tune: none of them imports it."""
    import ast

    import fledge

    root = Path(fledge.__file__).parent / "perf"
    for name in ("bench.py", "serving.py", "calibrate.py", "acceptance.py", "hwmodel.py", "servemodel.py", "corpus.py"):
        tree = ast.parse((root / name).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "fledge.perf.tune" not in imported, name


@pytest.mark.slow  # the real target and drafter on the CPU: about a minute on a loaded 2-core machine
def test_measured_tune_validates_on_the_shipped_engine_path(tmp_path, capsys):
    """The command that checks the model against the engine on a GPU, at CPU sizes: it predicts,
    then runs the shapes asked for through the same path (fused rounds) and reports both. Before
    its long timing runs it says what comes next and how long, and counts those runs as they end."""
    out = tmp_path / "v.json"
    drafter = str(Path(__file__).resolve().parents[1] / "drafters" / "smollm2-135m")
    rc = main(["tune", "engine", "--target", "smollm2-135m", "--drafter", drafter, "--device", "cpu", "--num-prompts", "1",
               "--max-new-tokens", "12", "--max-depth", "3", "--probe-topk", "2", "--validate",
               "--shapes", "1,1,2;3,2,6", "--json", str(out)])
    assert rc == 0
    err = capsys.readouterr().err
    assert "tune: plain decoding takes" in err and "decode 140 tokens next" in err  # 4 runs of 12 + 8, probe 20, 2 shapes x 20
    assert "draft timing (runs of 2 and 6 steps per topk): 100%" in err and "4/4" in err
    data = json.loads(out.read_text())
    rows = data["validation"]
    assert [(r["num_steps"], r["topk"], r["num_draft_tokens"]) for r in rows] == [(1, 1, 2), (3, 2, 6)]
    assert all(r["tok_s_measured"] > 0 and r["accept_measured"] >= 1 for r in rows)
    for r in rows:  # tok/s error splits into its two factors: accept length over round time
        ratio = (1 + r["accept_error_percent"] / 100) / (1 + r["round_error_percent"] / 100)
        assert r["round_ms_measured"] > 0
        assert r["tok_s_predicted"] / r["tok_s_measured"] == pytest.approx(
            ratio * (r["accept_measured"] * 1e3 / r["round_ms_measured"]) / r["tok_s_measured"], rel=1e-9)
    assert {"spine", "ranks"} <= set(data["profile"])
    assert "fused greedy rounds" in data["notes"][0]


def test_spine_table_predicts_a_chain_where_one_table_falls_short():
    """A full-tree probe through the engine, then a chain of 4 through it on the same prompts
    (CPU, fp32; a tiny target and a drafter built to imitate it, whose agreement runs in
    streaks as a trained drafter's does). The spine table predicts the chain's measured accept
    length within its sampling error; one table over every node the probe reached — what the
    probe recorded before the spine had its own — under-predicts it by several of those."""
    import statistics

    import torch
    from test_engine_spec import tiny_setup

    from fledge.engine.rig import EngineRig, RankProbe, run_shape

    hf, target, draft = tiny_setup("llama", vocab=32, initializer_range=0.15)
    rig = EngineRig(hf, None, target, draft, [], torch.device("cpu"))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 32, (9,), generator=g).tolist() for _ in range(40)]
    steps, topk, new_tokens = 4, 4, 60
    probe = RankProbe(rig.drafter(Shape(steps, topk, 1 + topk + (steps - 1) * topk ** 2)))
    run_shape(rig, probe, prompts, new_tokens, "probe")
    tables = probe.profile()
    on, off = 1, 0
    mixed = [[(a + b) / (n1 + n0) for a, b in zip(h1, h0)]
             for h1, h0, n1, n0 in zip(probe.hits[on], probe.hits[off], probe.reached[on], probe.reached[off])]
    chain = Shape(steps, 1, steps + 1)
    stats, _ = run_shape(rig, rig.drafter(chain), prompts, new_tokens, "chain")
    measured = stats.accept_length()
    se = statistics.stdev(stats.accepted) / len(stats.accepted) ** 0.5
    two = expected_accept_length(Profile(tables["ranks"], tables["spine"]), chain)
    one = expected_accept_length(Profile(mixed), chain)
    assert probe.reached[on][0] > 1000 and stats.steps > 1000
    assert one < two
    assert abs(two - measured) < 2 * se and abs(one - measured) > 3 * se, (measured, se, two, one)


def test_seeds_case_loses_with_its_range(tmp_path):
    """Kimi-K2.5 INT4 on 8 x RTX PRO 6000 over PCIe, SGLang TP8, s3 k4 n16 at accept ~2.1
    (DESIGN.md: plain 82-90 tok/s, speculative 54-57): the fitted serving model says it loses,
    the whole range below 1, and the range holds the measured ratio."""
    out = tmp_path / "kimi.json"
    fixture = str(Path(__file__).parent / "fixtures" / "tune" / "kimi_k25_config.json")
    assert main(["tune", "model", "--model", fixture, "--gpu", "rtx-pro-6000", "--tp", "8", "--interconnect", "pcie",
                 "--engine", "sglang", "--accept-length", "2.1", "--accept-shape", "3,4,16", "--concurrency", "1,16",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    ref = data["reference"]
    assert (ref["num_steps"], ref["topk"], ref["num_draft_tokens"]) == (3, 4, 16)
    assert ref["call"] == "loses" and ref["low"] <= ref["speedup"] <= ref["high"] < 1
    assert ref["low"] <= 55.5 / 86 <= ref["high"]
    assert 0.5 < data["ar_tok_s"] / 86 < 2  # plain decoding: the right order, not a fitted figure
    assert all(r["low"] <= r["speedup"] <= r["high"] for r in data["concurrency"])


def test_old_spellings_name_the_new_ones(capsys):
    for argv, new in [(["tune", "--what-if"], "tune what-if"), (["tune", "--model", "x"], "tune model"),
                      (["tune", "--target", "t"], "tune engine"),
                      (["tune", "what-if", "--ar-ms", "1", "--verify-ms", "1:1", "--max-steps", "3"], "--max-depth"),
                      (["tune", "model", "--model", "x", "--profile-json", "p"], "--accept-json"),
                      (["tune", "model", "--model", "x", "--profile", "p"], "--hardware-profile")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and new in err, err


def test_vllm_users_get_a_chain_verdict(tmp_path):
    """The same deployment read for vLLM: the verdict and its flags name a chain, never a tree."""
    out = tmp_path / "v.json"
    fixture = str(Path(__file__).parent / "fixtures" / "tune" / "llama31_8b_config.json")
    assert main(["tune", "model", "--model", fixture, "--gpu", "h100", "--engine", "vllm", "--accept-length", "2.8",
                 "--concurrency", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["engine"] == "vllm" and data["best"]["topk"] == 1 and data["best"]["vllm"]
    assert any(p["topk"] > 1 for p in data["predictions"])  # trees stay in the table for comparison


def test_docs_crossval_table_is_the_bench_json(monkeypatch):
    """docs/tune.md's cross-validated error is copied from the JSON bench/tune_crossval.py wrote
    (its table and the commits it names), and `tune model` reads the fit of that same run."""
    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "bench"))  # as `python bench/tune_crossval.py` has it
    spec = importlib.util.spec_from_file_location("tune_crossval", root / "bench" / "tune_crossval.py")
    cv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cv)
    report = json.loads((root / "bench" / "results" / "tune_crossval_cpu.json").read_text())
    docs = (root / "docs" / "tune.md").read_text()
    assert cv.docs_table(report["summary"]) in docs
    assert f"fledge commit {report['commit']}" in docs and f"corpus commit {report['corpus_commit']}" in docs
    assert f"of {report['rows_read']} rows, {len(report['skipped'])} could not be used" in " ".join(docs.split())
    fit = json.loads((root / "fledge" / "perf" / "servemodel_fit.json").read_text())
    assert fit["constants"] == report["constants"] and fit["residuals"] == report["residuals"]
