"""A MoE layer's router for a decode step, in one launch (DeepSeek-V4's, or any sqrt-softplus / sigmoid /
softmax top-k router with a selection bias).

From the layer's input ``x [T, D]`` and its gate ``weight [E, D]`` float32 (transformers
``DeepseekV4TopKRouter`` and ``DeepseekV4HashRouter``; ``MoE.route`` in ``models/deepseek_v4/moe.py``):

===========  ===========  ===============================================================================
output       shape        formula
===========  ===========  ===============================================================================
(inside)     ``[T, E]``   ``logits = x.float() @ weight.T``; ``scores = sqrt(softplus(logits))``,
                          ``sigmoid(logits)`` or ``softmax(logits, E)`` (``score_func``)
``index``    ``[T, K]``   top-K of ``scores + bias`` over E (``bias`` None: of ``scores``), or the given
                          experts of a hash-routed layer: ``index``, or ``tid2eid[ids]``
``weight``   ``[T, K]``   ``scores[index] / (sum_k scores[index] + 1e-20) * routed_scale``, float32
===========  ===========  ===============================================================================

:func:`route_topk_reference` is the PyTorch path ``MoE.route`` ran (``F.linear``, the score, ``topk`` or
the table gather, ``gather``, the normalisation: about 6 launches on CUDA). :func:`route_topk` is one
Triton launch (``_router_triton``'s module docstring): the gate is read by about two waves of programs,
split over E and D, and the last program of each token tile finishes the maths. Its float32 dots add in
another order than cuBLAS's and its exp / log in another approximation: ``weight`` within float32
rounding of the reference, not bitwise; ``index`` the same set unless two experts' ``scores + bias``
are within that rounding of each other at the K-th place.

Order of ``index``: :func:`route_topk` returns the top-K by descending ``scores + bias``, equal values
by ascending expert; the reference's ``torch.topk(sorted=False)`` promises no order. Consumers (the
expert bank) read pairs, not positions; compare the two as sets (sort both).

Legend: T = tokens, D = hidden, E = experts, K = experts per token (``top_k``), V = vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardsmith.runtime.layers.kernels._common import KernelError, sm_count, use_triton
from shardsmith.runtime.layers.kernels.fp8_linear import split_counters

SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")  # transformers' ACT2FN names (V4 config ``scoring_func``)
BLOCK_E = 16  # gate rows per program; with BLOCK_K and NUM_WARPS the fastest of an H200 sweep (benchmarks/router.py)
BLOCK_K = 256  # D elements per (unrolled) step of a program
NUM_WARPS = 4
TILE_T = 4  # tokens per program (a tile's tokens are finished together, by one program)
E_MAX = 1024  # experts the finishing program holds in registers ([TILE_T, E] logits)


def route_topk_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                         score_func: str, routed_scale: float, *, index: torch.Tensor | None = None,
                         tid2eid: torch.Tensor | None = None,
                         ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch path :func:`route_topk` replaces (module table): ``(index [T, K] int64, weight [T, K]
    float32)``, the same torch ops as ``MoE.route`` ran before the kernel, so the same bits. Arguments
    as :func:`route_topk`; ``index`` in ``torch.topk(sorted=False)``'s order."""
    logits = F.linear(x.float(), weight)  # [T, E]
    if score_func == "sqrtsoftplus":
        scores = F.softplus(logits).sqrt()
    elif score_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = logits.softmax(dim=-1)
    if tid2eid is not None:
        index = tid2eid[ids].long()
    elif index is not None:
        index = index.long()
    else:
        index = torch.topk(scores if bias is None else scores + bias, top_k, dim=-1, sorted=False).indices
    picked = scores.gather(1, index)
    return index, picked / (picked.sum(dim=-1, keepdim=True) + 1e-20) * routed_scale


