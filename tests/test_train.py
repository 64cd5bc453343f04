"""Training: the unrolled TTT forward against the inference loop, learning, rank/shard
equivalence, kill -9 resume, online == offline features, and refused inputs."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import forked
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from conftest import make_tiny
from safetensors.torch import load_file

from fledge.cli import main as cli_main
from fledge.core.config import DraftConfig
from fledge.core.errors import FledgeError
from fledge.core.target import Target
from fledge.data.vocab import save_vocab
from fledge.drafter.checkpoint import load_checkpoint
from fledge.drafter.eagle3 import Eagle3Draft
from fledge.train.budget import (
    EXIT_BUDGET,
    budget_steps,
    fit_step_time,
    plan_budget,
    planned_seconds,
)
from fledge.train.features import (
    FeatureOptions,
    FeatureStore,
    Sample,
    TargetHead,
    cut_loops,
    feature_model,
    features_meta,
    load_samples,
    loop_end,
    online_features,
    write_features,
)
from fledge.train.loop import TrainConfig, train
from fledge.train.resume import Paused
from fledge.train.run import Run, build_draft, epoch_batches
from fledge.train.ttt import TTT, replay_counts, summarize, unroll

TESTS = Path(__file__).parent
V = 301  # tiny target vocab



def write_data(path, n=48, seed=0, lo=12, hi=40, masked=True):
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(n):
            t = int(torch.randint(lo, hi, (), generator=g))
            prompt = int(torch.randint(2, 6, (), generator=g))
            ids = torch.randint(0, V, (t,), generator=g).tolist()
            mask = [0] * prompt + [int(masked)] * (t - prompt)
            f.write(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": mask}) + "\n")
    return str(path)


def tiny_target(name="tiny"):
    return Target(make_tiny("llama"), None, name, None)


def config(tmp, out="run", **kw) -> TrainConfig:
    base = dict(data=str(tmp / "data.jsonl"), out=str(tmp / out), batch_size=4, max_steps=6, lr=3e-3, warmup=0.0,
                log_every=1, eval_every=1000, save_every=1000, eval_samples=4, pad_multiple=1, ttt_steps=4)
    return TrainConfig(**{**base, **kw})


def curve(out) -> list[float]:
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r["objective"] for r in rows if r["kind"] == "train"]


def random_draft(target, draft_vocab=None, seed=1, eagle31=False, layers=1):
    cfg = DraftConfig.from_target(target.config, draft_vocab_size=draft_vocab).replace(
        fc_norm=eagle31, norm_output=eagle31, num_hidden_layers=layers)
    torch.manual_seed(seed)
    ids = torch.randperm(cfg.vocab_size)[:cfg.draft_vocab_size].sort().values
    d = Eagle3Draft.from_target(cfg, target, ids)
    for p in d.parameters():  # norms start at ones; randomise so any misplaced norm would show
        if p.requires_grad:
            p.data.normal_(0, 0.2 if p.ndim > 1 else 1.0)
    return d


# --------------------------------------------------------------------------- TTT = inference
@pytest.mark.parametrize("eagle31,layers", [(False, 1), (True, 1), (False, 3)])
def test_unrolled_ttt_matches_inference_loop(eagle31, layers):
    """For every context row t and depth j, the training forward's step-j logits at row t equal
    a draft run the inference way: context rows 0..t in one causal pass, then one token per
    depth against an explicit KV list, at position t+j, reading token x_{t+1+j}. The loss pairs
    step j / row t with the target's distribution at t+1+j and loss_mask[t+2+j]. Also for
    EAGLE-3.1's layer, whose later steps read the normed state, and for a drafter of three
    layers, each keeping its own keys."""
    target = make_tiny("llama")
    d = random_draft(target, draft_vocab=120, eagle31=eagle31, layers=layers)
    b, t_len, steps = 2, 11, 4
    ids = torch.randint(0, V, (b, t_len))
    aux = torch.randn(b, t_len, 3 * d.cfg.hidden_size)
    with torch.no_grad():
        train_logits = [d.logits(o) for o in unroll(d, ids, aux, steps)]
        checked = 0
        for r in range(b):
            for t in range(t_len - 1):
                causal = torch.ones(t + 1, t + 1, dtype=torch.bool).tril()[None, None]
                out, past = d(ids[r:r + 1, 1:t + 2], aux[r:r + 1, :t + 1], torch.arange(t + 1)[None], causal)
                h = out[:, t:t + 1]
                torch.testing.assert_close(d.logits(h)[0, 0], train_logits[0][r, t], atol=1e-4, rtol=1e-4)
                for j in range(1, min(steps, t_len - 1 - t)):
                    see_all = torch.ones(1, 1, 1, past[0][0].shape[2] + 1, dtype=torch.bool)
                    h, kv = d(ids[r:r + 1, t + 1 + j:t + 2 + j], h, torch.tensor([[t + j]]), see_all, past)
                    past = [(torch.cat([pk, k], 2), torch.cat([pv, v], 2)) for (pk, pv), (k, v) in zip(past, kv)]
                    torch.testing.assert_close(d.logits(h)[0, 0], train_logits[j][r, t], atol=1e-4, rtol=1e-4)
                    checked += 1
        assert checked > 20

        # the loss: brute-force soft CE over (row, step) pairs, against TTT.forward's sums
        cap_hidden = torch.randn(b, t_len, d.cfg.hidden_size)
        head = TargetHead.from_model(target, d.target_ids(), "cpu")
        probs, top = head.view(cap_hidden)
        mask = torch.rand(b, t_len) > 0.3
        _, stats = TTT(d, steps, 0.8)(ids, aux, probs, top, mask, torch.ones(steps))
        for j in range(steps):
            ce = hits = n = 0.0
            for r in range(b):
                for t in range(t_len - 2 - j):
                    if mask[r, t + 2 + j]:
                        logp = train_logits[j][r, t].log_softmax(-1)
                        ce -= float((probs[r, t + 1 + j] * logp).sum())
                        hits += float(logp.argmax() == top[r, t + 1 + j])
                        n += 1
            torch.testing.assert_close(stats[:, j], torch.tensor([ce, hits, n]), atol=1e-4, rtol=1e-5)
        # the hit map: step j's hit at row t exactly where the brute force scored one, False elsewhere
        _, stats2, hit_map = TTT(d, steps, 0.8)(ids, aux, probs, top, mask, torch.ones(steps), hit_map=True)
        torch.testing.assert_close(stats2, stats)
        for j in range(steps):
            for r in range(b):
                for t in range(t_len):
                    want = t < t_len - 2 - j and bool(mask[r, t + 2 + j]) and \
                        bool(train_logits[j][r, t].argmax() == top[r, t + 1 + j])
                    assert bool(hit_map[j, r, t]) == want, (j, r, t)


@pytest.mark.parametrize("parallel,layers", [(False, 1), (True, 1), (True, 2)])
def test_cod_rows_compute_what_the_full_unroll_does(parallel, layers):
    """COD sampling: each step's kept rows are nested, ceil(T * max(r**j, floor)) of them with
    every row at step 0; the unroll over them gives, at each kept row, exactly the full unroll's
    output (a kept row's earlier steps are kept); TTT's loss over them is the full per-row loss
    at those rows scaled by T / kept, and the eval (hit_map) runs every row."""
    from fledge.train.ttt import cod_rows
    target = make_tiny("llama")
    d = random_draft(target, draft_vocab=120, layers=layers)
    if parallel:
        d.add_mask_slots(7)
    b, t_len, steps = 2, 13, 5
    torch.manual_seed(3)
    rows = cod_rows(t_len, steps, 0.6, 0.2, "cpu")
    assert [len(r) for r in rows] == [13, 8, 5, 3, 3] and torch.equal(rows[0], torch.arange(t_len))
    assert all(set(rows[j + 1].tolist()) <= set(rows[j].tolist()) for j in range(steps - 1))
    ids, aux = torch.randint(0, V, (b, t_len)), torch.randn(b, t_len, 3 * d.cfg.hidden_size)
    with torch.no_grad():
        full, kept = unroll(d, ids, aux, steps), unroll(d, ids, aux, steps, rows)
        for j in range(steps):
            torch.testing.assert_close(kept[j], full[j][:, rows[j]], atol=1e-5, rtol=1e-5)
        probs, top = TargetHead.from_model(target, d.target_ids(), "cpu").view(torch.randn(b, t_len, d.cfg.hidden_size))
        mask = torch.rand(b, t_len) > 0.3
        ttt = TTT(d, steps, 0.5, cod=(0.6, 0.2))
        torch.manual_seed(3)  # the same draw as `rows`
        loss, stats = ttt(ids, aux, probs, top, mask, torch.ones(steps))
        want = 0.0
        for j in range(steps):
            n = ce = 0.0
            for r in range(b):
                for t in rows[j].tolist():
                    if t < t_len - 2 - j and mask[r, t + 2 + j]:
                        ce -= float((probs[r, t + 1 + j] * d.logits(full[j][r, t]).log_softmax(-1)).sum())
                        n += 1
            assert stats[2, j] == n
            torch.testing.assert_close(stats[0, j], torch.tensor(ce), atol=1e-4, rtol=1e-5)
            want += 0.5 ** j * t_len / len(rows[j]) * ce
        torch.testing.assert_close(loss, torch.tensor(want), atol=1e-3, rtol=1e-5)
        _, every = TTT(d, steps, 0.5)(ids, aux, probs, top, mask, torch.ones(steps))
        _, evaluated, _ = ttt(ids, aux, probs, top, mask, torch.ones(steps), hit_map=True)
        torch.testing.assert_close(evaluated, every)


def test_replayed_chain_is_what_the_engine_accepts():
    """Training's held-out replay (TTT's hit map walked by conventions.chain_replay) against the
    engine itself: the same drafter runs a chain of 4 through generate_spec on the text the
    target writes greedily (fp32); replaying that text must give the engine's accepted count
    of every round (the last one aside: max_new_tokens cuts the text, not the engine's round).
    SpecForge's product of step accuracies reads differently on the same rows."""
    from test_engine_spec import tiny_setup

    from fledge.core.conventions import chain_replay
    from fledge.core.shape import Shape
    from fledge.engine import SamplingParams, generate_ar
    from fledge.engine.drafters import Eagle3Drafter
    from fledge.engine.spec import generate_spec
    steps, new = 4, 40
    hf, target, d = tiny_setup("llama", vocab=32, initializer_range=0.15)  # rounds of 0 to 4 accepted
    head = TargetHead.from_model(hf, d.target_ids(), "cpu")
    feats = feature_model(hf)
    checked, pooled, replayed = set(), torch.zeros(3, steps), torch.zeros(2)
    for seed in range(3):
        prompt = torch.randint(0, 32, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
        params = SamplingParams(temperature=0.0, max_new_tokens=new)
        ar = generate_ar(target, [prompt], params, eos_ids=[])[0][0]
        out, st = generate_spec(target, Eagle3Drafter(d, Shape(steps, 1, steps + 1), target), prompt, params, eos_ids=[])
        assert out == ar
        ids = torch.tensor([prompt + ar])
        answer = torch.tensor([[i >= len(prompt) for i in range(ids.shape[1])]])
        aux, hidden = online_features(feats, tuple(d.cfg.aux_layer_ids), ids, torch.ones_like(ids))
        probs, top = head.view(hidden)
        with torch.no_grad():
            _, stats, hit_map = TTT(d, steps, 0.8)(ids, aux, probs, top, answer, torch.ones(steps), hit_map=True)
        accepted, rounds = replay_counts(hit_map, answer).tolist()
        walked = chain_replay(hit_map.long().cumprod(0).sum(0)[0].tolist(), answer[0].tolist())
        assert (sum(walked), len(walked)) == (accepted, rounds)
        assert walked[:len(st.accepted) - 1] == st.accepted[:-1], (walked, st.accepted)
        checked |= set(st.accepted[:-1])
        pooled += stats
        replayed += torch.tensor([accepted, rounds])
    assert len(checked) >= 3, checked  # rounds of several lengths, not all-or-nothing
    rec = summarize(pooled, replayed)
    assert abs(rec["accept_len"] - rec["replay_accept_len"]) > 0.02, rec


def test_chain_replay_walks_rounds_per_answer_segment():
    """Hand-checked walks: the prefill gives a segment's first token, a round gains its leading
    hits + 1, a later answer segment starts afresh, nothing is drafted past a segment."""
    from fledge.core.conventions import chain_replay
    answer = [False, False, True, True, True, True, True, True, False, False, True, True, True]
    leading = [0, 2, 9, 0, 1, 1, 0, 0, 0, 0, 1, 0, 0]  # row t drafts tokens t+2 on
    # segment 1 (tokens 2-7): rows 1 (+2 -> row 4), 4 (+1 -> row 6), 6 (token 8 not an answer: stop)
    # segment 2 (tokens 10-12): rows 9 (+0 -> row 10), 10 (+1 -> row 12: past the end)
    assert chain_replay(leading, answer) == [2, 1, 0, 1]  # leading[2] = 9 is never a round
    assert chain_replay([0] * 5, [False] * 5) == []


def test_draft_loss_kinds_against_brute_force():
    """Each objective of train.draft_loss against its definition written out row by row in
    float64, and its gradient against autograd of that brute force; the reported soft CE and
    hits are the same whatever the kind."""
    from fledge.core.config import LOSSES
    from fledge.train.ttt import draft_loss
    g = torch.Generator().manual_seed(3)
    n, rows_total, vd = 11, 20, 9
    probs = torch.softmax(3 * torch.randn(rows_total, vd, generator=g, dtype=torch.float64), -1)
    top = probs.argmax(-1)
    top[::4] = -1  # the target's argmax outside the draft vocab: no hard term, never a hit
    rows = torch.randperm(rows_total, generator=g)[:n]
    base = 2 * torch.randn(n, vd, generator=g, dtype=torch.float64)
    results = {}
    for kind in LOSSES:
        logits = base.clone().requires_grad_()
        ce, objective, hits = draft_loss(logits, probs, top, rows, kind)
        objective.backward()
        ref_logits = base.clone().requires_grad_()
        want_ce, want_obj = 0.0, 0.0
        for i in range(n):
            p, logq = probs[rows[i]], ref_logits[i].log_softmax(-1)
            row_ce = -(p * logq).sum()
            want_ce = want_ce + row_ce
            if kind == "kl":
                want_obj = want_obj + row_ce
            elif kind == "greedy":
                t = int(top[rows[i]])
                want_obj = want_obj + row_ce - (logq[t] if t >= 0 else 0.0)
            else:
                alpha = torch.minimum(p, logq.exp()).sum()
                lam = 1 - float(alpha.detach())
                want_obj = want_obj + lam * row_ce + (1 - lam) * (1 - alpha)
        want_obj.backward()
        torch.testing.assert_close(ce, want_ce.detach())
        torch.testing.assert_close(objective, want_obj.detach())
        torch.testing.assert_close(logits.grad, ref_logits.grad)
        want_hits = [int(top[r]) >= 0 and int(base[i].argmax()) == int(top[r]) for i, r in enumerate(rows.tolist())]
        assert hits.tolist() == want_hits
        results[kind] = (objective.detach(), logits.grad)
    # the kinds differ: the same logits give other objectives and other gradients
    for a, b in (("kl", "greedy"), ("kl", "lk"), ("greedy", "lk")):
        assert not torch.allclose(results[a][1], results[b][1]), (a, b)
    # the lk objective sums per-row terms: any split of the rows gives the same sum and gradient
    logits = base.clone().requires_grad_()
    parts = [draft_loss(logits[s], probs, top, rows[s], "lk")[1] for s in (slice(0, 4), slice(4, n))]
    (parts[0] + parts[1]).backward()
    torch.testing.assert_close(parts[0] + parts[1], results["lk"][0])
    torch.testing.assert_close(logits.grad, results["lk"][1])


def test_greedy_loss_moves_the_argmax_where_kl_is_content():
    """Where the target's distribution is flat, a draft that matches it exactly has nothing left
    to learn from the soft CE (its gradient is q - p = 0) and ranks the target's argmax no
    higher than its neighbours; the greedy objective still raises the argmax's logit."""
    from fledge.train.ttt import draft_loss
    probs = torch.tensor([[0.30, 0.29, 0.28, 0.13]], dtype=torch.float64)
    top, rows = torch.tensor([0]), torch.tensor([0])
    grads = {}
    for kind in ("kl", "greedy"):
        logits = probs.log().clone().requires_grad_()
        draft_loss(logits, probs, top, rows, kind)[1].backward()
        grads[kind] = logits.grad[0]
    torch.testing.assert_close(grads["kl"], torch.zeros(4, dtype=torch.float64))
    assert grads["greedy"][0] < 0 and (grads["greedy"][1:] > 0).all()  # a step down the gradient raises the argmax


@pytest.mark.parametrize("kind", ["kl", "greedy", "lk"])
def test_compiled_loss_equals_eager_loss_and_gradients(kind):
    """TTT's loss through torch.compile (ttt.draft_loss_compiled, CUDA's path) against eager,
    on the CPU: the same loss, stats and gradients of every trained weight, at two batch
    shapes (the row count varies, so the compiled loss must take dynamic shapes), for each
    objective."""
    target = make_tiny("llama", seed=4)
    d = random_draft(target, draft_vocab=48)
    head = TargetHead.from_model(target, d.target_ids(), "cpu")
    g = torch.Generator().manual_seed(9)
    for b, t_len in ((2, 9), (3, 13)):
        ids = torch.randint(0, target.config.vocab_size, (b, t_len), generator=g)
        aux = torch.randn(b, t_len, 3 * d.cfg.hidden_size, generator=g)
        probs, top = head.view(torch.randn(b, t_len, d.cfg.hidden_size, generator=g))
        mask = torch.rand(b, t_len, generator=g) > 0.3
        results = []
        for compiled in (False, True):
            d.zero_grad(set_to_none=True)
            loss, stats = TTT(d, 3, 0.8, compiled_loss=compiled, loss=kind)(ids, aux, probs, top, mask,
                                                                            torch.full((3,), 5.0))
            loss.backward()
            results.append((loss.detach(), stats, [p.grad.clone() for p in d.parameters() if p.requires_grad]))
        (l0, s0, g0), (l1, s1, g1) = results
        torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s1, s0, rtol=1e-5, atol=1e-5)
        assert s0[2].sum() > 0 and len(g0) == len(g1) > 5
        for a, c in zip(g0, g1):
            torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-6)


