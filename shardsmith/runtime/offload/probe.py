"""Start-up probe: measured link and host costs of the hybrid path, and the backend choice.

What a decode step's MoE layer costs (one rank, one token, ``m`` misses of the GPU slot cache):

* ``gpu``: ``m * t_copy + t_fused`` with ``t_copy = slot_bytes / h2d_bytes_per_s`` (the miss
  copies) and ``t_fused`` the slot step's compute of the layer's experts (the fused kernel over
  the slot pool, or the expanded FP4 pairs without it);
* ``hybrid`` with ``k`` of the misses on the host (a split step, :mod:`.runtime`): the host side
  costs ``t_round + k * t_host`` (``t_round``: the layer's round trip, the hand-off to the worker
  thread and back, the partial to the device; ``t_host``: one more expert there), the GPU side
  ``(m - k) * t_copy + t_fused`` (its experts stay on the slot path, the host's pairs masked); the
  two run in parallel, the layer takes the longer.

Every term is measured here, warm, as the runtime pays it (:func:`measure_host_path` drives
:meth:`~.cpu_backend.CpuExperts.submit_from` with device tensors while the calling thread keeps
launching GPU work, as a decode step's does), as the median of several repeats on experts the
probe has not touched. ``auto`` then picks ``hybrid`` only where the best ``k`` saves at least
:data:`HYBRID_MIN_GAIN` of the ``gpu`` layer time at :data:`REFERENCE_MISSES` misses per layer, else
``gpu`` (``cpu`` without a GPU): never a backend the measurements say is slower. Each rank
measures; :func:`run_probe` reduces the numbers over ranks (the slowest host, the slowest link)
before deciding, so every rank reaches the same decision from the same inputs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from shardsmith.runtime.layers.kernels import fused_experts
from . import link_cap
from .cpu_backend import CpuExperts
from .host_bank import HostBanks


HYBRID_MIN_GAIN = 0.2  # share of the ``gpu`` layer time a hybrid split must save for ``auto`` to pick it
REFERENCE_MISSES = 6  # misses per layer the decision is made at (DeepSeek-V4's top-6 with a cache that rarely hits)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What the probe measured (reduced over ranks) and chose.

    Attributes:
        h2d_gb_per_s: host-to-device copy bandwidth from the (pinned, if so) banks, GB/s (1e9 bytes);
            0 without CUDA. pinned: whether the banks are page-locked.
        cpu_s_per_expert: seconds for one more expert, one token, on the host (marginal, warm).
        slot_bytes: bytes per expert on this rank. backend: the backend chosen; hybrid_fraction:
        share of misses sent to the host; reason: one line for the log; cpu_isa: how the host
        computes experts (:meth:`~.cpu_backend.CpuExperts.path`: ``kernel avx512``, ``matmul amx_bf16``).
        host_round_trip_s: fixed seconds of one layer's host call (copies, thread hand-offs).
        gpu_fused_s: seconds of the slot path's compute of one token's :data:`REFERENCE_MISSES`
            experts on the GPU (``t_fused``).
        hybrid_gain: share of the ``gpu`` layer time the best split saves (0: none does).
    """

    h2d_gb_per_s: float
    pinned: bool
    cpu_s_per_expert: float
    slot_bytes: int
    backend: str
    hybrid_fraction: float
    reason: str
    cpu_isa: str
    host_round_trip_s: float = 0.0
    gpu_fused_s: float = 0.0
    hybrid_gain: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def measure_h2d(host: HostBanks, device: torch.device, *, min_bytes: int = 256 << 20, repeats: int = 3) -> float:
    """Best-of-``repeats`` GB/s copying ``min_bytes`` of the banks' own memory, expert by expert, to ``device``
    (at most the emulated rate when ``SHARDSMITH_TUNING=emulate_h2d_gbps`` caps it: :mod:`.link_cap`)."""
    if torch.device(device).type != "cuda":
        return 0.0
    srcs, total = [], 0
    for arrays in host.layers.values():
        for a in arrays.values():  # expert by expert: a copy must not span two pinned registrations
            for x in a:
                srcs.append(x)
                total += x.numel() * x.element_size()
                if total >= min_bytes:
                    break
            if total >= min_bytes:
                break
        if total >= min_bytes:
            break
    dsts = [torch.empty_like(s, device=device) for s in srcs]
    stream = torch.cuda.Stream(device)
    best = 0.0
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            for d, s in zip(dsts, srcs):
                d.copy_(s, non_blocking=True)
            link_cap.pad(total, device)  # the emulated link, as the cache's copies see it (off by default)
            end.record(stream)
        end.synchronize()
        best = max(best, total / (start.elapsed_time(end) / 1e3) / 1e9)
    del dsts
    return best


def probe_experts(n_experts: int, count: int) -> list[int]:
    """``count`` distinct experts from the top of a layer's ``n_experts`` down (the link probe reads
    from expert 0 up, so these are not just touched); cycles when the layer has fewer.

    Raises:
        ValueError: ``n_experts`` < 1.
    """
    if n_experts < 1:
        raise ValueError(f"a layer with {n_experts} experts cannot be probed")
    return [n_experts - 1 - (i % n_experts) for i in range(count)]


