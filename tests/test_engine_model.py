"""The engine against HF: logits and aux through the static cache, greedy generation token for
token, batching with padding, and sampling against brute force."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import ENGINE_FAMILIES, FAMILIES, make_tiny

from fledge.core.errors import FledgeError
from fledge.engine import (
    HFTarget,
    SamplingParams,
    Transformer,
    build_engine_target,
    generate_ar,
    logits_to_probs,
    make_causal_mask,
    sample_token,
)

AUX = (2, 3, 5)



def hf_reference(hf, seq):
    with torch.no_grad():
        out = hf(torch.tensor([seq]), output_hidden_states=True)
    return out.logits[0], torch.cat([out.hidden_states[i][0] for i in AUX], dim=-1)


def run_rows(model, seqs, prompt_lens, chunks, max_len=64):
    """Right-padded batched prefill of each row's prompt, then the rest of each row fed in
    `chunks`-token steps through the cache. Returns per-row (logits, aux) for every token."""
    B, P = len(seqs), max(prompt_lens)
    cache = model.new_cache(B, max_len)
    ids = torch.zeros(B, P, dtype=torch.long)
    for b, (s, n) in enumerate(zip(seqs, prompt_lens)):
        ids[b, :n] = torch.tensor(s[:n])
    pos = torch.arange(P).expand(B, -1)
    with torch.no_grad():
        logits, aux = model(ids, pos, pos, make_causal_mask(torch.zeros(B, dtype=torch.long), P, max_len), cache, AUX)
    got = [([logits[b, :n]], [aux[b, :n]]) for b, n in enumerate(prompt_lens)]
    lengths = torch.tensor(prompt_lens)
    for step in range(len(chunks)):
        T = chunks[step]
        ids = torch.stack([torch.tensor(s[n:n + T]) for s, n in zip(seqs, lengths.tolist())])
        pos = lengths[:, None] + torch.arange(T)
        with torch.no_grad():
            logits, aux = model(ids, pos, pos, make_causal_mask(lengths, T, max_len), cache, AUX)
        for b in range(B):
            got[b][0].append(logits[b])
            got[b][1].append(aux[b])
        lengths += T
    return [(torch.cat(lg), torch.cat(ax)) for lg, ax in got]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_aux_match_hf_through_cache_and_padding(family):
    hf = make_tiny(family, seed=3)
    model = build_engine_target(hf, torch.float32, "cpu")
    assert isinstance(model, Transformer if family in ENGINE_FAMILIES else HFTarget)
    prompt_lens, chunks = [11, 4, 7], [1, 1, 3, 1]  # > gemma3's sliding window of 8
    seqs = [torch.randint(0, 301, (n + sum(chunks),)).tolist() for n in prompt_lens]
    for seq, (logits, aux) in zip(seqs, run_rows(model, seqs, prompt_lens, chunks)):
        ref_logits, ref_aux = hf_reference(hf, seq)
        assert (logits - ref_logits).abs().max() < 1e-4
        assert (aux - ref_aux).abs().max() < 1e-4


def test_tied_embeddings_and_rope_scaling():
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf = make_tiny("llama", seed=5, tie_word_embeddings=True, rope_parameters=rope)
    hf.tie_weights()
    model = build_engine_target(hf, torch.float32, "cpu")
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    seq = torch.randint(0, 301, (100,)).tolist()  # past original_max_position_embeddings
    (logits, _), = run_rows(model, [seq], [90], [1] * 10, max_len=128)
    ref_logits, _ = hf_reference(hf, seq)
    assert (logits - ref_logits).abs().max() < 1e-4


def test_llama_with_attention_and_mlp_biases_matches_hf():
    """Llama's attention_bias (q/k/v/o) and mlp_bias (gate/up/down) reach the compact engine."""
    hf = make_tiny("llama", seed=6, attention_bias=True, mlp_bias=True)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)  # HF starts biases at zero, which would hide a dropped one
    model = build_engine_target(hf, torch.float32, "cpu")
    assert isinstance(model, Transformer)
    seq = torch.randint(0, 301, (20,)).tolist()
    (logits, aux), = run_rows(model, [seq], [12], [1, 3, 4])
    ref_logits, ref_aux = hf_reference(hf, seq)
    assert (logits - ref_logits).abs().max() < 1e-4
    assert (aux - ref_aux).abs().max() < 1e-4


