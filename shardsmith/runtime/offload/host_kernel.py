"""Routed experts on the host, read in their stored format by a small C++ kernel (AVX2 + FMA).

The plain path (:func:`shardsmith.runtime.layers.experts.expert_output`, the reference) expands an
expert to a dense copy, then multiplies: for a DeepSeek-V4-Flash expert at batch 1 that is 12.75 MB
of packed FP4 expanded to 50 MB of bf16, written and read again, about 100x the host's memory floor.
:func:`expert_swiglu_host` decodes the stored bytes in registers instead (``host_kernel.cpp``: FP4
e2m1 + UE8M0 per 32, FP8 e4m3 + float32 block scales, bf16), shares every decoded vector among the
step's tokens, and accumulates in float32, with rows split over torch's intra-op threads (the
rank's share of the cores, :func:`~shardsmith.runtime.engine.dist.clamp_threads`).

The kernel is compiled once per machine on first use (``torch.utils.cpp_extension``, ``-O3
-march=native``), cached by the hash of its source, the torch version and the CPU's flags under
``$SHARDSMITH_CACHE/host_kernel``. Without a compiler, or on a CPU without AVX2/FMA (the kernel then
has a scalar path), everything still works: :func:`available` says whether the compiled kernel is
loaded and callers fall back to the reference.

Legend: T = tokens (1..16 per call), D = hidden, I_r = this rank's intermediate share.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

from shardsmith.runtime.layers.experts import swiglu as clamped_swiglu
from shardsmith.runtime.layers.quant import bank_format

log = logging.getLogger("shardsmith.runtime.offload")
SOURCE = Path(__file__).with_name("host_kernel.cpp")
MAX_TOKENS = 16  # tokens per kernel call (the kernel's register budget); more are chunked


def _cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def available() -> bool:
    """Compile (once per machine, cached) and load the kernel; False, with one warning, if that fails."""
    if os.environ.get("SHARDSMITH_HOST_KERNEL", "1") == "0":
        return False
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + _cpu_flags().encode()).hexdigest()[:16]
    root = Path(os.environ.get("SHARDSMITH_CACHE", Path.home() / ".cache" / "shardsmith")) / "host_kernel" / key
    try:
        from torch.utils.cpp_extension import load

        root.mkdir(parents=True, exist_ok=True)
        load(name=f"shardsmith_host_{key}", sources=[str(SOURCE)], build_directory=str(root), is_python_module=False,
             extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no headers, a failed build: the reference path still works
        log.warning("host expert kernel unavailable (%s: %s); routed experts on the host use the plain path",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False
    return True


def _chunks(x: torch.Tensor):
    for t0 in range(0, x.shape[0], MAX_TOKENS):
        yield x[t0:t0 + MAX_TOKENS]


def _linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, fmt: str,
            block: tuple[int, int] | None) -> torch.Tensor:
    """``x [T, C] f32 @ W^T -> [T, R] f32`` for one stored matrix (``W [R, C]``, FP4 ``[R, C/2]``)."""
    ops = torch.ops.shardsmith_host
    if fmt == "fp4":
        return torch.cat([ops.fp4_linear(c, w.view(torch.uint8), scale.view(torch.uint8)) for c in _chunks(x)])
    br, bc = block if fmt == "fp8" else (0, 0)
    s = scale.float() if fmt == "fp8" else None
    return torch.cat([ops.dense_linear(c, w, s, br, bc) for c in _chunks(x)])


def supports(arrays: dict[str, torch.Tensor]) -> bool:
    """Whether :func:`expert_swiglu_host` takes these arrays (FP4, FP8 with float32 scales, bf16; host memory)."""
    gu = arrays["gate_up"]
    if gu.device.type != "cpu" or not available():
        return False
    fmt = bank_format(gu)
    if fmt == "fp4":
        return gu.shape[-1] % 16 == 0 and arrays["down"].shape[-1] % 16 == 0
    if fmt == "fp8":
        return arrays["gate_up_scale"].dtype == torch.float32
    return gu.dtype == torch.bfloat16


def expert_swiglu_host(arrays: dict[str, torch.Tensor], x: torch.Tensor, block: tuple[int, int] | None,
                       limit: float = 0.0) -> torch.Tensor:
    """One routed expert on its token rows, ``x [n, D] -> [n, D]`` (``x.dtype``), from its stored arrays.

    ``down(act(gate x, up x))`` with ``act(g, u) = silu(g) * u``, or with ``limit`` L > 0
    ``silu(min(g, L)) * clamp(u, -L, L)`` (DeepSeek-V4): the function of
    :func:`~shardsmith.runtime.layers.experts.expert_output` (the reference), computed in float32
    without expanding the weights; equal to the reference within float32 rounding.

    Args:
        arrays: one expert's ``gate_up [2*I_r, D]`` (FP4: ``[2*I_r, D/2]``; gate rows, then up rows),
            ``down [D, I_r]`` and, quantized, ``gate_up_scale`` / ``down_scale`` (gate and up scale
            rows stacked like their weights); host tensors, see :func:`supports`.
        x: ``[n, D]`` host activations; block: FP8 block size ``(rows, cols)`` (FP8 only).
        limit: SwiGLU clamp, 0 for none.

    Raises:
        RuntimeError: from the kernel, naming the shape that does not match (callers check
            :func:`supports` first).
    """
    gu, down = arrays["gate_up"], arrays["down"]
    fmt = bank_format(gu)
    x32 = x.float().contiguous()
    i_r = gu.shape[0] // 2
    if fmt == "fp4":
        h = _linear(x32, gu, arrays["gate_up_scale"], fmt, None)  # [n, 2*I_r]
        gate, up = h[:, :i_r], h[:, i_r:]
    else:
        s = arrays.get("gate_up_scale")
        s_r = s.shape[0] // 2 if s is not None else 0
        gate = _linear(x32, gu[:i_r], s[:s_r] if s is not None else None, fmt, block)
        up = _linear(x32, gu[i_r:], s[s_r:] if s is not None else None, fmt, block)
    act = clamped_swiglu(gate, up, limit).contiguous()  # [n, I_r] float32
    return _linear(act, down, arrays.get("down_scale"), fmt, block).to(x.dtype)
