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

from fledge.core.errors import FledgeError
from fledge.engine.decode import (
    ROW_GROUP,
    SpanSteps,
    cut_at_eos,
    decode_logits,
    decode_spans,
    right_padded,
    row_groups,
)
from fledge.engine.graphs import now
from fledge.engine.sampling import SamplingParams, sample_token


class Stream:
    """The rows in flight: device buffers the decode step reads and writes, and what the host
    knows of each row without a sync (which prompt it answers, its length, whether it moves)."""

    def __init__(self, model, prompts: list[list[int]], params: SamplingParams, eos_ids, rows: int, row_group: int,
                 graphs: bool):
        device = next(model.parameters()).device
        R, M = rows, params.max_new_tokens
        self.model, self.prompts, self.params, self.eos_ids = model, prompts, params, eos_ids
        self.cache = model.new_cache(R, -(-(max(map(len, prompts)) + M) // 64) * 64)
        self.gen = torch.Generator(device=device).manual_seed(params.seed)
        self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
        self.groups = row_groups(R, row_group)
        self.queue = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))[::-1]  # pop() takes the shortest
        self.owner = [-1] * R  # prompt index each row is answering (-1: none)
        self.host_len = [0] * R  # each row's length as the host knows it (spans need no sync)
        self.host_live = [False] * R  # rows still advancing: refilled and not yet seen to end
        self.tokens = torch.zeros(R, 1, dtype=torch.long, device=device)
        self.lengths = torch.zeros(R, dtype=torch.long, device=device)
        self.age = torch.zeros(R, dtype=torch.long, device=device)  # tokens a row has produced
        self.done = torch.ones(R, dtype=torch.bool, device=device)
        self.new = torch.zeros(R, M + 1, dtype=torch.long, device=device)  # + a column done rows write into
        self.results: list[list[int] | None] = [None] * len(prompts)
        # Captured mid-stream: a capture's runs are undone from a snapshot of these.
        self.steps = SpanSteps(self.step, (self.tokens, self.lengths, self.age, self.done, self.new), graphs)

    def advance(self, t) -> None:
        """Record token t of every live row; a row ends at eos or at M tokens, and stops moving."""
        M, live = self.params.max_new_tokens, ~self.done
        self.new.scatter_(1, torch.where(live, self.age, M)[:, None], t[:, None])
        self.lengths.add_(live.long())
        self.age.add_(live.long())
        self.done.logical_or_(live & (((t[:, None] == self.eos).any(-1)) | (self.age >= M)))
        self.tokens.copy_(t[:, None])

    def step(self, spans: tuple[int, ...]):
        """One decode step of every row: the logits when sampling, else nothing (advanced)."""
        logits = decode_logits(self.model, self.tokens, self.lengths, self.groups, spans, self.cache)
        if self.params.temperature != 0:
            return logits
        self.advance(logits.argmax(dim=-1))
        return None

    def refill(self) -> None:
        """Prefill the next prompts into the free rows (shortest first, padded to their longest)."""
        free = [r for r, o in enumerate(self.owner) if o < 0]
        take = [self.queue.pop() for _ in range(min(len(free), len(self.queue)))]
        if not take:
            return
        device = self.tokens.device
        rows_t = torch.tensor(free[:len(take)], device=device)
        lens = [len(self.prompts[i]) for i in take]
        ids = right_padded([self.prompts[i] for i in take]).to(device)
        lens_t = torch.tensor(lens, device=device)
        logits = self.model.prefill(ids, self.cache, logits_idx=(lens_t - 1)[:, None], rows=rows_t)[0][:, 0]
        t = sample_token(logits, self.params, self.gen)
        self.lengths[rows_t], self.age[rows_t], self.tokens[rows_t, 0] = lens_t, 1, t
        self.new[rows_t, 0] = t
        self.done[rows_t] = ((t[:, None] == self.eos).any(-1)) | (self.params.max_new_tokens <= 1)
        for r, i, n in zip(free, take, lens):
            self.owner[r], self.host_len[r], self.host_live[r] = i, n, True

    def harvest(self) -> None:
        """The answers of rows that have ended (the host's one sync here), their rows freed."""
        ended = [r for r, d in zip(range(len(self.owner)), self.done.tolist()) if d and self.owner[r] >= 0]
        if not ended:
            return
        idx = torch.tensor(ended, device=self.tokens.device)
        for r, row, k in zip(ended, self.new[idx].tolist(), self.age[idx].tolist()):
            self.results[self.owner[r]] = cut_at_eos(row[:k], self.eos_ids)
            self.owner[r], self.host_live[r] = -1, False

    def decode(self) -> None:
        """One step of every row, its spans from the host's lengths."""
        spans = decode_spans(self.model, [max(self.host_len[r0:r1]) + 1 for r0, r1 in self.groups], self.cache.max_len)
        logits = self.steps.get(spans)()
        if self.params.temperature != 0:
            self.advance(sample_token(logits, self.params, self.gen))
        # The host cannot see which rows ended since the last sync: it advances them all, which
        # over-estimates a span by at most refill_every slots, never under.
        for r, live in enumerate(self.host_live):
            if live:
                self.host_len[r] = min(self.host_len[r] + 1, self.cache.max_len - 1)

    def run(self, refill_every: int) -> int:
        """Until every prompt is answered; returns the decode steps run."""
        self.refill()
        steps = 0
        while True:
            if steps % refill_every == 0:
                self.harvest()
                self.refill()
                if all(o < 0 for o in self.owner):
                    return steps
            self.decode()
            steps += 1


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
    graphs = use_cuda_graph and device.type == "cuda" and model.cuda_graph_ok
    stream = Stream(model, prompts, params, eos_ids, min(rows, len(prompts)), row_group, graphs)
    with stream.steps:
        t0 = now(device)
        steps = stream.run(refill_every)
        t1 = now(device)
        n_graphs = len(stream.steps.by_span)
    n_new = sum(map(len, stream.results))
    return stream.results, {"prompts": len(prompts), "rows": len(stream.owner), "prompt_tokens": sum(map(len, prompts)),
                            "generated_tokens": n_new, "decode_steps": steps, "graphs": n_graphs,
                            "seconds": t1 - t0, "tok_s": n_new / max(t1 - t0, 1e-9)}
