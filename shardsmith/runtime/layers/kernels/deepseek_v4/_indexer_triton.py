"""Triton kernel behind :func:`~shardsmith.runtime.layers.kernels.deepseek_v4.indexer_scores.indexer_scores`.

``_indexer_scores_kernel`` (grid ``[B, ceil(C / BLOCK_S)]``): one program loads one row's index
queries ``q [h, c]`` and weights ``w [h]`` and ``BLOCK_S`` of its slot's entries ``[BLOCK_S, c]``
straight from the buffer, computes every head's dot product with ``tl.dot`` (float32 accumulation),
then ``relu``, the ``c^-1/2`` scale and the head weights, summed over the heads: ``[BLOCK_S]`` scores.

``_indexer_prefill_kernel`` (grid ``[ceil(T / BLOCK_T), ceil(C / BLOCK_S)]``): one sequence's chunk of
``T`` queries at once. One program loads ``BLOCK_S`` entries once and, head by head, scores a
``BLOCK_T``-query tile against them with ``tl.dot`` (each query tile read once per entry block, not
once per query and block), adding ``relu(dots) * c^-1/2 * w[t, head]`` in float32 in head order; an
entry not yet complete for a query is written ``-inf``, and a block past every query's complete
entries skips the dots.

Compiles: the column count and the row strides that move with the bucket are not specialised, so one
variant per (dtype, heads, head dim) serves every bucket and batch; the prefill kernel specialises on
none of the chunk's length, position or entry count either.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["columns", "stride_ob"])
def _indexer_scores_kernel(q_ptr, w_ptr, e_ptr, idx_ptr, out_ptr, h, c, columns, scale,
                           stride_qb, stride_qh, stride_wb, stride_en, stride_es, stride_ob,
                           DOT_F32: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
                           BLOCK_S: tl.constexpr):
    b, sb = tl.program_id(0), tl.program_id(1)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_C)
    cols = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    h_mask, c_mask, s_mask = heads < h, dims < c, cols < columns
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=h_mask[:, None] & c_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_C]
    slot = tl.load(idx_ptr + b)
    k = tl.load(e_ptr + slot * stride_en + cols[:, None] * stride_es + dims[None, :],
                mask=s_mask[:, None] & c_mask[None, :], other=0.0)  # [BLOCK_S, BLOCK_C]
    if DOT_F32:
        dots = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        dots = tl.dot(q, tl.trans(k))  # [BLOCK_H, BLOCK_S] float32
    w = tl.load(w_ptr + b * stride_wb + heads, mask=h_mask, other=0.0)
    score = tl.sum(tl.maximum(dots, 0.0) * scale * w[:, None], axis=0)  # [BLOCK_S]
    tl.store(out_ptr + b * stride_ob + cols, score, mask=s_mask)


def launch(q, w, entries, index, out, *, block_s: int, dot_f32: bool) -> None:
    """Scores of ``q [B, h, c]`` over ``entries[index, :C]`` into ``out [B, C]`` float32."""
    B, h, c = q.shape
    columns = out.shape[1]
    block_h = max(16, triton.next_power_of_2(h))
    _indexer_scores_kernel[(B, triton.cdiv(columns, block_s))](
        q, w, entries, index, out, h, c, columns, c ** -0.5,
        q.stride(0), q.stride(1), w.stride(0), entries.stride(0), entries.stride(1), out.stride(0),
        DOT_F32=dot_f32, BLOCK_H=block_h, BLOCK_C=max(16, triton.next_power_of_2(c)), BLOCK_S=block_s,
        num_warps=4)


@triton.jit(do_not_specialize=["T", "columns", "q0"])
def _indexer_prefill_kernel(q_ptr, w_ptr, e_ptr, out_ptr, T, h, c, columns, q0, ratio, scale,
                            stride_qt, stride_qh, stride_wt, stride_es, stride_ot,
                            DOT_F32: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                            BLOCK_S: tl.constexpr):
    tb, sb = tl.program_id(0), tl.program_id(1)
    rows = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_C)
    t_mask, s_mask, c_mask = rows < T, cols < columns, dims < c
    complete = (q0 + rows + 1) // ratio  # [BLOCK_T]: entries each query may see
    seen = cols[None, :] < complete[:, None]  # [BLOCK_T, BLOCK_S]
    score = tl.zeros((BLOCK_T, BLOCK_S), tl.float32)
    last = tl.minimum(q0 + tb * BLOCK_T + BLOCK_T, q0 + T)  # one past the block's last position
    if sb * BLOCK_S < last // ratio:  # a block past every query's complete entries is all hidden
        k = tl.load(e_ptr + cols[:, None] * stride_es + dims[None, :], mask=s_mask[:, None] & c_mask[None, :],
                    other=0.0)  # [BLOCK_S, BLOCK_C]: read once for every head
        if DOT_F32:
            k = k.to(tl.float32)
        for head in range(0, h):
            q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + dims[None, :],
                        mask=t_mask[:, None] & c_mask[None, :], other=0.0)  # [BLOCK_T, BLOCK_C]
            if DOT_F32:
                dots = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")
            else:
                dots = tl.dot(q, tl.trans(k))  # [BLOCK_T, BLOCK_S] float32
            w = tl.load(w_ptr + rows * stride_wt + head, mask=t_mask, other=0.0)
            score += tl.maximum(dots, 0.0) * scale * w[:, None]
    score = tl.where(seen, score, float("-inf"))
    tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :], score, mask=t_mask[:, None] & s_mask[None, :])


def launch_prefill(q, w, entries, out, *, q0: int, ratio: int, block_t: int, block_s: int, dot_f32: bool,
                   num_warps: int) -> None:
    """Scores of one sequence's ``q [T, h, c]`` at positions ``q0 ..`` over ``entries [C, c]`` into
    ``out [T, C]`` float32, ``-inf`` where an entry is not complete for the query."""
    T, h, c = q.shape
    columns = out.shape[1]
    _indexer_prefill_kernel[(triton.cdiv(T, block_t), triton.cdiv(columns, block_s))](
        q, w, entries, out, T, h, c, columns, q0, ratio, c ** -0.5,
        q.stride(0), q.stride(1), w.stride(0), entries.stride(0), out.stride(0),
        DOT_F32=dot_f32, BLOCK_T=block_t, BLOCK_C=max(16, triton.next_power_of_2(c)), BLOCK_S=block_s,
        num_warps=num_warps)
