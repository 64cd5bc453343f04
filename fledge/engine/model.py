"""The target as fledge's engine runs it: one compact Transformer for the Llama family
(SmolLM2, Llama), Qwen2 (q/k/v bias) and Qwen3 (per-head q/k norm), and `HFTarget`, which runs
any other supported family through transformers behind the same forward.

The forward is explicit about everything (gpt-fast style): the caller passes rope positions,
the cache slot each new token is written to, and the attention mask over the whole static
cache. Nothing in it depends on data (no `.item()`, no data-dependent shapes), so one decode
step can be captured in a CUDA graph. Causal, padded and tree masks are all just masks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from fledge.util import FledgeError

COMPACT_FAMILIES = ("llama", "qwen2", "qwen3")
HF_FAMILIES = ("gemma3", "gemma3_text", "deepseek_v3", "kimi_k2")
# Rope types whose frequencies do not change with sequence length (dynamic/longrope do).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelArgs:
    family: str
    vocab_size: int
    dim: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_inv_freq: tuple[float, ...]  # exactly HF's fp32 inverse frequencies (scaling included)
    rope_scale: float = 1.0  # HF's `attention_scaling`: multiplies cos and sin (yarn)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise FledgeError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if 2 * len(self.rope_inv_freq) != self.head_dim:
            raise FledgeError(f"rope covers {2 * len(self.rope_inv_freq)} dims, head_dim is {self.head_dim}")

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelArgs":
        cfg = cfg.get_text_config()
        family = cfg.model_type
        if family not in COMPACT_FAMILIES:
            raise FledgeError(f"model_type {family!r} has no compact engine implementation ({', '.join(COMPACT_FAMILIES)})")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise FledgeError(f"hidden_act {cfg.hidden_act!r}: the compact engine implements SiLU MLPs only")
        if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
            raise FledgeError(f"{family}: sliding-window layers are not supported by the compact engine")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope = cfg.rope_parameters
        rope_type = rope.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise FledgeError(f"rope_type {rope_type!r}: the compact engine supports {', '.join(STATIC_ROPE_TYPES)}")
        if rope_type == "default":  # HF keeps this one on each model's rotary class; same formula
            inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scale = 1.0
        else:
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        return cls(
            family=family, vocab_size=cfg.vocab_size, dim=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, n_layers=cfg.num_hidden_layers,
            n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=head_dim, norm_eps=cfg.rms_norm_eps,
            rope_inv_freq=tuple(inv_freq.float().tolist()), rope_scale=float(scale),
            qkv_bias=bias or family == "qwen2", o_bias=bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)), qk_norm=family == "qwen3",
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        )


@dataclass
class KVCache:
    k: torch.Tensor  # [n_layers, B, n_kv_heads, max_len, head_dim]
    v: torch.Tensor

    @classmethod
    def allocate(cls, args: ModelArgs, batch: int, max_len: int, dtype, device) -> "KVCache":
        shape = (args.n_layers, batch, args.n_kv_heads, max_len, args.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))


# --------------------------------------------------------------------------- pointwise ops
# The elementwise pieces of a layer, rounded exactly as HF rounds them (bf16 greedy output then
# follows HF's token for token). A CUDA-graph decode step at batch 1 is bound by the number of
# kernels (~2 us each however small), so `Pointwise.compiled()` fuses each into one kernel.
def rms_norm(x, weight, eps: float):
    """Normalised in fp32 (rms_norm's accumulation type), rounded, then scaled in x's dtype."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def apply_rope(x, cos, sin):
    """x * cos + rotate_half(x) * sin, with `sin` signed as `Transformer.rope` returns it."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class Pointwise:
    rms_norm: Callable = rms_norm
    apply_rope: Callable = apply_rope
    silu_mul: Callable = silu_mul

    @classmethod
    def compiled(cls) -> "Pointwise":
        # Small pure functions compile quickly and stay capturable; compiling the whole step
        # was slower at batch >= 64 on an H200 (5.8 vs 2.4 ms/step at batch 64).
        return cls(*(torch.compile(f, fullgraph=True) for f in (rms_norm, apply_rope, silu_mul)))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Pointwise):
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, ops: Pointwise):
        super().__init__()
        self.a, self.ops = a, ops
        # q, k and v in one matmul: decode at batch 1 is launch-bound.
        self.wqkv = nn.Linear(a.dim, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim, bias=a.qkv_bias)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=a.o_bias)
        self.q_norm = RMSNorm(a.head_dim, a.norm_eps, ops) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.norm_eps, ops) if a.qk_norm else None

    def forward(self, x, cos, sin, cache_k, cache_v, slots, mask):
        a, (B, T, _) = self.a, x.shape
        H, Hkv, D = a.n_heads, a.n_kv_heads, a.head_dim
        qkv = self.wqkv(x)
        v = qkv[..., (H + Hkv) * D:].view(B, T, Hkv, D)
        if self.q_norm is None:
            qk = qkv[..., :(H + Hkv) * D].view(B, T, H + Hkv, D)
        else:
            q, k = qkv[..., :H * D].view(B, T, H, D), qkv[..., H * D:(H + Hkv) * D].view(B, T, Hkv, D)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        qk = self.ops.apply_rope(qk, cos, sin)  # q and k at once
        q, k, v = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), v.transpose(1, 2)
        idx = slots[:, None, :, None].expand(B, Hkv, T, D)
        cache_k.scatter_(2, idx, k)
        cache_v.scatter_(2, idx, v)
        # GQA without copying K/V: the G query heads sharing a kv head (HF maps q head h to kv
        # head h // G) become G*T query rows; `mask` is additive, its rows already repeated G times.
        q = q.reshape(B, Hkv, (H // Hkv) * T, D)
        o = F.scaled_dot_product_attention(q, cache_k, cache_v, attn_mask=mask)
        return self.wo(o.reshape(B, H, T, D).transpose(1, 2).reshape(B, T, H * D))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs, ops: Pointwise):
        super().__init__()
        self.ops = ops
        self.w13 = nn.Linear(a.dim, 2 * a.intermediate_size, bias=a.mlp_bias)  # gate and up fused
        self.w2 = nn.Linear(a.intermediate_size, a.dim, bias=a.mlp_bias)

    def forward(self, x):
        return self.w2(self.ops.silu_mul(self.w13(x)))


class Block(nn.Module):
    def __init__(self, a: ModelArgs, ops: Pointwise):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps, ops)
        self.attention = Attention(a, ops)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps, ops)
        self.feed_forward = MLP(a, ops)

    def forward(self, x, cos, sin, cache_k, cache_v, slots, mask):
        x = x + self.attention(self.attention_norm(x), cos, sin, cache_k, cache_v, slots, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    cuda_graph_ok = True  # forward has static shapes and no host syncs

    def __init__(self, args: ModelArgs, ops: Pointwise = Pointwise()):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, ops) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, ops)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Persistent so that `from_hf` loads it (fp32) with the weights; never cast it.
        self.register_buffer("inv_freq", torch.tensor(args.rope_inv_freq, dtype=torch.float32))

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        w = self.output.weight
        return KVCache.allocate(self.args, batch, max_len, w.dtype, w.device)

    def rope(self, positions, dtype):
        """cos and signed sin [B, T, 1, head_dim], in fp32 then cast, as HF's rotary embedding.
        The sin's first half is negated so that x * cos + roll(x) * sin is HF's rope."""
        freqs = positions[..., None, None].float() * self.inv_freq.float()
        cos, sin = freqs.cos() * self.args.rope_scale, freqs.sin() * self.args.rope_scale
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)

    def forward(self, input_ids, positions, slots, mask, cache: KVCache, aux_ids=None, logits_idx=None):
        """input_ids/positions/slots [B, T] long; mask [B, 1, T, max_len] bool (True = may attend).

        Returns (logits [B, T, V] fp32, aux [B, T, 3H] or None). `aux` concatenates, in the order
        given, the residual stream entering layer i for i in `aux_ids` (= HF hidden_states[i]).
        `logits_idx` [B, K] (optional) computes logits only at those T-positions: [B, K, V]
        (prefill needs one row per prompt, not T x vocab); aux is always for all T.
        """
        if aux_ids is not None and not all(0 <= i < self.args.n_layers for i in aux_ids):
            raise FledgeError(f"aux ids {list(aux_ids)} out of range [0, {self.args.n_layers})")
        x = self.tok_embeddings(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        # SDPA would turn a bool mask into an additive one in every layer: do it once here, with
        # the rows repeated once per query head sharing a kv head (see Attention: GQA).
        bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~mask, float("-inf"))
        bias = bias.repeat(1, 1, self.args.n_heads // self.args.n_kv_heads, 1)
        captured = {}
        for i, layer in enumerate(self.layers):
            if aux_ids is not None and i in aux_ids:
                captured[i] = x
            x = layer(x, cos, sin, cache.k[i], cache.v[i], slots, bias)
        if logits_idx is not None:
            x = x.gather(1, logits_idx[..., None].expand(-1, -1, x.shape[-1]))
        logits = self.output(self.norm(x)).float()
        aux = torch.cat([captured[i] for i in aux_ids], dim=-1) if aux_ids is not None else None
        return logits, aux

    @classmethod
    def from_hf(cls, hf_model, dtype, device, compile: bool = False) -> "Transformer":
        """`compile`: fuse the pointwise ops with torch.compile (CUDA; ~20% faster decode)."""
        args = ModelArgs.from_hf_config(hf_model.config)
        with torch.device("meta"):
            model = cls(args, Pointwise.compiled() if compile else Pointwise())
        model.load_state_dict(_engine_state_dict(hf_model, args, dtype, device), strict=True, assign=True)
        return model.eval()


def _engine_state_dict(hf_model, args: ModelArgs, dtype, device) -> dict[str, torch.Tensor]:
    """HF weight names → this module's (q/k/v and gate/up concatenated)."""
    src = hf_model.state_dict()

    def get(*names):
        return torch.cat([src[n] for n in names]).to(device=device, dtype=dtype)

    sd = {"tok_embeddings.weight": get("model.embed_tokens.weight"), "norm.weight": get("model.norm.weight"),
          "inv_freq": torch.tensor(args.rope_inv_freq, dtype=torch.float32, device=device)}
    # Tied: one tensor behind both parameters (load_state_dict(assign=True) keeps it shared).
    sd["output.weight"] = sd["tok_embeddings.weight"] if args.tie_embeddings else \
        hf_model.get_output_embeddings().weight.detach().to(device=device, dtype=dtype)
    for i in range(args.n_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        sd[q + "attention.wqkv.weight"] = get(*(f"{attn}{x}_proj.weight" for x in "qkv"))
        sd[q + "attention.wo.weight"] = get(attn + "o_proj.weight")
        sd[q + "feed_forward.w13.weight"] = get(mlp + "gate_proj.weight", mlp + "up_proj.weight")
        sd[q + "feed_forward.w2.weight"] = get(mlp + "down_proj.weight")
        sd[q + "attention_norm.weight"] = get(p + "input_layernorm.weight")
        sd[q + "ffn_norm.weight"] = get(p + "post_attention_layernorm.weight")
        if args.qkv_bias:
            sd[q + "attention.wqkv.bias"] = get(*(f"{attn}{x}_proj.bias" for x in "qkv"))
        if args.o_bias:
            sd[q + "attention.wo.bias"] = get(attn + "o_proj.bias")
        if args.mlp_bias:
            sd[q + "feed_forward.w13.bias"] = get(mlp + "gate_proj.bias", mlp + "up_proj.bias")
            sd[q + "feed_forward.w2.bias"] = get(mlp + "down_proj.bias")
        if args.qk_norm:
            sd[q + "attention.q_norm.weight"] = get(attn + "q_norm.weight")
            sd[q + "attention.k_norm.weight"] = get(attn + "k_norm.weight")
    return sd


# --------------------------------------------------------------------------- generic HF path
@dataclass
class HFCache:
    """What HFTarget keeps per slot instead of K/V: the token, its rope position, and the mask
    row it was written with. A forward recomputes every written slot from these, so each
    token's K/V is exactly what an incremental forward would have cached."""

    ids: torch.Tensor  # [B, max_len] long
    positions: torch.Tensor  # [B, max_len] long
    mask: torch.Tensor  # [B, max_len, max_len] bool; unwritten slots attend to themselves (no NaN rows)
    used: int = 0  # slots [0, used) have been written in some row

    @classmethod
    def allocate(cls, batch: int, max_len: int, device) -> "HFCache":
        eye = torch.eye(max_len, dtype=torch.bool, device=device).expand(batch, -1, -1).clone()
        zeros = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        return cls(zeros, zeros.clone(), eye)


class HFTarget(nn.Module):
    """Any HF causal LM behind the engine's forward. Slow (every call recomputes all written
    slots) but exact: it is the reference path for families without a compact implementation
    (DeepSeek-V3/Kimi-K2, Gemma3). Not CUDA-graph capturable."""

    cuda_graph_ok = False

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model.eval()
        self.config = hf_model.config.get_text_config()
        impl = self.config._attn_implementation
        if impl not in ("eager", "sdpa"):
            raise FledgeError(f"attn_implementation {impl!r}: HFTarget needs 'eager' or 'sdpa' (custom 4D masks)")

    def new_cache(self, batch: int, max_len: int) -> HFCache:
        return HFCache.allocate(batch, max_len, self.hf.device)

    def _hf_mask(self, mask, positions):
        """bool [B, 1, n, n] → what the model's layers take: eager adds a float mask, sdpa takes
        bool; sliding-window layers get their own mask (window measured in rope positions)."""

        def convert(m):
            if self.config._attn_implementation == "sdpa":
                return m
            return torch.zeros(m.shape, dtype=self.hf.dtype, device=m.device).masked_fill(~m, torch.finfo(self.hf.dtype).min)

        layer_types = set(getattr(self.config, "layer_types", None) or ())
        if "sliding_attention" not in layer_types:
            return convert(mask)
        near = (positions[:, :, None] - positions[:, None, :]) < self.config.sliding_window
        return {"full_attention": convert(mask), "sliding_attention": convert(mask & near[:, None])}

    def forward(self, input_ids, positions, slots, mask, cache: HFCache, aux_ids=None, logits_idx=None):
        B = input_ids.shape[0]
        rows = torch.arange(B, device=input_ids.device)[:, None]
        cache.ids[rows, slots] = input_ids
        cache.positions[rows, slots] = positions
        cache.mask[rows, slots] = mask[:, 0]
        cache.used = max(cache.used, int(slots.max()) + 1)
        n = cache.used
        pos = cache.positions[:, :n]
        out = self.hf(input_ids=cache.ids[:, :n], position_ids=pos,
                      attention_mask=self._hf_mask(cache.mask[:, None, :n, :n], pos),
                      output_hidden_states=aux_ids is not None, use_cache=False)

        def at(t, idx):  # rows of t [B, n, X] at slots idx [B, K]
            return t.gather(1, idx[..., None].expand(-1, -1, t.shape[-1]))

        out_slots = slots if logits_idx is None else slots.gather(1, logits_idx)
        logits = at(out.logits, out_slots).float()
        aux = None
        if aux_ids is not None:
            aux = torch.cat([at(out.hidden_states[i], slots) for i in aux_ids], dim=-1)
        return logits, aux


def build_engine_target(hf_model, dtype, device, compile: bool = False):
    """The engine's view of a loaded HF model: the compact Transformer where fledge has one
    (`compile`: see `Transformer.from_hf`), else HFTarget (which moves `hf_model` itself to
    dtype/device)."""
    family = hf_model.config.get_text_config().model_type
    if family in COMPACT_FAMILIES:
        return Transformer.from_hf(hf_model, dtype, device, compile)
    if family in HF_FAMILIES or hf_model.config.model_type in HF_FAMILIES:
        return HFTarget(hf_model.to(device=device, dtype=dtype))
    raise FledgeError(f"model_type {family!r}: no engine implementation "
                      f"(compact: {', '.join(COMPACT_FAMILIES)}; via transformers: {', '.join(HF_FAMILIES)})")