def test_target_head_recomputes_capture_logits():
    """Offline shards keep the final-norm hidden state: the head must give the target's logits."""
    from fledge.core.target import capture
    target = make_tiny("llama")
    ids = torch.randint(0, V, (2, 9))
    cap = capture(target, ids, (2, 4, 5))
    draft_ids = torch.randperm(V)[:50].sort().values
    probs, top = TargetHead.from_model(target, draft_ids, "cpu").view(cap.hidden)
    torch.testing.assert_close(probs, cap.logits[..., draft_ids].softmax(-1))
    full_top = cap.logits.argmax(-1)
    inside = torch.isin(full_top, draft_ids)
    assert bool((top[~inside] == -1).all()) and bool((draft_ids[top[inside]] == full_top[inside]).all())


# --------------------------------------------------------------------------- learning
def test_loss_falls_and_draft_learns(tmp_path):
    data = write_data(tmp_path / "data.jsonl", n=64)
    target = tiny_target()
    with torch.no_grad():  # a random head is near-uniform; sharpen it so there is something to learn
        target.model.lm_head.weight.mul_(50)
        tops = torch.cat([target.model(s.input_ids[None]).logits[0].argmax(-1) for s in load_samples(data, 2048, V)])
    majority = tops.bincount().max().item() / tops.numel()  # always guessing the commonest token
    result = train(config(tmp_path, max_steps=30, eval_samples=8, eval_every=30), target)
    c = curve(tmp_path / "run")
    assert sum(c[-5:]) / 5 < sum(c[:5]) / 5 - 2.0
    ev = result["eval"]
    assert ev["acc"][0] > 1.5 * majority > 1.5 / V
    assert ev["accept_len"] == pytest.approx(1 + ev["accept_len_no_bonus"])
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000
    # warm start from the exported drafter: it starts where the first run ended (bf16 export)
    warm = train(config(tmp_path, "warm", init=str(tmp_path / "run" / "draft"), max_steps=1, lr=1e-9,
                        eval_samples=8), target)
    assert warm["eval"]["objective"] == pytest.approx(ev["objective"], abs=0.05)


