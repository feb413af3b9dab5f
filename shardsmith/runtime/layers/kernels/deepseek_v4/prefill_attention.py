"""DeepSeek-V4 prefill attention: one sequence's chunk of queries over its window and compressed entries.

A prefill (or a chunk of one) attends each new query over the keys its layer lets it see (K = V, one
latent KV head; ``Attention.core`` in ``models/deepseek_v4/attention.py``; paper §2.3):

=================  =====================  ===========================================================
tensor             shape                  what
=================  =====================  ===========================================================
``q``              ``[T, n, d]``          the chunk's queries, at positions ``q0 .. q0 + T - 1`` (bf16,
                                          f16, f32; f64 runs the reference)
``keys``           ``[S, d]``             window keys in position order, row ``j`` at ``first + j``;
                                          query ``t`` sees rows at ``pos - W < first + j <= pos``
``entries``        ``[C, d]`` or None     the slot's compressed entries so far (compressed layers)
``select``         ``[T, K]`` int or      CSA: the entries each query attends (the indexer's top-k),
                   None                   ``-1`` for none; None: every complete entry, ``w < (pos +
                                          1) // ratio`` (HCA)
``sink``           ``[n]`` float32        each head's sink logit (value zero)
output             ``[T, n, d]``          ``softmax(scale * q k^T)`` over the visible keys and the
                                          sink, times the keys, in ``q.dtype``
=================  =====================  ===========================================================

:func:`prefill_attention_reference` is the PyTorch maths (float32 einsums over ``[n, T', S + C]``
logits with a mask, ``T'`` up to :data:`QUERY_CHUNK` queries at a time: memory grows with ``T (W + C)``,
and a CSA layer scores all ``C`` entries to keep ``K`` of them). :func:`prefill_attention` is one
Triton launch that, per query and head block, reads only the keys that query sees (its window rows,
then its selected or complete entries, gathered from the buffer) under an online softmax, so nothing
``[n, T, S]`` reaches memory and a CSA query costs ``W + K`` key rows whatever the context (the
sparse prefill of DeepSeek's FlashMLA has the same shape: heads as the tile's rows, one query's
keys as its columns; written anew here). Scores and sums are float32; probabilities meet the keys
in the keys' dtype on the tensor cores, so bf16 results differ from the reference within bf16
rounding, not bitwise.

Legend: T = queries, n = local heads, d = head dim, S = window keys given, W = window, C = entries,
K = entries selected per query.
"""

from __future__ import annotations

import torch

from shardsmith.runtime.layers.kernels._common import (
    KernelError,
    interpreting,
    use_triton,
)

FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # float64: the reference only (parity runs)
QUERY_CHUNK = 1024  # queries per einsum in the reference (its logits are [n, QUERY_CHUNK, S + C] float32)
BLOCK_H = 16  # heads per program (tl.dot's smallest M)
BLOCK_S = 32  # key rows per step


