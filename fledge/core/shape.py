"""A speculation shape: SGLang's three knobs (steps, top-k, draft tokens), torch-free so that tune,
doctor and the launch-line lint use the engine's own class without loading torch."""

from __future__ import annotations

import json
from dataclasses import dataclass

from fledge.core.errors import FledgeError


def max_nodes(num_steps: int, topk: int) -> int:
    """The nodes of a full tree, root included: topk at depth 1, topk^2 at each depth after.

    Also SGLang's largest useful --speculative-num-draft-tokens: step 0 proposes topk children
    of the root, each later step expands the topk kept beams by topk each, and the verify set
    is the root plus the best num_draft_tokens - 1 of those candidates. A chain: steps + 1."""
    return 1 + topk + (num_steps - 1) * topk ** 2


def shape_problem(num_steps: int, topk: int, num_draft_tokens: int) -> str | None:
    """What makes (steps, topk, draft tokens) no shape SGLang would run, or None: the one place
    the bound is written, so a command can name its own flags in front of it."""
    if num_steps < 1 or topk < 1:
        return f"steps {num_steps} and topk {topk} must be >= 1"
    if topk == 1 and num_draft_tokens != num_steps + 1:
        return f"a chain (topk 1) of {num_steps} steps verifies exactly num_steps + 1 = {num_steps + 1} draft tokens"
    cap = max_nodes(num_steps, topk)
    if not 2 <= num_draft_tokens <= cap:
        return (f"a tree of {num_steps} steps, topk {topk} holds 2..{cap} draft tokens "
                "(root + topk + (steps-1)*topk^2)")
    return None


@dataclass(frozen=True)
class Shape:
    """SGLang's three knobs, the engine's and tune's speculation shape: `num_steps` draft forwards
    per round, `topk` children per expanded node, `num_draft_tokens` tree nodes verified per
    round, the root included. A chain is topk 1 with num_steps + 1 nodes."""

    num_steps: int
    topk: int
    num_draft_tokens: int

    def __post_init__(self):
        problem = shape_problem(self.num_steps, self.topk, self.num_draft_tokens)
        if problem:
            raise FledgeError(f"speculative shape {self.num_steps},{self.topk},{self.num_draft_tokens}: {problem}")

    @classmethod
    def full(cls, num_steps: int, topk: int) -> "Shape":
        return cls(num_steps, topk, max_nodes(num_steps, topk))

    @property
    def path_len(self) -> int:
        """Most nodes an accepted path holds, root included: also the most accept length one round
        can reach (its deepest draft token's depth, plus the bonus)."""
        return min(self.num_steps + 1, self.num_draft_tokens)

    @property
    def label(self) -> str:
        return f"s{self.num_steps} k{self.topk} n{self.num_draft_tokens}"

    def sglang_flags(self) -> str:
        return (f"--speculative-algorithm EAGLE3 --speculative-num-steps {self.num_steps} "
                f"--speculative-eagle-topk {self.topk} --speculative-num-draft-tokens {self.num_draft_tokens}")

    def vllm_flags(self, drafter: str) -> str | None:
        """vLLM's EAGLE-3 drafts a chain only: no flag set reproduces a topk > 1 tree."""
        if self.topk != 1:
            return None
        cfg = {"method": "eagle3", "model": drafter, "num_speculative_tokens": self.num_steps}
        return f"--speculative-config '{json.dumps(cfg)}'"


def parse_shape(text: str, flag: str) -> Shape:
    try:
        return Shape(*(int(x) for x in text.split(",")))
    except (ValueError, TypeError):
        raise FledgeError(f"{flag} {text!r}: expected STEPS,TOPK,TOKENS like '3,4,16'") from None


def parse_shapes(text: str, flag: str = "--shapes") -> list[Shape]:
    """"3,1,4;5,4,16" → [Shape(3, 1, 4), Shape(5, 4, 16)]."""
    return [parse_shape(item, flag) for item in text.split(";") if item.strip()]
