"""Triton kernels behind :func:`~shardsmith.runtime.layers.kernels.fp8_linear.fp8_linear`.

One program owns a ``[BLOCK_M, BLOCK_N]`` tile of the output and a contiguous range of K (split-K):
it streams its FP8 weight rows once, widens them to bf16 in registers, multiplies by the padded
token tile with ``tl.dot`` (M is padded to 16, the smallest dot shape) and applies the block scale
to the float32 partial of each K block, as vLLM's ``w8a8_block_fp8_matmul`` does (written anew).
With ``SPLITS > 1`` each program stores its float32 partial to a workspace ``[S, M, N]``; the S
partials of a tile are then added in split order 0, 1, ..., S-1 from 0.0 and cast, so results do
not depend on scheduling. The sum either folds into the same launch (``FUSED_SUM``, the default:
one launch per call) or runs as a second kernel, :func:`_sum_splits` (the path before the
fold, kept to compare). The fold is the classic split-K semaphore ("last program reduces", as in
CUTLASS's serial split-K and stream-K fix-up): after storing its partial, a program bumps its
tile's int32 counter with ``tl.atomic_add`` (acq_rel, gpu scope); the one that sees ``S - 1``
knows every partial is visible, sums them in split order (the same additions as
:func:`_sum_rows`, so the bits equal the two-kernel path's) and sets the counter back to 0 for
the next launch (no memset: a captured CUDA graph replays as is). A register GEMV (multiply-adds
and a row sum instead of the padded dot for M <= 4) ran 2.7-30x slower on the H200 and was dropped
(``benchmarks/RESULTS.md``).

Compiles: Triton compiles a kernel once per distinct set of constexpr values and plain-int
classes (1, multiple of 16, other; :mod:`.compile_keys`). Each kernel is jitted twice: the decode
variants (M <= ``DECODE_M``: every int specialised, the split fixed by the weight's shape) and the
long ones (``M`` and the sum's size unspecialised, the split one of two per weight), so a weight
compiles a bounded handful of variants whatever the prompt length, and ``fp8_linear.warmup_rows``
lists row counts whose launches compile them all.
"""

from __future__ import annotations

import triton
import triton.language as tl

from shardsmith.runtime.layers.kernels._common import DECODE_M


