"""A layer's matmuls for a forward of a few rows (a verify step at batch 1: 2 to 16 new tokens)
as Triton kernels, with the ops around each fused in: the residual add and RMS norm before it,
the bias, SiLU(gate) * up, or the residual add after it.

Why: on the H200 an 8-token verify cost 1.6-1.7 AR steps (1.14 ms against 0.71;
bench/results/profile_round_fast_topk_nvidia_h200.json, random weights). Of its ~1.0 ms of
kernels, cuBLAS's 120 small GEMMs took 0.44 ms (3.7 us each) and the seven norm, SiLU, rope and
copy kernels a layer around them 0.22 ms more, where a one-row decode step fuses those into its
reductions (model.linear). Here one program loads a BLOCK_N x K slice of the weight once for
all rows (tl.dot over 16 rows, the pads masked), all of it at once, so a layer is four matmul
kernels, the rope and the attention.

Rounding follows the eager layer functions in the order of operations (the sum rounded to the
activations' dtype before the norm, the norm before its weight, each matmul output before
SiLU, the product and the residual add); only the order of the fp32 sums differs.
"""

from __future__ import annotations

import torch

from fledge.engine.attention import kernel_available, triton

if triton is not None:
    import triton.language as tl

MAX_ROWS = 16  # tl.dot's smallest row tile; the whole x [16, K] sits in registers
MAX_K = 2048


