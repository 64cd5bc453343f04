"""The target as fledge's engine runs it: one compact Transformer for the Llama family
(SmolLM2, Llama), Qwen2 (q/k/v bias) and Qwen3 (per-head q/k norm), written against its own
weight layout. fledge.engine.hf builds one from a transformers model (or, for other families,
wraps that model behind the same forward).

The forward is explicit about everything (gpt-fast style): the caller passes rope positions,
the cache slot each new token is written to, and the attention mask over the whole static
cache. Nothing in it depends on data (no `.item()`, no data-dependent shapes), so one decode
step can be captured in a CUDA graph. Causal, padded and tree masks are all just masks.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fledge.core.conventions import validate_aux_layer_ids
from fledge.core.errors import FledgeError
from fledge.engine import few_rows as fr
from fledge.engine.attention import (
    Prefix,
    kernel_available,
    kernel_takes,
)
from fledge.engine.layers import LayerFns, attend_cached, linear, one_off_attention


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

@dataclass
class KVCache:
    kv: torch.Tensor  # [n_layers, 2, B, n_kv_heads, max_len, head_dim]: K and V side by side (one write per layer)

    @property
    def k(self) -> torch.Tensor:
        return self.kv[:, 0]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[:, 1]

    @property
    def max_len(self) -> int:
        return self.kv.shape[4]

    @classmethod
    def allocate(cls, args: ModelArgs, batch: int, max_len: int, dtype, device) -> "KVCache":
        shape = (args.n_layers, 2, batch, args.n_kv_heads, max_len, args.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device))


class RMSNorm(nn.Module):
    """Holds a norm's weight; the layer functions apply it."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        # q, k and v in one matmul: decode at batch 1 is launch-bound.
        self.wqkv = nn.Linear(a.dim, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim, bias=a.qkv_bias)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=a.o_bias)
        self.q_norm = RMSNorm(a.head_dim) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim) if a.qk_norm else None


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.w13 = nn.Linear(a.dim, 2 * a.intermediate_size, bias=a.mlp_bias)  # gate and up fused
        self.w2 = nn.Linear(a.intermediate_size, a.dim, bias=a.mlp_bias)


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim)
        self.feed_forward = MLP(a)