def _fp8_linear(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                K_ITERS: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, UE8M0: tl.constexpr,
                SPLITS: tl.constexpr, FUSED_SUM: tl.constexpr, DOT_F32: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    s_row = s_ptr + (offs_n // SCALE_N) * stride_sn  # [BLOCK_N] this tile's scale rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(K_ITERS):  # the last split may run past K: masked
        k0 = (pid_k * K_ITERS + kk) * BLOCK_K
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + ks[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0)
        if DOT_F32:  # float32 activations, or the interpreter (whose bf16 dot is wrong: triton 3.6, numpy 2.4)
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(w.to(x.dtype)))  # [BLOCK_M, BLOCK_N] float32
        s = tl.load(s_row + k0 // SCALE_K, mask=n_mask & (offs_n * 0 + k0 < K), other=0)  # a tensor test: triton 3.9's
        # interpreter refuses a mask made with a scalar bool
        if UE8M0:
            s = tl.exp2(s.to(tl.float32) - 127.0)
        acc += part * s[None, :]
    out = offs_m[:, None] * N + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLITS == 1:
        tl.store(out_ptr + out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + pid_k * M * N + out, acc, mask=mask)
        if FUSED_SUM:  # the last of the tile's SPLITS programs to get here adds the partials (module docstring)
            tl.debug_barrier()  # every thread's partial stored before the one thread's release below
            cnt = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
            if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:  # the others' partials happen-before
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for j in range(SPLITS):  # _sum_rows's order; .cg: from L2, never a stale L1 line
                    total += tl.load(ws_ptr + j * M * N + out, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + out, total.to(out_ptr.dtype.element_ty), mask=mask)
                # ready for the next launch (every program of this tile has counted); relaxed: the launch's end
                # orders it before the next one, and a release here would wait for the store above first
                tl.atomic_xchg(cnt, 0, sem="relaxed")


def _sum_rows(ws_ptr, out_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """``out = sum(ws[0..SPLITS), axis 0)`` in float32, in split order, cast to ``out``'s dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(ws_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, N, K, stride_xg, stride_wn, stride_sn,
                     group_n, k_iters, k_blocks, splits, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                     UE8M0: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token: ``out[n] = sum_k x[g(n), k] * w[n, k] * s[n // SCALE_N, k // SCALE_K]``, ``g(n) = n // GROUP_N``.

    A program owns ``BLOCK_N`` weight rows inside one scale row and one group (the launcher checks
    ``SCALE_N % BLOCK_N == 0 == group_n % BLOCK_N``) and ``k_iters`` steps of ``BLOCK_K`` columns, so
    a row's block scale depends on the column alone: it multiplies the ``BLOCK_K`` activations (exact
    for UE8M0, a power of two) and every product accumulates element-wise into a ``[BLOCK_N, BLOCK_K]``
    float32 tile, summed over K once at the end. No padded 16-row dot: each weight byte costs one conversion and one FMA, and the
    program keeps a whole ``BLOCK_N x BLOCK_K`` tile of loads in flight per step. Split-K partials
    are summed as in :func:`_fp8_linear` (the last program of a column tile adds them in split order).
    Shape-dependent counts (``group_n``, ``k_iters``, ``k_blocks``, ``splits``) are run-time ints, so the
    weights of a model share a few variants (:mod:`.compile_keys`).
    """
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    xg = x_ptr + (n0 // group_n) * stride_xg  # this tile's group row of x
    s_row = s_ptr + (n0 // SCALE_N) * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for kk in range(k_iters):  # the last split may run past K: masked (its scale index clamped in bounds)
        k0 = (pid_k * k_iters + kk) * BLOCK_K
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        s = tl.load(s_row + tl.minimum(ks // SCALE_K, k_blocks - 1))  # [BLOCK_K]: few distinct, cached
        if UE8M0:
            s = tl.exp2(s.to(tl.float32) - 127.0)
        xs = tl.load(xg + ks, mask=k_mask, other=0.0).to(tl.float32) * s
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + ks[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0)
        acc += w.to(tl.float32) * xs[None, :]
    part = tl.sum(acc, axis=1)  # [BLOCK_N]
    if not SPLIT:
        tl.store(out_ptr + offs_n, part.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        tl.store(ws_ptr + pid_k * N + offs_n, part, mask=n_mask)
        tl.debug_barrier()  # every thread's partial stored before the one thread's release below
        cnt = cnt_ptr + pid_n
        if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == splits - 1:  # _fp8_linear's fused sum
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for j in range(splits):
                total += tl.load(ws_ptr + j * N + offs_n, mask=n_mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)
            tl.atomic_xchg(cnt, 0, sem="relaxed")


# Decode (M <= DECODE_M): every int specialised (M == 1, M % 16), the split from the weight's shape.
_fp8_linear_kernel = triton.jit(_fp8_linear)
_sum_splits = triton.jit(_sum_rows)
# Longer (prefill): M and the sum's size unspecialised and the split one of two (module docstring), so
# each weight compiles at most two variants of each whatever the prompt length.
_fp8_linear_long_kernel = triton.jit(do_not_specialize=["M"])(_fp8_linear)
_sum_splits_long = triton.jit(do_not_specialize=["numel"])(_sum_rows)


def launch(x, w, scale, out, ws, counters, *, block: tuple[int, int], ue8m0: bool, splits: int,
           k_per_split: int, block_n: int, block_k: int, num_warps: int, num_stages: int, dot_f32: bool) -> None:
    """Run the kernel(s) into ``out [M, N]`` (and workspace ``ws [splits, M, N]`` float32 when ``splits > 1``):
    the decode kernels up to ``DECODE_M`` rows, the long ones past it. With ``splits > 1``, ``counters``
    (int32, one per output tile ``[ceil(M/16), ceil(N/block_n)]``, all zero, left zero) folds the sum
    into the one launch; ``None`` adds the splits with a second kernel."""
    M, K = x.shape
    N = w.shape[0]
    kernel, sum_kernel = (_fp8_linear_kernel, _sum_splits) if M <= DECODE_M else \
        (_fp8_linear_long_kernel, _sum_splits_long)
    grid = (triton.cdiv(N, block_n), splits, triton.cdiv(M, 16))
    fused = splits > 1 and counters is not None
    kernel[grid](x, w, scale, out, ws, counters if fused else ws, M, N, K, x.stride(0), w.stride(0), scale.stride(0),
                 K_ITERS=k_per_split // block_k, SCALE_N=block[0], SCALE_K=block[1], UE8M0=ue8m0,
                 SPLITS=splits, FUSED_SUM=fused, DOT_F32=dot_f32, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
                 num_warps=num_warps, num_stages=num_stages)
    if splits > 1 and not fused:
        sum_kernel[(triton.cdiv(M * N, 1024),)](ws, out, M * N, SPLITS=splits, BLOCK=1024, num_warps=4)


def launch_gemv(x, w, scale, out, ws, counters, *, block: tuple[int, int], ue8m0: bool, splits: int,
                k_per_split: int, group_n: int, block_n: int, block_k: int, num_warps: int, num_stages: int) -> None:
    """Run :func:`_fp8_gemv_kernel` into ``out [N]`` for one token: ``x [G, K]`` (row ``g`` feeds weight rows
    ``[g * group_n, (g + 1) * group_n)``; ``G = 1``, ``group_n = N`` for a plain linear), workspace
    ``ws [splits, N]`` float32 and ``counters`` (int32, one per column tile, zero, left zero) when
    ``splits > 1``."""
    N, K = w.shape
    _fp8_gemv_kernel[(triton.cdiv(N, block_n), splits)](
        x, w, scale, out, ws, counters if splits > 1 else ws, N, K, x.stride(0), w.stride(0), scale.stride(0),
        group_n, k_per_split // block_k, scale.shape[1], splits, SCALE_N=block[0], SCALE_K=block[1],
        UE8M0=ue8m0, SPLIT=splits > 1, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages)
