"""Triton kernels behind :func:`~shardsmith.runtime.layers.kernels.deepseek_v4.sink_attention.sink_attention`.

``_sink_split_kernel`` (grid ``[B, ceil(n / BLOCK_H), splits]``): one program takes ``BLOCK_H`` query
heads of one row and one chunk of its key columns, loads each key row of the chunk once
(``keys[index[b], s]``, straight from the layer's buffer: no gathered copy), scores it against every
head with ``tl.dot``, adds the column's bias, and keeps an online softmax (running max ``m``, sum
``l``, and the weighted key sum ``acc`` in float32). A chunk whose columns are all hidden leaves ``m``
at a finite floor, ``l = 0`` and ``acc = 0``, so no ``inf - inf`` arises. ``_sink_merge_kernel`` (grid
``[B, n]``) joins the splits with the sink column (logit ``sink[h]``, value zero): ``M = max(sink,
m_i)``, ``out = sum(acc_i e^(m_i - M)) / (e^(sink - M) + sum(l_i e^(m_i - M)))``.

Compiles: the column counts, strides and split count that move with the length bucket and the rows
are not specialised (``do_not_specialize``; the merge walks the splits 8 at a time), so one split
kernel per (dtype, head dim, one or two biases) and one merge kernel serve every bucket and batch.
"""

from __future__ import annotations

import triton
import triton.language as tl

FLOOR = tl.constexpr(-1.0e30)  # the running max's start: finite, below any real logit (a constexpr: jit code reads no other globals)


@triton.jit
def online_step(q, k, bias, m, l, acc, scale, DOT_F32: tl.constexpr):
    """One step of the online softmax over key rows ``k [BLOCK_S, BLOCK_D]`` (K = V) for queries ``q
    [BLOCK_H, BLOCK_D]`` (float32 when ``DOT_F32``): logits ``scale * q k^T + bias`` (``bias
    [BLOCK_S]``: 0 or ``-inf``), the running max ``m``, sum ``l`` and weighted key sum ``acc``
    updated; returns ``(m, l, acc)``. Shared by the decode and prefill kernels."""
    if DOT_F32:
        k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))  # [BLOCK_H, BLOCK_S] float32
    logits = qk * scale + bias[None, :]
    m_new = tl.maximum(m, tl.max(logits, axis=1))
    p = tl.exp(logits - m_new[:, None])
    alpha = tl.exp(m - m_new)
    l = l * alpha + tl.sum(p, axis=1)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p, k, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k)
    return m_new, l, acc


@triton.jit(do_not_specialize=["c1", "columns", "chunk", "stride_b1", "stride_b2"])
def _sink_split_kernel(q_ptr, k_ptr, idx_ptr, b1_ptr, b2_ptr, m_ptr, l_ptr, acc_ptr,
           n, d, c1, columns, chunk, scale,
           stride_qb, stride_qh, stride_kn, stride_ks, stride_b1, stride_b2,
           TWO: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
           BLOCK_D: tl.constexpr):
    b, hb, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits = tl.num_programs(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    h_mask, d_mask = heads < n, dims < d
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if DOT_F32:
        q = q.to(tl.float32)
    slot = tl.load(idx_ptr + b)
    k_row = k_ptr + slot * stride_kn + stride_ks  # column 0 of the bias = key row 1 (row 0 is the sink)
    m = tl.full((BLOCK_H,), FLOOR, tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, columns)
    for s0 in range(lo, hi, BLOCK_S):
        cols = s0 + tl.arange(0, BLOCK_S)
        c_mask = cols < hi
        k = tl.load(k_row + cols[:, None] * stride_ks + dims[None, :], mask=c_mask[:, None] & d_mask[None, :],
                    other=0.0)  # [BLOCK_S, BLOCK_D]
        bias = tl.load(b1_ptr + b * stride_b1 + cols, mask=c_mask & (cols < c1), other=float("-inf"))
        if TWO:
            bias2 = tl.load(b2_ptr + b * stride_b2 + (cols - c1), mask=c_mask & (cols >= c1), other=float("-inf"))
            bias = tl.where(cols < c1, bias, bias2)
        m, l, acc = online_step(q, k, bias, m, l, acc, scale, DOT_F32)
    part = (b * n + heads) * splits + sp  # [B, n, splits] row-major
    tl.store(m_ptr + part, m, mask=h_mask)
    tl.store(l_ptr + part, l, mask=h_mask)
    tl.store(acc_ptr + part[:, None] * d + dims[None, :], acc, mask=h_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["splits"])
def _sink_merge_kernel(m_ptr, l_ptr, acc_ptr, sink_ptr, out_ptr, n, d, splits, stride_ob, stride_oh,
           BLOCK_SP: tl.constexpr, BLOCK_D: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < d
    base = (b * n + h) * splits
    sink = tl.load(sink_ptr + h)
    top = sink
    for s0 in range(0, splits, BLOCK_SP):  # the largest of the sink and the splits' maxima
        sps = s0 + tl.arange(0, BLOCK_SP)
        top = tl.maximum(top, tl.max(tl.load(m_ptr + base + sps, mask=sps < splits, other=FLOOR), axis=0))
    total = tl.exp(sink - top)
    out = tl.zeros((BLOCK_D,), tl.float32)
    for s0 in range(0, splits, BLOCK_SP):
        sps = s0 + tl.arange(0, BLOCK_SP)
        sp_mask = sps < splits
        w = tl.exp(tl.load(m_ptr + base + sps, mask=sp_mask, other=FLOOR) - top)  # [BLOCK_SP]
        total += tl.sum(tl.load(l_ptr + base + sps, mask=sp_mask, other=0.0) * w, axis=0)
        acc = tl.load(acc_ptr + (base + sps)[:, None] * d + dims[None, :], mask=sp_mask[:, None] & d_mask[None, :],
                      other=0.0)
        out += tl.sum(acc * w[:, None], axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + dims, (out / total).to(out_ptr.dtype.element_ty), mask=d_mask)


def launch(q, keys, index, biases, sink, scale, out, part_m, part_l, part_acc, *, chunk: int, block_h: int,
           block_s: int, dot_f32: bool) -> None:
    """Run both kernels for ``q [B, n, d]`` into ``out``; ``part_*`` are the splits' workspaces
    ``[B, n, splits]`` (and ``[B, n, splits, d]``) float32."""
    B, n, d = q.shape
    splits = part_m.shape[2]
    b1 = biases[0]
    b2 = biases[1] if len(biases) > 1 else b1
    c1 = b1.shape[1]
    columns = c1 + (biases[1].shape[1] if len(biases) > 1 else 0)
    block_d = triton.next_power_of_2(d)
    _sink_split_kernel[(B, triton.cdiv(n, block_h), splits)](
        q, keys, index, b1, b2, part_m, part_l, part_acc, n, d, c1, columns, chunk, scale,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), b1.stride(0), b2.stride(0),
        TWO=len(biases) > 1, DOT_F32=dot_f32, BLOCK_H=block_h, BLOCK_S=block_s, BLOCK_D=block_d,
        num_warps=4 if block_d <= 128 else 8, num_stages=2)
    _sink_merge_kernel[(B, n)](part_m, part_l, part_acc, sink, out, n, d, splits, out.stride(0), out.stride(1),
                   BLOCK_SP=8, BLOCK_D=block_d, num_warps=4)