def measure_host_path(cpu: CpuExperts, device: torch.device, dim: int, dtype: torch.dtype, *, repeats: int = 5,
                      batch: int = 4, launches: int = 64) -> tuple[float, float]:
    """``(round_trip_s, s_per_expert)`` of the host path of a one-token layer, warm, medians.

    Times a split step's host round trip from and to ``device`` (the runtime's own calls:
    :meth:`~.cpu_backend.CpuExperts.stage`, :meth:`~.cpu_backend.CpuExperts.submit_partial`,
    :meth:`~.cpu_backend.HostPartial.add_to`: one D2H, the worker thread, one H2D) with 1 and
    with ``batch`` experts per call, ``repeats`` times each on fresh experts of the last layer,
    after one warm-up call of each size. While the host computes, this thread launches ``launches``
    small device ops, as a decode step's thread launches its GPU experts (its core and the GIL are
    then not free for the host's threads), then waits, as the step does.
    ``s_per_expert = (t_batch - t_1) / (batch - 1)``, at least ``t_batch / (2 * batch)`` (a noisy pair
    of medians must not make the host look free); ``round_trip_s = t_1 - s_per_expert`` (>= 0).

    Raises:
        ValueError: ``batch`` < 2 or ``repeats`` < 1.
    """
    if batch < 2 or repeats < 1:
        raise ValueError(f"measure_host_path needs batch >= 2 and repeats >= 1, got batch={batch}, repeats={repeats}")
    dev = torch.device(device)
    layer = len(cpu.layers) - 1
    n_exp = cpu.host.layers[cpu.layers[layer]]["gate_up"].shape[0]
    order = iter(probe_experts(n_exp, (repeats + 1) * (batch + 1)))
    x = torch.randn(1, dim, device=dev).to(dtype)
    busy = torch.zeros(64, device=dev)
    zero = torch.zeros_like(x)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    counters = ("experts_computed", "calls", "compute_s", "expert_s", "d2h_s", "h2d_s", "wait_s")
    before = {k: getattr(cpu, k) for k in counters}

    def once(n: int) -> float:
        experts = sorted({next(order) for _ in range(n)})
        index = torch.tensor([experts], device=dev)  # [1, n]: one token routed to n experts
        weight = torch.full((1, len(experts)), 1.0 / len(experts), device=dev)
        sync()
        t0 = time.perf_counter()
        index_h, x_h, w_h = cpu.stage(x, index, weight)
        part = cpu.submit_partial(layer, x_h, index_h, w_h, experts, dev)
        for _ in range(launches):  # the decode thread's own launches meanwhile (it holds the GIL while it does)
            busy.add_(1.0)
        part.add_to(zero)
        sync()
        return time.perf_counter() - t0

    once(1), once(batch)  # warm: extension load, thread start, first touch of the code paths
    one = statistics.median(once(1) for _ in range(repeats))
    many = statistics.median(once(batch) for _ in range(repeats))
    for k, v in before.items():  # the probe's calls are not the model's
        setattr(cpu, k, v)
    per = max((many - one) / (batch - 1), many / (2 * batch))  # a noisy pair must not make the host look free
    return max(one - per, 0.0), per


