"""One decode step of a DeepSeek-V4 KV compressor for every row, in one launch.

A compressed layer's compressor (and a CSA layer's indexer's) takes one token per decode row into
its slot's pending window; the row whose token completes the window (``done``) pools the window into
a new compressed entry (paper §2.3; transformers ``DeepseekV4HCACompressor`` /
``DeepseekV4CSACompressor``; ``Compressor`` in ``models/deepseek_v4/compressor.py``):

``entry = rope(norm(sum_j softmax_j(G_j) * C_j))``, ``G = gate + ape`` (float32), ``C`` the kv rows

over the window's ``r`` rows (HCA), or with overlap (CSA) over ``2r`` rows: the last complete window's
Ca half (``prev_kv`` / ``prev_gate``, kept per slot) then this window's Cb half; a done CSA row then
keeps this window's Ca half as the new ``prev``.

=================  ======================  ====================================================
tensor             shape                   what
=================  ======================  ====================================================
``kv_gate``        ``[B, 2, width]``       the rows' new ``(kv, gate)`` projections (dtype: bf16,
                                           f16 or f32; ``width = 2d`` with overlap, else ``d``)
``buf``            ``[N, r, 2, width]``    every slot's pending window (written: row ``column``)
``ape``            ``[r, width]`` float32  the window's position bias on the gates
``weight``         ``[d]`` float32         the entry's RMSNorm weight
``entries``        ``[N, E, d]``           every slot's entries (written where ``done``: row
                                           ``entry``); a view, rows may be strided
``index``          ``[B]`` int64           each row's slot
``column``         ``[B]`` int64           each row's column in its window (``position % r``)
``done``           ``[B]`` bool            the row completes its window (and is real)
``entry``          ``[B]`` int64           the entry a done row fills (``position // r``)
``cs``, ``sn``     ``[B, R]`` float32      the entry's RoPE in pairs (``ops.rope_pairs``)
``prev_kv``        ``[N, r, d]``           CSA: Ca of each slot's last complete window
``prev_gate``      ``[N, r, d]`` float32   CSA: its gates, ``ape`` added (``-inf``: none yet)
=================  ======================  ====================================================

:func:`compressor_step_reference` is the PyTorch path the model ran (an index_put, four gathers, two
``where`` + index_put pairs, two cats, softmax, the weighted sum, RMSNorm and RoPE as separate
kernels: about 22 launches for an HCA compressor and 30 for a CSA one, every step, though a row
completes its window once in ``r`` steps). :func:`compressor_step` is one Triton launch, a program
per row: it writes the row's kv and gate into its window and, only on a done row, pools, norms,
ropes and stores the entry (and the CSA carry). The same maths and roundings (the weights and the
products rounded to the kv dtype as the reference's bf16 tensors are, float32 sums), equal within
float32 summation order, not bitwise.

Legend: B = decode rows, N = slots, r = ratio (window rows), d = entry dim, E = entries per slot,
R = rope dims (the trailing ``R`` channels of an entry rotate).
"""

from __future__ import annotations

import torch

