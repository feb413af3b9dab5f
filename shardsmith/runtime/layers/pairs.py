"""The pair path of routed experts: SwiGLU, FP4 experts expanded one per (token, expert) pair, and
each token's weighted sum over its pairs: the plain PyTorch maths that the resident bank, the
offloaded slots, a captured decode piece and the fused expert kernel's reference share.

Legend: T = tokens, K = experts per token, P = T * K pairs (token-major), D = hidden,
I_r = this rank's expert intermediate share (TP-within-expert).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardsmith.runtime.layers.quant import dequantize_fp4

__all__ = ["expand_pairs", "gated", "routed_pairs", "swiglu"]


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float = 0.0, alpha: float | None = None) -> torch.Tensor:
    """``silu(min(gate, L)) * clamp(up, -L, L)``; ``silu(gate) * up`` when ``L`` is 0.

    With ``alpha`` (gpt-oss): ``(clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, L)``
    (OpenAI's gpt-oss ``torch/model.py`` ``swiglu``; transformers ``GptOssExperts``).
    The clamps act on whole elements of the rank's intermediate share, so TP does not change them.
    """
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    if alpha is not None:
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return F.silu(gate) * up


def gated(h: torch.Tensor, limit: float, alpha: float | None, interleaved: bool) -> torch.Tensor:
    """The gated unit of a gate/up projection ``h [..., 2*I_r]`` -> ``[..., I_r]``: gate and up split as the rows
    lie (``interleaved``: row ``2j`` gate channel ``j``, ``2j + 1`` up, as gpt-oss; else gate rows then up rows),
    then :func:`swiglu`."""
    gate, up = (h[..., ::2], h[..., 1::2]) if interleaved else h.chunk(2, dim=-1)
    return swiglu(gate, up, limit, alpha)


def expand_pairs(arrays: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 experts gathered one per pair, expanded: ``gate_up [P, 2*I_r, D]``, ``down [P, D, I_r]`` in ``dtype``.

    Args:
        arrays: ``gate_up [P, 2*I_r, D/2]`` I8, ``gate_up_scale [P, 2*I_r, D/32]``,
            ``down [P, D, I_r/2]``, ``down_scale [P, D, I_r/32]``.
    """
    return (dequantize_fp4(arrays["gate_up"], arrays["gate_up_scale"], dtype),
            dequantize_fp4(arrays["down"], arrays["down_scale"], dtype))


def routed_pairs(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 limit: float, out_dtype: torch.dtype | None = None, *, alpha: float | None = None,
                 interleaved: bool = False, gate_up_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's routed sum ``[T, D]`` (``out_dtype``, default ``x.dtype``) from its pairs' expanded experts.

    Args:
        gate_up: ``[P, 2*I_r, D]``, down: ``[P, D, I_r]`` (:func:`expand_pairs`), token-major;
        x: ``[T, D]``; weight: ``[T, K]`` float32 routing weights; limit: SwiGLU clamp.
        alpha, interleaved: gpt-oss's GLU and gate/up row layout (:func:`gated`); gate_up_bias: ``[P, 2*I_r]``
            added to the gate/up projection (gpt-oss).

    Two batched matmuls over all P pairs on each pair's token row, then a float32 sum over each
    token's K pairs in a fixed order (``index_add_`` with repeated rows is atomic, so run-to-run
    nondeterministic, on CUDA): the one pair path of the resident bank, the offloaded slots and a
    captured decode piece, so all three give the same bits on any device.
    """
    T, K = weight.shape
    tok = torch.arange(T, device=x.device).repeat_interleave(K)  # [P]
    h = torch.bmm(gate_up, x[tok][:, :, None]).squeeze(-1)  # [P, 2*I_r]
    if gate_up_bias is not None:
        h = h + gate_up_bias.to(h.dtype)
    y = torch.bmm(down, gated(h, limit, alpha, interleaved)[..., None]).squeeze(-1)  # [P, D]
    return (y.float() * weight.flatten()[:, None]).view(T, K, y.shape[-1]).sum(dim=1).to(out_dtype or x.dtype)