def measure_gpu_fused(cpu: CpuExperts, device: torch.device, dim: int, dtype: torch.dtype, block, *,
                      kernel: bool, misses: int = REFERENCE_MISSES, repeats: int = 5) -> float:
    """Median seconds of the slot path's compute of one token routed to ``misses`` experts on
    ``device``: :func:`~shardsmith.runtime.layers.experts.fused_bank` over a pool of them with
    ``kernel``, else the expanded pairs (the kernel's PyTorch reference, the runtime's pair path);
    0.0 off CUDA."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return 0.0
    bank = cpu.host.layers[cpu.layers[0]]
    m = min(misses, bank["gate_up"].shape[0])
    pool = {name: a[:m].to(dev) for name, a in bank.items()}
    x = torch.randn(1, dim, device=dev).to(dtype)
    ids = torch.arange(m, device=dev)[None]  # [1, m]
    weight = torch.full((1, m), 1.0 / m, device=dev)
    backend = "triton" if kernel else "reference"
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fused_experts(x, ids, weight, pool["gate_up"], pool["down"], pool.get("gate_up_scale"),
                      pool.get("down_scale"), limit=cpu.math.limit, block=block, backend=backend)
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def hybrid_split(t_copy: float, t_host: float, *, round_trip_s: float = 0.0, fused_s: float = 0.0,
                 misses: int = REFERENCE_MISSES) -> tuple[int, float]:
    """The best number of ``misses`` to send to the host and the share of the ``gpu`` layer time it saves.

    Layer time with ``k`` on the host: ``max((m - k) * t_copy + fused_s, round_trip_s + k * t_host)``
    for ``k >= 1`` against ``m * t_copy + fused_s`` for ``gpu`` (module docstring: the two sides of
    a split step overlap). Returns ``(k, gain)``, with ``k = 0`` and ``gain = 0.0`` when no split
    beats copying; all times in seconds.

    Raises:
        ValueError: ``misses`` < 1 or a negative time.
    """
    if misses < 1 or min(t_copy, t_host, round_trip_s, fused_s) < 0:
        raise ValueError(f"hybrid_split needs misses >= 1 and times >= 0, got misses={misses}, t_copy={t_copy}, "
                         f"t_host={t_host}, round_trip_s={round_trip_s}, fused_s={fused_s}")
    if t_copy == float("inf"):
        return misses, 1.0
    base = misses * t_copy + fused_s
    best_k, best = 0, base
    for k in range(1, misses + 1):
        t = max((misses - k) * t_copy + fused_s, round_trip_s + k * t_host)
        if t < best:
            best_k, best = k, t
    return best_k, (1.0 - best / base) if base > 0 else 0.0


def decide(requested: str, *, cuda: bool, h2d_gb_per_s: float, slot_bytes: int, cpu_s_per_expert: float,
           hybrid_fraction: float | None = None, round_trip_s: float = 0.0, fused_s: float = 0.0,
           misses: int = REFERENCE_MISSES, graphed: bool = True) -> tuple[str, float, str]:
    """``(backend, hybrid_fraction, reason)`` for ``requested`` in ``auto|gpu|cpu|hybrid`` (see :func:`hybrid_split`).

    ``graphed``: whether decode steps run as CUDA graphs. ``auto`` picks ``hybrid`` only then: eager
    split steps measured slower than eager ``gpu`` at rates where graphed ones were 1.27x faster
    (one H200, 25 GB/s link: 54.7 vs 64.1 tok/s eager, 160.8 vs 126.3 graphed; benchmarks/RESULTS.md,
    h200x1i), as the eager step's launches occupy the thread that hands the host its work."""
    t_copy = slot_bytes / (h2d_gb_per_s * 1e9) if h2d_gb_per_s > 0 else float("inf")
    t_cpu = cpu_s_per_expert
    k, gain = hybrid_split(t_copy, t_cpu, round_trip_s=round_trip_s, fused_s=fused_s, misses=misses)
    costs = (f"copy {t_copy * 1e3:.3f} ms/expert vs host {t_cpu * 1e3:.3f} ms/expert + {round_trip_s * 1e3:.3f} ms "
             f"per layer, GPU slot compute {fused_s * 1e3:.3f} ms per layer")
    if requested == "auto":
        if not cuda:
            return "cpu", 1.0, "no CUDA device"
        if k and gain >= HYBRID_MIN_GAIN:
            if not graphed:
                return "gpu", 0.0, (f"{k} of {misses} misses on the host would save {gain:.0%} of a graphed layer, "
                                    f"but steps run eagerly (--enforce-eager), where a split step is slower ({costs})")
            return "hybrid", k / misses, (f"{k} of {misses} misses on the host save {gain:.0%} of the layer time "
                                          f"({costs})")
        return "gpu", 0.0, (f"a hybrid split saves {max(gain, 0.0):.0%} of the layer time at {misses} misses, "
                            f"under {HYBRID_MIN_GAIN:.0%} ({costs})")
    if requested == "hybrid":
        f = (k / misses if k else 0.0) if hybrid_fraction is None else hybrid_fraction
        return "hybrid", f, f"as requested; {f:.2f} of misses to the host ({costs})"
    return requested, (1.0 if requested == "cpu" else 0.0), f"as requested ({costs})"


def _slowest(values: list[float], device: torch.device) -> list[float]:
    """Each value's maximum over ranks (identity at world size 1), so every rank decides alike."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    dev = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def run_probe(host: HostBanks, cpu: CpuExperts, *, device: torch.device, dim: int, dtype: torch.dtype,
              slot_bytes: int, requested: str, hybrid_fraction: float | None, kernel: bool = False,
              misses: int = REFERENCE_MISSES, graphed: bool = True) -> ProbeResult:
    """Measure on every rank, reduce over ranks (slowest link, slowest host), then :func:`decide`.

    Collective when torch.distributed is initialised: every rank must call it.
    """
    dev = torch.device(device)
    bw = measure_h2d(host, dev)
    round_trip, per = measure_host_path(cpu, dev, dim, dtype)
    gpu_s = measure_gpu_fused(cpu, dev, dim, dtype, cpu.block, kernel=kernel, misses=misses)
    neg_bw, round_trip, per, gpu_s = _slowest([-bw, round_trip, per, gpu_s], dev)
    bw = -neg_bw
    backend, frac, reason = decide(requested, cuda=dev.type == "cuda", h2d_gb_per_s=bw, slot_bytes=slot_bytes,
                                   cpu_s_per_expert=per, hybrid_fraction=hybrid_fraction, round_trip_s=round_trip,
                                   fused_s=gpu_s, misses=misses, graphed=graphed)
    t_copy = slot_bytes / (bw * 1e9) if bw > 0 else float("inf")
    _, gain = hybrid_split(t_copy, per, round_trip_s=round_trip, fused_s=gpu_s, misses=misses)
    return ProbeResult(bw, host.pinned, per, slot_bytes, backend, frac, reason, cpu.path(), round_trip, gpu_s, gain)
