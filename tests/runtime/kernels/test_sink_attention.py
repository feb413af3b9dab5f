"""DeepSeek-V4's decode attention kernels (``sink_attention``, ``indexer_scores``) against their PyTorch
references.

CPU: under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton loads) on small shapes in
float32: one or two bias tensors (sliding / HCA, CSA), head counts below and past one 16-head block, a
head dim that is not a power of two, rows whose every key is hidden (only the sink remains: output
zero), many splits with chunks whose columns are all hidden, rows that share a slot, an index view
that is not contiguous, and no rows at all. The kernel's float32
dot and online softmax land within float32 rounding of the reference's ``baddbmm`` / ``bmm``.
The indexer's scores: one to many score blocks, padded heads and head dims, within float32 rounding.
GPU (``-m gpu``): V4-Flash's real shapes (64 heads, head dim 512, window 128, 4-2048 entries) in bf16
within bf16 rounding of the reference, the same bits under CUDA-graph capture and replay; the
indexer's 64 x 128 heads over 128-4096 entries within float32 rounding.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shardsmith.runtime.layers.kernels import KernelError, triton_available
from shardsmith.runtime.layers.kernels.deepseek_v4.indexer_scores import indexer_scores, indexer_scores_reference
from shardsmith.runtime.layers.kernels.deepseek_v4.sink_attention import (BLOCK_S, sink_attention, sink_attention_reference,
                                                               splits_for)

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
NEG = float("-inf")


def _case(B: int, n: int, d: int, W: int, C: int, two: bool, *, slots: int = 5, hidden: float = 0.3,
          dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    keys = torch.randn(slots, 1 + W + C + 3, d, generator=g, device=device).to(dtype)
    keys[:, 0] = 0  # the sink row
    q = torch.randn(B, n, d, generator=g, device=device).to(dtype)
    index = torch.randint(0, slots, (B,), generator=g, device=device)
    mask = lambda c: torch.where(torch.rand(B, c, generator=g, device=device) < hidden, NEG, 0.0)  # noqa: E731
    biases = (mask(W), mask(C)) if two else (mask(W + C),)
    sink = torch.randn(n, generator=g, device=device)
    return q, keys, index, biases, sink


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype and torch.isfinite(got).all()
    err = (got.double() - want.double()).abs().max().item()
    assert err <= tol * max(1.0, want.double().abs().max().item()), err


@needs_triton
@pytest.mark.parametrize(("B", "n", "d", "W", "C", "two"), [
    (1, 4, 64, 8, 6, True),        # CSA: window bias, then the indexer's picks
    (3, 20, 48, 16, 0, False),     # sliding: window only; 20 heads = a block and a partial one; d = 48
    (2, 16, 64, 128, 128, True),   # V4's window, several splits
    (1, 2, 32, 8, 4, False),       # HCA: window and visible entries in one bias
    (4, 3, 32, 40, 300, False),    # long entries: many splits, ragged last chunk
])
def test_kernel_matches_reference(B, n, d, W, C, two):
    q, keys, index, biases, sink = _case(B, n, d, W, C, two, seed=B * 100 + C)
    got = sink_attention(q, keys, index, biases, sink, d ** -0.5, backend="triton")
    _close(got, sink_attention_reference(q, keys, index, biases, sink, d ** -0.5), 2e-6)


@needs_triton
def test_hidden_rows_keep_only_the_sink_and_shared_slots():
    """Every key hidden: the sink takes all the mass and its value is zero, so the output is zero (no
    NaN from an all -inf chunk); rows reading the same slot with different biases stay apart."""
    q, keys, index, biases, sink = _case(3, 4, 32, 16, 64, True, hidden=0.5, seed=3)
    index = torch.tensor([2, 2, 1])
    biases = (biases[0].clone(), biases[1].clone())
    biases[0][0], biases[1][0] = NEG, NEG  # row 0 sees nothing
    got = sink_attention(q, keys, index, biases, sink, 32 ** -0.5, backend="triton")
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    _close(got, sink_attention_reference(q, keys, index, biases, sink, 32 ** -0.5), 2e-6)
    assert not torch.allclose(got[1], got[2])


@needs_triton
def test_strided_index_and_empty_batches():
    q, keys, index, biases, sink = _case(3, 4, 32, 8, 8, True, slots=6, seed=5)
    wide = torch.stack((index, torch.full_like(index, 99)), dim=1)  # a column view: stride 2
    got = sink_attention(q, keys, wide[:, 0], biases, sink, 32 ** -0.5, backend="triton")
    _close(got, sink_attention_reference(q, keys, index, biases, sink, 32 ** -0.5), 2e-6)
    empty = sink_attention(q[:0], keys, index[:0], tuple(b[:0] for b in biases), sink, 0.1, backend="triton")
    assert empty.shape == (0, 4, 32)


def test_reference_is_the_sink_softmax():
    """The reference against a plain loop: per row and head, softmax over [sink logit, scaled scores
    + bias], the sink's value dropped."""
    q, keys, index, biases, sink = _case(2, 3, 16, 8, 5, True, seed=4)
    got = sink_attention_reference(q, keys, index, biases, sink, 0.25)
    bias = torch.cat(biases, dim=1)
    for b in range(2):
        k = keys[index[b], 1:1 + bias.shape[1]]
        for h in range(3):
            logits = torch.cat((sink[h:h + 1], q[b, h] @ k.T * 0.25 + bias[b]))
            want = logits.softmax(0)[1:] @ k
            assert torch.allclose(got[b, h], want, atol=1e-6)


