"""Triton kernel behind :func:`~shardsmith.runtime.layers.kernels.router.route_topk`: a MoE router in one launch.

``_router_kernel`` (grid ``(ceil(E / BLOCK_E), SPLITS, ceil(T / TILE_T))``): each program takes
``BLOCK_E`` rows of the gate ``w [E, D]`` (float32) and one D chunk of ``K_ITERS`` steps of them for
``TILE_T`` tokens of ``x [T, D]`` (the steps unrolled: every load of the chunk can be in flight at
once), and stores its partial logits ``[TILE_T, BLOCK_E]`` (float32 products and sums) to a float32
workspace ``ws [T, SPLITS, E]``: the ``E * D * 4`` bytes of the gate (4 MiB for V4-Flash) are read by
about two waves of programs at once, not by one. Then the split-K "last program reduces" fold of
``_fp8_triton`` and ``_hc_triton`` (CUTLASS's serial split-K semaphore): a barrier, an acq_rel
gpu-scope ``atomic_add`` on the token tile's int32 counter, and the program that sees the tile's
``E-blocks x SPLITS - 1`` finishes the tile's tokens together (``[TILE_T, E]`` tensors, one set of
reductions for all of them), in a fixed order (the same bits every launch and replay):

1. ``logits``: the ``SPLITS`` partials added in split order (unrolled; read with ``.cg``: from L2,
   never a stale L1 line);
2. ``scores``: ``sqrt(softplus(logits))`` (torch's softplus: the logit itself past 20, else
   ``max(l, 0) + log1p(exp(-|l|))``, ``log1p`` by Goldberg's exact-rounding trick), ``sigmoid`` or a
   softmax over E;
3. the experts: ``K`` rounds of one int64 max over the experts not yet taken, each keyed by its
   ``scores + bias`` (the float's bits made to order as an int: torch.topk's order, NaN above
   +inf) over ``E_PAD - 1 - expert`` (equal values: the lower expert first); padding ``E..E_PAD``
   and taken experts keyed below all (K distinct experts in range, whatever the values); or the
   given rows of a hash table;
4. ``weight = scores[index] / (sum_k scores[index] + 1e-20) * routed_scale`` with correctly rounded
   divisions (``scores`` gathered from the tile's first split row of ``ws``, which holds them once
   the partials are read), then the counter set back to 0 (no memset: a captured CUDA graph
   replays as is).

``SCORE``: 0 sqrtsoftplus, 1 sigmoid, 2 softmax. ``HASH``: 0 top-k, 1 ``tbl [T, K]`` (one row per
token), 2 ``tbl [V, K]`` at rows ``ids [T]`` (``tid2eid[ids]``, the gather done here).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _scores(logits, ok, SCORE: tl.constexpr):
    """The router's scores of ``logits [TILE_T, E_PAD]`` (float32); entries where ``ok`` is false are 0."""
    if SCORE == 0:  # sqrt(softplus(l)); torch: l itself past its threshold 20
        u = tl.exp(-tl.abs(logits))  # (0, 1]
        v = 1.0 + u
        log1p = tl.where(v == 1.0, u, tl.log(v) * tl.div_rn(u, tl.where(v == 1.0, 1.0, v - 1.0)))  # log1p(u)
        s = tl.sqrt_rn(tl.where(logits > 20.0, logits, tl.maximum(logits, 0.0) + log1p))
    elif SCORE == 1:
        s = tl.sigmoid(logits)
    else:
        m = tl.max(tl.where(ok, logits, float("-inf")), axis=1)
        m = tl.where(m == float("-inf"), 0.0, m)  # rows of no token (past T): 0, not NaN
        ex = tl.where(ok, tl.exp(logits - m[:, None]), 0.0)
        total = tl.sum(ex, axis=1)
        s = tl.div_rn(ex, tl.zeros_like(ex) + tl.where(total == 0.0, 1.0, total)[:, None])
    return tl.where(ok, s, 0.0)


