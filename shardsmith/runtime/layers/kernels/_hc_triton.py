"""Triton kernel behind :func:`~shardsmith.runtime.layers.kernels.hc_mix.hc_mix`: one program per token.

The program loads the token's ``(2 + m) * m`` mixer logits, makes ``pre`` and ``post`` (sigmoids)
and ``comb`` (a row softmax, then Sinkhorn-Knopp: columns first, ``ITERS`` rounds) in registers
and writes the three; ``m`` x ``m`` is tiny (4 x 4 for DeepSeek-V4), so the ~2 * ITERS normalising
passes that torch runs as separate reductions cost one launch here.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _hc_mix_kernel(f_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, f_stride, eps,
                   M: tl.constexpr, BLOCK_M: tl.constexpr, ITERS: tl.constexpr):
    t = tl.program_id(0)
    row = f_ptr + t * f_stride
    i = tl.arange(0, BLOCK_M)
    ok = i < M
    s_pre, s_post, s_comb = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    pre = tl.sigmoid(tl.load(row + i, mask=ok, other=0.0) * s_pre + tl.load(base_ptr + i, mask=ok, other=0.0)) + eps
    post = 2 * tl.sigmoid(tl.load(row + M + i, mask=ok, other=0.0) * s_post
                          + tl.load(base_ptr + M + i, mask=ok, other=0.0))
    tl.store(pre_ptr + t * M + i, pre, mask=ok)
    tl.store(post_ptr + t * M + i, post, mask=ok)
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
    tl.store(comb_ptr + t * M * M + at, comb, mask=ok2)
