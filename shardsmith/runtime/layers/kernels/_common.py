"""What the kernels share: their error class, the Triton switch and the device's multiprocessor count.

Triton is optional (the ``kernels`` extra): it is imported only when a kernel runs, so the runtime
and its CPU tests import this package without it. ``TRITON_INTERPRET=1`` runs the kernels on CPU
tensors through Triton's interpreter (slow; tests only).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from shardsmith import settings
from shardsmith.errors import ShardsmithError

BACKENDS = ("auto", "triton", "reference")

DECODE_M = 16  # rows up to which fp8_linear runs its decode kernels (one 16-row tile)


class KernelError(ShardsmithError):
    """A kernel was called with inputs it does not take (shape, dtype, block size, backend)."""


@functools.cache
def triton_available() -> bool:
    """Whether ``triton`` can be imported (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton's CPU interpreter is on (``TRITON_INTERPRET=1``)."""
    return settings.triton_interpreting()


def use_triton(x: torch.Tensor, backend: str) -> bool:
    """Pick the path for input ``x``: ``auto`` takes Triton on CUDA, or on CPU under the interpreter.

    Raises:
        KernelError: ``backend`` is not one of :data:`BACKENDS`, or is ``triton`` while Triton is
            missing or ``x`` is on CPU without the interpreter.
    """
    if backend not in BACKENDS:
        raise KernelError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend == "reference":
        return False
    runnable = triton_available() and (x.is_cuda or interpreting())
    if backend == "triton" and not runnable:
        why = "triton is not installed (pip install 'shardsmith[kernels]')" if not triton_available() else \
            f"x is on {x.device} and TRITON_INTERPRET is not set"
        raise KernelError(f"backend 'triton' cannot run: {why}")
    return runnable


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (132 on an H200 SXM; 132 assumed for CPU, so the interpreter
    runs the same grids as the GPU)."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