def test_a_family_without_a_compact_engine_decodes_as_hf_does(capsys):
    """gpt2 (learned positions, no compact engine): the fallback says in one line which path
    runs, and its greedy decoding is HF's own."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    model = build_engine_target(hf, torch.float32, "cpu")
    assert not isinstance(model, Transformer)
    assert "gpt2 runs through transformers' own layers" in capsys.readouterr().err
    prompt = torch.randint(1, 50, (7,)).tolist()
    got, _ = generate_ar(model, [prompt], SamplingParams(max_new_tokens=10), [49])
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=49,
                      pad_token_id=0)[0, len(prompt):].tolist()
    assert got[0] == ref


@pytest.mark.parametrize("family", ENGINE_FAMILIES + ["gemma3"])
def test_greedy_matches_hf_generate_and_batching_matches_solo(family):
    hf = make_tiny(family, seed=1)
    model = build_engine_target(hf, torch.float32, "cpu")
    prompts = [torch.randint(0, 301, (n,)).tolist() for n in (9, 3, 14)]
    eos = [int(torch.randint(0, 301, ()))]
    params = SamplingParams(max_new_tokens=24)
    batched, stats = generate_ar(model, prompts, params, eos)
    assert stats["generated_tokens"] == sum(len(r) for r in batched)
    for p, row in zip(prompts, batched):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=eos[0],
                          pad_token_id=0)[0, len(p):].tolist()
        assert row == ref
        assert generate_ar(model, [p], params, eos)[0][0] == row


def test_row_groups_and_spans_change_nothing(monkeypatch):
    """A long batch in unsorted order, decoded in length-sorted groups of 2 rows, each group
    prefilled apart and attending over its own span (span quantum shrunk so spans grow during
    the run): every row equals that prompt generated alone, in the caller's order."""
    from fledge.engine import decode as generate
    hf = make_tiny("qwen2", seed=4)
    model = build_engine_target(hf, torch.float32, "cpu")
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 301, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (7,), generator=g)]
    params = SamplingParams(max_new_tokens=20)
    monkeypatch.setattr(generate, "SPAN_QUANTUM", 16)
    rows, stats = generate_ar(model, prompts, params, [], row_group=2)
    assert stats["row_groups"] == 4 and len(set(stats["spans"])) > 1
    for p, row in zip(prompts, rows):
        assert generate_ar(model, [p], params, [])[0][0] == row


def test_hf_target_decodes_over_spans_narrower_than_its_cache(monkeypatch):
    """HFTarget (no prefix kernel) is given decode masks over the first span of its cache, not
    all of it, once the cache is longer than a span: the same text as over the whole cache."""
    from fledge.engine import decode as generate
    model = build_engine_target(make_tiny("gemma3", seed=2), torch.float32, "cpu")
    prompt, params = [5, 9, 2, 7, 11], SamplingParams(max_new_tokens=30)
    whole = generate_ar(model, [prompt], params, [])[0][0]
    monkeypatch.setattr(generate, "SPAN_QUANTUM", 8)
    rows, stats = generate_ar(model, [prompt], params, [])
    assert rows[0] == whole and min(s for s, in stats["spans"]) < 64


def test_decode_attention_equals_sdpa():
    """The matmul decode attention is SDPA's math: fresh random q/k/v, a random key mask."""
    from fledge.engine.layers import decode_attention
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(5, 3, *shape, generator=g) for shape in ((4, 16), (40, 16), (40, 16)))
    keep = torch.rand(5, 1, 4, 40, generator=g) < 0.6
    keep[..., 0] = True  # no row without a key
    bias = torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(decode_attention(q, k, v, bias), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # torch.compile on the CPU
def test_compiled_batched_decode_equals_eager():
    """Compiled layers, with row groups large enough for the matmul decode attention: every
    row equals the eager engine's (fp32)."""
    import dataclasses

    from fledge.engine.layers import LayerFns
    hf = make_tiny("llama", seed=6)
    eager = build_engine_target(hf, torch.float32, "cpu")
    fns, calls = LayerFns.compiled(decode_attention_min_rows=4, prefix_kernel=False, few_rows=0), []

    def counted(*a):
        calls.append(a[0].shape[0])
        return fns.decode_attention(*a)
    compiled = build_engine_target(hf, torch.float32, "cpu", fns=dataclasses.replace(fns, decode_attention=counted))
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 301, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (12,), generator=g)]
    params = SamplingParams(max_new_tokens=12)
    assert generate_ar(compiled, prompts, params, [], row_group=6)[0] == generate_ar(eager, prompts, params, [], row_group=6)[0]
    assert calls and set(calls) == {6}  # both groups of 6 rows, every decode step and layer