@triton.jit(do_not_specialize=["T", "tbl_stride"])  # variants: the layer's shapes, x's dtype, the path
def _router_kernel(x_ptr, w_ptr, bias_ptr, tbl_ptr, ids_ptr, ws_ptr, cnt_ptr, idx_ptr, wt_ptr,
                   T, tbl_stride, routed_scale,
                   D: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                   SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr, SPLITS: tl.constexpr,
                   K_ITERS: tl.constexpr, TILE_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_e, pid_s, pid_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tok = pid_t * TILE_T + tl.arange(0, TILE_T)
    t_ok = tok < T
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * D  # [TILE_T, 1]
    w_rows = w_ptr + e.to(tl.int64)[:, None] * D  # [BLOCK_E, 1]
    acc = tl.zeros((TILE_T, BLOCK_E), dtype=tl.float32)
    for kk in tl.static_range(K_ITERS):  # the last split may run past D: masked
        ks = (pid_s * K_ITERS + kk) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < D
        x = tl.load(x_rows + ks[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_rows + ks[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)  # [TILE_T, BLOCK_E]: float32 products and sums
    row = ws_ptr + tok[:, None] * (SPLITS * E)  # [TILE_T, 1]: token t's partials, ws[t, :, :]
    tl.store(row + pid_s * E + e[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])
    tl.debug_barrier()  # every thread's partial stored before the one thread's release below
    cnt = cnt_ptr + pid_t
    if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) * SPLITS - 1:  # the others'
        ee = tl.arange(0, E_PAD)  # partials happen-before this program's reads
        ok = t_ok[:, None] & (ee < E)[None, :]  # [TILE_T, E_PAD]
        slot = tl.arange(0, K_PAD)
        out_ok = t_ok[:, None] & (slot < K)[None, :]  # [TILE_T, K_PAD]
        logits = tl.zeros((TILE_T, E_PAD), dtype=tl.float32)
        for s in tl.static_range(SPLITS):  # .cg: from L2, never a stale L1 line
            logits += tl.load(row + s * E + ee[None, :], mask=ok, other=0.0, cache_modifier=".cg")
        scores = _scores(logits, ok, SCORE)
        if HASH == 0:
            sel = scores
            if HAS_BIAS:
                sel += tl.load(bias_ptr + ee, mask=ee < E, other=0.0)[None, :]
            bits = sel.to(tl.int32, bitcast=True)  # float order as int order: negatives' magnitude bits flipped
            key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32
            key = key | (E_PAD - 1 - ee).to(tl.int64)[None, :]
            taken = tl.full((TILE_T, E_PAD), 1, tl.int64) << 63  # below every key (padding, experts taken)
            key = tl.where(ok, key, taken)
            index = tl.zeros((TILE_T, K_PAD), dtype=tl.int32)
            for k in tl.static_range(K):  # one max a round: the largest value, then the lower expert
                j = E_PAD - 1 - (tl.max(key, axis=1) & (E_PAD - 1)).to(tl.int32)  # [TILE_T]
                key = tl.where(ee[None, :] == j[:, None], taken, key)
                index = tl.where(slot[None, :] == k, j[:, None], index)
        else:
            tbl_row = tok.to(tl.int64)
            if HASH == 2:
                tbl_row = tl.load(ids_ptr + tok, mask=t_ok, other=0).to(tl.int64)
            index = tl.load(tbl_ptr + tbl_row[:, None] * tbl_stride + slot[None, :], mask=out_ok, other=0)
            index = index.to(tl.int32)
        tl.debug_barrier()  # every thread's partials read before split 0's are overwritten
        tl.store(row + ee[None, :], scores, mask=ok)  # in split 0's place: the scores, for a gather
        tl.debug_barrier()  # every thread's scores stored before any thread gathers
        picked = tl.load(row + index, mask=out_ok & (index >= 0) & (index < E), other=0.0)  # [TILE_T, K_PAD]
        total = tl.zeros_like(picked) + (tl.sum(picked, axis=1) + 1e-20)[:, None]
        out = tok[:, None] * K + slot[None, :]
        tl.store(idx_ptr + out, index.to(tl.int64), mask=out_ok)
        tl.store(wt_ptr + out, tl.div_rn(picked, total) * routed_scale, mask=out_ok)
        # ready for the next launch (every program of this tile has counted); relaxed, as _fp8_triton's
        tl.atomic_xchg(cnt, 0, sem="relaxed")
