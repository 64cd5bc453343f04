"""Speculative decoding on the engine: tree logic against brute force, greedy output equal to
AR token for token, draft KV consistency, lossless sampling (with a negative control), bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import ENGINE_FAMILIES, make_tiny

from fledge.core.config import DraftConfig
from fledge.core.errors import FledgeError
from fledge.core.shape import Shape
from fledge.drafter.eagle3 import Eagle3Draft
from fledge.engine import (
    HFTarget,
    SamplingParams,
    build_engine_target,
    generate_ar,
    logits_to_probs,
    make_causal_mask,
)
from fledge.engine.attention import Prefix
from fledge.engine.drafters import Eagle3Drafter, NgramDrafter, OracleDrafter
from fledge.engine.protocols import DraftInput
from fledge.engine.rounds import verify_forward
from fledge.engine.spec import generate_spec
from fledge.engine.tree import (
    chain,
    make_tree,
    path_to,
    select_tree,
    verify_greedy,
    verify_sample,
)


def random_candidates(g, B, K, steps):
    """Candidates laid out as Eagle3Drafter lays them out: K children of the root, then K*K per
    step, children of that step's K best beams."""
    toks, scores, parents, depth = [], [], [], []
    score = torch.rand(B, K, generator=g).log()
    toks.append(torch.randint(0, 50, (B, K), generator=g)), scores.append(score)
    parents.append(torch.full((B, K), -1)), depth.append(torch.ones(B, K, dtype=torch.long))
    beams, n = torch.arange(K).expand(B, K), K
    for i in range(1, steps):
        child = (score[..., None] + torch.rand(B, K, K, generator=g).log()).flatten(1)
        toks.append(torch.randint(0, 50, (B, K * K), generator=g)), scores.append(child)
        parents.append(beams[..., None].expand(B, K, K).flatten(1)), depth.append(torch.full((B, K * K), i + 1))
        score, pick = child.topk(K, dim=1)
        beams, n = n + pick, n + K * K
    return [torch.cat(x, 1) for x in (toks, scores, parents, depth)]


@pytest.mark.parametrize("by_rank", [True, False])
def test_select_tree_keeps_best_valid_subtree(by_rank):
    g = torch.Generator().manual_seed(0)
    for K, steps, N in [(1, 4, 5), (2, 3, 6), (3, 4, 12), (4, 2, 9)]:
        toks, scores, parents, depth = random_candidates(g, 3, K, steps)
        root = torch.randint(0, 50, (3,), generator=g)
        tree = select_tree(root, toks, scores, parents, depth, N, by_rank)
        for b in range(3):
            best = sorted(range(toks.shape[1]), key=lambda c: -scores[b, c].item())[:N - 1]
            kept = sorted(best)  # brute force: the N-1 best candidates, in candidate order
            assert tree.tokens[b, 1:].tolist() == [toks[b, c].item() for c in kept]
            for node, c in enumerate(kept, 1):
                p = parents[b, c].item()
                want = 0 if p < 0 else kept.index(p) + 1  # raises if a parent was dropped
                assert tree.parents[b, node].item() == want
                assert tree.depth[b, node].item() == depth[b, c].item()
                walk, j = {node, 0}, want
                while j:
                    walk.add(j)
                    j = tree.parents[b, j].item()
                assert set(torch.nonzero(tree.anc[b, node]).flatten().tolist()) == walk


def test_tree_mask_and_path():
    g = torch.Generator().manual_seed(1)
    toks, scores, parents, depth = random_candidates(g, 2, 3, 3)
    tree = select_tree(torch.tensor([7, 8]), toks, scores, parents, depth, 8)
    cache_len = torch.tensor([5, 11])
    mask = Prefix(cache_len, tree.anc).dense(32)
    for b in range(2):
        for i in range(8):
            want = [c < cache_len[b] or (0 <= c - cache_len[b] < 8 and bool(tree.anc[b, i, c - cache_len[b]]))
                    for c in range(32)]
            assert mask[b, 0, i].tolist() == want
    best = torch.tensor([7, 3])
    path = path_to(best, tree, 4)
    for b in range(2):
        nodes, j = [], best[b].item()
        while True:
            nodes.insert(0, j)
            if j == 0:
                break
            j = tree.parents[b, j].item()
        assert path[b, :len(nodes)].tolist() == nodes
        assert all(x == best[b].item() for x in path[b, len(nodes):].tolist())


def test_verify_greedy_walks_the_tree():
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        toks, scores, parents, depth = random_candidates(g, 1, 2, 4)
        toks = toks % 4  # small vocab so matches happen
        tree = select_tree(torch.tensor([0]), toks, scores, parents, depth, 8)
        logits = torch.randn(1, 8, 4, generator=g)
        best, bonus = verify_greedy(logits, tree)
        node = 0  # brute force: from the root, step to the child holding the argmax
        while True:
            kids = [j for j in range(1, 8) if tree.parents[0, j] == node
                    and tree.tokens[0, j] == logits[0, node].argmax()]
            if not kids:
                break
            node = kids[0]
        assert best.item() == node and bonus.item() == logits[0, node].argmax().item()


