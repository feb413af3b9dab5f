"""Routed experts computed on the host, straight from the host banks (``--moe-backend cpu|hybrid``).

The host path reads each selected expert's arrays where they lie (no copy) and computes them with
the stored-format kernel (:mod:`.host_kernel`: FP4, FP8 and bf16 decoded in registers, float32
accumulation, equal to the GPU path within float32 rounding); formats it does not take, maths it
does not compute (gpt-oss's GLU with alpha, interleaved gate/up and biases), or a machine where it
cannot be compiled, dequantize to the compute dtype and run the same SwiGLU as
the GPU path (:func:`~shardsmith.runtime.layers.experts.expert_output`). Threads: every rank's process gets
``cores // ranks_on_this_host`` intra-op threads (:func:`~shardsmith.runtime.layers.parallel.clamp_threads`),
so the ranks' CPU work is partitioned and never oversubscribes the host. The ready log says how
the host computes (:meth:`CpuExperts.path`): the kernel's instruction set (``kernel avx512``), or,
on the plain path, the bf16 matmul's (oneDNN: AMX tiles where the CPU has them, ``amx_bf16``).

A hybrid layer's host round trip (:meth:`CpuExperts.submit_from`, :meth:`CpuExperts.collect`):
activations and routing weights leave the device in one copy (one stream sync, after the ids'),
the worker thread computes, and every contribution and token row returns in one pinned
asynchronous copy per dtype (no sync; a pageable ``.to(device)`` per expert syncs the stream twice
per expert: :mod:`~shardsmith.runtime.layers.staging`). With a GPU driving the step, the worker
uses one intra-op thread fewer than the process (``reserve_core``): the thread that launches the
GPU work stays busy meanwhile, and a parallel region as wide as every core then waits, at each of
its barriers, for the one thread the scheduler has parked behind it.

Legend: T = tokens, K = experts per token, D = hidden.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from shardsmith.runtime.layers.experts import ExpertMath, expert_output
from shardsmith.runtime.layers.staging import rows_by_expert, to_device
from .host_bank import HostBanks
from .host_kernel import check_expert, default_isa, expert_swiglu_host, supports


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
        reserve_core: the worker thread uses ``torch.get_num_threads() - 1`` intra-op threads (at
            least 1), leaving a core to the thread that drives the GPU (module docstring).

    Attributes:
        experts_computed, calls: experts and :meth:`compute` calls so far; compute_s: seconds the
        worker spent in :meth:`compute`, expert_s of it in the expert calls (the kernel, which runs
        without the GIL, and the wait to take the GIL back from the driving thread after it; the
        rest is Python around them); d2h_s, h2d_s: seconds this thread spent in
        :meth:`submit_from`'s copy (a stream sync) and issuing :meth:`collect`'s; wait_s: seconds
        :meth:`collect` blocked on the worker (host time not hidden behind the GPU's).
    """

    def __init__(self, host: HostBanks, layers: list[str], block: tuple[int, int] | None,
                 math: ExpertMath = ExpertMath(), *, kernel: bool = True, reserve_core: bool = False) -> None:
        self.host, self.layers, self.block, self.math = host, layers, block, math
        self.kernel = kernel
        self.threads = max(1, torch.get_num_threads() - 1) if reserve_core else torch.get_num_threads()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cpu-experts", initializer=torch.set_num_threads,
                                        initargs=(self.threads,))
        self.experts_computed = self.calls = 0
        self.compute_s = self.expert_s = self.d2h_s = self.h2d_s = self.wait_s = 0.0
        self._checked: set[str] = set()  # layers whose bank layout the kernel's Python checks passed

    def _expert_fn(self, layer: int, bank: dict[str, torch.Tensor], x: torch.Tensor):
        """The host path for this bank: the kernel (its layout checked once per layer) or the reference."""
        if not (self.kernel and self.math.plain and supports({name: a[0] for name, a in bank.items()})):
            return functools.partial(expert_output, math=self.math)
        key = self.layers[layer]
        if key not in self._checked:
            check_expert({name: a[0] for name, a in bank.items()}, x[:1], self.block)
            self._checked.add(key)
        return functools.partial(expert_swiglu_host, check=False)

    def compute(self, layer: int, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
                experts: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Each expert's weighted partial on the host.

        Args:
            x: ``[T, D]`` host; index: ``[T, K]`` host; weight: ``[T, K]`` host; experts: which to compute.

        Returns:
            expert -> ``(tok [n], contribution [n, D])`` in the accumulator's dtype, as the resident path adds them.
        """
        t0 = time.perf_counter()
        bank = self.host.layers[self.layers[layer]]
        expert = self._expert_fn(layer, bank, x)
        out = {}
        for e, (tok, k) in rows_by_expert(index, experts, index.device).items():
            t1 = time.perf_counter()
            y = expert({name: a[e] for name, a in bank.items()}, x[tok], self.block, self.math.limit)
            self.expert_s += time.perf_counter() - t1
            out[e] = (tok, self.math.contribution(y, weight[tok, k], x.dtype))
        self.experts_computed += len(experts)
        self.calls += 1
        self.compute_s += time.perf_counter() - t0
        return out

    def path(self) -> str:
        """How the host computes this model's experts: ``kernel <isa>`` or ``matmul <isa>``."""
        bank = next(iter(self.host.layers.values()))
        if self.kernel and self.math.plain and supports({name: a[0] for name, a in bank.items()}):
            return f"kernel {default_isa()}"
        return f"matmul {cpu_matmul_isa()}"

    def submit(self, *args) -> Future:
        """:meth:`compute` on the backend's worker thread (torch releases the GIL inside kernels)."""
        return self._pool.submit(self.compute, *args)

    def submit_from(self, layer: int, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
                    experts: list[int]) -> Future:
        """:meth:`submit` from device tensors: ``x [T, D]`` and ``weight [T, K]`` leave the device in
        one copy (one stream sync); ``index [T, K]`` is already on the host (the layer's ids)."""
        t0 = time.perf_counter()
        T, D = x.shape
        both = torch.cat([x.reshape(-1).float(), weight.reshape(-1).float()]).cpu()  # bf16 -> float32 is exact
        x_h = both[: T * D].view(T, D).to(x.dtype)
        w_h = both[T * D:].view(weight.shape).to(weight.dtype)
        self.d2h_s += time.perf_counter() - t0
        return self.submit(layer, x_h, index, w_h, experts)

    def collect(self, fut: Future, device: torch.device) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`submit`'s result on ``device``: expert -> ``(tok [n], contribution [n, D])`` as the
        GPU path's, with one pinned asynchronous copy for the token rows and one for the
        contributions (:func:`~shardsmith.runtime.layers.staging.to_device`; no stream sync)."""
        t0 = time.perf_counter()
        out = fut.result()
        t1 = time.perf_counter()
        experts = list(out)
        toks = to_device([out[e][0] for e in experts], device)
        ys = to_device([out[e][1].reshape(-1) for e in experts], device)
        res = {e: (tok, y.view(out[e][1].shape)) for e, tok, y in zip(experts, toks, ys)}
        self.wait_s += t1 - t0
        self.h2d_s += time.perf_counter() - t1
        return res

    def timings(self) -> dict[str, float]:
        """Counters for a benchmark row (see the class's Attributes)."""
        return {"host_calls": self.calls, "host_compute_s": self.compute_s, "host_expert_s": self.expert_s,
                "host_d2h_s": self.d2h_s,
                "host_h2d_s": self.h2d_s, "host_wait_s": self.wait_s, "host_threads": self.threads}

    def reset_timings(self) -> None:
        """Zero :meth:`timings`' counters (``experts_computed`` too)."""
        self.experts_computed = self.calls = 0
        self.compute_s = self.expert_s = self.d2h_s = self.h2d_s = self.wait_s = 0.0

    def close(self) -> None:
        self._pool.shutdown(wait=True)
