"""The engine's two contracts: what a target model and a drafter must offer a speculative round.

A new target family or drafter kind implements one of these; `rounds` and `spec` use nothing
else of them. The class attributes are capabilities, read where the engine picks a path (CUDA
graphs, grouped prefill, the prefix kernel), never probed for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from fledge.core.shape import Shape
from fledge.engine.tree import Tree


@dataclass
class DraftInput:
    """What a drafter sees at the start of a round."""

    root: torch.Tensor  # [B] the next tree root (last sampled token, not yet in the target cache)
    cache_len: torch.Tensor  # [B] tokens in the target cache = the root's position
    context: list[list[int]]  # host copy of every token so far, root included


class EngineTarget(Protocol):
    """The verifier: a causal LM over a static KV cache (`engine.model.Transformer`, or any HF
    model behind `engine.hf.HFTarget`)."""

    compact: bool  # built from ModelArgs with static caches: a resident prefill can hold it
    cuda_graph_ok: bool  # forward has static shapes and no host syncs
    row_groups_ok: bool  # forward takes per-group masks and prefill a row range
    prefix_kernel: bool  # a `Prefix` mask runs the prefix kernel rather than a dense mask

    def dims(self) -> tuple[int, int, int]:
        """(hidden size, vocab size, layers)."""

    def new_cache(self, batch: int, max_len: int): ...

    def prefill(self, input_ids, cache, aux_ids=None, logits_idx=None, rows=None):
        """A fresh right-padded batch at positions 0..T-1: (logits, aux states or None)."""

    def forward(self, input_ids, positions, slots, mask, cache, aux_ids=None, logits_idx=None):
        """New tokens at `slots` of `cache`: (logits, the aux states at `aux_ids` or None)."""


class Drafter(Protocol):
    """Proposes a tree of exactly `spec.num_draft_tokens` nodes per round, so the verify step
    always has one shape.

    `start(batch, max_len)` is called once per request, before the prefill. `observe` is told
    every token that entered the target cache (the prompt after prefill, the accepted path after
    each verify step) with the target's aux hidden states for them, and the token that comes
    next (the next tree root). `propose` returns the round's tree.
    """

    spec: Shape
    aux_ids: tuple[int, ...] | None  # the target layers observe wants (None: no hidden states)
    vocab: frozenset[int] | None  # target ids it can propose (None: any)
    device_only: bool  # reads nothing from the host context: propose/observe run in a round's CUDA graph

    def buffers(self) -> tuple:
        """The device tensors a captured round reads (only for a `device_only` drafter)."""

    def start(self, batch: int, max_len: int) -> None: ...

    def observe(self, tokens, aux, n, next_token, start) -> None: ...

    def propose(self, inp: DraftInput) -> Tree: ...