def test_stats_follow_sglang_definitions():
    from fledge.engine.stats import SpecStats

    s = SpecStats(num_steps=3, num_draft_tokens=4, accepted=[0, 3, 1, 3])
    assert s.accept_length() == (7 + 4) / 4  # (accepted + one bonus per verify step) / steps
    assert s.accept_rate() == 7 / (4 * 3)
    assert s.histogram() == [1, 1, 0, 2]
    assert s.depth_acceptance() == [0.75, 0.5, 0.5]
    assert SpecStats.merge([s, s]).accept_length() == s.accept_length()


# --------------------------------------------------------------------------- on tiny targets
def tiny_setup(family, vocab=24, seed=0, draft_ids=None, eagle31=False, draft_layers=1, **overrides):
    """A tiny target and a random drafter nudged to imitate it (fc passes the highest aux state
    through, the head is the target's), so drafts are often accepted and the accept/compact/
    re-feed paths run with multi-token rounds; its attention still matters (the 0.3 scale).
    `draft_ids`: ascending target ids of a draft vocabulary (default: the whole vocab).
    `eagle31`: the drafter has EAGLE-3.1's fc_norm (the passed state's weights random) and
    norm_output. `draft_layers`: its num_hidden_layers (the later ones random, scaled as the first)."""
    hf = make_tiny(family, seed=seed, vocab_size=vocab, **overrides)
    target = build_engine_target(hf, torch.float32, "cpu")
    torch.manual_seed(seed + 1)
    cfg = DraftConfig.from_target(hf.config, None if draft_ids is None else len(draft_ids)).replace(
        fc_norm=eagle31, norm_output=eagle31, num_hidden_layers=draft_layers)
    draft = Eagle3Draft.from_target(cfg, hf, draft_ids).eval()
    H = draft.cfg.hidden_size
    with torch.no_grad():
        draft.fc.weight.zero_()[:, 2 * H:] = torch.eye(H)
        if eagle31:
            draft.fc_norm[2].weight.uniform_(0.5, 1.5)
        for layer in draft.stack():
            layer.self_attn.o_proj.weight.mul_(0.3)
            if layer is not draft.midlayer:
                layer.mlp.down_proj.weight.mul_(0.3)
        draft.lm_head.weight.copy_(hf.lm_head.weight if draft_ids is None else hf.lm_head.weight[draft_ids])
        draft.norm.weight.copy_(hf.model.norm.weight)
    return hf, target, draft


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)


# Weights at std 0.25 over a 32-token vocab: at the default init these targets repeat one or two
# tokens, and text equality then proves little (8 or more distinct tokens in 21 here).
VARIED = dict(vocab=32, initializer_range=0.25)
GREEDY_21 = SamplingParams(temperature=0.0, max_new_tokens=21)


