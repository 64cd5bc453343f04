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
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from fledge.core.conventions import validate_aux_layer_ids
from fledge.core.errors import FledgeError
from fledge.engine import few_rows as fr
from fledge.engine.attention import (
    Prefix,
    kernel_available,
    kernel_takes,
    prefix_attention,
)


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


# --------------------------------------------------------------------------- one layer, as three functions
# A CUDA-graph decode step at batch 1 is bound by the number of kernels (~2 us each however
# small), so a layer is written as pure functions of tensors that `LayerFns.compiled()` hands to
# torch.compile: one compiled graph serves all layers (guards see shapes, not modules), and each
# function fuses into a few kernels. The residual add of layer i-1's MLP output happens at the
# start of layer i, where it fuses with the attention norm. The cache write and the attention
# stay eager between them: compiled in-place writes into a graph input risk a copy of the cache.
# Eager, every op rounds as HF's does (bf16 greedy output then follows HF's token for token).
def rms_norm(x, weight, eps: float):
    """Normalised in fp32 (rms_norm's accumulation type), rounded, then scaled in x's dtype."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def apply_rope(x, cos, sin):
    """x * cos + rotate_half(x) * sin, with `sin` signed as `Transformer.rope` returns it."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


# On the CPU, x @ w.T (F.linear) for a few rows costs up to 2.5x more than w @ x.T: MKL's GEMM
# with the big operand transposed. SmolLM2's weights read from memory, on a 2-core CPU in fp32:
# lm_head at 5 rows 35.6 against
# 16.1 ms, at 2 rows 32.5 against 12.9 (one row: 17.7 and 14.2). So a verify step of a few tokens
# costs about one decode step, where through F.linear it cost 1.4-1.9.
CPU_FEW_ROWS = 64


def linear(x, w, b, gemv_rows: int = 0):
    """F.linear; or, for at most `gemv_rows` rows (batch x tokens), the same product written as
    a multiply and a sum over K. Compiled, that is one reduction kernel that streams the weight,
    with the ops around it (residual add, SiLU x up) fused in — where cuBLAS's smallest GEMM
    took ~3.9 us per matmul at one row on the H200 in bf16, 45% of a decode step
    (docs/performance.md). On the CPU, 2 to
    CPU_FEW_ROWS rows multiply as w @ x.T (see CPU_FEW_ROWS). Output in x's dtype, as F.linear."""
    rows = x.numel() // x.shape[-1]
    if rows <= gemv_rows:
        y = (x.float()[..., None, :] * w.float()).sum(-1)
        return (y if b is None else y + b.float()).to(x.dtype)
    if x.device.type == "cpu" and 1 < rows <= CPU_FEW_ROWS:
        y = torch.mm(w, x.reshape(rows, x.shape[-1]).t())
        y = (y if b is None else y + b[:, None]).t().contiguous()
        return y.view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w, b)


VERIFY_ROWS = 64  # new tokens up to which attn_in lays q and k out in one buffer (verify steps)


def attn_in(x, delta, norm_w, wqkv, bqkv, q_norm_w, k_norm_w, cos, sin, eps: float, n_heads: int, n_kv: int,
            gemv_rows: int = 0):
    """Residual add of the previous layer's MLP output (`delta`; None in layer 0), attention
    norm, q/k/v in one matmul, q/k norm (Qwen3), rope. Returns (x = the stream entering this
    layer, HF hidden_states[i]; q [B, n_kv, G*T, D]; k and v [B, n_kv, T, D], views: the
    prefix kernel reads them where they are, so stacking them would cost a kernel).

    GQA without copying K/V: the G query heads sharing a kv head (HF maps q head h to kv head
    h // G) become G*T query rows of that kv head; masks repeat their rows G times to match."""
    if delta is not None:
        x = x + delta
    B, T, _ = x.shape
    D = cos.shape[-1]
    qkv = linear(rms_norm(x, norm_w, eps), wqkv, bqkv, gemv_rows).view(B, T, n_heads + 2 * n_kv, D)
    qk, v = qkv[:, :, :n_heads + n_kv], qkv[:, :, n_heads + n_kv:]
    if q_norm_w is not None:
        qk = torch.cat([rms_norm(qk[:, :, :n_heads], q_norm_w, eps), rms_norm(qk[:, :, n_heads:], k_norm_w, eps)], dim=2)
    qk = apply_rope(qk, cos, sin)  # q and k at once: eager, that is half the rope kernels
    G, k = n_heads // n_kv, qk[:, :, n_heads:].transpose(1, 2)
    q = qk[:, :, :n_heads].transpose(1, 2).reshape(B, n_kv, G * T, D)
    if 1 < T <= VERIFY_ROWS:
        # A verify's q rows and k of each kv head in one buffer: compiled, the rope writes both in
        # one kernel, where q apart (copied into its row layout) and k took one each. (A decode
        # step's q is a view already; a prefill's attention reshapes q back into heads.)
        rows = torch.cat([q, k], dim=2)
        q, k = rows[:, :, :G * T], rows[:, :, G * T:]
    return x, q, k, v.transpose(1, 2)


