"""Emulation of a slower host-to-GPU link, for benchmarks only: ``SHARDSMITH_TUNING=emulate_h2d_gbps=GBPS``.

The people ``hybrid`` is for copy experts over PCIe Gen4 (~25 GB/s) to 16-48 GB cards; the GPU
host has a Gen5 link (~55 GB/s pinned). With the variable set to a rate below the real one, every
batch of expert copies on the cache's copy stream (and the probe's measurement copies) is followed,
on the same stream, by a GPU spin of ``bytes / cap - bytes / real`` seconds, so the stream is busy
for as long as the slower link would keep it and everything that waits on the copies waits that
long; the measured and achieved copy rates then read as the capped one. What it does not model:
the real bytes land earlier (nothing can read them before the stream's event anyway), and the
slower link's own latency per copy. Unset (the default), nothing changes and nothing is measured.

``real`` is measured once per device (64 MiB from pinned memory, best of 3) and the spin rate of
``torch.cuda._sleep`` once (cycles per second, by CUDA events).
"""

from __future__ import annotations

import functools

import torch

from shardsmith import settings



def cap_gb_per_s() -> float | None:
    """The emulated link rate in GB/s (1e9 bytes), or None when ``SHARDSMITH_TUNING`` has no ``emulate_h2d_gbps`` item.

    Raises:
        UsageError: a value that is not a positive finite number (:mod:`shardsmith.settings`).
    """
    return settings.current().emulate_h2d_gbps


@functools.cache
def _calibration(index: int) -> tuple[float, float]:
    """``(real pinned H2D bytes/s, GPU spin cycles/s)`` of CUDA device ``index``."""
    dev = torch.device("cuda", index)
    src = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device=dev)
    stream = torch.cuda.Stream(dev)
    rate, hz = 0.0, 0.0
    with torch.cuda.stream(stream):
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            dst.copy_(src, non_blocking=True)
            b.record(stream)
            b.synchronize()
            rate = max(rate, src.numel() / (a.elapsed_time(b) / 1e3))
        for cycles in (1 << 20, 1 << 24):  # the first warms up
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            torch.cuda._sleep(cycles)
            b.record(stream)
            b.synchronize()
            hz = cycles / (a.elapsed_time(b) / 1e3)
    return rate, hz


def pad(nbytes: int, device: torch.device) -> float:
    """After ``nbytes`` were queued for copying on the current stream: spin that stream for the
    extra time the capped link would take. Returns the seconds added (0 when no cap is set, on a
    CPU device, or when the real link is no faster than the cap). Not for use inside graph capture."""
    cap = cap_gb_per_s()
    dev = torch.device(device)
    if cap is None or dev.type != "cuda" or nbytes <= 0:
        return 0.0
    real, hz = _calibration(dev.index if dev.index is not None else torch.cuda.current_device())
    extra = nbytes / (cap * 1e9) - nbytes / real
    if extra <= 0:
        return 0.0
    torch.cuda._sleep(int(extra * hz))
    return extra
