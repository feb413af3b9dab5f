"""Process start-up for rank processes: the process group, per-rank CPU threads, rank-0-only logs.

Re-exported by :mod:`shardsmith.runtime.layers.parallel`. Backends: gloo on CPU, NCCL on CUDA. Failure
detection: gloo notices a dead peer at once (its TCP connection closes); NCCL only when a
collective exceeds the group's timeout.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def init_distributed(rank: int, world_size: int, *, master_addr: str = "127.0.0.1", master_port: int = 29500,
                     device: str = "cpu", timeout_s: float = 600.0) -> None:
    """Initialise the default process group: gloo on CPU, NCCL on CUDA (``cuda:{LOCAL_RANK}``).

    A no-op at world_size 1. ``timeout_s`` bounds every collective of the default group: on gloo a
    dead peer is noticed at once (its TCP connection closes); on NCCL a dead peer is noticed only
    when a collective times out, so keep it short enough to fail fast and long enough for a prefill.

    Args:
        rank, world_size: this process and the total; master_addr/master_port: the one rendezvous.
        device: ``cpu`` or ``cuda``.
    """
    if world_size == 1 or dist.is_initialized():
        return
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


def clamp_threads(local_world_size: int | None = None) -> int:
    """Give each rank on this host ``max(1, cores // local_world_size)`` CPU threads.

    Sets ``torch.set_num_threads`` and ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` (inherited by child
    processes; a launcher should set them before spawning, as OpenMP reads them at start-up).
    Oversubscribed ranks are a known cause of 20x slower loads and decode.

    Returns:
        the thread count chosen.
    """
    ws = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", ws))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = max(1, cores // max(1, local))
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)
    return n


class RankZeroFilter(logging.Filter):
    """Logging filter passing records only on rank 0 (install on the ``shardsmith`` logger)."""

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: D102
        return _rank() == 0


def install_rank_zero_logging(logger: logging.Logger | None = None) -> None:
    """Attach :class:`RankZeroFilter` to ``logger`` (default: ``shardsmith``) once."""
    logger = logger or logging.getLogger("shardsmith")
    if not any(isinstance(f, RankZeroFilter) for f in logger.filters):
        logger.addFilter(RankZeroFilter())
