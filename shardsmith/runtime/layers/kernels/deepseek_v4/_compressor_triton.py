"""Triton kernel behind :func:`~shardsmith.runtime.layers.kernels.deepseek_v4.compressor_step.compressor_step`.

``_compressor_step_kernel`` (grid ``[B]``): a program per decode row. Every row copies its new kv and
gate into its slot's window row ``column``; a done row then (a runtime branch, so the other ``r - 1``
steps of ``r`` cost one row copy) pools its window over the ``ROWS`` rows (``r``, or ``2r`` with
CSA's overlap: ``prev`` then the window's Cb half) in chunks of ``BLOCK_R`` rows and three passes
per channel (the gates' max, the sum of their exponentials, then the weights and the weighted kv
sum: softmax as ``exp(g - max) / sum``), norms the pooled row, stores it as the entry, and rotates
the entry's trailing ``ROPE`` channels in place (the pair partner re-read from the stored row);
with overlap it then copies the window's Ca half and its gates (``ape`` added) to ``prev``.

Ordering inside a program: each step's stores are followed by ``tl.debug_barrier`` (a CTA barrier,
which also makes the program's global stores visible to its own threads) before the next step
reads them, and the pooling's reads of ``prev`` are finished before it is overwritten.

Compiles: one variant per (dtype, ratio, entry dim, rope dims, overlap); row strides that move with
the buffer sizes are not specialised.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _window_rows(buf_row, ape_ptr, pkv_row, pg_row, j, cols, c_mask,
                 R: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, OVERLAP: tl.constexpr):
    """``(kv, gate)`` ``[BLOCK_R, BLOCK_D]`` of pooled rows ``j``: kv in the buffer's dtype (0 past
    ``ROWS``), the gate in float32 with ``ape`` added (``-inf`` past ``ROWS``)."""
    WIDTH: tl.constexpr = 2 * D if OVERLAP else D
    r_mask = j < ROWS
    if OVERLAP:  # rows [0, R): the carry; [R, 2R): this window's Cb half (channels D..2D)
        carry = j < R
        w = tl.where(carry, 0, j - R)
        m_carry = (carry & r_mask)[:, None] & c_mask[None, :]
        m_win = (~carry & r_mask)[:, None] & c_mask[None, :]
        at = w[:, None] * 2 * WIDTH + D + cols[None, :]
        kv = tl.load(pkv_row + j[:, None] * D + cols[None, :], mask=m_carry, other=0.0) + \
            tl.load(buf_row + at, mask=m_win, other=0.0)
        win_gate = tl.load(buf_row + at + WIDTH, mask=m_win, other=0.0).to(tl.float32) + \
            tl.load(ape_ptr + w[:, None] * WIDTH + D + cols[None, :], mask=m_win, other=0.0)
        gate = tl.where(carry[:, None], tl.load(pg_row + j[:, None] * D + cols[None, :], mask=m_carry, other=0.0),
                        win_gate)
    else:
        m = r_mask[:, None] & c_mask[None, :]
        at = j[:, None] * 2 * WIDTH + cols[None, :]
        kv = tl.load(buf_row + at, mask=m, other=0.0)
        gate = tl.load(buf_row + at + WIDTH, mask=m, other=0.0).to(tl.float32) + \
            tl.load(ape_ptr + j[:, None] * WIDTH + cols[None, :], mask=m, other=0.0)
    return kv, tl.where(r_mask[:, None], gate, float("-inf"))


@triton.jit
def _take_row(b, kvg_ptr, buf_ptr, ape_ptr, w_ptr, ent_ptr, idx_ptr, col_ptr, done_ptr, entry_ptr, cs_ptr, sn_ptr,
              pkv_ptr, pg_ptr, eps, stride_kb, stride_en, stride_ee,
              R: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr, OVERLAP: tl.constexpr,
              BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """Row ``b``: its kv and gate into its slot's window and, when done, the pooled entry (and carry)."""
    WIDTH: tl.constexpr = 2 * D if OVERLAP else D
    ROWS: tl.constexpr = 2 * R if OVERLAP else R
    slot = tl.load(idx_ptr + b)
    buf_row = buf_ptr + slot * (R * 2 * WIDTH)  # this slot's window [R, 2, WIDTH]
    # 1. the row's kv and gate into the window
    offs = tl.arange(0, BLOCK_W)
    w_mask = offs < WIDTH
    new_row = buf_row + tl.load(col_ptr + b) * 2 * WIDTH
    tl.store(new_row + offs, tl.load(kvg_ptr + b * stride_kb + offs, mask=w_mask), mask=w_mask)
    tl.store(new_row + WIDTH + offs, tl.load(kvg_ptr + b * stride_kb + WIDTH + offs, mask=w_mask), mask=w_mask)
    if tl.load(done_ptr + b) != 0:
        tl.debug_barrier()  # the row just stored is read back below
        cols = tl.arange(0, BLOCK_D)
        c_mask = cols < D
        pkv_row = pkv_ptr + slot * (R * D)
        pg_row = pg_ptr + slot * (R * D)
        rows = tl.arange(0, BLOCK_R)
        # 2. softmax over the window rows per channel: max, then sum of exp, then the weighted kv sum
        g_max = tl.full((BLOCK_D,), float("-inf"), tl.float32)
        for j0 in range(0, ROWS, BLOCK_R):
            _, gate = _window_rows(buf_row, ape_ptr, pkv_row, pg_row, j0 + rows, cols, c_mask, R, D, ROWS, OVERLAP)
            g_max = tl.maximum(g_max, tl.max(gate, axis=0))
        g_max = tl.where(c_mask, g_max, 0.0)  # lanes past D: finite
        g_sum = tl.zeros((BLOCK_D,), tl.float32)
        for j0 in range(0, ROWS, BLOCK_R):
            _, gate = _window_rows(buf_row, ape_ptr, pkv_row, pg_row, j0 + rows, cols, c_mask, R, D, ROWS, OVERLAP)
            g_sum += tl.sum(tl.exp(gate - g_max[None, :]), axis=0)
        g_sum = tl.where(c_mask, g_sum, 1.0)
        dt = buf_ptr.dtype.element_ty
        pooled = tl.zeros((BLOCK_D,), tl.float32)
        for j0 in range(0, ROWS, BLOCK_R):
            kv, gate = _window_rows(buf_row, ape_ptr, pkv_row, pg_row, j0 + rows, cols, c_mask, R, D, ROWS, OVERLAP)
            weight = (tl.exp(gate - g_max[None, :]) / g_sum[None, :]).to(dt)  # the reference's weights in kv's dtype
            pooled += tl.sum((kv.to(tl.float32) * weight.to(tl.float32)).to(dt).to(tl.float32), axis=0)
        # 3. RMSNorm (float32, weighted, in the kv dtype), stored as the entry; then RoPE in place
        h = pooled.to(dt).to(tl.float32)
        h = h * tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
        normed = (tl.load(w_ptr + cols, mask=c_mask, other=0.0) * h).to(dt)
        ent_row = ent_ptr + slot * stride_en + tl.load(entry_ptr + b) * stride_ee
        tl.store(ent_row + cols, normed, mask=c_mask)
        tl.debug_barrier()
        pairs = tl.arange(0, ROPE)
        at = D - ROPE + pairs
        x = tl.load(ent_row + at).to(tl.float32)
        partner = tl.load(ent_row + D - ROPE + (pairs ^ 1)).to(tl.float32)  # the pair's other channel
        rotated = x * tl.load(cs_ptr + b * ROPE + pairs) + partner * tl.load(sn_ptr + b * ROPE + pairs)
        tl.debug_barrier()  # every thread's reads of the unrotated row done
        tl.store(ent_row + at, rotated.to(dt))
        if OVERLAP:  # 4. this window's Ca half becomes the carry (the pooling read the old one above)
            for j0 in range(0, R, BLOCK_R):
                j = j0 + rows
                m = (j < R)[:, None] & c_mask[None, :]
                at2 = j[:, None] * 2 * WIDTH + cols[None, :]
                kv = tl.load(buf_row + at2, mask=m, other=0.0)
                gate = tl.load(buf_row + at2 + WIDTH, mask=m, other=0.0).to(tl.float32) + \
                    tl.load(ape_ptr + j[:, None] * WIDTH + cols[None, :], mask=m, other=0.0)
                tl.store(pkv_row + j[:, None] * D + cols[None, :], kv, mask=m)
                tl.store(pg_row + j[:, None] * D + cols[None, :], gate, mask=m)