class Transformer(nn.Module):
    cuda_graph_ok = True  # forward has static shapes and no host syncs

    def __init__(self, args: ModelArgs, fns: LayerFns = LayerFns()):
        super().__init__()
        self.args, self.fns = args, fns
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Persistent so that hf.transformer_from_hf loads it (fp32) with the weights; never cast it.
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

    def _check_aux(self, aux_ids):
        if aux_ids is not None:
            validate_aux_layer_ids(aux_ids, self.args.n_layers, count=None)

    def _run(self, fns: LayerFns, x, cos, sin, attention, aux_ids, logits_idx, hidden_only=False):
        """The layer stack; `attention(i, q, k, v)` is layer i's attention. Returns (logits [B, K, V]
        fp32, or with `hidden_only` the final-normed states [B, K, H]; aux [B, T, nH] (n aux ids) or None)."""
        f, a, delta, captured = fns, self.args, None, {}
        rows = x.shape[0] * x.shape[1]
        few = f.gemv_rows < rows <= f.few_rows and fr.usable(rows, a.n_heads, a.head_dim, x.device)
        for i, layer in enumerate(self.layers):
            at, ff = layer.attention, layer.feed_forward
            qn, kn = (at.q_norm.weight, at.k_norm.weight) if a.qk_norm else (None, None)
            x, q, k, v = f.attn_in(x, delta, layer.attention_norm.weight, at.wqkv.weight, at.wqkv.bias, qn, kn,
                                   cos, sin, a.norm_eps, a.n_heads, a.n_kv_heads, f.gemv_rows)
            if aux_ids is not None and i in aux_ids:
                captured[i] = x
            o = attention(i, q, k, v)
            mlp_w = (layer.ffn_norm.weight, ff.w13.weight, ff.w13.bias, ff.w2.weight, ff.w2.bias, a.norm_eps)
            if few:  # o_proj reads the attention's output in place (see engine.few_rows)
                x = fr.o_proj(x, o, at.wo.weight, at.wo.bias)
                delta = f.mlp(x, *mlp_w, f.gemv_rows)
            else:
                x, delta = f.attn_out(x, o, at.wo.weight, at.wo.bias, *mlp_w, f.gemv_rows)
        if logits_idx is not None:
            idx = logits_idx[..., None].expand(-1, -1, x.shape[-1])
            x, delta = x.gather(1, idx), delta.gather(1, idx)
        h = f.final_norm(x, delta, self.norm.weight, a.norm_eps)
        aux = torch.cat([captured[i] for i in aux_ids], dim=-1) if aux_ids is not None else None
        return (h if hidden_only else linear(h, self.output.weight, None).float()), aux

    row_groups_ok = True  # forward takes per-group masks, prefill a row range (see generate_ar)
    compact = True  # ModelArgs, static caches: a resident prefill can hold it

    def dims(self) -> tuple[int, int, int]:
        """(hidden size, vocab size, layers)."""
        return self.args.dim, self.args.vocab_size, self.args.n_layers

    @property
    def prefix_kernel(self) -> bool:
        """Whether a `Prefix` mask runs the prefix kernel, which reads only each row's own slots
        (so decode needs no attention spans), rather than becoming a dense mask."""
        return (self.fns.prefix_attention is not None and kernel_takes(self.args.head_dim)
                and kernel_available(self.output.weight.device))

    def forward(self, input_ids, positions, slots, mask, cache: KVCache, aux_ids=None, logits_idx=None):
        """input_ids/positions/slots [B, T] long; mask [B, 1, T, S] bool (True = may attend) over
        the cache's first S <= max_len slots — or a tuple of such masks for consecutive groups of
        rows, each with its own S (a batch sorted by length then reads what each group uses) —
        or a `Prefix` (decode, verify: the new tokens at slots lengths + 0..T-1).

        Returns (logits [B, T, V] fp32, aux [B, T, nH] (n aux ids) or None). `aux` concatenates, in the order
        given, the residual stream entering layer i for i in `aux_ids` (= HF hidden_states[i]).
        `logits_idx` [B, K] (optional) computes logits only at those T-positions: [B, K, V];
        aux is always for all T.
        """
        self._check_aux(aux_ids)
        x = self.tok_embeddings(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        if isinstance(mask, Prefix):
            if self.prefix_kernel:
                kernel, mask = self.fns.prefix_attention, mask.for_kernel()

                def attention(i, q, k, v):  # the kernel writes the cache itself, at lengths + t
                    return kernel(q, k, v, cache.kv[i][0], cache.kv[i][1], mask)
                return self._run(self.fns, x, cos, sin, attention, aux_ids, logits_idx)
            mask = mask.dense(cache.max_len)
        # SDPA would turn a bool mask into an additive one in every layer: do it once here, with
        # the rows repeated once per query head sharing a kv head (see attn_in: GQA).
        rep = self.args.n_heads // self.args.n_kv_heads
        biases = [torch.zeros(m.shape, dtype=x.dtype, device=x.device).masked_fill_(~m, float("-inf")).repeat(1, 1, rep, 1)
                  for m in (mask if isinstance(mask, tuple) else (mask,))]
        matmul, rows = self.fns.decode_attention if input_ids.shape[1] == 1 else None, self.fns.decode_attention_min_rows
        return self._run(self.fns, x, cos, sin,
                         lambda i, q, k, v: attend_cached(q, k, v, cache.kv[i], slots, biases, matmul, rows), aux_ids, logits_idx)

    def prefill(self, input_ids, cache: KVCache | None = None, aux_ids=None, logits_idx=None, hidden_only=False,
                rows: tuple[int, int] | torch.Tensor | None = None):
        """A fresh right-padded batch at positions 0..T-1, causal over itself (flash attention,
        no mask: a row's pads come after its tokens, so no real token sees one). Writes K/V
        into cache slots [0, T) when `cache` is given (decoding continues from there) — of cache
        rows `rows` = (first, end), or a tensor of row indices (continuous batching refills
        the rows that ended), when given; without a cache it is a plain forward, as training's
        feature pass wants. Returns as `_run`."""
        self._check_aux(aux_ids)
        B, T = input_ids.shape
        if cache is not None and T > cache.max_len:
            raise FledgeError(f"prefill of {T} tokens > cache of {cache.max_len} slots")
        # Eager layer functions: prompt lengths vary, and a compile per length would cost more
        # than the launches it saves in a one-off forward. (Padding a batch-1 prompt to a
        # power-of-two bucket through the compiled functions saved nothing on the H200: 26.3
        # against 26.1 ms a request in bench/bench_engine.py;
        # the time goes to host work, not kernels.) A cuDNN plan per length would cost more
        # still when decoding follows; training's feature pass meets its few padded lengths
        # again and again, and keeps SDPA's choice.
        x = self.tok_embeddings(input_ids)
        cos, sin = self.rope(torch.arange(T, device=x.device).expand(B, T), x.dtype)
        rep = self.args.n_heads // self.args.n_kv_heads

        where = rows if isinstance(rows, torch.Tensor) else slice(*(rows or (0, B)))

        def attention(i, q, k, v):
            if cache is not None:
                cache.kv[i][0, where, :, :T] = k
                cache.kv[i][1, where, :, :T] = v
            k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))  # plain heads: flash takes no GQA here
            return F.scaled_dot_product_attention(q.reshape(B, -1, T, q.shape[-1]), k, v, is_causal=True)

        with one_off_attention() if cache is not None else contextlib.nullcontext():
            return self._run(LayerFns(), x, cos, sin, attention, aux_ids, logits_idx, hidden_only)
