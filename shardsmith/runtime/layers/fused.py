"""Row-wise maths of a prefill chunk fused by ``torch.compile`` (Inductor), one graph per function for every
layer and chunk length.

A prefill chunk of thousands of tokens runs its norms, mixers and RoPE as element-wise PyTorch ops, each
one pass over the chunk's rows in HBM: DeepSeek-V4's hyper-connection mixer alone reads and writes its
``[T, m, D]`` streams in float32 about a dozen times. Such a function, decorated with :func:`for_chunks`,
runs compiled when it is given at least :data:`CHUNK_ROWS` rows: Inductor fuses its element-wise ops and
reductions into a few kernels (the matmuls stay cuBLAS calls), with the row count symbolic, so chunks of
every length share one graph, and every layer shares it too (a decorated function takes tensors and
constants, no module). Fewer rows (decode steps, which have their own kernels and captured pieces) run
the function as written, and so does a call inside another compiled region (the outer graph fuses it).

Compiled where ``SHARDSMITH_KERNELS=compile_pieces`` compiles the decode pieces (:func:`compiles`: ``auto``
on CUDA, ``kernel`` on the CPU too as Inductor's C++ code, ``reference`` never). The compiled graph keeps
eager's casts to lower precision (``emulate_precision_casts``); its reductions may still add in another
order, so it equals the function within float rounding, not bitwise.

Source: PyTorch ``torch.compile`` (https://pytorch.org/docs/stable/generated/torch.compile.html).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from shardsmith import settings

F = TypeVar("F", bound=Callable[..., Any])

CHUNK_ROWS = 17  # rows from which a decorated function runs compiled (decode steps have at most 16 in a kernel)
ENABLED: bool | None = None  # None: compiles(); a benchmark sets False or True to compare the two paths


def compiles() -> bool:
    """Whether compiled pieces are on (``compile_pieces``: ``auto`` on CUDA, ``kernel`` everywhere)."""
    mode = settings.current().compile_pieces
    return mode is settings.Kernel.KERNEL or (mode is settings.Kernel.AUTO and torch.cuda.is_available())


def for_chunks(fn: F) -> F:
    """``fn`` (row-wise over dim 0 of its first argument, a tensor) compiled for prefill chunks: see the
    module docstring. The undecorated function stays reachable as ``.reference``."""
    compiled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if args[0].shape[0] < CHUNK_ROWS or not (compiles() if ENABLED is None else ENABLED) \
                or torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if not compiled:
            from torch import _dynamo as dynamo

            dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 512)
            compiled.append(torch.compile(fn, dynamic=True, options={"emulate_precision_casts": True}))
        return compiled[0](*args, **kwargs)

    run.reference = fn  # type: ignore[attr-defined]
    return run  # type: ignore[return-value]
