"""o_proj of a forward of a few rows (a verify step at batch 1: 2 to 16 new tokens) as one
Triton kernel that reads the attention's output where it is and adds the residual.

Eager or compiled, a layer's o_proj first copies the attention's [B, n_kv, G*T, D] output into
[B, T, H*D] rows for cuBLAS, then adds the result to the stream. Here one program loads a
BLOCK_N x K slice of the weight and every row's K inputs at once (two power-of-two K tiles,
tl.dot over 16 rows, the pads masked): one memory round trip and one kernel. On the H200, 30
layers' weights in turn, 8 rows: 2.80 us a layer against 5.07 for the copy and cuBLAS (bf16).

The same kernel with the norm, gate/up and down matmuls fused in
tied or lost against cuBLAS plus Inductor's fused norm and SiLU kernels (qkv 4.13 against
3.17 + a norm kernel; down_proj 6.02 against 5.02), so those stay as they were.
"""

from __future__ import annotations

import torch

from fledge.engine.attention import kernel_available, kernel_takes, triton

if triton is not None:
    import triton.language as tl

MAX_ROWS = 16  # tl.dot's smallest row tile; every row's K inputs sit in registers
MAX_K = 2048


def k_split(k: int) -> tuple[int, int]:
    """An input width k as a + b, powers of two from 16 with a >= b (a power of two k as two
    halves), or (0, 0). A program loads its inputs and weight slice as these two tiles at
    once: a loop over K waits for each step's loads in turn (5.8 us a matmul on the H200 with
    such a loop)."""
    if k < 32 or k > MAX_K:
        return 0, 0
    a = 1 << (k.bit_length() - 1)
    a, b = (a // 2, a // 2) if a == k else (a, k - a)
    return (a, b) if b >= 16 and b & (b - 1) == 0 else (0, 0)


def usable(rows: int, n_heads: int, head_dim: int, device: torch.device) -> bool:
    """Whether a forward of `rows` rows (batch x tokens) can take the kernel."""
    return (1 <= rows <= MAX_ROWS and kernel_available(device) and kernel_takes(head_dim)
            and k_split(n_heads * head_dim)[0] > 0)


if triton is not None:
    @triton.jit
    def _load_heads(O, rows, rmask, c0, T, sob, sot, soh, KC: tl.constexpr, D: tl.constexpr):
        """Input columns [c0, c0 + KC) of every row: row m is (b, t) = (m // T, m % T), column c
        is head c // D, dim c % D, over strides (sob, sot, soh, 1)."""
        c = c0 + tl.arange(0, KC)
        ptr = O + ((rows // T) * sob + (rows % T) * sot)[:, None] + ((c // D) * soh + c % D)[None, :]
        return tl.load(ptr, mask=rmask[:, None], other=0.0)

    @triton.jit
    def _dot(x, w, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(x, tl.trans(w), input_precision="ieee")
        return tl.dot(x, tl.trans(w))

    @triton.jit
    def _o_proj(O, W, BIAS, RES, Y, M, N, T, sob, sot, soh, swn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KA: tl.constexpr, KB: tl.constexpr, D: tl.constexpr,
                HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
        """Y [M, N] = RES + (heads @ W.T + BIAS), each sum rounded to Y's dtype as the eager
        `x + linear(o, w, b)` rounds: program p makes columns [p*BLOCK_N, +BLOCK_N)."""
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        rmask = rows < M
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        # Every load first, so that they are in flight together.
        xa = _load_heads(O, rows, rmask, 0, T, sob, sot, soh, KA, D)
        xb = _load_heads(O, rows, rmask, KA, T, sob, sot, soh, KB, D)
        wp = W + cols[:, None] * swn
        wa = tl.load(wp + tl.arange(0, KA)[None, :], mask=cmask[:, None], other=0.0)
        wb = tl.load(wp + KA + tl.arange(0, KB)[None, :], mask=cmask[:, None], other=0.0)
        omask = rmask[:, None] & cmask[None, :]
        res = tl.load(RES + rows[:, None] * N + cols[None, :], mask=omask, other=0.0)
        y = _dot(xa, wa, IEEE) + _dot(xb, wb, IEEE)
        if HAS_BIAS:
            y += tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        dt = Y.dtype.element_ty
        tl.store(Y + rows[:, None] * N + cols[None, :], (y.to(dt).to(tl.float32) + res.to(tl.float32)).to(dt), mask=omask)


# The best of 9 tiles for SmolLM2's o_proj at 8 and 16 rows (timed on the H200, bf16).
BLOCK_N, NUM_WARPS = 16, 4


def o_proj(x, o, w, b=None, config: tuple[int, int] = (BLOCK_N, NUM_WARPS)):
    """x + o_proj(o) for the stream x [B, T, N] and the attention's output o [B, n_kv, G*T, D]
    (query row g*T + t of kv head h is head h*G + g at token t: see model.attn_in), read in
    place. Returns [B, T, N] in x's dtype. `config`: (BLOCK_N, num_warps)."""
    B, T, N = x.shape
    heads = o.reshape(B, -1, T, o.shape[-1]).transpose(1, 2)  # [B, T, H, D], a view
    H, D = heads.shape[2:]
    ka, kb = k_split(H * D)
    M = B * T
    assert ka and w.shape == (N, H * D) and w.stride(1) == 1 and heads.stride(3) == 1 and M <= MAX_ROWS
    x = x.contiguous()
    y = torch.empty_like(x)
    _o_proj[(triton.cdiv(N, config[0]),)](
        heads, w, b if b is not None else x, x, y, M, N, T, heads.stride(0), heads.stride(1), heads.stride(2),
        w.stride(0), BLOCK_M=MAX_ROWS, BLOCK_N=config[0], KA=ka, KB=kb, D=D, HAS_BIAS=b is not None,
        IEEE=x.dtype == torch.float32, num_warps=config[1], num_stages=1)
    return y
