"""Routed experts computed on the host, straight from the host banks (``--moe-backend cpu|hybrid``).

The host path reads each selected expert's arrays where they lie (no copy) and computes them with
the stored-format kernel (:mod:`.host_kernel`: FP4, FP8 and bf16 decoded in registers, float32
accumulation, equal to the GPU path within float32 rounding; gpt-oss's GLU with alpha, interleaved
gate/up rows and biases on its FP4 banks too); formats it does not take, or a machine where it
cannot be compiled, dequantize to the compute dtype and run the same maths as
the GPU path (:func:`~shardsmith.runtime.layers.experts.expert_output`). Threads: every rank's process gets
``cores // ranks_on_this_host`` intra-op threads (:func:`~shardsmith.runtime.engine.dist.clamp_threads`),
pinned to that many CPUs of its own (``engine/dist.py`` ``pin_cores``: whole cores, one NUMA node where
the split allows), so the ranks' CPU work is partitioned and never oversubscribes the host. The ready log says how
the host computes (:meth:`CpuExperts.path`): the kernel's instruction set (``kernel avx512``), or,
on the plain path, the bf16 matmul's (oneDNN: AMX tiles where the CPU has them, ``amx_bf16``).

A hybrid decode step's host round trip (:meth:`CpuExperts.stage`, :meth:`CpuExperts.submit_partial`,
:meth:`HostPartial.add_to`): the ids, activations and routing weights leave the device together,
into page-locked buffers kept per shape, with the layer's one stream sync; the worker thread sums
its experts' weighted outputs into one kept page-locked partial ``[T, D]`` while the GPU computes
the rest; that partial returns in one asynchronous copy into a kept device buffer (no sync; a
pageable ``.to(device)`` syncs the stream: :mod:`~shardsmith.runtime.layers.staging`) and is added
to the GPU's. The older per-expert round trip (:meth:`CpuExperts.submit_from`,
:meth:`CpuExperts.collect`: one more sync, one copy per dtype back) serves prefill-sized steps. With a GPU driving the step, the worker
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
from shardsmith.runtime.layers.quant import bank_format
from shardsmith.runtime.layers.staging import rows_by_expert, to_device
from .host_bank import HostBanks
from .host_kernel import check_expert, current_prefetch_bytes, default_isa, experts_swiglu_host, supports


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
        self._down: dict[tuple, tuple[torch.Tensor, ...]] = {}  # stage(): (index, x, weight) host buffers per shape
        self._up: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # submit_partial(): (host, device) partials
        self._up_read: torch.cuda.Event | None = None  # the last partial's H2D copy (its host buffer is free after)

    def _experts_fn(self, layer: int, bank: dict[str, torch.Tensor], x: torch.Tensor):
        """The host path for this bank, ``fn(arrays_list, xs, block, limit) -> ys``: one kernel call for
        all of the step's experts (their layout checked once per layer), or the reference per expert."""
        if not self._kernel_takes(bank):
            one = functools.partial(expert_output, math=self.math)
            return lambda arrays, xs, block, limit: [one(a, xe, block, limit) for a, xe in zip(arrays, xs)]
        key = self.layers[layer]
        if key not in self._checked:
            check_expert({name: a[0] for name, a in bank.items()}, x[:1], self.block)
            self._checked.add(key)
        return functools.partial(experts_swiglu_host, check=False, alpha=self.math.alpha,
                                 interleaved=self.math.interleaved)

    def _kernel_takes(self, bank: dict[str, torch.Tensor]) -> bool:
        """Whether the host kernel runs this bank with this family's maths: the SwiGLU of any format it
        takes, and gpt-oss's GLU (interleaved gate/up rows, a bias, ``alpha``) on FP4 banks."""
        arrays = {name: a[0] for name, a in bank.items()}
        return self.kernel and supports(arrays) and (self.math.plain or bank_format(arrays["gate_up"]) == "fp4")

    def compute(self, layer: int, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
                experts: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Each expert's weighted partial on the host (every expert of the layer in one kernel call).

        Args:
            x: ``[T, D]`` host; index: ``[T, K]`` host; weight: ``[T, K]`` host; experts: which to compute.

        Returns:
            expert -> ``(tok [n], contribution [n, D])`` in the accumulator's dtype, as the resident path adds them.
        """
        t0 = time.perf_counter()
        bank = self.host.layers[self.layers[layer]]
        groups = rows_by_expert(index, experts, index.device)
        out = {}
        if groups:
            fn = self._experts_fn(layer, bank, x)
            t1 = time.perf_counter()
            ys = fn([{name: a[e] for name, a in bank.items()} for e in groups], [x[tok] for tok, _ in groups.values()],
                    self.block, self.math.limit)
            self.expert_s += time.perf_counter() - t1
            for (e, (tok, k)), y in zip(groups.items(), ys):
                out[e] = (tok, self.math.contribution(y, weight[tok, k], x.dtype))
        self.experts_computed += len(experts)
        self.calls += 1
        self.compute_s += time.perf_counter() - t0
        return out

    def path(self) -> str:
        """How the host computes this model's experts: ``kernel <isa>, prefetch <n> B`` or ``matmul <isa>``."""
        bank = next(iter(self.host.layers.values()))
        if self._kernel_takes(bank):
            return f"kernel {default_isa()}, prefetch {current_prefetch_bytes()} B"
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

    def stage(self, x: torch.Tensor, index: torch.Tensor,
              weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(index [T, K], x [T, D], weight [T, K])`` on the host, copied from ``x``'s device into
        buffers kept per shape (page-locked on CUDA) with one stream sync: the decode step's read of
        its ids, which brings the host share's inputs along. The buffers are rewritten by the next
        call of the same shape: the caller collects its host work before the next layer stages."""
        key = (tuple(x.shape), x.dtype, tuple(index.shape), index.dtype, weight.dtype)
        bufs = self._down.get(key)
        if bufs is None:
            pin = x.device.type == "cuda"
            with torch.inference_mode(False):  # kept across calls, written in and out of inference mode
                bufs = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in (index, x, weight))
            self._down[key] = bufs
        t0 = time.perf_counter()
        for dst, src in zip(bufs, (index, x, weight)):
            dst.copy_(src, non_blocking=True)
        if x.device.type == "cuda":
            torch.cuda.current_stream(x.device).synchronize()
        self.d2h_s += time.perf_counter() - t0
        return bufs

    def submit_partial(self, layer: int, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
                       experts: list[int], device: torch.device) -> HostPartial:
        """Start the host share of a split decode step on the worker thread: ``experts``' weighted
        outputs summed into one ``[T, D]`` partial (float32 when the family accumulates in float32,
        else ``x.dtype``; contributions added in ascending expert order, as the resident general path).

        Args:
            x, index, weight: host tensors (:meth:`stage`'s); experts: ascending; device: where
                :meth:`HostPartial.add_to` will add the partial.
        """
        acc = torch.float32 if self.math.accumulate_f32 else x.dtype
        dev = torch.device(device)
        key = (tuple(x.shape), acc, dev)
        bufs = self._up.get(key)
        if bufs is None:
            cuda = dev.type == "cuda"
            with torch.inference_mode(False):  # as stage()'s
                host = torch.empty(x.shape, dtype=acc, pin_memory=cuda)
                bufs = self._up[key] = (host, torch.empty(x.shape, dtype=acc, device=dev) if cuda else host)
        fut = self._pool.submit(self._partial, layer, x, index, weight, experts, bufs[0])
        return HostPartial(self, fut, *bufs, x.dtype)

    def _partial(self, layer: int, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
                 experts: list[int], out: torch.Tensor) -> torch.Tensor:
        """Worker thread: :meth:`compute`, its contributions summed into ``out``."""
        if self._up_read is not None:  # normally long done: the next layer's id read synced past it
            self._up_read.synchronize()
        contrib = self.compute(layer, x, index, weight, experts)
        t0 = time.perf_counter()
        out.zero_()
        for e in experts:
            tok, y = contrib[e]
            out.index_add_(0, tok, y)
        self.compute_s += time.perf_counter() - t0
        return out

    def _finish(self, part: HostPartial, gpu: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        part.future.result()
        t1 = time.perf_counter()
        if part.device_buf is not part.host_buf:
            part.device_buf.copy_(part.host_buf, non_blocking=True)
            self._up_read = torch.cuda.current_stream(gpu.device).record_event()
        out = (gpu.float() + part.device_buf.float()).to(part.dtype)
        self.wait_s += t1 - t0
        self.h2d_s += time.perf_counter() - t1
        return out

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


class HostPartial:
    """A split decode step's host share in flight (:meth:`CpuExperts.submit_partial`).

    Attributes:
        future: the worker's call; host_buf: its ``[T, D]`` partial (page-locked on CUDA);
        device_buf: where it is copied on the device (``host_buf`` itself on a CPU device);
        dtype: the activations' (the routed partial's).
    """

    def __init__(self, cpu: CpuExperts, future: Future, host_buf: torch.Tensor, device_buf: torch.Tensor,
                 dtype: torch.dtype) -> None:
        self.cpu, self.future, self.host_buf, self.device_buf, self.dtype = cpu, future, host_buf, device_buf, dtype

    def add_to(self, gpu: torch.Tensor) -> torch.Tensor:
        """The layer's routed partial ``[T, D]`` (the activations' dtype): ``gpu`` (the GPU experts'
        float32 partial, ``apply_slots(..., masked=True)``) plus the host's, added in float32 and cast once. Waits for the worker, then copies its
        partial to the device asynchronously (no stream sync); call it after queueing the GPU
        experts, so their work overlaps the host's."""
        return self.cpu._finish(self, gpu)
