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
replicated. The pre/post/comb maths (40 Sinkhorn half-steps on ``[T, m, m]``) is
:func:`~shardsmith.runtime.layers.kernels.hc_mix.hc_mix`: one Triton program per token on CUDA (eagerly
it is ~80 tiny kernels; ``torch.compile`` made it 5-6), its PyTorch reference elsewhere. With the
``SHARDSMITH_HC_PRE`` switch on (``auto``: CUDA), a mixer of up to 16 tokens runs whole (norm,
``fn`` projection, pre/post/comb, collapse) as :func:`~shardsmith.runtime.layers.kernels.hc_pre.hc_pre`,
one split-K launch instead of 4-5. Legend: T = tokens, m = streams, D = hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardsmith.runtime.layers.kernels.hc_mix import hc_mix
from shardsmith.runtime.layers.kernels.hc_pre import hc_pre
from shardsmith.runtime.layers.parallel import kernel_switch
from shardsmith.runtime.models.deepseek_v4.ops import rms_unweighted

HC_PRE_TOKENS = 16  # mixers of up to this many tokens run hc_pre when ``kernel`` is on (decode batches)


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
        self.kernel = False  # up to HC_PRE_TOKENS tokens through hc_pre (use_kernel_)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [T, m, D]`` -> ``(collapsed [T, D], post [T, m], comb [T, m, m])``."""
        if self.kernel and streams.shape[0] <= HC_PRE_TOKENS:  # one launch; within float32 rounding of below
            collapsed, _, post, comb = hc_pre(streams, self.fn, self.base, self.scale, self.iters, self.eps,
                                              self.norm_eps)
            return collapsed, post, comb
        f = F.linear(rms_unweighted(streams.flatten(1).float(), self.norm_eps), self.fn)  # [T, (2+m)*m]
        # the kernel on CUDA only: on CPU the reference (TRITON_INTERPRET=1 in a test must not slow every model)
        pre, post, comb = hc_mix(f, self.base, self.scale, self.m, self.iters, self.eps,
                                 backend="auto" if f.is_cuda else "reference")
        collapsed = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)  # [T, D]
        return collapsed, post, comb

    def use_kernel_(self, device: torch.device) -> None:
        """Run mixers of up to ``HC_PRE_TOKENS`` tokens through :func:`hc_pre` when ``SHARDSMITH_HC_PRE``
        allows on ``device`` (``auto``: on CUDA; ``off``: the RMS, ``F.linear``, ``hc_mix`` and sum above)."""
        self.kernel = kernel_switch("SHARDSMITH_HC_PRE", "off", device)

    def warm_kernel(self, seen: set, *, dtype: torch.dtype) -> int:
        """Launch :func:`hc_pre` once on zero streams of ``dtype`` (the activations'), so its kernel
        compiles before serving (``engine/warmup.py``; token and split counts are not specialised),
        unless a mixer of the same variant did (``seen``); returns the launches (0 or 1)."""
        m, D = self.m, self.fn.shape[1] // self.m
        key = ("hc_pre", m, D, self.iters, dtype)
        if key in seen:
            return 0
        seen.add(key)
        hc_pre(torch.zeros(1, m, D, dtype=dtype, device=self.fn.device), self.fn, self.base, self.scale, self.iters,
               self.eps, self.norm_eps)
        return 1


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
