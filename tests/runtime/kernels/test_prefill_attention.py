"""DeepSeek-V4's prefill attention kernel (``prefill_attention``) against its PyTorch reference, and the
reference against a plain per-query loop.

CPU: under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton loads) on small shapes in
float32: the three layer kinds (window only; every complete entry; the indexer's picks with ``-1``
holes and repeats of none), a first chunk and a later chunk whose keys start before its first query's
window, head counts below and past one 16-head block, a head dim that is not a power of two, a
window wider than the chunk, and queries that see only the sink's share. GPU (``-m gpu``): V4-Flash's
shapes (64 heads, head dim 512, window 128, top-k 512, 2048-query chunk at 8k of context) in bf16
within a few times the reference's own bf16 error of a float32 truth. The indexer's prefill scores
(``indexer_prefill_scores``) against their reference: chunks at the sequence's start (the triangle of
incomplete entries, ``-inf``), later chunks, blocks no query may see yet; on the GPU 64 x 128 heads
over 2k entries in bf16.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shardsmith.runtime.layers.kernels import KernelError, triton_available
from shardsmith.runtime.layers.kernels.deepseek_v4.indexer_scores import (indexer_prefill_scores,
                                                                          indexer_prefill_scores_reference)
from shardsmith.runtime.layers.kernels.deepseek_v4.prefill_attention import (
    entry_mask,
    prefill_attention,
    prefill_attention_reference,
)

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def _case(T: int, n: int, d: int, W: int, q0: int, *, ratio: int = 4, mode: str = "csa", K: int = 6,
          extra_old: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    """A chunk of ``T`` queries at ``q0``; keys from ``first = max(0, q0 - W + 1 - extra_old)``."""
    g = torch.Generator(device=device).manual_seed(seed)
    first = max(0, q0 - W + 1 - extra_old)
    keys = torch.randn(q0 + T - first, d, generator=g, device=device).to(dtype)
    q = torch.randn(T, n, d, generator=g, device=device).to(dtype)
    sink = torch.randn(n, generator=g, device=device)
    C = (q0 + T) // ratio
    entries = torch.randn(C, d, generator=g, device=device).to(dtype) if mode != "sliding" else None
    select = None
    if mode == "csa" and C:
        positions = torch.arange(q0, q0 + T, device=device)
        visible = (positions + 1) // ratio  # complete entries per query
        scores = torch.rand(T, C, generator=g, device=device)
        scores = scores.masked_fill(torch.arange(C, device=device)[None, :] >= visible[:, None], -1.0)
        top = scores.topk(min(K, C), dim=1)
        select = torch.where(top.values >= 0, top.indices, -1).int()  # -1: not complete (none picked)
    return q, keys, entries, select, sink, {"q0": q0, "first": first, "window": W, "ratio": ratio}


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype and torch.isfinite(got).all()
    err = (got.double() - want.double()).abs().max().item()
    assert err <= tol * max(1.0, want.double().abs().max().item()), err


@needs_triton
@pytest.mark.parametrize(("T", "n", "d", "W", "q0", "mode", "extra_old"), [
    (37, 4, 64, 8, 0, "sliding", 0),   # the first chunk, window only
    (21, 20, 48, 16, 30, "sliding", 0),  # a later chunk; 20 heads = a block and a partial one; d = 48
    (29, 4, 32, 8, 0, "hca", 0),       # every complete entry
    (33, 3, 32, 8, 17, "hca", 3),      # a later chunk whose keys start 3 rows before the first window
    (40, 4, 32, 8, 0, "csa", 0),       # the indexer's picks, -1 for the queries with fewer complete
    (18, 17, 32, 64, 50, "csa", 0),    # a window wider than the chunk
])
def test_kernel_matches_reference(T, n, d, W, q0, mode, extra_old):
    q, keys, entries, select, sink, kw = _case(T, n, d, W, q0, mode=mode, extra_old=extra_old, seed=T + q0)
    got = prefill_attention(q, keys, entries, select, sink, d ** -0.5, backend="triton", **kw)
    _close(got, prefill_attention_reference(q, keys, entries, select, sink, d ** -0.5, **kw), 2e-6)


def test_reference_is_a_per_query_sink_softmax():
    """The reference against a plain loop: per query and head, softmax over [sink, the window keys the
    query sees, the entries it attends], the sink's value dropped; chunks past QUERY_CHUNK agree too."""
    from shardsmith.runtime.layers.kernels.deepseek_v4 import prefill_attention as mod

    for mode in ("sliding", "hca", "csa"):
        q, keys, entries, select, sink, kw = _case(13, 3, 16, 5, 9, mode=mode, ratio=2, K=3, seed=7)
        old, mod.QUERY_CHUNK = mod.QUERY_CHUNK, 4  # several reference chunks
        try:
            got = prefill_attention_reference(q, keys, entries, select, sink, 0.3, **kw)
        finally:
            mod.QUERY_CHUNK = old
        first, W = kw["first"], kw["window"]
        picks = None if entries is None else entry_mask(select, torch.arange(9, 22), entries.shape[0], 2)
        for t in range(13):
            pos = 9 + t
            rows = [j for j in range(keys.shape[0]) if 0 <= pos - (first + j) < W]
            k = keys[rows]
            if entries is not None:
                k = torch.cat((k, entries[picks[t]]))
            for h in range(3):
                logits = torch.cat((sink[h:h + 1], q[t, h] @ k.T * 0.3))
                want = logits.softmax(0)[1:] @ k
                assert torch.allclose(got[t, h], want, atol=1e-6), (mode, t, h)


