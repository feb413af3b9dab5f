"""Reference quantizers and dequantizers for the formats shardsmith moves (tests and generators).

- FP8 block: ``float8_e4m3fn`` weight with one scale per ``b0 x b1`` block (ragged edge blocks
  are partial); ``w = fp8.float() * scale``. Scales are F32 ``weight_scale_inv`` (DeepSeek-V3,
  Qwen3-FP8) or UE8M0 ``float8_e8m0fnu`` powers of two (DeepSeek-V4). Source: DeepSeek-V3
  ``inference/kernel.py`` ``weight_dequant``.
- FP4 e2m1 with 1x32 UE8M0 scales along the input dim, two values per ``int8`` byte, element
  ``2i`` in the low nibble (as transformers' ``finegrained_fp8`` unpacks DeepSeek-V4 experts).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x.clamp_min(2.0**-126))))


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128), *, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [R, C]`` to FP8 e4m3 with one scale per block.

    Returns:
        ``(weight [R, C] float8_e4m3fn, scale [ceil(R/b0), ceil(C/b1)])``; the scale is F32, or
        ``float8_e8m0fnu`` powers of two when ``ue8m0``.
    """
    rows, cols = w.shape
    b0, b1 = block
    sr, sc = -(-rows // b0), -(-cols // b1)
    padded = torch.zeros(sr * b0, sc * b1, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.reshape(sr, b0, sc, b1)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp_min(1e-12)
    if ue8m0:
        scale = _pow2_ceil(scale)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(sr * b0, sc * b1)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu) if ue8m0 else scale


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_block`: ``[R, C]`` float32."""
    rows, cols = q.shape
    s = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return q.float() * s


def quantize_fp4_group(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [R, C]`` to e2m1 with a UE8M0 scale per ``1 x group`` along the input dim.

    Returns:
        ``(packed [R, C/2] int8, scale [R, C/group] float8_e8m0fnu)``.
    """
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // group, group)
    scale = _pow2_ceil(g.abs().amax(dim=-1) / 6.0)
    x = g / scale[..., None]
    values = torch.tensor(E2M1_VALUES)
    idx = (x.abs()[..., None] - values).abs().argmin(dim=-1)  # nearest magnitude
    code = (idx | ((x < 0).long() << 3)).reshape(rows, cols).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


def dequantize_fp4_group(packed: torch.Tensor, scale: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Inverse of :func:`quantize_fp4_group`: ``[R, 2 * packed_cols]`` float32."""
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    u8 = packed.view(torch.uint8)
    vals = torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], dim=-1).reshape(u8.shape[0], -1)
    return vals * scale.float().repeat_interleave(group, dim=1)
