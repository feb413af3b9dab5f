"""DeepSeek-V4 decode attention over a gathered key buffer with per-head sinks, in one pass over the keys.

A decode step attends each row's query heads over its own slot's keys (K = V, one latent KV head;
``Attention.decode_core`` in ``models/deepseek_v4/attention.py``):

=================  ==========================  ===================================================
tensor             shape                       what
=================  ==========================  ===================================================
``q``              ``[B, n, d]``               the rows' queries (bf16, f16 or f32)
``keys``           ``[N, L, d]``               the layer's key buffer: row 0 the sink (zeros), then
                                               the window ring and the compressed entries
``index``          ``[B]`` int64               each row's slot in ``keys``
``biases``         ``[B, c_1]`` (, ``[B, c_2]``)  additive float32 biases of key columns ``1 ..
                                               S - 1`` in order (0 visible, ``-inf`` hidden):
                                               window then entries; ``S = 1 + c_1 + c_2``
``sink``           ``[n]`` float32             each head's sink logit (column 0, value zero)
output             ``[B, n, d]``               ``softmax(scale * q k^T + bias) k``, in ``q.dtype``
=================  ==========================  ===================================================

:func:`sink_attention_reference` is the PyTorch maths the model ran (a gather of ``keys[index, :S]``,
float32 ``baddbmm``, softmax, ``bmm``: seven kernels and two ``[B, S, d]`` copies per layer);
:func:`sink_attention` runs it as two Triton launches that read each key row once from the buffer
(flash-decoding, Dao et al. 2023: the key columns are split over programs, each keeps an online
softmax, and a second launch merges the splits with the sink; FlashMLA's decode has the same shape,
written anew here). Scores and sums are float32; the probabilities meet the keys in the keys' dtype
on the tensor cores (FlashAttention's practice), so bf16 results differ from the reference's
float32 ``bmm`` within bf16 rounding, not bitwise.

Legend: B = decode rows, n = local query heads, d = head dim, N = slots, L = key rows per slot,
S = key columns attended (sink included), c = bias columns.
"""

from __future__ import annotations

import torch

from shardsmith.runtime.layers.kernels._common import KernelError, interpreting, sm_count, use_triton

BLOCK_H = 16  # query heads per program (tl.dot's smallest M)
BLOCK_S = 32  # key columns per step


def _full_bias(biases: tuple[torch.Tensor, ...], sink: torch.Tensor, B: int, n: int) -> torch.Tensor:
    parts = [sink.float()[None, :, None].expand(B, n, 1)]
    parts += [b.float()[:, None, :].expand(B, n, b.shape[1]) for b in biases]
    return torch.cat(parts, dim=2)  # [B, n, S]


def sink_attention_reference(q: torch.Tensor, keys: torch.Tensor, index: torch.Tensor,
                             biases: tuple[torch.Tensor, ...], sink: torch.Tensor, scale: float) -> torch.Tensor:
    """The PyTorch path :func:`sink_attention` replaces (shapes in the module table): gather the rows'
    ``S`` key columns, float32 ``baddbmm`` with the full bias, softmax over all ``S`` (the sink's zero
    value adds nothing), ``bmm``, cast to ``q.dtype``."""
    B, n = q.shape[:2]
    S = 1 + sum(b.shape[1] for b in biases)
    k = keys[index, :S].float()  # [B, S, d]
    logits = torch.baddbmm(_full_bias(biases, sink, B, n), q.float(), k.transpose(1, 2), alpha=scale)
    return torch.bmm(logits.softmax(dim=-1), k).to(q.dtype)


