"""One routed expert's SwiGLU from its arrays in stored format, wherever they live.

Shared by the GPU cache (arrays are slot views of the pool) and the CPU backend (arrays are views
of the host banks), so both compute exactly what the resident :class:`~shardsmith.runtime.moe.ExpertBank`
computes. Stored formats, by the dtype of ``gate_up``:

===============  =============================  ===========================================
format           weights                        scales
===============  =============================  ===========================================
``dense``        bf16 / fp16 / fp32             none
``fp8``          ``float8_e4m3fn``              float32 ``weight_scale_inv`` per block (e.g. 128x128)
``fp4``          e2m1 packed two per int8 byte  ``float8_e8m0fnu`` per 1x32 group (DeepSeek-V4)
===============  =============================  ===========================================

Legend: n = tokens routed to the expert, D = hidden, I_r = this rank's intermediate share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..parallel import dequantize_blocks

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_GROUP = 32


def bank_format(gate_up: torch.Tensor) -> str:
    """``dense``, ``fp8`` or ``fp4`` from the dtype of a ``gate_up`` array."""
    if gate_up.dtype == torch.float8_e4m3fn:
        return "fp8"
    if gate_up.dtype in (torch.int8, torch.uint8):
        return "fp4"
    return "dense"


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[R, C/2]`` packed e2m1 (low nibble first) with ``[R, C/32]`` UE8M0 scales -> ``[R, C]`` ``dtype``.

    Source: the OCP MX e2m1 element encoding (sign bit 3, magnitudes :data:`E2M1`), as
    :func:`shardsmith.testing.quant.quantize_fp4_group` writes it.
    """
    lut = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32, device=packed.device)
    u8 = packed.view(torch.uint8)
    vals = torch.stack((lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]), dim=-1).reshape(u8.shape[0], -1)
    return (vals * scale.float().repeat_interleave(FP4_GROUP, dim=1)).to(dtype)


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


def swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate h) * up h)``: ``[n, D] -> [n, D]`` partial over this rank's share (as the resident path)."""
    return F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)


def routed(index_host: torch.Tensor, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows and top-k columns routed to expert ``e`` (host tensors, no device sync)."""
    return torch.where(index_host == e)