def test_rounds_ended_outside_the_draft_vocab_are_counted():
    """A token the draft vocabulary lacks enters the text only as a round's bonus (the text
    still equals AR's); SpecStats counts the rounds such a token ended short of the tree's
    depth. A whole-vocab drafter ends none there; an oracle has no vocabulary to count."""
    from fledge.engine.stats import SpecStats

    prompt = torch.randint(0, 32, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    hf, target, full = tiny_setup("llama", **VARIED)
    ar = generate_ar(target, [prompt], GREEDY_21, eos_ids=[])[0][0]
    missing = sorted(set(ar[1:]))[:3]
    _, _, small = tiny_setup("llama", **VARIED, draft_ids=torch.tensor([t for t in range(32) if t not in missing]))
    for spec in (Shape(3, 1, 4), Shape(3, 3, 9)):
        out, stats = generate_spec(target, Eagle3Drafter(small, spec, target), prompt, GREEDY_21, eos_ids=[])
        assert out == ar
        ends, pos = [], 0
        for a in stats.accepted:  # out[0] comes from the prefill, then each round adds a + 1 tokens
            pos += a + 1
            ends.append((pos, a))
        assert {i for i in range(1, len(out)) if out[i] in missing} <= {p for p, _ in ends}
        seen = sum(p < len(out) and out[p] in missing and a < spec.path_len - 1 for p, a in ends)
        assert seen > 0
        # the last round's bonus may lie past max_new_tokens, unseen here but counted
        assert stats.outside_vocab - seen in ((0, 1) if ends[-1][0] >= len(out) else (0,))
        assert f"outside the draft vocabulary: {100 * stats.outside_vocab / stats.steps:.1f}%" in stats.report()
        _, whole = generate_spec(target, Eagle3Drafter(full, spec, target), prompt, GREEDY_21, eos_ids=[])
        assert whole.outside_vocab == 0
    _, oracle = generate_spec(target, OracleDrafter(Shape(4, 1, 5), [prompt + ar]), prompt, GREEDY_21, eos_ids=[])
    assert oracle.outside_vocab is None and oracle.summary()["ended_outside_vocab"] is None
    assert SpecStats.merge([stats, whole]).outside_vocab == stats.outside_vocab


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_greedy_spec_equals_ar(family):
    hf, target, draft = tiny_setup(family, **VARIED)
    prompt = torch.randint(0, 32, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    ar = generate_ar(target, [prompt], GREEDY_21, eos_ids=[])[0][0]
    assert len(set(ar)) >= 8, ar
    drafters = {
        "eagle chain": Eagle3Drafter(draft, Shape(3, 1, 4), target),
        "eagle tree": Eagle3Drafter(draft, Shape(3, 3, 9), target),
        "eagle wide tree": Eagle3Drafter(draft, Shape(2, 4, 13), target),
        "oracle": OracleDrafter(Shape(4, 1, 5), [prompt + ar]),
        "ngram": NgramDrafter(Shape(3, 1, 4), 2),
    }
    for name, drafter in drafters.items():
        out, stats = generate_spec(target, drafter, prompt, GREEDY_21, eos_ids=[])
        assert out == ar, name
        if "tree" in name:  # the imitating drafter gets multi-token rounds through a tree
            assert sum(stats.accepted) > 0, name
        if name == "oracle":  # 20 tokens after the prefill's one = 4 full rounds of 4 + bonus
            assert stats.accepted == [4, 4, 4, 4]
    # a stop token mid-round is cut exactly as AR cuts it
    eos = [ar[6]]
    ar_eos = generate_ar(target, [prompt], GREEDY_21, eos_ids=eos)[0][0]
    out, _ = generate_spec(target, drafters["oracle"], prompt, GREEDY_21, eos_ids=eos)
    assert out == ar_eos and out[-1] == eos[0]


def test_rounds_queued_ahead_stay_inside_an_exact_cache():
    """With the cache exactly prompt + max_new_tokens + num_draft_tokens slots and an oracle
    that fills every round, the round queued ahead of the host (rounds.QueuedRound) must wait where it
    could overrun the cache (an index error here); the text, accepted counts and round count
    are those of the unqueued phased rounds."""
    hf, target, draft = tiny_setup("llama", vocab=32, initializer_range=0.15)
    prompt = torch.randint(0, 32, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    longer = generate_ar(target, [prompt], SamplingParams(temperature=0.0, max_new_tokens=32), eos_ids=[])[0][0]
    for new in (16, 17, 21):
        params = SamplingParams(temperature=0.0, max_new_tokens=new)
        ar = generate_ar(target, [prompt], params, eos_ids=[])[0][0]
        assert ar == longer[:new]
        spec = Shape(4, 1, 5)
        exact = len(prompt) + new + spec.num_draft_tokens
        # The oracle knows text past max_new_tokens: a round queued after the last needed one would fill up.
        for drafter in (OracleDrafter(spec, [prompt + longer]), Eagle3Drafter(draft, Shape(3, 3, 9), target)):
            fused, fs = generate_spec(target, drafter, prompt, params, eos_ids=[], cache_len=exact + drafter.spec.num_draft_tokens - 5)
            phased, ps = generate_spec(target, drafter, prompt, params, eos_ids=[], phased=True)
            assert fused == phased == ar and fs.accepted == ps.accepted and len(fs.round_ms) == fs.steps
            # and none is queued past max_new_tokens: proposals = the prefill's + one per round run
            calls, propose = [], drafter.propose
            drafter.propose = lambda inp, propose=propose: calls.append(1) or propose(inp)
            again, gs = generate_spec(target, drafter, prompt, params, eos_ids=[])
            del drafter.propose
            assert again == ar and len(calls) == 1 + gs.steps


def test_fused_rounds_equal_phased_rounds():
    """The fused round (one graph on CUDA) and the phased one (each step apart, timed) are the
    same algorithm: same tokens, same accepted counts, for device and host drafters."""
    hf, target, draft = tiny_setup("qwen3", seed=2, **VARIED)
    prompt = torch.randint(0, 32, (11,), generator=torch.Generator().manual_seed(8)).tolist()
    ar = generate_ar(target, [prompt], GREEDY, eos_ids=[])[0][0]
    assert len(set(ar)) >= 6, ar
    for drafter in (Eagle3Drafter(draft, Shape(3, 1, 4), target), Eagle3Drafter(draft, Shape(3, 3, 9), target),
                    OracleDrafter(Shape(5, 1, 6), [prompt + ar[:7]]), NgramDrafter(Shape(3, 1, 4), 2)):
        fused, fs = generate_spec(target, drafter, prompt, GREEDY, eos_ids=[])
        phased, ps = generate_spec(target, drafter, prompt, GREEDY, eos_ids=[], phased=True)
        assert fused == phased == ar and fs.accepted == ps.accepted
        assert len(fs.round_ms) == fs.steps and fs.summary()["verify_ms_per_step"] is None
        assert ps.summary()["verify_ms_per_step"] is not None


@pytest.mark.slow  # torch.compile on the CPU: ~1 minute on 2 cores
def test_compiled_engine_equals_eager():
    """torch.compile of the target's layer functions and the drafter's halves changes nothing
    (fp32): AR tokens, and the drafter's accepted counts, chain and tree. Each compiled run
    covers its own graphs: AR the one-token decode step; the chain a 4-token verify and the
    drafter's chain; the tree a 9-token verify and the drafter's tree bookkeeping (fast_topk,
    the default). The torch.topk bookkeeping drafts the same trees (eager: the same counts)."""
    hf, target, draft = tiny_setup("llama", seed=3)
    compiled = build_engine_target(hf, torch.float32, "cpu", compile=True)
    prompt = torch.randint(0, 24, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    ar = generate_ar(target, [prompt], GREEDY, eos_ids=[])[0][0]
    assert generate_ar(compiled, [prompt], GREEDY, eos_ids=[])[0][0] == ar
    for spec in (Shape(3, 1, 4), Shape(3, 3, 9)):
        eager, es = generate_spec(target, Eagle3Drafter(draft, spec, target), prompt, GREEDY, eos_ids=[])
        comp, cs = generate_spec(compiled, Eagle3Drafter(draft, spec, compiled, compile=True), prompt, GREEDY, eos_ids=[])
        assert comp == eager == ar and cs.accepted == es.accepted and sum(es.accepted) > 0
        by_topk, ts = generate_spec(target, Eagle3Drafter(draft, spec, target, fast_topk=False), prompt, GREEDY,
                                    eos_ids=[])
        assert by_topk == ar and ts.accepted == es.accepted


def test_compaction_kernel_equals_gather_scatter():
    """rounds.compact's one-kernel move (Triton; the interpreter here) writes the cache exactly as
    the gather-then-scatter form, for random tree paths whose nodes sit in slots other path
    entries move into, padded paths included, at two rows."""
    from fledge.engine.model import KVCache
    from fledge.engine.rounds import compact, path_of
    g = torch.Generator().manual_seed(6)
    for trial in range(3):
        N, D = 12, 6
        parents = torch.tensor([int(torch.randint(max(0, i - 3), i, (1,), generator=g)) for i in range(1, N)])
        tree = make_tree(torch.zeros(2, dtype=torch.long), torch.zeros(2, N - 1, dtype=torch.long), parents.expand(2, -1))
        best = torch.randint(0, N, (2,), generator=g)
        path = path_of(tree, best, None, D)[0]
        start = torch.randint(0, 5, (2,), generator=g)
        kv = torch.randn(3, 2, 2, 2, 24, 16, generator=g)
        caches = [KVCache(kv.clone()), KVCache(kv.clone())]
        compact(caches[0], start, path, use_kernel=False)
        compact(caches[1], start, path, use_kernel=True)
        assert torch.equal(caches[0].kv, caches[1].kv), trial
        b = 0  # the moved rows are where they belong
        for i, node in enumerate(path[b].tolist()):
            assert torch.equal(caches[1].kv[:, :, b, :, start[b] + i], kv[:, :, b, :, start[b] + node])


def test_chain_equals_make_tree():
    g = torch.Generator().manual_seed(4)
    for n in (1, 3, 7):
        root, toks = torch.randint(0, 50, (2,), generator=g), torch.randint(0, 50, (2, n), generator=g)
        a, b = chain(root, toks), make_tree(root, toks, torch.arange(n).expand(2, n))
        for x, y in zip((a.tokens, a.parents, a.depth, a.anc), (b.tokens, b.parents, b.depth, b.anc)):
            assert torch.equal(x, y)


def test_hf_target_family_spec_equals_ar():
    """Families without a compact implementation run through HFTarget, whose cache keeps each
    layer's K/V and each slot's position: compaction must move all of them."""
    hf, target, draft = tiny_setup("gemma3")
    prompt = torch.randint(0, 24, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    ar = generate_ar(target, [prompt], GREEDY, eos_ids=[])[0][0]
    for drafter in (OracleDrafter(Shape(4, 1, 5), [prompt + ar]), Eagle3Drafter(draft, Shape(3, 3, 9), target)):
        out, stats = generate_spec(target, drafter, prompt, GREEDY, eos_ids=[])
        assert out == ar
    assert isinstance(target, HFTarget)


@pytest.mark.parametrize("eagle31,layers", [(False, 1), (True, 1), (False, 2)])
def test_eagle_draft_cache_matches_recompute(eagle31, layers):
    """Every chain the drafter proposes equals a from-scratch draft run over the whole context
    with HF's hidden states: the static draft cache, after re-feeding accepted tokens, holds
    exactly what a fresh prefill would (and, with EAGLE-3.1's norm_output, the state it keeps
    for the next step is the normed one; with a second layer, its own cache too)."""
    hf, target, draft = tiny_setup("llama", vocab=12, seed=4, eagle31=eagle31, draft_layers=layers)
    drafter = Eagle3Drafter(draft, Shape(3, 1, 4), target)
    rounds, propose = [], drafter.propose

    def recording(inp: DraftInput):
        tree = propose(inp)
        rounds.append((inp.cache_len.item(), drafter.last[0].clone(), tree.tokens[0, 1:].tolist()))
        return tree

    drafter.propose = recording
    prompt = torch.randint(0, 12, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    generated, stats = generate_spec(target, drafter, prompt, SamplingParams(max_new_tokens=20), eos_ids=[])
    assert sum(stats.accepted) > 0  # some rounds moved the cache by more than one token
    to_target = draft.target_ids()
    # Where max_new_tokens cuts the last round, the proposal made inside it looks past the output.
    rounds = [r for r in rounds if r[0] + 1 <= len(prompt + generated)]
    assert len(rounds) >= stats.steps
    with torch.no_grad():
        for L, last, proposed in rounds:
            ctx = (prompt + generated)[:L + 1]  # the verified tokens and the root
            hs = hf(torch.tensor([ctx[:-1]]), output_hidden_states=True).hidden_states
            aux = torch.cat([hs[i] for i in draft.cfg.aux_layer_ids], -1)
            causal = torch.ones(L, L, dtype=torch.bool).tril()[None, None]
            out, kv = draft(torch.tensor([ctx[1:]]), aux, torch.arange(L)[None], causal)
            h, want = out[:, -1:], []
            torch.testing.assert_close(last, h[0, 0], atol=1e-4, rtol=1e-4)
            for i in range(3):
                want.append(to_target[draft.logits(h)[0, -1].argmax()].item())
                if i == 2:
                    break
                ones = torch.ones(1, 1, 1, kv[0][0].shape[2] + 1, dtype=torch.bool)
                h, step_kv = draft(torch.tensor([[want[-1]]]), h, torch.tensor([[L + i]]), ones, kv)
                kv = [(torch.cat([k, sk], 2), torch.cat([v, sv], 2)) for (k, v), (sk, sv) in zip(kv, step_kv)]
            assert proposed == want


# --------------------------------------------------------------------------- sampling
def first_round(temperature=1.0, top_p=0.95, samples=40000, residual=True):
    """One verify round replicated `samples` times (batch dim) on a real tiny target and a random
    EAGLE-3 tree. Returns per-depth TV distances between what the round emits and the exact
    distribution, computed by HF on each explicit prefix, and the tolerance for each."""
    hf, target, draft = tiny_setup("llama", vocab=8, seed=6)
    with torch.no_grad():
        hf.lm_head.weight.mul_(3)  # peaked enough that deep nodes get accepted, flat enough that sampling varies
        target.output.weight.mul_(3)
    params = SamplingParams(temperature=temperature, top_p=top_p)
    ctx = torch.randint(0, 8, (6,), generator=torch.Generator().manual_seed(7)).tolist()
    spec = Shape(3, 4, 20)
    drafter = Eagle3Drafter(draft, spec, target)
    drafter.start(1, 64)
    cache = target.new_cache(1, 64)
    L = torch.tensor([len(ctx) - 1])
    pos = torch.arange(len(ctx) - 1)[None]
    with torch.no_grad():
        _, aux = target(torch.tensor([ctx[:-1]]), pos, pos, make_causal_mask(L * 0, len(ctx) - 1, 64), cache,
                        aux_ids=drafter.aux_ids)
        drafter.observe(torch.tensor([ctx[:-1]]), aux, L, torch.tensor([ctx[-1]]), L * 0)
        tree = drafter.propose(DraftInput(torch.tensor([ctx[-1]]), L, [ctx]))
        logits, _ = verify_forward(target, cache, tree, L, None)
        B = samples
        big = type(tree)(*(t.expand(B, *t.shape[1:]) for t in (tree.tokens, tree.parents, tree.depth, tree.anc)))
        best, bonus = verify_sample(logits_to_probs(logits, params).expand(B, -1, -1), big,
                                    torch.Generator().manual_seed(8), residual=residual)
        path = path_to(best, big, spec.path_len)
        emitted = torch.cat([big.tokens.gather(1, path), bonus[:, None]], 1)  # root, path..., (bonus)
        n = big.depth.gather(1, best[:, None])[:, 0]
        results = []
        for d in range(3):  # token d+1 after the root, given the d before it were accepted
            rows = n >= d
            y = torch.where(n[rows] == d, bonus[rows], emitted[rows, d + 1])
            prefixes = emitted[rows, :d + 1]
            for pre in torch.unique(prefixes, dim=0):
                sel = (prefixes == pre).all(1)
                if sel.sum() < 1000:
                    continue
                ref = logits_to_probs(hf(torch.tensor([ctx[:-1] + pre.tolist()])).logits[0, -1], params)
                emp = torch.bincount(y[sel], minlength=8).double() / sel.sum()
                tv = 0.5 * (emp - ref).abs().sum().item()
                # ~3x the expected TV of an honest sample of this size
                tol = 1.2 * (ref * (1 - ref) / sel.sum()).sqrt().sum().item() + 1e-3
                results.append((d, tv, tol))
    return results


def test_sampling_matches_ar_distribution():
    results = first_round()
    assert {d for d, _, _ in results} == {0, 1, 2}, "every depth needs a well-sampled prefix"
    for d, tv, tol in results:
        assert tv <= tol, f"depth {d}: total variation {tv:.4f} > {tol:.4f}"


def test_sampling_without_rejection_correction_is_caught():
    """Negative control: drawing the bonus from p without removing the rejected children
    over-weights drafted tokens; the same test must flag it."""
    results = first_round(residual=False)
    assert any(tv > tol for _, tv, tol in results)


def test_sampled_generation_runs_and_is_seeded():
    hf, target, draft = tiny_setup("llama", vocab=12, seed=4)
    drafter = Eagle3Drafter(draft, Shape(3, 2, 6), target)
    runs = [generate_spec(target, drafter, [1, 2, 3], SamplingParams(0.8, 0.9, 24, seed), [])[0] for seed in (0, 0, 1)]
    assert runs[0] == runs[1] != runs[2]
    assert all(len(r) == 24 and all(0 <= t < 12 for t in r) for r in runs)


# --------------------------------------------------------------------------- bad input
def test_bad_input_is_one_fledge_error():
    hf, target, draft = tiny_setup("qwen2")
    with pytest.raises(FledgeError, match="chain"):
        Shape(num_steps=4, topk=1, num_draft_tokens=4)
    with pytest.raises(FledgeError, match="holds 2..7"):
        Shape(num_steps=2, topk=2, num_draft_tokens=8)
    with pytest.raises(FledgeError, match="cache"):
        generate_spec(target, NgramDrafter(Shape(3, 1, 4), 2), list(range(20)), GREEDY, [], cache_len=32)
    other = make_tiny("qwen2", hidden_size=32)
    small = Eagle3Draft.from_target(DraftConfig.from_target(other.config), other)
    with pytest.raises(FledgeError, match="hidden size"):
        Eagle3Drafter(small, Shape(7, 1, 8), target)
    other = make_tiny("qwen2", vocab_size=50)
    wrong_vocab = Eagle3Draft.from_target(DraftConfig.from_target(other.config), other)
    with pytest.raises(FledgeError, match="vocab"):
        Eagle3Drafter(wrong_vocab, Shape(7, 1, 8), target)
    with pytest.raises(FledgeError, match="chain"):
        OracleDrafter(Shape(2, 2, 5), [[1]])


@pytest.mark.parametrize("layers", [1, 2])
def test_exported_drafter_through_load_drafter(tmp_path, layers):
    """The path `fledge generate --drafter DIR` takes: export, load with the target's
    embeddings, draft a tree; output still equals AR, and the loaded drafter drafts what the
    exported one did (a two-layer drafter's second layer included)."""
    from fledge.drafter.checkpoint import export_checkpoint
    from fledge.engine.drafters import load_drafter

    hf, target, draft = tiny_setup("llama", vocab=12, seed=4, draft_layers=layers)
    export_checkpoint(draft, tmp_path / "d", dtype=torch.float32)
    drafter = load_drafter(str(tmp_path / "d"), Shape(3, 2, 6), hf, target, torch.device("cpu"), torch.float32)
    assert drafter.draft.cfg.num_hidden_layers == layers == len(drafter.draft.stack())
    prompt = torch.randint(0, 12, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    ar = generate_ar(target, [prompt], GREEDY, eos_ids=[])[0][0]
    out, stats = generate_spec(target, drafter, prompt, GREEDY, eos_ids=[])
    assert out == ar and sum(stats.accepted) > 0
    _, direct = generate_spec(target, Eagle3Drafter(draft, Shape(3, 2, 6), target), prompt, GREEDY, eos_ids=[])
    assert direct.accepted == stats.accepted


def test_cli_flag_errors_are_one_line(capsys):
    from fledge.cli import main

    assert main(["generate", "--target", "x", "--prompt", "hi", "--topk", "2"]) == 2
    assert main(["generate", "--target", "x", "--prompt", "hi", "--num-steps", "3", "--num-draft-tokens", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("fledge: error: --num") for line in err)
    assert "--num-draft-tokens 3: a chain (topk 1) of 3 steps verifies exactly num_steps + 1 = 4" in err[1]
    # refused before the target ("x", which would not load) and its AR run
    assert main(["generate", "--target", "x", "--prompt", "hi", "--oracle", "--topk", "2", "--num-draft-tokens", "5"]) == 2
    assert capsys.readouterr().err.strip() == "fledge: error: --oracle drafts a chain: use --topk 1"


def test_messages_inline_however_long_or_from_a_file(tmp_path):
    import argparse
    import json

    from fledge.engine.generate import _messages
    msgs = [{"role": "user", "content": "word " * 200}]  # longer than a file name may be
    assert _messages(argparse.Namespace(prompt=None, messages=json.dumps(msgs))) == msgs
    (tmp_path / "m.json").write_text(json.dumps(msgs))
    assert _messages(argparse.Namespace(prompt=None, messages=str(tmp_path / "m.json"))) == msgs
    (tmp_path / "bad.json").write_text("[{")
    with pytest.raises(FledgeError, match=r"--messages .*bad\.json: not valid JSON"):
        _messages(argparse.Namespace(prompt=None, messages=str(tmp_path / "bad.json")))


def test_oracle_text_refines_a_wrong_reference_to_the_verify_own_text():
    """spec.oracle_text on a tiny target in fp32: fed AR's text it stops after one pass; fed a
    reference that is wrong from its fourth token on, the first pass returns the verify's own
    text (AR's, in fp32) and the second confirms it; an oracle fed that accepts every draft."""
    import fledge.engine.spec as spec_mod
    hf = make_tiny("llama", seed=3)
    target = build_engine_target(hf, torch.float32, "cpu")
    prompt, params, chain7 = [5, 9, 2, 7], SamplingParams(max_new_tokens=23), Shape(7, 1, 8)
    ar = generate_ar(target, [prompt], params, eos_ids=[])[0][0]
    assert spec_mod.oracle_text(target, chain7, prompt, ar, params, []) == (ar, 1)
    wrong = ar[:3] + [(t + 1) % hf.config.vocab_size for t in ar[3:]]
    assert spec_mod.oracle_text(target, chain7, prompt, wrong, params, []) == (ar, 2)
    _, st = generate_spec(target, OracleDrafter(chain7, [prompt + ar]), prompt, params, [])
    assert sum(st.histogram()[:-1]) == 0 and st.histogram()[-1] > 0  # every round took all 7 drafts


def test_oracle_text_follows_a_rejection_point_that_moves_later(monkeypatch):
    """The loop against a model of bf16 rounding: each pass keeps the text it was fed up to the
    first token its verify computes otherwise, then writes that token and three more of its own
    text before a later near-tie (where the rounds fell) parts it again. The loop must reach the
    fixed point, count its passes, and stop at `max_passes` with the last output when it can't."""
    import fledge.engine.spec as spec_mod
    final = list(range(100, 130))

    def fake_generate(target, drafter, prompt, params, eos, **kw):
        fed = drafter.sequences[0][len(prompt):]
        p = next((i for i, (a, b) in enumerate(zip(fed, final)) if a != b), len(final))
        own = final[:p + 4]
        return own + [7] * (len(final) - len(own)), None

    monkeypatch.setattr(spec_mod, "generate_spec", fake_generate)
    target = build_engine_target(make_tiny("llama"), torch.float32, "cpu")
    params, chain = SamplingParams(max_new_tokens=30), Shape(3, 1, 4)
    text, passes = spec_mod.oracle_text(target, chain, [1, 2], [0] * 30, params, [], max_passes=20)
    assert text == final and passes == 9  # 4, 8, ..., 28, 30 tokens right, then a pass that changes nothing
    text, passes = spec_mod.oracle_text(target, chain, [1, 2], [0] * 30, params, [], max_passes=3)
    assert passes == 3 and text == final[:12] + [7] * 18


# --------------------------------------------------------------------------- a real model
@pytest.mark.slow
def test_smollm2_greedy_spec_equals_ar():
    from fledge.core.target import load_target
    t = load_target("smollm2-135m")
    hf, tok = t.model, t.tokenizer
    target = build_engine_target(hf, torch.float32, "cpu")
    prompt = tok("The capital of France is Paris. The capital of Germany is")["input_ids"]
    params = SamplingParams(max_new_tokens=40)
    ar = generate_ar(target, [prompt], params, eos_ids=[])[0][0]
    oracle = generate_spec(target, OracleDrafter(Shape(7, 1, 8), [prompt + ar]), prompt, params, [])
    ngram = generate_spec(target, NgramDrafter(Shape(4, 1, 5), 3), prompt, params, [])
    torch.manual_seed(0)
    draft = Eagle3Draft.from_target(DraftConfig.from_target(hf.config), hf)
    tree = generate_spec(target, Eagle3Drafter(draft, Shape(3, 2, 6), target), prompt, params, [])
    assert oracle[0] == ar and ngram[0] == ar and tree[0] == ar
    assert oracle[1].accept_length() > 7


def test_cli_generate_fused_and_phased_agree(tmp_path, capsys):
    """`fledge generate` end to end on a tiny target directory: the n-gram drafter's fused and
    phased rounds write the same tokens; only the phased report splits draft / verify / other."""
    import json

    from test_target import save_tiny_dir

    from fledge.cli import main
    save_tiny_dir(tmp_path / "t")
    outs = {}
    for mode in ("fused", "phased"):
        args = ["generate", "--target", str(tmp_path / "t"), "--prompt", "a b a b a b", "--ngram", "2",
                "--num-steps", "3", "--max-new-tokens", "12", "--json", str(tmp_path / f"{mode}.json")]
        assert main(args + (["--phased"] if mode == "phased" else [])) == 0
        outs[mode] = json.loads((tmp_path / f"{mode}.json").read_text())
    assert outs["fused"]["output_ids"] == outs["phased"]["output_ids"]
    assert outs["fused"]["verify_ms_per_step"] is None and outs["phased"]["verify_ms_per_step"] is not None
    assert "verify" in capsys.readouterr().out


def test_one_off_attention_shapes_skip_cudnn(monkeypatch):
    """cuDNN's SDPA builds a plan per new shape (~40 ms each on the H200): the request's prefill
    and the drafter's pass over the prompt run without it; verify, whose shape repeats, keeps
    SDPA's own choice; a round's draft steps attend without SDPA. Recorded at every SDPA call
    of one request."""
    import torch.nn.functional as F
    hf, target, draft = tiny_setup("llama", seed=4)
    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(q, *a, **kw):
        seen.append((q.shape[-2], torch.backends.cuda.cudnn_sdp_enabled()))
        return sdpa(q, *a, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    prompt = torch.randint(0, 24, (13,), generator=torch.Generator().manual_seed(6)).tolist()
    generate_spec(target, Eagle3Drafter(draft, Shape(3, 1, 4), target), prompt, GREEDY, eos_ids=[])
    heads = hf.config.num_attention_heads
    prompt_rows = {13 * heads // hf.config.num_key_value_heads, 13}  # the draft's GQA rows, the prefill's heads
    assert prompt_rows <= {rows for rows, _ in seen}
    assert any(not on for _, on in seen) and any(on for _, on in seen)
    assert all(on != (rows in prompt_rows) for rows, on in seen)


def test_topk_forms_equal_torch_topk():
    from fledge.engine.tree import topk_by_max, topk_by_rank

    g = torch.Generator().manual_seed(11)
    for shape, k in (((3, 500), 1), ((2, 4, 1000), 4), ((1, 8, 777), 8), ((2, 16), 4), ((3, 68), 15)):
        x = torch.randn(*shape, generator=g)
        want_v, want_i = x.topk(k, dim=-1)
        for topk in (topk_by_max, topk_by_rank):
            v, i = topk(x, k)
            assert torch.equal(v, want_v) and torch.equal(i, want_i), topk.__name__
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])  # ties go to the lower index
    for topk in (topk_by_max, topk_by_rank):
        assert topk(ties, 3)[1].tolist() == [[1, 2, 4]]
    wide = torch.zeros(2, 1000)  # rows cut into chunks: ties across chunks, and a row that is all ties
    wide[0, [999, 300, 40, 600]] = 2.0
    assert topk_by_max(wide, 4)[1].tolist() == [[40, 300, 600, 999], [0, 1, 2, 3]]
    assert topk_by_max(wide, 4, chunk=8)[1].tolist() == [[40, 300, 600, 999], [0, 1, 2, 3]]


def test_logsumexp_by_chunks_equals_logsumexp():
    from fledge.engine.tree import logsumexp_by_chunks

    g = torch.Generator().manual_seed(12)
    for shape, chunk in (((3, 100), 256), ((2, 4, 16384), 256), ((1, 70000), 256), ((2, 1001), 7)):
        x = 8 * torch.randn(*shape, generator=g)
        torch.testing.assert_close(logsumexp_by_chunks(x, chunk), x.logsumexp(-1))


def test_compiled_round_finish_equals_eager_with_ties():
    """The fused round's compiled acceptance and bookkeeping (rounds.finish_round through
    torch.compile, as on CUDA) against eager on random trees whose logits tie often (values 0-2
    over 7 tokens): the same path, and the same state buffers written in place (start, cache
    length, n, path tokens, bonus, aux rows, the host's result), so ties break to the lowest
    token id in both."""
    from fledge.engine.rounds import RoundState, finish_round, finish_round_compiled
    g = torch.Generator().manual_seed(11)
    for trial in range(4):
        V, N, D = 7, 9, 4
        parents = torch.tensor([int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N)])  # node i's parent < i
        tree = make_tree(torch.randint(0, V, (1,), generator=g), torch.randint(0, V, (1, N - 1), generator=g),
                         parents.expand(1, -1))
        logits = torch.randint(0, 3, (1, N, V), generator=g).float()
        aux = torch.randn(1, N, 5, generator=g)
        outs = []
        for finish in (finish_round, finish_round_compiled):
            state = RoundState.allocate(Shape(D - 1, 2, N), "cpu", 5, torch.float32)
            state.set_tree(tree)
            state.cache_len.fill_(20)
            path = finish(logits, aux, state)
            outs.append([path, state.cache_len, state.start, state.n, state.path_tokens, state.bonus, state.aux,
                         state.result])
        for want, got in zip(*outs):
            assert torch.equal(want, got), trial
        cache_len, start, n = outs[0][1:4]
        assert start.item() == 20 and cache_len.item() == 20 + n.item() and outs[0][-1][0] == n


def test_compiled_oracle_serves_every_sequence_width_with_one_compile():
    """The oracle's compiled token lookup (CUDA's path, run here on the CPU) equals the eager one
    for requests whose sequences differ in width, under a recompile limit of 2: compiled with
    static shapes, every width was a recompile, and 80 MT-Bench requests hit the limit."""
    import torch._dynamo

    from fledge.engine.drafters import _oracle_tokens, _oracle_tokens_compiled
    g = torch.Generator().manual_seed(0)
    with torch._dynamo.config.patch(recompile_limit=2):
        for w in (30, 41, 57, 90, 311):
            seq, root, at = torch.randint(0, 100, (1, w), generator=g), torch.tensor([5]), torch.tensor([w - 4])
            assert torch.equal(_oracle_tokens(seq, root, at, 7), _oracle_tokens_compiled(seq, root, at, 7)), w