def test_entry_mask_reads_holes_and_completion():
    select = torch.tensor([[2, -1], [0, 1]])
    assert entry_mask(select, torch.arange(2), 3, 4).tolist() == [[False, False, True], [True, True, False]]
    assert entry_mask(None, torch.tensor([2, 3, 8]), 3, 4).tolist() == [[False] * 3, [True, False, False],
                                                                        [True, True, False]]


@needs_triton
def test_a_query_that_sees_only_itself_and_the_sink():
    """Window 1, no entries complete: each query attends its own key and the sink: ``e^s/(e^s + e^x)``
    weighs zero, the rest weighs its key."""
    q, keys, _, _, sink, kw = _case(5, 2, 16, 1, 0, mode="sliding")
    got = prefill_attention(q, keys, None, None, sink, 0.25, backend="triton", **kw)
    logit = (q * keys[:, None, :]).sum(-1) * 0.25  # [T, n]
    share = torch.sigmoid(logit - sink[None, :])  # the key's probability against the sink
    _close(got, share[..., None] * keys[:, None, :], 2e-6)


def test_bad_inputs_are_refused_with_every_problem():
    q, keys, entries, select, sink, kw = _case(8, 4, 16, 4, 4)
    with pytest.raises(KernelError, match=r"select .* want \[T, K\].*sink \(3,\)"):
        prefill_attention(q, keys, entries, select[:3], sink[:3], 0.25, backend="reference", **kw)
    with pytest.raises(KernelError, match="keys cover positions"):
        prefill_attention(q, keys[:-1], entries, select, sink, 0.25, backend="reference", **kw)
    with pytest.raises(KernelError, match="bfloat16, float16, float32, float64, the same"):
        prefill_attention(q.double(), keys, None, None, sink, 0.25, backend="reference", **kw)
    double = prefill_attention(q.double(), keys.double(), None, None, sink, 0.25, backend="triton", **kw)
    assert double.dtype == torch.float64  # float64 (parity runs) takes the reference, even when Triton is asked


