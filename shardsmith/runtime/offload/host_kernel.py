"""Routed experts on the host, read in their stored format by a small C++ kernel.

The plain path (:func:`shardsmith.runtime.layers.experts.expert_output`, the reference) expands an
expert to a dense copy, then multiplies: for a DeepSeek-V4-Flash expert at batch 1 that is 12.75 MB
of packed FP4 expanded to 50 MB of bf16, written and read again, about 100x the host's memory floor.
:func:`expert_swiglu_host` runs the whole expert (gate_up, SwiGLU, down) in one kernel call that
decodes the stored bytes in registers instead (``host_kernel*.cpp``: FP4 e2m1 + UE8M0 per 32, FP8
e4m3 + float32 block scales, bf16), shares every decoded vector among up to 8 of the step's tokens,
and accumulates in float32, with rows split over torch's intra-op threads (the rank's share of the
cores, :func:`~shardsmith.runtime.layers.parallel.clamp_threads`).

Instruction sets (:func:`isas`, chosen per call; :func:`default_isa` is the best one, or
``$SHARDSMITH_HOST_ISA``): ``scalar`` (plain C++), ``avx2`` (AVX2 + FMA + F16C: FP4 through a pshufb
table, FP8 -> f16 by bit moves), ``avx512`` (AVX-512F: FP4 through a 16-entry float table per
vpermps, 16 lanes). One build holds all three (each file targets its set by pragma) and the CPU's
features decide at run time, so the paths can be compared on one host (``benchmarks/host_experts.py
--isa``). Tried and not taken: int8 activations with integer dot products (VNNI / maddubs) and
bf16 dot products (AVX512-BF16) are faster per byte but round the activations, so the result would
no longer equal the resident bank's within float32 rounding.

The kernel is compiled once per machine on first use (``torch.utils.cpp_extension``, ``-O3``),
cached by the hash of its sources, the torch version and the CPU's flags under
``$SHARDSMITH_CACHE/host_kernel``. Without a compiler everything still works: :func:`available`
says whether the compiled kernel is loaded and callers fall back to the reference.

Legend: T = tokens, D = hidden, I_r = this rank's intermediate share.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

from shardsmith.runtime.layers.quant import bank_format
from ...errors import UsageError

log = logging.getLogger("shardsmith.runtime.offload")
_HERE = Path(__file__).parent
SOURCES = tuple(_HERE / f for f in ("host_kernel.cpp", "host_kernel_scalar.cpp", "host_kernel_avx2.cpp",
                                     "host_kernel_avx512.cpp"))
HEADER = _HERE / "host_kernel.h"
ISA_ENV = "SHARDSMITH_HOST_ISA"


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
    h = hashlib.sha256(torch.__version__.encode() + _cpu_flags().encode())
    for f in (*SOURCES, HEADER):
        h.update(f.read_bytes())
    key = h.hexdigest()[:16]
    root = Path(os.environ.get("SHARDSMITH_CACHE", Path.home() / ".cache" / "shardsmith")) / "host_kernel" / key
    try:
        from torch.utils.cpp_extension import load

        root.mkdir(parents=True, exist_ok=True)
        load(name=f"shardsmith_host_{key}", sources=[str(s) for s in SOURCES], build_directory=str(root),
             is_python_module=False, extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no headers, a failed build: the reference path still works
        log.warning("host expert kernel unavailable (%s: %s); routed experts on the host use the plain path",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False
    return True


@functools.cache
def isas() -> tuple[str, ...]:
    """Instruction sets this build and CPU support, worst first (``scalar``, ``avx2``, ``avx512``); () without the kernel."""
    return tuple(torch.ops.shardsmith_host.isas().split(",")) if available() else ()


def default_isa() -> str:
    """``$SHARDSMITH_HOST_ISA`` if set, else the best of :func:`isas`.

    Raises:
        UsageError: the variable names a set this CPU or build lacks.
    """
    want = os.environ.get(ISA_ENV, "")
    if want and want not in isas():
        raise UsageError(f"{ISA_ENV}={want!r}: this CPU and build support {', '.join(isas()) or 'no host kernel'}")
    return want or (isas()[-1] if isas() else "")


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
                       limit: float = 0.0, *, isa: str | None = None) -> torch.Tensor:
    """One routed expert on its token rows, ``x [n, D] -> [n, D]`` (``x.dtype``), from its stored arrays.

    ``down(act(gate x, up x))`` with ``act(g, u) = silu(g) * u``, or with ``limit`` L > 0
    ``silu(min(g, L)) * clamp(u, -L, L)`` (DeepSeek-V4): the function of
    :func:`~shardsmith.runtime.layers.experts.expert_output` (the reference), computed in float32
    without expanding the weights; equal to the reference within float32 rounding.

    Args:
        arrays: one expert's ``gate_up [2*I_r, D]`` (FP4: ``[2*I_r, D/2]``; gate rows, then up rows),
            ``down [D, I_r]`` and, quantized, ``gate_up_scale`` / ``down_scale`` (gate and up scale
            rows stacked like their weights); host tensors, see :func:`supports`.
        x: ``[n, D]`` host activations, any n >= 1; block: FP8 block size ``(rows, cols)`` (FP8 only).
        limit: SwiGLU clamp, 0 for none. isa: one of :func:`isas` (default :func:`default_isa`).

    Raises:
        RuntimeError: from the kernel, naming the shape that does not match or the instruction set
            that is missing (callers check :func:`supports` first).
    """
    gu, down = arrays["gate_up"], arrays["down"]
    fmt = bank_format(gu)
    x32 = x.float().contiguous()
    isa = default_isa() if isa is None else isa
    if fmt == "fp4":
        y = torch.ops.shardsmith_host.expert(x32, gu.view(torch.uint8), arrays["gate_up_scale"].view(torch.uint8),
                                             down.view(torch.uint8), arrays["down_scale"].view(torch.uint8),
                                             "fp4", 0, 0, limit, isa)
    elif fmt == "fp8":
        br, bc = block
        y = torch.ops.shardsmith_host.expert(x32, gu, arrays["gate_up_scale"].float(), down, arrays["down_scale"].float(),
                                             "fp8", br, bc, limit, isa)
    else:
        y = torch.ops.shardsmith_host.expert(x32, gu, None, down, None, "bf16", 0, 0, limit, isa)
    return y.to(x.dtype)
