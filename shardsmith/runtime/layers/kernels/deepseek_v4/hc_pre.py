"""The whole hyper-connection mixer of a DeepSeek-V4 block before its sublayer, in one launch.

From the residual streams ``streams [T, m, D]`` (paper §2.2, Xie et al. 2026; transformers
``DeepseekV4HyperConnection``; ``HyperMixer`` in ``models/deepseek_v4/hyper.py``):

==============  ===============  ==============================================================
output          shape            formula
==============  ===============  ==============================================================
``f`` (inside)  ``[T, W]``       ``rms_unweighted(flatten(streams).float(), norm_eps) @ fn.T``
                                 float32, ``rms_unweighted(x) = x * rsqrt(mean(x^2) + norm_eps)``
pre, post,      ``[T, m]``,      :func:`~.hc_mix.hc_mix_reference` of ``f``, ``base``, ``scale``
comb            ``[T, m]``,
                ``[T, m, m]``
collapsed       ``[T, D]``       ``sum_j pre[:, j] * streams[:, j]`` in float32, cast to
                                 ``streams.dtype``: the sublayer's input
(``out_norm``)  ``[T, D]``       instead of ``collapsed``: ``RMSNorm(collapsed)`` as
                                 ``models/deepseek_v4/ops.py``'s ``RMSNorm`` computes it
                                 (:func:`rms_norm_reference`), the norm V4 runs on the mixer's
                                 output before attention (``attn_norm``) and the MoE (``ffn_norm``)
==============  ===============  ==============================================================

:func:`hc_pre_reference` is the PyTorch path the model ran (an RMS, ``F.linear`` against ``fn``
``[W, m*D]`` float32, :func:`~.hc_mix.hc_mix`, a weighted sum: 4-5 launches on CUDA).
:func:`hc_pre` is one Triton launch split over K = m * D (``_hc_triton``'s module docstring): the
1.5 MB of V4's ``fn`` is read by about two waves of programs and the last program of each token tile
finishes the maths. Its float32 dots add in another order than cuBLAS's and multiply by the norm
after the dot (``r * (x @ fn.T)`` for ``(r * x) @ fn.T``): equal within float32 rounding, not bitwise;
``collapsed`` within one rounding of its dtype. With ``out_norm`` the norm reads ``collapsed`` rounded to
its dtype, as the separate norm does, and follows its op order (``weight * (c * rsqrt(mean(c^2) + eps))``
in float32, one cast); only its sum of squares adds in another order than torch's ``mean``, which can
move the float32 ``rsqrt`` by an ulp or so. Against ``RMSNorm`` of the kernel's own ``collapsed``: in
bf16 / float16 the same bits but where a value sits near a tie (none or one in 65536 elements in the
tests), within one rounding always; in float32 within a few ulps. Against the reference path the
collapse's own difference (above) is carried through the norm.

Legend: T = tokens, m = streams (``hc_mult``), D = hidden, K = m * D, W = (2 + m) * m mixer logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardsmith.runtime.layers.kernels._common import KernelError, sm_count, use_triton
from shardsmith.runtime.layers.kernels.fp8_linear import split_counters
from shardsmith.runtime.layers.kernels.deepseek_v4.hc_mix import hc_mix_reference

Pre = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
BLOCK_K = 64  # K elements per inner step of a program
TILE_T = 4  # tokens per program (the finishing of a tile's tokens runs in one program)
BLOCK_S = 64  # splits added per step by the finishing program
BLOCK_D = 1024  # hidden channels per step of ``collapsed`` at T > 1 (:func:`hc_pre_op` takes the whole row at T = 1)
WHOLE_ROW_MAX = 4096  # :func:`hc_pre_op` at one token keeps rows up to this many channels in registers


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``ops.RMSNorm``'s forward on ``x [T, D]`` with its ``weight [D]`` float32, op for op (transformers
    ``DeepseekV4RMSNorm``: the norm in float32, times the float32 weight, cast once to ``x.dtype``)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def hc_pre_reference(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                     eps: float, norm_eps: float, *, out_norm: tuple[torch.Tensor, float] | None = None) -> Pre:
    """The PyTorch path :func:`hc_pre` replaces (module table): ``(collapsed [T, D], pre [T, m], post [T, m],
    comb [T, m, m])``, with ``out_norm = (weight, eps)`` the first ``RMSNorm(collapsed)``
    (:func:`rms_norm_reference`). The same torch ops as ``HyperMixer.forward`` on CPU, so the same bits."""
    x = streams.flatten(1).float()
    f = F.linear(x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + norm_eps).to(x.dtype), fn)  # ops.rms_unweighted
    pre, post, comb = hc_mix_reference(f, base, scale, streams.shape[1], iters, eps)
    collapsed = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)  # [T, D]
    if out_norm is not None:
        collapsed = rms_norm_reference(collapsed, *out_norm)
    return collapsed, pre, post, comb


def splits_for(tokens: int, k: int, *, sms: int, block_k: int = BLOCK_K, split_k: int | None = None) -> tuple[int, int]:
    """``(splits, K steps of block_k per split)`` of a launch over ``tokens`` tokens and ``k = m * D``:
    ``split_k`` (default: about one wave of ``sms`` programs over the ``ceil(tokens / TILE_T)`` token
    tiles, the fastest of the H200 sweep in ``benchmarks/hc_pre.py`` at 1 and 4 tokens and within
    1.1x of it at 16, h200x1ab) rounded to whole ``block_k`` steps per split; the last split may be
    short."""
    k_blocks = -(-k // block_k)
    if split_k is None:
        split_k = max(1, sms // -(-tokens // TILE_T))
    k_iters = -(-k_blocks // max(1, min(k_blocks, split_k)))
    return -(-k_blocks // k_iters), k_iters


def _check(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
           block_k: int, out_norm: tuple[torch.Tensor, float] | None) -> None:
    problems = []
    weight = out_norm[0] if out_norm is not None else None
    if streams.dim() != 3 or streams.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        problems.append(f"streams {tuple(streams.shape)} {streams.dtype}: want [T, m, D] bfloat16, float16 or float32")
    else:
        _, m, D = streams.shape
        W = (2 + m) * m
        named = [("fn", fn, (W, m * D)), ("base", base, (W,)), ("scale", scale, (3,))]
        for name, t, want in named + ([("out_norm weight", weight, (D,))] if weight is not None else []):
            if tuple(t.shape) != want or t.dtype != torch.float32:
                problems.append(f"{name} {tuple(t.shape)} {t.dtype}: want {list(want)} float32")
    if out_norm is not None and not out_norm[1] >= 0:
        problems.append(f"out_norm eps={out_norm[1]} must be >= 0")
    if iters < 1:
        problems.append(f"iters={iters} must be >= 1")
    if block_k < 16 or block_k & (block_k - 1):
        problems.append(f"block_k={block_k}: a power of two >= 16")
    tensors = (streams, fn, base, scale) + ((weight,) if weight is not None else ())
    if len({t.device for t in tensors}) != 1:
        problems.append(f"streams, fn, base, scale{', out_norm weight' if weight is not None else ''} on "
                        f"{', '.join(str(t.device) for t in tensors)}: one device")
    if problems:
        raise KernelError("hc_pre: " + "; ".join(problems))


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float,
           norm_eps: float, *, out_norm: tuple[torch.Tensor, float] | None = None, split_k: int | None = None,
           block_k: int = BLOCK_K, block_d: int = BLOCK_D, num_warps: int = 4, backend: str = "auto") -> Pre:
    """:func:`hc_pre_reference` as one Triton launch: norm, projection, pre/post/comb and the collapse
    (and, with ``out_norm``, the RMSNorm of the collapse).

    Built for decode (T = 1..16 tokens); any T runs, correct but not tuned past that (each program
    reads the ``fn`` rows of its K chunk, so the token tiles read ``fn`` once each, mostly from L2).
    Split-K over about two waves of the device's multiprocessors; the partials are added in a fixed
    order (deterministic) by the last program of each ``TILE_T``-token tile, counted on the per-device
    counters of :func:`~.fp8_linear.split_counters` (set back to 0 by the launch): calls must not
    overlap on two streams of one device, with each other or with ``fp8_linear``. No host sync and
    shapes fixed by the inputs, so calls can be captured in a CUDA graph (the counters must exist
    first: a capture that would have to grow them runs the reference instead).

    Args:
        streams: ``[T, m, D]`` bfloat16, float16 or float32; fn: ``[(2+m)*m, m*D]`` float32; base:
            ``[(2+m)*m]`` float32; scale: ``[3]`` float32; iters: Sinkhorn rounds (>= 1); eps: floor of
            pre / comb and the Sinkhorn sums; norm_eps: the RMS epsilon.
        out_norm: ``(weight [D] float32, eps >= 0)`` of the RMSNorm that follows the mixer
            (``ops.RMSNorm``'s buffer and epsilon): the first output is then ``RMSNorm(collapsed)``,
            computed by the finishing program from ``collapsed`` rounded to ``streams.dtype``.
        split_k: K splits (default: from the multiprocessor count); block_k: K elements per step
            (a power of two >= 16); block_d: hidden channels per step of the finishing program's
            collapse (a power of two >= 16; at ``>= D`` the row and its norm stay in registers: one
            load, one store); num_warps: Triton's (``benchmarks/hc_pre.py`` sweeps them).
        backend: ``auto`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, else the reference),
            ``triton`` or ``reference``.

    Returns:
        ``(collapsed [T, D] in streams.dtype, pre [T, m], post [T, m], comb [T, m, m])`` float32 but
        ``collapsed`` (normed with ``out_norm``), fresh tensors.

    Raises:
        KernelError: shapes, dtypes or devices do not fit (every problem listed), or the backend cannot run.

    Example:
        >>> x, pre, post, comb = hc_pre(streams, mixer.fn, mixer.base, mixer.scale, 20, 1e-6, 1e-6)  # doctest: +SKIP
    """
    _check(streams, fn, base, scale, iters, block_k, out_norm)
    if block_d < 16 or block_d & (block_d - 1):
        raise KernelError(f"hc_pre: block_d={block_d}: a power of two >= 16")
    if not use_triton(streams, backend):
        return hc_pre_reference(streams, fn, base, scale, iters, eps, norm_eps, out_norm=out_norm)
    import triton

    from shardsmith.runtime.layers.kernels.deepseek_v4 import _hc_triton

    T, m, D = streams.shape
    W, dev = (2 + m) * m, streams.device
    if streams.stride(2) != 1 or streams.stride(1) != D:
        streams = streams.contiguous()
    splits, k_iters = splits_for(T, m * D, sms=sm_count(dev), block_k=block_k, split_k=split_k)
    tiles = -(-T // TILE_T)
    counters = split_counters(dev, tiles) if T else None
    if counters is None:  # no tokens, or a capture that would have to grow the counters
        return hc_pre_reference(streams, fn, base, scale, iters, eps, norm_eps, out_norm=out_norm)
    w_pad = triton.next_power_of_2(W + 1)  # column W: the partial sums of squares
    ws = torch.empty((splits, T, w_pad), dtype=torch.float32, device=dev)
    f = torch.empty((T, w_pad), dtype=torch.float32, device=dev)
    pre = torch.empty((T, m), dtype=torch.float32, device=dev)
    post = torch.empty((T, m), dtype=torch.float32, device=dev)
    comb = torch.empty((T, m, m), dtype=torch.float32, device=dev)
    out = torch.empty((T, D), dtype=streams.dtype, device=dev)
    weight, rms_eps = out_norm if out_norm is not None else (base, 0.0)  # base: a float32 pointer never read
    _hc_triton._hc_pre_kernel[(splits, tiles)](
        streams, fn.contiguous(), base.contiguous(), scale.contiguous(), ws, f, counters, pre, post, comb, out,
        weight.contiguous(), T, splits, k_iters, streams.stride(0), float(eps), float(norm_eps), float(rms_eps),
        M=m, D=D, BLOCK_M=triton.next_power_of_2(m), ITERS=iters, W=W, W_PAD=w_pad, TILE_T=TILE_T,
        BLOCK_K=block_k, BLOCK_S=BLOCK_S, BLOCK_D=min(block_d, triton.next_power_of_2(D)), HAS_NORM=out_norm is not None,
        num_warps=num_warps)
    return out, pre, post, comb


@torch.library.custom_op("shardsmith::hc_pre", mutates_args=())
def _hc_pre_op(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               weight: torch.Tensor | None, iters: int, eps: float, norm_eps: float, rms_eps: float,
               block_d: int) -> list[torch.Tensor]:
    out_norm = (weight, rms_eps) if weight is not None else None
    return list(hc_pre(streams, fn, base, scale, iters, eps, norm_eps, out_norm=out_norm, block_d=block_d))


@_hc_pre_op.register_fake
def _(streams, fn, base, scale, weight, iters, eps, norm_eps, rms_eps, block_d):
    T, m, D = streams.shape
    f32 = dict(dtype=torch.float32, device=streams.device)
    return [streams.new_empty(T, D), torch.empty(T, m, **f32), torch.empty(T, m, **f32), torch.empty(T, m, m, **f32)]


def hc_pre_op(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
              eps: float, norm_eps: float, *, out_norm: tuple[torch.Tensor, float] | None = None) -> Pre:
    """:func:`hc_pre` as the models call it: through the ``shardsmith::hc_pre`` custom op
    (``torch.library``), so that inside a ``torch.compile``'d piece inductor calls it as an opaque
    extern and Triton compiles and launches the kernel itself, and with the whole row in registers at
    one token (``block_d`` = D up to ``WHOLE_ROW_MAX``; ``BLOCK_D`` steps otherwise).

    Why: traced as a user kernel, inductor recompiles the kernel under its own options and it ran
    1.22-1.27x slower (V4's m = 4, D = 4096, one token, CUDA-graph replays on an H200: 14.7 us
    against 12.05 eager and 11.9 through the op at ``block_d`` 1024; 14.0 / 11.0 / 11.2 at 4096;
    ``benchmarks/results/hc_pre_compiled-20261203-h200x1ah.json``). Same arguments, returns and
    errors as :func:`hc_pre`; the same bits as :func:`hc_pre` at the same ``block_d``."""
    _check(streams, fn, base, scale, iters, BLOCK_K, out_norm)
    D = streams.shape[2]
    block_d = max(16, 1 << (D - 1).bit_length()) if streams.shape[0] == 1 and D <= WHOLE_ROW_MAX else BLOCK_D
    weight, rms_eps = out_norm if out_norm is not None else (None, 0.0)
    return tuple(_hc_pre_op(streams, fn, base, scale, weight, iters, float(eps), float(norm_eps), float(rms_eps),
                            block_d))
