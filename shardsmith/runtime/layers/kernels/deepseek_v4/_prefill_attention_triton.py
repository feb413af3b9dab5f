"""Triton kernel behind :func:`~shardsmith.runtime.layers.kernels.deepseek_v4.prefill_attention.prefill_attention`.

``_prefill_attention_kernel`` (grid ``[T, ceil(n / BLOCK_H)]``): one program takes ``BLOCK_H`` heads of
one query (position ``q0 + t``) and walks the keys that query may see, ``BLOCK_S`` rows a step, each
scored against every head of the block with ``tl.dot``, under an online softmax (running max ``m``,
sum ``l`` and weighted key sum ``acc`` in float32; K = V, so the same rows are the values):

1. its window rows ``keys[lo:hi]`` (``lo = max(0, pos - W + 1 - first)``, ``hi = pos - first + 1``);
2. its compressed entries: the first ``min(C, (pos + 1) // ratio)`` rows of ``entries`` (``MODE`` 1,
   HCA), or the rows ``select[t, :]`` names, ``-1`` for none (``MODE`` 2, CSA: the indexer's top-k,
   gathered row by row straight from the entry buffer).

It ends with the sink (logit ``sink[h]``, value zero): ``out = acc e^(m - M) / (l e^(m - M) +
e^(sink - M))``, ``M = max(m, sink)``. ``m`` starts at a finite floor, so hidden rows (logit ``-inf``)
weigh exactly zero and no ``inf - inf`` arises. Nothing ``[n, T, S]`` is ever written: the scores
live in registers.

Compiles: positions, counts and strides move with the chunk and are not specialised, so one variant
per (dtype, head dim, heads block, mode) serves every prompt length.
"""

from __future__ import annotations

import triton
import triton.language as tl

from shardsmith.runtime.layers.kernels.deepseek_v4._sink_attention_triton import FLOOR, online_step


@triton.jit
def _attend_rows(q, k, valid, m, l, acc, scale, DOT_F32: tl.constexpr):
    """:func:`online_step` over rows ``k`` of which ``valid [BLOCK_S]`` are seen (the rest weigh 0)."""
    return online_step(q, k, tl.where(valid, 0.0, float("-inf")), m, l, acc, scale, DOT_F32)


@triton.jit(do_not_specialize=["q0", "first", "n_entries", "topk", "stride_qt", "stride_st", "stride_ot"])
def _prefill_attention_kernel(q_ptr, k_ptr, e_ptr, sel_ptr, sink_ptr, out_ptr,
                              n, d, q0, first, window, ratio, n_entries, topk, scale,
                              stride_qt, stride_qh, stride_ks, stride_es, stride_st, stride_ot, stride_oh,
                              MODE: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    t, hb = tl.program_id(0), tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    h_mask, d_mask = heads < n, dims < d
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if DOT_F32:
        q = q.to(tl.float32)
    m = tl.full((BLOCK_H,), FLOOR, tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    pos = q0 + t
    lo = tl.maximum(pos - window + 1 - first, 0)
    hi = pos - first + 1
    for s0 in range(lo, hi, BLOCK_S):  # 1. the window
        rows = s0 + tl.arange(0, BLOCK_S)
        valid = rows < hi
        k = tl.load(k_ptr + rows[:, None] * stride_ks + dims[None, :], mask=valid[:, None] & d_mask[None, :],
                    other=0.0)
        m, l, acc = _attend_rows(q, k, valid, m, l, acc, scale, DOT_F32)
    if MODE == 1:  # 2. every complete entry (HCA)
        count = tl.minimum((pos + 1) // ratio, n_entries)
        for s0 in range(0, count, BLOCK_S):
            rows = s0 + tl.arange(0, BLOCK_S)
            valid = rows < count
            k = tl.load(e_ptr + rows[:, None] * stride_es + dims[None, :], mask=valid[:, None] & d_mask[None, :],
                        other=0.0)
            m, l, acc = _attend_rows(q, k, valid, m, l, acc, scale, DOT_F32)
    if MODE == 2:  # 2. the indexer's picks (CSA), gathered
        for s0 in range(0, topk, BLOCK_S):
            cols = s0 + tl.arange(0, BLOCK_S)
            idx = tl.load(sel_ptr + t * stride_st + cols, mask=cols < topk, other=-1)
            valid = (idx >= 0) & (idx < n_entries)
            k = tl.load(e_ptr + idx[:, None] * stride_es + dims[None, :], mask=valid[:, None] & d_mask[None, :],
                        other=0.0)
            m, l, acc = _attend_rows(q, k, valid, m, l, acc, scale, DOT_F32)
    sink = tl.load(sink_ptr + heads, mask=h_mask, other=0.0)
    top = tl.maximum(m, sink)
    w = tl.exp(m - top)
    total = l * w + tl.exp(sink - top)
    out = acc * (w / total)[:, None]
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


def launch(q, keys, entries, select, sink, out, *, q0: int, first: int, window: int, ratio: int, scale: float,
           mode: int, block_h: int, block_s: int, dot_f32: bool, num_warps: int) -> None:
    """Run the kernel for ``q [T, n, d]`` into ``out``; ``entries [C, d]`` and ``select [T, K]`` int32
    may be placeholders where ``mode`` does not read them (0: window only, 1: every complete entry,
    2: the selected ones)."""
    T, n, d = q.shape
    _prefill_attention_kernel[(T, triton.cdiv(n, block_h))](
        q, keys, entries, select, sink, out, n, d, q0, first, window, ratio, entries.shape[0], select.shape[1],
        scale, q.stride(0), q.stride(1), keys.stride(0), entries.stride(0), select.stride(0), out.stride(0),
        out.stride(1), MODE=mode, DOT_F32=dot_f32, BLOCK_H=block_h, BLOCK_S=block_s,
        BLOCK_D=triton.next_power_of_2(d), num_warps=num_warps, num_stages=2)