def attn_out(x, o, wo, bo, norm_w, w13, b13, w2, b2, eps: float, gemv_rows: int = 0):
    """o_proj and its residual add, then `mlp`. Returns (x after attention, the MLP output: the
    next layer adds it). `o` is [B, n_heads or n_kv, *, D]."""
    B, T, _ = x.shape
    o = o.reshape(B, -1, T, o.shape[-1]).transpose(1, 2).reshape(B, T, -1)
    x = x + linear(o, wo, bo, gemv_rows)
    return x, mlp(x, norm_w, w13, b13, w2, b2, eps, gemv_rows)


def mlp(x, norm_w, w13, b13, w2, b2, eps: float, gemv_rows: int = 0):
    """The MLP of the normed stream, gate and up in one matmul. With `gemv_rows` (see `linear`),
    gate and up are two sums over the same K, so that they and SiLU(gate) * up fuse into one
    kernel."""
    B, T, _ = x.shape
    h = rms_norm(x, norm_w, eps)
    if B * T <= gemv_rows:
        n = w13.shape[0] // 2
        b1, b3 = (None, None) if b13 is None else (b13[:n], b13[n:])
        act = F.silu(linear(h, w13[:n], b1, gemv_rows)) * linear(h, w13[n:], b3, gemv_rows)
    else:
        gate, up = linear(h, w13, b13).chunk(2, dim=-1)
        act = F.silu(gate) * up
    return linear(act, w2, b2, gemv_rows)


def final_norm(x, delta, weight, eps: float):
    return rms_norm(x + delta, weight, eps)


# cuDNN's SDPA kernel builds an execution plan for every new shape: 40-88 ms per new prompt length
# on the H200, against 0.1-0.3 ms for the flash and mem-efficient kernels (timed on the first
# call of each kernel at new lengths).
# Attention whose shape changes with every request (a prompt's prefill, the drafter's pass over
# it) therefore runs without it; fixed-shape steps, captured once, keep SDPA's own choice.
ONE_OFF_SDPA = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def one_off_attention():
    """Context for attention of a shape seen once (see ONE_OFF_SDPA)."""
    return sdpa_kernel(list(ONE_OFF_SDPA))


def decode_attention(q, k, v, bias):
    """SDPA's math as two batched matmuls and a softmax, for decode steps of many rows: compiled,
    it read K/V at ~3.2-3.3 TB/s on the H200 at 256-1024 rows, where SDPA's masked kernel read
    ~2.1 (docs/performance.md). Eager it would not pay (the scores make extra passes)."""
    s = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5 + bias
    return s.softmax(-1).to(v.dtype) @ v


DECODE_ATTENTION_MIN_ROWS = 64  # default: a row group this large decodes through LayerFns.decode_attention
# Compiled default: forwards of up to 4 rows (batch-1 decode) multiply as
# reductions (`linear`). On the H200 a batch-1 decode step of SmolLM2's shapes took 0.699 ms
# against 0.937 with cuBLAS (bf16; docs/performance.md).
GEMV_ROWS = 4


def write_kv(cache_kv, slots, k, v) -> None:
    """This step's K and V [B, n_kv, T, D] into one layer's cache [2, B, n_kv, S, D] at `slots` [B, T]."""
    idx = slots[:, None, :, None].expand(k.shape)
    cache_kv[0].scatter_(2, idx, k)
    cache_kv[1].scatter_(2, idx, v)


