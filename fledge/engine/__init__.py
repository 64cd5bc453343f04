"""fledge's engine: the lab bench that runs a target and a drafter exactly.

model.py: the compact target Transformer, its layers as three compilable functions, with an
explicit, CUDA-graph-friendly forward and a flash prefill; attention.py, few_rows.py: its Triton
kernels; hf.py: a transformers model as the engine's target (the compact Transformer from its
config and weights, else HFTarget, which runs it through transformers behind the same forward);
generate.py: autoregressive baseline (length-sorted row groups, attention spans), sampling,
masks, CUDA-graph capture; stream.py: continuous batching; resident.py: a batch-1 target kept
between requests; tree.py, rounds.py: EAGLE-2 trees, verification in one forward, acceptance,
KV compaction, rounds fused into one graph; spec.py: a request's prefill and rounds;
drafters.py: EAGLE-3, oracle and n-gram behind one interface; stats.py: what every run prints.
"""

from fledge.engine.decode import generate_ar, make_causal_mask
from fledge.engine.graphs import capture_cuda_graph
from fledge.engine.hf import HFTarget, build_engine_target
from fledge.engine.model import KVCache, ModelArgs, Transformer
from fledge.engine.sampling import SamplingParams, logits_to_probs, sample_token

__all__ = ["HFTarget", "KVCache", "ModelArgs", "SamplingParams", "Transformer", "build_engine_target",
           "capture_cuda_graph", "generate_ar", "logits_to_probs", "make_causal_mask",
           "sample_token"]
