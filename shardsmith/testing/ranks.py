"""Run a function on ``world_size`` real processes (``spawn``) that meet over torch.distributed.

Used by the tests and benchmarks that need real ranks (gloo on CPU, NCCL on GPUs) without the
serving launcher. ``target(rank, world_size, port, *args, queue)`` runs in each process; rank 0
puts one ``(status, payload)`` tuple on ``queue``: ``("ok", result)`` or ``("error", traceback)``.
:func:`run_gloo` is the common case: ``fn(*args, rank, world_size)`` after ``init_distributed`` on
every rank, rank 0's return value reported.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

from shardsmith.runtime.serve.launch import free_port


def run_ranks(target: Callable[..., None], world_size: int, *args: Any, timeout: float = 300.0,
              join_timeout: float = 30.0) -> Any:
    """Start the ranks, wait for rank 0's report, then reap every process (killing stragglers).

    Returns:
        rank 0's payload.

    Raises:
        RuntimeError: rank 0 reported an error (its message is the payload).
        queue.Empty: no report within ``timeout`` seconds.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world_size, port, *args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        status, payload = queue.get(timeout=timeout)
    finally:
        for p in procs:
            p.join(timeout=join_timeout)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise RuntimeError(payload)
    return payload


def run_gloo(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0) -> Any:
    """:func:`run_ranks` of ``fn(*args, rank, world_size)`` on ranks that first join the process group
    (:func:`~shardsmith.runtime.engine.dist.init_distributed`: gloo on CPU); rank 0's return value.

    ``fn`` must be importable by name (a module-level function), as ``spawn`` pickles it.

    Raises:
        RuntimeError: a rank's ``fn`` raised on rank 0 (its traceback is the message).
        queue.Empty: no report within ``timeout`` seconds.
    """
    return run_ranks(_gloo_entry, world_size, fn, args, timeout=timeout)


def _gloo_entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue) -> None:
    try:
        from shardsmith.runtime.engine.dist import init_distributed

        init_distributed(rank, world_size, master_port=port)
        out = fn(*args, rank, world_size)
        if rank == 0:
            queue.put(("ok", out))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise
