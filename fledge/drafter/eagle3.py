"""The EAGLE-3 drafter: a Llama decoder layer over [embedding ; fused target states], and
optionally more plain layers after it.

Parameter names are exactly the served checkpoint's (`LlamaForCausalLMEagle3` in SGLang and
vLLM), so `state_dict()` is the export and no key mapping exists anywhere (`fledge.drafter.layout`
lists the same names and shapes for readers that load no torch; a test holds the two equal).

One draft step, for a token x_t at position t:
    h      = fc(cat[aux_low, aux_mid, aux_high])    (first step; later steps reuse the draft's own h)
    a      = cat[input_layernorm(embed(x_t)), hidden_norm(h)]          2H wide
    h'     = h + o_proj(attention(q/k/v_proj(a)))
    out    = h' + mlp(post_attention_layernorm(h'))   → fed to the next step as its h
    logits = lm_head(norm(out))                        over the draft vocab
A drafter of `num_hidden_layers` N > 1 (published P-EAGLE drafters have four) runs N-1 more
layers `layers.1` .. `layers.{N-1}` on `out` before the head, each the pre-norm Llama layer
    x' = x + o_proj(attention(q/k/v_proj(input_layernorm(x)))),  x'' = x' + mlp(post_attention_layernorm(x'))
with its own keys and values: what vLLM's `LlamaForCausalLMEagle3` computes (its layer 0 is
`midlayer`). SGLang builds the extra layers differently (`fledge.doctor` says how).
EAGLE-3.1 (arXiv 2605.09992, "attention drift") changes two lines, each behind a config.json
flag that SGLang and vLLM read under the same name:
    fc_norm      each aux state through its own RMSNorm (`fc_norm.{0,1,2}`) before fc, so the
                 high layers' larger states do not swamp the low one's;
    norm_output  the next step reads norm(out), the state lm_head reads, instead of out, so the
                 residual stream's scale cannot grow from step to step.
A step (`step`) takes the caller's attention as a function, so that training (keys concatenated
across unrolled steps) and the engine (keys in a static cache) share every weight-touching line.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from fledge.core.config import DraftConfig
from fledge.core.conventions import (
    d2t_from_target_ids,
    rope_fields,
    t2d_from_target_ids,
)
from fledge.core.errors import FledgeError


def rope_config(cfg: DraftConfig) -> transformers.LlamaConfig:
    """An HF LlamaConfig carrying only what rotary embeddings read, so the draft's RoPE
    (including llama3/yarn scaling) is HF's own code, not a re-derivation."""
    theta, scaling = rope_fields({"rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling})
    rope = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    return transformers.LlamaConfig(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rope_parameters=rope)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig, width: int):
        super().__init__()
        h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = nn.Linear(width, q, bias=False)
        self.k_proj = nn.Linear(width, kv, bias=False)
        self.v_proj = nn.Linear(width, kv, bias=False)
        self.o_proj = nn.Linear(q, h, bias=False)


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """The first layer (`first`: attention over [embedding ; hidden], 2H wide, with `hidden_norm`)
    or a further one (a plain Llama layer, H wide)."""

    def __init__(self, cfg: DraftConfig, first: bool = True):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps) if first else None
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, 2 * h if first else h)
        self.mlp = DraftMLP(cfg)


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen (EAGLE-3 recipe)
        self.fc_norm = self.aux_norms() if cfg.fc_norm else None
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.midlayer = DraftLayer(cfg)
        self.layers = nn.ModuleDict({str(i): DraftLayer(cfg, first=False) for i in range(1, cfg.num_hidden_layers)})
        self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(rope_config(cfg))  # inv_freq is a non-persistent buffer
        # Until a vocabulary is built, the draft vocab is the first N target ids.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", t2d_from_target_ids(torch.arange(cfg.draft_vocab_size), cfg.vocab_size))
        # P-EAGLE: what a mask slot reads in place of the target's aux states (vLLM's shape)
        self.register_parameter("mask_hidden", nn.Parameter(torch.randn(1, 3 * cfg.target_hidden_size) * 0.02)
                                if cfg.parallel else None)

    def aux_norms(self) -> nn.ModuleList:
        return nn.ModuleList(LlamaRMSNorm(self.cfg.target_hidden_size, eps=self.cfg.rms_norm_eps) for _ in range(3))

    @classmethod
    def from_target(cls, cfg: DraftConfig, target_model, target_ids: torch.Tensor | None = None) -> "Eagle3Draft":
        """A fresh drafter with the target's input embeddings."""
        draft = cls(cfg)
        draft.take_embeddings(target_model)
        if target_ids is not None:
            draft.set_vocab(target_ids)
        return draft

    @torch.no_grad()
    def take_embeddings(self, target_model) -> None:
        """Copy in the target's input embeddings (the drafter reads them, frozen, as the target does)."""
        emb, mine = target_model.get_input_embeddings().weight, self.embed_tokens.weight
        if emb.shape != mine.shape:
            raise FledgeError(f"target embeddings {list(emb.shape)} do not fit the drafter {list(mine.shape)}")
        mine.copy_(emb.float())

    @torch.no_grad()
    def init_head_from(self, target_model) -> None:
        """Start the output side where the target's is: `lm_head` = the target's output rows of
        the draft vocab, `norm` = its final norm, so that a draft landing on the target's final
        hidden state of the next position predicts as the target does. The target must be a
        Llama-family HF model, its decoder's final norm at `.norm.weight` (a FledgeError
        otherwise). That norm is copied only where it is a plain weighted RMSNorm, or
        1 + weight (Gemma), checked numerically; other norms keep the ones of a fresh draft.
        Not the default: a random draft state through a copied head gives confident wrong
        logits at first (on SmolLM2, CPU, 400 answers: soft CE 12.9 against 7.6 over the first
        10 steps), which the draft must unlearn.
        """
        try:
            norm = target_model.get_decoder().norm
            w = norm.weight
        except AttributeError:
            raise FledgeError(f"the drafter's head starts from the target's, but {type(target_model).__name__} "
                              "has no final norm at get_decoder().norm.weight (Llama-family models do)") from None
        if w.shape != self.norm.weight.shape:
            raise FledgeError(f"the target's final norm {list(w.shape)} does not fit the drafter's "
                              f"{list(self.norm.weight.shape)}")
        head = target_model.get_output_embeddings().weight
        self.lm_head.weight.copy_(head[self.target_ids().to(head.device)].float())
        x = torch.randn(4, w.numel(), generator=torch.Generator().manual_seed(0))
        ref = norm(x.to(w)).float().cpu()
        plain = LlamaRMSNorm(w.numel(), eps=self.cfg.rms_norm_eps)
        for cand in (w.detach().float().cpu(), 1 + w.detach().float().cpu()):
            plain.weight.copy_(cand)
            if (plain(x) - ref).norm() <= 1e-2 * ref.norm():  # bf16 targets round at ~4e-3
                self.norm.weight.copy_(cand)
                return

    @torch.no_grad()
    def widen_mlp(self, size: int, seed: int = 0) -> None:
        """Grow every layer's MLP to `size` hidden units without changing what the draft computes:
        the new gate/up rows start as nn.Linear's default init, the new down_proj columns at zero,
        so each new unit adds nothing until training moves it (a warm start gains capacity without
        first losing what it learned)."""
        old = self.cfg.intermediate_size
        if size < old:
            raise FledgeError(f"the drafter's MLP has {old} units; it can be widened, not narrowed to {size}")
        g = torch.Generator().manual_seed(seed)
        bound = self.cfg.hidden_size ** -0.5
        for mlp in (layer.mlp for layer in self.stack()):
            grown = {}
            for lin in (mlp.gate_proj, mlp.up_proj):
                extra = (torch.rand(size - old, lin.in_features, generator=g) * 2 - 1) * bound
                grown[lin] = torch.cat([lin.weight, extra.to(lin.weight)], 0)
            w = mlp.down_proj.weight
            grown[mlp.down_proj] = torch.cat([w, w.new_zeros(w.shape[0], size - old)], 1)
            for lin, weight in grown.items():
                lin.weight = nn.Parameter(weight, requires_grad=lin.weight.requires_grad)
                lin.in_features, lin.out_features = weight.shape[1], weight.shape[0]
        self.cfg = self.cfg.replace(intermediate_size=size)

    @torch.no_grad()
    def add_layers(self, n: int, seed: int = 0) -> None:
        """Grow to `n` layers without changing what the draft computes: each new layer starts as
        nn.Linear's default init with its o_proj and down_proj at zero, so it adds nothing to the
        residual stream until training moves it (a warm start from a one-layer drafter)."""
        have = self.cfg.num_hidden_layers
        if n < have:
            raise FledgeError(f"the drafter has {have} layers; layers can be added, not removed to {n}")
        w = self.fc.weight
        self.cfg = self.cfg.replace(num_hidden_layers=n)
        with torch.random.fork_rng(devices=[]):  # the caller's RNG stream stays where it was
            torch.manual_seed(seed)
            for i in range(have, n):
                layer = DraftLayer(self.cfg, first=False).to(device=w.device, dtype=w.dtype)
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
                self.layers[str(i)] = layer

    @torch.no_grad()
    def add_fc_norm(self, scales) -> None:
        """Give a drafter trained without fc_norm its per-aux norms, weights set to `scales`
        (each aux state's typical RMS, [3]): fc then sees every state at its usual scale, so the
        first step of a token whose states have those RMS computes what it did before, and a
        warm start keeps most of what it learned."""
        if self.fc_norm is not None:
            raise FledgeError("the drafter already has fc_norm")
        w = self.fc.weight
        self.cfg = self.cfg.replace(fc_norm=True)
        self.fc_norm = self.aux_norms().to(device=w.device, dtype=w.dtype)
        for norm, scale in zip(self.fc_norm, torch.as_tensor(scales).tolist(), strict=True):
            norm.weight.fill_(scale)

    @torch.no_grad()
    def add_mask_slots(self, ptd_token_id: int) -> None:
        """Make a sequential drafter a P-EAGLE one: its first draft stays what it was, later
        drafts come from mask slots of `ptd_token_id` and a fresh `mask_hidden`, to be trained."""
        if self.cfg.parallel:
            raise FledgeError("the drafter already drafts in parallel")
        w = self.fc.weight
        self.cfg = self.cfg.replace(ptd_token_id=ptd_token_id)
        self.mask_hidden = nn.Parameter(torch.randn(1, w.shape[1], device=w.device, dtype=w.dtype) * 0.02)

    @torch.no_grad()
    def change_vocab(self, target_ids: torch.Tensor, target_model) -> dict:
        """Move to another draft vocabulary (ascending target ids): a token both vocabularies
        hold keeps its trained lm_head row; a new token's row is the target's output row for
        it mapped into the draft's head space by the one linear map that best carries the
        target's rows of the shared tokens onto the draft's (least squares), so new tokens
        start where the trained head would likely have put them, not at random. Returns the
        counts of tokens kept, added and dropped."""
        old_ids, new_ids = self.target_ids().cpu(), target_ids.to(torch.int64).cpu()
        slot = torch.full((self.cfg.vocab_size,), -1, dtype=torch.int64)
        slot[old_ids] = torch.arange(old_ids.numel())
        at = slot[new_ids]
        kept = at >= 0
        if not kept.any():
            raise FledgeError("the new draft vocabulary shares no token with the drafter's: nothing to carry over")
        head = self.lm_head.weight
        theirs = target_model.get_output_embeddings().weight.detach().cpu().double()
        mine = head.detach().cpu().double()
        fit = torch.linalg.lstsq(theirs[new_ids[kept]], mine[at[kept]]).solution  # [H_target, H]
        rows = (theirs[new_ids] @ fit).to(head)
        rows[kept] = head[at[kept].to(head.device)]
        self.lm_head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=head.device, dtype=head.dtype)
        self.lm_head.weight.copy_(rows)
        self.lm_head.weight.requires_grad_(head.requires_grad)
        self.cfg = self.cfg.replace(draft_vocab_size=new_ids.numel())
        self.d2t = torch.zeros(new_ids.numel(), dtype=torch.int64, device=self.d2t.device)
        self.set_vocab(new_ids)
        return {"kept": int(kept.sum()), "added": int((~kept).sum()), "dropped": old_ids.numel() - int(kept.sum())}

    def cast(self, device, dtype) -> "Eagle3Draft":
        """Weights to `dtype` on `device`, RoPE frequencies kept fp32 as HF models keep them
        (bf16 frequencies shift the angles at long positions)."""
        inv_freq = self.rotary.inv_freq.float()
        self.to(device=device, dtype=dtype)
        self.rotary.inv_freq = inv_freq.to(device)
        return self

    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """Install the draft vocabulary given as ascending target ids (conventions.py owns the encoding)."""
        self.d2t.copy_(d2t_from_target_ids(target_ids, self.cfg.vocab_size))
        self.t2d.copy_(t2d_from_target_ids(target_ids, self.cfg.vocab_size))

    def target_ids(self) -> torch.Tensor:
        """Target token id of every draft id: i + d2t[i]."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def mask_slots(self, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """P-EAGLE's mask slots, (ids [b,t], aux-wide hidden [b,t,3H]): the token `ptd_token_id`
        and `mask_hidden`, which `step` fuses through fc as it fuses the target's aux states."""
        w = self.mask_hidden
        ids = torch.full((b, t), self.cfg.ptd_token_id, dtype=torch.long, device=w.device)
        return ids, w.expand(b, t, w.shape[-1])

    # ---------------------------------------------------------------- one draft step
    def stack(self) -> list[DraftLayer]:
        """The layers in order: `midlayer`, then `layers.1` ..."""
        return [self.midlayer, *self.layers.values()]

    def fuse(self, aux):
        """The first step's h from the target's aux states [..., 3 x target hidden]."""
        if self.fc_norm is not None:
            aux = torch.cat([norm(x) for norm, x in zip(self.fc_norm, aux.chunk(3, -1))], -1)
        return self.fc(aux)

    def step(self, input_ids, hidden, positions, attend):
        """One draft step of T tokens through every layer. `hidden` is [B,T,3H] target aux states
        (fused here by fc) or [B,T,H] the draft's own previous output. `attend(i, q, k, v)` is the
        caller's attention for layer i: it keeps this step's keys/values (k, v [B,kv_heads,T,hd],
        already rotated) with those it holds and returns the attention of q [B,heads,T,hd] over
        them, [B,heads,T,hd]. Returns the output [B,T,H] the next step reads as its hidden state:
        pre-norm, or with `norm_output` already through `norm`."""
        if hidden.shape[-1] != self.cfg.hidden_size:
            hidden = self.fuse(hidden)
        first = self.midlayer
        x = torch.cat([first.input_layernorm(self.embed_tokens(input_ids).to(hidden.dtype)),
                       first.hidden_norm(hidden)], dim=-1)
        cos, sin = self.rotary(hidden, positions)
        stream = hidden
        for i, layer in enumerate(self.stack()):
            if i:
                x = layer.input_layernorm(stream)
            attn, hd = layer.self_attn, self.cfg.head_dim
            b, t, _ = x.shape
            q = attn.q_proj(x).view(b, t, -1, hd).transpose(1, 2)
            k = attn.k_proj(x).view(b, t, -1, hd).transpose(1, 2)
            v = attn.v_proj(x).view(b, t, -1, hd).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            o = attend(i, q, k, v)
            h = stream + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            stream = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(stream) if self.cfg.norm_output else stream

    def sdpa(self, q, keys, values, mask):
        """Attention of q over `keys`/`values` ([B,kv_heads,S,hd]) under the bool `mask`
        ([B,1,T,S], True = may attend)."""
        rep = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        return F.scaled_dot_product_attention(q, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1),
                                              attn_mask=mask)

    def logits(self, out):
        """Draft-vocab logits from a step's output (map to target ids with `target_ids()`)."""
        return self.lm_head(out if self.cfg.norm_output else self.norm(out))

    def forward(self, input_ids, hidden, positions, mask, past_kv=None):
        """One step over T tokens with keys = past keys + these. Returns (out, kv) where kv holds
        each layer's (k, v) of this step only, for the caller to keep."""
        new = []

        def attend(i, q, k, v):
            new.append((k, v))
            if past_kv is not None:
                k, v = torch.cat([past_kv[i][0], k], 2), torch.cat([past_kv[i][1], v], 2)
            return self.sdpa(q, k, v, mask)

        return self.step(input_ids, hidden, positions, attend), new