@pytest.mark.parametrize("head", ["target", "frozen"])
def test_head_from_the_target_trains_or_stays(tmp_path, head):
    """--head target starts lm_head at the target's rows and trains it; --head frozen keeps
    exactly those rows (bf16 in the saved drafter) while the rest of the draft learns."""
    write_data(tmp_path / "data.jsonl", n=32)
    target = tiny_target()
    train(config(tmp_path, head=head, max_steps=4), target)
    d = load_checkpoint(tmp_path / "run" / "draft", embed_from=target.model)
    rows = target.model.lm_head.weight[d.target_ids()].detach().to(torch.bfloat16).float()
    moved = (d.lm_head.weight - rows).abs().max().item()
    assert (moved == 0) == (head == "frozen"), moved
    train(config(tmp_path, "still", head=head, max_steps=1, lr=1e-12), target)  # same start, no learning
    start = load_checkpoint(tmp_path / "still" / "draft", embed_from=target.model)
    assert (d.fc.weight - start.fc.weight).abs().max() > 1e-3


def test_wider_draft_mlp_trains_exports_and_drafts(tmp_path):
    """--draft-intermediate-size: the exported config carries the width (SGLang and vLLM build
    the MLP from it), the checkpoint loads back at that width, and the engine drafts with it."""
    from fledge.core.shape import Shape
    from fledge.drafter.checkpoint import load_checkpoint
    from fledge.engine.decode import generate_ar
    from fledge.engine.drafters import Eagle3Drafter
    from fledge.engine.hf import build_engine_target
    from fledge.engine.sampling import SamplingParams
    from fledge.engine.spec import generate_spec
    write_data(tmp_path / "data.jsonl", n=24)
    target = Target(make_tiny("llama"), None, "tiny-alias", tmp_path / "tiny-hf-dir")
    train(config(tmp_path, max_steps=2, draft_intermediate_size=96), target)
    out = tmp_path / "run" / "draft"
    cj = json.loads((out / "config.json").read_text())
    assert cj["intermediate_size"] == 96
    # The recorded verifier is what vLLM can load (the resolved directory), not the alias typed.
    assert cj["fledge"]["verifier"]["name_or_path"] == str(tmp_path / "tiny-hf-dir")
    draft = load_checkpoint(out, embed_from=target.model).float().eval()
    assert draft.midlayer.mlp.down_proj.weight.shape[1] == 96 != target.model.config.intermediate_size
    engine = build_engine_target(target.model, torch.float32, "cpu")
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    ar = generate_ar(engine, [[1, 5, 9, 2]], params, eos_ids=[])[0][0]
    spec, _ = generate_spec(engine, Eagle3Drafter(draft, Shape(3, 2, 6), engine), [1, 5, 9, 2], params, eos_ids=[])
    assert spec == ar
    # Widening a warm start keeps what it computes: a run that barely moves it evaluates the same.
    base = train(config(tmp_path, "same", init=str(out), max_steps=1, lr=1e-12, eval_samples=8), target)
    wide = train(config(tmp_path, "wide", init=str(out), draft_intermediate_size=160, max_steps=1, lr=1e-12,
                        eval_samples=8), target)
    assert wide["eval"]["objective"] == pytest.approx(base["eval"]["objective"], rel=1e-4)
    assert json.loads((tmp_path / "wide" / "draft" / "config.json").read_text())["intermediate_size"] == 160
    with pytest.raises(FledgeError, match="--init .*96 units.*narrowed to 64"):
        train(config(tmp_path, "narrow", init=str(out), draft_intermediate_size=64, max_steps=1), target)