def attend_cached(q, k, v, cache_kv, slots, biases, matmul_attention=None, min_rows: int = DECODE_ATTENTION_MIN_ROWS):
    """Write this step's K/V at `slots`, then attend: `biases`
    cover consecutive groups of rows, each over the cache's first S = bias.shape[-1] slots, so
    a decode step reads only the slots its group uses (see Transformer.forward). A group of
    `min_rows` or more goes through `matmul_attention` when one is given."""
    write_kv(cache_kv, slots, k, v)
    outs, r0 = [], 0
    for bias in biases:
        r1, S = r0 + bias.shape[0], bias.shape[-1]
        k, v = cache_kv[0, r0:r1, :, :S], cache_kv[1, r0:r1, :, :S]
        if matmul_attention is not None and r1 - r0 >= min_rows:
            outs.append(matmul_attention(q[r0:r1], k, v, bias))
        else:
            outs.append(F.scaled_dot_product_attention(q[r0:r1], k, v, attn_mask=bias))
        r0 = r1
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def compile_static(fn, **options):
    """torch.compile(fn) whole (fullgraph) for static shapes: the engine's layer functions and
    its drafter's halves, compiled once per shape they meet (decode, each verify width, each
    regen batch; each tree shape and draft cache quantum). torch's default of 8 compiles per
    function would silently fall back to eager after the eighth, so this raises that limit, a
    process-wide setting, to 64 whenever the engine asks for a compile."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(fn, fullgraph=True, dynamic=False, **options)


@dataclass(frozen=True)
class LayerFns:
    attn_in: Callable = attn_in
    attn_out: Callable = attn_out
    final_norm: Callable = final_norm
    decode_attention: Callable | None = None  # compiled only: see decode_attention
    decode_attention_min_rows: int = DECODE_ATTENTION_MIN_ROWS
    prefix_attention: Callable | None = None  # masks in prefix form: see fledge.engine.attention
    gemv_rows: int = 0  # forwards of at most this many rows (batch x tokens) multiply as reductions: see `linear`
    mlp: Callable = mlp  # attn_out's second half, on its own for the few-rows path
    few_rows: int = 0  # forwards of more than gemv_rows and at most this many rows: o_proj by engine.few_rows

    @classmethod
    def compiled(cls, mode: str | None = None, decode_attention_min_rows: int = DECODE_ATTENTION_MIN_ROWS,
                 prefix_kernel: bool = True, gemv_rows: int = GEMV_ROWS, few_rows: int = fr.MAX_ROWS) -> "LayerFns":
        """`mode`: torch.compile's (e.g. "max-autotune-no-cudagraphs": Triton GEMM templates
        with fused epilogues, autotuned per shape; the engine captures its own graphs).
        `decode_attention_min_rows`: row groups from this size decode through the matmul
        attention (1: every decode step) — where the prefix kernel does not serve them.
        `prefix_kernel`: decode and verify steps attend through attention.prefix_attention
        (on a GPU, for head sizes it takes). `gemv_rows`: see `linear` (0: cuBLAS always).
        `few_rows`: forwards of more than `gemv_rows` and at most this many rows run o_proj as
        engine.few_rows' kernel (0: none; at most few_rows.MAX_ROWS). On the H200 (random weights,
        bf16, both measured in one process; docs/performance.md) it took 0.04 ms off a verify and a
        round: chain 7 verify 1.006 against 1.047 ms, round 1.644 against 1.683."""
        # Static shapes: one compile per (batch, T) — decode, each verify width, each regen
        # batch. Layer 0 (delta None) is one more.
        fns = (compile_static(f, mode=mode) for f in (attn_in, attn_out, final_norm, mlp))
        # Dynamic: decode attention meets every (rows, span) pair of a run; its kernels are a
        # matmul library call and a softmax either way.
        ain, aout, fnorm, mlp_fn = fns
        return cls(ain, aout, fnorm, decode_attention=torch.compile(decode_attention, fullgraph=True, dynamic=True),
                   decode_attention_min_rows=decode_attention_min_rows,
                   prefix_attention=prefix_attention if prefix_kernel else None, gemv_rows=gemv_rows,
                   mlp=mlp_fn, few_rows=min(few_rows, fr.MAX_ROWS))


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
            validate_aux_layer_ids(aux_ids, self.args.n_layers)

    def _run(self, fns: LayerFns, x, cos, sin, attention, aux_ids, logits_idx, hidden_only=False):
        """The layer stack; `attention(i, q, k, v)` is layer i's attention. Returns (logits [B, K, V]
        fp32, or with `hidden_only` the final-normed states [B, K, H]; aux [B, T, 3H] or None)."""
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

        Returns (logits [B, T, V] fp32, aux [B, T, 3H] or None). `aux` concatenates, in the order
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
