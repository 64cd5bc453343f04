"""A SmolLM2-135M-shaped model with random weights, for speed measurements that need no
weights: kernel times depend on shapes, not values. Acceptance figures need the real target."""

from __future__ import annotations

import torch
import transformers

# SmolLM2-135M-Instruct's architecture (its config.json): what the timings depend on.
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu")


def smollm2_random(dtype, device, seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**SMOLLM2_135M)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype).eval()