def k_split(k: int) -> tuple[int, int]:
    """An input width k as a + b, powers of two from 16 with a >= b (a power of two k as two
    halves), or (0, 0). A program loads x and its weight slice as these two tiles at once: one
    memory round trip, where a loop over K waited for each step's loads in turn (5.8 us a
    matmul on the H200 against cuBLAS's 3.7; session 7's first form)."""
    if k < 32 or k > MAX_K:
        return 0, 0
    a = 1 << (k.bit_length() - 1)
    a, b = (a // 2, a // 2) if a == k else (a, k - a)
    return (a, b) if b >= 16 and b & (b - 1) == 0 else (0, 0)


def usable(rows: int, dim: int, head_dim: int, intermediate: int, device: torch.device) -> bool:
    """Whether a forward of `rows` rows (batch x tokens) of these widths can take these kernels."""
    return (1 <= rows <= MAX_ROWS and kernel_available(device) and k_split(dim)[0] > 0
            and k_split(intermediate)[0] > 0 and head_dim in (16, 32, 64, 128))


if triton is not None:
    @triton.jit
    def _load_x(X, DELTA, rows, rmask, c0, TR, sxb, sxt, sxh, sdm, KC: tl.constexpr, HEAD: tl.constexpr,
                ADD: tl.constexpr):
        """Input columns [c0, c0 + KC) of every row: x, or x + delta rounded to x's dtype. Row m
        of X is (m // TR, m % TR) over strides (sxb, sxt), column c is (c // HEAD, c % HEAD)
        over (sxh, 1): a plain [M, K] or the attention's heads [B, T, H, D] without a copy."""
        c = c0 + tl.arange(0, KC)
        ptr = X + ((rows // TR) * sxb + (rows % TR) * sxt)[:, None] + ((c // HEAD) * sxh + c % HEAD)[None, :]
        x = tl.load(ptr, mask=rmask[:, None], other=0.0)
        if ADD:
            d = tl.load(DELTA + rows[:, None] * sdm + c[None, :], mask=rmask[:, None], other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
        return x

    @triton.jit
    def _normed(x, NW, c0, rstd, KC: tl.constexpr):
        """x * rstd rounded to x's dtype, times the norm's weight, rounded (model.rms_norm's order)."""
        nw = tl.load(NW + c0 + tl.arange(0, KC)).to(tl.float32)
        return ((x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32) * nw[None, :]).to(x.dtype)

    @triton.jit
    def _dot(x, w, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(x, tl.trans(w), input_precision="ieee")
        return tl.dot(x, tl.trans(w))

    @triton.jit
    def _rows_linear(X, DELTA, XOUT, NW, W, BIAS, RES, Y, M, N, TR, sxb, sxt, sxh, sdm, swn, eps,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KA: tl.constexpr, KB: tl.constexpr,
                     HEAD: tl.constexpr, ADD: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                     GATED: tl.constexpr, HAS_RES: tl.constexpr, IEEE: tl.constexpr):
        """Y [M, N] = epilogue(prologue(X) @ W[:N].T) over K = KA + KB input columns: program p
        makes columns [p*BLOCK_N, +BLOCK_N). Prologue: + DELTA (ADD; program 0 stores the sum in
        XOUT), RMS norm with weight NW (NORM). Epilogue: + BIAS; GATED: SiLU(that) * (the same
        from W[N:2N]); + RES (HAS_RES)."""
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        rmask = rows < M
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        ka, kb = tl.arange(0, KA), KA + tl.arange(0, KB)
        # Every load first, so that they are in flight together.
        xa = _load_x(X, DELTA, rows, rmask, 0, TR, sxb, sxt, sxh, sdm, KA, HEAD, ADD)
        xb = _load_x(X, DELTA, rows, rmask, KA, TR, sxb, sxt, sxh, sdm, KB, HEAD, ADD)
        wp = W + cols[:, None] * swn
        wa = tl.load(wp + ka[None, :], mask=cmask[:, None], other=0.0)
        wb = tl.load(wp + kb[None, :], mask=cmask[:, None], other=0.0)
        if GATED:
            w3a = tl.load(wp + N * swn + ka[None, :], mask=cmask[:, None], other=0.0)
            w3b = tl.load(wp + N * swn + kb[None, :], mask=cmask[:, None], other=0.0)
        if ADD:
            if pid == 0:
                tl.store(XOUT + rows[:, None] * sdm + ka[None, :], xa, mask=rmask[:, None])
                tl.store(XOUT + rows[:, None] * sdm + kb[None, :], xb, mask=rmask[:, None])
        if NORM:
            fa, fb = xa.to(tl.float32), xb.to(tl.float32)
            rstd = 1.0 / tl.sqrt((tl.sum(fa * fa, 1) + tl.sum(fb * fb, 1)) / (KA + KB) + eps)
            xa, xb = _normed(xa, NW, 0, rstd, KA), _normed(xb, NW, KA, rstd, KB)
        acc = _dot(xa, wa, IEEE) + _dot(xb, wb, IEEE)
        dt = Y.dtype.element_ty
        y = acc
        if HAS_BIAS:
            y += tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            up = _dot(xa, w3a, IEEE) + _dot(xb, w3b, IEEE)
            if HAS_BIAS:
                up += tl.load(BIAS + N + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
            g = y.to(dt).to(tl.float32)
            y = (g * tl.sigmoid(g)).to(dt).to(tl.float32) * up.to(dt).to(tl.float32)
        omask = rmask[:, None] & cmask[None, :]
        if HAS_RES:
            res = tl.load(RES + rows[:, None] * N + cols[None, :], mask=omask, other=0.0)
            y = y.to(dt).to(tl.float32) + res.to(tl.float32)
        tl.store(Y + rows[:, None] * N + cols[None, :], y.to(dt), mask=omask)

    # On a GPU each shape picks its tile by measurement, in the warm-up run before a graph is
    # captured (capture_cuda_graph); the interpreter takes one. No K loop, so no stages.
    _CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=1) for n in (16, 32) for w in (4, 8)]
    _tuned = triton.autotune(_CONFIGS, key=["M", "N", "KA", "KB", "ADD", "NORM", "GATED", "HAS_RES"])(_rows_linear)


def rows_linear(x, w, b=None, *, delta=None, norm_w=None, eps: float = 0.0, residual=None, gated: bool = False,
                config: tuple[int, int] | None = None):
    """For x [B, T, K] (or the attention's output as heads [B, T, H, D], a view): with `delta`,
    x = x + delta first; with `norm_w`, the RMS norm of that (weight norm_w, `eps`) is the input;
    y = input @ w.T + b — or, `gated`, SiLU(input @ w1.T + b1) * (input @ w3.T + b3) with w the
    two stacked, as MLP.w13 — plus `residual` [B, T, N] if given. Returns y [B, T, N], or (x, y)
    with `delta` (x: the sum, the stream the next ops read). `config` (BLOCK_N, num_warps) skips
    the autotuner (bench/few_rows_micro.py compares them)."""
    B, T = x.shape[:2]
    M = B * T
    if x.dim() == 4:  # heads: column h*D + d is x[b, t, h, d]
        H, D = x.shape[2:]
        K, head, TR, sxb, sxt, sxh = H * D, D, T, x.stride(0), x.stride(1), x.stride(2)
        assert x.stride(3) == 1
    else:
        x = x.contiguous()
        K = x.shape[-1]
        head, TR, sxb, sxt, sxh = 16, M, 0, K, 16
    ka, kb = k_split(K)
    N = w.shape[0] // (2 if gated else 1)
    assert ka and w.shape[1] == K and w.stride(1) == 1 and M <= MAX_ROWS and (delta is None or norm_w is not None)
    y = torch.empty(B, T, N, dtype=x.dtype, device=x.device)
    xout = torch.empty(B, T, K, dtype=x.dtype, device=x.device) if delta is not None else y
    if delta is not None:
        delta = delta.contiguous()
    if residual is not None:
        residual = residual.contiguous()
    dummy = y
    args = (x, delta if delta is not None else dummy, xout, norm_w if norm_w is not None else dummy, w,
            b if b is not None else dummy, residual if residual is not None else dummy, y,
            M, N, TR, sxb, sxt, sxh, K, w.stride(0), eps)
    flags = dict(BLOCK_M=MAX_ROWS, KA=ka, KB=kb, HEAD=head, ADD=delta is not None, NORM=norm_w is not None,
                 HAS_BIAS=b is not None, GATED=gated, HAS_RES=residual is not None, IEEE=x.dtype == torch.float32)
    if config is not None:
        _rows_linear[(triton.cdiv(N, config[0]),)](*args, BLOCK_N=config[0], num_warps=config[1], num_stages=1, **flags)
    elif x.device.type == "cuda":
        _tuned[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](*args, **flags)
    else:
        _rows_linear[(triton.cdiv(N, 16),)](*args, BLOCK_N=16, **flags)
    return (xout, y) if delta is not None else y


def attn_in(split_heads, x, delta, norm_w, wqkv, bqkv, q_norm_w, k_norm_w, cos, sin, eps: float, n_heads: int,
            n_kv: int):
    """model.attn_in with the residual add, norm and q/k/v matmul in one kernel; `split_heads`
    (model.split_heads, compiled or not) does the rest."""
    if delta is None:  # layer 0
        qkv = rows_linear(x, wqkv, bqkv, norm_w=norm_w, eps=eps)
    else:
        x, qkv = rows_linear(x, wqkv, bqkv, delta=delta, norm_w=norm_w, eps=eps)
    return (x, *split_heads(qkv, q_norm_w, k_norm_w, cos, sin, eps, n_heads, n_kv))


def attn_out(x, o, wo, bo, norm_w, w13, b13, w2, b2, eps: float):
    """model.attn_out in three kernels: o_proj with its residual add; the norm, gate and up
    matmuls and SiLU(gate) * up; down_proj. `o` [B, n_kv, G*T, D] is read as heads in place."""
    B, T, _ = x.shape
    o = o.reshape(B, -1, T, o.shape[-1]).transpose(1, 2)  # [B, T, n_heads, D], a view
    x = rows_linear(o, wo, bo, residual=x)
    act = rows_linear(x, w13, b13, norm_w=norm_w, eps=eps, gated=True)
    return x, rows_linear(act, w2, b2)
