"""Triton kernels behind :func:`~shardsmith.runtime.layers.kernels.deepseek_v4.hc_mix.hc_mix` (one program per token)
and :func:`~shardsmith.runtime.layers.kernels.deepseek_v4.hc_pre.hc_pre` (the whole mixer, split-K, one launch).

:func:`_hc_mix_row` is the mixer maths of one token: it loads the token's ``(2 + m) * m`` mixer
logits, makes ``pre`` and ``post`` (sigmoids) and ``comb`` (a row softmax, then Sinkhorn-Knopp:
columns first, ``ITERS`` rounds) in registers and writes the three; ``m`` x ``m`` is tiny (4 x 4 for
DeepSeek-V4), so the ~2 * ITERS normalising passes that torch runs as separate reductions cost one
launch here. ``_hc_mix_kernel`` runs it once per token.

``_hc_pre_kernel`` (grid ``(splits, ceil(T / TILE_T))``): each program takes one K chunk of the
flattened streams ``x [T, K]`` (K = m * D) for ``TILE_T`` tokens, and stores to a float32 workspace
``ws [splits, T, W_PAD]`` its partial dot products with all ``W = (2 + m) * m`` rows of ``fn`` and, in
column ``W``, its partial sum of squares. Then the split-K "last program reduces" fold of
``_fp8_triton`` (CUTLASS's serial split-K semaphore): a barrier, an acq_rel gpu-scope ``atomic_add``
on the token tile's int32 counter, and the program that sees ``splits - 1`` adds the partials of
each of its tokens in a fixed order (chunks of ``BLOCK_S`` splits in split order, a fixed tree within a
chunk: the same bits every launch and replay), scales the dots by ``rsqrt(sumsq / K + norm_eps)``,
runs :func:`_hc_mix_row` on them, writes ``collapsed = sum_j pre[j] * x[t, j]`` (reading the token's
streams once) and sets the counter back to 0 (no memset: a captured CUDA graph replays as is). With
``HAS_NORM`` it then reads its ``collapsed`` row back (rounded to the output dtype, as ``ops.RMSNorm``
sees it) and overwrites it with ``weight * (c * rsqrt(sum(c^2) / D + rms_eps))``: the RMSNorm after
the mixer in the same program (its sum of squares is added while the row is written). When one
``BLOCK_D`` step covers D, the row and its norm stay in registers instead: one load, one store, the
same operations (``hc_pre(block_d=...)``).

``_hc_post_kernel`` (grid ``(T, ceil(D / BLOCK_D))``): the expansion after a sublayer,
``y[t, k] = post[t, k] * out[t] + sum_j comb[t, j, k] * x[t, j]`` for all ``m`` output streams of one
``BLOCK_D`` slice of one token; it rounds where ``hyper.expand`` does (``post``, ``comb``, the
product, the ``comb`` sum and the result each in the activation dtype; the sum over ``j`` a float32
FMA chain in stream order).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _hc_mix_row(row, base_ptr, scale_ptr, pre_out, post_out, comb_out, eps,
                M: tl.constexpr, BLOCK_M: tl.constexpr, ITERS: tl.constexpr):
    """One token's ``pre [M]``, ``post [M]``, ``comb [M, M]`` from its logits at ``row`` (float32, contiguous),
    stored at ``pre_out``, ``post_out``, ``comb_out``; returns ``pre`` as ``[BLOCK_M]`` (0 past ``M``)."""
    i = tl.arange(0, BLOCK_M)
    ok = i < M
    s_pre, s_post, s_comb = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    pre = tl.sigmoid(tl.load(row + i, mask=ok, other=0.0) * s_pre + tl.load(base_ptr + i, mask=ok, other=0.0)) + eps
    post = 2 * tl.sigmoid(tl.load(row + M + i, mask=ok, other=0.0) * s_post
                          + tl.load(base_ptr + M + i, mask=ok, other=0.0))
    tl.store(pre_out + i, pre, mask=ok)
    tl.store(post_out + i, post, mask=ok)
    r, c = i[:, None], i[None, :]  # comb[r, c]: row r (stream j), column c (stream k)
    ok2 = (r < M) & (c < M)
    at = r * M + c
    logits = tl.load(row + 2 * M + at, mask=ok2, other=0.0) * s_comb + tl.load(base_ptr + 2 * M + at, mask=ok2, other=0.0)
    logits = tl.where(ok2, logits, float("-inf"))
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = tl.where(ok2, e / tl.sum(e, axis=1)[:, None] + eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    tl.store(comb_out + at, comb, mask=ok2)
    return tl.where(ok, pre, 0.0)


@triton.jit
def _hc_mix_kernel(f_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, f_stride, eps,
                   M: tl.constexpr, BLOCK_M: tl.constexpr, ITERS: tl.constexpr):
    t = tl.program_id(0)
    _hc_mix_row(f_ptr + t * f_stride, base_ptr, scale_ptr, pre_ptr + t * M, post_ptr + t * M, comb_ptr + t * M * M,
                eps, M, BLOCK_M, ITERS)


@triton.jit(do_not_specialize=["T", "splits", "k_iters"])  # variants: the module's shapes and dtype only
def _hc_pre_kernel(x_ptr, fn_ptr, base_ptr, scale_ptr, ws_ptr, f_ptr, cnt_ptr, pre_ptr, post_ptr, comb_ptr, out_ptr,
                   nw_ptr, T, splits, k_iters, stride_xt, eps, norm_eps, rms_eps,
                   M: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, ITERS: tl.constexpr,
                   W: tl.constexpr, W_PAD: tl.constexpr, TILE_T: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr):
    K: tl.constexpr = M * D
    pid_s, pid_t = tl.program_id(0), tl.program_id(1)
    tok = pid_t * TILE_T + tl.arange(0, TILE_T)
    t_ok = tok < T
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_xt  # [TILE_T, 1]
    col = tl.arange(0, W_PAD)  # fn's W rows; column W: the sum of squares
    w_ok = col < W
    acc = tl.zeros((TILE_T, W_PAD), dtype=tl.float32)
    sq = tl.zeros((TILE_T,), dtype=tl.float32)
    for kk in range(k_iters):  # the last split may run past K: masked
        ks = (pid_s * k_iters + kk) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_rows + ks[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(fn_ptr + col[:, None] * K + ks[None, :], mask=w_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)  # [TILE_T, W_PAD]: float32 products and sums
        sq += tl.sum(x * x, axis=1)
    acc = tl.where(col[None, :] == W, sq[:, None], acc)
    tl.store(ws_ptr + (pid_s * T + tok[:, None]) * W_PAD + col[None, :], acc, mask=t_ok[:, None])
    tl.debug_barrier()  # every thread's partial stored before the one thread's release below
    cnt = cnt_ptr + pid_t
    if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == splits - 1:  # the others' partials happen-before
        s = tl.arange(0, BLOCK_S)
        j = tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        for i in tl.static_range(TILE_T):
            t = pid_t * TILE_T + i
            if t < T:
                total = tl.zeros((W_PAD,), dtype=tl.float32)
                for s0 in range(0, splits, BLOCK_S):  # .cg: from L2, never a stale L1 line
                    part = tl.load(ws_ptr + ((s0 + s[:, None]) * T + t) * W_PAD + col[None, :],
                                   mask=(s0 + s[:, None]) < splits, other=0.0, cache_modifier=".cg")
                    total += tl.sum(part, axis=0)
                sumsq = tl.sum(tl.where(col == W, total, 0.0), axis=0)
                f_row = f_ptr + t * W_PAD
                tl.store(f_row + col, total * tl.rsqrt(sumsq / K + norm_eps))  # f = rms-normed x @ fn.T
                tl.debug_barrier()  # the row visible to every thread of the program
                pre = _hc_mix_row(f_row, base_ptr, scale_ptr, pre_ptr + t * M, post_ptr + t * M,
                                  comb_ptr + t * M * M, eps, M, BLOCK_M, ITERS)
                x_t = x_ptr + t.to(tl.int64) * stride_xt
                out_t = out_ptr + t.to(tl.int64) * D
                if BLOCK_D >= D:  # the whole row in one step: the norm from registers, one store
                    v = tl.load(x_t + j[:, None] * D + d[None, :], mask=(j[:, None] < M) & (d[None, :] < D), other=0.0)
                    out = tl.sum(pre[:, None] * v.to(tl.float32), axis=0).to(out_ptr.dtype.element_ty)
                    if HAS_NORM:  # the chunked path's operations on one chunk: the same bits
                        c = out.to(tl.float32)
                        r = tl.rsqrt(tl.sum(c * c, axis=0) / D + rms_eps)
                        w = tl.load(nw_ptr + d, mask=d < D, other=0.0)
                        out = (w * (c * r)).to(out_ptr.dtype.element_ty)
                    tl.store(out_t + d, out, mask=d < D)
                else:
                    sq_d = tl.zeros((BLOCK_D,), dtype=tl.float32)
                    for d0 in range(0, D, BLOCK_D):
                        dd = d0 + d
                        v = tl.load(x_t + j[:, None] * D + dd[None, :], mask=(j[:, None] < M) & (dd[None, :] < D),
                                    other=0.0)
                        out = tl.sum(pre[:, None] * v.to(tl.float32), axis=0).to(out_ptr.dtype.element_ty)
                        tl.store(out_t + dd, out, mask=dd < D)
                        if HAS_NORM:  # ops.RMSNorm: h = c.float(); mean of h^2 (0 past D)
                            sq_d += out.to(tl.float32) * out.to(tl.float32)
                    if HAS_NORM:
                        r = tl.rsqrt(tl.sum(sq_d, axis=0) / D + rms_eps)
                        tl.debug_barrier()  # the row stored by every thread before any reads it back
                        for d0 in range(0, D, BLOCK_D):
                            dd = d0 + d
                            c = tl.load(out_t + dd, mask=dd < D, other=0.0, cache_modifier=".cg").to(tl.float32)
                            w = tl.load(nw_ptr + dd, mask=dd < D, other=0.0)
                            tl.store(out_t + dd, (w * (c * r)).to(out_ptr.dtype.element_ty), mask=dd < D)
        # ready for the next launch (every program of this tile has counted); relaxed, as _fp8_triton's
        tl.atomic_xchg(cnt, 0, sem="relaxed")


@triton.jit
def _hc_post_kernel(x_ptr, o_ptr, post_ptr, comb_ptr, y_ptr, stride_xt, stride_ot,
                    M: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    t, pid_d = tl.program_id(0), tl.program_id(1)
    dt = y_ptr.dtype.element_ty  # the activation dtype: hyper.expand's rounding points
    k = tl.arange(0, BLOCK_M)  # output stream
    k_ok = k < M
    dd = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = dd < D
    t64 = t.to(tl.int64)
    x_t = x_ptr + t64 * stride_xt
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for i in tl.static_range(M):  # matmul(comb.T, x): a float32 FMA chain in stream order (as MKL's; cuBLAS's too
        # where it adds in order); bf16 / fp16 products are exact in float32, so only the order can matter
        c = tl.load(comb_ptr + (t * M + i) * M + k, mask=k_ok, other=0.0).to(dt).to(tl.float32)  # comb[t, i, :]
        s = tl.load(x_t + i * D + dd, mask=d_ok, other=0.0).to(tl.float32)
        acc = tl.fma(c[:, None], s[None, :], acc)
    p = tl.load(post_ptr + t * M + k, mask=k_ok, other=0.0).to(dt).to(tl.float32)
    o = tl.load(o_ptr + t64 * stride_ot + dd, mask=d_ok, other=0.0).to(tl.float32)
    y = (p[:, None] * o[None, :]).to(dt).to(tl.float32) + acc.to(dt).to(tl.float32)
    tl.store(y_ptr + t64 * (M * D) + k[:, None] * D + dd[None, :], y.to(dt), mask=k_ok[:, None] & d_ok[None, :])
