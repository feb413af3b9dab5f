"""Which kernel launches compile: Triton's cache key of a launch, computed on CPU without compiling.

Triton 3.x's ``JITFunction.run`` finds a compiled kernel by a key made of each argument's
specialization and the launch options (``num_warps``, ``num_stages``); a launch whose key is new
compiles (seconds on an H200; a warm disk cache turns it into a load). The specialization:

=====================  ==================================================================
argument               key part
=====================  ==================================================================
``tl.constexpr``       its value
plain int              i32 / i64 by range; the value 1 becomes a constexpr, a multiple of 16
                       is marked divisible (not when ``do_not_specialize`` names it)
tensor                 element type; a 16-byte-aligned address is marked divisible
=====================  ==================================================================

:func:`compile_key` reproduces it with Triton's own binder
(``triton.runtime.jit.create_function_from_signature``, the code ``JITFunction.run`` calls), for
a kernel built by ``triton.jit`` with or without ``TRITON_INTERPRET=1``. :func:`record_launches`
swaps the kernels of :mod:`._fp8_triton` and :mod:`._moe_triton` for recorders, so a test can
call the wrappers (``fp8_linear``, ``fused_experts``) over many token counts and count the
distinct keys, that is the compiles serving would pay. Tests and benchmarks only: it reads
Triton internals that may move between releases (written against Triton 3.6).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any


@functools.cache
def _binder(fn: Any, do_not_specialize: tuple, do_not_specialize_on_alignment: tuple):
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jf = JITFunction(fn, do_not_specialize=list(do_not_specialize),
                     do_not_specialize_on_alignment=list(do_not_specialize_on_alignment))
    return create_function_from_signature(jf.signature, jf.params, CUDABackend)


def _raw(kernel: Any) -> tuple[Any, tuple, tuple]:
    """``(python function, do_not_specialize, do_not_specialize_on_alignment)`` of a jitted kernel
    (``JITFunction``, or ``InterpretedFunction`` under ``TRITON_INTERPRET=1``)."""
    opts = getattr(kernel, "kwargs", None) or {}  # InterpretedFunction keeps triton.jit's keywords
    dns = getattr(kernel, "do_not_specialize", None) or opts.get("do_not_specialize") or ()
    dnsa = getattr(kernel, "do_not_specialize_on_alignment", None) or opts.get("do_not_specialize_on_alignment") or ()
    return kernel.fn, tuple(dns), tuple(dnsa)


def compile_key(kernel: Any, *args: Any, **kwargs: Any) -> tuple:
    """The key under which ``kernel[grid](*args, **kwargs)`` finds its compiled variant:
    ``(kernel name, per-argument specialization, launch options)``; equal keys share one compile.

    Args:
        kernel: a ``triton.jit`` function; args, kwargs: as passed to the launch (tensors may be
            on CPU: only their dtype and address are read).

    Returns:
        A hashable tuple.
    """
    fn, dns, dnsa = _raw(kernel)
    _, specialization, options = _binder(fn, dns, dnsa)(*args, **kwargs)
    return fn.__name__, tuple(specialization), tuple(sorted(options.items()))


class _Recorder:
    """Stands in for a jitted kernel: ``rec[grid](*args, **kwargs)`` appends the launch's key to
    ``keys`` and, with ``run``, launches the real kernel."""

    def __init__(self, name: str, kernel: Any, keys: list[tuple], run: bool) -> None:
        self.name, self.kernel, self.keys, self.run = name, kernel, keys, run
        self.fn = kernel.fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.keys.append((self.name, *compile_key(self.kernel, *args, **kwargs)[1:]))
            if self.run:
                return self.kernel[grid](*args, **kwargs)
            return None

        return launch


@contextlib.contextmanager
def record_launches(*, run: bool = False) -> Iterator[list[tuple]]:
    """Record the compile key of every launch of the kernels behind ``fp8_linear``, ``fused_experts``,
    ``sink_attention``, ``indexer_scores``, ``compressor_step``, ``hc_mix``, ``hc_pre``, ``hc_post`` and ``route_topk``
    while the block runs;
    without ``run`` nothing is launched (the wrappers' outputs are then uninitialised).

    Yields:
        The list the keys are appended to, in launch order, each named by the kernel's module
        attribute (``_fp8_linear_kernel``, ``_fp8_linear_long_kernel``, ...).

    Example:
        >>> with record_launches() as keys:  # doctest: +SKIP
        ...     fp8_linear(x, w, scale, backend="triton")
        >>> len(set(keys))  # doctest: +SKIP
    """
    from shardsmith.runtime.layers.kernels import _fp8_triton, _moe_triton, _router_triton
    from shardsmith.runtime.layers.kernels.deepseek_v4 import (_compressor_triton, _hc_triton, _indexer_triton,
                                                               _sink_attention_triton)

    keys: list[tuple] = []
    saved = []
    for mod in (_fp8_triton, _moe_triton, _sink_attention_triton, _indexer_triton, _compressor_triton, _hc_triton,
                _router_triton):
        for name, obj in list(vars(mod).items()):
            if name.endswith("_kernel") or name.startswith("_sum_splits"):
                if hasattr(obj, "fn") and not isinstance(obj, _Recorder):
                    saved.append((mod, name, obj))
                    setattr(mod, name, _Recorder(name, obj, keys, run))
    try:
        yield keys
    finally:
        for mod, name, obj in saved:
            setattr(mod, name, obj)
