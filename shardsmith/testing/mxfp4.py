"""A reference MXFP4 quantizer and dequantizer in gpt-oss's checkpoint layout (tests and generators).

MXFP4 (OCP Microscaling Formats v1.0, section 5 and 6.3): blocks of 32 consecutive elements along
the input dim share one E8M0 scale ``X = 2^(floor(log2(amax)) - 2)`` (2 = ``emax`` of e2m1, whose
largest value is 6 = 1.5 * 2^2); each element is ``V / X`` rounded to the nearest e2m1 value, ties
to even, saturating at +-6. E8M0 byte ``s`` means ``2^(s - 127)``.

gpt-oss stores a weight ``W [E, N, K]`` (E experts, N output rows, K input columns) as

==========================  =====================  =====================================================
tensor                      dtype, shape           contents
==========================  =====================  =====================================================
``<proj>_blocks``           U8 ``[E, N, K/32, 16]``  two e2m1 codes per byte, element ``2i`` in the low nibble
``<proj>_scales``           U8 ``[E, N, K/32]``      the E8M0 exponent byte of each 32-element block
==========================  =====================  =====================================================

Sources: the OCP MX spec; OpenAI's gpt-oss ``weights.py`` and transformers ``integrations/mxfp4.py``
(``FP4_VALUES``, low nibble first, ``ldexp(value, scale - 127)``; the dequantized weight is
transposed to ``[E, K, N]`` there).
"""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; code | 8 is the negative value
BLOCK = 32  # elements per E8M0 scale
E2M1_EMAX = 2


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [..., N, K]`` to MXFP4 blocks and scales.

    Args:
        w: any float tensor whose last dim ``K`` is a multiple of 32.

    Returns:
        ``(blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32])``.

    Raises:
        ValueError: ``K`` is not a multiple of 32.
    """
    *lead, k = w.shape
    if k % BLOCK:
        raise ValueError(f"MXFP4: last dim {k} is not a multiple of the {BLOCK}-element block")
    g = w.float().reshape(*lead, k // BLOCK, BLOCK)  # [..., K/32, 32]
    amax = g.abs().amax(dim=-1)  # [..., K/32]
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0**-126))) - E2M1_EMAX,
                      torch.full_like(amax, -127.0)).clamp(-127, 127)
    x = g / torch.exp2(exp)[..., None]  # [..., K/32, 32]
    grid = torch.tensor(E2M1)
    dist = (x.abs().clamp(max=6.0)[..., None] - grid).abs()  # [..., 32, 8]
    best = dist.min(dim=-1, keepdim=True).values
    ties = dist == best  # at most two neighbours; ties go to the even code (even mantissa bit)
    code = torch.where(ties[..., 0::2].any(-1), (ties[..., 0::2].int().argmax(-1) * 2), ties.int().argmax(-1))
    code = code | ((x < 0) | ((x == 0) & torch.signbit(x))).long() << 3  # sign bit (keeps -0.0)
    code = code.to(torch.uint8).reshape(*lead, k // BLOCK, BLOCK)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)  # [..., K/32, 16]
    return blocks, (exp + 127).to(torch.uint8)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_mxfp4`: ``[..., N, K]`` in ``dtype`` (exact in bf16 and wider).

    Args:
        blocks: uint8 ``[..., N, K/32, 16]``; scales: uint8 ``[..., N, K/32]``.
    """
    lut = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32)
    b = blocks.to(torch.uint8).long()
    vals = torch.stack((lut[b & 0xF], lut[b >> 4]), dim=-1).flatten(-2)  # [..., K/32, 32]
    out = vals * torch.exp2(scales.float() - 127.0)[..., None]
    return out.flatten(-2).to(dtype)
