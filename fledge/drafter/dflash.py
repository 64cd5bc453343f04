"""The DFlash block drafter: one forward proposes a whole block of tokens.

A block is the last sampled token (the anchor, whose target state is not known yet) followed
by `block_size - 1` mask tokens, at consecutive positions after the verified context. The
draft is a small stack of Qwen3 decoder layers (per-head q/k RMSNorm) over the block only; the
verified context enters every layer as keys and values, projected from the target's aux
states:

    c          = hidden_norm(fc(cat[aux_1, ..., aux_n]))          one vector per context token
    layer l    keys/values = [k_norm(k_proj_l(c)), v_proj_l(c)]  (context, rotated at its positions)
                           + the block's own keys/values          (block tokens see each other both ways)
    logits     = lm_head(norm(out))  at each mask slot: the token AT that slot's position

Parameter names are those vLLM's `DFlashDraftModel` (qwen3_dflash) loads, so `state_dict()`
less `embed_tokens`/`t2d` is the export. The target's embeddings are read frozen (the mask
slots use the embedding of `mask_token_id`); the head covers a draft vocabulary mapped to
target ids by `d2t` (fledge.core.conventions), as EAGLE-3's does.

Training (fledge.train.dflash) and the engine (fledge.engine.block) share `context_kv` and
`block`: the only lines that touch weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    apply_rotary_pos_emb,
)

from fledge.core.config import DraftConfig
from fledge.core.conventions import (
    ROPE_THETA_DEFAULT,
    d2t_from_target_ids,
    t2d_from_target_ids,
)
from fledge.core.errors import FledgeError
from fledge.drafter.eagle3 import rope_config


@dataclass
class DFlashConfig:
    """A DFlash drafter's shape. `aux_layer_ids` are canonical (vLLM) ids, any number of them
    (config.json spells them DFlash's way: `conventions.aux_ids_to_dflash`). `block_size`: the
    anchor plus the masks of one block, as trained; a round may draft fewer. `mask_token_id`: the
    target token whose (frozen) embedding marks a slot to fill."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    aux_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = ROPE_THETA_DEFAULT
    rope_scaling: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # verifier, carried verbatim

    def __post_init__(self):
        ids = tuple(int(i) for i in self.aux_layer_ids)
        if not ids or list(ids) != sorted(set(ids)) or ids[0] < 1 or ids[-1] > self.target_num_layers - 1:
            raise FledgeError(f"aux layer ids {list(ids)}: strictly increasing, in [1, {self.target_num_layers - 1}]")
        self.aux_layer_ids = ids
        if self.hidden_size != self.target_hidden_size:
            raise FledgeError(f"draft hidden_size {self.hidden_size} != target hidden size {self.target_hidden_size}: "
                              "the drafter reads the target's embeddings")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise FledgeError(f"draft_vocab_size {self.draft_vocab_size} must be in [1, {self.vocab_size}]")
        if self.num_hidden_layers < 1 or self.block_size < 2:
            raise FledgeError(f"a DFlash drafter needs >= 1 layer and a block of >= 2 tokens "
                              f"(got {self.num_hidden_layers}, {self.block_size})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise FledgeError(f"mask_token_id {self.mask_token_id} outside the target vocab [0, {self.vocab_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise FledgeError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_target(cls, tcfg, *, mask_token_id: int, draft_vocab_size: int | None = None, aux_layer_ids=None,
                    num_layers: int = 2, block_size: int = 8, intermediate_size: int | None = None) -> DFlashConfig:
        """Attention geometry and widths follow the target (one draft layer costs one target
        layer); the aux ids default to EAGLE-3's, so both methods train on one feature store."""
        # the target's geometry read once, as the EAGLE-3 drafter's config reads it
        g = DraftConfig.from_target(tcfg, draft_vocab_size, None, intermediate_size)  # aux ids: any number here
        return cls(hidden_size=g.hidden_size, intermediate_size=g.intermediate_size, num_hidden_layers=num_layers,
                   num_attention_heads=g.num_attention_heads, num_key_value_heads=g.num_key_value_heads,
                   head_dim=g.head_dim, vocab_size=g.vocab_size, draft_vocab_size=g.draft_vocab_size,
                   target_hidden_size=g.target_hidden_size, target_num_layers=g.target_num_layers,
                   aux_layer_ids=tuple(aux_layer_ids or g.aux_layer_ids), block_size=block_size,
                   mask_token_id=mask_token_id,
                   max_position_embeddings=g.max_position_embeddings, rms_norm_eps=g.rms_norm_eps,
                   rope_theta=g.rope_theta, rope_scaling=g.rope_scaling)

    def replace(self, **kw) -> DFlashConfig:
        return dataclasses.replace(self, **kw)


class BlockAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = nn.Linear(h, q, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(q, h, bias=False)
        self.q_norm = Qwen3RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps)
        self.head_dim = cfg.head_dim

    def heads(self, proj, norm, x):
        """[B,T,H] → [B,heads,T,hd] through `proj` (and the per-head `norm`, if any)."""
        b, t, _ = x.shape
        y = proj(x).view(b, t, -1, self.head_dim)
        return (norm(y) if norm is not None else y).transpose(1, 2)


class BlockLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = BlockAttention(cfg)
        self.mlp = Qwen3MLP(_mlp_config(cfg))


def _mlp_config(cfg: DFlashConfig):
    from transformers import Qwen3Config
    return Qwen3Config(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, hidden_act="silu")


class DFlashDraft(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(rope_config(cfg))  # inv_freq: a non-persistent buffer
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", t2d_from_target_ids(torch.arange(cfg.draft_vocab_size), cfg.vocab_size))

    @classmethod
    def from_target(cls, cfg: DFlashConfig, target_model, target_ids: torch.Tensor | None = None) -> DFlashDraft:
        """A fresh drafter reading the target's embeddings, its head the target's output rows of
        the draft vocabulary and its final norm the target's (the masks' outputs start where
        the target's next-token states are read)."""
        draft = cls(cfg)
        with torch.no_grad():
            emb = target_model.get_input_embeddings().weight
            if emb.shape != draft.embed_tokens.weight.shape:
                raise FledgeError(f"target embeddings {list(emb.shape)} do not fit the drafter "
                                  f"{list(draft.embed_tokens.weight.shape)}")
            draft.embed_tokens.weight.copy_(emb.float())
            if target_ids is not None:
                draft.set_vocab(target_ids)
            head = target_model.get_output_embeddings().weight
            draft.lm_head.weight.copy_(head[draft.target_ids().to(head.device)].float())
        return draft

    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """Install the draft vocabulary given as ascending target ids."""
        self.d2t.copy_(d2t_from_target_ids(target_ids, self.cfg.vocab_size))
        self.t2d.copy_(t2d_from_target_ids(target_ids, self.cfg.vocab_size))

    def target_ids(self) -> torch.Tensor:
        """Target token id of every draft id: i + d2t[i]."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def cast(self, device, dtype) -> DFlashDraft:
        """Weights to `dtype` on `device`, RoPE frequencies kept fp32 (as Eagle3Draft.cast)."""
        inv_freq = self.rotary.inv_freq.float()
        self.to(device=device, dtype=dtype)
        self.rotary.inv_freq = inv_freq.to(device)
        return self

    # ---------------------------------------------------------------- the two halves of a block
    def context_kv(self, aux, positions) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values [B,kv_heads,T,hd] for context tokens with target aux
        states `aux` [B,T,n*H_target] at `positions` [B,T] (keys rotated there)."""
        c = self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))
        cos, sin = self.rotary(c, positions)
        out = []
        for layer in self.layers:
            attn = layer.self_attn
            k = attn.heads(attn.k_proj, attn.k_norm, c)
            k, _ = apply_rotary_pos_emb(k, k, cos, sin)
            out.append((k, attn.heads(attn.v_proj, None, c)))
        return out

    def block(self, ids, positions, attend) -> torch.Tensor:
        """The draft over block tokens `ids` [B,Q] at `positions` [B,Q]. `attend(l, q, k, v)`
        finishes layer l's attention: q [B,heads,Q,hd], k/v [B,kv_heads,Q,hd] the block's own
        (rotated), returning [B,heads,Q,hd] over whatever context keys the caller keeps.
        Returns the final states [B,Q,H] (`logits` reads them)."""
        x = self.embed_tokens(ids).to(self.fc.weight.dtype)
        cos, sin = self.rotary(x, positions)
        b, t, _ = x.shape
        for i, layer in enumerate(self.layers):
            attn, h = layer.self_attn, layer.input_layernorm(x)
            q, k = attn.heads(attn.q_proj, attn.q_norm, h), attn.heads(attn.k_proj, attn.k_norm, h)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            o = attend(i, q, k, attn.heads(attn.v_proj, None, h))
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def logits(self, out):
        """Draft-vocab logits from `block`'s states (map to target ids with `target_ids()`)."""
        return self.lm_head(out)


def attend_over(q, keys, values, mask):
    """Attention of q [B,heads,Q,hd] over keys/values [B,kv_heads,S,hd] under the bool `mask`
    [B,1,Q,S] (True = may attend); GQA by repeating the kv heads."""
    rep = q.shape[1] // keys.shape[1]
    return F.scaled_dot_product_attention(q, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1),
                                          attn_mask=mask)