@triton.jit(do_not_specialize=["stride_kb", "stride_en", "stride_ee"])
def _compressor_step_kernel(kvg_ptr, buf_ptr, ape_ptr, w_ptr, ent_ptr, idx_ptr, col_ptr, done_ptr, entry_ptr,
                            cs_ptr, sn_ptr, pkv_ptr, pg_ptr, run_ptr, eps, stride_kb, stride_en, stride_ee,
                            R: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr, OVERLAP: tl.constexpr,
                            RUNS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    b = tl.program_id(0)
    if RUNS:  # a run's first row takes its rows in order; the run's other rows' programs do nothing
        for j in range(0, tl.load(run_ptr + b)):
            tl.debug_barrier()  # the last row's stores seen, and its reads done, before this row's
            _take_row(b + j, kvg_ptr, buf_ptr, ape_ptr, w_ptr, ent_ptr, idx_ptr, col_ptr, done_ptr, entry_ptr,
                      cs_ptr, sn_ptr, pkv_ptr, pg_ptr, eps, stride_kb, stride_en, stride_ee,
                      R, D, ROPE, OVERLAP, BLOCK_W, BLOCK_D, BLOCK_R)
    else:
        _take_row(b, kvg_ptr, buf_ptr, ape_ptr, w_ptr, ent_ptr, idx_ptr, col_ptr, done_ptr, entry_ptr,
                  cs_ptr, sn_ptr, pkv_ptr, pg_ptr, eps, stride_kb, stride_en, stride_ee,
                  R, D, ROPE, OVERLAP, BLOCK_W, BLOCK_D, BLOCK_R)


def launch(kv_gate, buf, ape, weight, entries, index, column, done_u8, entry, cs, sn, prev_kv, prev_gate, *,
           eps: float, run=None) -> None:
    """One program per row of ``kv_gate [B, 2, width]`` (rows may be strided; each row's ``[2, width]``
    contiguous), shapes as ``compressor_step``'s module table; ``run`` ``[B]`` int32/int64: the rows
    program ``b`` takes, from row ``b`` on (a run's length at its first row, 0 at its other rows)."""
    B = kv_gate.shape[0]
    _, r, _, width = buf.shape
    d = entries.shape[-1]
    overlap = prev_kv is not None
    rows = (2 if overlap else 1) * r
    _compressor_step_kernel[(B,)](
        kv_gate, buf, ape, weight, entries, index, column, done_u8, entry, cs, sn,
        prev_kv if overlap else buf, prev_gate if overlap else ape, index if run is None else run, eps,
        kv_gate.stride(0), entries.stride(0), entries.stride(1),
        R=r, D=d, ROPE=cs.shape[1], OVERLAP=overlap, RUNS=run is not None, BLOCK_W=triton.next_power_of_2(width),
        BLOCK_D=triton.next_power_of_2(d), BLOCK_R=min(8, triton.next_power_of_2(rows)), num_warps=4)