from shardsmith.runtime.layers.kernels._common import KernelError, use_triton


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``ops.RMSNorm``'s maths: float32, weighted, cast back to ``x.dtype``."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def _rope_pairs(x: torch.Tensor, cs: torch.Tensor, sn: torch.Tensor) -> torch.Tensor:
    """``ops.apply_rope_pairs`` on ``x`` ``[B, d]``: the trailing ``R`` channels rotated in pairs."""
    r = cs.shape[-1]
    rope = x[..., -r:].float()
    swapped = rope.unflatten(-1, (r // 2, 2)).flip(-1).flatten(-2)
    return torch.cat((x[..., :-r], (rope * cs + swapped * sn).to(x.dtype)), dim=-1)


def compressor_step_reference(kv_gate: torch.Tensor, buf: torch.Tensor, ape: torch.Tensor, weight: torch.Tensor,
                              entries: torch.Tensor, index: torch.Tensor, column: torch.Tensor, done: torch.Tensor,
                              entry: torch.Tensor, cs: torch.Tensor, sn: torch.Tensor,
                              prev_kv: torch.Tensor | None = None, prev_gate: torch.Tensor | None = None, *,
                              eps: float) -> None:
    """The PyTorch path :func:`compressor_step` replaces, in place (shapes in the module table): every
    row pools its window as if complete and only done rows keep the result (static shapes, no host
    branch)."""
    buf[index, column] = kv_gate
    window = buf[index]  # [B, r, 2, width]
    kv, gate = window[:, :, 0], window[:, :, 1] + ape  # [B, r, width]; gate float32
    if prev_kv is not None:
        d = prev_kv.shape[-1]
        prev = (prev_kv[index], prev_gate[index])  # copies (advanced indexing): read before the update
        keep = done[:, None, None]
        prev_kv[index] = torch.where(keep, kv[..., :d], prev[0])
        prev_gate[index] = torch.where(keep, gate[..., :d], prev[1])
        kv, gate = torch.cat((prev[0], kv[..., d:]), dim=1), torch.cat((prev[1], gate[..., d:]), dim=1)
    weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    new = _rope_pairs(_rms_norm((kv * weights).sum(dim=1), weight, eps), cs, sn)  # [B, d]
    entries[index, entry] = torch.where(done[:, None], new, entries[index, entry])


def _check(kv_gate, buf, ape, weight, entries, index, column, done, entry, cs, sn, prev_kv, prev_gate) -> None:
    problems = []
    if buf.dim() != 4 or buf.shape[2] != 2:
        problems.append(f"buf {tuple(buf.shape)}: want [N, r, 2, width]")
    else:
        N, r, _, width = buf.shape
        d = entries.shape[-1] if entries.dim() == 3 else -1
        overlap = prev_kv is not None
        if (prev_gate is not None) != overlap:
            problems.append("prev_kv and prev_gate: both (overlap) or neither")
        if width != (2 if overlap else 1) * d:
            problems.append(f"buf width {width}, entries' d {d}: want width = {'2d' if overlap else 'd'}")
        if kv_gate.dim() != 3 or tuple(kv_gate.shape[1:]) != (2, width):
            problems.append(f"kv_gate {tuple(kv_gate.shape)}: want [B, 2, {width}]")
        if tuple(ape.shape) != (r, width) or ape.dtype != torch.float32:
            problems.append(f"ape {tuple(ape.shape)} {ape.dtype}: want [{r}, {width}] float32")
        if tuple(weight.shape) != (d,) or weight.dtype != torch.float32:
            problems.append(f"weight {tuple(weight.shape)} {weight.dtype}: want [{d}] float32")
        if entries.dim() != 3 or entries.shape[0] != N:
            problems.append(f"entries {tuple(entries.shape)}: want [{N}, E, d]")
        if overlap and prev_gate is not None and (tuple(prev_kv.shape) != (N, r, d) or tuple(prev_gate.shape) != (N, r, d)
                        or prev_gate.dtype != torch.float32):
            problems.append(f"prev_kv {tuple(prev_kv.shape)}, prev_gate {tuple(prev_gate.shape)} {prev_gate.dtype}: "
                            f"want [{N}, {r}, {d}], the gate float32")
    B = kv_gate.shape[0] if kv_gate.dim() == 3 else -1
    for name, t, dtype in (("index", index, torch.int64), ("column", column, torch.int64),
                           ("done", done, torch.bool), ("entry", entry, torch.int64)):
        if tuple(t.shape) != (B,) or t.dtype != dtype:
            problems.append(f"{name} {tuple(t.shape)} {t.dtype}: want [{B}] {dtype}")
    if cs.shape != sn.shape or cs.dim() != 2 or cs.shape[0] != B or cs.shape[1] % 2 or cs.shape[1] < 2 or \
            entries.dim() == 3 and cs.shape[1] > entries.shape[-1] or \
            cs.dtype != torch.float32 or sn.dtype != torch.float32:
        problems.append(f"cs {tuple(cs.shape)} {cs.dtype}, sn {tuple(sn.shape)} {sn.dtype}: want [{B}, R] float32, "
                        "R even, 2 <= R <= d")
    kinds = (torch.bfloat16, torch.float16, torch.float32)
    named = [("kv_gate", kv_gate), ("buf", buf), ("entries", entries)] + ([("prev_kv", prev_kv)] if prev_kv is not None
                                                                          else [])
    if buf.dtype not in kinds or any(t.dtype != buf.dtype for _, t in named):
        problems.append(", ".join(f"{n} {t.dtype}" for n, t in named) + ": one dtype of bfloat16, float16, float32")
    tensors = (kv_gate, buf, ape, weight, entries, index, column, done, entry, cs, sn,
               *(t for t in (prev_kv, prev_gate) if t is not None))
    if len({t.device for t in tensors}) != 1:
        problems.append("every tensor must be on one device")
    if problems:
        raise KernelError("compressor_step: " + "; ".join(problems))


def compressor_step(kv_gate: torch.Tensor, buf: torch.Tensor, ape: torch.Tensor, weight: torch.Tensor,
                    entries: torch.Tensor, index: torch.Tensor, column: torch.Tensor, done: torch.Tensor,
                    entry: torch.Tensor, cs: torch.Tensor, sn: torch.Tensor, prev_kv: torch.Tensor | None = None,
                    prev_gate: torch.Tensor | None = None, *, eps: float, backend: str = "auto",
                    run: torch.Tensor | None = None) -> None:
    """Take one token per row into its slot's window; done rows write their pooled entry (in place).

    Real rows must hold distinct slots (padding rows may share the scratch slot: its state is
    garbage but finite), unless ``run`` is given: ``run`` ``[B]`` int64 lets a slot hold a run of
    rows that follow one another (a speculative verify run at consecutive positions): the run's
    length at its first row, 0 at its other rows, 1 at a slot's only row. The run's first row's
    program then takes the run's rows in order, so a window a later row completes pools the earlier
    ones: the state consecutive one-row steps leave, in one launch. ``run`` needs the Triton path (the
    model takes runs in phases on the reference). ``index < N``, ``column < r`` and ``entry < E`` are the caller's to keep
    (:class:`~shardsmith.runtime.models.deepseek_v4.rows.DecodeRows` builds them so): the kernel
    reads no host value and checks no index, where the reference raises ``IndexError``. No host
    sync and shapes fixed by the inputs, so calls can be captured in a CUDA graph.

    Args:
        kv_gate, buf, ape, weight, entries, index, column, done, entry, cs, sn, prev_kv, prev_gate: as
            the module table (``prev_*`` for CSA's overlap only); eps: the RMSNorm epsilon.
        backend: ``auto`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else the reference),
            ``triton`` or ``reference``.

    Raises:
        KernelError: shapes, dtypes or devices do not fit (every problem listed), ``buf``, ``prev_*``
            or the entries' last dim not contiguous or the rope dims not a power of two on the Triton
            path, ``run`` without the Triton path, or the backend cannot run.
    """
    _check(kv_gate, buf, ape, weight, entries, index, column, done, entry, cs, sn, prev_kv, prev_gate)
    if run is not None:
        if tuple(run.shape) != (kv_gate.shape[0],) or run.dtype != torch.int64 or run.device != kv_gate.device:
            raise KernelError(f"compressor_step: run {tuple(run.shape)} {run.dtype}: want [{kv_gate.shape[0]}] int64 "
                              "on the rows' device")
        if not use_triton(kv_gate, backend):
            raise KernelError("compressor_step: run lengths need the Triton path (on the reference a caller takes "
                              "a run's rows in phases, one call each)")
    if not use_triton(kv_gate, backend):
        return compressor_step_reference(kv_gate, buf, ape, weight, entries, index, column, done, entry, cs, sn,
                                         prev_kv, prev_gate, eps=eps)
    if kv_gate.shape[0] == 0:
        return None
    from shardsmith.runtime.layers.kernels.deepseek_v4 import _compressor_triton

    state = [buf, *(t for t in (prev_kv, prev_gate) if t is not None)]
    if not all(t.is_contiguous() for t in state) or entries.stride(-1) != 1:
        raise KernelError("compressor_step: buf, prev_kv, prev_gate and the entries' rows must be contiguous "
                          "(the kernel writes them in place)")
    if cs.shape[1] & (cs.shape[1] - 1):
        raise KernelError(f"compressor_step: rope dims {cs.shape[1]}: the kernel takes a power of two")
    # read-only inputs made contiguous (the kernel reads them by element offset)
    if kv_gate.stride(2) != 1 or kv_gate.stride(1) != kv_gate.shape[2]:  # rows may be strided (a merged GEMM's)
        kv_gate = kv_gate.contiguous()
    ape, weight, cs, sn = (t.contiguous() for t in (ape, weight, cs, sn))
    index, column, entry = index.contiguous(), column.contiguous(), entry.contiguous()
    _compressor_triton.launch(kv_gate, buf, ape, weight, entries, index, column, done.contiguous().view(torch.uint8),
                              entry, cs, sn, prev_kv, prev_gate, eps=eps, run=None if run is None else run.contiguous())
    return None
