"""DeepSeek-V4's lightning-indexer scores for decode rows, read straight from the compressed-entry buffer.

A CSA layer's indexer scores each row's compressed entries before its top-k (paper §2.3;
``Indexer.step`` in ``models/deepseek_v4/compressor.py``):

``score[b, s] = sum_h w[b, h] * relu(q[b, h] . k[index[b], s]) * c^-1/2``

=================  ==================  ==========================================================
tensor             shape               what
=================  ==================  ==========================================================
``q``              ``[B, h, c]``       the rows' index queries (bf16, f16 or f32)
``w``              ``[B, h]`` float32  the rows' head weights
``entries``        ``[N, E, c]``       the indexer compressor's entries per slot (``q``'s dtype)
``index``          ``[B]`` int64       each row's slot
output             ``[B, C]`` float32  scores of entries ``[0, C)`` (``C <= E``: the bucket's)
=================  ==================  ==========================================================

:func:`indexer_scores_reference` is the PyTorch maths the model ran (a gather of ``entries[index, :C]``,
float32 copies of it and of ``q``, an einsum, relu, a weighted sum: six kernels and two ``[B, C, c]``
copies per CSA layer); :func:`indexer_scores` is one Triton launch that reads each entry once and
scores it against every head with ``tl.dot`` (float32 accumulation of exact bf16 products): equal
within float32 rounding, not bitwise, so a top-k over near-ties may pick differently.

Legend: B = decode rows, h = index heads, c = index head dim, N = slots, E = entries per slot, C =
entry columns scored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardsmith.runtime.layers.kernels._common import KernelError, interpreting, use_triton

BLOCK_S = 32  # entries per program


def indexer_scores_reference(q: torch.Tensor, w: torch.Tensor, entries: torch.Tensor, index: torch.Tensor,
                             columns: int) -> torch.Tensor:
    """The PyTorch path :func:`indexer_scores` replaces (shapes in the module table)."""
    keys = entries[index, :columns]  # [B, C, c]
    scores = F.relu(torch.einsum("thc,tsc->ths", q.float(), keys.float())) * q.shape[-1] ** -0.5
    return (scores * w[..., None]).sum(dim=1)  # [B, C]


def _check(q: torch.Tensor, w: torch.Tensor, entries: torch.Tensor, index: torch.Tensor, columns: int) -> None:
    problems = []
    if q.dim() != 3 or entries.dim() != 3 or q.shape[-1] != entries.shape[-1]:
        problems.append(f"q {tuple(q.shape)} and entries {tuple(entries.shape)}: want [B, h, c] and [N, E, c]")
    elif not 0 <= columns <= entries.shape[1]:
        problems.append(f"columns {columns}: want 0 .. E = {entries.shape[1]}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or entries.dtype != q.dtype:
        problems.append(f"q {q.dtype}, entries {entries.dtype}: one of bfloat16, float16, float32")
    if w.dtype != torch.float32 or w.shape != q.shape[:2]:
        problems.append(f"w {tuple(w.shape)} {w.dtype}: want [B, h] float32")
    if index.dtype != torch.int64 or index.shape != q.shape[:1]:
        problems.append(f"index {tuple(index.shape)} {index.dtype}: want [B] int64")
    if len({t.device for t in (q, w, entries, index)}) != 1:
        problems.append("q, w, entries and index must be on one device")
    if problems:
        raise KernelError("indexer_scores: " + "; ".join(problems))


def indexer_scores(q: torch.Tensor, w: torch.Tensor, entries: torch.Tensor, index: torch.Tensor, columns: int, *,
                   backend: str = "auto") -> torch.Tensor:
    """Index scores of ``B`` decode rows over their slots' first ``columns`` entries, each entry read once.

    No host sync and shapes fixed by the inputs, so calls can be captured in a CUDA graph.

    Args:
        q, w, entries, index: as the module table; columns: C, the entries scored.
        backend: ``auto`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else the reference),
            ``triton`` or ``reference``.

    Returns:
        ``[B, C]`` float32.

    Raises:
        KernelError: shapes, dtypes or devices do not fit (every problem listed), or the backend cannot run.
    """
    _check(q, w, entries, index, columns)
    if not use_triton(q, backend) or columns == 0 or q.numel() == 0:
        return indexer_scores_reference(q, w, entries, index, columns)
    from shardsmith.runtime.layers.kernels.deepseek_v4 import _indexer_triton

    q = q if q.stride(-1) == 1 else q.contiguous()
    w, index = w.contiguous(), index.contiguous()  # read by element offset
    entries = entries if entries.stride(-1) == 1 else entries.contiguous()
    out = torch.empty((q.shape[0], columns), dtype=torch.float32, device=q.device)
    _indexer_triton.launch(q, w, entries, index, out, block_s=BLOCK_S,
                           dot_f32=q.dtype == torch.float32 or interpreting())
    return out


PREFILL_BLOCK_T = 32  # queries per prefill program
PREFILL_BLOCK_S = 256  # entries per prefill program (each query tile is read once per entry block)


def indexer_prefill_scores_reference(q: torch.Tensor, w: torch.Tensor, entries: torch.Tensor, *, q0: int,
                                     ratio: int) -> torch.Tensor:
    """One sequence's index scores ``[T, C]`` float32 (the module's formula) of queries ``q [T, h, c]``
    at positions ``q0 ..`` with head weights ``w [T, h]`` float32 over its entries ``[C, c]``, ``-inf``
    where entry ``s`` is not complete for the query (``s >= (pos + 1) // ratio``): the einsum the
    prefill ran."""
    scores = F.relu(torch.einsum("thc,sc->ths", q.float(), entries.float())) * q.shape[-1] ** -0.5
    score = (scores * w[..., None]).sum(dim=1)  # [T, C]
    positions = torch.arange(q0, q0 + q.shape[0], device=q.device)
    hidden = torch.arange(entries.shape[0], device=q.device)[None, :] >= ((positions + 1) // ratio)[:, None]
    return score.masked_fill(hidden, float("-inf"))


def indexer_prefill_scores(q: torch.Tensor, w: torch.Tensor, entries: torch.Tensor, *, q0: int, ratio: int,
                           backend: str = "auto") -> torch.Tensor:
    """Index scores of one sequence's prefill chunk (:func:`indexer_prefill_scores_reference`'s maths and
    shapes), one Triton launch that reads each query tile once per block of :data:`PREFILL_BLOCK_S`
    entries and skips blocks no query of a tile may see yet.

    Args:
        q: ``[T, h, c]``; w: ``[T, h]`` float32; entries: ``[C, c]`` in ``q``'s dtype; q0: the first
            query's position; ratio: the compression ratio (which entries are complete).
        backend: ``auto`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else the reference),
            ``triton`` or ``reference``.

    Returns:
        ``[T, C]`` float32, ``-inf`` where an entry is not complete for the query.

    Raises:
        KernelError: shapes, dtypes or devices do not fit (every problem listed), or the backend cannot run.
    """
    problems = []
    if q.dim() != 3 or entries.dim() != 2 or q.shape[-1] != entries.shape[-1]:
        problems.append(f"q {tuple(q.shape)} and entries {tuple(entries.shape)}: want [T, h, c] and [C, c]")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64) or entries.dtype != q.dtype:
        problems.append(f"q {q.dtype}, entries {entries.dtype}: one of bfloat16, float16, float32, float64, the same")
    if w.dtype != torch.float32 or w.shape != q.shape[:2]:
        problems.append(f"w {tuple(w.shape)} {w.dtype}: want [T, h] float32")
    if q0 < 0 or ratio < 1:
        problems.append(f"q0 {q0}, ratio {ratio}: want q0 >= 0, ratio >= 1")
    if len({t.device for t in (q, w, entries)}) != 1:
        problems.append("q, w and entries must be on one device")
    if problems:
        raise KernelError("indexer_prefill_scores: " + "; ".join(problems))
    if not use_triton(q, backend) or entries.shape[0] == 0 or q.numel() == 0 or q.dtype == torch.float64:
        return indexer_prefill_scores_reference(q, w, entries, q0=q0, ratio=ratio)
    from shardsmith.runtime.layers.kernels.deepseek_v4 import _indexer_triton

    q = q if q.stride(-1) == 1 else q.contiguous()
    entries = entries if entries.stride(-1) == 1 else entries.contiguous()
    w = w.contiguous()
    out = torch.empty((q.shape[0], entries.shape[0]), dtype=torch.float32, device=q.device)
    _indexer_triton.launch_prefill(q, w, entries, out, q0=q0, ratio=ratio, block_t=PREFILL_BLOCK_T,
                                   block_s=PREFILL_BLOCK_S, dot_f32=q.dtype == torch.float32 or interpreting(),
                                   num_warps=8)
    return out