def entry_mask(select: torch.Tensor | None, positions: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """``[T, C]`` bool: the entries each query attends. ``select`` ``[T, K]`` (``-1``: none) names them
    (CSA); None: every complete one, ``w < (pos + 1) // ratio`` (HCA)."""
    if select is None:
        return torch.arange(n_entries, device=positions.device)[None, :] < ((positions + 1) // ratio)[:, None]
    picked = select.long()
    mask = torch.zeros(select.shape[0], n_entries + 1, dtype=torch.bool, device=select.device)
    mask.scatter_(1, torch.where(picked < 0, n_entries, picked), True)  # -1 lands in a spare last column
    return mask[:, :n_entries]


def prefill_attention_reference(q: torch.Tensor, keys: torch.Tensor, entries: torch.Tensor | None,
                                select: torch.Tensor | None, sink: torch.Tensor, scale: float, *, q0: int,
                                first: int, window: int, ratio: int = 1) -> torch.Tensor:
    """The PyTorch path (module table): per :data:`QUERY_CHUNK` queries, float32 logits over the window
    keys any of them sees and all entries, masked (window distance, :func:`entry_mask`), a softmax
    with the sink column, dropped after, and the weighted sum of the keys."""
    T, n, _ = q.shape
    out = torch.empty_like(q)
    C = 0 if entries is None else entries.shape[0]
    for a in range(0, T, QUERY_CHUNK):
        b = min(T, a + QUERY_CHUNK)
        p0 = q0 + a
        lo, hi = max(0, p0 - window + 1 - first), p0 + (b - a) - first  # window rows any query here sees
        k = keys[lo:hi]  # [S', d]
        positions = torch.arange(p0, q0 + b, device=q.device)
        dist = positions[:, None] - torch.arange(first + lo, first + hi, device=q.device)[None, :]
        mask = (dist >= 0) & (dist < window)  # [T', S']
        if C:
            mask = torch.cat((mask, entry_mask(None if select is None else select[a:b], positions, C, ratio)), dim=1)
            k = torch.cat((k, entries))
        logits = torch.einsum("tnd,sd->nts", q[a:b].float(), k.float()) * scale  # [n, T', S' + C]
        logits = logits.masked_fill(~mask, float("-inf"))
        logits = torch.cat((logits, sink.float()[:, None, None].expand(n, b - a, 1)), dim=-1)
        probs = (logits - logits.amax(dim=-1, keepdim=True)).softmax(dim=-1)[..., :-1]
        out[a:b] = torch.einsum("nts,sd->tnd", probs, k.float()).to(q.dtype)
    return out


def _check(q: torch.Tensor, keys: torch.Tensor, entries: torch.Tensor | None, select: torch.Tensor | None,
           sink: torch.Tensor, q0: int, first: int, window: int, ratio: int) -> None:
    problems = []
    if q.dim() != 3 or keys.dim() != 2 or q.shape[-1] != keys.shape[-1]:
        problems.append(f"q {tuple(q.shape)} and keys {tuple(keys.shape)}: want [T, n, d] and [S, d]")
    if q.dtype not in FLOATS or keys.dtype != q.dtype:
        problems.append(f"q {q.dtype}, keys {keys.dtype}: one of bfloat16, float16, float32, float64, the same")
    if entries is not None and (entries.dim() != 2 or entries.shape[-1] != keys.shape[-1] or entries.dtype != keys.dtype):
        problems.append(f"entries {tuple(entries.shape)} {entries.dtype}: want [C, d] in the keys' dtype")
    if select is not None and (entries is None or select.dim() != 2 or select.shape[0] != q.shape[0]
                               or select.dtype not in (torch.int32, torch.int64)):
        problems.append(f"select {tuple(select.shape)} {select.dtype}: want [T, K] int32 or int64, with entries")
    if q.dim() == 3 and tuple(sink.shape) != (q.shape[1],):
        problems.append(f"sink {tuple(sink.shape)}: want [n] = [{q.shape[1]}]")
    if window < 1 or ratio < 1 or q0 < 0 or first < 0:
        problems.append(f"window {window}, ratio {ratio}, q0 {q0}, first {first}: want window, ratio >= 1 and "
                        "positions >= 0")
    elif q.dim() == 3 and keys.dim() == 2 and (first > q0 or q0 + q.shape[0] - first > keys.shape[0]):
        problems.append(f"keys cover positions {first} .. {first + keys.shape[0] - 1}; the queries at {q0} .. "
                        f"{q0 + q.shape[0] - 1} need up to {q0 + q.shape[0] - 1}, from at most {q0}")
    if len({t.device for t in (q, keys, sink, *(x for x in (entries, select) if x is not None))}) != 1:
        problems.append("q, keys, entries, select and sink must be on one device")
    if problems:
        raise KernelError("prefill_attention: " + "; ".join(problems))


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, entries: torch.Tensor | None,
                      select: torch.Tensor | None, sink: torch.Tensor, scale: float, *, q0: int, first: int,
                      window: int, ratio: int = 1, backend: str = "auto") -> torch.Tensor:
    """Sink attention of one sequence's ``T`` new queries over their window and compressed entries
    (module table), each query reading only the key rows it sees.

    Args:
        q, keys, entries, select, sink: as the module table; scale: the logits' factor (``d ** -0.5``).
        q0: the first query's position; first: the position of ``keys[0]`` (``<= q0``; rows older than
            a query's window are not read); window: W.
        ratio: the compression ratio (the entries each query may see when ``select`` is None).
        backend: ``auto`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else the reference),
            ``triton`` or ``reference``.

    Returns:
        ``[T, n, d]`` in ``q.dtype``.

    Raises:
        KernelError: shapes, dtypes, positions or devices do not fit (every problem listed), or the
            backend cannot run.
    """
    _check(q, keys, entries, select, sink, q0, first, window, ratio)
    if entries is not None and entries.shape[0] == 0:
        entries = select = None
    if not use_triton(q, backend) or q.numel() == 0 or q.dtype == torch.float64:
        return prefill_attention_reference(q, keys, entries, select, sink, scale, q0=q0, first=first,
                                           window=window, ratio=ratio)
    from shardsmith.runtime.layers.kernels.deepseek_v4 import _prefill_attention_triton

    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    mode = 0 if entries is None else 1 if select is None else 2
    if entries is None:
        entries = keys[:0]
    elif entries.stride(-1) != 1:
        entries = entries.contiguous()
    select = (keys.new_full((q.shape[0], 0), -1, dtype=torch.int32) if select is None
              else select.to(torch.int32).contiguous())
    out = torch.empty_like(q)
    d = q.shape[-1]
    _prefill_attention_triton.launch(q, keys, entries, select, sink.float().contiguous(), out, q0=q0, first=first,
                                     window=window, ratio=ratio, scale=scale, mode=mode, block_h=BLOCK_H,
                                     block_s=BLOCK_S, dot_f32=q.dtype == torch.float32 or interpreting(),
                                     num_warps=4 if d <= 128 else 8)
    return out
