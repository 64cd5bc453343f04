"""The drafter's configuration: derived from a target's config, saved as serving JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from fledge.conventions import default_aux_layer_ids, validate_aux_layer_ids
from fledge.util import FledgeError


@dataclass
class DraftConfig:
    """One Llama decoder layer reading 3 target hidden states. Field names follow the
    `LlamaForCausalLMEagle3` config.json that SGLang and vLLM read.

    `aux_layer_ids` are canonical (vLLM) ids: see `fledge.conventions`.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocab
    draft_vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    aux_layer_ids: tuple[int, int, int]
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"
    extra: dict[str, Any] = field(default_factory=dict)  # target fields carried verbatim

    def __post_init__(self):
        self.aux_layer_ids = validate_aux_layer_ids(self.aux_layer_ids, self.target_num_layers)
        if self.hidden_size != self.target_hidden_size:
            # EAGLE-3 reuses the target's embeddings, so the draft width must match.
            raise FledgeError(f"draft hidden_size {self.hidden_size} != target hidden size {self.target_hidden_size}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise FledgeError(f"draft_vocab_size {self.draft_vocab_size} must be in [1, {self.vocab_size}]")
        if self.num_attention_heads % self.num_key_value_heads:
            raise FledgeError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise FledgeError(f"hidden_act {self.hidden_act!r}: the EAGLE-3 midlayer is a SiLU Llama layer")

    @classmethod
    def from_target(cls, tcfg, draft_vocab_size: int | None = None, aux_layer_ids=None,
                    intermediate_size: int | None = None) -> "DraftConfig":
        """Build the draft config from an HF target config (any family: only the text
        fields every causal LM has are read; attention geometry follows the target so the
        draft layer costs what one target layer costs)."""
        tcfg = getattr(tcfg, "text_config", None) or tcfg
        n = tcfg.num_hidden_layers
        h = tcfg.hidden_size
        heads = tcfg.num_attention_heads
        # transformers 5 keeps rope in `rope_parameters` (older: rope_theta + rope_scaling).
        rp = dict(getattr(tcfg, "rope_parameters", None) or getattr(tcfg, "rope_scaling", None) or {})
        rope_theta = rp.pop("rope_theta", None) or getattr(tcfg, "rope_theta", None) or 10000.0
        rope_type = rp.get("rope_type", rp.get("type", "default"))
        rope_scaling = rp if rope_type != "default" else None
        return cls(
            hidden_size=h,
            intermediate_size=intermediate_size or getattr(tcfg, "intermediate_size", 4 * h),
            num_attention_heads=heads,
            num_key_value_heads=getattr(tcfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(tcfg, "head_dim", None) or h // heads,
            vocab_size=tcfg.vocab_size,
            draft_vocab_size=draft_vocab_size or tcfg.vocab_size,
            target_hidden_size=h,
            target_num_layers=n,
            aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(n),
            max_position_embeddings=tcfg.max_position_embeddings,
            rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
        )

    def replace(self, **kw) -> "DraftConfig":
        return dataclasses.replace(self, **kw)
