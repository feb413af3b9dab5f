"""One routed expert's SwiGLU from its arrays in stored format, wherever they live.

Shared by the GPU cache (arrays are slot views of the pool) and the CPU backend (arrays are views
of the host banks), so both compute exactly what the resident :class:`~shardsmith.runtime.models.mixtral.moe.ExpertBank`
computes. Stored formats, by the dtype of ``gate_up``:

===============  =============================  ===========================================
format           weights                        scales
===============  =============================  ===========================================
``dense``        bf16 / fp16 / fp32             none
``fp8``          ``float8_e4m3fn``              float32 ``weight_scale_inv`` per block (e.g. 128x128)
``fp4``          e2m1 packed two per int8 byte  ``float8_e8m0fnu`` per 1x32 group (DeepSeek-V4)
===============  =============================  ===========================================

The arithmetic around the matmuls (SwiGLU clamp, accumulation dtype) is the family's
:class:`ExpertMath`; FP4 is expanded by :func:`shardsmith.runtime.layers.quant.dequantize_fp4`.

Legend: n = tokens routed to the expert, D = hidden, I_r = this rank's intermediate share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardsmith.runtime.models.deepseek_v4.moe import expert_swiglu
from shardsmith.runtime.models.deepseek_v4.moe import swiglu as clamped_swiglu
from shardsmith.runtime.layers.quant import dequantize_fp4
from shardsmith.runtime.layers.parallel import dequantize_blocks


@dataclass(frozen=True, slots=True)
class ExpertMath:
    """The model family's expert arithmetic, so offloaded experts compute what its resident bank does.

    Attributes:
        limit: SwiGLU clamp ``L`` (DeepSeek-V4 ``swiglu_limit``): ``silu(min(g, L)) * clamp(u, -L, L)``;
            0 means no clamp (Mixtral / Qwen-MoE).
        accumulate_f32: weight and sum the experts' outputs in float32, cast once at the end
            (DeepSeek-V4's ``ExpertBank``); else each weighted output is cast to the activation
            dtype and summed there (the Mixtral-family ``ExpertBank``).
        batched_pairs: up to this many (token, expert) pairs (a decode step), FP4 slots are
            gathered and expanded together exactly as the resident bank's decode path does
            (:func:`shardsmith.runtime.models.deepseek_v4.moe.apply_pairs`; DeepSeek-V4: 16); 0: never.
    """

    limit: float = 0.0
    accumulate_f32: bool = False
    batched_pairs: int = 0

    def accumulator(self, x: torch.Tensor) -> torch.Tensor:
        """Zeros ``[T, D]`` to :meth:`torch.Tensor.index_add_` contributions into."""
        return torch.zeros(x.shape, dtype=torch.float32 if self.accumulate_f32 else x.dtype, device=x.device)

    def contribution(self, y: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Expert output ``y [n, D]`` times its routing weights ``w [n]``, in the accumulator's dtype."""
        return y.float() * w.float()[:, None] if self.accumulate_f32 else (y * w[:, None]).to(dtype)


def bank_format(gate_up: torch.Tensor) -> str:
    """``dense``, ``fp8`` or ``fp4`` from the dtype of a ``gate_up`` array."""
    if gate_up.dtype == torch.float8_e4m3fn:
        return "fp8"
    if gate_up.dtype in (torch.int8, torch.uint8):
        return "fp4"
    return "dense"


def expert_weights(arrays: dict[str, torch.Tensor], dtype: torch.dtype,
                   block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gate ``[I_r, D]``, up ``[I_r, D]`` and down ``[D, I_r]`` of one expert, in ``dtype``.

    Args:
        arrays: ``gate_up [2*I_r, D(/2)]``, ``down [D, I_r(/2)]`` and their ``*_scale`` (one expert).
        block: FP8 block size (FP8 banks only).
    """
    gu, down = arrays["gate_up"], arrays["down"]
    i_r = gu.shape[0] // 2
    fmt = bank_format(gu)
    if fmt == "dense":
        return gu[:i_r].to(dtype), gu[i_r:].to(dtype), down.to(dtype)
    s, ds = arrays["gate_up_scale"], arrays["down_scale"]
    s_r = s.shape[0] // 2  # gate and up scale rows stacked like their weights
    if fmt == "fp8":
        return (dequantize_blocks(gu[:i_r], s[:s_r], block, dtype), dequantize_blocks(gu[i_r:], s[s_r:], block, dtype),
                dequantize_blocks(down, ds, block, dtype))
    return dequantize_fp4(gu[:i_r], s[:s_r], dtype), dequantize_fp4(gu[i_r:], s[s_r:], dtype), dequantize_fp4(down, ds, dtype)


def expert_output(arrays: dict[str, torch.Tensor], x: torch.Tensor, block: tuple[int, int] | None,
                  limit: float = 0.0) -> torch.Tensor:
    """One expert on its token rows ``x [n, D] -> [n, D]`` (``x.dtype``), with the resident bank's kernels.

    FP4 experts (DeepSeek-V4) go through :func:`shardsmith.runtime.models.deepseek_v4.moe.expert_swiglu`
    (one gate+up matmul, as the V4 bank); dense and FP8 ones through :func:`expert_weights` and
    :func:`swiglu` (separate gate and up, as the Mixtral-family bank).
    """
    if bank_format(arrays["gate_up"]) == "fp4":
        return expert_swiglu(arrays, x, limit)
    gate, up, down = expert_weights(arrays, x.dtype, block)
    return swiglu(x, gate, up, down, limit)


def swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """``down(act(gate h, up h))``: ``[n, D] -> [n, D]`` partial over this rank's share (as the resident path).

    ``act(g, u) = silu(g) * u``, or with ``limit`` L > 0 ``silu(min(g, L)) * clamp(u, -L, L)`` (DeepSeek-V4).
    """
    return F.linear(clamped_swiglu(F.linear(h, gate), F.linear(h, up), limit), down)
