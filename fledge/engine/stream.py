"""Continuous batching for regeneration: a stream of prompts through a fixed set of rows.

`generate_ar` answers one batch: every row decodes until the last one ends, so rows that end
early decode for nothing, and each batch prefills and captures its graphs anew. Here a row
that ends is refilled with the next prompt (checked every `refill_every` steps, one host sync),
the decode step's graphs are captured once per tuple of spans and reused for the whole stream,
and every output is what `generate_ar` gives that prompt alone (greedy, exact in fp32).

The prompts are taken in order of length, and the rows are cut into groups of `row_group` as
in `generate_ar`: a group's span is its longest row's, so a long prompt makes only its own
group read long spans. A finished row that is not refilled (the stream has run dry) stops
advancing, so it never outgrows the cache.
"""

from __future__ import annotations

import torch

from fledge.engine.generate import (ROW_GROUP, SamplingParams, capture_cuda_graph, cut_at_eos, decode_logits, decode_spans,
                                    now, row_groups, sample_token)
from fledge.util import FledgeError


@torch.no_grad()
def generate_stream(model, prompts: list[list[int]], params: SamplingParams, eos_ids, rows: int = 1024,
                    refill_every: int = 16, row_group: int = ROW_GROUP, use_cuda_graph: bool = True):
    """Answer every prompt with at most `rows` in flight. Returns (per-prompt new tokens, each
    ending at its first eos (included) or at max_new_tokens; stats). Needs the compact
    Transformer (row groups, CUDA graphs)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise FledgeError("generate_stream: every prompt needs at least one token")
    if not model.row_groups_ok:
        raise FledgeError("generate_stream needs the compact engine (prefill into chosen rows)")
    device = next(model.parameters()).device
    R, M = min(rows, len(prompts)), params.max_new_tokens
    cache_len = -(-(max(map(len, prompts)) + M) // 64) * 64
    cache = model.new_cache(R, cache_len)
    gen = torch.Generator(device=device).manual_seed(params.seed)
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
    groups = row_groups(R, row_group)
    greedy = params.temperature == 0
    graphs = use_cuda_graph and device.type == "cuda" and model.cuda_graph_ok

    queue = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))[::-1]  # pop() takes the shortest
    owner = [-1] * R  # prompt index each row is answering (-1: none)
    host_len = [0] * R  # each row's length as the host knows it (spans need no sync)
    host_live = [False] * R  # rows still advancing: refilled and not yet seen to end
    tokens = torch.zeros(R, 1, dtype=torch.long, device=device)
    lengths = torch.zeros(R, dtype=torch.long, device=device)
    age = torch.zeros(R, dtype=torch.long, device=device)  # tokens a row has produced
    done = torch.ones(R, dtype=torch.bool, device=device)
    new = torch.zeros(R, M + 1, dtype=torch.long, device=device)  # + a column done rows write into
    results: list[list[int] | None] = [None] * len(prompts)

    def advance(t):
        """Record token t of every live row; a row ends at eos or at M tokens, and stops moving."""
        live = ~done
        new.scatter_(1, torch.where(live, age, M)[:, None], t[:, None])
        lengths.add_(live.long())
        age.add_(live.long())
        done.logical_or_(live & (((t[:, None] == eos).any(-1)) | (age >= M)))
        tokens.copy_(t[:, None])

    def refill(free: list[int]) -> None:
        """Prefill the next prompts into rows `free` (shortest first, padded to their longest)."""
        take = [queue.pop() for _ in range(min(len(free), len(queue)))]
        if not take:
            return
        rows_t = torch.tensor(free[:len(take)], device=device)
        lens = [len(prompts[i]) for i in take]
        ids = torch.zeros(len(take), max(lens), dtype=torch.long)
        for j, i in enumerate(take):
            ids[j, :lens[j]] = torch.tensor(prompts[i])
        lens_t = torch.tensor(lens, device=device)
        logits = model.prefill(ids.to(device), cache, logits_idx=(lens_t - 1)[:, None], rows=rows_t)[0][:, 0]
        t = sample_token(logits, params, gen)
        lengths[rows_t], age[rows_t], tokens[rows_t, 0] = lens_t, 1, t
        new[rows_t, 0] = t
        done[rows_t] = ((t[:, None] == eos).any(-1)) | (M <= 1)
        for r, i, n in zip(free, take, lens):
            owner[r], host_len[r], host_live[r] = i, n, True

    def harvest(ended: list[int]) -> None:
        if not ended:
            return
        idx = torch.tensor(ended, device=device)
        got = new[idx].tolist()
        n = age[idx].tolist()
        for r, row, k in zip(ended, got, n):
            results[owner[r]] = cut_at_eos(row[:k], eos_ids)
            owner[r], host_live[r] = -1, False

    steps_by_span: dict = {}

    def step_for(spans):
        if spans not in steps_by_span:
            def step():
                logits = decode_logits(model, tokens, lengths, groups, spans, cache)
                if not greedy:
                    return logits
                advance(logits.argmax(dim=-1))
                return None

            if graphs:  # captured mid-stream: the warm-up run's changes are undone from a snapshot
                snap = [b.clone() for b in (tokens, lengths, age, done, new)]

                def reset():
                    for b, v in zip((tokens, lengths, age, done, new), snap):
                        b.copy_(v)
                steps_by_span[spans] = capture_cuda_graph(step, reset, 1 if steps_by_span else 3)
            else:
                steps_by_span[spans] = step
        return steps_by_span[spans]

    t0 = now(device)
    refill(list(range(R)))
    steps = 0
    while True:
        if steps % refill_every == 0:
            ended = [r for r, d in zip(range(R), done.tolist()) if d and owner[r] >= 0]  # the sync
            harvest(ended)
            refill([r for r in range(R) if owner[r] < 0])
            if all(o < 0 for o in owner):
                break
        spans = decode_spans(model, [max(host_len[r0:r1]) + 1 for r0, r1 in groups], cache_len)
        logits = step_for(spans)()
        if not greedy:
            advance(sample_token(logits, params, gen))
        # The host cannot see which rows ended since the last sync: it advances them all, which
        # over-estimates a span by at most refill_every slots, never under.
        for r in range(R):
            if host_live[r]:
                host_len[r] = min(host_len[r] + 1, cache_len - 1)
        steps += 1
    t1 = now(device)
    n_new = sum(map(len, results))
    return results, {"prompts": len(prompts), "rows": R, "prompt_tokens": sum(map(len, prompts)),
                     "generated_tokens": n_new, "decode_steps": steps, "graphs": len(steps_by_span),
                     "seconds": t1 - t0, "tok_s": n_new / max(t1 - t0, 1e-9)}
