"""The few-rows o_proj kernel (Triton, interpreted on this CPU) against the eager layer
function it replaces, alone and in whole forwards and speculative rounds."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import ENGINE_FAMILIES, make_tiny
from test_engine_attention import spec_rounds_match
from test_engine_spec import tiny_setup

from fledge.engine import SamplingParams, build_engine_target, generate_ar
from fledge.engine.attention import Prefix, kernel_available, prefix_attention
from fledge.engine.few_rows import MAX_ROWS, k_split, o_proj, usable
from fledge.engine.layers import LayerFns

pytestmark = pytest.mark.skipif(not kernel_available(torch.device("cpu")), reason="needs Triton (interpreted)")


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_o_proj_equals_eager(rows):
    """few_rows.o_proj on the attention's [B, n_kv, G*T, D] output (GQA rows, read in place)
    equals model.attn_out's copy, matmul and residual add, with and without a bias, for an
    input width of two K tiles (6 heads x 16 = 64 + 32) and a column count no tile divides."""
    g = torch.Generator().manual_seed(rows)
    n_kv, G, D, N = 2, 3, 16, 40
    x, o = torch.randn(1, rows, N, generator=g), torch.randn(1, n_kv, G * rows, D, generator=g)
    w, b = torch.randn(N, n_kv * G * D, generator=g) / 8, torch.randn(N, generator=g)
    heads = o.reshape(1, -1, rows, D).transpose(1, 2).reshape(1, rows, -1)
    for bias in (None, b):
        torch.testing.assert_close(o_proj(x, o, w, bias), x + F.linear(heads, w, bias), rtol=1e-4, atol=1e-4)


def test_usable_says_no_to_shapes_it_cannot_take():
    assert [k_split(k) for k in (576, 1536, 64, 96, 72, 960, 4096)] == [(512, 64), (1024, 512), (32, 32), (64, 32),
                                                                        (0, 0), (0, 0), (0, 0)]
    cpu = torch.device("cpu")
    assert usable(8, 9, 64, cpu) and usable(MAX_ROWS, 4, 16, cpu)
    assert not usable(MAX_ROWS + 1, 9, 64, cpu)
    assert not usable(8, 9, 24, cpu) and not usable(8, 15, 64, cpu)  # head_dim 24; 960 = 15 x 64 has no two tiles


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_forwards_of_few_rows_equal_the_eager_layers(family, monkeypatch):
    """Forwards of a chunk of new tokens after a prefill with few_rows on: logits, aux and
    cache equal the eager layers' at batch 1 and 3 (batch x tokens is the row count)."""
    from fledge.engine import few_rows
    calls = []
    kernel = few_rows.o_proj
    monkeypatch.setattr(few_rows, "o_proj", lambda *a: calls.append(1) or kernel(*a))
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
        mask = Prefix(torch.full((B,), P), torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T))
        le, ae = eager(ids[:, P:], pos, pos, mask, ce, aux_ids=(1, 2, 5))
        lf, af = few(ids[:, P:], pos, pos, mask, cf, aux_ids=(1, 2, 5))
        torch.testing.assert_close(lf, le, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(af, ae, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cf.kv, ce.kv, rtol=1e-4, atol=1e-4)
    assert len(calls) == 2 * hf.config.num_hidden_layers  # the kernel ran in every layer of both chunks


def test_spec_rounds_through_few_rows_equal_ar():
    """EAGLE-3 chain and tree rounds whose verify forwards (and one-row decode steps: gemv_rows
    is 0 here) take the kernel, with the prefix attention kernel: greedy text equal to eager
    AR, and the same accepted counts as without the kernels."""
    hf, dense, draft = tiny_setup("llama")
    fns = dataclasses.replace(LayerFns(), prefix_attention=prefix_attention, few_rows=16)
    kern = build_engine_target(hf, torch.float32, "cpu", fns=fns)
    prompt = torch.randint(0, 24, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_new_tokens=12)
    ar = generate_ar(dense, [prompt], params, [])[0][0]
    # the kernel's one-row decode steps: each interpreted call is slow, and six steps show it
    assert generate_ar(kern, [prompt], SamplingParams(max_new_tokens=6), [])[0][0] == ar[:6]
    assert spec_rounds_match(kern, dense, draft, prompt, params, ar) > 0
