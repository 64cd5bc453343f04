"""Attention over the static KV cache for steps whose mask has a prefix form: decode (one new
token per row) and tree verification (N new tokens). Row b's queries see the cache's first
`lengths[b]` slots, and of the T new tokens written at slots lengths[b] + j, those that
`local[b, t, j]` allows (a tree's ancestors; for decode, itself).

`prefix_attention` is a Triton kernel that reads only the slots each row uses, split over the
slots so that batch 1 still fills the GPU (flash-decoding), then a second kernel merges the
splits. It also writes the step's K/V into the cache, so no scatter runs before it. Because a
row stops at its own length, one decode graph serves every step of a run: no attention spans,
no graph per span tuple. On the H200 in bf16 (docs/performance.md):
batched it reads K/V at 2.9-3.6 TB/s where SDPA's masked kernel read 1.9-2.1; at batch 1 it is
level with cuDNN at 384 slots and faster at 1,024 (12.8 against 19.3 us a layer); a whole
batch-1 decode step went from 1.253 to 0.937 ms. `Prefix.dense` is the same mask as a bool tensor for
every other path (CPU, HFTarget, head sizes the kernel does not take).

On a machine without a GPU, tests run the kernel under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheel of torch comes without it; the dense path needs none
    triton = None


@dataclass
class Prefix:
    """Mask in prefix form (see the module docstring): lengths [B] long, local [B, T, T] bool.
    The T new tokens must sit at slots lengths[b] + 0..T-1 (decode and verify write them there)."""

    lengths: torch.Tensor
    local: torch.Tensor

    def for_kernel(self) -> "Prefix":
        """The dtypes the kernel reads (int32 lengths, int8 local): convert once per forward,
        not once per layer (two copy kernels each)."""
        return Prefix(self.lengths.to(torch.int32), self.local.to(torch.int8))

    @classmethod
    def causal_decode(cls, lengths: torch.Tensor) -> "Prefix":
        """One new token per row at slot lengths[b], seeing every slot before it and itself."""
        return cls(lengths, torch.ones(lengths.shape[0], 1, 1, dtype=torch.bool, device=lengths.device))

    def dense(self, max_len: int) -> torch.Tensor:
        """[B, 1, T, max_len] bool, the same mask over the whole cache."""
        B, T, _ = self.local.shape
        cols = torch.arange(max_len, device=self.local.device)
        mask = (cols < self.lengths[:, None])[:, None, :].expand(B, T, max_len).clone()
        slots = (self.lengths[:, None] + torch.arange(T, device=cols.device)).clamp(max=max_len - 1)
        mask.scatter_(2, slots[:, None, :].expand(B, T, T), self.local)
        return mask[:, None]


def kernel_available(device: torch.device) -> bool:
    """Triton importable, and a GPU to run it or the interpreter asked for."""
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def kernel_takes(head_dim: int) -> bool:
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0  # tl.arange needs a power of two


BLOCK_N = 64  # slots per inner step


@functools.lru_cache(maxsize=None)
def _target_ctas(device_index: int | None) -> int:
    if torch.cuda.is_available() and device_index is not None:
        return 2 * torch.cuda.get_device_properties(device_index).multi_processor_count
    return 8  # the interpreter: few programs keep it quick


def _splits(programs: int, slots: int, device: torch.device) -> int:
    """Slot splits per (row, kv head): enough programs for ~2 per SM, at least BLOCK_N slots
    each. It depends on the batch and cache size only, never on T, so a decode step and a
    verify step of the same rows split (and so round) the same way."""
    want = -(-_target_ctas(device.index if device.type == "cuda" else None) // programs)
    return max(1, min(want, -(-slots // BLOCK_N)))


MAX_SPLITS = 16  # the merge loads every split's partial at once


if triton is not None:
    @triton.jit
    def _online_block(q, k, v, seen, m, den, acc, scale, IEEE: tl.constexpr):
        """Fold one block of slots (keys k, values v [BLOCK_N, D]; `seen` [BLOCK_R, BLOCK_N])
        into the running max m, denominator den and weighted sum acc of each query row."""
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return m_new, den * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv

    @triton.jit
    def _attend_split(Q, KN, VN, K, V, LENS, LOCAL, O, ML,
                      sq_b, sq_h, sq_r, skn_b, skn_h, skn_t, svn_b, svn_h, svn_t,
                      sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sl_b, sl_t, sl_j,
                      so_b, so_h, so_s, so_r, n_kv, R, T, S, chunk, scale,
                      BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                      FINAL: tl.constexpr, IEEE: tl.constexpr):
        """One program: query rows [rb*BLOCK_R, +BLOCK_R) of kv head h of row b (query row r is
        new token r % T) over slots [split*chunk, +chunk) up to the row's length + T: the cached
        ones, seen by every row, and the T new tokens at length + j, whose K/V come from KN/VN
        (this step's projection) and are seen as `local` says; the first row block writes
        them into the cache.
        FINAL: the only split, so the output is normalised and stored in O's dtype; else O gets
        the unnormalised fp32 sum and ML the running max and denominator, for _merge_splits."""
        bh, rb, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, h = bh // n_kv, bh % n_kv
        rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        t = rows % T
        d = tl.arange(0, D)
        q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_r + d[None, :], mask=rmask[:, None], other=0.0)
        length = tl.load(LENS + b)
        m = tl.full([BLOCK_R], -1e30, tl.float32)  # finite: a block with nothing visible leaves it, exp gives 0
        den = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        lo = sp * chunk
        hi = tl.minimum(tl.minimum(lo + chunk, length + T), S)
        # One pass over slots [lo, hi) in blocks at fixed offsets, cached and new alike: a
        # token's output then rounds the same whether it is decoded alone or verified among T
        # (bf16 greedy decode and verify agree on what they compute). Blocks wholly below the
        # row's length take a loop of their own that neither loads new K/V nor stores: the
        # same values into the same _online_block, without the extra loads and the branch in
        # every block of a long row. Batched decode at 1,024 rows read 249.8K tok/s before the
        # one pass, 173.1K after it and 215.4K with this loop (random weights, H200, bf16; at
        # 256 rows 125.5K, 114.8K, 135.1K; 256 new tokens, no eos).
        cached_hi = tl.minimum(hi, length)
        mid = lo + tl.maximum(cached_hi - lo, 0) // BLOCK_N * BLOCK_N
        for start in range(lo, mid, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            cached = cols < cached_hi
            k = tl.load(K + b * sk_b + h * sk_h + cols[:, None] * sk_s + d[None, :], mask=cached[:, None], other=0.0)
            v = tl.load(V + b * sv_b + h * sv_h + cols[:, None] * sv_s + d[None, :], mask=cached[:, None], other=0.0)
            m, den, acc = _online_block(q, k, v, rmask[:, None] & cached[None, :], m, den, acc, scale, IEEE)
        for start in range(mid, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            cached = cols < tl.minimum(hi, length)
            j = cols - length
            new = (j >= 0) & (cols < hi)
            k = tl.load(K + b * sk_b + h * sk_h + cols[:, None] * sk_s + d[None, :], mask=cached[:, None], other=0.0)
            v = tl.load(V + b * sv_b + h * sv_h + cols[:, None] * sv_s + d[None, :], mask=cached[:, None], other=0.0)
            kn = tl.load(KN + b * skn_b + h * skn_h + j[:, None] * skn_t + d[None, :], mask=new[:, None], other=0.0)
            vn = tl.load(VN + b * svn_b + h * svn_h + j[:, None] * svn_t + d[None, :], mask=new[:, None], other=0.0)
            k = tl.where(new[:, None], kn, k)
            v = tl.where(new[:, None], vn, v)
            if rb == 0:  # this step's tokens into the cache, once per kv head
                tl.store(K + b * sk_b + h * sk_h + cols[:, None] * sk_s + d[None, :], kn, mask=new[:, None])
                tl.store(V + b * sv_b + h * sv_h + cols[:, None] * sv_s + d[None, :], vn, mask=new[:, None])
            loc = tl.load(LOCAL + b * sl_b + t[:, None] * sl_t + j[None, :] * sl_j, mask=rmask[:, None] & new[None, :], other=0)
            seen = rmask[:, None] & (cached[None, :] | (loc != 0))
            m, den, acc = _online_block(q, k, v, seen, m, den, acc, scale, IEEE)
        out = O + b * so_b + h * so_h + sp * so_s + rows[:, None] * so_r + d[None, :]
        if FINAL:
            tl.store(out, (acc / tl.where(rmask, den, 1.0)[:, None]).to(O.dtype.element_ty), mask=rmask[:, None])
        else:
            tl.store(out, acc, mask=rmask[:, None])
            ml = ML + ((b * n_kv + h) * tl.num_programs(2) + sp) * 2 * R
            tl.store(ml + rows, m, mask=rmask)
            tl.store(ml + R + rows, den, mask=rmask)

    @triton.jit
    def _merge_splits(PART, ML, O, n_split, R, BLOCK_R: tl.constexpr, D: tl.constexpr, NS: tl.constexpr):
        """Rescale each split's sum to the global max and normalise into O [B, n_kv, R, D]
        (contiguous; program bh is row b's kv head h, as in _attend_split). The loop over the
        splits is unrolled (NS >= n_split): its loads do not wait for one another."""
        bh, rb = tl.program_id(0), tl.program_id(1)
        rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        d = tl.arange(0, D)
        ml = ML + bh * n_split * 2 * R
        sp = tl.arange(0, NS)
        smask = (sp < n_split)[:, None] & rmask[None, :]
        m_all = tl.load(ml + sp[:, None] * 2 * R + rows[None, :], mask=smask, other=-1e30)  # [NS, BLOCK_R]
        m = tl.max(m_all, 0)
        den = tl.sum(tl.exp(m_all - m[None, :]) * tl.load(ml + sp[:, None] * 2 * R + R + rows[None, :], mask=smask, other=0.0), 0)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        for s in tl.static_range(NS):
            live = rmask & (tl.full([BLOCK_R], s, tl.int32) < n_split)
            w = tl.exp(tl.load(ml + s * 2 * R + rows, mask=live, other=-1e30) - m)
            part = tl.load(PART + (bh * n_split + s) * R * D + rows[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
            acc += w[:, None] * part
        tl.store(O + bh * R * D + rows[:, None] * D + d[None, :], (acc / tl.where(rmask, den, 1.0)[:, None]).to(O.dtype.element_ty),
                 mask=rmask[:, None])


def prefix_attention(q, k_new, v_new, k_cache, v_cache, prefix: Prefix) -> torch.Tensor:
    """Write this step's K/V into the cache and attend. q [B, n_kv, G*T, D] (query row r of a kv
    head is new token r % T, as model.attn_in lays out GQA); k_new/v_new [B, n_kv, T, D], any
    strides but the last; k_cache/v_cache [B, n_kv, S, D], one layer's cache, which gets the new
    tokens at slots lengths + 0..T-1. Returns [B, n_kv, G*T, D] in q's dtype. No host sync and
    static shapes: CUDA-graph safe."""
    B, n_kv, R, D = q.shape
    S, T = k_cache.shape[2], prefix.local.shape[1]
    q, k_new, v_new = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_new, v_new))
    block_r = min(64, max(16, triton.next_power_of_2(R)))
    merge_r = 4  # the merge's tile holds every split: few rows a program, more programs for a verify's rows
    n_split = min(MAX_SPLITS, _splits(B * n_kv, S, q.device))
    chunk = -(-(-(-S // n_split)) // BLOCK_N) * BLOCK_N
    n_split = -(-S // chunk)
    out = torch.empty(B, n_kv, R, D, dtype=q.dtype, device=q.device)
    final = n_split == 1
    part = out if final else torch.empty(B, n_kv, n_split, R, D, dtype=torch.float32, device=q.device)
    ml = part if final else torch.empty(B, n_kv, n_split, 2, R, dtype=torch.float32, device=q.device)
    so = (out.stride(0), out.stride(1), 0, out.stride(2)) if final else part.stride()[:4]
    if prefix.lengths.dtype != torch.int32 or prefix.local.dtype != torch.int8:
        prefix = prefix.for_kernel()
    local, lengths = prefix.local, prefix.lengths
    _attend_split[(B * n_kv, -(-R // block_r), n_split)](
        q, k_new, v_new, k_cache, v_cache, lengths, local, part, ml,
        q.stride(0), q.stride(1), q.stride(2), k_new.stride(0), k_new.stride(1), k_new.stride(2),
        v_new.stride(0), v_new.stride(1), v_new.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), local.stride(0), local.stride(1), local.stride(2),
        *so, n_kv, R, T, S, chunk, D ** -0.5,
        BLOCK_R=block_r, BLOCK_N=BLOCK_N, D=D, FINAL=final, IEEE=q.dtype == torch.float32, num_warps=4)
    if not final:
        _merge_splits[(B * n_kv, -(-R // merge_r))](part, ml, out, n_split, R, BLOCK_R=merge_r, D=D,
                                                    NS=triton.next_power_of_2(n_split), num_warps=4)
    return out