def test_widened_mlp_computes_what_it_did():
    """Eagle3Draft.widen_mlp on a two-layer drafter: same outputs in fp32, every layer's new
    units live (they train), width recorded."""
    draft = random_draft(make_tiny("llama"), layers=2)
    ids, aux = torch.randint(0, V, (2, 9)), torch.randn(2, 9, 3 * draft.cfg.hidden_size)
    with torch.no_grad():
        before = torch.stack(unroll(draft, ids, aux, 3))
        draft.widen_mlp(draft.cfg.intermediate_size + 40, seed=3)
        after = torch.stack(unroll(draft, ids, aux, 3))
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    torch.stack(unroll(draft, ids, aux, 3)).square().sum().backward()
    for mlp in (layer.mlp for layer in draft.stack()):
        assert draft.cfg.intermediate_size == mlp.gate_proj.weight.shape[0] == mlp.down_proj.weight.shape[1]
        assert mlp.gate_proj.weight[-40:].abs().min() > 0 and mlp.down_proj.weight[:, -40:].abs().max() == 0
        assert mlp.down_proj.weight.grad[:, -40:].abs().max() > 0


@pytest.mark.parametrize("parallel", [False, True])
def test_added_layers_compute_what_the_drafter_did(parallel):
    """Eagle3Draft.add_layers: a one-layer drafter grown to three drafts the same in fp32 (EAGLE-3
    and P-EAGLE alike), the new layers train, their names are vLLM's, and the caller's RNG
    stream is where it was."""
    draft = random_draft(make_tiny("llama"))
    if parallel:
        draft.add_mask_slots(3)
    ids, aux = torch.randint(0, V, (2, 9)), torch.randn(2, 9, 3 * draft.cfg.hidden_size)
    with torch.no_grad():
        before = torch.stack(unroll(draft, ids, aux, 3))
        state = torch.random.get_rng_state()
        draft.add_layers(3, seed=5)
        assert torch.equal(torch.random.get_rng_state(), state)
        after = torch.stack(unroll(draft, ids, aux, 3))
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    assert draft.cfg.num_hidden_layers == 3 and {k.split(".")[1] for k in draft.state_dict() if k.startswith("layers.")} == {"1", "2"}
    draft.logits(torch.stack(unroll(draft, ids, aux, 3))).square().sum().backward()
    for layer in draft.stack()[1:]:
        assert layer.self_attn.o_proj.weight.grad.abs().max() > 0
    with pytest.raises(FledgeError, match="3 layers.*removed to 2"):
        draft.add_layers(2)


