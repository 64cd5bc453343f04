"""The resident target (one cache kept between requests, the prefill per padded bucket) against
the per-request path: the same logits, aux states and cache slots, and the same generated text
for AR, EAGLE-3 chains and trees and the oracle, request after request on one cache, through
speculative rounds built once and kept."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny
from test_engine_spec import tiny_setup

from fledge.core.errors import FledgeError
from fledge.core.shape import Shape
from fledge.engine import HFTarget, SamplingParams, build_engine_target, generate_ar
from fledge.engine.drafters import Eagle3Drafter, OracleDrafter
from fledge.engine.resident import Resident, buckets
from fledge.engine.rounds import PhasedRound, QueuedRound
from fledge.engine.spec import generate_spec

AUX = (2, 3, 5)


def prompts(lengths, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def test_buckets_are_powers_of_two_from_64_within_the_cache():
    assert buckets(63) == [] and buckets(64) == [64] and buckets(300) == [64, 128, 256]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_resident_prefill_equals_prefill(family):
    """Lengths in the first and second bucket and one past the largest (the eager fallback),
    longest first, so stale slots and stale pad tokens from the request before are present."""
    target = build_engine_target(make_tiny(family), torch.float32, "cpu")
    res = Resident(target, 192, aux_sets=[None, AUX])
    assert sorted({b for b, _ in res.runs}) == [64, 128]
    for ids in prompts([150, 100, 37, 64, 5], 301, seed=1):
        ids = torch.tensor([ids])
        L = ids.shape[1]
        cache = target.new_cache(1, 192)
        with torch.no_grad():
            want_logits, want_aux = target.prefill(ids, cache, aux_ids=AUX, logits_idx=torch.tensor([[L - 1]]))
        for aux_ids in (AUX, None):
            logits, aux = res.prefill(ids, aux_ids)
            torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
            if aux_ids is None:
                assert aux is None
            else:
                torch.testing.assert_close(aux, want_aux, rtol=0, atol=1e-5)
            torch.testing.assert_close(res.cache.kv[..., :L, :], cache.kv[..., :L, :], rtol=0, atol=1e-5)


def test_resident_requests_generate_what_fresh_ones_do():
    """One resident cache serves AR, an EAGLE-3 chain and tree, and the oracle, over prompts of
    several buckets in turn: every output equals AR's without a resident, token for token, and
    each drafter accepts what it accepts without one (a wrong aux state or stale slot would
    change the drafts, not the text). Weights at std 0.15 keep the text from repeating one token."""
    hf, target, draft = tiny_setup("llama", vocab=32, initializer_range=0.15)
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    res = Resident(target, 256, aux_sets=[None, tuple(draft.cfg.aux_layer_ids)])
    drafters = [Eagle3Drafter(draft, Shape(3, 1, 4), target), Eagle3Drafter(draft, Shape(3, 3, 9), target)]
    accepted, distinct = 0, []
    for prompt in prompts([120, 9, 70, 31], 32, seed=2):
        ar = generate_ar(target, [prompt], params, eos_ids=[])[0][0]
        distinct.append(len(set(ar)))
        assert generate_ar(target, [prompt], params, eos_ids=[], resident=res)[0][0] == ar
        for d in drafters + [OracleDrafter(Shape(4, 1, 5), [prompt + ar])]:
            out, st = generate_spec(target, d, prompt, params, eos_ids=[], resident=res)
            _, fresh = generate_spec(target, d, prompt, params, eos_ids=[])
            assert out == ar and st.accepted == fresh.accepted
            accepted += sum(st.accepted)
        phased, _ = generate_spec(target, drafters[1], prompt, params, eos_ids=[], resident=res, phased=True)
        assert phased == ar
    assert accepted > 0 and min(distinct) > 3  # multi-token rounds ran, over text that is not one token


def test_resident_bad_input_is_one_fledge_error():
    hf = make_tiny("llama")
    target = build_engine_target(hf, torch.float32, "cpu")
    res = Resident(target, 128)
    params = SamplingParams(max_new_tokens=8)
    with pytest.raises(FledgeError, match="batch 1"):
        generate_ar(target, [[1, 2], [3]], params, [], resident=res)
    with pytest.raises(FledgeError, match="cache_len 128"):
        generate_ar(target, [[1] * 125], params, [], resident=res)
    with pytest.raises(FledgeError, match="aux ids"):
        res.prefill(torch.tensor([[1, 2, 3]]), AUX)
    with pytest.raises(FledgeError, match="> resident cache"):
        res.prefill(torch.ones(1, 129, dtype=torch.long))
    with pytest.raises(FledgeError, match="compact engine"):
        Resident(HFTarget(make_tiny("gemma3")), 128)


def test_a_kept_round_serves_request_after_request():
    """With a resident, the round a request builds (its RoundState, the drafter's buffers and, on
    CUDA, its captured graph) is kept and replayed by the next requests of the same drafter:
    an EAGLE-3 chain and tree (fused and phased) and one oracle fed each prompt's text in place,
    greedy, each give every prompt the output and stats of a fresh per-request run through one
    round object built once. A request whose drafter cache changes shape gets a new round."""
    hf, target, draft = tiny_setup("llama", vocab=32, initializer_range=0.15)
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    res = Resident(target, 256, aux_sets=[None, tuple(draft.cfg.aux_layer_ids)])
    batch = prompts([31, 25, 20, 9], 32, seed=5)  # one drafter cache size (64) for all, the widest oracle text first
    texts = [generate_ar(target, [p], params, eos_ids=[])[0][0] for p in batch]
    oracle = OracleDrafter(Shape(4, 1, 5), [batch[0] + texts[0]], "cpu")
    tree = Eagle3Drafter(draft, Shape(3, 3, 9), target)
    runs = [(Eagle3Drafter(draft, Shape(3, 1, 4), target), False), (tree, False), (tree, True), (oracle, False)]
    for drafter, phased in runs:
        kept, accepted = None, 0
        for prompt, ar in zip(batch, texts):
            if drafter is oracle:
                oracle.set_sequences([prompt + ar])
                fresh_drafter = OracleDrafter(Shape(4, 1, 5), [prompt + ar])
            else:
                fresh_drafter = Eagle3Drafter(draft, drafter.spec, target)
            out, st = generate_spec(target, drafter, prompt, params, eos_ids=[], resident=res, phased=phased)
            want, fresh = generate_spec(target, fresh_drafter, prompt, params, eos_ids=[], phased=phased)
            assert out == want == ar
            assert (st.accepted, st.generated_tokens, st.prompt_tokens) == (fresh.accepted, fresh.generated_tokens,
                                                                           fresh.prompt_tokens)
            assert len(st.round_ms) == len(fresh.round_ms) == st.steps and len(st.verify_ms) == len(fresh.verify_ms)
            kind = PhasedRound if phased else QueuedRound
            kept = kept or res.rounds[kind]
            assert res.rounds[kind] is kept and kept.drafter is drafter
            accepted += sum(st.accepted)
        assert accepted > 0
    assert oracle.seq.shape[1] == len(batch[0] + texts[0])  # every later text was written into the first's tensor
    chain = runs[0][0]
    generate_spec(target, chain, batch[0], params, eos_ids=[], resident=res)
    short = res.rounds[QueuedRound]
    longer = prompts([100], 32, seed=6)[0]  # a drafter cache of 192 rows, not 64: new buffers, so a new round
    out, _ = generate_spec(target, chain, longer, params, eos_ids=[], resident=res)
    assert res.rounds[QueuedRound] is not short and res.rounds[QueuedRound].drafter is chain
    assert out == generate_ar(target, [longer], params, eos_ids=[])[0][0]