def test_linear_as_reduction_equals_f_linear():
    from fledge.engine.layers import linear

    g = torch.Generator().manual_seed(13)
    w, b = torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    for shape in ((1, 1, 40), (2, 2, 40), (3, 2, 40)):  # 1 and 4 rows as a reduction, 6 as w @ x.T (CPU)
        x = torch.randn(*shape, generator=g)
        for bias in (None, b):
            want = torch.nn.functional.linear(x, w, bias)
            torch.testing.assert_close(linear(x, w, bias, gemv_rows=4), want, rtol=1e-5, atol=1e-5)


def test_cpu_few_rows_linear_equals_f_linear():
    """On the CPU, 2..CPU_FEW_ROWS rows multiply as w @ x.T: the same product, a contiguous
    result of F.linear's shape, either side of both thresholds, 2-D and 3-D, with and without bias."""
    from fledge.engine.layers import CPU_FEW_ROWS, linear

    w, b = torch.randn(96, 72), torch.randn(96)
    for rows in (1, 2, 5, CPU_FEW_ROWS, CPU_FEW_ROWS + 1):
        for shape in ((rows, 72), (1, rows, 72)):
            x = torch.randn(*shape)
            for bias in (None, b):
                got, want = linear(x, w, bias), torch.nn.functional.linear(x, w, bias)
                assert got.shape == want.shape and got.is_contiguous()
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # torch.compile on the CPU
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_compiled_gemv_layers_equal_eager(family):
    """Compiled layers whose one-row matmuls are reductions (gemv_rows): the same greedy tokens
    and logits within fp32 rounding, at batch 1 (the reduction form) and batch 5 (F.linear)."""
    from fledge.engine.layers import LayerFns
    hf = make_tiny(family, seed=7)
    eager = build_engine_target(hf, torch.float32, "cpu")
    gemv = build_engine_target(hf, torch.float32, "cpu", fns=LayerFns.compiled(prefix_kernel=False, gemv_rows=4, few_rows=0))
    g = torch.Generator().manual_seed(14)
    prompts = [torch.randint(0, 301, (int(n),), generator=g).tolist() for n in (7, 3, 11, 5, 9)]
    params = SamplingParams(max_new_tokens=10)
    for batch in (prompts[:1], prompts):
        assert generate_ar(gemv, batch, params, [])[0] == generate_ar(eager, batch, params, [])[0]
    ids = torch.tensor([prompts[0]])
    pos = torch.arange(ids.shape[1])[None]
    want = eager(ids[:, -1:], pos[:, -1:], pos[:, -1:], make_causal_mask(pos[0, -1:], 1, 16), eager.new_cache(1, 16))[0]
    got = gemv(ids[:, -1:], pos[:, -1:], pos[:, -1:], make_causal_mask(pos[0, -1:], 1, 16), gemv.new_cache(1, 16))[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_generation_stops_at_eos_per_row():
    model = build_engine_target(make_tiny("llama", seed=2), torch.float32, "cpu")
    prompts = [torch.randint(0, 301, (n,)).tolist() for n in (5, 8)]
    free, _ = generate_ar(model, prompts, SamplingParams(max_new_tokens=12), eos_ids=[])
    eos = free[0][4]  # row 0's fifth token becomes eos: row 0 must stop there
    rows, _ = generate_ar(model, prompts, SamplingParams(max_new_tokens=12), eos_ids=[eos])
    for got, full in zip(rows, free):
        assert got == (full[:full.index(eos) + 1] if eos in full else full)


def test_decoding_stops_once_every_row_has_ended():
    """The host learns of the last eos without a periodic check (generate.DoneWatch): on the CPU
    the run takes exactly the steps up to the later row's eos, not up to a multiple of 16."""
    model = build_engine_target(make_tiny("llama", seed=5, vocab_size=64, initializer_range=0.25), torch.float32, "cpu")
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 7)]
    free, _ = generate_ar(model, prompts, SamplingParams(max_new_tokens=40), eos_ids=[])
    eos = next(t for t in free[0][3:] if t in free[1][3:])  # a token both rows write after their third
    rows, stats = generate_ar(model, prompts, SamplingParams(max_new_tokens=40), eos_ids=[eos])
    assert [len(r) for r in rows] == [r.index(eos) + 1 for r in free]
    assert stats["decode_steps"] == max(len(r) for r in rows) - 1 < 39


