"""The hyper-connection mixer's small maths (DeepSeek-V4 mHC): pre, post and a doubly stochastic comb.

``f [T, (2+m)*m]`` float32 (the streams' normed projection, computed by the caller) becomes
(paper §2.2; transformers ``DeepseekV4HyperConnection``):

==========  ==========  ===============================================================================
output      shape       formula
==========  ==========  ===============================================================================
pre         ``[T, m]``  ``sigmoid(f_pre * scale[0] + base_pre) + eps``
post        ``[T, m]``  ``2 * sigmoid(f_post * scale[1] + base_post)``
comb        ``[T,m,m]`` ``softmax(f_comb * scale[2] + base_comb, dim=-1) + eps``, columns normalised,
                        then ``iters - 1`` rounds of rows then columns (Sinkhorn-Knopp)
==========  ==========  ===============================================================================

:func:`hc_mix_reference` is the PyTorch maths (eagerly ~4 * iters tiny kernels); :func:`hc_mix`
runs it as one Triton program per token on CUDA. Both in float32; the kernel's sums over ``m``
(4 values) may round in another order than torch's: equal within float32 rounding, not bitwise.

Legend: T = tokens, m = streams (``hc_mult``).
"""

from __future__ import annotations

import torch

from shardsmith.runtime.layers.kernels._common import KernelError, use_triton

Mix = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def hc_mix_reference(f: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, m: int, iters: int,
                     eps: float) -> Mix:
    """``(pre [T, m], post [T, m], comb [T, m, m])`` float32 from ``f`` ``[T, (2+m)*m]`` (module table)."""
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


def hc_mix(f: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, m: int, iters: int, eps: float, *,
           backend: str = "auto") -> Mix:
    """:func:`hc_mix_reference` as one Triton launch (one program per token) on CUDA.

    Args:
        f: ``[T, (2+m)*m]`` float32 (last dim contiguous); base: ``[(2+m)*m]`` float32; scale: ``[3]``
            float32; m: streams; iters: Sinkhorn rounds (>= 1); eps: floor of pre / comb and the sums.
        backend: ``auto`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else the reference),
            ``triton`` or ``reference``.

    Returns:
        ``(pre [T, m], post [T, m], comb [T, m, m])`` float32, fresh tensors.

    Raises:
        KernelError: dtypes or shapes do not fit (every problem listed), or the backend cannot run.
    """
    width = (2 + m) * m
    problems = [f"{name} is {t.dtype}, expected float32" for name, t in (("f", f), ("base", base), ("scale", scale))
                if t.dtype != torch.float32]
    if f.dim() != 2 or f.shape[-1] != width or f.stride(-1) != 1:
        problems.append(f"f must be [T, {width}] with a contiguous last dim, got {tuple(f.shape)}")
    if tuple(base.shape) != (width,) or tuple(scale.shape) != (3,):
        problems.append(f"base must be [{width}] and scale [3], got {tuple(base.shape)} and {tuple(scale.shape)}")
    if iters < 1:
        problems.append(f"iters={iters} must be >= 1")
    if problems:
        raise KernelError("hc_mix: " + "; ".join(problems))
    if not use_triton(f, backend):
        return hc_mix_reference(f, base, scale, m, iters, eps)
    import triton

    from shardsmith.runtime.layers.kernels.deepseek_v4 import _hc_triton as k

    T = f.shape[0]
    pre = torch.empty((T, m), dtype=torch.float32, device=f.device)
    post = torch.empty((T, m), dtype=torch.float32, device=f.device)
    comb = torch.empty((T, m, m), dtype=torch.float32, device=f.device)
    if T:
        k._hc_mix_kernel[(T,)](f, base.contiguous(), scale.contiguous(), pre, post, comb, f.stride(0), float(eps),
                               M=m, BLOCK_M=triton.next_power_of_2(m), ITERS=iters, num_warps=1)
    return pre, post, comb