def _check(q: torch.Tensor, keys: torch.Tensor, index: torch.Tensor, biases: tuple[torch.Tensor, ...],
           sink: torch.Tensor) -> None:
    problems = []
    if q.dim() != 3 or keys.dim() != 3 or q.shape[-1] != keys.shape[-1]:
        problems.append(f"q {tuple(q.shape)} and keys {tuple(keys.shape)}: want [B, n, d] and [N, L, d]")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or keys.dtype != q.dtype:
        problems.append(f"q {q.dtype}, keys {keys.dtype}: one of bfloat16, float16, float32")
    if index.dtype != torch.int64 or index.shape != q.shape[:1]:
        problems.append(f"index {tuple(index.shape)} {index.dtype}: want [B] int64")
    if not 1 <= len(biases) <= 2 or any(b.dim() != 2 or b.shape[0] != q.shape[0] for b in biases):
        problems.append(f"biases {[tuple(b.shape) for b in biases]}: want one or two [B, c] tensors")
    elif keys.dim() == 3 and 1 + sum(b.shape[1] for b in biases) > keys.shape[1]:
        problems.append(f"biases cover {sum(b.shape[1] for b in biases)} columns past the sink, keys hold "
                        f"{keys.shape[1] - 1}")
    if q.dim() == 3 and tuple(sink.shape) != (q.shape[1],):
        problems.append(f"sink {tuple(sink.shape)}: want [n] = [{q.shape[1]}]")
    if len({t.device for t in (q, keys, index, sink, *biases)}) != 1:
        problems.append("q, keys, index, biases and sink must be on one device")
    if problems:
        raise KernelError("sink_attention: " + "; ".join(problems))


def splits_for(rows: int, heads: int, columns: int, sms: int) -> tuple[int, int]:
    """``(splits, chunk)``: the key columns past the sink (``columns``) cut into ``splits`` chunks of
    ``chunk`` columns (a multiple of :data:`BLOCK_S`), enough programs for about two waves of ``sms``
    multiprocessors over ``rows x ceil(heads / BLOCK_H)`` head blocks, never a chunk under one step."""
    steps = max(1, -(-columns // BLOCK_S))
    want = max(1, -(-2 * sms // (rows * -(-heads // BLOCK_H))))
    chunk = -(-steps // min(steps, want)) * BLOCK_S
    return -(-max(1, columns) // chunk), chunk


def sink_attention(q: torch.Tensor, keys: torch.Tensor, index: torch.Tensor, biases: tuple[torch.Tensor, ...],
                   sink: torch.Tensor, scale: float, *, backend: str = "auto") -> torch.Tensor:
    """Sink attention of ``B`` decode rows over their slots' keys (module table), each key row read once.

    No host sync and shapes fixed by the inputs, so calls can be captured in a CUDA graph.

    Args:
        q, keys, index, biases, sink: as the module table; scale: the logits' factor (``d ** -0.5``).
        backend: ``auto`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else the reference),
            ``triton`` or ``reference``.

    Returns:
        ``[B, n, d]`` in ``q.dtype``.

    Raises:
        KernelError: shapes, dtypes or devices do not fit (every problem listed), or the backend cannot run.
    """
    biases = tuple(biases)
    _check(q, keys, index, biases, sink)
    if not use_triton(q, backend):
        return sink_attention_reference(q, keys, index, biases, sink, scale)
    from shardsmith.runtime.layers.kernels.deepseek_v4 import _sink_attention_triton

    B, n, d = q.shape
    if q.numel() == 0:  # no rows or no heads: nothing to attend
        return q.new_empty(q.shape)
    columns = sum(b.shape[1] for b in biases)
    splits, chunk = splits_for(B, n, columns, sm_count(q.device))
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    biases = tuple(b if b.stride(-1) == 1 else b.contiguous() for b in biases)
    index, sink = index.contiguous(), sink.float().contiguous()  # the kernels read both by element offset
    part_m = torch.empty((B, n, splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((B, n, splits, d), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    _sink_attention_triton.launch(q, keys, index, biases, sink, scale, out, part_m, part_l, part_acc,
                                  chunk=chunk, block_h=BLOCK_H, block_s=BLOCK_S,
                                  dot_f32=q.dtype == torch.float32 or interpreting())
    return out