def splits_for(d: int, e_blocks: int, *, sms: int, block_k: int = BLOCK_K,
               split_k: int | None = None) -> tuple[int, int]:
    """``(splits, D steps of block_k per split)`` of a launch over hidden size ``d`` and ``e_blocks``
    blocks of gate rows: ``split_k`` (default: about two waves of ``sms`` programs for one token tile;
    ``benchmarks/router.py`` sweeps it) rounded to whole ``block_k`` steps per split; the last split may
    be short. Not from the token count: both are constexprs of the kernel, one variant per gate shape."""
    k_blocks = -(-d // block_k)
    if split_k is None:
        split_k = max(1, 2 * sms // e_blocks)
    k_iters = -(-k_blocks // max(1, min(k_blocks, split_k)))
    return -(-k_blocks // k_iters), k_iters


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, score_func: str,
           index: torch.Tensor | None, tid2eid: torch.Tensor | None, ids: torch.Tensor | None,
           block_e: int, block_k: int) -> None:
    problems = []
    ints = (torch.int32, torch.int64)
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        problems.append(f"x {tuple(x.shape)} {x.dtype}: want [T, D] bfloat16, float16 or float32")
    if weight.dim() != 2 or weight.dtype != torch.float32 or (x.dim() == 2 and weight.shape[1] != x.shape[1]):
        problems.append(f"weight {tuple(weight.shape)} {weight.dtype}: want [E, D={x.shape[-1]}] float32")
    E, T = (weight.shape[0] if weight.dim() else 0), (x.shape[0] if x.dim() else 0)
    if bias is not None and (tuple(bias.shape) != (E,) or bias.dtype != torch.float32):
        problems.append(f"bias {tuple(bias.shape)} {bias.dtype}: want [{E}] float32")
    if not 1 <= top_k <= E:
        problems.append(f"top_k={top_k}: want 1 <= top_k <= E={E}")
    if score_func not in SCORE_FUNCS:
        problems.append(f"score_func {score_func!r}: want one of {', '.join(SCORE_FUNCS)}")
    if index is not None and (tid2eid is not None or ids is not None):
        problems.append("index with tid2eid / ids: pass the experts or the table, not both")
    if index is not None and (tuple(index.shape) != (T, top_k) or index.dtype not in ints):
        problems.append(f"index {tuple(index.shape)} {index.dtype}: want [{T}, {top_k}] int64 or int32")
    if (tid2eid is None) != (ids is None):
        problems.append("tid2eid and ids: pass both or neither")
    if tid2eid is not None and (tid2eid.dim() != 2 or tid2eid.shape[1] != top_k or tid2eid.dtype not in ints
                                or tid2eid.stride(1) != 1):
        problems.append(f"tid2eid {tuple(tid2eid.shape)} {tid2eid.dtype}: want [V, {top_k}] int64 or int32, rows "
                        "contiguous")
    if ids is not None and (tuple(ids.shape) != (T,) or ids.dtype not in ints):
        problems.append(f"ids {tuple(ids.shape)} {ids.dtype}: want [{T}] int64 or int32")
    if block_e < 4 or block_e > 256 or block_e & (block_e - 1):
        problems.append(f"block_e={block_e}: a power of two in 4..256")
    if block_k < 16 or block_k & (block_k - 1):
        problems.append(f"block_k={block_k}: a power of two >= 16")
    tensors = {"x": x, "weight": weight, "bias": bias, "index": index, "tid2eid": tid2eid, "ids": ids}
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) != 1:
        problems.append(", ".join(devices) + " on " + ", ".join(str(d) for d in devices.values()) + ": one device")
    if problems:
        raise KernelError("route_topk: " + "; ".join(problems))


def route_topk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, score_func: str,
               routed_scale: float, *, index: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
               ids: torch.Tensor | None = None, split_k: int | None = None, block_e: int = BLOCK_E,
               block_k: int = BLOCK_K, num_warps: int = NUM_WARPS,
               backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route_topk_reference` as one Triton launch: gate projection, scores, top-K and weights.

    Built for decode (T = 1..16 tokens); any T runs, correct but not tuned past that (each token tile
    reads the whole gate, mostly from L2 after the first). Split over E (``block_e`` rows per program)
    and D (about two waves of the device's multiprocessors); the partials are added in a fixed order
    (deterministic) by the last program of each ``TILE_T``-token tile, counted on the per-device
    counters of :func:`~.fp8_linear.split_counters` (set back to 0 by the launch): calls must not
    overlap on two streams of one device, with each other or with ``fp8_linear`` / ``hc_pre``. No host
    sync and shapes fixed by the inputs, so calls can be captured in a CUDA graph (the counters must
    exist first: a capture that would have to grow them runs the reference instead).

    Args:
        x: ``[T, D]`` bfloat16, float16 or float32; weight: ``[E, D]`` float32 (the gate; E <= 1024 for
            the kernel); bias: ``[E]`` float32, added to the scores for the choice only (V4's
            ``gate.bias``, transformers' ``e_score_correction_bias``), or None; top_k: K, 1..E;
            score_func: ``sqrtsoftplus``, ``sigmoid`` or ``softmax``; routed_scale: the weights' factor.
        index: ``[T, K]`` int64 / int32, the experts of a hash-routed layer (no top-K); or
            tid2eid: ``[V, K]`` int64 / int32 with ids: ``[T]`` token ids, the experts ``tid2eid[ids]``
            gathered in the kernel (V4's first ``n_hash_layers``). Entries must lie in ``0..E-1``
            (not checked: a host sync; the kernel weighs an expert out of range 0).
        split_k: D splits (default: from the multiprocessor count); block_e: gate rows per program
            (a power of two in 4..256); block_k: D elements per step (a power of two >= 16);
            num_warps: Triton's (``benchmarks/router.py`` sweeps them).
        backend: ``auto`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else the reference),
            ``triton`` or ``reference``.

    Returns:
        ``(index [T, K] int64, weight [T, K] float32)``, fresh tensors; ``index`` by descending
        ``scores + bias``, ties to the lower expert (module docstring), or the given experts' order.

    Raises:
        KernelError: shapes, dtypes, options or devices do not fit (every problem listed), the backend
            cannot run, or E > 1024 on the Triton path.

    Example:
        >>> index, weight = route_topk(x, gate.weight, gate.bias, 6, "sqrtsoftplus", 1.5)  # doctest: +SKIP
    """
    _check(x, weight, bias, top_k, score_func, index, tid2eid, ids, block_e, block_k)
    reference = {"index": index, "tid2eid": tid2eid, "ids": ids}
    if not use_triton(x, backend):
        return route_topk_reference(x, weight, bias, top_k, score_func, routed_scale, **reference)
    import triton

    from shardsmith.runtime.layers.kernels import _router_triton

    (T, D), E, dev = x.shape, weight.shape[0], x.device
    if E > E_MAX:
        raise KernelError(f"route_topk: weight has E={E} experts: the kernel takes up to {E_MAX}")
    e_blocks, tiles = -(-E // block_e), -(-T // TILE_T)
    counters = split_counters(dev, tiles) if T else None
    if counters is None:  # no tokens, or a capture that would have to grow the counters
        return route_topk_reference(x, weight, bias, top_k, score_func, routed_scale, **reference)
    splits, k_iters = splits_for(D, e_blocks, sms=sm_count(dev), block_k=block_k, split_k=split_k)
    ws = torch.empty((T, splits, E), dtype=torch.float32, device=dev)
    out_index = torch.empty((T, top_k), dtype=torch.int64, device=dev)
    out_weight = torch.empty((T, top_k), dtype=torch.float32, device=dev)
    table = tid2eid if tid2eid is not None else index.contiguous() if index is not None else None
    w = weight.contiguous()  # also the unused pointers: a tensor the launch only reads
    _router_triton._router_kernel[(e_blocks, splits, tiles)](
        x.contiguous(), w, w if bias is None else bias.contiguous(), w if table is None else table,
        w if ids is None else ids.contiguous(), ws, counters, out_index, out_weight,
        T, top_k if table is None else table.stride(0), float(routed_scale),
        D=D, E=E, E_PAD=triton.next_power_of_2(E), K=top_k, K_PAD=triton.next_power_of_2(top_k),
        SCORE=SCORE_FUNCS.index(score_func), HAS_BIAS=bias is not None,
        HASH=0 if table is None else 2 if ids is not None else 1, SPLITS=splits, K_ITERS=k_iters,
        TILE_T=TILE_T, BLOCK_E=block_e, BLOCK_K=block_k, num_warps=num_warps)
    return out_index, out_weight