def test_splits_cover_the_columns_with_whole_steps():
    for rows, heads, columns in [(1, 64, 256), (1, 64, 128), (8, 64, 4224), (32, 16, 131), (1, 4, 1), (2, 8, 0)]:
        splits, chunk = splits_for(rows, heads, columns, 132)
        assert chunk % BLOCK_S == 0 and splits >= 1
        assert (splits - 1) * chunk < max(1, columns) <= splits * chunk  # no empty trailing split
    assert splits_for(1, 64, 256, 132)[0] == 8  # one step each: 4 head blocks x 8 = 32 programs


def test_bad_inputs_are_refused_with_every_problem():
    q, keys, index, biases, sink = _case(2, 4, 16, 8, 4, True)
    with pytest.raises(KernelError, match=r"index .* want \[B\] int64.*sink \(3,\)"):
        sink_attention(q, keys, index.int(), biases, sink[:3], 0.25, backend="reference")
    with pytest.raises(KernelError, match="keys hold"):
        sink_attention(q, keys, index, (biases[0], torch.zeros(2, 100)), sink, 0.25, backend="reference")
    with pytest.raises(KernelError, match="bfloat16, float16, float32"):
        sink_attention(q.double(), keys.double(), index, biases, sink, 0.25, backend="reference")


# ------------------------------------------------------------------ GPU: V4-Flash shapes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("B", "C", "two"), [(1, 0, False), (1, 4, False), (1, 128, True), (4, 1024, True),
                                             (16, 2048, True)])
def test_v4_shapes_on_cuda_within_bf16_and_graphed(B, C, two):
    q, keys, index, biases, sink = _case(B, 64, 512, 128, C, two, slots=max(4, B), dtype=torch.bfloat16,
                                         device="cuda", seed=B + C)
    scale = 512 ** -0.5
    got = sink_attention(q, keys, index, biases, sink, scale)
    want = sink_attention_reference(q, keys, index, biases, sink, scale)
    truth = sink_attention_reference(q.float(), keys.float(), index, biases, sink, scale)
    err, ref_err = (got.float() - truth).abs().max().item(), (want.float() - truth).abs().max().item()
    assert err <= 4 * ref_err + 1e-3, (err, ref_err)
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        out = sink_attention(q, keys, index, biases, sink, scale)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, got)


# ------------------------------------------------------------------ the indexer's scores (CSA layers)


def _index_case(B: int, h: int, c: int, E: int, *, dtype=torch.float32, device: str = "cpu", seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, h, c, generator=g, device=device).to(dtype)
    w = torch.randn(B, h, generator=g, device=device)
    entries = torch.randn(6, E, c, generator=g, device=device).to(dtype)
    index = torch.randint(0, 6, (B,), generator=g, device=device)
    return q, w, entries, index


@needs_triton
@pytest.mark.parametrize(("B", "h", "c", "E", "C"), [
    (1, 4, 32, 40, 40),      # every entry, a partial second block
    (3, 20, 48, 100, 67),    # heads past 16 (padded to 32), c not a power of two, C < E
    (2, 64, 128, 64, 16),    # V4's index heads and dim, a short bucket
])
def test_indexer_scores_match_reference(B, h, c, E, C):
    q, w, entries, index = _index_case(B, h, c, E, seed=B + h)
    got = indexer_scores(q, w, entries, index, C, backend="triton")
    want = indexer_scores_reference(q, w, entries, index, C)
    _close(got, want, 2e-6)
    assert got.shape == (B, C)


def test_indexer_reference_is_the_weighted_relu_sum_and_refuses_bad_inputs():
    q, w, entries, index = _index_case(2, 3, 8, 5)
    got = indexer_scores_reference(q, w, entries, index, 4)
    for b in range(2):
        want = (torch.relu(q[b] @ entries[index[b], :4].T) * 8 ** -0.5 * w[b][:, None]).sum(0)
        assert torch.allclose(got[b], want, atol=1e-6)
    with pytest.raises(KernelError, match=r"columns 9: want 0 .. E = 5.*w \(2, 2\)"):
        indexer_scores(q, w[:, :2], entries, index, 9, backend="reference")
    assert indexer_scores(q, w, entries, index, 0).shape == (2, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("B", "C"), [(1, 128), (4, 1024), (16, 4096)])
def test_indexer_scores_v4_shapes_on_cuda(B, C):
    q, w, entries, index = _index_case(B, 64, 128, 4096, dtype=torch.bfloat16, device="cuda", seed=C)
    got = indexer_scores(q, w, entries, index, C)
    want = indexer_scores_reference(q, w, entries, index, C)
    _close(got, want, 1e-5)  # exact bf16 products, float32 sums in another order
