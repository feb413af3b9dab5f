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


def clamp_threads(local_world_size: int | None = None, local_rank: int | None = None) -> int:
    """Give each rank on this host ``max(1, cores // local_world_size)`` CPU threads; with
    ``local_rank``, also pin the process to that many CPUs of its own (:func:`pin_cores`).

    Sets ``torch.set_num_threads`` and ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` (inherited by child
    processes; a launcher should set them before spawning, as OpenMP reads them at start-up).
    Oversubscribed ranks are a known cause of 20x slower loads and decode. Once pinned, later calls
    keep the pinned share's size.

    Returns:
        the thread count chosen.

    Raises:
        UsageError: from :func:`pin_cores`.
    """
    global _PINNED
    ws = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", ws))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = max(1, cores // max(1, local))
    if _PINNED is not None:
        n = len(_PINNED)
    elif local_rank is not None:
        share = pin_cores(local_rank, local)
        if share is not None:
            _PINNED, n = share, len(share)
            logging.getLogger("shardsmith.runtime").info(
                "rank %d of %d on this host: pinned to CPUs %s (%d thread%s)", local_rank, local, _ranges(share), n,
                "" if n == 1 else "s")
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)
    return n


_PINNED: list[int] | None = None  # this process's CPUs once clamp_threads pinned it


def _ranges(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5`` (the cpu-list format)."""
    out, start = [], None
    for i, c in enumerate(cpus):
        start = c if start is None else start
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ",".join(out)


_SYS_CPU, _SYS_NODE = "/sys/devices/system/cpu", "/sys/devices/system/node"


def _cpulist(text: str) -> list[int]:
    """Linux's cpu-list format (``0-3,8,10-11``) as a list of ids."""
    out: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except OSError:
        return None


def host_topology(cpus: list[int]) -> tuple[dict[int, int], dict[int, int]]:
    """NUMA node and physical core of each CPU id in ``cpus``, from sysfs (``node*/cpulist``,
    ``cpu*/topology/core_cpus_list``; node 0 and the CPU itself where sysfs does not say)."""
    node_of = {c: 0 for c in cpus}
    for entry in sorted(os.listdir(_SYS_NODE)) if os.path.isdir(_SYS_NODE) else []:
        if entry.startswith("node") and entry[4:].isdigit():
            for c in _cpulist(_read(f"{_SYS_NODE}/{entry}/cpulist") or ""):
                if c in node_of:
                    node_of[c] = int(entry[4:])
    core_of = {}
    for c in cpus:
        siblings = _read(f"{_SYS_CPU}/cpu{c}/topology/core_cpus_list") or \
            _read(f"{_SYS_CPU}/cpu{c}/topology/thread_siblings_list") or str(c)
        core_of[c] = min(_cpulist(siblings) or [c])
    return node_of, core_of


def core_share(cpus: list[int], local_rank: int, local_world_size: int, node_of: dict[int, int],
               core_of: dict[int, int]) -> list[int]:
    """This rank's CPUs: ``len(cpus) // local_world_size`` of them, whole physical cores where the
    count allows, the ranks' shares disjoint and each as few NUMA nodes as the split allows.

    ``cpus`` are ordered by (node, physical core, id) and cut into ``local_world_size`` consecutive
    runs, so the siblings of a core and the cores of a node stay together (with 2 ranks on a 2-node
    host, a node each; with 4, half a node each).

    Raises:
        ValueError: ``local_rank`` is not in ``0 .. local_world_size - 1``, or fewer CPUs than ranks.
    """
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local rank {local_rank} is not in 0 .. {local_world_size - 1}")
    if len(cpus) < local_world_size:
        raise ValueError(f"{len(cpus)} CPUs for {local_world_size} ranks on this host")
    ordered = sorted(cpus, key=lambda c: (node_of[c], core_of[c], c))
    n = len(cpus) // local_world_size
    return ordered[local_rank * n:(local_rank + 1) * n]


def pin_setting() -> bool:
    """Whether ranks pin their CPUs: ``SHARDSMITH_PIN_CORES`` (default 1; empty is the default).

    Raises:
        UsageError: the variable is neither 0 nor 1.
    """
    from shardsmith import settings

    return settings.current().pin_cores


def pin_cores(local_rank: int, local_world_size: int) -> list[int] | None:
    """Pin this rank's process to its share of the CPUs it may use (:func:`core_share`), so ranks
    on one host never contend for a core and a rank's threads (its intra-op pool, the host expert
    kernel's team) stay on one NUMA node where the split allows. Call before any thread pool
    starts: threads inherit the affinity when created. Off with ``SHARDSMITH_PIN_CORES=0`` (for a
    launcher that pins by itself: ``numactl``, ``taskset``, a scheduler's cgroup split), and a
    no-op for a single rank or where the OS has no affinity call.

    Returns:
        the CPUs pinned to, or None where nothing was pinned.

    Raises:
        UsageError: ``SHARDSMITH_PIN_CORES`` is neither 0 nor 1.
    """
    if not pin_setting() or local_world_size <= 1 or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < local_world_size:
        return None  # fewer CPUs than ranks: sharing is unavoidable, leave the OS to it
    share = core_share(cpus, local_rank, local_world_size, *host_topology(cpus))
    os.sched_setaffinity(0, share)
    return share


class RankZeroFilter(logging.Filter):
    """Logging filter passing records only on rank 0 (install on the ``shardsmith`` logger)."""

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: D102
        return _rank() == 0


def install_rank_zero_logging(logger: logging.Logger | None = None) -> None:
    """Attach :class:`RankZeroFilter` to ``logger`` (default: ``shardsmith``) once."""
    logger = logger or logging.getLogger("shardsmith")
    if not any(isinstance(f, RankZeroFilter) for f in logger.filters):
        logger.addFilter(RankZeroFilter())
