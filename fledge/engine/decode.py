"""Autoregressive generation on the engine: batched prefill, then one token per step.

Batches are RIGHT-padded: row b's prompt sits in cache slots [0, len_b) exactly as it would
alone, and its next token always goes to slot `lengths[b]` with rope position `lengths[b]`.
Rows therefore never need to move in lockstep — the property speculative decoding needs when
rows accept different numbers of tokens — and a batched row computes what it computes alone.
Pad tokens in the prefill write slots >= len_b; each is overwritten by that row's next real
token before any mask lets a query see it.

A batch is sorted by prompt length and cut into groups of ROW_GROUP neighbouring rows: each
group prefills padded only to its own longest prompt, and a decode step attends, group by
group, only to the cache slots that group uses (its span, rounded up to SPAN_QUANTUM). On CUDA
the decode step is one CUDA graph per tuple of spans, over static buffers (tokens, lengths);
the masks and positions are derived from `lengths` inside the graph, so a step allocates
nothing on the host, and every graph is captured before the clock starts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fledge.core.errors import FledgeError
from fledge.engine.attention import Prefix
from fledge.engine.graphs import PinnedCopies, capture_cuda_graph, now
from fledge.engine.sampling import SamplingParams, sample_token


# --------------------------------------------------------------------------- masks
def make_causal_mask(starts, T: int, max_len: int):
    """[B, 1, T, max_len] bool: query t of row b sits in slot starts[b] + t and may attend
    every slot up to and including its own (prefill: starts = 0; decode: T = 1)."""
    q_slot = starts[:, None] + torch.arange(T, device=starts.device)
    return (torch.arange(max_len, device=starts.device) <= q_slot[:, :, None])[:, None]


def decode_logits(model, tokens, lengths, groups, spans, cache):
    """One decode step of every row: tokens [B, 1] at slot and position lengths[b]; row group g
    (consecutive rows (r0, r1)) attends to the cache's first spans[g] slots — or, with `spans`
    empty, each row to its own slots through the model's prefix kernel. Returns [B, V]."""
    here = lengths[:, None]
    if not spans:
        return model(tokens, here, here, Prefix.causal_decode(lengths), cache)[0][:, -1]
    masks = tuple(make_causal_mask(lengths[r0:r1], 1, S) for (r0, r1), S in zip(groups, spans))
    return model(tokens, here, here, masks if len(masks) > 1 else masks[0], cache)[0][:, -1]


SPAN_QUANTUM = 256  # decode attends to the cache's first k*256 slots, not all of them
ROW_GROUP = 128  # rows of a length-sorted batch that prefill together and share a span


def row_groups(batch: int, size: int = ROW_GROUP) -> list[tuple[int, int]]:
    """Consecutive (first, end) row ranges of at most `size` rows covering the batch."""
    return [(r, min(batch, r + size)) for r in range(0, batch, size)]


def decode_spans(model, longest: list[int], cache_len: int) -> tuple[int, ...]:
    """The attention span of each row group whose longest row uses `longest[g]` slots; none (one
    graph for a whole run) when the model's prefix kernel reads each row's own length."""
    if model.prefix_kernel:
        return ()
    return tuple(attention_span(w, cache_len) for w in longest)


