"""Quantized weight formats, dequantized on the fly (one matrix or one expert at a time).

==========  ===========================  =================================  ===================
format      weight                       scale                              dequantized value
==========  ===========================  =================================  ===================
FP8 block   ``float8_e4m3fn [R, C]``     F32 ``[ceil(R/b0), ceil(C/b1)]``   ``w * s``
            (DeepSeek-V3, Mixtral FP8)   (``weight_scale_inv``)
FP8 block   ``float8_e4m3fn [R, C]``     UE8M0 ``[ceil(R/128), ceil(C/128)]``  ``w * 2^(s-127)``
FP4 group   ``int8 [R, C/2]``: e2m1,     UE8M0 ``[R, C/32]``                ``e2m1 * 2^(s-127)``
            element ``2i`` low nibble
==========  ===========================  =================================  ===================

UE8M0 (``float8_e8m0fnu``) is a bare exponent: byte ``s`` means ``2^(s-127)``, so converting it
to float32 is exact. FP8 dense weights go through the runtime's parallel layers, which hold an
float32 block scale (``weight_scale_inv``); :func:`ue8m0_to_float` makes it at load time (4 bytes
per 128x128 block). Expert scales stay UE8M0 (1 byte per 32 weights) and are expanded per
expert at use. Sources: DeepSeek-V3 ``inference/kernel.py`` ``weight_dequant`` (FP8 blocks);
the DeepSeek-V4 release headers; transformers ``finegrained_fp8.py`` (``Fp8Dequantize._unpack_fp4``:
low nibble first; the e2m1 table below).

An expert bank's format is told by the dtype of its ``gate_up`` array (:func:`bank_format`), and
:func:`expert_weights` expands one expert of any format: the one place expert dequantization is
written, for resident banks, cache slots and host banks alike.

Legend: R = rows (output features), C = columns (input features).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_GROUP = 32  # elements per UE8M0 scale along the input dim
_BYTE_LUT: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_WORD_LUT: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """``2^(byte - 127)`` as float32 (exact); float scales are returned as float32 unchanged."""
    if scale.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        return scale.float()
    u8 = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    return torch.exp2(u8.float() - 127.0)


def _byte_lut(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[256, 2]``: the two e2m1 values of every byte (low nibble first), in ``dtype`` (exact)."""
    lut = _BYTE_LUT.get((device, dtype))
    if lut is None:
        e2m1 = torch.tensor(E2M1, dtype=torch.float32)
        byte = torch.arange(256)
        lut = torch.stack((e2m1[byte & 0xF], e2m1[byte >> 4]), dim=-1).to(device=device, dtype=dtype)
        _BYTE_LUT[(device, dtype)] = lut
    return lut


def _word_lut(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[65536, 4]``: the four e2m1 values of every little-endian 16-bit word (512 KiB in bf16)."""
    lut = _WORD_LUT.get((device, dtype))
    if lut is None:
        byte = _byte_lut(torch.device("cpu"), torch.float32)
        word = torch.arange(65536)
        lut = torch.cat((byte[word & 0xFF], byte[word >> 8]), dim=-1).to(device=device, dtype=dtype)
        _WORD_LUT[(device, dtype)] = lut
    return lut


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Expand an FP4 e2m1 matrix with its 1x32 UE8M0 scales.

    Codes are looked up two bytes (four values) at a time in a 65536-entry table with
    :func:`torch.nn.functional.embedding` (4x faster than one advanced-indexing lookup per byte on
    CPU, ``benchmarks/fp4_dequant.py``); rows of odd byte width, or views whose bytes cannot be
    read as 16-bit words, use the per-byte table. Words are little-endian (x86, Arm, CUDA).

    Args:
        packed: ``[..., R, C/2]`` int8 (or uint8), two e2m1 codes per byte, element ``2i`` in the
            low nibble; scale: ``[..., R, C/32]`` float8_e8m0fnu (or its uint8 bytes).
        dtype: output dtype (e2m1 values and power-of-two scales are exact in bf16 and wider,
            barring under/overflow of the product).

    Returns:
        ``[..., R, C]`` in ``dtype``.
    """
    lead = packed.shape[:-1]
    u8 = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    try:
        words = u8.view(torch.int16)  # [..., R, C/4]
    except RuntimeError:  # odd width, offset or stride: no 16-bit view of these bytes
        vals = F.embedding(u8.int(), _byte_lut(packed.device, dtype))  # [..., R, C/2, 2]
    else:
        vals = F.embedding(words.int() & 0xFFFF, _word_lut(packed.device, dtype))  # [..., R, C/4, 4]
    vals = vals.view(*lead, -1, FP4_GROUP)  # [..., R, C/32, 32]
    return (vals * ue8m0_to_float(scale).to(dtype)[..., None]).view(*lead, -1)


def dequantize_blocks(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """``w.float() * scale`` per block, cropped at ragged edges, in ``dtype``.

    Args:
        w: ``[R, C]`` ``float8_e4m3fn``; scale: ``[ceil(R/b0), ceil(C/b1)]`` float32
            (``weight_scale_inv``); block: ``(b0, b1)`` elements.
    """
    R, C = w.shape
    b0, b1 = block
    if R % b0 == 0 and C % b1 == 0:  # whole blocks: broadcast the scales, no [R, C] float32 copy of them
        return (w.view(R // b0, b0, C // b1, b1).float() * scale[:, None, :, None]).to(dtype).view(R, C)
    s = scale.repeat_interleave(b0, 0)[:R].repeat_interleave(b1, 1)[:, :C]  # [R, C]
    return (w.float() * s).to(dtype)


def dequantize_fp8_(model: nn.Module, dtype: torch.dtype) -> None:
    """Dequantize every FP8 block-scaled linear and expert bank of ``model`` to ``dtype`` once
    (``Engine.load(fp8="load")``): each module with a ``dequantize_(dtype)`` method."""
    for m in model.modules():
        if hasattr(m, "dequantize_"):
            m.dequantize_(dtype)


def bank_format(gate_up: torch.Tensor) -> str:
    """``dense``, ``fp8`` or ``fp4`` from the dtype of a ``gate_up`` bank array."""
    if gate_up.dtype == torch.float8_e4m3fn:
        return "fp8"
    if gate_up.dtype in (torch.int8, torch.uint8):
        return "fp4"
    return "dense"


def expert_weights(arrays: dict[str, torch.Tensor], dtype: torch.dtype,
                   block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gate ``[I_r, D]``, up ``[I_r, D]`` and down ``[D, I_r]`` of one expert, in ``dtype``.

    Args:
        arrays: one expert's ``gate_up [2*I_r, D(/2)]`` (gate rows first, then up),
            ``down [D, I_r(/2)]`` and, when quantized, their ``*_scale`` (scale rows stacked like
            their weights); block: the FP8 block size (FP8 banks only).
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
