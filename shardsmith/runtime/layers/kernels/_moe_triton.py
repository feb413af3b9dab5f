"""Triton kernels behind :func:`~shardsmith.runtime.layers.kernels.fused_moe.fused_experts`.

Two paths. The pair path (end of this file: ``_pair_gate_up_kernel``, ``_pair_down_kernel``, then the
combine) gives every (token, expert) pair its own programs. The grouped path: three launches per
call, after one device sort of the (token, expert) pairs by expert (or slot) id:

1. :func:`_gate_up_kernel`, grid ``(P, cdiv(I, BLOCK_I))``: the program at sorted position ``j``
   leads when ``j`` starts a run of one expert (or each 16th pair of a longer run); it gathers the
   run's token rows (up to 16, padded for ``tl.dot``), streams that expert's gate and up rows once
   (FP4 nibbles decoded and scaled in registers), applies SwiGLU with the clamp and writes
   ``h [P, I]`` in the activation dtype. Other programs return at once. FP8 rows are scaled by
   their float32 block scale in registers (scale rows ``S_R`` onward belong to up).
2. :func:`_down_kernel`, grid ``(P, cdiv(D, BLOCK_N))``: the same leaders stream the expert's down
   rows, multiply by the routing weight and write each pair's float32 row ``y [P, D]``.
3. :func:`_combine_kernel`: ``out[t] = sum_k y[t*K + k]`` in k order, cast (deterministic; no atomics).

Grouping by expert so each expert's bytes are read once per step follows vLLM/SGLang's fused MoE
(``moe_align_block_size``); the in-kernel leader test replaces their host-sized padding so every
shape is fixed by ``T*K`` alone (CUDA-graph friendly). FP4 e2m1 is decoded with bit arithmetic:
code ``c = s|e1 e0|m`` is ``m/2`` when ``e = 0``, else ``(1 + m/2) * 2^(e-1)``; the UE8M0 byte ``s``
is the float32 ``2^(s-127)`` whose bits are ``s << 23``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e2m1(code):
    """float32 value of 4-bit e2m1 codes (int32 tensor, 0..15): exact."""
    mag = code & 7
    e, m = mag >> 1, mag & 1
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _ue8m0(byte):
    """float32 ``2^(byte-127)`` of UE8M0 bytes (uint8 tensor); exact for bytes 1..254."""
    return (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _run_rows(sorted_ptr, P, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr):
    """``(skip, e, rows, row_mask)`` for the program at sorted position ``program_id(0)``: ``skip``
    unless it leads a run (or a 16-pair chunk of one) of expert ``e``, whose pairs sit at ``rows``."""
    j = tl.program_id(0)
    offs_p = tl.arange(0, BLOCK_P)
    all_e = tl.load(sorted_ptr + offs_p, mask=offs_p < P, other=2147483647)
    e = tl.load(sorted_ptr + j)
    first = tl.sum((all_e < e).to(tl.int32))  # where this expert's run starts
    rows = j + tl.arange(0, BLOCK_M)
    row_mask = (rows < P) & (tl.load(sorted_ptr + rows, mask=rows < P, other=-1) == e)
    return (j - first) % BLOCK_M != 0, e, rows, row_mask


@triton.jit
def _rows_dot(acc, a_ptr, a_rows, a_stride, row_mask, w_ptr, w_rows, w_stride, s_ptr, s_rows, s_stride, k0, KDIM,
              FP4: tl.constexpr, FP8: tl.constexpr, B1: tl.constexpr, SCALED_DOT: tl.constexpr,
              BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """``acc += a[a_rows, k0:k0+BLOCK_K] @ W[w_rows, k0:k0+BLOCK_K].T`` (W FP4-packed, FP8 or plain).

    FP4 reads its scales at rows ``w_rows`` (one byte per 32 elements); FP8 reads float32 block
    scales at rows ``s_rows`` and column ``k // B1`` and scales each weight in float32 before the
    cast, exactly as ``dequantize_blocks`` does."""
    ks = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + a_rows[:, None] * a_stride + ks[None, :], mask=row_mask[:, None] & (ks < KDIM)[None, :],
                other=0.0)  # [BLOCK_M, BLOCK_K]
    w_ok = w_rows >= 0
    if FP4:
        G: tl.constexpr = BLOCK_K // 32  # scale groups in this step
        g = k0 // 32 + tl.arange(0, G)
        s_mask = w_ok[:, None] & (g < KDIM // 32)[None, :]
        scale_u8 = tl.load(s_ptr + w_rows[:, None] * s_stride + g[None, :], mask=s_mask, other=0)  # [BLOCK_R, G]
        if SCALED_DOT:  # Triton's microscaling dot (OCP MX e2m1 + E8M0 per 32): it upcasts on Hopper
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            byte = tl.load(w_ptr + w_rows[None, :] * w_stride + kb[:, None],
                           mask=w_ok[None, :] & (kb < KDIM // 2)[:, None], other=0)  # [BLOCK_K/2, BLOCK_R]
            acc = tl.dot_scaled(a, None, "bf16", byte, scale_u8, "e2m1", acc)
        else:
            b = tl.arange(0, 16)
            kb = k0 // 2 + (tl.arange(0, G) * 16)[:, None] + b[None, :]  # [G, 16] byte columns
            byte = tl.load(w_ptr + w_rows[:, None, None] * w_stride + kb[None, :, :],
                           mask=w_ok[:, None, None] & (kb < KDIM // 2)[None, :, :], other=0)
            byte = byte.to(tl.int32) & 0xFF  # [BLOCK_R, G, 16]
            scale = _ue8m0(scale_u8)[:, :, None]
            w = tl.join(_e2m1(byte & 0xF) * scale, _e2m1(byte >> 4) * scale)  # [BLOCK_R, G, 16, 2]: low nibble first
            w = tl.reshape(w, (BLOCK_R, BLOCK_K))
            if DOT_F32:
                acc += tl.dot(a.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(w.to(a.dtype)))
    else:
        w_mask = w_ok[:, None] & (ks < KDIM)[None, :]
        w = tl.load(w_ptr + w_rows[:, None] * w_stride + ks[None, :], mask=w_mask, other=0.0)
        if FP8:
            if B1 % BLOCK_K == 0:  # the step's columns lie in one scale column (k0 is a multiple of BLOCK_K): one per row
                s = tl.load(s_ptr + s_rows * s_stride + k0 // B1, mask=w_ok, other=0.0)  # [BLOCK_R]
                w = w.to(tl.float32) * s[:, None]
            else:  # [BLOCK_R, BLOCK_K] scale gather (cached: 4 bytes per b0 x b1 block); any block, ragged edges
                s = tl.load(s_ptr + s_rows[:, None] * s_stride + (ks // B1)[None, :], mask=w_mask, other=0.0)
                w = w.to(tl.float32) * s
        if DOT_F32:
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w.to(a.dtype)))
    return acc


@triton.jit
def _glu(gate, up, limit, alpha, HAS_LIMIT: tl.constexpr, HAS_ALPHA: tl.constexpr):
    """The experts' gated unit in float32: ``silu(gate) * up`` (Mixtral, DeepSeek), or with ``HAS_ALPHA``
    gpt-oss's ``(up + 1) * gate * sigmoid(alpha * gate)``; with ``HAS_LIMIT`` gate is clamped to at most
    ``limit`` and up to ``[-limit, limit]`` first (DeepSeek-V4, gpt-oss)."""
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    if HAS_ALPHA:
        return (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _gate_up_kernel(x_ptr, sorted_ptr, order_ptr, w_ptr, s_ptr, b_ptr, h_ptr, P, stride_x, stride_we, stride_wr,
                    stride_se, stride_sr, stride_be, limit, alpha, TOP_K: tl.constexpr, D: tl.constexpr,
                    I: tl.constexpr, FP4: tl.constexpr, FP8: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
                    S_R: tl.constexpr, SCALED_DOT: tl.constexpr, HAS_LIMIT: tl.constexpr, DOT_F32: tl.constexpr,
                    INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALPHA: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr):
    skip, e, rows, row_mask = _run_rows(sorted_ptr, P, BLOCK_P, BLOCK_M)
    if skip:
        return
    tok = tl.load(order_ptr + rows, mask=row_mask, other=0) // TOP_K
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    if INTERLEAVED:  # gpt-oss: row 2j gate channel j, row 2j + 1 up channel j; -1 masked
        g_rows = tl.where(offs_i < I, 2 * offs_i, -1)
        u_rows = tl.where(offs_i < I, 2 * offs_i + 1, -1)
    else:  # gate rows [0, I), up rows [I, 2I)
        g_rows = tl.where(offs_i < I, offs_i, -1)
        u_rows = tl.where(offs_i < I, offs_i + I, -1)
    if FP8:  # gate's block-scale rows, then up's from S_R (stacked like their weights; I may be ragged)
        gs_rows, us_rows = offs_i // B0, S_R + offs_i // B0
    else:
        gs_rows, us_rows = g_rows, u_rows
    w_e, s_e = w_ptr + e.to(tl.int64) * stride_we, s_ptr + e.to(tl.int64) * stride_se
    gate = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    for d in range((D + BLOCK_D - 1) // BLOCK_D):
        gate = _rows_dot(gate, x_ptr, tok, stride_x, row_mask, w_e, g_rows, stride_wr, s_e, gs_rows, stride_sr,
                         d * BLOCK_D, D, FP4, FP8, B1, SCALED_DOT, BLOCK_I, BLOCK_D, DOT_F32)
        up = _rows_dot(up, x_ptr, tok, stride_x, row_mask, w_e, u_rows, stride_wr, s_e, us_rows, stride_sr,
                       d * BLOCK_D, D, FP4, FP8, B1, SCALED_DOT, BLOCK_I, BLOCK_D, DOT_F32)
    if HAS_BIAS:
        b_e = b_ptr + e.to(tl.int64) * stride_be
        gate += tl.load(b_e + g_rows, mask=g_rows >= 0, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b_e + u_rows, mask=u_rows >= 0, other=0.0).to(tl.float32)[None, :]
    h = _glu(gate, up, limit, alpha, HAS_LIMIT, HAS_ALPHA)
    mask = row_mask[:, None] & (offs_i < I)[None, :]
    tl.store(h_ptr + rows[:, None] * I + offs_i[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _down_kernel(h_ptr, sorted_ptr, order_ptr, w_ptr, s_ptr, route_ptr, y_ptr, P, stride_we, stride_wr, stride_se,
                 stride_sr, D: tl.constexpr, I: tl.constexpr, FP4: tl.constexpr, FP8: tl.constexpr,
                 B0: tl.constexpr, B1: tl.constexpr, S_R: tl.constexpr, SCALED_DOT: tl.constexpr, DOT_F32: tl.constexpr,
                 BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    skip, e, rows, row_mask = _run_rows(sorted_ptr, P, BLOCK_P, BLOCK_M)
    if skip:
        return
    pair = tl.load(order_ptr + rows, mask=row_mask, other=0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    d_rows = tl.where(offs_n < D, offs_n, -1)
    if FP8:
        ds_rows = offs_n // B0
    else:
        ds_rows = d_rows
    w_e, s_e = w_ptr + e.to(tl.int64) * stride_we, s_ptr + e.to(tl.int64) * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range((I + BLOCK_K - 1) // BLOCK_K):
        acc = _rows_dot(acc, h_ptr, rows, I, row_mask, w_e, d_rows, stride_wr, s_e, ds_rows, stride_sr,
                        k * BLOCK_K, I, FP4, FP8, B1, SCALED_DOT, BLOCK_N, BLOCK_K, DOT_F32)
    acc *= tl.load(route_ptr + pair, mask=row_mask, other=0.0)[:, None]
    tl.store(y_ptr + pair[:, None] * D + offs_n[None, :], acc, mask=row_mask[:, None] & (offs_n < D)[None, :])


@triton.jit
def _combine_kernel(y_ptr, out_ptr, D: tl.constexpr, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + k) * D + offs, mask=offs < D, other=0.0)
    tl.store(out_ptr + t * D + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < D)


@triton.jit
def _tiles_mm_kernel(a_ptr, tile_ptr, w_ptr, s_ptr, out_ptr, stride_a, stride_out, stride_we, stride_wr, stride_se,
                     stride_sr, N: tl.constexpr, KDIM: tl.constexpr, FP4: tl.constexpr, FP8: tl.constexpr,
                     B0: tl.constexpr, B1: tl.constexpr, SPLIT: tl.constexpr, S_R: tl.constexpr,
                     SCALED_DOT: tl.constexpr, DOT_F32: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_N]`` block of :func:`~.fused_moe.grouped_gemm`: program ``tile * n_blocks + nb``
    multiplies rows ``[r0, r1)`` of ``a`` (tile ``tile`` of the table: expert ``e``, ``r0``, ``r1``) by output
    rows ``nb * BLOCK_N ..`` of expert ``e``'s matrix (FP4 decoded, FP8 block-scaled, or plain) in registers.
    FP8 output row ``r`` reads scale row ``r // B0`` below ``SPLIT`` and ``S_R + (r - SPLIT) // B0`` from it
    (gate and up stacked, each with its own scale rows). The output blocks of one tile are neighbours in
    launch order, so a tile's rows of ``a`` are read from HBM once and the experts in flight stay in L2."""
    pid = tl.program_id(0)
    n_blocks: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    tile, nb = pid // n_blocks, pid % n_blocks
    e = tl.load(tile_ptr + 3 * tile).to(tl.int64)
    r0 = tl.load(tile_ptr + 3 * tile + 1)
    r1 = tl.load(tile_ptr + 3 * tile + 2)
    rows = r0 + tl.arange(0, BLOCK_M)
    row_mask = rows < r1
    rows = rows.to(tl.int64)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = tl.where(offs_n < N, offs_n, -1)
    if FP8:
        s_rows = tl.where(offs_n < SPLIT, offs_n // B0, S_R + (offs_n - SPLIT) // B0)
    else:
        s_rows = w_rows
    w_e, s_e = w_ptr + e * stride_we, s_ptr + e * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range((KDIM + BLOCK_K - 1) // BLOCK_K):
        acc = _rows_dot(acc, a_ptr, rows, stride_a, row_mask, w_e, w_rows, stride_wr, s_e, s_rows, stride_sr,
                        k * BLOCK_K, KDIM, FP4, FP8, B1, SCALED_DOT, BLOCK_N, BLOCK_K, DOT_F32)
    tl.store(out_ptr + rows[:, None] * stride_out + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (offs_n < N)[None, :])


# --- the pair path: one (token, expert) pair per program row, CUDA-core dot products -----------------
#
# For decode batches the grouped path's tl.dot pads each expert's run to 16 rows and upcasts FP4 for
# the tensor cores; that upcast, not the bytes, set its time (benchmarks/RESULTS.md, h200x1b). Here
# each program owns BLOCK_R output rows of one pair and accumulates products in float32 registers
# (no reduction inside the loop but the one over a 32-element scale group, which stays in-thread):
# many small programs keep enough loads in flight, nothing is sorted, and a pair's result does not
# depend on the rest of the batch. An expert chosen by several tokens of the batch is read once per
# pair (the later reads mostly hit L2).


@triton.jit
def _e2m1_x16k(code):
    """float32 value of e2m1 codes (int32 tensor, 0..15) times ``2^-14``, exact: the three magnitude
    bits become a float16's two low exponent bits and top mantissa bit (a subnormal when ``e = 0``)."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _pair_rows(a_ptr, w_e, s_e, rows, ok, stride_w, stride_s, KDIM: tl.constexpr, FP4: tl.constexpr,
               BLOCK_R: tl.constexpr, G: tl.constexpr, dw_e, ds_e, wr, WRITE: tl.constexpr):
    """``W[rows, :KDIM] @ a[:KDIM]`` in float32 ``[BLOCK_R]`` for one expert ``W`` at ``w_e``.

    FP4: each step reads ``G`` scale groups (``16*G`` bytes) of every row, decodes both nibbles
    (element ``2i`` in the low one), sums each group in float32 and scales it by its UE8M0 byte.
    Plain weights: ``G`` elements per step. ``WRITE``: the bytes read (weights, FP4 scales) are also
    stored at ``dw_e`` / ``ds_e`` (same layout) where ``wr`` holds: an expert read from host memory
    written through to its new cache slot."""
    acc = tl.zeros((BLOCK_R, G), dtype=tl.float32)
    if FP4:
        b = tl.arange(0, 16)
        for g0 in range(0, KDIM // 32, G):
            g = g0 + tl.arange(0, G)
            g_ok = g < KDIM // 32
            a = tl.load(a_ptr + g[:, None] * 32 + tl.arange(0, 32)[None, :], mask=g_ok[:, None], other=0.0)
            a_lo, a_hi = tl.split(tl.reshape(a.to(tl.float32), (G, 16, 2)))  # each byte's even, odd element
            m = ok[:, None] & g_ok[None, :]
            w_off = rows[:, None, None] * stride_w + (g[:, None] * 16 + b[None, :])[None, :, :]
            raw = tl.load(w_e + w_off, mask=m[:, :, None], other=0)  # [BLOCK_R, G, 16]
            s_off = rows[:, None] * stride_s + g[None, :]
            sc = tl.load(s_e + s_off, mask=m, other=0)
            if WRITE:
                wm = tl.where(wr, m, False)  # (not ``m & wr``: Triton's interpreter refuses a scalar in the mask)
                tl.store(dw_e + w_off, raw, mask=wm[:, :, None])
                tl.store(ds_e + s_off, sc, mask=wm)
            byte = raw.to(tl.int32)
            part = tl.sum(_e2m1_x16k(byte & 15) * a_lo[None, :, :] + _e2m1_x16k(byte >> 4) * a_hi[None, :, :], axis=2)
            acc += part * _ue8m0(sc)
        return tl.sum(acc, axis=1) * 16384.0  # undo the decode's 2^-14 (exact: a power of two)
    else:
        for k0 in range(0, KDIM, G):
            k = k0 + tl.arange(0, G)
            k_ok = k < KDIM
            a = tl.load(a_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            w_off = rows[:, None] * stride_w + k[None, :]
            w = tl.load(w_e + w_off, mask=ok[:, None] & k_ok[None, :], other=0.0)
            if WRITE:
                tl.store(dw_e + w_off, w, mask=tl.where(wr, ok[:, None] & k_ok[None, :], False))
            acc += w.to(tl.float32) * a[None, :]
        return tl.sum(acc, axis=1)


@triton.jit
def _pair_expert(ids_ptr, dst_ptr, p, w_ptr, s_ptr, stride_we, stride_se, host_w, host_s, HOST: tl.constexpr):
    """Where pair ``p``'s expert is read: ``(weights, scales, write-through weights, scales, write?)``.
    ``ids[p] >= 0``: row ``ids[p]`` of the bank; with ``HOST`` a negative id ``-1 - e`` is expert ``e``
    of the host bank, ``host_w`` / ``host_s`` elements past the bank's base (mapped pinned memory),
    and ``dst[p] >= 0`` the bank row its bytes are written to."""
    e = tl.load(ids_ptr + p).to(tl.int64)
    if HOST:
        d = tl.load(dst_ptr + p).to(tl.int64)
        ew = tl.where(e >= 0, e * stride_we, host_w + (-1 - e) * stride_we)
        es = tl.where(e >= 0, e * stride_se, host_s + (-1 - e) * stride_se)
        dd = tl.maximum(d, 0)
        return w_ptr + ew, s_ptr + es, w_ptr + dd * stride_we, s_ptr + dd * stride_se, d >= 0
    return w_ptr + e * stride_we, s_ptr + e * stride_se, w_ptr, s_ptr, e < 0


@triton.jit
def _pair_gate_up_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, b_ptr, h_ptr, stride_x, stride_we, stride_wr, stride_se,
                         stride_sr, stride_be, limit, alpha, dst_ptr, host_w, host_s, host_b, TOP_K: tl.constexpr,
                         D: tl.constexpr, I: tl.constexpr, FP4: tl.constexpr, HAS_LIMIT: tl.constexpr,
                         INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALPHA: tl.constexpr,
                         BLOCK_R: tl.constexpr, G: tl.constexpr, HOST: tl.constexpr):
    """Grid ``(P, cdiv(I, BLOCK_R))``: ``h[p, rows] = glu(gate, up)`` of pair ``p``'s token (``_glu``); a
    ``HAS_BIAS`` bank's gate/up bias row is read (and written through) like its weights."""
    p = tl.program_id(0)
    w_e, s_e, dw_e, ds_e, wr = _pair_expert(ids_ptr, dst_ptr, p, w_ptr, s_ptr, stride_we, stride_se, host_w, host_s,
                                            HOST)
    a_ptr = x_ptr + (p // TOP_K).to(tl.int64) * stride_x
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < I
    if INTERLEAVED:  # gpt-oss: row 2j gate channel j, row 2j + 1 up channel j
        g_rows, u_rows = 2 * rows, 2 * rows + 1
    else:
        g_rows, u_rows = rows, rows + I
    gate = _pair_rows(a_ptr, w_e, s_e, g_rows, ok, stride_wr, stride_sr, D, FP4, BLOCK_R, G, dw_e, ds_e, wr, HOST)
    up = _pair_rows(a_ptr, w_e, s_e, u_rows, ok, stride_wr, stride_sr, D, FP4, BLOCK_R, G, dw_e, ds_e, wr, HOST)
    if HAS_BIAS:
        b_e, _, db_e, _, _ = _pair_expert(ids_ptr, dst_ptr, p, b_ptr, b_ptr, stride_be, stride_be, host_b, host_b,
                                          HOST)
        b_g = tl.load(b_e + g_rows, mask=ok, other=0.0)
        b_u = tl.load(b_e + u_rows, mask=ok, other=0.0)
        if HOST:
            wm = tl.where(wr, ok, False)
            tl.store(db_e + g_rows, b_g, mask=wm)
            tl.store(db_e + u_rows, b_u, mask=wm)
        gate += b_g.to(tl.float32)
        up += b_u.to(tl.float32)
    h = _glu(gate, up, limit, alpha, HAS_LIMIT, HAS_ALPHA)
    tl.store(h_ptr + p * I + rows, h.to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _pair_down_kernel(h_ptr, ids_ptr, w_ptr, s_ptr, route_ptr, y_ptr, stride_we, stride_wr, stride_se, stride_sr,
                      dst_ptr, host_w, host_s, D: tl.constexpr, I: tl.constexpr, FP4: tl.constexpr,
                      BLOCK_R: tl.constexpr, G: tl.constexpr, HOST: tl.constexpr):
    """Grid ``(P, cdiv(D, BLOCK_R))``: ``y[p, rows] = route[p] * down(h[p])`` in float32."""
    p = tl.program_id(0)
    w_e, s_e, dw_e, ds_e, wr = _pair_expert(ids_ptr, dst_ptr, p, w_ptr, s_ptr, stride_we, stride_se, host_w, host_s,
                                            HOST)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < D
    acc = _pair_rows(h_ptr + p * I, w_e, s_e, rows, ok, stride_wr, stride_sr, I, FP4, BLOCK_R, G, dw_e, ds_e, wr, HOST)
    tl.store(y_ptr + p * D + rows, acc * tl.load(route_ptr + p), mask=ok)
