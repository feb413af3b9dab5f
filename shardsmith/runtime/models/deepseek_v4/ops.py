"""Small DeepSeek-V4 building blocks: RMSNorms, interleaved partial RoPE with YaRN.

Sources: transformers ``modeling_deepseek_v4.py`` (``DeepseekV4RMSNorm`` multiplies the float32
weight in float32 and casts once; ``apply_rotary_pos_emb`` rotates consecutive channel pairs of the
*trailing* ``rope_dim`` channels of a head) and ``modeling_rope_utils._compute_yarn_parameters``
(YaRN inverse frequencies; V4 forces its attention factor to 1).

Legend: T = tokens, n = heads, d = head dim, r = rope dims.
"""

from __future__ import annotations

import math

import torch


def rms_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim (rms in float32), in ``x.dtype``."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def inv_freq(rope_dim: int, theta: float, yarn: dict | None = None) -> torch.Tensor:
    """Inverse frequencies ``[r/2]`` float32: plain RoPE, or YaRN-blended when ``yarn`` is set.

    YaRN (Peng et al. 2023, transformers ``_compute_yarn_parameters`` with ``truncate``): dims
    rotating more than ``beta_fast`` times over ``original_max_position_embeddings`` keep their
    frequency, those under ``beta_slow`` are divided by ``factor``, a linear ramp in between.
    """
    base = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    if yarn is None:
        return 1.0 / base
    factor, orig = yarn["factor"], yarn["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:
        return rope_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(dim_of(yarn["beta_fast"])), 0), min(math.ceil(dim_of(yarn["beta_slow"])), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the unscaled (extrapolated) frequency
    return (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep


def rope_cos_sin(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``[T, r/2]`` float32 of absolute ``positions`` ``[T]``."""
    angles = positions[:, None].float() * freqs.to(positions.device)[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(2i, 2i+1)`` of the trailing ``r`` channels of ``x`` ``[T, ..., d]``.

    ``cos``/``sin`` ``[T, r/2]`` (pass ``-sin`` for the inverse rotation). The leading ``d - r``
    channels pass through; the rotation runs in float32 and is cast back to ``x.dtype``.
    """
    r = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    nope, rope = x[..., :-r], x[..., -r:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]  # [T, ..., r/2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)


def rope_pairs(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rope`'s tables interleaved per channel pair: ``(cs, sn)`` ``[T, r]`` with
    ``cs = (cos_i, cos_i)`` and ``sn = (-sin_i, sin_i)`` for pair ``i`` (for :func:`apply_rope_pairs`)."""
    return torch.stack((cos, cos), dim=-1).flatten(-2), torch.stack((-sin, sin), dim=-1).flatten(-2)


def apply_rope_pairs(x: torch.Tensor, cs: torch.Tensor, sn: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` (the reference) from :func:`rope_pairs` tables, in fewer torch ops (13, not 17:
    for the decode step's eager path, where tables built once per step serve several calls).

    The same bits: channel ``2i`` is ``even * cos + odd * (-sin)``, which rounds as ``even * cos - odd *
    sin`` (negation is exact), and ``2i+1`` is ``odd * cos + even * sin`` in the same order.
    ``x`` ``[T, ..., d]``; ``cs``/``sn`` ``[T, r]``.
    """
    r = cs.shape[-1]
    shape = (cs.shape[0],) + (1,) * (x.dim() - 2) + (r,)
    rope = x[..., -r:].float()
    swapped = rope.unflatten(-1, (r // 2, 2)).flip(-1).flatten(-2)  # (odd, even) per pair
    rotated = rope * cs.reshape(shape) + swapped * sn.reshape(shape)
    return torch.cat((x[..., :-r], rotated.to(x.dtype)), dim=-1)
