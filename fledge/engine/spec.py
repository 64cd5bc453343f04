"""Speculative decoding: draft a tree, verify it in one target forward, keep the longest
accepted path and a bonus token.

A request prefills, then runs rounds (engine.rounds) of one kind until it has its tokens: `FusedRound` (greedy,
one graph replay a round), `QueuedRound` (the same for device drafters, queued ahead of the
host) or `PhasedRound` (separate timed steps; also sampling). Each round returns a
`RoundResult` that knows its own timings. Per round the host learns one small tensor (accepted
count, path tokens, bonus) with a single `.tolist()`; everything else stays on the device.
Exactness: with greedy sampling the output is token-for-token the engine's AR output; with
temperature/top-p every token is distributed as AR's (generate.logits_to_probs), via
tree.verify_sample.
"""

from __future__ import annotations

import torch

from fledge.core.errors import FledgeError
from fledge.core.shape import Shape
from fledge.engine.decode import cut_at_eos
from fledge.engine.drafters import OracleDrafter
from fledge.engine.protocols import Drafter, EngineTarget
from fledge.engine.rounds import Request, round_for
from fledge.engine.sampling import sample_token
from fledge.engine.stats import Clock, SpecStats


def cache_size(prompt_len: int, max_new_tokens: int, spec: Shape, cache_len: int | None = None) -> int:
    """Slots needed: prompt + new tokens + one tree written past the end (rounded to 64, as AR)."""
    need = prompt_len + max_new_tokens + spec.num_draft_tokens
    size = cache_len or -(-need // 64) * 64
    if size < need:
        raise FledgeError(f"cache of {size} slots < prompt {prompt_len} + max_new_tokens {max_new_tokens} "
                          f"+ num_draft_tokens {spec.num_draft_tokens} = {need}")
    return size


# --------------------------------------------------------------------------- a request
def prefill(target, drafter, cache, resident, req: Request):
    """The prompt into the target cache (the resident's captured prefill, if any) and into the
    drafter. Returns (root = the first new token [1], cache_len [1])."""
    ids = torch.tensor([req.prompt], device=next(target.parameters()).device)
    cache_len = torch.tensor([len(req.prompt)], device=ids.device)
    if resident is not None:
        logits, aux = resident.prefill(ids, drafter.aux_ids)
    else:
        logits, aux = target.prefill(ids, cache, aux_ids=drafter.aux_ids, logits_idx=(cache_len - 1)[:, None])
    root = sample_token(logits[:, 0], req.params, req.gen)
    drafter.observe(ids, aux, cache_len, root, torch.zeros_like(cache_len))
    return root, cache_len


@torch.no_grad()
def generate_spec(target: EngineTarget, drafter: Drafter, prompt: list[int], params, eos_ids, cache_len: int | None = None,
                  use_cuda_graph: bool = True, phased: bool = False, resident=None):
    """One prompt (batch 1). Returns (new tokens, ending at the first eos (included) or at
    max_new_tokens — the same cut as generate_ar; SpecStats).

    Greedy rounds are fused (FusedRound, QueuedRound); `phased`, and sampling, run each round
    as separate timed steps (PhasedRound), so that SpecStats splits it into draft / verify /
    other. `resident`: an engine.resident.Resident of `target`, whose cache and captured
    prefill (with the drafter's aux ids) the request uses, and which keeps the round built for
    the next request (round_for)."""
    if not prompt:
        raise FledgeError("generate_spec: the prompt is empty")
    spec: Shape = drafter.spec
    device = next(target.parameters()).device
    size = cache_size(len(prompt), params.max_new_tokens, spec, cache_len)
    if resident is not None:  # the same check against the resident cache; the drafter's rows stay per request
        cache_size(len(prompt), params.max_new_tokens, spec, resident.max_len)
    cache = resident.cache if resident is not None else target.new_cache(1, size)
    drafter.start(1, size)
    graphs = use_cuda_graph and device.type == "cuda"
    rounds = round_for(target, cache, drafter, resident, graphs, phased or params.temperature > 0)
    req = Request(prompt, params, size, torch.Generator(device=device).manual_seed(params.seed), Clock(device))
    eos = set(eos_ids)

    t0 = req.clock.now()
    root, root_len = prefill(target, drafter, cache, resident, req)
    out = [root.item()]
    rounds.start(req, root, root_len)
    t_prefill = req.clock.now()
    results, done = [], out[0] in eos
    while len(out) < params.max_new_tokens and not done:
        r = rounds.run(out)
        results.append(r)
        out += r.tokens
        done = any(t in eos for t in r.tokens)
    t_end = req.clock.now()  # after any round queued past the end: its time counts
    req.clock.wait(t_end)

    out = cut_at_eos(out[:params.max_new_tokens], eos)
    stats = SpecStats(spec.num_steps, spec.num_draft_tokens, prompt_tokens=len(prompt), generated_tokens=len(out),
                      prefill_ms=req.clock.ms(t0, t_prefill), wall_ms=req.clock.ms(t0, t_end),
                      accepted=[r.accepted for r in results])
    if drafter.vocab is not None:  # a round's last token is its bonus, the target's own choice
        stats.outside_vocab = sum(r.accepted < spec.path_len - 1 and r.tokens[-1] not in drafter.vocab for r in results)
    prev = t_prefill
    for r in results:
        prev = r.record(stats, req.clock, prev)
    return out, stats


def oracle_text(target, spec: Shape, prompt: list[int], reference: list[int], params, eos_ids,
                max_passes: int = 8, **generate_kw) -> tuple[list[int], int]:
    """The greedy text this engine's own verify computes for `prompt` with a chain of `spec`:
    what an oracle drafter must propose so that every draft is accepted (the engine's ceiling).

    AR's text is not it in bf16: a verify over many rows may round a near-tie apart from a
    one-row step, and where the rounds fall moves the rows a position is computed in. So the
    reference is refined: each pass proposes the last pass's output. Up to a pass's first
    rejection its rounds are the last pass's, so each pass moves that point later; the text is
    final once a pass returns what it was fed. Returns (text, passes run); after `max_passes`
    the last output stands (an oracle fed it then accepts less than everything, and says so).
    In fp32 the first pass already returns AR's text."""
    drafter = OracleDrafter(spec, [prompt + reference], next(target.parameters()).device)
    for n in range(1, max_passes + 1):
        out, _ = generate_spec(target, drafter, prompt, params, eos_ids, **generate_kw)
        if out == reference:
            return out, n
        reference = out
        drafter.set_sequences([prompt + reference])
    return reference, max_passes
