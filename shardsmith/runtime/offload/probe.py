"""Start-up probe: measured host-to-GPU bandwidth and CPU expert throughput, and the backend choice.

Costs per missed expert (one rank, decode, one token):

* GPU path: ``slot_bytes / h2d_bytes_per_s`` (the copy; the GPU matmul is negligible beside it);
* CPU path: ``cpu_s_per_expert`` (dequantize + three matvecs on the host, measured).

In ``hybrid`` the two paths run in parallel, so the share ``f`` of misses sent to the host that
balances them is ``f = t_copy / (t_copy + t_cpu)``, and n misses then take
``n * t_copy * t_cpu / (t_copy + t_cpu)`` instead of ``n * t_copy``: a gain whenever the host
computes at all, but a hybrid step also pays a host round trip (ids and activations out, partial
sums back). ``auto`` therefore picks ``hybrid`` only where the balanced split saves at least
:data:`HYBRID_MIN_GAIN` of the miss time (``t_cpu <= 4 * t_copy``), else ``gpu`` (with a GPU),
``cpu`` without one: never a backend the measurements say is slower.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from . import link_cap
from .cpu_backend import CpuExperts
from .host_bank import HostBanks


HYBRID_MIN_GAIN = 0.2  # share of the copy-only miss time a hybrid split must save for ``auto`` to pick it


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What the probe measured and chose.

    Attributes:
        h2d_gb_per_s: host-to-device copy bandwidth from the (pinned, if so) banks, GB/s (1e9 bytes);
            0 without CUDA. pinned: whether the banks are page-locked.
        cpu_s_per_expert: seconds for one expert, one token, on the host.
        slot_bytes: bytes per expert on this rank. backend: the backend chosen; hybrid_fraction:
        share of misses sent to the host; reason: one line for the log; cpu_isa: how the host
        computes experts (:meth:`~.cpu_backend.CpuExperts.path`: ``kernel avx512``, ``matmul amx_bf16``).
    """

    h2d_gb_per_s: float
    pinned: bool
    cpu_s_per_expert: float
    slot_bytes: int
    backend: str
    hybrid_fraction: float
    reason: str
    cpu_isa: str

    def as_dict(self) -> dict:
        return asdict(self)


def measure_h2d(host: HostBanks, device: torch.device, *, min_bytes: int = 256 << 20, repeats: int = 3) -> float:
    """Best-of-``repeats`` GB/s copying ``min_bytes`` of the banks' own memory, expert by expert, to ``device``
    (at most the emulated rate when ``$SHARDSMITH_EMULATE_H2D_GBPS`` caps it: :mod:`.link_cap`)."""
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


def measure_cpu_expert(cpu: CpuExperts, dim: int, dtype: torch.dtype, *, repeats: int = 5) -> float:
    """Median seconds for one expert and one token on the host (layer 0, experts 0..repeats-1)."""
    x = torch.randn(1, dim).to(dtype)
    n_exp = next(iter(cpu.host.layers.values()))["gate_up"].shape[0]
    times = []
    for r in range(repeats + 1):
        e = r % n_exp
        index, weight = torch.tensor([[e]]), torch.ones(1, 1)
        t0 = time.perf_counter()
        cpu.compute(0, x, index, weight, [e])
        times.append(time.perf_counter() - t0)
    cpu.experts_computed -= repeats + 1
    return sorted(times[1:])[len(times[1:]) // 2]  # first call warms up


def decide(requested: str, *, cuda: bool, h2d_gb_per_s: float, slot_bytes: int, cpu_s_per_expert: float,
           hybrid_fraction: float | None = None) -> tuple[str, float, str]:
    """``(backend, hybrid_fraction, reason)`` for ``requested`` in ``auto|gpu|cpu|hybrid``."""
    t_copy = slot_bytes / (h2d_gb_per_s * 1e9) if h2d_gb_per_s > 0 else float("inf")
    t_cpu = cpu_s_per_expert
    balance = t_copy / (t_copy + t_cpu) if t_copy != float("inf") else 1.0
    costs = f"copy {t_copy * 1e3:.3f} ms/expert vs host {t_cpu * 1e3:.3f} ms/expert"
    if requested == "auto":
        if not cuda:
            return "cpu", 1.0, "no CUDA device"
        saved = t_copy / (t_copy + t_cpu) if t_copy != float("inf") else 1.0  # 1 - t_cpu / (t_copy + t_cpu)
        if saved >= HYBRID_MIN_GAIN:
            return "hybrid", balance, f"host and link together save {saved:.0%} of the miss time ({costs})"
        return "gpu", 0.0, f"copying alone is within {HYBRID_MIN_GAIN:.0%} of a hybrid split ({costs})"
    if requested == "hybrid":
        f = balance if hybrid_fraction is None else hybrid_fraction
        return "hybrid", f, f"as requested; {f:.2f} of misses to the host ({costs})"
    return requested, (1.0 if requested == "cpu" else 0.0), f"as requested ({costs})"


def run_probe(host: HostBanks, cpu: CpuExperts, *, device: torch.device, dim: int, dtype: torch.dtype,
              slot_bytes: int, requested: str, hybrid_fraction: float | None) -> ProbeResult:
    """Measure, then :func:`decide`."""
    dev = torch.device(device)
    bw = measure_h2d(host, dev)
    cpu_s = measure_cpu_expert(cpu, dim, dtype)
    backend, frac, reason = decide(requested, cuda=dev.type == "cuda", h2d_gb_per_s=bw, slot_bytes=slot_bytes,
                                   cpu_s_per_expert=cpu_s, hybrid_fraction=hybrid_fraction)
    return ProbeResult(bw, host.pinned, cpu_s, slot_bytes, backend, frac, reason, cpu.path())
