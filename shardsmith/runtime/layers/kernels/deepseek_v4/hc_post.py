"""The hyper-connection expansion of a DeepSeek-V4 block after its sublayer, in one launch.

After attention and after the MoE, the sublayer's output ``out [T, D]`` is spread back onto the
``m`` residual streams and the streams are mixed (paper §2.2, Xie et al. 2026; transformers
``DeepseekV4DecoderLayer.forward`` around ``DeepseekV4HyperConnection``; ``expand`` in
``models/deepseek_v4/hyper.py``)::

    streams'[t, k] = post[t, k] * out[t] + sum_j comb[t, j, k] * streams[t, j]     [T, m, D]

in the activation dtype: ``post`` and ``comb`` (float32, from the mixer) are cast to it, the
product ``post * out`` and the matmul ``comb.T @ streams`` (float32 accumulation) are each rounded
to it, and so is their sum. :func:`hc_post_reference` is that PyTorch path (a batched matmul, a
multiply and an add: on CUDA, compiled, a cuBLAS/CUTLASS matmul, a pointwise kernel and a cast).
:func:`hc_post` is one Triton launch (``_hc_triton._hc_post_kernel``) that rounds at the same points
and adds the ``m`` products in stream order (an explicit float32 FMA chain). In bfloat16 and float16
the products are exact in float32, so only the matmul's order of adding them can differ: the same bits
as the reference where it adds in stream order (the CPU's does, in the tests), else within one
rounding of the dtype, and rarely that (a tie moved by one float32 ulp). In float32 on the CPU
(interpreter) the same bits at m = 4 (MKL's FMA chain; at m = 2, 3 MKL adds otherwise: within float32
rounding); on CUDA Triton fuses the float32 product ``post * out`` into the final add (FP fusion, as
inductor's kernel for the same expression does): one rounding fewer, within one float32 rounding.

Legend: T = tokens, m = streams (``hc_mult``), D = hidden.
"""

from __future__ import annotations

import torch

from shardsmith.runtime.layers.kernels._common import KernelError, use_triton

BLOCK_D = 256  # hidden channels per program: T=1 at D=4096 is 16 programs of m+1 loads of 16 bytes a thread


def hc_post_reference(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The PyTorch path :func:`hc_post` replaces: ``hyper.expand``'s ops (transformers' decoder layer's),
    ``[T, m, D]`` in ``streams.dtype``. Shapes as :func:`hc_post`."""
    dt = streams.dtype
    return post.to(dt)[..., None] * out[:, None, :] + torch.matmul(comb.to(dt).transpose(-1, -2), streams)


def _check(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, block_d: int) -> None:
    problems = []
    if streams.dim() != 3 or streams.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        problems.append(f"streams {tuple(streams.shape)} {streams.dtype}: want [T, m, D] bfloat16, float16 or float32")
    else:
        T, m, D = streams.shape
        if tuple(out.shape) != (T, D) or out.dtype != streams.dtype:
            problems.append(f"out {tuple(out.shape)} {out.dtype}: want {[T, D]} {streams.dtype} (the streams')")
        for name, t, want in (("post", post, (T, m)), ("comb", comb, (T, m, m))):
            if tuple(t.shape) != want or t.dtype != torch.float32:
                problems.append(f"{name} {tuple(t.shape)} {t.dtype}: want {list(want)} float32")
    if block_d < 16 or block_d & (block_d - 1):
        problems.append(f"block_d={block_d}: a power of two >= 16")
    if len({t.device for t in (streams, out, post, comb)}) != 1:
        problems.append(f"streams, out, post, comb on {streams.device}, {out.device}, {post.device}, {comb.device}: "
                        "one device")
    if problems:
        raise KernelError("hc_post: " + "; ".join(problems))


def hc_post(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
            block_d: int = BLOCK_D, num_warps: int = 1, backend: str = "auto") -> torch.Tensor:
    """:func:`hc_post_reference` as one Triton launch: every output stream of a ``block_d`` slice of
    one token per program, rounded where the reference rounds (module docstring).

    Built for decode (T = 1..16 tokens); any T runs (``T * ceil(D / block_d)`` programs). No host
    sync, no workspace, shapes fixed by the inputs: a call can be captured in a CUDA graph and traced
    by ``torch.compile`` as a user kernel.

    Args:
        streams: ``[T, m, D]`` bfloat16, float16 or float32, the block's input streams; out: ``[T, D]``
            in the same dtype, the sublayer's output; post: ``[T, m]`` float32; comb: ``[T, m, m]``
            float32 (``comb[t, j, k]``: stream j's weight in output stream k), both from the mixer.
        block_d: hidden channels per program (a power of two >= 16); num_warps: Triton's
            (``benchmarks/hc_post.py`` sweeps both).
        backend: ``auto`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else the reference),
            ``triton`` or ``reference``.

    Returns:
        ``[T, m, D]`` in ``streams.dtype``, a fresh contiguous tensor.

    Raises:
        KernelError: shapes, dtypes or devices do not fit (every problem listed), or the backend cannot run.

    Example:
        >>> streams = hc_post(streams, attn_out, post, comb)  # doctest: +SKIP
    """
    _check(streams, out, post, comb, block_d)
    if not use_triton(streams, backend):
        return hc_post_reference(streams, out, post, comb)
    import triton

    from shardsmith.runtime.layers.kernels.deepseek_v4 import _hc_triton

    T, m, D = streams.shape
    if streams.stride(2) != 1 or streams.stride(1) != D:
        streams = streams.contiguous()
    if out.stride(1) != 1:
        out = out.contiguous()
    y = torch.empty((T, m, D), dtype=streams.dtype, device=streams.device)
    if T == 0:
        return y
    block = min(block_d, triton.next_power_of_2(D))
    _hc_triton._hc_post_kernel[(T, triton.cdiv(D, block))](
        streams, out, post.contiguous(), comb.contiguous(), y, streams.stride(0), out.stride(0),
        M=m, D=D, BLOCK_M=triton.next_power_of_2(m), BLOCK_D=block, num_warps=num_warps)
    return y