def test_compiled_step_finish_equals_eager():
    """A greedy decode step's bookkeeping compiled (generate.finish_step, as in the CUDA-graph
    step) writes what eager writes: argmax column, tokens, done rows (ties included), lengths."""
    from fledge.engine.decode import finish_step, finish_step_compiled
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 3, (4, 9), generator=g).float()  # ties: the lowest index wins
    for eos in (torch.tensor([0, 2]), torch.tensor([], dtype=torch.long)):
        outs = []
        for finish in (finish_step, finish_step_compiled):
            bufs = [torch.zeros(4, 6, dtype=torch.long), torch.tensor([2]), torch.tensor([True, False, False, False]),
                    torch.zeros(4, 1, dtype=torch.long), torch.tensor([5, 6, 7, 8])]
            finish(logits, eos, *bufs)
            outs.append(bufs)
        for want, got in zip(*outs):
            assert torch.equal(want, got)
        new, col, done, tokens, lengths = outs[0]
        assert new[:, 2].tolist() == logits.argmax(-1).tolist() == tokens[:, 0].tolist() and col.item() == 3
        assert done.tolist() == [True] + [t in eos.tolist() for t in logits.argmax(-1).tolist()[1:]]
        assert lengths.tolist() == [6, 7, 8, 9]


def test_sampling_is_reproducible_with_a_seed():
    model = build_engine_target(make_tiny("qwen2", seed=4), torch.float32, "cpu")
    prompts = [torch.randint(0, 301, (6,)).tolist(), torch.randint(0, 301, (2,)).tolist()]

    def run(seed):
        return generate_ar(model, prompts, SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, seed=seed), [])[0]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_top_p_keeps_exactly_the_nucleus():
    torch.manual_seed(0)
    logits = torch.randn(50, 12) * 2
    params = SamplingParams(temperature=0.7, top_p=0.8)
    probs = logits_to_probs(logits, params)
    full = torch.softmax(logits / 0.7, dim=-1)
    for row, p in zip(full.tolist(), probs):
        order = sorted(range(12), key=lambda i: -row[i])
        nucleus, mass = set(), 0.0
        for i in order:  # smallest set of most likely tokens with mass >= top_p
            nucleus.add(i)
            mass += row[i]
            if mass >= 0.8:
                break
        expect = torch.tensor([row[i] / mass if i in nucleus else 0.0 for i in range(12)])
        assert torch.allclose(p, expect, atol=1e-6)
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_token(logits, params, gen) for _ in range(200)])
    assert probs.gather(1, draws.T).gt(0).all()  # never a token outside the nucleus
    assert torch.equal(sample_token(logits, SamplingParams(), gen), logits.argmax(-1))


@pytest.mark.slow
def test_smollm2_real_weights_match_hf():
    from fledge.core.target import load_target

    target = load_target("smollm2-135m")
    hf, tok = target.model, target.tokenizer
    model = build_engine_target(hf, torch.float32, "cpu")
    text = tok.apply_chat_template([{"role": "user", "content": "Why is the sky blue? Answer briefly."}],
                                   tokenize=False, add_generation_prompt=True)
    prompt = tok(text)["input_ids"]
    (logits, _), = run_rows(model, [prompt + [tok.eos_token_id]], [len(prompt)], [1], max_len=128)
    ref, _ = hf_reference(hf, prompt + [tok.eos_token_id])
    assert (logits - ref).abs().max() < 1e-4
    rows, _ = generate_ar(model, [prompt], SamplingParams(max_new_tokens=32), eos_ids=[])
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert rows[0] == ref[0, len(prompt):].tolist()


