"""The prefix attention kernel (Triton, interpreted on this CPU) against SDPA over the same
mask as a dense tensor, and the engine with the kernel against the engine without it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from test_engine_spec import tiny_setup

from fledge.core.shape import Shape
from fledge.engine import SamplingParams, build_engine_target, generate_ar
from fledge.engine.attention import Prefix, kernel_available, prefix_attention
from fledge.engine.decode import make_causal_mask
from fledge.engine.drafters import Eagle3Drafter
from fledge.engine.layers import LayerFns
from fledge.engine.spec import generate_spec
from fledge.engine.stream import generate_stream
from fledge.engine.tree import make_tree

pytestmark = pytest.mark.skipif(not kernel_available(torch.device("cpu")), reason="needs triton (interpreter)")


def reference(q, k_new, v_new, k, v, prefix: Prefix):
    """The new K/V written at lengths + t by hand, then SDPA over the dense mask (in fp64)."""
    B, _, T, _ = k_new.shape
    k, v = k.clone(), v.clone()
    for b in range(B):
        n = int(prefix.lengths[b])
        k[b, :, n:n + T], v[b, :, n:n + T] = k_new[b], v_new[b]
    G = q.shape[2] // T
    mask = prefix.dense(k.shape[2]).repeat(1, 1, G, 1)
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask), k, v


# (batch, kv heads, query heads per kv head, new tokens T, cache slots, head dim): batch * kv
# heads below the interpreter's 8 programs splits the slots (and merges); above, one pass.
@pytest.mark.parametrize("B,n_kv,G,T,S,D", [(1, 3, 3, 1, 384, 64), (2, 3, 3, 1, 200, 64), (4, 2, 2, 1, 130, 32),
                                            (2, 2, 3, 5, 100, 16), (3, 1, 4, 16, 64, 16), (1, 1, 2, 40, 300, 16)])
def test_kernel_equals_sdpa_on_random_masks(B, n_kv, G, T, S, D):
    g = torch.Generator().manual_seed(B * 1000 + T * 10 + D)
    q, k, v = (torch.randn(B, n_kv, n, D, generator=g) for n in (G * T, S, S))
    # the new K/V as attn_in hands them over: a transposed view of [B, T, n_kv, D]
    k_new, v_new = (torch.randn(B, T, n_kv, D, generator=g).transpose(1, 2) for _ in "kv")
    lengths = torch.randint(0, S - T + 1, (B,), generator=g)
    lengths[0] = 0 if T > 1 else lengths[0]  # a row with nothing before its new tokens
    local = (torch.rand(B, T, T, generator=g) < 0.5) | torch.eye(T, dtype=torch.bool)
    prefix = Prefix(lengths, local)
    want, k_want, v_want = reference(q, k_new, v_new, k, v, prefix)
    out = prefix_attention(q, k_new, v_new, k, v, prefix)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(k, k_want) and torch.equal(v, v_want)  # the kernel wrote the new slots, nothing else


def test_kernel_reads_nothing_past_a_rows_slots():
    """Slots past lengths + T hold garbage (NaN): they must not leak in."""
    B, n_kv, G, T, S, D = 2, 2, 2, 3, 96, 16
    q, k, v = (torch.randn(B, n_kv, n, D) for n in (G * T, S, S))
    k_new, v_new = torch.randn(B, n_kv, T, D), torch.randn(B, n_kv, T, D)
    lengths = torch.tensor([10, 70])
    for r, n in enumerate(lengths.tolist()):
        k[r, :, n:], v[r, :, n:] = float("nan"), float("nan")  # the new slots too: written before read, or not read
    prefix = Prefix(lengths, torch.tril(torch.ones(T, T, dtype=torch.bool)).expand(B, T, T))
    want, _, _ = reference(q, k_new, v_new, k.nan_to_num(0.0), v.nan_to_num(0.0), prefix)
    out = prefix_attention(q, k_new, v_new, k, v, prefix)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_dense_form_is_the_causal_and_tree_masks():
    lengths = torch.tensor([0, 5, 11])
    assert torch.equal(Prefix.causal_decode(lengths).dense(16), make_causal_mask(lengths, 1, 16))
    tree = make_tree(torch.tensor([1]), torch.tensor([[4, 5, 6, 7]]), torch.tensor([[0, 0, 1, 1]]))
    dense = Prefix(torch.tensor([3]), tree.anc).dense(12)
    want = torch.zeros(5, 12, dtype=torch.bool)
    want[:, :3] = True
    want[:, 3:8] = tree.anc[0]  # node i at slot 3 + i sees its ancestors' slots
    assert torch.equal(dense[0, 0], want)
    assert want[3].tolist() == [True] * 3 + [True, True, False, True, False] + [False] * 4  # node 3: root, 1, itself


def test_engine_with_kernel_equals_engine_without():
    """AR (batched, one step shape for every length) and EAGLE-3 chain and tree rounds through
    the kernel give the dense path's tokens and accepted counts (an imitating drafter, so
    rounds accept several tokens and the tree part of the mask matters)."""
    hf, dense, draft = tiny_setup("llama")
    kern = build_engine_target(hf, torch.float32, "cpu", fns=dataclasses.replace(LayerFns(), prefix_attention=prefix_attention))
    assert kern.prefix_kernel and not dense.prefix_kernel
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 24, (n,), generator=g).tolist() for n in (3, 9, 6)]
    # each interpreted kernel call is slow: six tokens already step rows of three lengths together
    rows, stats = generate_ar(kern, prompts, SamplingParams(max_new_tokens=6), [])
    assert rows == generate_ar(dense, prompts, SamplingParams(max_new_tokens=6), [])[0]
    assert stats["spans"] == [()]  # no attention spans: each row reads its own length
    short = SamplingParams(max_new_tokens=5)
    streamed, st = generate_stream(kern, prompts, short, [], rows=2, refill_every=2)  # a row refilled, one step shape
    assert streamed == generate_ar(dense, prompts, short, [])[0] and st["graphs"] == 1
    prompt = torch.randint(0, 24, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_new_tokens=12)
    ar = generate_ar(dense, [prompt], params, [])[0][0]
    assert spec_rounds_match(kern, dense, draft, prompt, params, ar) > 0


def spec_rounds_match(kern, dense, draft, prompt, params, ar) -> int:
    """A chain and a tree through both targets: the same text (= `ar`) and accepted counts.
    Returns the drafts accepted in all (> 0 shows the multi-token paths ran)."""
    accepted = 0
    for spec in (Shape(3, 1, 4), Shape(3, 3, 9)):
        a, sa = generate_spec(kern, Eagle3Drafter(draft, spec, kern), prompt, params, [])
        b, sb = generate_spec(dense, Eagle3Drafter(draft, spec, dense), prompt, params, [])
        assert a == b == ar and sa.accepted == sb.accepted
        accepted += sum(sa.accepted)
    return accepted


def test_a_token_rounds_alike_decoded_or_verified():
    """A chain of T tokens verified at once, and each token decoded alone after the ones before
    it: the same slots, walked in the same blocks. On the GPU that is what keeps bf16 decode and
    verify rounding alike; here the interpreter's matmul rounds by tile height, so the check
    is fp32 agreement, not bits."""
    B, n_kv, G, T, S, D = 1, 3, 3, 8, 400, 64
    g = torch.Generator().manual_seed(21)
    q = torch.randn(B, n_kv, G * T, D, generator=g)
    k, v = (torch.randn(B, n_kv, S, D, generator=g) for _ in "kv")
    k_new, v_new = (torch.randn(B, n_kv, T, D, generator=g) for _ in "kv")
    n = 250
    chain = torch.tril(torch.ones(T, T, dtype=torch.bool))[None]
    together = prefix_attention(q, k_new, v_new, k.clone(), v.clone(), Prefix(torch.tensor([n]), chain))
    kc, vc = k.clone(), v.clone()
    for t in range(T):
        alone = prefix_attention(q[:, :, t::T], k_new[:, :, t:t + 1], v_new[:, :, t:t + 1], kc, vc,
                                 Prefix.causal_decode(torch.tensor([n + t])))
        torch.testing.assert_close(alone, together[:, :, t::T], atol=1e-6, rtol=0)
