"""Routed experts computed on the host, straight from the host banks (``--moe-backend cpu|hybrid``).

The host path reads each selected expert's arrays where they lie (no copy) and computes them with
the stored-format kernel (:mod:`.host_kernel`: FP4, FP8 and bf16 decoded in registers, float32
accumulation, equal to the GPU path within float32 rounding); formats it does not take, or a
machine where it cannot be compiled, dequantize to the compute dtype and run the same SwiGLU as
the GPU path (:func:`~shardsmith.runtime.layers.experts.expert_output`). Threads: every rank's process gets
``cores // ranks_on_this_host`` intra-op threads (:func:`~shardsmith.runtime.layers.parallel.clamp_threads`),
so the ranks' CPU work is partitioned and never oversubscribes the host. The ready log says how
the host computes (:meth:`CpuExperts.path`): the kernel's instruction set (``kernel avx512``), or,
on the plain path, the bf16 matmul's (oneDNN: AMX tiles where the CPU has them, ``amx_bf16``).

Legend: T = tokens, K = experts per token, D = hidden.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from shardsmith.runtime.layers.experts import ExpertMath, expert_output
from shardsmith.runtime.layers.staging import rows_by_expert
from .host_bank import HostBanks
from .host_kernel import default_isa, expert_swiglu_host, supports


@functools.cache
def cpu_matmul_isa() -> str:
    """The best bf16 matmul instruction set of this CPU: ``amx_bf16``, ``avx512_bf16``, or what torch reports."""
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        flags = set()
    for isa in ("amx_bf16", "avx512_bf16"):
        if isa in flags:
            return isa
    return str(torch.backends.cpu.get_cpu_capability()).lower()


class CpuExperts:
    """Compute routed experts of any layer on the host.

    Args:
        host: the rank's host banks; layers: bank layer keys in model order; block: FP8 block size;
        math: the family's SwiGLU clamp and accumulation (:class:`~shardsmith.runtime.layers.experts.ExpertMath`).
        kernel: use the stored-format host kernel where it takes the bank (else the reference path).
    """

    def __init__(self, host: HostBanks, layers: list[str], block: tuple[int, int] | None,
                 math: ExpertMath = ExpertMath(), *, kernel: bool = True) -> None:
        self.host, self.layers, self.block, self.math = host, layers, block, math
        self.kernel = kernel
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cpu-experts")
        self.experts_computed = 0

    def compute(self, layer: int, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
                experts: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Each expert's weighted partial on the host.

        Args:
            x: ``[T, D]`` host; index: ``[T, K]`` host; weight: ``[T, K]`` host; experts: which to compute.

        Returns:
            expert -> ``(tok [n], contribution [n, D])`` in the accumulator's dtype, as the resident path adds them.
        """
        bank = self.host.layers[self.layers[layer]]
        fast = self.kernel and supports({name: a[0] for name, a in bank.items()})
        expert = expert_swiglu_host if fast else expert_output
        out = {}
        for e, (tok, k) in rows_by_expert(index, experts, index.device).items():
            y = expert({name: a[e] for name, a in bank.items()}, x[tok], self.block, self.math.limit)
            out[e] = (tok, self.math.contribution(y, weight[tok, k], x.dtype))
        self.experts_computed += len(experts)
        return out

    def path(self) -> str:
        """How the host computes this model's experts: ``kernel <isa>`` or ``matmul <isa>``."""
        bank = next(iter(self.host.layers.values()))
        if self.kernel and supports({name: a[0] for name, a in bank.items()}):
            return f"kernel {default_isa()}"
        return f"matmul {cpu_matmul_isa()}"

    def submit(self, *args) -> Future:
        """:meth:`compute` on the backend's worker thread (torch releases the GIL inside kernels)."""
        return self._pool.submit(self.compute, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