def test_stream_refills_rows_and_equals_solo_generation(monkeypatch):
    """Continuous batching: 11 prompts through 4 rows in groups of 2, rows ending at an eos
    mid-run and refilled, spans growing (quantum shrunk): each answer equals that prompt
    generated alone; every prompt is answered once; a sampled stream respects the limits."""
    from fledge.engine import decode as generate
    from fledge.engine.stream import generate_stream
    hf = make_tiny("llama", seed=7)
    model = build_engine_target(hf, torch.float32, "cpu")
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 301, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (11,), generator=g)]
    params = SamplingParams(max_new_tokens=10)
    monkeypatch.setattr(generate, "SPAN_QUANTUM", 8)
    solo = [generate_ar(model, [p], params, [])[0][0] for p in prompts]
    eos = [solo[0][3], solo[5][1]]  # some rows end early, at different steps
    solo = [generate_ar(model, [p], params, eos)[0][0] for p in prompts]
    assert len({len(s) for s in solo}) > 1
    out, stats = generate_stream(model, prompts, params, eos, rows=4, refill_every=2, row_group=2)
    assert out == solo
    assert stats["generated_tokens"] == sum(map(len, solo)) and stats["rows"] == 4
    sampled, _ = generate_stream(model, prompts, SamplingParams(temperature=1.0, max_new_tokens=7), eos, rows=3)
    assert all(1 <= len(s) <= 7 and all(t not in eos for t in s[:-1]) for s in sampled)


@pytest.mark.parametrize("ids, phrase", [((0, 3, 5), r"out of range \[1, 7\]"), ((2, 3, 8), r"out of range \[1, 7\]"),
                                         ((2, 5, 3), "strictly increasing"), ((), "none given")])
def test_engine_refuses_aux_ids_the_conventions_refuse(ids, phrase):
    model = build_engine_target(make_tiny("llama", seed=3), torch.float32, "cpu")  # 8 layers
    x = torch.tensor([[1, 2, 3]])
    with pytest.raises(FledgeError, match=phrase):
        model.prefill(x, model.new_cache(1, 64), aux_ids=ids)
    cache = model.new_cache(1, 64)
    pos = torch.arange(3)[None]
    with pytest.raises(FledgeError, match=phrase):
        model(x, pos, pos, make_causal_mask(torch.zeros(1, dtype=torch.long), 3, 64), cache, ids)
    _, aux = model.prefill(x, model.new_cache(1, 64), aux_ids=(1, 4, 7))  # the widest valid range
    assert aux.shape == (1, 3, 3 * 64)
    _, aux5 = model.prefill(x, model.new_cache(1, 64), aux_ids=(1, 2, 4, 6, 7))  # a DFlash drafter may read five
    assert aux5.shape == (1, 3, 5 * 64) and torch.equal(aux5[..., :64], aux[..., :64])


@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
def test_a_batch_frees_its_cache_on_return(fails, monkeypatch):
    """regen calls the engine once per turn: a batch's KV cache must be gone when the call
    returns or raises, without waiting for a gc pass, or the next turn's cache is allocated
    beside it."""
    import gc
    import weakref

    from fledge.engine import decode as generate
    from fledge.engine import stream
    model = build_engine_target(make_tiny("llama", seed=2), torch.float32, "cpu")
    made = []
    new_cache = model.new_cache
    model.new_cache = lambda *a: made.append(weakref.ref(c := new_cache(*a))) or c
    if fails:
        def broken(*a):
            raise RuntimeError("a decode step failed")
        monkeypatch.setattr(generate, "decode_logits", broken)
        monkeypatch.setattr(stream, "decode_logits", broken)
    prompts = [torch.randint(0, 301, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 8, 3)]
    calls = (lambda: generate_ar(model, prompts, SamplingParams(max_new_tokens=6), eos_ids=[]),
             lambda: stream.generate_stream(model, prompts, SamplingParams(max_new_tokens=6), [], rows=2))
    raised = 0
    gc.disable()
    try:
        for call in calls:
            try:
                call()
            except RuntimeError:
                raised += 1
        assert raised == (2 if fails else 0)
        assert len(made) == 2 and all(ref() is None for ref in made)
    finally:
        gc.enable()
