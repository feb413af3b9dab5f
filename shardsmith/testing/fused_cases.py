"""Random inputs for every fused prefill-chunk function (``runtime/layers/fused.py``), for its tests and
``benchmarks/fused_chunks.py``: DeepSeek-V4's mixer, query, KV, index query and output maths and the grouped
experts' SwiGLU and combine, at ``T`` rows of the shapes given (V4-Flash: :data:`V4_FLASH`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardsmith.runtime.layers.experts import combine_pairs, glu_rows
from shardsmith.runtime.models.deepseek_v4.attention import kv_rows, query_heads, unrope
from shardsmith.runtime.models.deepseek_v4.compressor import index_query
from shardsmith.runtime.models.deepseek_v4.hyper import collapse, collapse_norm, mixer_scores

V4_FLASH = {"m": 4, "D": 4096, "n": 64, "d": 512, "r": 64, "h": 64, "c": 128, "K": 6, "I": 2048}  # streams,
# hidden, heads, head dim, rope dims, index heads, index head dim, experts per token, expert intermediate (one
# rank's share at TP=1)


def fused_chunk_cases(T: int, *, m: int, D: int, n: int, d: int, r: int, h: int, c: int, K: int, I: int,
                      dtype: torch.dtype, device: str | torch.device,
                      gen: torch.Generator) -> list[tuple[Callable[..., Any], tuple]]:
    """``(function, args)`` of every fused chunk function at ``T`` rows: ``m`` streams of hidden ``D``,
    ``n`` heads of ``d`` with ``r`` rotary dims, ``h`` index heads of ``c``, ``K`` experts per token of
    intermediate ``I``; activations
    in ``dtype``, mixer and norm weights float32, drawn from ``gen`` on ``device``."""
    def rnd(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dt)

    streams, pre = rnd(T, m, D), torch.rand(T, m, generator=gen, device=device)
    angles = torch.rand(T, r // 2, generator=gen, device=device) * 6.28
    cos, sin = angles.cos(), angles.sin()
    return [
        (mixer_scores, (streams, rnd((2 + m) * m, m * D, dt=torch.float32) * 0.01, 1e-6)),
        (collapse, (streams, pre)),
        (collapse_norm, (streams, pre, rnd(D, dt=torch.float32), 1e-6)),
        (query_heads, (rnd(T, n, d), cos, sin, 1e-6)),
        (kv_rows, (rnd(T, d), rnd(d, dt=torch.float32), cos, sin, 1e-6)),
        (index_query, (rnd(T, h, c), cos, sin)),
        (unrope, (rnd(T, n, d), cos, sin)),
        (glu_rows, (rnd(T, 2 * I), 10.0, None, False)),
        (combine_pairs, (rnd(T, D), rnd(T * K, D), torch.randperm(T * K, generator=gen, device=device).view(T, K),
                         torch.rand(T, K, generator=gen, device=device), True)),
    ]


def compiled_graphs(fn: Callable[..., Any]) -> int:
    """Graphs dynamo holds for the fused function ``fn`` in this process (its code's cache entries)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(fn.reference.__code__))