def attention_span(slots_in_use: int, cache_len: int) -> int:
    """Cache slots a decode step attends to: the slots in use rounded up to SPAN_QUANTUM, so a
    long cache costs only what is written of it and a few spans (graphs) cover a whole run."""
    return min(cache_len, -(-slots_in_use // SPAN_QUANTUM) * SPAN_QUANTUM)


class DoneWatch:
    """Whether every row has ended, as the host can learn it without stalling the stream. On CUDA
    each step's `done` is copied to pinned memory behind the step, and the host reads the copy
    of the step `lag` back while the next one is queued: a run ends at most `lag` steps past its
    last row's eos. (A sync every 16 steps ran up to 16 past it and idled the GPU at each check.)
    On the CPU every step reads `done` itself: nothing is queued there."""

    def __init__(self, done: torch.Tensor, lag: int = 2):
        self.done, self.lag = done, lag
        self.copies = PinnedCopies(done, lag + 1) if done.device.type == "cuda" else None

    def queued(self) -> None:
        """Call after queueing each step (and once after the prefill)."""
        if self.copies is not None:
            self.copies.push(self.done)

    def all_done(self) -> bool:
        if self.copies is None:
            return bool(self.done.all())
        return len(self.copies) >= self.lag and bool(self.copies.pop().all())


def finish_step(logits, eos, new, col, done, tokens, lengths) -> None:
    """A greedy decode step's bookkeeping, in place: its argmax into column `col` of `new` and
    into `tokens`, rows that wrote an eos marked `done`, lengths and col advanced. Compiled
    (CUDA graphs, batch 1), its six small kernels become one or two. Batched it stays eager:
    at 1,024 rows the compiled form decoded no faster (1,498 against 1,509 ms, random weights,
    H200, bf16) and cost a compile per batch shape."""
    t = logits.argmax(dim=-1)
    new.index_copy_(1, col, t[:, None])
    done.logical_or_((t[:, None] == eos).any(-1))  # not isin: it may sort (and sync) for long eos lists
    tokens.copy_(t[:, None])
    lengths.add_(1)
    col.add_(1)


finish_step_compiled = torch.compile(finish_step, fullgraph=True)


class SpanSteps:
    """A decode step per tuple of attention spans (decode_spans), each captured as a CUDA graph
    on first use when `graphs`. `step(spans)` reads and writes only static buffers; those it
    changes (`state`) are put back after each capture's runs to what they held when it began."""

    def __init__(self, step, state: tuple[torch.Tensor, ...], graphs: bool):
        self.step, self.state, self.graphs, self.by_span = step, state, graphs, {}

    def get(self, spans: tuple[int, ...]):
        if spans not in self.by_span:
            run = functools.partial(self.step, spans)
            if self.graphs:
                snapshot = [b.clone() for b in self.state]

                def reset():
                    for b, v in zip(self.state, snapshot):
                        b.copy_(v)
                # After the first capture one warm-up run suffices (it compiles a new shape, if
                # any): at 1,024 rows each run is a full decode step, and a run meets up to ~16
                # span tuples.
                run = capture_cuda_graph(run, reset, 1 if self.by_span else 3)
            self.by_span[spans] = run
        return self.by_span[spans]

    def __enter__(self) -> "SpanSteps":
        return self

    def __exit__(self, *exc) -> None:
        """Drop the captured steps, also when decoding raised. They hold `step`'s owner, which
        holds this object: a cycle that would keep the owner's KV cache (tens of GB at 1,024
        rows) until a gc pass, so the next batch's cache would be allocated beside it."""
        self.step, self.by_span = None, {}


# --------------------------------------------------------------------------- generation
def right_padded(rows: list[list[int]]) -> torch.Tensor:
    """[len(rows), longest] long on the CPU: each row, then zeros."""
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
    return ids


@dataclass
class SortedBatch:
    """A batch's rows sorted by prompt length, in groups of neighbours: each group prefills
    padded to its own longest prompt and decodes over its own span, so one long prompt does not
    make the whole batch compute and read its length. Sorted row r is prompts[order[r]]."""

    order: list[int]
    lens: list[int]  # prompt lengths, sorted
    groups: list[tuple[int, int]]  # (first, end) sorted rows
    longest: list[int]  # each group's longest prompt (its last row)

    @classmethod
    def of(cls, prompts: list[list[int]], row_group: int | None) -> "SortedBatch":
        """`row_group` None: one group (a model that takes no per-group masks)."""
        order = sorted(range(len(prompts)), key=lambda b: len(prompts[b]))
        lens = [len(prompts[b]) for b in order]
        groups = row_groups(len(prompts), row_group) if row_group else [(0, len(prompts))]
        return cls(order, lens, groups, [lens[r1 - 1] for _, r1 in groups])

    def unsort(self, rows: list) -> list:
        out = [None] * len(rows)
        for r, b in enumerate(self.order):
            out[b] = rows[r]
        return out


class Decode:
    """generate_ar's decode steps over static buffers. Greedy, a step also takes its argmax,
    records it in column `col` of `new`, marks rows that ended and advances the row lengths:
    one graph replay a step and no other launch. Sampling (a host-side generator) stays outside
    it. A group's longest row is known on the host at every step (each row advances one slot a
    step), so choosing a step's spans needs no sync."""

    def __init__(self, model, cache, batch: SortedBatch, first, lengths, eos, params, graphs: bool):
        B, device = len(batch.order), first.device
        self.model, self.cache, self.batch, self.eos = model, cache, batch, eos
        self.greedy = params.temperature == 0
        self.finish = finish_step_compiled if graphs and B == 1 else finish_step
        self.tokens, self.lengths = first[:, None].clone(), lengths
        self.col = torch.ones(1, dtype=torch.long, device=device)
        self.new = torch.zeros(B, params.max_new_tokens + 1, dtype=torch.long, device=device)  # + a column capture may write
        self.new[:, 0] = first
        self.done = (first[:, None] == eos).any(-1)
        self.steps = SpanSteps(self.step, (self.tokens, self.lengths, self.done, self.col), graphs)

    def spans_at(self, step: int) -> tuple[int, ...]:
        return decode_spans(self.model, [w + step + 1 for w in self.batch.longest], self.cache.max_len)

    def step(self, spans: tuple[int, ...]):
        """One decode step whose group g attends to its first spans[g] slots: the logits when
        sampling, else nothing (finish_step has recorded the argmax)."""
        logits = decode_logits(self.model, self.tokens, self.lengths, self.batch.groups, spans, self.cache)
        if not self.greedy:
            return logits
        self.finish(logits, self.eos, self.new, self.col, self.done, self.tokens, self.lengths)
        return None

    def run(self, params: SamplingParams, gen) -> int:
        """Decode until every row has ended (as the host learns it, up to two steps late: see
        DoneWatch) or max_new_tokens; returns the steps run."""
        steps, watch = 0, DoneWatch(self.done)
        watch.queued()  # the prefill's token may be an eos
        while steps < params.max_new_tokens - 1 and not watch.all_done():
            logits = self.steps.get(self.spans_at(steps))()
            if not self.greedy:
                tok = sample_token(logits, params, gen)
                self.new[:, steps + 1] = tok
                self.done |= (tok[:, None] == self.eos).any(-1)
                self.tokens.copy_(tok[:, None])
                self.lengths.add_(1)
            watch.queued()
            steps += 1
        return steps


def ar_cache(model, prompts: list[list[int]], max_new_tokens: int, cache_len: int | None, resident):
    """The cache a generate_ar batch decodes in: the resident's, or a new one of `cache_len`
    slots, by default the longest prompt + max_new_tokens rounded up to 64 (SDPA's mask aligned)."""
    if resident is not None and len(prompts) != 1:
        raise FledgeError(f"generate_ar: a resident target serves batch 1, not {len(prompts)}")
    need = max(map(len, prompts)) + max_new_tokens
    cache_len = resident.max_len if resident is not None else cache_len or -(-need // 64) * 64
    if cache_len < need:
        raise FledgeError(f"cache_len {cache_len} < longest prompt + max_new_tokens = {need}")
    return resident.cache if resident is not None else model.new_cache(len(prompts), cache_len)


def prefill_groups(model, batch: SortedBatch, ids, lengths, cache):
    """Each row group's prefill, padded to its own longest prompt: logits [B, 1, V] at each
    row's last token."""
    return torch.cat([model.prefill(ids[r0:r1, :w], cache, logits_idx=(lengths[r0:r1] - 1)[:, None], rows=(r0, r1))[0]
                      for (r0, r1), w in zip(batch.groups, batch.longest)])


@torch.no_grad()
def generate_ar(model, prompts: list[list[int]], params: SamplingParams, eos_ids, cache_len=None,
                use_cuda_graph=True, row_group: int = ROW_GROUP, resident=None):
    """Generate for a batch of prompts. Returns (per-row new tokens, each ending at its first eos
    (included, as HF does) or at max_new_tokens; stats dict).

    The host learns that every row has ended up to two steps late (DoneWatch): those steps'
    tokens are discarded, their time counted.
    `row_group`: rows per group of the length-sorted batch (SortedBatch).
    `resident`: an engine.resident.Resident of `model` (batch 1): its cache and captured prefill.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise FledgeError("generate_ar: every prompt needs at least one token")
    device = next(model.parameters()).device
    cache = ar_cache(model, prompts, params.max_new_tokens, cache_len, resident)
    gen = torch.Generator(device=device).manual_seed(params.seed)
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
    batch = SortedBatch.of(prompts, row_group if model.row_groups_ok else None)

    t0 = now(device)
    ids, lengths = right_padded([prompts[b] for b in batch.order]).to(device), torch.tensor(batch.lens, device=device)
    logits = resident.prefill(ids)[0] if resident is not None else prefill_groups(model, batch, ids, lengths, cache)
    first = sample_token(logits[:, 0], params, gen)
    t1 = now(device)
    graphs = use_cuda_graph and device.type == "cuda" and model.cuda_graph_ok
    decode = Decode(model, cache, batch, first, lengths, eos, params, graphs)
    with decode.steps:
        for spans in dict.fromkeys(decode.spans_at(s) for s in range(params.max_new_tokens)):
            decode.steps.get(spans)  # every capture before the clock: none is decode time
        t2 = now(device)
        steps = decode.run(params, gen)
        t3 = now(device)
        spans = sorted(decode.steps.by_span)

    rows = batch.unsort([cut_at_eos(r, eos_ids) for r in decode.new[:, :steps + 1].tolist()])
    n_new, B = sum(len(r) for r in rows), len(prompts)
    return rows, {
        "batch": B, "prompt_tokens": sum(batch.lens), "generated_tokens": n_new, "decode_steps": steps,
        "prefill_ms": 1e3 * (t1 - t0), "capture_ms": 1e3 * (t2 - t1), "decode_ms": 1e3 * (t3 - t2),
        "row_groups": len(batch.groups),
        "spans": spans,  # per-group attention spans captured (each a CUDA graph on the GPU)
        "tok_s": n_new / max(t3 - t2 + t1 - t0, 1e-9),
        "decode_tok_s": B * steps / max(t3 - t2, 1e-9),  # all rows' decode steps, incl. finished rows
    }


def cut_at_eos(row: list[int], eos_ids) -> list[int]:
    """The row up to and including its first end-of-turn token (HF's cut; the whole row if none)."""
    eos_ids = set(eos_ids)
    for i, t in enumerate(row):
        if t in eos_ids:
            return row[:i + 1]
    return row
