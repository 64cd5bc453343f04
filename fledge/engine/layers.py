"""The target's layer as plain functions over weights (attention in and out, MLP, norms, rope, the
cached attention), and `LayerFns`, the set of them a `Transformer` runs: eager, or each compiled
with static shapes for CUDA graphs. Functions rather than modules, so that compile sees whole
fused regions and one set serves the target and the drafter alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fledge.engine import few_rows as fr
from fledge.engine.attention import (
    prefix_attention,
)


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
