"""The serving model's terms against brute force: the kernel-time floor, overlapping MoE routes,
the drafter's vocabulary by method, the n-gram round, the symmetric conformal range and its
reported coverage."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from fledge.core.shape import Shape
from fledge.perf import corpus as C
from fledge.perf import hwmodel as H
from fledge.perf import modelspec as M
from fledge.perf import servemodel as S

LLAMA8 = {"family": "llama", "params_b": 8.03, "active_params_b": 8.03, "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8,
              "head_dim": 128, "vocab": 128256, "moe": None, "attention": "gqa"}
QWEN30 = {"family": "qwen3_moe", "params_b": 30.5, "active_params_b": 3.3, "layers": 48, "hidden": 2048, "heads": 32, "kv_heads": 4,
              "head_dim": 128, "vocab": 151936, "moe": {"experts": 128, "active": 8, "expert_intermediate": 768}, "attention": "gqa"}


def _deployment(arch, tp=1, engine="sglang"):
    target = C.spec_from_arch(arch, None)
    return S.Deployment(target, M.default_drafter(target), H.GPUS["h100"], tp, H.LINKS["nvlink"], engine)


def test_a_forward_is_never_faster_than_its_kernels():
    """Splitting a small target over more GPUs stops helping once each GPU's share takes less
    than the kernels' least time; a large target's batch-1 step stays set by its bytes."""
    c = S.defaults()
    small = _deployment(QWEN30, tp=8)
    floor_ms = H.kernels(small.target) * c["kernel_us"] * 1e-3
    no_comm = {**c, "allreduce_scale": 0.3}
    assert S.forward_ms(small.target, small, no_comm, 1, 1, 128) >= floor_ms
    assert S.forward_ms(small.target, small, {**no_comm, "kernel_us": 6.0}, 1, 1, 128) > \
        S.forward_ms(small.target, small, no_comm, 1, 1, 128) + 0.5 * H.kernels(small.target) * 4e-3
    big = _deployment(LLAMA8)
    assert S.forward_ms(big.target, big, {**c, "kernel_us": 0.5}, 1, 1, 128) == \
        pytest.approx(S.forward_ms(big.target, big, c, 1, 1, 128))


def test_overlapping_routes_touch_the_experts_fewer_draws_would():
    """With overlap r, n tokens of one sequence touch as many experts as 1 + (n - 1)(1 - r)
    independent tokens; a plain step (n = 1) does not depend on r. The distinct-expert count is
    checked against a simulation of uniform routing."""
    d = _deployment(QWEN30)
    c = S.defaults()
    t = d.target
    plain = [S.forward_ms(t, d, {**c, "route_overlap": r}, 1, 2, 512) for r in (0.0, 0.5, 0.9)]
    assert plain[0] == pytest.approx(plain[1]) == pytest.approx(plain[2])
    verify = [S.forward_ms(t, d, {**c, "route_overlap": r}, 16, 2, 512) for r in (0.0, 0.5, 0.9)]
    assert verify[0] > verify[1] > verify[2] > plain[0]
    rng = random.Random(0)
    draws = 2 * (1 + 15 * (1 - 0.5))
    sims = [len({e for _ in range(int(draws)) for e in rng.sample(range(t.experts), t.active)}) for _ in range(3000)]
    assert sum(sims) / len(sims) == pytest.approx(M.distinct_experts(t.experts, t.active, int(draws)), rel=0.01)


def test_eagle1_and_mtp_drafters_read_the_full_vocabulary():
    row = {"source": "s", "arch": LLAMA8, "quant": None, "gpu": "H100", "gpu_count": 1, "tp": 1, "interconnect": None, "engine": "vllm",
               "batch": 1, "input_len": None, "output_len": None, "shape": {"num_steps": 2, "topk": 1, "num_draft_tokens": 3},
               "accept_length": 2.0, "plain_tok_s": 100.0, "spec_tok_s": 150.0, "speedup": 1.5, "tok_s_kind": "per_request",
               "plain_tpot_ms": None, "spec_tpot_ms": None}
    vocab = {m: C.case({**row, "method": m}).deployment.drafter.vocab for m in ("eagle", "mtp", "eagle3")}
    assert vocab == {"eagle": 128256, "mtp": 128256, "eagle3": C.EAGLE3_DRAFT_VOCAB}
    d1, d3 = (C.case({**row, "method": m}) for m in ("eagle", "eagle3"))
    assert d1.predict(S.defaults())[0] < d3.predict(S.defaults())[0]  # the bigger head drafts slower


def test_range_is_symmetric_and_holds_its_share_of_the_errors():
    """The half-width is the ceil((n + 1) x COVERAGE)-th smallest |residual|: counted by brute
    force, and a new draw from the same law falls inside at least COVERAGE of the time (over many
    sets of ten residuals, where the rank is not the plain quantile's)."""
    rng = random.Random(1)
    residuals = [rng.gauss(0.05, 0.2) for _ in range(401)]
    lo, hi = S.quantile_pair(residuals)
    assert lo == -hi and hi > 0
    rank = math.ceil(402 * S.COVERAGE)
    assert sum(abs(r) <= hi for r in residuals) == rank and sorted(abs(r) for r in residuals)[rank - 1] == hi
    r = S.with_range(1.3, residuals)
    assert r.low == pytest.approx(1.3 * math.exp(-hi)) and r.high == pytest.approx(1.3 * math.exp(hi))
    trials = [[rng.gauss(0.0, 0.2) for _ in range(11)] for _ in range(4000)]
    held = sum(abs(t[-1]) <= S.quantile_pair(t[:-1])[1] for t in trials) / len(trials)
    assert held >= S.COVERAGE - 0.02  # exact in law: P = ceil(11 x 0.8) / 11 = 0.818
    with pytest.raises(Exception, match="no cross-validation residuals"):
        S.quantile_pair([])


def test_a_family_with_few_residuals_takes_at_least_the_pooled_range():
    own, pooled = [0.01, -0.02, 0.03], [0.3, -0.4, 0.25, 0.1, -0.2, 0.35]
    assert S.quantile_pair(own, pooled)[1] == S.conformal_halfwidth(pooled) > S.conformal_halfwidth(own)
    many = [0.01 * i for i in range(S.MIN_OWN)]
    assert S.quantile_pair(many, pooled)[1] == S.conformal_halfwidth(many)  # enough of its own: no floor
    assert S.quantile_pair([], pooled)[1] == S.conformal_halfwidth(pooled)


def test_an_ngram_round_is_one_verify():
    """An n-gram lookup has no drafter: its round costs the fixed step and the verify of its
    tokens, whatever the drafter terms, where an EAGLE round of the same shape pays them."""
    base, shape = _deployment(LLAMA8, engine="trtllm"), Shape(5, 1, 6)
    ngram = replace(base, drafting="ngram")
    for c in (S.defaults(), {**S.defaults(), "round_extra": 3.0, "draft_fixed": 2.0}):
        verify = S.forward_ms(base.target, base, c, 6, 4, 512)
        assert S.round_ms(ngram, c, shape, 4, 512) == pytest.approx(c["step"] + verify)
        assert S.round_ms(base, c, shape, 4, 512) > c["step"] + verify + c["round_extra"] + 6 * c["draft_fixed"] - 1e-9


def test_crossval_reports_how_often_the_range_holds_the_measurement():
    """The summary's coverage is the share of rows whose measured speed-up lies in their range,
    counted here by hand; the per-source breakdown covers every source."""
    rows = []
    for i, (batch, steps, accept, speedup) in enumerate([(1, 3, 2.6, 1.9), (4, 3, 2.6, 1.5), (1, 2, 2.2, 1.6),
                                                         (8, 2, 2.2, 1.1), (1, 4, 3.0, 2.2), (2, 4, 3.0, 1.9)]):
        rows.append({"source": f"s{i % 3}", "arch": LLAMA8, "quant": None, "gpu": "H100", "gpu_count": 1, "tp": 1, "interconnect": None,
                         "engine": "sglang", "batch": batch, "input_len": None, "output_len": None, "method": "eagle3",
                         "shape": {"num_steps": steps, "topk": 1, "num_draft_tokens": steps + 1}, "accept_length": accept,
                         "plain_tok_s": None, "spec_tok_s": None, "speedup": speedup, "tok_s_kind": None, "plain_tpot_ms": None,
                         "spec_tpot_ms": None})
    cases, skipped = C.cases(rows)
    assert not skipped
    cv = C.crossval(cases)
    by_hand = 100 * sum(r["low"] <= r["speedup_measured"] <= r["high"] for r in cv["rows"]) / len(cv["rows"])
    assert cv["summary"]["range_coverage_percent"] == pytest.approx(by_hand)
    assert cv["summary"]["range_nominal_percent"] == pytest.approx(100 * S.COVERAGE)
    assert S.round_ms(cases[0].deployment, S.defaults(), Shape(3, 1, 4), 1, 512) > \
        S.plain_ms(cases[0].deployment, S.defaults(), 1, 512)


def test_per_token_host_work_is_paid_alike_with_and_without_speculation():
    """`token_ms` adds batch x token_ms to a request's every token, plain or speculative (both emit
    the same tokens), so it pulls the speed-up towards 1 and leaves the round's own cost alone."""
    d, shape, accept = _deployment(LLAMA8), Shape(3, 1, 4), 2.5
    quiet = {**S.defaults(), "token_ms": 0.0}
    for batch in (1, 16):
        load = S.Load(batch, 512)
        p0, s0 = S.speeds(d, quiet, load, shape, accept)
        p1, s1 = S.speeds(d, {**quiet, "token_ms": 0.5}, load, shape, accept)
        assert p1 - p0 == pytest.approx(0.5 * batch) and s1 - s0 == pytest.approx(0.5 * batch)
        assert S.round_ms(d, {**quiet, "token_ms": 0.5}, shape, batch, 512) == S.round_ms(d, quiet, shape, batch, 512)
        assert 1 < p1 / s1 < p0 / s0


def test_an_moe_target_with_dense_layers_keeps_their_weights():
    """Llama-4-Maverick routes every second layer: 24 dense MLPs of 16384, 24 routed layers of 128
    experts (one routed and one shared per token). Its active count (17.2B), summed by hand from
    the spec, comes back, and so do the dense layers' width and the one shared expert."""
    arch = {"family": "llama4", "params_b": 400.7, "active_params_b": 17.2, "layers": 48, "hidden": 5120, "heads": 40,
            "kv_heads": 8, "head_dim": 128, "vocab": 202048, "attention": "gqa",
            "moe": {"experts": 128, "active": 1, "expert_intermediate": 8192, "dense_layers": 24, "dense_intermediate": 16384}}
    m = C.spec_from_arch(arch, "fp8")
    assert (m.moe_layers, m.intermediate, m.shared_experts) == (24, 16384, 1)
    active = (m.layers * m.attn_params() + 2 * m.vocab * m.hidden + 24 * 3 * m.hidden * m.intermediate
              + m.moe_layers * (m.active + m.shared_experts) * m.expert_params())
    assert active == pytest.approx(17.2e9, rel=0.03)
