"""Sampling parameters and the one sampler every decoding path uses (greedy at temperature 0)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fledge.core.config import check_number


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0

    def __post_init__(self):
        check_number("--temperature", float(self.temperature), 0)
        check_number("--top-p", float(self.top_p), 0, 1, low_open=True)
        check_number("--max-new-tokens", self.max_new_tokens, 1, integer=True)
        check_number("--seed", self.seed, -2**63, integer=True)


def logits_to_probs(logits, params: SamplingParams):
    """The sampling distribution [..., V] (fp32): softmax(logits / T), restricted to the nucleus
    — the smallest set of most likely tokens whose mass reaches top_p — and renormalised.
    Speculative decoding's accept/reject uses this same distribution."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1:
        p, order = probs.sort(dim=-1, descending=True)
        # A token stays if the mass strictly before it is < top_p (so the top token always stays).
        p = p.masked_fill(p.cumsum(-1) - p >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_token(logits, params: SamplingParams, generator) -> torch.Tensor:
    """logits [..., V] → token ids [...] (long). Greedy when temperature == 0."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    probs = logits_to_probs(logits, params)
    flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
    return flat.view(probs.shape[:-1])
