"""fledge's engine: the lab bench that runs a target (and later a drafter) exactly.

model.py: the target (compact Transformer or HFTarget) with an explicit, CUDA-graph-friendly
forward; generate.py: autoregressive baseline, sampling, masks, CUDA-graph capture.
"""

from fledge.engine.generate import (SamplingParams, capture_cuda_graph, generate_ar, logits_to_probs,
                                    make_causal_mask, prefix_mask, sample_token)
from fledge.engine.model import HFTarget, KVCache, ModelArgs, Transformer, build_engine_target

__all__ = ["HFTarget", "KVCache", "ModelArgs", "SamplingParams", "Transformer", "build_engine_target",
           "capture_cuda_graph", "generate_ar", "logits_to_probs", "make_causal_mask", "prefix_mask",
           "sample_token"]
