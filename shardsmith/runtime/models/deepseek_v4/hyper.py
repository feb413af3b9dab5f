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
:func:`~shardsmith.runtime.layers.kernels.deepseek_v4.hc_mix.hc_mix`: one Triton program per token on CUDA (eagerly
it is ~80 tiny kernels; ``torch.compile`` made it 5-6), its PyTorch reference elsewhere. With the
``SHARDSMITH_KERNELS=hc_pre`` on (``auto``: CUDA), a mixer of up to 16 tokens runs whole (norm,
``fn`` projection, pre/post/comb, collapse) as :func:`~shardsmith.runtime.layers.kernels.deepseek_v4.hc_pre.hc_pre`,
one split-K launch instead of 4-5, and the RMSNormF32 the block runs on the collapse (``attn_norm``,
``ffn_norm``, passed as ``norm``) in the same launch. With ``SHARDSMITH_KERNELS=hc_post`` on (``auto``: CUDA),
:meth:`HyperMixer.expand` spreads the sublayer's output onto the streams as
:func:`~shardsmith.runtime.layers.kernels.deepseek_v4.hc_post.hc_post` (one launch for the matmul, multiply, add
and cast) at any token count (a prefill chunk's batched ``m x m`` matmul ran a slow small-tile cuBLAS
kernel). ``hc_pre`` stays with decode: at an 8k-token chunk it took 5.2 ms a call on an H100, slower
than the PyTorch ops below, which a mixer of more tokens (or with the switch off, the default on
CPU) runs.

Legend: T = tokens, m = streams, D = hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardsmith.runtime.layers.kernels.deepseek_v4.hc_mix import hc_mix
from shardsmith.runtime.layers.kernels.deepseek_v4.hc_post import hc_post
from shardsmith.runtime.layers.kernels.deepseek_v4.hc_pre import hc_pre_op as hc_pre
from shardsmith.runtime.layers.fused import for_chunks
from shardsmith.runtime.layers.parallel import kernel_on
from shardsmith.runtime.models.common import RMSNormF32
from shardsmith.runtime.models.deepseek_v4.ops import rms_unweighted

HC_PRE_TOKENS = 16  # mixers of up to this many tokens run hc_pre when ``kernel`` is on (decode rows)


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
        self.post_kernel = False  # expand through hc_post (use_kernel_)

    def forward(self, streams: torch.Tensor, norm: RMSNormF32 | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
        """``streams [T, m, D]`` -> ``(x [T, D], post [T, m], comb [T, m, m])``: ``x`` is the collapsed
        streams, or ``norm(collapsed)`` when the block's RMSNormF32 is given (folded into ``hc_pre``)."""
        if self.kernel and streams.shape[0] <= HC_PRE_TOKENS:  # one launch; within float32 rounding of below
            x, _, post, comb = hc_pre(streams, self.fn, self.base, self.scale, self.iters, self.eps, self.norm_eps,
                                      out_norm=None if norm is None else (norm.weight, norm.eps))
            return x, post, comb
        f = mixer_scores(streams, self.fn, self.norm_eps)  # [T, (2+m)*m]
        # the kernel on CUDA only: on CPU the reference (TRITON_INTERPRET=1 in a test must not slow every model)
        pre, post, comb = hc_mix(f, self.base, self.scale, self.m, self.iters, self.eps,
                                 backend="auto" if f.is_cuda else "reference")
        if norm is None:
            return collapse(streams, pre), post, comb
        return collapse_norm(streams, pre, norm.weight, norm.eps), post, comb

    def expand(self, streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The sublayer's ``out [T, D]`` spread onto ``streams [T, m, D]`` with this mixer's ``post`` and
        ``comb``: :func:`expand`, or :func:`hc_post` (the same roundings, one launch, at any token count:
        a prefill chunk's batched ``m x m`` matmul is slow on cuBLAS) when ``post_kernel`` is on."""
        if self.post_kernel:
            return hc_post(streams, out, post, comb)
        return expand(streams, out, post, comb)

    def use_kernel_(self, device: torch.device) -> None:
        """Run mixers of up to ``HC_PRE_TOKENS`` tokens through :func:`hc_pre` (with the norm after
        them) when ``SHARDSMITH_KERNELS=hc_pre`` allows on ``device``, and their :meth:`expand` through
        :func:`hc_post` when ``hc_post`` does (``auto``: on CUDA; ``reference``: the torch ops)."""
        self.kernel = kernel_on("hc_pre", device)
        self.post_kernel = kernel_on("hc_post", device)

    def warm_kernel(self, seen: set, *, dtype: torch.dtype) -> int:
        """Launch the kernels this mixer runs once on zero inputs of ``dtype`` (the activations'), so
        they compile before serving (``engine/warmup.py``; token and split counts are not specialised),
        unless a mixer of the same variant did (``seen``): :func:`hc_pre` with a norm folded (as the
        blocks call it) and :func:`hc_post`; returns the launches (0 to 2)."""
        m, D = self.m, self.fn.shape[1] // self.m
        dev, launches = self.fn.device, 0
        if self.kernel and ("hc_pre", m, D, self.iters, dtype) not in seen:
            seen.add(("hc_pre", m, D, self.iters, dtype))
            hc_pre(torch.zeros(1, m, D, dtype=dtype, device=dev), self.fn, self.base, self.scale, self.iters,
                   self.eps, self.norm_eps, out_norm=(torch.ones(D, device=dev), self.norm_eps))
            launches += 1
        if self.post_kernel and ("hc_post", m, D, dtype) not in seen:
            seen.add(("hc_post", m, D, dtype))
            hc_post(torch.zeros(1, m, D, dtype=dtype, device=dev), torch.zeros(1, D, dtype=dtype, device=dev),
                    torch.zeros(1, m, device=dev), torch.zeros(1, m, m, device=dev))
            launches += 1
        return launches


@for_chunks
def mixer_scores(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``rms(flatten(streams)) @ fn.T`` in float32: ``[T, m, D]`` -> ``[T, (2+m)*m]`` (the mixer's ``f``)."""
    return F.linear(rms_unweighted(streams.flatten(1).float(), norm_eps), fn)


@for_chunks
def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_j pre[j] * streams[j]``: ``[T, m, D]`` with ``pre [T, m]`` float32 -> ``[T, D]`` in ``streams.dtype``."""
    return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)


@for_chunks
def collapse_norm(streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`collapse` then the block's RMSNormF32 (``weight [D]`` float32, ``eps``): ``[T, D]``."""
    return RMSNormF32.normalize(collapse.reference(streams, pre), weight, eps)


def expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``post[k] * out + sum_j comb[j, k] * streams[j]``: ``[T, m, D]`` in ``streams.dtype`` (transformers
    ``DeepseekV4DecoderLayer``; :func:`~shardsmith.runtime.layers.kernels.deepseek_v4.hc_post.hc_post_reference`)."""
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
