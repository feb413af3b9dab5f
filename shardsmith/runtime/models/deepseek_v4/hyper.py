"""Manifold-constrained hyper-connections (mHC): ``hc_mult`` residual streams per token.

The residual is ``m`` streams ``[T, m, D]``. Before each block a mixer reads all streams and makes
(paper §2.2, Xie et al. 2026; transformers ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead``):

==========  ==========  ========================================================================
weight      shape       formula (``f = rms(flatten(streams)) @ fn.T``, float32)
==========  ==========  ========================================================================
pre         ``[T, m]``  ``sigmoid(f_pre * scale[0] + base_pre) + eps``: collapses streams -> input
post        ``[T, m]``  ``2 * sigmoid(f_post * scale[1] + base_post)``: spreads the block output
comb        ``[T,m,m]`` ``softmax(f_comb * scale[2] + base_comb) + eps``, then Sinkhorn-Knopp to
                        doubly stochastic (columns first, ``hc_sinkhorn_iters`` rounds)
==========  ==========  ========================================================================

``streams' [k] = post[k] * block(sum_j pre[j] streams[j]) + sum_j comb[j, k] streams[j]``. The
head mixer (``hc_head_*``) collapses the streams once more before the final norm. All mixers are
replicated. On GPU the pre/post/comb maths (40 Sinkhorn half-steps on ``[T, m, m]``) is fused by
``torch.compile``: eagerly it is launch-bound. Legend: T = tokens, m = streams, D = hidden.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from shardsmith.runtime.models.deepseek_v4.ops import rms_unweighted


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.float32, device="meta")


class HyperMixer(nn.Module):
    """The pre/post/comb mixer of one block (buffers ``fn [(2+m)*m, m*D]``, ``base``, ``scale [3]``).

    Args:
        dim: D; mult: m; iters: Sinkhorn rounds; eps: floor of pre/comb and the Sinkhorn sums.
    """

    def __init__(self, dim: int, mult: int, iters: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.m, self.iters, self.eps, self.norm_eps = mult, iters, eps, norm_eps
        width = (2 + mult) * mult
        self.register_buffer("fn", _meta(width, mult * dim))
        self.register_buffer("base", _meta(width))
        self.register_buffer("scale", _meta(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [T, m, D]`` -> ``(collapsed [T, D], post [T, m], comb [T, m, m])``."""
        f = F.linear(rms_unweighted(streams.flatten(1).float(), self.norm_eps), self.fn)  # [T, (2+m)*m]
        mix = _mix_compiled() if f.is_cuda else _mix
        pre, post, comb = mix(f, self.base, self.scale, self.m, self.iters, self.eps)
        collapsed = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)  # [T, D]
        return collapsed, post, comb


def _mix(f: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, m: int, iters: int,
         eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre ``[T, m]``, post ``[T, m]`` and Sinkhorn-normalised comb ``[T, m, m]`` from ``f``."""
    f_pre, f_post, f_comb = f.split([m, m, m * m], dim=-1)
    b_pre, b_post, b_comb = base.split([m, m, m * m])
    pre = torch.sigmoid(f_pre * scale[0] + b_pre) + eps
    post = 2 * torch.sigmoid(f_post * scale[1] + b_post)
    comb = torch.softmax(f_comb.view(-1, m, m) * scale[2] + b_comb.view(m, m), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


@functools.cache
def _mix_compiled():
    """:func:`_mix` fused by ``torch.compile`` (on GPU, eager it is ~120 tiny kernels per call)."""
    return torch.compile(_mix, dynamic=True)


def expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``post[k] * out + sum_j comb[j, k] * streams[j]``: ``[T, m, D]`` in ``streams.dtype``."""
    dt = streams.dtype
    return post.to(dt)[..., None] * out[:, None, :] + torch.matmul(comb.to(dt).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """Final collapse of the streams (buffers ``hc_head_fn [m, m*D]``, ``hc_head_base``, ``hc_head_scale``)."""

    def __init__(self, dim: int, mult: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.register_buffer("fn", _meta(mult, mult * dim))
        self.register_buffer("base", _meta(mult))
        self.register_buffer("scale", _meta(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:  # [T, m, D] -> [T, D]
        f = F.linear(rms_unweighted(streams.flatten(1).float(), self.norm_eps), self.fn)  # [T, m]
        pre = torch.sigmoid(f * self.scale + self.base) + self.eps
        return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
