"""The few-rows matmul kernels (Triton, interpreted on this CPU) against the eager layer
functions they replace, alone and in whole forwards and speculative rounds."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from conftest import ENGINE_FAMILIES, make_tiny
from fledge.engine import SamplingParams, build_engine_target, generate_ar
from fledge.engine.attention import kernel_available, prefix_attention
from fledge.engine.drafters import Eagle3Drafter, SpecConfig
from fledge.engine.few_rows import MAX_ROWS, rows_linear, usable
from fledge.engine.model import LayerFns, attn_out, rms_norm
from fledge.engine.spec import generate_spec
from test_engine_spec import tiny_setup

pytestmark = pytest.mark.skipif(not kernel_available(torch.device("cpu")), reason="needs Triton (interpreted)")


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_rows_linear_equals_eager_in_every_mode(rows):
    """Each prologue and epilogue against its eager form, fresh random inputs, rows either side
    of a power of two, an input width of two K tiles (64 + 32), a column count no tile divides."""
    g = torch.Generator().manual_seed(rows)
    K, N, B = 96, 40, 1
    x, delta = torch.randn(B, rows, K, generator=g), torch.randn(B, rows, K, generator=g)
    w, b = torch.randn(N, K, generator=g) / 8, torch.randn(N, generator=g)
    w13, b13 = torch.randn(2 * N, K, generator=g) / 8, torch.randn(2 * N, generator=g)
    nw, res = torch.rand(K, generator=g) + 0.5, torch.randn(B, rows, N, generator=g)
    close = dict(rtol=1e-4, atol=1e-4)
    for bias in (None, b):
        torch.testing.assert_close(rows_linear(x, w, bias), F.linear(x, w, bias), **close)
        torch.testing.assert_close(rows_linear(x, w, bias, residual=res), res + F.linear(x, w, bias), **close)
    s, y = rows_linear(x, w, b, delta=delta, norm_w=nw, eps=1e-6)
    torch.testing.assert_close(s, x + delta, **close)
    torch.testing.assert_close(y, F.linear(rms_norm(x + delta, nw, 1e-6), w, b), **close)
    gate, up = F.linear(rms_norm(x, nw, 1e-6), w13, b13).chunk(2, dim=-1)
    torch.testing.assert_close(rows_linear(x, w13, b13, norm_w=nw, eps=1e-6, gated=True), F.silu(gate) * up, **close)


def test_attn_out_reads_the_attention_heads_in_place():
    """few_rows.attn_out on the attention's [B, n_kv, G*T, D] output (GQA rows) equals
    model.attn_out, which copies it into [B, T, H*D] first."""
    from fledge.engine import few_rows
    g = torch.Generator().manual_seed(2)
    B, T, n_kv, G, D, dim, inter = 1, 6, 2, 3, 16, 96, 64
    x, o = torch.randn(B, T, dim, generator=g), torch.randn(B, n_kv, G * T, D, generator=g)
    wo, nw = torch.randn(dim, n_kv * G * D, generator=g) / 8, torch.rand(dim, generator=g) + 0.5
    w13, w2 = torch.randn(2 * inter, dim, generator=g) / 8, torch.randn(dim, inter, generator=g) / 8
    want = attn_out(x, o, wo, None, nw, w13, None, w2, None, 1e-6)
    got = few_rows.attn_out(x, o, wo, None, nw, w13, None, w2, None, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_usable_says_no_to_shapes_it_cannot_take():
    from fledge.engine.few_rows import k_split
    assert [k_split(k) for k in (576, 1536, 64, 96, 72, 960, 4096)] == [(512, 64), (1024, 512), (32, 32), (64, 32),
                                                                        (0, 0), (0, 0), (0, 0)]
    cpu = torch.device("cpu")
    assert usable(8, 576, 64, 1536, cpu) and usable(MAX_ROWS, 64, 16, 128, cpu)
    assert not usable(MAX_ROWS + 1, 576, 64, 1536, cpu)
    assert not usable(8, 72, 64, 1536, cpu) and not usable(8, 576, 24, 1536, cpu)


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_forwards_of_few_rows_equal_the_eager_layers(family):
    """Whole forwards with few_rows on (every forward here, prefill included, has at most
    MAX_ROWS rows): logits and aux equal the eager layers' at batch 1 and 3 (batch x tokens
    is the row count), for a prefill and a chunk of new tokens after it."""
    hf = make_tiny(family, seed=9)
    eager = build_engine_target(hf, torch.float32, "cpu")
    few = build_engine_target(hf, torch.float32, "cpu", fns=LayerFns(few_rows=MAX_ROWS))
    for B, P, T in ((1, 9, 5), (3, 7, 4)):
        ids = torch.randint(0, 301, (B, P + T))
        ce, cf = eager.new_cache(B, 32), few.new_cache(B, 32)
        for cache, model in ((ce, eager), (cf, few)):
            model.prefill(ids[:, :P], cache)
        torch.testing.assert_close(cf.kv, ce.kv, rtol=1e-4, atol=1e-4)
        pos = torch.arange(P, P + T).expand(B, T)
        from fledge.engine.attention import Prefix
        mask = Prefix(torch.full((B,), P), torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T))
        le, ae = eager(ids[:, P:], pos, pos, mask, ce, aux_ids=(1, 2, 5))
        lf, af = few(ids[:, P:], pos, pos, mask, cf, aux_ids=(1, 2, 5))
        torch.testing.assert_close(lf, le, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(af, ae, rtol=1e-4, atol=1e-4)


def test_spec_rounds_through_few_rows_equal_ar():
    """EAGLE-3 chain and tree rounds whose verify forwards take the kernels (decode too, with
    gemv_rows 0), with the prefix attention kernel: greedy text equal to eager AR, and the
    same accepted counts as without the kernels."""
    hf, dense, draft = tiny_setup("llama")
    fns = dataclasses.replace(LayerFns(), prefix_attention=prefix_attention, few_rows=16)
    kern = build_engine_target(hf, torch.float32, "cpu", fns=fns)
    prompt = torch.randint(0, 24, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_new_tokens=12)
    ar = generate_ar(dense, [prompt], params, [])[0][0]
    assert generate_ar(kern, [prompt], params, [])[0][0] == ar
    accepted = 0
    for spec in (SpecConfig(3, 1, 4), SpecConfig(3, 3, 9)):
        a, sa = generate_spec(kern, Eagle3Drafter(draft, spec, kern), prompt, params, [])
        b, sb = generate_spec(dense, Eagle3Drafter(draft, spec, dense), prompt, params, [])
        assert a == b == ar and sa.accepted == sb.accepted
        accepted += sum(sa.accepted)
    assert accepted > 0