def test_change_vocab_keeps_trained_rows_and_maps_new_ones():
    """Eagle3Draft.change_vocab: a kept token's logits are what they were, to the bit; a new
    token's row is the target's row through the least-squares map of the shared rows (exact
    when the trained head is such a map of the target's); the vocab encodings follow."""
    target = make_tiny("llama")
    draft = random_draft(target, draft_vocab=200)
    theirs = target.get_output_embeddings().weight.detach()
    old = draft.target_ids().clone()
    fit = torch.randn(theirs.shape[1], draft.cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        draft.lm_head.weight.copy_(theirs[old] @ fit)
    outside = torch.tensor(sorted(set(range(V)) - set(old.tolist())))
    # more shared rows than the head is wide, so the map is determined
    new = torch.cat([old[:150], outside[:80]]).sort().values
    ids, aux = torch.randint(0, V, (2, 9)), torch.randn(2, 9, 3 * draft.cfg.hidden_size)
    with torch.no_grad():
        before = draft.logits(torch.stack(unroll(draft, ids, aux, 3)))
        assert draft.change_vocab(new, target) == {"kept": 150, "added": 80, "dropped": 50}
        after = draft.logits(torch.stack(unroll(draft, ids, aux, 3)))
    assert draft.cfg.draft_vocab_size == 230 == draft.lm_head.weight.shape[0] == draft.d2t.numel()
    assert torch.equal(draft.target_ids(), new) and torch.equal(draft.t2d.nonzero().flatten(), new)
    kept_now, kept_before = torch.isin(new, old).nonzero().flatten(), torch.isin(old, new).nonzero().flatten()
    assert torch.equal(after[..., kept_now], before[..., kept_before])
    added = (~torch.isin(new, old)).nonzero().flatten()
    torch.testing.assert_close(draft.lm_head.weight[added], theirs[new[added]] @ fit, rtol=1e-4, atol=1e-4)
    with pytest.raises(FledgeError, match="shares no token"):
        draft.change_vocab(outside[80:90], target)


def test_init_with_another_vocab_trains_and_exports_it(tmp_path, capsys):
    """`--init DIR --vocab V`: the warm start moves to V's vocabulary and the export carries it."""
    write_data(tmp_path / "data.jsonl", n=24)
    target = tiny_target()
    save_vocab(tmp_path / "v1.safetensors", torch.arange(0, 120), V, {})
    train(config(tmp_path, "first", vocab=str(tmp_path / "v1.safetensors"), max_steps=1), target)
    save_vocab(tmp_path / "v2.safetensors", torch.arange(60, 260), V, {})
    train(config(tmp_path, "second", init=str(tmp_path / "first" / "draft"), vocab=str(tmp_path / "v2.safetensors"),
                 max_steps=1), target)
    assert "60 rows kept, 140 added, 60 dropped" in capsys.readouterr().err
    draft = load_checkpoint(tmp_path / "second" / "draft", embed_from=target.model)
    assert torch.equal(draft.target_ids(), torch.arange(60, 260))
    assert json.loads((tmp_path / "second" / "draft" / "config.json").read_text())["draft_vocab_size"] == 200
    own = list(draft.cfg.aux_layer_ids)
    with pytest.raises(FledgeError, match=rf"--aux-layers \[1, 2, 3\]: --init .* reads layers \{own}"):
        build_draft(config(tmp_path, "third", init=str(tmp_path / "second" / "draft"), aux_layers=(1, 2, 3)), target)
    assert build_draft(config(tmp_path, "third", init=str(tmp_path / "second" / "draft"), aux_layers=own), target)


def test_eagle31_warm_start_from_an_eagle3_drafter(tmp_path, target_dir, capsys):
    """`--init DIR --fc-norm --norm-output`: the EAGLE-3 warm start gains fc_norm weights at
    the median RMS of each aux state over the first batch's tokens (recomputed here from HF's
    hidden states), and the exported drafter and its config carry both flags. A warm start
    that already has them keeps its layer, without a new calibration."""
    data = write_data(tmp_path / "data.jsonl", n=16)
    ev = write_data(tmp_path / "eval.jsonl", n=4, seed=1)
    common = ["--data", data, "--eval-data", ev, "--target", str(target_dir), "--batch-size", "3",
              "--ttt-steps", "2", "--max-steps", "1"]
    assert cli_main(["train", *common, "--out", str(tmp_path / "e3")]) == 0
    capsys.readouterr()
    init = ["--init", str(tmp_path / "e3" / "draft"), "--lr", "1e-12"]
    assert cli_main(["train", *common, *init, "--out", str(tmp_path / "e31"), "--fc-norm", "--norm-output"]) == 0
    assert "--init gained fc_norm" in capsys.readouterr().err
    out = tmp_path / "e31" / "draft"
    cj = json.loads((out / "config.json").read_text())
    assert cj["fc_norm"] is True and cj["norm_output"] is True
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    draft = load_checkpoint(out, embed_from=hf)
    assert draft.cfg.fc_norm and draft.cfg.norm_output
    rms = [[] for _ in range(3)]
    with torch.no_grad():
        for s in load_samples(data, 2048, V)[:3]:
            hs = hf(s.input_ids[None], output_hidden_states=True).hidden_states
            for i, layer in enumerate(draft.cfg.aux_layer_ids):
                rms[i] += hs[layer][0].pow(2).mean(-1).sqrt().tolist()
    for norm, r in zip(draft.fc_norm, rms):
        torch.testing.assert_close(norm.weight.float(), torch.full_like(norm.weight.float(), torch.tensor(r).median()),
                                   rtol=1e-2, atol=0)  # exported in bf16
    # the EAGLE-3 weights came through: lr 1e-12 moved nothing a bf16 export shows
    before = load_checkpoint(tmp_path / "e3" / "draft", embed_from=hf)
    assert torch.equal(before.fc.weight, draft.fc.weight)
    assert cli_main(["train", *common, "--init", str(out), "--out", str(tmp_path / "again"), "--fc-norm"]) == 0
    assert "gained" not in capsys.readouterr().err
    again = load_checkpoint(tmp_path / "again" / "draft", embed_from=hf)
    assert again.cfg.fc_norm and again.cfg.norm_output  # the init's layer, norm_output without the flag too


# --------------------------------------------------------------------------- ranks and shards
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_worker(rank, world, port, kw):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    train(TrainConfig(**kw), tiny_target())
    dist.destroy_process_group()


def _weights(out):
    return load_file(str(Path(out) / "draft" / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_match_one_rank(tmp_path, parallel):
    """2 gloo ranks x batch 2 (DDP, or FSDP2-sharded) == 1 rank x batch 4, curve and weights."""
    write_data(tmp_path / "data.jsonl", n=40)
    one = config(tmp_path, "one", max_steps=5, grad_accum=2, batch_size=2)
    train(one, tiny_target())
    kw = {**config(tmp_path, "two", max_steps=5, batch_size=1, grad_accum=2, parallel=parallel).__dict__}
    forked.server()  # the ranks fork from it: torch and fledge imported once, not once per rank
    mp.start_processes(_rank_worker, args=(2, _free_port(), kw), nprocs=2, start_method="forkserver")
    assert curve(tmp_path / "one") == pytest.approx(curve(tmp_path / "two"), abs=1e-5)
    a, b = (torch.load(tmp_path / r / "checkpoint" / "state.pt")["model"] for r in ("one", "two"))
    assert a.keys() == b.keys()
    for k in a:  # the full fp32 state, gathered from the shards under FSDP2
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- kill -9, SIGINT, resume
def _train_tiny(kw: dict) -> int:
    """A training run on the tiny target in a process of its own (forked): 130 when paused."""
    try:
        train(TrainConfig(**kw), tiny_target())
    except Paused:
        return 130
    return 0


def interrupt_then_resume(tmp_path, sig, ready, **kw):
    """Run "ref" and "cut" as processes of their own (forked, see tests/forked.py; the only
    difference is the signal), send `sig` to "cut" once `ready(cut_dir)` holds, check that "ref"
    finished, rerun "cut" to the end and check curves and weights bit for bit. Returns "cut"'s
    exit code from the signal and the step its checkpoint holds."""
    write_data(tmp_path / "data.jsonl", n=48, lo=20, hi=40)

    def run(out):
        return forked.start(_train_tiny, config(tmp_path, out, **kw).__dict__)

    ref = run("ref")
    child = run("cut")
    while child.is_alive() and not ready(tmp_path / "cut"):
        time.sleep(0.005)
    os.kill(child.pid, sig)
    rc = forked.wait(child)
    assert forked.wait(ref) == 0 and len(curve(tmp_path / "cut")) < kw["max_steps"]
    step = json.loads((tmp_path / "cut" / "checkpoint" / "meta.json").read_text())["step"]
    assert forked.wait(run("cut")) == 0
    assert curve(tmp_path / "cut") == curve(tmp_path / "ref")
    a, b = _weights(tmp_path / "ref"), _weights(tmp_path / "cut")
    assert all(torch.equal(a[k], b[k]) for k in a)
    return rc, step


def saved_step(run_dir) -> int:
    meta = run_dir / "checkpoint" / "meta.json"
    return json.loads(meta.read_text())["step"] if meta.exists() else 0


@pytest.mark.slow
def test_kill9_then_resume_gives_the_same_curve(tmp_path):
    rc, step = interrupt_then_resume(tmp_path, signal.SIGKILL, lambda d: saved_step(d) >= 3, max_steps=10, save_every=3)
    assert rc == -signal.SIGKILL and step in (3, 6, 9)


@pytest.mark.slow
def test_sigint_pauses_with_a_checkpoint_and_resumes_the_same_curve(tmp_path):
    """SIGINT mid-run (as `timeout -s INT` sends at a job's time limit): the run saves at the
    step it reached although no save was due, and exits 130."""
    logged = lambda d: (d / "metrics.jsonl").exists() and len((d / "metrics.jsonl").read_text().splitlines()) >= 3  # noqa: E731
    rc, step = interrupt_then_resume(tmp_path, signal.SIGINT, logged, max_steps=12, save_every=1000)
    assert rc == 130 and 3 <= step < 12


# --------------------------------------------------------------------------- --time-budget
def test_budget_plans_the_most_steps_that_fit():
    """budget_steps against counting up one step at a time: step i costs step_s[i], a new
    padded length met at a step of new_at costs first_s once, an eval runs every eval_every
    steps and after the last."""
    g = torch.Generator().manual_seed(0)
    rand = lambda scale=1.0: float(torch.rand((), generator=g)) * scale  # noqa: E731
    for _ in range(300):
        budget, spent, eval_s, first_s = rand(100), rand(10), rand(5), rand(2)
        step_s = [0.05 + rand() for _ in range(400)]
        new_at = sorted(int(torch.randint(0, 60, (), generator=g)) for _ in range(int(torch.randint(0, 8, (), generator=g))))
        every = None if rand() < 0.2 else int(torch.randint(1, 20, (), generator=g))
        seconds = lambda n: (sum(step_s[:n]) + sum(first_s for p in new_at if p < n)  # noqa: E731
                             + (-(-n // every) * eval_s if every else 0))
        n = 0
        while spent + seconds(n + 1) <= budget:
            n += 1
        if n == 0:
            with pytest.raises(FledgeError, match=f"--time-budget {budget:g}: no optimizer step fits"):
                budget_steps(budget, spent, step_s, eval_s, every, first_s, new_at)
        else:
            assert budget_steps(budget, spent, step_s, eval_s, every, first_s, new_at) == n
            assert spent + planned_seconds(step_s[:n], eval_s, every, first_s, new_at) == pytest.approx(spent + seconds(n))


def test_step_time_fit_recovers_a_line_and_stays_non_negative():
    assert fit_step_time([100, 400, 250], [0.06, 0.21, 0.135]) == pytest.approx((0.01, 5e-4))
    assert fit_step_time([100, 400, 250], [0.3, 0.1, 0.2]) == pytest.approx((0.2, 0.0))  # slower when shorter: the mean
    fixed, per = fit_step_time([100, 400, 250], [0.1, 0.35, 0.2])
    assert fixed >= 0 and per > 0
    assert fit_step_time([256, 256, 256], [0.2, 0.2, 0.2]) == pytest.approx((0.0, 0.2 / 256))


def test_budget_plan_pays_each_new_batch_length_once(tmp_path, monkeypatch):
    """A simulated GPU: a forward/backward pass takes 0.05 s plus 0.2 ms per padded token, plus
    1 s the first time its padded length is met (kernel selection, compilation); an eval 0.5 s,
    plus 2 s the first time. The plan fits the per-token cost from three warm steps and counts
    the 1 s once per new length, not per step, so the simulated run takes the planned seconds
    and ends within a step of the budget. Timing first passes alone planned under a third of
    these steps, and the three warm steps' mean time alone misses the count too."""
    assert [planned_seconds([0.2] * n, 0.0, None, 1.0, [3, 3, 7]) for n in range(10)] == pytest.approx(
        [0.2 * n + 2 * (n > 3) + (n > 7) for n in range(10)])
    write_data(tmp_path / "data.jsonl")
    cfg = config(tmp_path, max_steps=None, time_budget=120.0, batch_size=8, pad_multiple=4, eval_every=50)
    g = torch.Generator().manual_seed(0)
    samples = [Sample(f"s{i}", i, torch.zeros(int(torch.randint(3, 128, (), generator=g)), dtype=torch.int64),
                      torch.ones(1, dtype=torch.bool)) for i in range(800)]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    run = Run(cfg, None, None, None, "", None, (), None, samples, samples[:8], opt, 100, 0, 1, torch.device("cpu"))
    now, met, evals, warm_s = [10.0], set(), [], []  # 10 s of setting up before the warm-up

    def accumulate(run, step):
        epoch, k = divmod(step, 100)
        batch = epoch_batches([len(s.input_ids) for s in samples], 8, cfg.seed, epoch)[k]
        length = -(-max(len(samples[i].input_ids) for i in batch) // 4) * 4
        warm_s.append(0.05 + 2e-4 * 8 * length)
        now[0] += warm_s[-1] + (length not in met)
        met.add(length)
        return torch.zeros(3, 1), 0

    def evaluate(run):
        now[0] += 0.5 + 2.0 * (not evals)
        evals.append(now[0])

    monkeypatch.setattr("fledge.train.budget.accumulate", accumulate)
    monkeypatch.setattr("fledge.train.budget.evaluate", evaluate)
    plan = plan_budget(run, 0.0, lambda: now[0])
    n, warmed, timed = plan["total_steps"], len(met), warm_s[2:7:2]
    figures = plan["step_fixed_s"], plan["step_s_per_token"], plan["seconds_per_new_shape"], plan["seconds_per_eval"]
    assert figures == pytest.approx((0.05, 2e-4, 1.0, 0.5))
    assert plan["spent_s"] == now[0]
    warm_s[:] = []
    for step in range(n):  # the run: the lengths the warm-up met are warm
        accumulate(run, step)
        if (step + 1) % 50 == 0 or step + 1 == n:
            evaluate(run)
    assert 10 < plan["new_shapes"] == len(met) - warmed < n / 10
    assert now[0] == pytest.approx(plan["planned_s"]) and 120.0 - max(warm_s) - 1.0 - 0.5 < now[0] <= 120.0 + 1e-9
    assert plan["seconds_per_step"] == pytest.approx(sum(warm_s) / n)
    assert abs(sum(timed) / 3 / plan["seconds_per_step"] - 1) > 0.1  # what a plan from the mean would be off by
    assert n > 3 * budget_steps(120.0, plan["spent_s"], [s + 1.0 for s in warm_s] + [2.0] * n, 2.5, 50)


def test_time_budget_pauses_and_resumes_to_the_planned_run(tmp_path):
    """A budget run plans N steps from its warm-up, runs slower than planned, pauses at the
    budget (exit 75, checkpoint saved), is resumed twice (once more under the budget, once
    without it) and ends bit-equal to a run of --max-steps N: the warm-up changed nothing, the
    schedule was fixed by the plan, and no resume planned again. The clock reads 1 s per
    reading while measuring and 10 s per reading once the plan is written."""
    write_data(tmp_path / "data.jsonl", n=48)
    metrics = tmp_path / "budget" / "metrics.jsonl"

    def clock():
        now = [0.0]

        def read():
            now[0] += 10.0 if metrics.exists() and '"plan"' in metrics.read_text() else 1.0
            return now[0]
        return read

    budget = config(tmp_path, "budget", max_steps=None, time_budget=24.0)
    meta = tmp_path / "budget" / "checkpoint" / "meta.json"
    stops = []
    for _ in range(2):
        with pytest.raises(Paused) as e:
            train(budget, tiny_target(), clock=clock())
        assert e.value.exit_code == EXIT_BUDGET == 75 and "time budget of 24 s ran out" in str(e.value)
        stops.append(json.loads(meta.read_text()))
    plans = [json.loads(line) for line in metrics.read_text().splitlines() if '"plan"' in line]
    assert len(plans) == 1 and plans[0]["step"] == 0
    n = plans[0]["total_steps"]
    assert plans[0]["planned_s"] <= 24.0 and plans[0]["seconds_per_step"] == 1.0
    assert [m["total_steps"] for m in stops] == [n, n] and 1 <= stops[0]["step"] < stops[1]["step"] < n
    result = train(config(tmp_path, "budget", max_steps=None), tiny_target())  # resumed without a budget
    assert result["steps"] == n
    assert [json.loads(line)["kind"] for line in metrics.read_text().splitlines()].count("plan") == 1
    train(config(tmp_path, "straight", max_steps=n), tiny_target())
    assert curve(tmp_path / "budget") == curve(tmp_path / "straight")
    a, b = _weights(tmp_path / "budget"), _weights(tmp_path / "straight")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_engine_features_match_hf_capture(family):
    """Training reads the target through the engine's compact model (feature_model): its aux and
    final states on a right-padded batch equal HF's, hooks and attention mask, at every real token."""
    from fledge.core.target import capture
    from fledge.engine.model import Transformer
    hf = make_tiny(family, seed=7)
    lens = [13, 5, 9]
    ids = torch.zeros(3, 16, dtype=torch.long)
    attn = torch.zeros(3, 16, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, :n], attn[b, :n] = torch.randint(0, 301, (n,)), 1
    model = feature_model(hf)
    assert isinstance(model, Transformer)
    aux, hidden = online_features(model, (1, 3, 5), ids, attn)
    ref = capture(hf, ids, (1, 3, 5), attention_mask=attn)
    for b, n in enumerate(lens):
        torch.testing.assert_close(aux[b, :n], ref.aux[b, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hidden[b, :n], ref.hidden[b, :n], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- online == offline
def test_online_equals_offline_fp32(tmp_path):
    data = write_data(tmp_path / "data.jsonl", n=24)
    save_vocab(tmp_path / "vocab.safetensors", torch.randperm(V)[:150].sort().values, V, {})
    target = tiny_target()
    samples = load_samples(data, 2048, V)
    feats = tmp_path / "feats"
    write_features(target.model, (2, 4, 5), samples, feats, features_meta("tiny", data, 2048),
                   FeatureOptions("fp32", shard_size=10, batch_size=3))
    first = sorted(feats.glob("shard_*"))[0]
    stamp = first.stat().st_mtime_ns
    first_bytes = first.read_bytes()
    (feats / "shard_00001.safetensors").unlink()  # resume: only the missing shard is recomputed
    write_features(target.model, (2, 4, 5), samples, feats, features_meta("tiny", data, 2048),
                   FeatureOptions("fp32", shard_size=10, batch_size=5))
    assert first.stat().st_mtime_ns == stamp and first.read_bytes() == first_bytes
    meta = json.loads((feats / "meta.json").read_text())
    (feats / "meta.json").write_text(json.dumps({**meta, "written_by": "another tool"}))
    with pytest.raises(FledgeError, match=r"holds features of another run \(written_by differ\)"):
        write_features(target.model, (2, 4, 5), samples, feats, features_meta("tiny", data, 2048),
                       FeatureOptions("fp32", shard_size=10, batch_size=5))
    (feats / "meta.json").write_text(json.dumps(meta))
    store = FeatureStore(feats, {}, 64)
    aux, hidden = online_features(target.model, (2, 4, 5), samples[13].input_ids[None], None)
    torch.testing.assert_close(store.get(13)[0], aux[0], atol=1e-5, rtol=1e-5)

    kw = dict(vocab=str(tmp_path / "vocab.safetensors"), max_steps=4, batch_size=3)
    train(config(tmp_path, "online", **kw), target)
    train(config(tmp_path, "offline", features=str(feats), **kw), tiny_target())
    assert curve(tmp_path / "online") == pytest.approx(curve(tmp_path / "offline"), abs=1e-5)


# --------------------------------------------------------------------------- refused inputs
@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from test_target import save_tiny_dir
    path = tmp_path_factory.mktemp("tiny_target")
    save_tiny_dir(path)
    return path


def _cli_fails(capsys, tmp_path, target_dir, *extra, match):
    args = ["train", "--data", str(tmp_path / "data.jsonl"), "--out", str(tmp_path / "run"),
            "--target", str(target_dir), "--max-steps", "2", "--batch-size", "2", "--ttt-steps", "2", *extra]
    assert cli_main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fledge")]  # not HF's bars
    assert len(err) == 1 and err[0].startswith("fledge: error:") and match in err[0], err


def test_loss_reaches_the_run_and_its_checkpoint(tmp_path, target_dir, capsys):
    """`--loss` trains with that objective (from one start, the first step's soft CE is the same
    for every kind and the later ones part) and belongs to the run's config: a checkpoint made
    with one objective is refused under another, untouched."""
    data = write_data(tmp_path / "data.jsonl", n=16)
    curves = {}
    for kind in ("kl", "greedy", "lk"):
        out = tmp_path / ("run" if kind == "kl" else f"run-{kind}")
        assert cli_main(["train", "--data", data, "--out", str(out), "--target", str(target_dir), "--max-steps", "2",
                         "--batch-size", "2", "--ttt-steps", "2", "--log-every", "1", "--loss", kind]) == 0
        curves[kind] = curve(out)
    assert len(curves["kl"]) == 2 and curves["kl"][0] == curves["greedy"][0] == curves["lk"][0]
    assert curves["greedy"][1] != curves["kl"][1] != curves["lk"][1], curves
    capsys.readouterr()
    state = tmp_path / "run" / "checkpoint" / "state.pt"
    before = state.read_bytes()
    _cli_fails(capsys, tmp_path, target_dir, "--loss", "greedy", match="another config (loss differ")
    assert state.read_bytes() == before


def test_bad_inputs_refused(tmp_path, target_dir, capsys):
    data = write_data(tmp_path / "data.jsonl", n=16)
    # a vocab map made for another target vocab
    save_vocab(tmp_path / "v500.safetensors", torch.arange(100), 500, {})
    _cli_fails(capsys, tmp_path, target_dir, "--vocab", str(tmp_path / "v500.safetensors"), match="500-token vocab")
    # features 2H wide (from a target of another width)
    narrow = make_tiny("llama", hidden_size=32)
    write_features(narrow, (2, 4, 5), load_samples(data, 2048, V), tmp_path / "narrow",
                   features_meta(str(target_dir), data, 2048), FeatureOptions("fp32"))
    _cli_fails(capsys, tmp_path, target_dir, "--features", str(tmp_path / "narrow"), match="3xH=192")
    assert not (tmp_path / "run").exists()
    # a time budget too small for one step, and one next to --max-steps
    assert cli_main(["train", "--data", data, "--out", str(tmp_path / "run"), "--target", str(target_dir),
                     "--batch-size", "2", "--ttt-steps", "2", "--time-budget", "0.01"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fledge")]
    assert len(err) == 1 and "--time-budget 0.01: no optimizer step fits" in err[0] and "give at least" in err[0], err
    _cli_fails(capsys, tmp_path, target_dir, "--time-budget", "60", match="drop --max-steps")
    assert not (tmp_path / "run").exists()
    # nothing to train after filtering
    write_data(tmp_path / "empty.jsonl", n=8, masked=False)
    _cli_fails(capsys, tmp_path, target_dir, "--data", str(tmp_path / "empty.jsonl"), match="no sample")
    # a checkpoint of another config is refused and left as it was
    assert cli_main(["train", "--data", data, "--out", str(tmp_path / "run"), "--target", str(target_dir),
                     "--max-steps", "2", "--batch-size", "2", "--ttt-steps", "2"]) == 0
    capsys.readouterr()
    state = tmp_path / "run" / "checkpoint" / "state.pt"
    before = state.read_bytes()
    _cli_fails(capsys, tmp_path, target_dir, "--lr", "0.5", match="another config (lr differ")
    assert state.read_bytes() == before


# --------------------------------------------------------------------------- loops cut
def _loop_end_brute(ids: list[int], mask: list[int], width: int):
    """Every window of every trained run against every earlier window of the same run."""
    runs, i = [], 0
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    for a, b in runs:
        for i in range(a, b - width + 1):
            if any(ids[j:j + width] == ids[i:i + width] for j in range(a, i)):
                return i + width
    return None


def test_loop_end_against_brute_force():
    g = torch.Generator().manual_seed(0)
    found = 0
    for trial in range(400):
        n, alphabet, width = int(torch.randint(1, 60, (), generator=g)), int(torch.randint(2, 9, (), generator=g)), \
            int(torch.randint(1, 6, (), generator=g))
        ids = torch.randint(0, alphabet, (n,), generator=g)
        mask = torch.rand(n, generator=g) < 0.85  # several trained runs, some split by a prompt token
        want = _loop_end_brute(ids.tolist(), mask.int().tolist(), width)
        assert loop_end(ids, mask, width) == want, (ids.tolist(), mask.int().tolist(), width)
        found += want is not None
    assert 50 < found < 350  # both outcomes are exercised
    # a repeat that straddles an untrained token is not a loop of one answer
    ids, mask = torch.tensor([5, 6, 7, 5, 6, 7]), torch.tensor([1, 1, 1, 0, 1, 1], dtype=torch.bool)
    assert loop_end(ids, mask, 2) is None and loop_end(ids, mask.fill_(True), 2) == 5


def test_loop_cut_trains_as_if_the_data_were_cut(tmp_path, target_dir, capsys):
    """`--loop-cut W` on looping answers runs the same steps as training, uncut, on the samples
    cut at their loop_end by hand; it is part of the run's config and refused beside --features."""
    g = torch.Generator().manual_seed(3)
    whole, cut = [], []
    for i in range(16):
        lap = torch.randint(0, V, (int(torch.randint(3, 7, (), generator=g)),), generator=g).tolist()
        ids = [1, 2, 3] + torch.randint(0, V, (8,), generator=g).tolist() + lap * 6
        mask = [0, 0, 0] + [1] * (len(ids) - 3)
        end = _loop_end_brute(ids, mask, 4)
        whole.append({"id": f"s{i}", "input_ids": ids, "loss_mask": mask})
        cut.append({"id": f"s{i}", "input_ids": ids[:end], "loss_mask": mask[:end]})
    for name, rows in (("whole", whole), ("cut", cut)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--target", str(target_dir), "--max-steps", "3", "--batch-size", "2", "--ttt-steps", "2",
              "--log-every", "1", "--eval-samples", "2"]
    assert cli_main(["train", "--data", str(tmp_path / "whole.jsonl"), "--out", str(tmp_path / "a"),
                     "--loop-cut", "4", *common]) == 0
    assert "--loop-cut 4 cut 15 of 15 samples" in capsys.readouterr().err
    assert cli_main(["train", "--data", str(tmp_path / "cut.jsonl"), "--out", str(tmp_path / "b"), *common]) == 0
    assert len(curve(tmp_path / "a")) == 3 and curve(tmp_path / "a") == curve(tmp_path / "b")
    samples = load_samples(tmp_path / "whole.jsonl", 2048, V)
    kept, counts = cut_loops(samples, 4)
    assert counts["cut"] == 16 and counts["trained_tokens_kept"] == sum(sum(r["loss_mask"]) for r in cut)
    assert [s.input_ids.tolist() for s in kept] == [r["input_ids"] for r in cut]
    capsys.readouterr()
    state = tmp_path / "a" / "checkpoint" / "state.pt"
    before = state.read_bytes()
    assert cli_main(["train", "--data", str(tmp_path / "whole.jsonl"), "--out", str(tmp_path / "a"),
                     "--loop-cut", "5", *common]) == 2
    assert "another config (loop_cut differ" in capsys.readouterr().err and state.read_bytes() == before
    (tmp_path / "feats").mkdir()
    assert cli_main(["train", "--data", str(tmp_path / "whole.jsonl"), "--out", str(tmp_path / "c"),
                     "--loop-cut", "4", "--features", str(tmp_path / "feats"), *common]) == 2
    assert "--loop-cut cuts samples the stored --features cover whole" in capsys.readouterr().err
