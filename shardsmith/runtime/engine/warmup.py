"""Compile every Triton kernel variant a rank's steps can use before the server says ready.

Triton compiles a kernel the first time a launch brings a new combination of constexpr values and
integer classes (:mod:`~shardsmith.runtime.layers.kernels.compile_keys`); on an H200 that took
0.6-3.6 s of time to first token for each new prompt length (``benchmarks/RESULTS.md``,
continuous batching). The kernels now compile a bounded set per weight, and :func:`warm_kernels`
launches each once at start, on zero inputs, through the same calls the model makes:

=====================================  ==========================================  ===================
module (``kernel`` on)                 call                                        rows
=====================================  ==========================================  ===================
FP8 ``_Linear``                        ``matmul(x [M, in])`` -> ``fp8_linear``       ``warmup_rows``:
                                                                                   1..16, 17, max
                                                                                   (at most 32 x SMs)
routed experts (``ExpertBank``,        ``fused_bank`` over its arrays               T = 1..16
gpt-oss's ``Experts``)
offload runtime                        ``apply_slots`` over the slot pool           T = 1..16
V4 ``Attention``                       ``warm_kernel`` -> ``sink_attention``         1 (column counts,
                                                                                   rows and splits are
                                                                                   not specialised)
V4 ``Compressor``                      ``warm_kernel`` -> ``compressor_step``        1 (on a scratch copy
                                                                                   of one slot's state)
V4 ``HyperMixer`` (``kernel`` or       ``warm_kernel`` -> ``hc_pre`` (with the       1 each (in ``dtype``;
``post_kernel`` on)                    norm folded), ``hc_post``                    token and split counts
                                                                                   are not specialised)
V4 ``MoE`` (its router)                ``warm_kernel`` -> ``route_topk``             1 (in ``dtype``; per
                                                                                   routing: top-K, hash)
=====================================  ==========================================  ===================

Modules with the same weight shapes, dtypes and block share variants and are warmed once. Nothing
here touches a sequence slot or the expert cache's bookkeeping (the kernels only read weights);
every rank runs it (the engine's ``WARMUP`` command), so TP ranks compile in parallel. vLLM and
SGLang do the same in their start-up profiling run and CUDA-graph capture.
"""

from __future__ import annotations

from typing import Any

import torch

from shardsmith.runtime.layers.experts import FUSED_TOKENS_MAX, RoutedExperts, fused_bank
from shardsmith.runtime.layers.kernels.fp8_linear import warmup_rows
from shardsmith.runtime.layers.parallel import _Linear


def kernel_modules(model: torch.nn.Module, offload: Any = None) -> list[Any]:
    """The modules (and offload runtime) of ``model`` that run a Triton kernel (``kernel`` set at load)."""
    mods = [m for m in model.modules() if isinstance(m, (_Linear, RoutedExperts)) and m.kernel]
    return mods + ([offload] if offload is not None and getattr(offload, "kernel", False) else [])


def _signature(m: Any) -> tuple:
    """What decides a module's kernel variants: its arrays' shapes and dtypes (and strides), its block."""
    arrays = m.cache.pool if hasattr(m, "cache") else dict(m.named_buffers(recurse=False))
    return (type(m).__name__, getattr(m, "block", None), getattr(getattr(m, "math", None), "limit", None),
            tuple((k, tuple(t.shape), t.stride(), t.dtype) for k, t in sorted(arrays.items()) if t is not None))


@torch.inference_mode()
def warm_kernels(model: torch.nn.Module, *, max_rows: int, top_k: int, dtype: torch.dtype, device: torch.device,
                 offload: Any = None) -> int:
    """Launch every kernel variant ``model``'s steps of up to ``max_rows`` tokens can need; returns
    the number of launches (0 when no module runs a kernel, as on CPU by default).

    Args:
        model: a loaded model (kernels switched by ``use_kernels_``); offload: the offload runtime,
            if routed experts are offloaded; max_rows: most tokens one step may carry (the
            engine's ``max_seq_len``); top_k: experts per token; dtype, device: the activations'.
    """
    launches, seen = 0, set()
    for m in kernel_modules(model, offload):
        sig = _signature(m)
        if sig in seen:
            continue
        seen.add(sig)
        if isinstance(m, _Linear):
            for rows in warmup_rows(max_rows):
                m.matmul(torch.zeros(rows, m.weight.shape[1], dtype=dtype, device=device))
                launches += 1
            continue
        pool = m.cache.pool if m is offload else None
        dim = (pool or m.arrays())["down"].shape[1]
        for tokens in range(1, FUSED_TOKENS_MAX + 1):
            x = torch.zeros(tokens, dim, dtype=dtype, device=device)
            ids = torch.zeros(tokens, top_k, dtype=torch.int64, device=device)  # expert (or slot) 0
            weight = torch.full((tokens, top_k), 1.0 / top_k, dtype=torch.float32, device=device)
            if pool is not None:
                m.apply_slots(x, weight, ids.flatten())
            else:
                fused_bank(x, ids, weight, m.arrays(), m.math, m.block)
            launches += 1
    for m in model.modules():  # DeepSeek-V4's decode attention (sink_attention), compressors (compressor_step),
        on = getattr(m, "kernel", False) or getattr(m, "post_kernel", False)  # mixers (hc_pre, hc_post), routers (route_topk)
        if on and hasattr(m, "warm_kernel"):
            launches += m.warm_kernel(seen, dtype=dtype)
    if launches and device.type == "cuda":
        torch.cuda.synchronize(device)
    return launches
