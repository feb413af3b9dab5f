"""Triton kernel behind :func:`~shardsmith.runtime.layers.kernels.router.route_topk`: a MoE router in one launch.

``_router_kernel`` (grid ``(ceil(E / BLOCK_E), splits, ceil(T / TILE_T))``): each program takes
``BLOCK_E`` rows of the gate ``w [E, D]`` (float32) and one K chunk of them for ``TILE_T`` tokens of
``x [T, D]``, and stores its partial logits ``[TILE_T, BLOCK_E]`` (float32 products and sums) to a
float32 workspace ``ws [splits, T, E]``: the ``E * D * 4`` bytes of the gate (4 MiB for V4-Flash) are
read by about two waves of programs at once, not by one. Then the split-K "last program reduces"
fold of ``_fp8_triton`` and ``_hc_triton`` (CUTLASS's serial split-K semaphore): a barrier, an acq_rel
gpu-scope ``atomic_add`` on the token tile's int32 counter, and the program that sees the tile's
``E-blocks x splits - 1`` finishes each of its tokens alone, in a fixed order (the same bits every
launch and replay):

1. ``logits [E]``: the partials added in chunks of ``BLOCK_S`` splits in split order (a fixed tree
   within a chunk), read with ``.cg`` (from L2, never a stale L1 line);
2. ``scores``: ``sqrt(softplus(logits))`` (torch's softplus: the logit itself past 20, else
   ``max(l, 0) + log1p(exp(-|l|))``, ``log1p`` by Goldberg's exact-rounding trick), ``sigmoid`` or a
   softmax over E;
3. the experts: ``K`` rounds of max over the experts not yet taken of ``scores + bias`` (padding
   ``E..E_PAD`` never available), the lowest index among equal maxima (and the lowest available one
   if no value compares equal: NaN scores still give K distinct experts in range); or the given
   rows of a hash table;
4. ``weight = scores[index] / (sum_k scores[index] + 1e-20) * routed_scale`` with correctly rounded
   divisions, then the counter set back to 0 (no memset: a captured CUDA graph replays as is).

``SCORE``: 0 sqrtsoftplus, 1 sigmoid, 2 softmax. ``HASH``: 0 top-k, 1 ``tbl [T, K]`` (one row per
token), 2 ``tbl [V, K]`` at rows ``ids [T]`` (``tid2eid[ids]``, the gather done here).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _scores(logits, ok, SCORE: tl.constexpr):
    """The router's scores of ``logits [E_PAD]`` (float32); entries where ``ok`` is false are 0."""
    if SCORE == 0:  # sqrt(softplus(l)); torch: l itself past its threshold 20
        u = tl.exp(-tl.abs(logits))  # (0, 1]
        v = 1.0 + u
        log1p = tl.where(v == 1.0, u, tl.log(v) * tl.div_rn(u, tl.where(v == 1.0, 1.0, v - 1.0)))  # log1p(u)
        s = tl.sqrt_rn(tl.where(logits > 20.0, logits, tl.maximum(logits, 0.0) + log1p))
    elif SCORE == 1:
        s = tl.sigmoid(logits)
    else:
        m = tl.max(tl.where(ok, logits, float("-inf")), axis=0)
        ex = tl.where(ok, tl.exp(logits - m), 0.0)
        s = tl.div_rn(ex, tl.zeros_like(ex) + tl.sum(ex, axis=0))
    return tl.where(ok, s, 0.0)


@triton.jit(do_not_specialize=["T", "k_iters", "tbl_stride"])  # variants: the layer's shapes, x's dtype, the path
def _router_kernel(x_ptr, w_ptr, bias_ptr, tbl_ptr, ids_ptr, ws_ptr, cnt_ptr, idx_ptr, wt_ptr,
                   T, k_iters, tbl_stride, routed_scale,
                   D: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                   SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr, TILE_T: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr):
    pid_e, pid_s, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits = tl.num_programs(1)
    tok = pid_t * TILE_T + tl.arange(0, TILE_T)
    t_ok = tok < T
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * D  # [TILE_T, 1]
    w_rows = w_ptr + e.to(tl.int64)[:, None] * D  # [BLOCK_E, 1]
    acc = tl.zeros((TILE_T, BLOCK_E), dtype=tl.float32)
    for kk in range(k_iters):  # the last split may run past D: masked
        ks = (pid_s * k_iters + kk) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < D
        x = tl.load(x_rows + ks[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_rows + ks[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)  # [TILE_T, BLOCK_E]: float32 products and sums
    tl.store(ws_ptr + (pid_s * T + tok[:, None]) * E + e[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])
    tl.debug_barrier()  # every thread's partial stored before the one thread's release below
    cnt = cnt_ptr + pid_t
    if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) * splits - 1:  # others' partials
        s = tl.arange(0, BLOCK_S)  # happen-before this program's reads
        ee = tl.arange(0, E_PAD)
        ee_ok = ee < E
        slot = tl.arange(0, K_PAD)
        slot_ok = slot < K
        for i in tl.static_range(TILE_T):
            t = pid_t * TILE_T + i
            if t < T:
                logits = tl.zeros((E_PAD,), dtype=tl.float32)
                for s0 in range(0, splits, BLOCK_S):  # .cg: from L2, never a stale L1 line
                    ss = s0 + s[:, None]
                    part = tl.load(ws_ptr + (ss * T + t) * E + ee[None, :], mask=(ss < splits) & ee_ok[None, :],
                                   other=0.0, cache_modifier=".cg")
                    logits += tl.sum(part, axis=0)
                scores = _scores(logits, ee_ok, SCORE)
                if HASH == 0:
                    sel = scores
                    if HAS_BIAS:
                        sel += tl.load(bias_ptr + ee, mask=ee_ok, other=0.0)
                    avail = ee_ok
                    index = tl.zeros((K_PAD,), dtype=tl.int32)
                    for k in tl.static_range(K):  # descending sel, ties to the lower expert
                        cand = tl.where(avail, sel, float("-inf"))
                        best = tl.max(cand, axis=0)
                        j = tl.min(tl.where(avail & (cand == best), ee, E_PAD), axis=0)
                        j = tl.where(j < E_PAD, j, tl.min(tl.where(avail, ee, E_PAD), axis=0))  # NaN: in range
                        avail = avail & (ee != j)
                        index = tl.where(slot == k, j, index)
                else:
                    row = t.to(tl.int64)
                    if HASH == 2:
                        row = tl.load(ids_ptr + t).to(tl.int64)
                    index = tl.load(tbl_ptr + row * tbl_stride + slot, mask=slot_ok, other=0).to(tl.int32)
                picked = tl.sum(tl.where(ee[None, :] == index[:, None], scores[None, :], 0.0), axis=1)  # [K_PAD]
                picked = tl.where(slot_ok, picked, 0.0)
                total = tl.zeros_like(picked) + (tl.sum(picked, axis=0) + 1e-20)
                tl.store(idx_ptr + t * K + slot, index.to(tl.int64), mask=slot_ok)
                tl.store(wt_ptr + t * K + slot, tl.div_rn(picked, total) * routed_scale, mask=slot_ok)
        # ready for the next launch (every program of this tile has counted); relaxed, as _fp8_triton's
        tl.atomic_xchg(cnt, 0, sem="relaxed")