def _scores_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """The same ``-inf`` places, the finite scores within ``tol`` of the largest."""
    assert got.shape == want.shape and got.dtype == torch.float32
    hidden = torch.isinf(want)
    assert torch.equal(torch.isinf(got), hidden) and (got[hidden] < 0).all()
    if (~hidden).any():
        err = (got[~hidden].double() - want[~hidden].double()).abs().max().item()
        assert err <= tol * max(1.0, want[~hidden].abs().max().item()), err


@needs_triton
@pytest.mark.parametrize(("T", "h", "c", "q0", "ratio"), [
    (37, 4, 32, 0, 4),      # the first chunk: the early queries see nothing, the triangle inside
    (45, 20, 48, 300, 4),   # a later chunk: many blocks seen by all, heads past 16, c not a power of two
    (16, 3, 16, 1000, 4),   # one query tile, every block complete
    (70, 2, 32, 5, 128),    # no entry complete at all: every block skipped, all -inf
])
def test_index_prefill_scores_match_reference(T, h, c, q0, ratio):
    g = torch.Generator().manual_seed(T + q0)
    q, w = torch.randn(T, h, c, generator=g), torch.randn(T, h, generator=g)
    entries = torch.randn((q0 + T) // ratio, c, generator=g)
    got = indexer_prefill_scores(q, w, entries, q0=q0, ratio=ratio, backend="triton")
    want = indexer_prefill_scores_reference(q, w, entries, q0=q0, ratio=ratio)
    _scores_close(got, want, 2e-6)
    for t in (0, T - 1):  # the formula, by hand
        seen = (q0 + t + 1) // ratio
        by_hand = (torch.relu(q[t] @ entries[:seen].T) * c ** -0.5 * w[t][:, None]).sum(0)
        assert torch.allclose(want[t, :seen], by_hand, atol=1e-5) and torch.isinf(want[t, seen:]).all()


def test_index_prefill_scores_refuse_bad_inputs():
    q, w, entries = torch.randn(4, 2, 8), torch.randn(4, 2), torch.randn(3, 8)
    with pytest.raises(KernelError, match=r"w \(4, 3\).*ratio 0"):
        indexer_prefill_scores(q, torch.randn(4, 3), entries, q0=0, ratio=0, backend="reference")
    with pytest.raises(KernelError, match="want \\[T, h, c\\] and \\[C, c\\]"):
        indexer_prefill_scores(q, w, entries[:, :4], q0=0, ratio=4, backend="reference")


# ------------------------------------------------------------------ GPU: V4-Flash shapes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("mode", "ratio"), [("sliding", 4), ("hca", 128), ("csa", 4)])
def test_v4_shapes_on_cuda_within_bf16(mode, ratio):
    q, keys, entries, select, sink, kw = _case(2048, 64, 512, 128, 6144, mode=mode, ratio=ratio, K=512,
                                               dtype=torch.bfloat16, device="cuda", seed=11)
    scale = 512 ** -0.5
    got = prefill_attention(q, keys, entries, select, sink, scale, **kw)
    want = prefill_attention_reference(q, keys, entries, select, sink, scale, **kw)
    f = (lambda x: None if x is None else x.float())
    truth = prefill_attention_reference(q.float(), keys.float(), f(entries), select, sink, scale, **kw)
    err, ref_err = (got.float() - truth).abs().max().item(), (want.float() - truth).abs().max().item()
    assert err <= 4 * ref_err + 1e-3, (err, ref_err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_index_prefill_scores_v4_shapes_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(3)
    T, q0 = 2048, 6144
    q = torch.randn(T, 64, 128, generator=g, device="cuda").bfloat16()
    w = torch.randn(T, 64, generator=g, device="cuda")
    entries = torch.randn((q0 + T) // 4, 128, generator=g, device="cuda").bfloat16()
    got = indexer_prefill_scores(q, w, entries, q0=q0, ratio=4)
    _scores_close(got, indexer_prefill_scores_reference(q, w, entries, q0=q0, ratio=4), 1e-5)
