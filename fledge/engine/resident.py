"""A batch-1 target kept between requests: one KV cache that every request reuses, the
prefill captured as a CUDA graph per prompt-length bucket, and the speculative rounds last
built over that cache (engine.rounds.round_for), whose graphs the next request of the same
drafter replays.

Why: an eager prefill launches ~600 kernels from Python. On the H200 a request spent 13-26 ms on
that before its first decode step (bench/bench_engine.py's "prefill_ms_per_prompt", bf16),
a sixth of an AR request and a third of an oracle one. Compiling the prefill per bucket saved
nothing (the host work became Dynamo's); a graph replay is one call. A graph holds
its buffers' addresses, so the cache it writes must outlive the request: `Resident` owns it, and
generate_ar / generate_spec take it (`resident=`) instead of allocating one. Every bucket is
captured when the Resident is built, before any request's clock starts.

A prompt of L tokens runs in the smallest bucket of at least L tokens, padded at the end. A causal
prefill's real tokens never see the pads, and the pads' K/V land in slots >= L, which decode and
verify overwrite before any mask lets a query see them (generate_ar's padded rows rely on the
same). Slots a previous request left behind are past the new length for the same reason.
Prompts longer than the largest bucket prefill eagerly, as without a Resident.
"""

from __future__ import annotations

import torch

from fledge.core.errors import FledgeError
from fledge.engine.graphs import capture_cuda_graph

SMALLEST_BUCKET = 64


def buckets(max_len: int) -> list[int]:
    """Prefill lengths captured for a cache of `max_len` slots: 64, 128, ... up to max_len."""
    out, b = [], SMALLEST_BUCKET
    while b <= max_len:
        out.append(b)
        b *= 2
    return out


class Resident:
    """`aux_sets`: the aux-layer id tuples (None: no aux states) requests will ask the prefill
    for, each captured per bucket; asking for another is an error, not a capture inside a
    request's timed span. On the CPU, or with `use_graph` off, each bucket's prefill runs eagerly
    over the same static buffers (what the tests check)."""

    def __init__(self, model, max_len: int, aux_sets=(None,), use_graph: bool = True):
        if not model.compact:
            raise FledgeError("a resident prefill needs the compact engine (Llama, Qwen2, Qwen3), "
                              f"not {type(model).__name__}")
        dev = model.output.weight.device
        self.model, self.cache = model, model.new_cache(1, max_len)
        self.rounds = {}  # the rounds built over this cache (engine.rounds), one per kind
        self.last = torch.zeros(1, 1, dtype=torch.long, device=dev)  # the prompt's last position
        self.ids = {b: torch.zeros(1, b, dtype=torch.long, device=dev) for b in buckets(max_len)}
        graphs = use_graph and dev.type == "cuda" and model.cuda_graph_ok
        self.runs = {}
        for aux_ids in dict.fromkeys(None if a is None else tuple(a) for a in aux_sets):
            for b, ids in self.ids.items():
                def run(ids=ids, aux_ids=aux_ids):
                    return model.prefill(ids, self.cache, aux_ids=aux_ids, logits_idx=self.last)
                # Pads only: every capture runs before the first request, which rewrites its slots.
                self.runs[b, aux_ids] = capture_cuda_graph(run, warmup=2) if graphs else run

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, aux_ids=None):
        """ids [1, L] on the model's device → (logits [1, 1, V] at the last token, aux [1, L, 3H]
        or None), the prompt's K/V in cache slots [0, L). The outputs are the graph's own
        buffers: read them before the next prefill."""
        L, key = ids.shape[1], None if aux_ids is None else tuple(aux_ids)
        if L > self.max_len:
            raise FledgeError(f"prompt of {L} tokens > resident cache of {self.max_len} slots")
        fits = [b for b in self.ids if b >= L]
        if not fits:
            return self.model.prefill(ids, self.cache, aux_ids=aux_ids, logits_idx=torch.full_like(self.last, L - 1))
        if (fits[0], key) not in self.runs:
            raise FledgeError(f"resident prefill has no capture for aux ids {key}: pass them in aux_sets")
        self.ids[fits[0]][:, :L].copy_(ids)
        self.last.fill_(L - 1)
        logits, aux = self.runs[fits[0], key]()
        return logits, None if aux is None else aux[:, :L]
