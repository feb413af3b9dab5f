"""gpt-oss configuration from ``config.json`` and its YaRN RoPE tables.

Field sources: transformers' ``GptOssConfig`` (v5 ``rope_parameters`` and the release's v4
``rope_theta`` + ``rope_scaling`` spellings both accepted; ``layer_types`` defaulting to sliding
on even layers) and the release ``config.json`` of ``openai/gpt-oss-20b``.

YaRN (Peng et al. 2023) as transformers computes it for gpt-oss
(``modeling_rope_utils._compute_yarn_parameters``): per frequency pair ``i`` of ``d/2``, blend
``1/theta^(2i/d)`` (extrapolation) and the same divided by ``factor`` (interpolation) by a linear
ramp between the correction dims of ``beta_fast`` and ``beta_slow`` rotations over
``original_max_position_embeddings``, floored/ceiled only when ``truncate`` (gpt-oss: false), and
multiply cos and sin by ``attention_factor`` (default ``0.1 * ln(factor) + 1``, or the
``mscale``/``mscale_all_dim`` ratio when both are given).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardsmith.errors import RuntimeLoadError


@dataclass(frozen=True, slots=True)
class GptOssArgs:
    """What the runtime needs from ``config.json``.

    Attributes:
        vocab_size, dim, n_layers: V, D (hidden) and layers.
        n_heads, n_kv_heads, head_dim: global query heads, KV heads and head size.
        norm_eps: RMSNorm epsilon; rope: ``rope_type``, ``rope_theta`` and the YaRN parameters.
        windows: per layer, the sliding window in tokens, or ``None`` for full attention.
        n_experts, top_k, expert_dim: routed experts, experts per token, intermediate size I (global).
        alpha, limit: the clamped SwiGLU's sigmoid gain (1.702) and clamp (``swiglu_limit``, 7.0).
        tie_embeddings: the LM head is the embedding.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    rope: dict
    windows: tuple[int | None, ...]
    n_experts: int
    top_k: int
    expert_dim: int
    alpha: float
    limit: float
    tie_embeddings: bool

    @classmethod
    def from_config(cls, c: dict) -> "GptOssArgs":
        """Read ``config.json``.

        Raises:
            RuntimeLoadError: a missing field, an unknown layer type or an unsupported ``rope_type``.
        """
        try:
            n_layers, heads, dim = int(c["num_hidden_layers"]), int(c["num_attention_heads"]), int(c["hidden_size"])
            types = c.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
            bad = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
            if bad or len(types) != n_layers:
                raise RuntimeLoadError(f"config.json: layer_types {types!r} must list sliding_attention/full_attention "
                                       f"once per layer ({n_layers}); unknown: {bad}")
            window = c.get("sliding_window")
            return cls(
                vocab_size=int(c["vocab_size"]), dim=dim, n_layers=n_layers, n_heads=heads,
                n_kv_heads=int(c.get("num_key_value_heads") or heads), head_dim=int(c.get("head_dim") or dim // heads),
                norm_eps=float(c.get("rms_norm_eps", 1e-5)), rope=_rope(c),
                windows=tuple(int(window) if t == "sliding_attention" and window else None for t in types),
                n_experts=int(c["num_local_experts"]), top_k=int(c.get("num_experts_per_tok") or c["experts_per_token"]),
                expert_dim=int(c["intermediate_size"]), alpha=float(c.get("swiglu_alpha", 1.702)),
                limit=float(c.get("swiglu_limit", 7.0)), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise RuntimeLoadError(f"config.json: missing field {e.args[0]!r} for GptOssForCausalLM") from None


def _rope(c: dict) -> dict:
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", c.get("rope_theta", 150000.0))
    if rope["rope_type"] not in ("default", "yarn"):
        raise RuntimeLoadError(f"config.json: rope_type {rope['rope_type']!r} is not supported for gpt-oss "
                               "(supported: yarn, default)")
    if rope["rope_type"] == "yarn":
        missing = [k for k in ("factor", "original_max_position_embeddings") if rope.get(k) is None]
        if missing:
            raise RuntimeLoadError(f"config.json: YaRN rope parameters lack {', '.join(missing)}")
    return rope


def inv_freq(rope: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[d/2]`` (float32) and the cos/sin scale (``attention_factor``).

    Raises:
        RuntimeLoadError: via :func:`_rope` only; here the parameters are already checked.
    """
    d, base = head_dim, float(rope["rope_theta"])
    pos = base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)  # [d/2]
    if rope["rope_type"] != "yarn":
        return 1.0 / pos, 1.0
    factor, orig = float(rope["factor"]), float(rope["original_max_position_embeddings"])
    scale = rope.get("attention_factor")
    if scale is None:
        def mscale(m: float = 1.0) -> float:
            return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        scale = mscale(float(m)) / mscale(float(m_all)) if m and m_all else mscale()

    def corr_dim(rotations: float) -> float:
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(float(rope.get("beta_fast") or 32)), corr_dim(float(rope.get("beta_slow") or 1))
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [d/2]
    extrapolate = 1 - ramp
    return (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate, float(scale)


def rope_tables(args: GptOssArgs, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``[max_seq_len, d/2]`` float32, already multiplied by the YaRN attention factor."""
    inv, scale = inv_freq(args.rope, args.head_dim)
    freqs = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * inv[None, :]  # [S, d/2]
    return freqs.cos() * scale, freqs.sin() * scale
